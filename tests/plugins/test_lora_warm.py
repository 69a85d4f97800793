"""The `triton` LoRA backend's warm-up (``TritonLoRABackend.warm_up``): one batch of each size that compiles kernels of
its own, so that no batch of up to the engine's largest step compiles one after start.

Each kernel launch is recorded as Triton keys its compiled kernels: the kernel, its constexprs and launch options, each
tensor's dtype and 16-byte alignment, and each integer argument as 1, a multiple of 16 or neither (unless the kernel
does not specialize it). Every batch size from 1 to 1100 tokens (gather, sorted before and after the dense window,
dense, the sorted form's blocks of 64 tokens past 1024; with the sorted form off, the slot-grouped and segmented
forms), with random adapters, must launch only what the warm-up launched. Those checks record the launches without
running them; one warm-up under the interpreter runs them, leaving the weights as they were.

Triton decides interpret-or-compile when it is first imported, so the checks run in a fresh subprocess (this file as
a script with TRITON_INTERPRET=1); the tests assert on its results.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import traceback

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

RESULT_MARKER = "LORA_WARM_JSON="
MAX_TOKENS = 1100
# projections, in, widths (down_proj's in: the gather shrink splits it over programs for a few tokens)
LAYERS = {"qkv": (3, 32, (32, 16, 16)), "o": (1, 32, (32,)), "gate_up": (2, 48, (40, 40)), "down": (1, 1024, (32,))}


def triton_key(kernel, signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple:
    """What Triton's cache of compiled kernels keys a launch of ``kernel`` (of ``signature``) by (see the module
    docstring)."""
    bound = signature.bind(*args, **{k: v for k, v in kwargs.items() if k in signature.parameters})
    bound.apply_defaults()
    not_specialized = set(kernel.kwargs.get("do_not_specialize") or ())
    parts = []
    for name, value in bound.arguments.items():
        if "constexpr" in str(signature.parameters[name].annotation):
            parts.append((name, value))
        elif isinstance(value, torch.Tensor):
            parts.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool) and name not in not_specialized:
            parts.append((name, "1" if value == 1 else "D" if value % 16 == 0 else ""))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in signature.parameters))
    return kernel.fn.__name__, tuple(parts), options


class LaunchRecorder:
    """Records the key of every launch of the LoRA kernels; ``run`` False skips running them."""

    def __init__(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        from treadle.kernels import lora, lora_dense, lora_sorted, lora_tiles

        self.keys: list[tuple] = []
        self.run = True
        for module in (lora, lora_dense, lora_sorted, lora_tiles):
            for value in vars(module).values():
                if isinstance(value, InterpretedFunction) and value.fn.__module__ == module.__name__:
                    self._wrap(value)

    def _wrap(self, kernel) -> None:
        launch = kernel.__dict__.setdefault("unrecorded_run", kernel.run)  # not another recorder's
        signature = inspect.signature(kernel.fn)

        def run(*args, grid, warmup, **kwargs):
            self.keys.append(triton_key(kernel, signature, args, kwargs))
            if self.run:
                return launch(*args, grid=grid, warmup=warmup, **kwargs)
            return None

        kernel.run = run


def make_layers(max_rank: int, slots: int, dtype: torch.dtype) -> dict:
    from treadle.core.lora.backend import StackedLoRA

    gen = torch.Generator().manual_seed(max_rank)
    layers = {}
    for name, (projections, in_features, widths) in LAYERS.items():
        bounds = [sum(widths[:p]) for p in range(len(widths) + 1)]
        layers[name] = StackedLoRA(
            a=torch.randn(slots, projections * max_rank, in_features, generator=gen).to(dtype),
            b=torch.randn(slots, bounds[-1], max_rank, generator=gen).to(dtype),
            scalings=torch.rand(projections, slots, generator=gen),
            ranks=torch.randint(1, max_rank + 1, (projections, slots), generator=gen, dtype=torch.int32),
            segments=tuple(zip(bounds[:-1], bounds[1:]))).with_dense_b()
    return layers


def coverage(max_rank: int, choice_text: str, warm_tokens: int = MAX_TOKENS, first: int = 1,
             slots: int = 4) -> dict:
    """The warm-up's launches (recorded, not run) against every batch size's from ``first`` to MAX_TOKENS."""
    from treadle.kernels.lora_choice import LoRAKernelChoice, choice_fields
    from treadle.plugins.lora_backends.triton import TritonLoRABackend

    backend = TritonLoRABackend(slots, max_rank, "cpu", torch.float32)
    backend.kernel_choice = LoRAKernelChoice(**choice_fields(choice_text))
    backend.compiles = True
    layers = make_layers(max_rank, slots, torch.float32)
    recorder = LaunchRecorder()
    recorder.run = False
    batches = backend.warm_up(list(layers.values()) * 2, warm_tokens)  # each shape once, however many layers
    warmed = list(recorder.keys)
    sizes = {name: backend.warm_up_sizes(weights, warm_tokens) for name, weights in layers.items()}
    gen = torch.Generator().manual_seed(7)
    missed, forms = [], set()
    x_flat, out_flat = torch.zeros(MAX_TOKENS * 1024), torch.zeros(MAX_TOKENS * 80)  # room for the widest in, out of LAYERS
    for num_tokens in range(first, MAX_TOKENS + 1):
        ids = torch.randint(-1, slots, (num_tokens,), generator=gen)
        order = torch.argsort(ids, stable=True) if num_tokens > backend.adapter_order_above else None
        for name, weights in layers.items():
            recorder.keys.clear()
            in_features, width = weights.a.shape[2], weights.b.shape[1]
            backend.add_delta(x_flat[:num_tokens * in_features].view(num_tokens, in_features), weights, ids,
                              out_flat[:num_tokens * width].view(num_tokens, width), order=order)
            forms.update(key[0] for key in recorder.keys)
            missed += [[name, num_tokens, key[0]] for key in recorder.keys if key not in warmed]
    return {"batches": batches, "sizes": sizes, "warmed_forms": sorted({key[0] for key in warmed}),
            "forms": sorted(forms), "missed": missed[:20], "missed_count": len(missed)}


def warm_up_runs() -> dict:
    """A real warm-up under the interpreter (thresholds lowered so every form runs at a few tokens): its kernels run,
    the layers' weights are left bit for bit."""
    from treadle.kernels.lora_choice import LoRAKernelChoice
    from treadle.plugins.lora_backends.triton import TritonLoRABackend

    backend = TritonLoRABackend(4, 8, "cpu", torch.bfloat16)
    backend.kernel_choice = LoRAKernelChoice(sort_above=4, dense_above=8, dense_max_tokens=12)
    layers = make_layers(8, 4, torch.bfloat16)
    before = {name: [t.clone() for t in (w.a, w.b, w.scalings, w.ranks, w.dense_b)] for name, w in layers.items()}
    skipped = backend.warm_up(list(layers.values()), 20)  # off CUDA nothing compiles: skipped
    backend.compiles = True
    recorder = LaunchRecorder()
    batches = backend.warm_up(list(layers.values()), 20)
    unchanged = all(torch.equal(old, new) for name, w in layers.items()
                    for old, new in zip(before[name], (w.a, w.b, w.scalings, w.ranks, w.dense_b)))
    return {"skipped": skipped, "batches": batches, "forms": sorted({key[0] for key in recorder.keys}),
            "unchanged": unchanged}


