"""The tunables of kernels/lora.py's decode forms (``add_delta``'s two launches), as one frozen value: what the
``triton`` LoRA backend runs (:func:`choice_from_env`, when it is built) and what ``treadle bench lora --part
kernels --sweep`` varies.

At decode sizes the LoRA path is a chain of small kernels (two a linear layer, 256 a Llama-3.1-8B step): at bs=1
the 2.6 MB a layer's rank-16 adapters hold take under a microsecond to read, so each launch's hand-over (the
kernel before completing, this one's programs starting and loading their first weights) is what costs; at bs=32
over 32 adapters the same chain moves 2.7 GB. ``go_ahead`` shortens the hand-over (kernels/pdl.py): each gather
kernel lets the next one start right after its own wait, so the next kernel's programs are resident and loading
their weights while this one reads ``x`` (or ``h``) and stores, instead of only once every program of this one
has exited. The tiles and the split-K reach set how many programs a launch has and how much each loads.

Past ``sort_above`` tokens (large decode batches, mixed and prefill batches) ``add_delta`` runs the sorted form
instead: the tokens in slot order (one device-side sort a step), so a block of tokens holds one or a few adapters
whose ``a`` and ``b`` tiles it reads once and multiplies on tensor cores, where the gather kernels read them once
per token; ``sort_programs`` is how many programs its shrink aims for (it splits ``in`` to get them), and
``sort_columns`` how many output columns each expand program covers (it adds up the shrink's slices once for them).

Past ``dense_above`` tokens, where the layer's slots stack no more than ``dense_max_stack`` rank rows (``slots *
max_rank``), it runs the dense form (kernels/lora_dense.py): every slot's ``A`` in one cuBLAS GEMM a layer and
every slot's ``B`` in one a projection, each token's own slot kept by a mask. Its extra work is ``slots * max_rank *
(in + out)`` multiply-adds a token and layer whatever adapters the batch holds (at Llama-3.1-8B's widths 9.6% of
the base layers' at a stack of 256, 19% at 512), every slot's weights read once a step (1.3 GB at 256, 2.7 GB at
512) and 13 launches a layer, so it pays only where a batch has many tokens. ``dense_above`` = 128 is above the
decode sizes the gather kernels serve and below bs=256, where the unsorted forms measured 2.17x the base matmuls
and a roofline estimate of the dense form (its GEMMs at 650 TFLOP/s or 3 TB/s, 2.5 us a launch) gives 1.40x at 16
slots, 1.48x at 32; past ~1000 tokens the estimate is 1.15-1.26x, about what the segmented tiles measured on an
8192-token prefill (1.17x). ``treadle bench lora --part kernels --sweep`` times it against the other forms at
every size (``dense_above=1`` / ``dense_above=1048576``). Measured (2 x H200, 2026-11-28, 32 slots of rank 16 over 16
adapters, ``--sizes 64,256,1024,4096``): the dense form loses at 64 tokens (1.58x the base matmuls against 1.48x),
wins at 256 (1.44x against the sorted form's 1.60x) and loses again at 1024 (1.28x against 1.20x) and on a 4096-token
prefill (1.24x against 1.15x), where the sorted form's tensor-core tiles read each adapter once per block: so it runs
up to ``dense_max_tokens`` = 512 (a decode batch of every running request), the crossover interpolated at ~680.

``fuse_gemv`` (on by default): where the batch takes the gather form, the expand carries the layer's epilogue
(kernels/lora_fused.py) and, where the layer's matmul is the small-batch Triton kernel, the shrink runs in extra
programs of its launch: two launches a layer where the gather form alone runs three or four; beside a cuBLAS matmul
the shrink runs in its own launch (three a layer, the ``silu_mul`` and add + RMSNorm kernels gone).
``fuse_gemv=0`` is the unfused path, for A/B runs (``treadle bench lora --part gemv`` times both;
``--engine-kernels fuse_gemv=0``). ``fuse_max_tokens`` = 1 keeps the split to one-token steps: on 2 x H200
(2026-11-28, Llama-3.1-8B shapes, rank 16 on seven projections, the engine's own matmuls) it took a bs=1 step's linear
work from 1.189x the base to 1.080x (end to end 1.067x; 1.156x unsplit in an earlier call), but at bs=32 over 32
adapters it measured 1.344x against the unfused path's 1.318x (1.350x against 1.328x beside cuBLAS); sizes between
are not measured yet.

``shrink_loop_above`` (16): the gather shrink of batches of more tokens takes the looped form: blocks of
``shrink_loop_rows`` (4) stacked rank rows walk ``in`` in chunks of ``shrink_loop_k`` (2048) columns with
``shrink_loop_warps`` (4) warps, where the full-row form loads one ``shrink_tile`` of whole rows of ``in`` a program
(at bs=32, in=14336: one row, 16 warps, one program an SM) and then only reduces. Where partial sums may be returned
(``add_delta``), ``in`` is split into slices of whole chunks, as many as reach ``shrink_loop_programs`` (384) programs
and at most ``shrink_loop_chunks`` (2) chunks a program. ``shrink_loop_stages``: 0 (default) loads each chunk when
its turn comes; 1 loads the next one into registers before reducing this one; more, that many stages of Triton's
software pipeline through shared memory. Measured on an H200 (2026-11-28, every shrink launch alone at bs=32 over 32
adapters, Llama-3.1-8B's four projections): 14.7 us a layer against the full-row form's 18.1; end to end the bs=32
step 1.269x the base against 1.288x (docs/lora.md). The one-token and split-K forms stay as they are.

``expand_wide_above`` / ``expand_wide_tile`` / ``expand_max_warps`` (candidates): the same launches alone gave the
plain gather expand no one best block: 1024 columns and 8 warps took o's and down's (4096 columns, 128 programs at
bs=32) from 2.5 to 1.8-2.2 us and q/k/v's from 3.4 to 3.2, while gate/up's 28672 columns were fastest at 256 columns
and 4 warps (9.9 us against 10.2; 11.3 at 1024). ``expand_tile=16384,expand_max_warps=8,expand_wide_above=8192,
expand_wide_tile=4096`` gives each layer its best of those (~1.5 us a layer at bs=32); end to end it gained nothing (4 x
H200, 2026-11-28, 300 requests: bs=32 1.241x the base against the defaults' 1.236x, 1024-column blocks everywhere
1.253x), so they stay candidates.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAKernelChoice:
    """``go_ahead`` (1/0): the gather kernels give the next kernel the go-ahead (PDL) right after their wait, or
    only by exiting; ``shrink_tile`` / ``expand_tile``: elements of ``a`` / ``b`` a gather program loads at once;
    ``busy_programs``: a decode launch with fewer programs than this splits ``in`` over programs of ``split_k``
    columns each (the shrink) or narrows its column blocks to 64 (the expand); ``sort_above``: batches of more
    tokens take the sorted form (a large value keeps the gather / slot-grouped / segmented forms of unsorted
    tokens); ``sort_programs``: the programs the sorted shrink aims for; ``sort_columns``: output columns of one
    projection a sorted expand program covers (it reads its rows' partial sums once for all of them);
    ``dense_above``: batches of more tokens take the dense form (library GEMMs over every slot) where the slots'
    stack ``slots * max_rank`` is at most ``dense_max_stack`` (a larger stack never takes it, and its layers keep no
    dense copy of ``B``), up to ``dense_max_tokens`` tokens (larger batches, long prefill chunks, sort);
    ``fuse_gemv`` (1/0): the gather form split around the layer's matmul: the expand carries the layer's epilogue
    and the shrink runs in the small-batch Triton kernel's launch (kernels/lora_fused.py: two launches a layer) or,
    beside cuBLAS, in its own; or the unfused path; ``fuse_tile``: the largest gather-shrink tile (elements of ``a``
    a program loads at once) that runs in a matmul's launch: its registers are the launch's (bs=32's ``[1, 16384]``
    tiles of ``down_proj`` would spill a 4-warp matmul tile's), larger ones run in their own launch (the expand
    still carrying the epilogue); ``fuse_max_tokens``: batches of more tokens run unfused; ``shrink_loop_above``:
    gather shrinks of more tokens (and not split-K) take the looped form (module docstring),
    ``shrink_loop_rows`` stacked rank rows a program, ``shrink_loop_k`` columns of ``in`` a chunk,
    ``shrink_loop_programs`` the programs it aims for by splitting ``in`` where partial sums may be returned,
    ``shrink_loop_chunks`` the most chunks a program walks there, ``shrink_loop_stages`` its pipeline (0: none; 1: the
    next chunk in registers; more: Triton's pipeline of that many stages, through shared memory),
    ``shrink_loop_warps`` its launch's warps; ``expand_wide_above`` / ``expand_wide_tile`` (candidates, off by
    default): a layer of more output columns than that takes that gather-expand tile instead of ``expand_tile``;
    ``expand_max_warps``: at most that many warps a gather-expand program (16: the tile decides)."""

    go_ahead: int = 1
    shrink_tile: int = 8192
    expand_tile: int = 8192
    busy_programs: int = 128
    split_k: int = 512
    sort_above: int = 64
    sort_programs: int = 128
    sort_columns: int = 256
    dense_above: int = 128
    dense_max_stack: int = 512
    dense_max_tokens: int = 512
    fuse_gemv: int = 1
    fuse_tile: int = 8192
    fuse_max_tokens: int = 1
    shrink_loop_above: int = 16
    shrink_loop_rows: int = 4
    shrink_loop_k: int = 2048
    shrink_loop_programs: int = 384
    shrink_loop_chunks: int = 2
    shrink_loop_stages: int = 0
    shrink_loop_warps: int = 4
    expand_wide_above: int = 1 << 20
    expand_wide_tile: int = 8192
    expand_max_warps: int = 16

    def __post_init__(self) -> None:
        for name, least in (("shrink_tile", 16), ("expand_tile", 16), ("split_k", 16), ("shrink_loop_k", 16),
                            ("shrink_loop_rows", 1), ("shrink_loop_warps", 1), ("expand_wide_tile", 16),
                            ("expand_max_warps", 1)):
            value = getattr(self, name)
            if value < least or value & (value - 1):
                raise ValueError(f"LoRAKernelChoice.{name} must be a power of two >= {least} (a block of a Triton "
                                 f"kernel), not {value}")

    @property
    def name(self) -> str:
        changed = [f"{field.name}={getattr(self, field.name)}" for field in dataclasses.fields(self)
                   if getattr(self, field.name) != field.default]
        return ",".join(changed) or "default"


def choice_fields(text: str) -> dict[str, int]:
    """``go_ahead=0,shrink_tile=16384`` -> those :class:`LoRAKernelChoice` fields."""
    known = {field.name for field in dataclasses.fields(LoRAKernelChoice)}
    fields: dict[str, int] = {}
    for pair in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = (side.strip() for side in pair.partition("="))
        if key not in known or not value.isdigit() or int(value) <= 0 and key not in _MAY_BE_ZERO:
            raise ValueError(f"bad LoRA kernel choice {pair!r}: expected FIELD=N (N a positive integer; go_ahead "
                             f"and fuse_gemv 0 or 1; shrink_loop_stages 0 too), FIELD one of {', '.join(sorted(known))}")
        fields[key] = int(value)
    return fields


_FLAGS = ("go_ahead", "fuse_gemv")
_MAY_BE_ZERO = _FLAGS + ("shrink_loop_stages",)


def choice_from_env() -> LoRAKernelChoice:
    """The default choice with ``TREADLE_LORA_KERNELS``'s fields (the same FIELD=N,... text as ``treadle bench lora
    --sweep --choice``): what a triton backend built now runs, for A/B runs of the engine."""
    return LoRAKernelChoice(**choice_fields(os.environ.get("TREADLE_LORA_KERNELS", "")))


# The choice when this module was imported: what the two-call shrink/expand (and add_delta called without a choice)
# run.
DEFAULT = choice_from_env()
