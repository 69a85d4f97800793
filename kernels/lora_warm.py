"""Which batch sizes compile LoRA kernels of their own: the ``triton`` LoRA backend's warm-up runs one batch of each
at engine start, so that no request pays a compile (plugins/lora_backends/triton.py, ``warm_up``).

Triton compiles a kernel once per distinct set of constexprs, launch options and specializations of its other
arguments (an integer is specialized as 1, a multiple of 16, or neither; ``do_not_specialize`` arguments are not). The
LoRA kernels take the number of tokens unspecialized, but their forms, blocks and split-K slices are picked by it,
and the float32 partial sums' slice stride (``tokens * rows``) is an argument Triton specializes. A batch size's
*variant* (``kernels/lora.py``'s ``add_delta_variant``, the dense form apart) is what its launches depend on besides
that stride: each value is taken by one run of consecutive batch sizes, so the runs are found by bisection, and
within a run the stride's specialization repeats every 16 sizes at most.

Imported only on a CUDA device (or under ``TRITON_INTERPRET=1`` in tests), like the kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple


class BatchVariant(NamedTuple):
    """What a batch size's launches depend on: ``launches`` (the forms, blocks, constexprs and options), ``stride``
    (an integer argument Triton specializes that grows with the size, or None) and ``run``, equal to ``launches``
    but taken by one run of consecutive sizes only (a form that resumes after another form's sizes marked apart)."""

    run: Hashable
    launches: Hashable
    stride: int | None


def int_specialization(value: int) -> str:
    """How Triton specializes an integer argument: ``"1"``, ``"D"`` (a multiple of 16) or ``""``."""
    if value == 1:
        return "1"
    return "D" if value % 16 == 0 else ""


def variant_token_counts(variant: Callable[[int], BatchVariant], max_tokens: int) -> list[int]:
    """One batch size (the smallest) for each distinct pair of ``launches`` and the specialization of ``stride`` over
    sizes 1..``max_tokens``. Each ``run`` value must be taken by one run of consecutive sizes (true where each part of
    it is monotone in the size while the parts before it are fixed), and ``stride`` must be the size times a constant
    within a run (its specialization then repeats within 16 sizes)."""
    counts: list[int] = []
    seen: set[tuple[Hashable, str | None]] = set()
    first = 1
    while first <= max_tokens:
        run = variant(first).run
        last, beyond = first, max_tokens + 1  # variant(last).run == run; the run ends before ``beyond``
        while beyond - last > 1:
            middle = (last + beyond) // 2
            if variant(middle).run == run:
                last = middle
            else:
                beyond = middle
        for size in range(first, min(last, first + 15) + 1):
            launches, stride = variant(size)[1:]
            key = (launches, None if stride is None else int_specialization(stride))
            if key not in seen:
                seen.add(key)
                counts.append(size)
        first = last + 1
    return counts
