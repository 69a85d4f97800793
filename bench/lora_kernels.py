"""The kernel half of ``treadle bench lora``: the LoRA deltas of all seven projections of Llama-3.1-8B's 32 layers
against the base projections' matmuls, each replayed from one CUDA graph (device time, no launch gaps).

Per case (tokens, adapters) four graphs run the 32 layers' linear work: the base matmuls alone (the fused
``qkv``, ``o``, ``gate_up`` and ``down`` weights, cuBLAS), the LoRA deltas alone as the engine adds them (one
``add_delta`` per fused layer: one shrink for its stacked projections, one expand into its output, 8 launches a
layer), both, and the deltas per projection (a shrink and an expand into each projection's column slice, 14
launches a layer: the form before the projections were stacked, for comparison). Every layer has its own weights
and its own stacked adapters, so a step reads them from memory as a decode step does, not from L2. The ratio
``(base + LoRA) / base`` is what the deltas add to the linear layers' time; the whole decode step (attention, norms,
sampling) is the end-to-end half's business. For the ``triton`` backend each case also times the dense form
(kernels/lora_dense.py: cuBLAS GEMMs over every slot) forced on and off, so one run shows where it wins.

:func:`run_kernel_sweep` (``--sweep``) times the ``triton`` backend's kernel tunables (kernels/lora_choice.py's
``LoRAKernelChoice``: the PDL go-ahead, gather tiles, split-K reach) against its default, per decode size, each as
``(base + LoRA) / base`` of the same run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from treadle.core.execution.batch_context import adapter_order
from treadle.core.lora.backend import StackedLoRA

# Llama-3.1-8B: (in, out) of each projection, and the fused weights the base model runs.
PROJECTIONS = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096),
               "gate_proj": (4096, 14336), "up_proj": (4096, 14336), "down_proj": (14336, 4096)}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up_proj": ("gate_proj", "up_proj"),
         "down_proj": ("down_proj",)}
NUM_LAYERS = 32


@dataclass
class KernelCase:
    """One measured configuration: ``tokens`` tokens, ``adapters`` distinct adapters spread over them: token ``t``
    has adapter ``t % adapters`` in a decode batch (requests given adapters round-robin), runs of consecutive
    tokens in a prefill (each request's tokens together)."""

    label: str
    tokens: int
    adapters: int
    prefill: bool = False


CASES = (KernelCase("bs=1 decode, one adapter", 1, 1), KernelCase("bs=32 decode, 32 adapters", 32, 32),
         KernelCase("bs=256 decode, 16 adapters", 256, 16), KernelCase("1024 decode tokens, 16 adapters", 1024, 16),
         KernelCase("4096-token prefill, 16 adapters", 4096, 16, prefill=True),
         KernelCase("8192-token prefill, 16 adapters", 8192, 16, prefill=True))
# The triton backend's add_delta with the dense form at every size, and never (the gather / sorted forms).
DENSE_FORMS = {"dense": {"dense_above": 0}, "no_dense": {"dense_above": 1 << 20}}


def run_kernel_cases(backend_name: str, rank: int, cases: tuple[KernelCase, ...] = CASES,
                     replays: int = 20, slots: int | None = None) -> list[dict[str, Any]]:
    """Each case's base, LoRA and combined device milliseconds per 32-layer step, and the ratio; for the triton
    backend also ``forms``: the LoRA and combined milliseconds with the dense form forced on and off."""
    from treadle.core.registry import build_registry
    from treadle.kernels.lora_choice import LoRAKernelChoice

    dtype, device = torch.bfloat16, torch.device("cuda")
    max_slots = slots or max(case.adapters for case in cases)
    backend = build_registry().get("lora_backends", backend_name)(max_slots, rank, device, dtype)
    layers = [_Layer(max_slots, rank, dtype, device, seed=i) for i in range(NUM_LAYERS)]
    results = []
    for case in cases:
        inputs = _Inputs(case, layers[0], dtype, device)
        base_s, lora_s, both_s, split_s = _case_seconds(layers, inputs, backend, replays)
        row = {"case": case.label, "tokens": case.tokens, "adapters": case.adapters, "slots": max_slots,
               "rank": rank, "backend": backend_name, "base_ms": 1e3 * base_s, "lora_ms": 1e3 * lora_s,
               "base_plus_lora_ms": 1e3 * both_s, "ratio": both_s / base_s, "lora_per_projection_ms": 1e3 * split_s}
        if hasattr(backend, "kernel_choice"):
            default, row["forms"] = backend.kernel_choice, {}
            for form, fields in DENSE_FORMS.items():
                backend.kernel_choice = LoRAKernelChoice(**fields)
                form_s, form_both_s = _lora_seconds(layers, inputs, backend, replays)
                row["forms"][form] = {"lora_ms": 1e3 * form_s, "ratio": form_both_s / base_s}
            backend.kernel_choice = default
        results.append(row)
        print(f"{case.label}: base {1e3 * base_s:.3f} ms, LoRA {1e3 * lora_s:.3f} ms, both {1e3 * both_s:.3f} ms, "
              f"LoRA per projection {1e3 * split_s:.3f} ms"
              + "".join(f", {form} {values['ratio']:.3f}x" for form, values in row.get("forms", {}).items()),
              flush=True)
        torch.cuda.empty_cache()
    return results


# ``--sweep``: decode sizes around the targets (bs=1, bs=32 over 32 adapters, the offline run's bs~256 over 16),
# each timed with every kernel choice, against the base matmuls of the same run. The first choice is the default;
# go_ahead=0 is the hand-over before it (each kernel's programs start once every program of the one before exited).
SWEEP_CASES = (KernelCase("bs=1, 1 adapter", 1, 1), KernelCase("bs=8, 8 adapters", 8, 8),
               KernelCase("bs=32, 32 adapters", 32, 32), KernelCase("bs=64, 16 adapters", 64, 16),
               KernelCase("bs=128, 16 adapters", 128, 16), KernelCase("bs=256, 16 adapters", 256, 16),
               KernelCase("bs=512, 16 adapters", 512, 16), KernelCase("1024 tokens, 16 adapters", 1024, 16),
               KernelCase("4096-token prefill, 16", 4096, 16, prefill=True))
SWEEP_CHOICES = ({}, {"go_ahead": 0},
                 {"sort_above": 1 << 20},  # no sorted form: gather / slot-grouped / segmented over unsorted tokens
                 {"sort_above": 32},  # the sorted form from 33 tokens (bs=64 over 16 adapters: 4 tokens each)
                 {"sort_programs": 64}, {"sort_programs": 256},  # the sorted shrink over half / twice the slices
                 {"sort_columns": 128}, {"sort_columns": 512},  # sorted expand programs of 1 / 4 column blocks
                 {"shrink_tile": 16384, "expand_tile": 16384},  # wider loads, fewer programs
                 {"shrink_tile": 4096, "expand_tile": 4096},  # more programs in flight
                 {"busy_programs": 1024},  # split-K shrinks and narrow expand blocks up to bs~32
                 {"busy_programs": 1024, "split_k": 1024},
                 # the dense form (cuBLAS over every slot) past 1 token, i.e. at every size but bs=1, and never
                 {"dense_above": 1}, {"dense_above": 1 << 20},
                 # the gather shrink's looped form past 16 tokens (the default: 4 rows a program, chunks of 2048,
                 # towards 384 programs of at most 2 chunks, 4 warps, no lookahead) against the full-row form, and
                 # its neighbours: fewer / more programs and chunks, 8 warps, the next chunk ahead in registers (1)
                 # or Triton's pipeline (3), round 1's 8-16 rows over chunks of 512-1024
                 {"shrink_loop_above": 1 << 20},
                 {"shrink_loop_programs": 256}, {"shrink_loop_programs": 512}, {"shrink_loop_chunks": 1},
                 {"shrink_loop_chunks": 4}, {"shrink_loop_warps": 8}, {"shrink_loop_stages": 1},
                 {"shrink_loop_stages": 3}, {"shrink_loop_rows": 8, "shrink_loop_k": 1024},
                 {"shrink_loop_rows": 8, "shrink_loop_k": 512, "shrink_loop_programs": 768,
                  "shrink_loop_chunks": 1 << 20},
                 {"shrink_loop_rows": 16, "shrink_loop_k": 512, "shrink_loop_programs": 256,
                  "shrink_loop_chunks": 1 << 20, "shrink_loop_stages": 1, "shrink_loop_warps": 8},
                 # the gather expand: 1024-column blocks of 8 warps for layers up to 8192 columns, 256 columns (4
                 # warps) for wider ones (gate/up), and each half of that alone
                 {"expand_tile": 16384, "expand_max_warps": 8, "expand_wide_above": 8192, "expand_wide_tile": 4096},
                 {"expand_tile": 16384, "expand_max_warps": 8}, {"expand_wide_above": 8192, "expand_wide_tile": 4096})


def run_kernel_sweep(rank: int, choices: tuple[dict[str, int], ...] = SWEEP_CHOICES,
                     cases: tuple[KernelCase, ...] = SWEEP_CASES, replays: int = 20,
                     slots: int | None = None) -> list[dict[str, Any]]:
    """Per case, the base matmuls once, then base + LoRA deltas with each ``LoRAKernelChoice(**fields)`` of
    ``choices``: one row each. ``slots``: resident adapter slots (default the cases' largest adapter count; the
    dense form's work grows with it)."""
    from treadle.core.registry import build_registry
    from treadle.kernels.lora_choice import LoRAKernelChoice

    dtype, device = torch.bfloat16, torch.device("cuda")
    max_slots = slots or max(case.adapters for case in cases)
    backend = build_registry().get("lora_backends", "triton")(max_slots, rank, device, dtype)
    layers = [_Layer(max_slots, rank, dtype, device, seed=i) for i in range(NUM_LAYERS)]
    built = [LoRAKernelChoice(**fields) for fields in choices]
    rows = []
    for case in cases:
        inputs = _Inputs(case, layers[0], dtype, device)
        base_s = _graph_seconds(lambda: _base(layers, inputs), replays)
        for i, choice in enumerate(built):
            backend.kernel_choice = choice
            lora_s, both_s = _lora_seconds(layers, inputs, backend, replays)
            rows.append({"case": case.label, "tokens": case.tokens, "adapters": case.adapters, "slots": max_slots,
                         "rank": rank, "choice": choice.name, "fields": choices[i], "base_ms": 1e3 * base_s,
                         "lora_ms": 1e3 * lora_s, "base_plus_lora_ms": 1e3 * both_s, "ratio": both_s / base_s})
            print(f"{case.label}: {choice.name}: base {1e3 * base_s:.3f} ms, LoRA {1e3 * lora_s:.3f} ms, "
                  f"ratio {both_s / base_s:.3f}", flush=True)
        torch.cuda.empty_cache()
    return rows


def _case_seconds(layers: list[_Layer], inputs: _Inputs, backend: Any,
                  replays: int) -> tuple[float, float, float, float]:
    """Seconds per 32-layer step of the base matmuls, the LoRA deltas, both, and the deltas per projection."""
    base_s = _graph_seconds(lambda: _base(layers, inputs), replays)
    lora_s, both_s = _lora_seconds(layers, inputs, backend, replays)
    return base_s, lora_s, both_s, _graph_seconds(lambda: _lora_per_projection(layers, inputs, backend), replays)


def _lora_seconds(layers: list[_Layer], inputs: _Inputs, backend: Any, replays: int) -> tuple[float, float]:
    """Seconds per 32-layer step of the LoRA deltas (``backend`` as it is now configured), and of base + deltas."""
    return (_graph_seconds(lambda: _lora(layers, inputs, backend), replays),
            _graph_seconds(lambda: (_base(layers, inputs), _lora(layers, inputs, backend)), replays))


class _Layer:
    """One decoder layer's fused base weights and, per fused weight, its projections' adapters stacked as the
    engine stacks them (:class:`StackedLoRA` with its dense copy of ``B``; small random values, every slot of rank
    ``rank``)."""

    def __init__(self, slots: int, rank: int, dtype: torch.dtype, device: torch.device, seed: int) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.weights = {}
        for fused, parts in FUSED.items():
            in_features = PROJECTIONS[parts[0]][0]
            out_features = sum(PROJECTIONS[p][1] for p in parts)
            self.weights[fused] = (torch.randn(out_features, in_features, device=device, generator=gen,
                                               dtype=dtype) * 0.02)
        self.adapters = {}
        for fused, parts in FUSED.items():
            in_features, widths = PROJECTIONS[parts[0]][0], [PROJECTIONS[p][1] for p in parts]
            starts = [sum(widths[:i]) for i in range(len(parts))]
            self.adapters[fused] = StackedLoRA(
                a=torch.randn(slots, len(parts) * rank, in_features, device=device, generator=gen, dtype=dtype) * 0.02,
                b=torch.randn(slots, sum(widths), rank, device=device, generator=gen, dtype=dtype) * 0.02,
                scalings=torch.full((len(parts), slots), 2.0, device=device),
                ranks=torch.full((len(parts), slots), rank, dtype=torch.int32, device=device),
                segments=tuple((start, start + width) for start, width in zip(starts, widths))).with_dense_b()


class _Inputs:
    """A case's activations and fused outputs (shared by the layers: their values do not matter) and its
    adapter ids."""

    def __init__(self, case: KernelCase, layer: _Layer, dtype: torch.dtype, device: torch.device) -> None:
        self.x = {fused: torch.randn(case.tokens, weight.shape[1], device=device, dtype=dtype)
                  for fused, weight in layer.weights.items()}
        self.out = {fused: torch.empty(case.tokens, weight.shape[0], device=device, dtype=dtype)
                    for fused, weight in layer.weights.items()}
        tokens = torch.arange(case.tokens, device=device)
        run = -(-case.tokens // case.adapters)
        self.adapter_ids = tokens // run if case.prefill else tokens % case.adapters
        self.adapter_order = adapter_order(self.adapter_ids)


def _base(layers: list[_Layer], inputs: _Inputs) -> None:
    for layer in layers:
        for fused, weight in layer.weights.items():
            torch.mm(inputs.x[fused], weight.t(), out=inputs.out[fused])


def _lora(layers: list[_Layer], inputs: _Inputs, backend: Any) -> None:
    # The tokens sorted by adapter, for a backend that takes them: sorted once a step before the graph replays, as
    # the engine's static batch context does (a few microseconds, not in the timed step).
    order = {"order": inputs.adapter_order} if getattr(backend, "adapter_order_above", None) is not None else {}
    for layer in layers:
        for fused, weights in layer.adapters.items():
            backend.add_delta(inputs.x[fused], weights, inputs.adapter_ids, inputs.out[fused], **order)


def _lora_per_projection(layers: list[_Layer], inputs: _Inputs, backend: Any) -> None:
    for layer in layers:
        for fused, weights in layer.adapters.items():
            x, out = inputs.x[fused], inputs.out[fused]
            for p, (start, end) in enumerate(weights.segments):
                a, b, scalings, ranks = weights.projection(p)
                h = backend.shrink(x, a, inputs.adapter_ids, scalings, ranks)
                backend.expand(h, b, inputs.adapter_ids, ranks, out[:, start:end])


def _graph_seconds(step: Callable[[], Any], replays: int) -> float:
    """Device seconds of one ``step`` replayed from a CUDA graph (compiled and warmed up outside the capture)."""
    from treadle.core.execution.cuda_graph import replay_seconds

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seconds = replay_seconds(graph, replays)
    del graph
    return seconds