def _run_all() -> dict:
    jobs = {"rank8": lambda: coverage(8, ""), "rank96": lambda: coverage(96, "", slots=2),
            "unsorted": lambda: coverage(16, "sort_above=1048576"),
            "short": lambda: coverage(8, "", warm_tokens=1000, first=1000), "runs": warm_up_runs}
    results = {}
    for name, job in jobs.items():
        try:
            results[name] = job()
        except Exception:  # reported per check, so one failure does not hide the others
            results[name] = {"traceback": traceback.format_exc()}
    return results


if __name__ == "__main__":
    print(RESULT_MARKER + json.dumps(_run_all()))
    sys.exit(0)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    from interpreted import interpreted_results

    return interpreted_results(__file__, RESULT_MARKER)


@pytest.mark.parametrize("name", ["rank8", "rank96", "unsorted"])
def test_every_batch_size_launches_only_warmed_kernels(name: str, results: dict[str, dict]) -> None:
    result = results[name]
    assert "traceback" not in result, result.get("traceback")
    assert result["missed_count"] == 0, f"launches the warm-up did not make: {result['missed']}"
    assert result["warmed_forms"] == result["forms"]
    assert result["batches"] == sum(len(sizes) for sizes in result["sizes"].values())  # each shape once
    # A few sizes a layer (each a new pair of shrink and expand launches; at most one of them may be warm already)
    assert max(len(sizes) for sizes in result["sizes"].values()) <= 10


def test_warm_up_reaches_every_form(results: dict[str, dict]) -> None:
    """Gather (split-K, whole rows, looped), sorted (blocks of 32 and 64 tokens), dense; ranks past one tensor-core
    tile expand segmented; with the sorted form off, the segmented shrink, slot-grouped and segmented expands."""
    default = {"_shrink_gather_kernel", "_expand_gather_kernel", "_shrink_sorted_kernel", "_expand_sorted_kernel",
               "_keep_own_slot"}
    assert set(results["rank8"]["warmed_forms"]) == default
    assert set(results["rank96"]["warmed_forms"]) == default - {"_expand_sorted_kernel"} | {"_expand_segmented_kernel"}
    assert set(results["unsorted"]["warmed_forms"]) == {
        "_shrink_gather_kernel", "_expand_gather_kernel", "_shrink_segmented_kernel", "_expand_grouped_kernel",
        "_expand_segmented_kernel", "_keep_own_slot"}
    sizes = results["rank8"]["sizes"]
    # o_proj's 8 stacked rows: the partial sums' stride 8n specializes apart for odd and even n
    assert sizes["o"] == [1, 2, 17, 18, 65, 66, 129, 1025, 1026]
    # gather (whole rows of in, looped past 16 tokens), sorted, dense, the sorted shrink's 64-token blocks
    assert sizes["gate_up"] == [1, 17, 65, 129, 1025]
    # in=1024: the gather shrink split-K at every gather size; the sorted shrink's slices of in: 8, then 4 past 512
    assert sizes["down"] == [1, 2, 65, 66, 129, 513, 514, 1025, 1026]


def test_warm_up_of_fewer_tokens_misses_larger_batches(results: dict[str, dict]) -> None:
    """The check above can fail: warmed up to 1000 tokens, the batches past 1024 launch kernels not warmed."""
    result = results["short"]
    assert "traceback" not in result, result.get("traceback")
    assert result["missed_count"] > 0 and all(tokens > 1024 for _, tokens, _ in result["missed"])


def test_warm_up_runs_and_changes_no_weight(results: dict[str, dict]) -> None:
    result = results["runs"]
    assert "traceback" not in result, result.get("traceback")
    assert result["skipped"] == 0  # ``compiles`` False (the interpreter): nothing run
    assert result["batches"] > 0 and result["unchanged"]
    assert {"_shrink_gather_kernel", "_shrink_sorted_kernel", "_keep_own_slot"} <= set(result["forms"])
