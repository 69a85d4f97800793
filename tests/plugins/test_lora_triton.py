"""The `triton` LoRA backend's kernels against plain torch arithmetic, on the CPU under Triton's interpreter.

Triton decides interpret-or-compile when it is first imported (see test_triton_backend.py), so the kernel
checks run in one fresh subprocess — this file run as a script with TRITON_INTERPRET=1 — and each test asserts
on its scenario's result. Checks that launch no kernel run in the pytest process.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

RESULT_MARKER = "LORA_CHECKS_JSON="
NO_ADAPTER = -1


def reference_shrink(x, a, ids, scalings, ranks) -> torch.Tensor:
    """Token by token in float64: ``scalings[s] * x[t] @ a[s, :rank].T``, zero past the rank and for no adapter."""
    h = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(ids.tolist()):
        if slot != NO_ADAPTER:
            rank = int(ranks[slot])
            h[t, :rank] = float(scalings[slot]) * (x[t].double() @ a[slot, :rank].double().T)
    return h


def reference_expand(h, b, ids, ranks, out) -> torch.Tensor:
    """``out[t] + h[t, :rank] @ b[s, :, :rank].T`` in float64, rows without an adapter as they were."""
    result = out.double().clone()
    for t, slot in enumerate(ids.tolist()):
        if slot != NO_ADAPTER:
            rank = int(ranks[slot])
            result[t] += h[t, :rank].double() @ b[slot, :, :rank].double().T
    return result


def make_case(num_tokens: int, dtype: torch.dtype, ranks: list[int], max_rank: int, in_features: int,
              out_features: int, layout: str, seed: int):
    """Stacked adapters zero past their ranks, and ids: ``decode`` (each token a random slot or none) or
    ``prefill`` (runs of 1-50 tokens sharing one)."""
    gen = torch.Generator().manual_seed(seed)
    slots = len(ranks)
    a = torch.randn(slots, max_rank, in_features, generator=gen) / in_features ** 0.5
    b = torch.randn(slots, out_features, max_rank, generator=gen) / max_rank ** 0.5
    for slot, rank in enumerate(ranks):
        a[slot, rank:] = 0
        b[slot, :, rank:] = 0
    if layout == "decode":
        ids = torch.randint(-1, slots, (num_tokens,), generator=gen)
    else:
        runs = []
        while sum(len(r) for r in runs) < num_tokens:
            runs.append([int(torch.randint(-1, slots, (1,), generator=gen))] * int(torch.randint(1, 51, (1,),
                                                                                               generator=gen)))
        ids = torch.tensor([slot for run in runs for slot in run][:num_tokens])
    x = torch.randn(num_tokens, in_features, generator=gen)
    scalings = torch.rand(slots, generator=gen) * 2 + 0.25
    return x.to(dtype), a.to(dtype), b.to(dtype), ids, scalings, torch.tensor(ranks, dtype=torch.int32)


# Scenario -> (tokens, dtype, ranks, max_rank, in, out, layout). Which kernels run (kernels/lora.py): up to 64
# tokens the gather ones; the shrink gathers up to 4096 // max_rank tokens, then runs segmented tiles; the expand
# groups by slot up to 1024 tokens (max_rank <= 64), then runs segmented tiles.
SCENARIOS = {
    "one_token_fp32": (1, torch.float32, [16, 8, 3, 1], 16, 80, 48, "decode"),
    "one_token_bf16": (1, torch.bfloat16, [16, 8, 3, 1], 16, 80, 48, "decode"),
    "decode_64_mixed_ranks_fp32": (64, torch.float32, [16, 8, 3, 1, 12], 16, 96, 40, "decode"),
    "decode_64_bf16": (64, torch.bfloat16, [16, 8, 3, 1, 12], 16, 96, 40, "decode"),
    "grouped_expand_65_decode_ids_fp32": (65, torch.float32, [16, 8, 3, 1], 16, 80, 48, "decode"),
    "grouped_expand_100_prefill_ids_bf16": (100, torch.bfloat16, [16, 8, 3, 1], 16, 80, 48, "prefill"),
    "segmented_shrink_300_decode_ids_fp32": (300, torch.float32, [16, 8, 3, 1], 16, 80, 48, "decode"),
    "segmented_shrink_300_prefill_ids_bf16": (300, torch.bfloat16, [16, 8, 3, 1], 16, 80, 48, "prefill"),
    "segmented_1100_decode_ids_bf16": (1100, torch.bfloat16, [16, 8, 3, 1], 16, 40, 24, "decode"),
    # max_rank above one rank tile (64): the shrink's rank blocks, the expand's loop over rank tiles
    "wide_rank_gather_fp32": (9, torch.float32, [128, 100, 64, 7], 128, 40, 24, "decode"),
    "wide_rank_segmented_fp32": (90, torch.float32, [128, 100, 64, 7], 128, 40, 24, "prefill"),
}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

# add_delta: a layer's projections stacked, mixed ranks per projection, into the middle columns of its output.
# Scenario -> (tokens, dtype, max_rank, in, projection widths). One token at in=1024 splits in over two programs
# (the expand adds the partial sums up); past 64 tokens the sorted form (70 and 150 tokens; rank 128: two rank
# tiles in the expand). The conformance kit's add_delta check adds gather at 5.
STACKED_SCENARIOS = {
    "stacked_split_k_one_token_bf16": (1, torch.bfloat16, 8, 1024, (16, 8, 8)),
    "stacked_sorted_70_tokens_bf16": (70, torch.bfloat16, 8, 40, (24, 24)),
    "stacked_sorted_150_tokens_fp32": (150, torch.float32, 16, 40, (24, 8, 8)),
    "stacked_wide_rank_70_tokens_fp32": (70, torch.float32, 128, 24, (16, 8)),
}
UNSORTED = {"sort_above": 1 << 20}  # the forms over unsorted tokens at any size
LOOP = {"shrink_loop_above": 16, "shrink_loop_k": 128, "shrink_loop_programs": 150, "shrink_loop_stages": 1,
        "busy_programs": 16}
# kernels/lora_choice.py's tunables: split-K shrinks over four slices of in at 8 tokens (busy_programs above the
# batch's work), and one token through narrow tiles (the shrink's k loop over three blocks of in, one row a
# program; the expand's 16-column blocks, several per projection) without the PDL go-ahead; the unsorted forms
# past 64 tokens: 70 tokens of two projections, gather shrink and slot-grouped expand; 150 of three, segmented
# shrink; rank 128, segmented expand.
CHOICE_SCENARIOS = {
    "unsorted_grouped_70_tokens_bf16": ((70, torch.bfloat16, 8, 40, (24, 24)), UNSORTED),
    "unsorted_segmented_150_tokens_fp32": ((150, torch.float32, 16, 40, (24, 8, 8)), UNSORTED),
    "unsorted_wide_rank_70_tokens_fp32": ((70, torch.float32, 128, 24, (16, 8)), UNSORTED),
    "choice_split_k_8_tokens_bf16": ((8, torch.bfloat16, 8, 1024, (16, 8, 8)),
                                     {"busy_programs": 4096, "split_k": 256}),
    # the expand candidates: a layer of 48 columns counts as wide past 32 and takes 16-column blocks, 2 warps
    "choice_wide_expand_20_tokens_bf16": ((20, torch.bfloat16, 8, 40, (24, 24)),
                                          {"expand_wide_above": 32, "expand_wide_tile": 128, "expand_max_warps": 2,
                                           "busy_programs": 16}),
    "choice_narrow_tiles_one_token_fp32": ((1, torch.float32, 16, 300, (40, 8, 8)),
                                           {"shrink_tile": 64, "expand_tile": 256, "go_ahead": 0}),
    # the looped gather shrink (a bs=32-like batch: 18 tokens of mixed adapters and ranks, some on the base model):
    # blocks of 16 of the 36 stacked rows (rank 12: blocks across projections, the last one partial), chunks of 128
    # of in=600 in three slices of two chunks (the last one partial), to reach 150 programs
    "loop_shrink_18_tokens_bf16": ((18, torch.bfloat16, 12, 600, (16, 8, 8)), LOOP),
}


def run_scenario(name: str) -> dict:
    from treadle.kernels import lora

    num_tokens, dtype, ranks, max_rank, in_features, out_features, layout = SCENARIOS[name]
    x, a, b, ids, scalings, rank_tensor = make_case(num_tokens, dtype, ranks, max_rank, in_features, out_features,
                                                    layout, seed=len(name))
    h = lora.shrink(x, a, ids, scalings, rank_tensor)
    expected_h = reference_shrink(x, a, ids, scalings, rank_tensor)
    # The expand adds into the middle columns of a wider tensor, and into every other column of one.
    wide = torch.randn(num_tokens, 2 * out_features + 7).to(dtype)
    before = wide.clone()
    lora.expand(h, b, ids, rank_tensor, wide[:, 3:3 + out_features])
    expected_out = reference_expand(h, b, ids, rank_tensor, before[:, 3:3 + out_features])
    spaced = torch.randn(num_tokens, 2 * out_features).to(dtype)
    spaced_before = spaced.clone()
    lora.expand(h, b, ids, rank_tensor, spaced[:, ::2])
    outside = torch.ones(wide.shape[1], dtype=torch.bool)
    outside[3:3 + out_features] = False
    none = ids == NO_ADAPTER
    return {
        "shrink_error": _relative_error(h, expected_h),
        "shrink_dtype": str(h.dtype), "shrink_shape": list(h.shape),
        "no_adapter_rows_zero": bool((h[none] == 0).all()),
        "expand_error": _relative_error(wide[:, 3:3 + out_features], expected_out),
        "spaced_error": _relative_error(spaced[:, ::2],
                                        reference_expand(h, b, ids, rank_tensor, spaced_before[:, ::2])),
        "outside_untouched": torch.equal(wide[:, outside], before[:, outside])
        and torch.equal(spaced[:, 1::2], spaced_before[:, 1::2]),
        "no_adapter_rows_untouched": torch.equal(wide[none], before[none]),
        "tolerance": TOLERANCE[dtype],
    }


# The two-call shrink (scaled, rounded, one slice of in) in the looped form through Triton's pipeline: 40 tokens
# (some without an adapter) over ranks 16, 8, 3 and 1, two blocks of 8 rows, chunks of 64 of in=300 (the last one
# partial).
LOOP_SHRINK = {"shrink_loop_above": 16, "shrink_loop_rows": 8, "shrink_loop_k": 64, "shrink_loop_stages": 3}


def run_loop_shrink() -> dict:
    from treadle.kernels import lora
    from treadle.kernels.lora_choice import LoRAKernelChoice

    x, a, _, ids, scalings, ranks = make_case(40, torch.bfloat16, [16, 8, 3, 1], 16, 300, 8, "decode", seed=5)
    h = torch.empty((40, 16), dtype=x.dtype)
    lora._shrink(x, a, ids, scalings, ranks, 16, h.unsqueeze(0), True, LoRAKernelChoice(**LOOP_SHRINK))
    return {"error": _relative_error(h, reference_shrink(x, a, ids, scalings, ranks)),
            "no_adapter_rows_zero": bool((h[ids == NO_ADAPTER] == 0).all()), "tolerance": TOLERANCE[x.dtype]}


def make_stacked_case(num_tokens: int, dtype: torch.dtype, max_rank: int, in_features: int, widths: tuple,
                      seed: int, ranks: torch.Tensor | None = None):
    """Four slots of random ranks per projection (or ``ranks`` ``[projections, slots]``; 0: the slot's adapter
    leaves it alone), the projections at columns 3.. of a wider output, ids a random slot or none per token."""
    from treadle.core.lora.backend import StackedLoRA

    gen = torch.Generator().manual_seed(seed)
    count = len(widths)
    if ranks is None:
        ranks = torch.randint(0, max_rank + 1, (count, 4), generator=gen, dtype=torch.int32)
        ranks[:, 0] = max_rank
    slots = ranks.shape[1]
    a = torch.randn(slots, count * max_rank, in_features, generator=gen) / in_features ** 0.5
    b = torch.zeros(slots, 3 + sum(widths), max_rank)
    segments, start = [], 3
    for p, width in enumerate(widths):
        segments.append((start, start + width))
        b[:, start:start + width] = torch.randn(slots, width, max_rank, generator=gen) / max_rank ** 0.5
        for slot in range(slots):
            a[slot, p * max_rank + int(ranks[p, slot]):(p + 1) * max_rank] = 0
            b[slot, start:start + width, int(ranks[p, slot]):] = 0
        start += width
    weights = StackedLoRA(a.to(dtype), b.to(dtype), torch.rand(count, slots, generator=gen) * 2 + 0.25, ranks,
                          tuple(segments))
    ids = torch.randint(-1, slots, (num_tokens,), generator=gen)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    return x, weights, ids, torch.randn(num_tokens, start + 5, generator=gen).to(dtype)


def reference_add_delta(x, weights, ids, out) -> torch.Tensor:
    """Each projection's shrink (rounded to x's dtype) and expand per token, in float64."""
    result = out.double().clone()
    for p, (start, end) in enumerate(weights.segments):
        a, b, scalings, ranks = weights.projection(p)
        h = reference_shrink(x, a, ids, scalings, ranks).to(x.dtype)
        result[:, start:end] = reference_expand(h, b, ids, ranks, out[:, start:end])
    return result


def run_stacked_scenario(name: str) -> dict:
    from treadle.kernels import lora
    from treadle.kernels.lora_choice import LoRAKernelChoice

    if name in CHOICE_SCENARIOS:
        (num_tokens, dtype, max_rank, in_features, widths), fields = CHOICE_SCENARIOS[name]
    else:
        (num_tokens, dtype, max_rank, in_features, widths), fields = STACKED_SCENARIOS[name], {}
    choice = LoRAKernelChoice(**fields)
    x, weights, ids, out = make_stacked_case(num_tokens, dtype, max_rank, in_features, widths, seed=len(name))
    before = out.clone()
    lora.add_delta(x, weights.a, weights.b, ids, weights.scalings, weights.ranks, weights.segments, out, choice)
    first, last = weights.segments[0][0], weights.segments[-1][1]
    none = ids == NO_ADAPTER
    return {"error": _relative_error(out, reference_add_delta(x, weights, ids, before)),
            "outside_untouched": torch.equal(out[:, :first], before[:, :first])
            and torch.equal(out[:, last:], before[:, last:]),
            "no_adapter_rows_untouched": torch.equal(out[none], before[none]),
            "split": lora._gather_shrink_blocks(num_tokens, weights.a.shape[1], in_features, True, choice)[3]
            if lora._shrink_gathers(num_tokens, weights.a.shape[1]) else 1,
            "tolerance": TOLERANCE[dtype]}


# The sorted form (add_delta past LoRAKernelChoice.sort_above = 64 tokens) against the torch backend: adapters of
# ranks 16 and 8 mixed (a slot that leaves the last projection alone), tokens on the base model among them.
# Scenario -> (token counts, dtype, in, projection widths, padding rows, LoRAKernelChoice fields): either side of a
# threshold of 8 (gather, then sorted with in=512 over four slices), a CUDA graph's shape (the last rows padding
# without an adapter), ten blocks of sorted tokens whose expand programs cover two column blocks of 128 each (the
# 300-wide projection in two groups, the last one partial).
SORTED_SCENARIOS = {
    "sorted_around_threshold_fp32": ((8, 9), torch.float32, 512, (24, 8, 8), 0, {"sort_above": 8}),
    "sorted_graph_padded_bf16": ((96,), torch.bfloat16, 200, (24, 8, 8), 24, {}),
    "sorted_ten_blocks_fp32": ((300,), torch.float32, 48, (300, 40, 40), 0, {"sort_columns": 256}),
}
MIXED_RANKS = torch.tensor([[16, 8, 16, 8, 16, 8], [8, 16, 16, 8, 8, 16], [16, 8, 16, 0, 8, 8]], dtype=torch.int32)


def run_sorted_scenario(name: str) -> dict:
    from treadle.core.execution.batch_context import adapter_order
    from treadle.kernels import lora_sorted
    from treadle.kernels.lora_choice import LoRAKernelChoice
    from treadle.plugins.lora_backends.torch import TorchLoRABackend
    from treadle.plugins.lora_backends.triton import TritonLoRABackend

    counts, dtype, in_features, widths, padding, fields = SORTED_SCENARIOS[name]
    choice = LoRAKernelChoice(**fields)
    result = {"tolerance": 1e-5 if dtype == torch.float32 else TOLERANCE[dtype], "errors": [], "sorted": [],
              "own_sort_equal": True, "no_adapter_rows_untouched": True, "splits": []}
    for num_tokens in counts:
        x, weights, ids, out = make_stacked_case(num_tokens, dtype, 16, in_features, widths, seed=num_tokens,
                                                 ranks=MIXED_RANKS)
        ids[num_tokens - padding:] = NO_ADAPTER
        expected = out.float().clone()
        TorchLoRABackend(6, 16, "cpu", torch.float32).add_delta(x.float(), _float_weights(weights), ids, expected)
        backend = TritonLoRABackend(6, 16, "cpu", dtype)
        backend.kernel_choice = choice
        given, own = out.clone(), out.clone()
        backend.add_delta(x, weights, ids, given, order=adapter_order(ids))
        backend.add_delta(x, weights, ids, own)  # no order: the backend sorts
        none = ids == NO_ADAPTER
        result["errors"].append(_relative_error(given, expected.double()))
        result["sorted"].append(lora_sorted.sorts(num_tokens, choice))
        result["splits"].append(lora_sorted._sorted_split(num_tokens, 48, in_features, 32, 64, 128, choice)[0])
        result["own_sort_equal"] &= torch.equal(given, own)
        result["no_adapter_rows_untouched"] &= torch.equal(given[none], out[none])
    return result


# The dense form (add_delta past LoRAKernelChoice.dense_above tokens: cuBLAS-style matmuls over every slot and a
# Triton mask, kernels/lora_dense.py) against the torch backend and against the same backend without the dense copy
# of B (its other forms). Scenario -> (token counts, dtype, max_rank, in, projection widths, padding rows, ranks
# [P, slots], LoRAKernelChoice fields): either side of the bounds 8 and 40 with ranks 16 and 8 mixed (a slot leaving
# the last projection alone); a CUDA graph's shape in bf16 (the last rows padding without an adapter); ranks 8 and
# 64 mixed, padded to 64.
RANKS_8_64 = torch.tensor([[64, 8, 8, 64], [8, 64, 0, 64], [8, 8, 64, 0]], dtype=torch.int32)
DENSE_SCENARIOS = {
    "dense_around_threshold_fp32": ((8, 9, 40, 41), torch.float32, 16, 48, (24, 8, 8), 0, MIXED_RANKS,
                                    {"dense_above": 8, "dense_max_tokens": 40}),
    "dense_graph_padded_bf16": ((200,), torch.bfloat16, 16, 200, (24, 8, 8), 24, MIXED_RANKS, {}),
    "dense_ranks_8_and_64_fp32": ((150,), torch.float32, 64, 40, (24, 16, 8), 0, RANKS_8_64, {}),
}


def run_dense_scenario(name: str) -> dict:
    import dataclasses

    from treadle.core.execution.batch_context import adapter_order
    from treadle.kernels import lora
    from treadle.kernels.lora_choice import LoRAKernelChoice
    from treadle.plugins.lora_backends.torch import TorchLoRABackend
    from treadle.plugins.lora_backends.triton import TritonLoRABackend

    counts, dtype, max_rank, in_features, widths, padding, ranks, fields = DENSE_SCENARIOS[name]
    slots = ranks.shape[1]
    result = {"tolerance": 1e-5 if dtype == torch.float32 else TOLERANCE[dtype], "errors": [], "other_forms": [],
              "no_adapter_rows_untouched": True, "outside_untouched": True, "dense_calls": []}
    dense = lora.add_delta_dense
    lora.add_delta_dense = lambda x, *args: (result["dense_calls"].append(x.shape[0]), dense(x, *args))[1]
    try:
        for num_tokens in counts:
            x, weights, ids, out = make_stacked_case(num_tokens, dtype, max_rank, in_features, widths, seed=num_tokens,
                                                     ranks=ranks)
            ids[num_tokens - padding:] = NO_ADAPTER
            expected = out.float().clone()
            TorchLoRABackend(slots, max_rank, "cpu", torch.float32).add_delta(x.float(), _float_weights(weights), ids,
                                                                              expected)
            backend = TritonLoRABackend(slots, max_rank, "cpu", dtype)
            backend.kernel_choice = LoRAKernelChoice(**fields)
            got, other = out.clone(), out.clone()
            backend.add_delta(x, weights.with_dense_b(), ids, got, order=adapter_order(ids))
            backend.add_delta(x, dataclasses.replace(weights, dense_b=None), ids, other, order=adapter_order(ids))
            none, (first, last) = ids == NO_ADAPTER, (weights.segments[0][0], weights.segments[-1][1])
            result["errors"].append(_relative_error(got, expected.double()))
            result["other_forms"].append(_relative_error(got, other.double()))
            result["no_adapter_rows_untouched"] &= torch.equal(got[none], out[none])
            result["outside_untouched"] &= torch.equal(got[:, :first], out[:, :first]) and torch.equal(
                got[:, last:], out[:, last:])
    finally:
        lora.add_delta_dense = dense
    result["wants_dense_b"] = [TritonLoRABackend(s, r, "cpu", dtype).wants_dense_b for s, r in ((32, 16), (32, 32))]
    return result


def _float_weights(weights):
    import dataclasses

    return dataclasses.replace(weights, a=weights.a.float(), b=weights.b.float())


def run_conformance(dtype_name: str) -> dict:
    from treadle.plugins.lora_backends.triton import TritonLoRABackend
    from treadle.testing import check_lora_backend

    # Every kernel form (gather, slot-grouped, segmented) at fewer sizes than the kit's default, for the interpreter
    check_lora_backend(TritonLoRABackend, "cpu", getattr(torch, dtype_name), token_counts=(1, 33, 300, 1100),
                       stacked_token_counts=(5,))
    return {"passed": True}


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((got.double() - expected).abs() / (1 + expected.abs())).max()) if got.numel() else 0.0


def _run_all() -> dict:
    results = {}
    jobs = {**{name: (run_scenario, name) for name in SCENARIOS},
            **{name: (run_stacked_scenario, name) for name in (*STACKED_SCENARIOS, *CHOICE_SCENARIOS)},
            **{name: (run_sorted_scenario, name) for name in SORTED_SCENARIOS},
            **{name: (run_dense_scenario, name) for name in DENSE_SCENARIOS},
            "loop_shrink": (lambda _: run_loop_shrink(), None),
            "conformance_float32": (run_conformance, "float32")}
    for key, (function, argument) in jobs.items():
        try:
            results[key] = function(argument)
        except Exception:  # reported per scenario, so one failure does not hide the others
            results[key] = {"traceback": traceback.format_exc()}
    return results


if __name__ == "__main__":
    print(RESULT_MARKER + json.dumps(_run_all()))
    sys.exit(0)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict]:
    from interpreted import interpreted_results as run_interpreted

    return run_interpreted(__file__, RESULT_MARKER)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_kernels_match_reference(name: str, interpreted_results: dict[str, dict]) -> None:
    result = interpreted_results[name]
    assert "traceback" not in result, result.get("traceback")
    num_tokens, dtype, _, max_rank, *_ = SCENARIOS[name]
    assert result["shrink_shape"] == [num_tokens, max_rank] and result["shrink_dtype"] == str(dtype)
    assert result["no_adapter_rows_zero"], "shrink wrote something into rows of tokens without an adapter"
    assert result["shrink_error"] <= result["tolerance"], f"shrink: relative error {result['shrink_error']}"
    assert result["expand_error"] <= result["tolerance"], f"expand: relative error {result['expand_error']}"
    assert result["spaced_error"] <= result["tolerance"], f"strided expand: relative error {result['spaced_error']}"
    assert result["outside_untouched"], "expand wrote columns outside the out slice"
    assert result["no_adapter_rows_untouched"], "expand changed rows of tokens without an adapter"


@pytest.mark.parametrize("name", [*STACKED_SCENARIOS, *CHOICE_SCENARIOS])
def test_stacked_projections_add_into_their_columns(name: str, interpreted_results: dict[str, dict]) -> None:
    result = interpreted_results[name]
    assert "traceback" not in result, result.get("traceback")
    assert result["error"] <= result["tolerance"], f"add_delta: relative error {result['error']}"
    assert result["outside_untouched"], "add_delta wrote columns outside the projections"
    assert result["no_adapter_rows_untouched"], "add_delta changed rows of tokens without an adapter"
    if name == "stacked_split_k_one_token_bf16":
        assert result["split"] == 2  # in=1024 over two programs' slices
    if name == "choice_split_k_8_tokens_bf16":
        assert result["split"] == 4  # in=1024 over four slices of split_k=256
    if name == "loop_shrink_18_tokens_bf16":
        assert result["split"] == 3  # 54 programs of 16 rows, in three slices of 256 columns towards 150


def test_looped_shrink_matches_reference(interpreted_results: dict[str, dict]) -> None:
    """The two-call shrink in the looped form (several chunks of in a program, Triton's pipeline) is the
    reference's, scaled and rounded, zero rows for tokens without an adapter."""
    result = interpreted_results["loop_shrink"]
    assert "traceback" not in result, result.get("traceback")
    assert result["error"] <= result["tolerance"], f"relative error {result['error']}"
    assert result["no_adapter_rows_zero"]


def test_looped_shrink_reach() -> None:
    """The looped form runs past ``shrink_loop_above`` (16) tokens, in place of the full-row form: 4 rows over chunks
    of 2048 columns, ``in`` split towards 384 programs and at most two chunks a program; the split-K form (few
    tokens, partial sums allowed) stays."""
    pytest.importorskip("triton")
    from treadle.kernels.lora import _gather_shrink_blocks
    from treadle.kernels.lora_choice import LoRAKernelChoice

    default, full_rows = LoRAKernelChoice(), LoRAKernelChoice(shrink_loop_above=1 << 20)
    # bs=32 over Llama-3.1-8B's layers at rank 16: qkv (48 rows, in=4096) 384 programs of all of in
    assert _gather_shrink_blocks(32, 48, 4096, True, default) == (4, 2048, 4096, 1, 0, 4)
    assert _gather_shrink_blocks(32, 16, 4096, True, default) == (4, 2048, 2048, 2, 0, 4)  # o: 128 programs, 2 slices
    assert _gather_shrink_blocks(32, 32, 4096, True, default) == (4, 2048, 2048, 2, 0, 4)  # gate_up: 256 x 2
    # down (in=14336: 7 chunks): 128 programs x 4 slices of two chunks (3 slices would reach 384, of three chunks)
    assert _gather_shrink_blocks(32, 16, 14336, True, default) == (4, 2048, 4096, 4, 0, 4)
    assert _gather_shrink_blocks(32, 48, 4096, False, default) == (4, 2048, 4096, 1, 0, 4)  # the two-call shrink
    # up to 16 tokens, and with the looped form off: two rows of all of in a program, warps by the tile
    assert _gather_shrink_blocks(16, 48, 4096, True, default) == (2, 4096, 4096, 1, 0, 0)
    assert _gather_shrink_blocks(32, 48, 4096, True, full_rows) == (2, 4096, 4096, 1, 0, 0)
    # round 1's candidate: 16 rows, chunks of 512 ahead in registers, 96 programs in three slices towards 256
    round1 = LoRAKernelChoice(shrink_loop_rows=16, shrink_loop_k=512, shrink_loop_programs=256,
                              shrink_loop_chunks=1 << 20, shrink_loop_stages=1, shrink_loop_warps=8)
    assert _gather_shrink_blocks(32, 48, 4096, True, round1) == (16, 512, 1536, 3, 1, 8)
    # one token: split-K whatever the threshold
    everywhere = LoRAKernelChoice(shrink_loop_above=0)
    assert _gather_shrink_blocks(1, 48, 4096, True, everywhere) == (4, 512, 512, 8, 0, 0)
    with pytest.raises(ValueError, match="shrink_loop_rows must be a power of two"):
        LoRAKernelChoice(shrink_loop_rows=12)


def test_expand_blocks_for_wide_layers() -> None:
    """The expand candidates: layers of more than ``expand_wide_above`` columns take ``expand_wide_tile``, the others
    ``expand_tile``; the narrowing for few programs stays; the default keeps 512-column blocks at rank 16."""
    pytest.importorskip("triton")
    from treadle.kernels.lora import _gather_expand_columns
    from treadle.kernels.lora_choice import LoRAKernelChoice

    default = LoRAKernelChoice()
    split = LoRAKernelChoice(expand_tile=16384, expand_max_warps=8, expand_wide_above=8192, expand_wide_tile=4096)
    # bs=32 over Llama-3.1-8B's layers at rank 16: o (4096 columns), q/k/v (6144, widest 4096), gate/up (2 x 14336)
    assert [_gather_expand_columns(32, cols, widest, 16, default)
            for cols, widest in ((4096, 4096), (6144, 4096), (28672, 14336))] == [512, 512, 512]
    assert [_gather_expand_columns(32, cols, widest, 16, split)
            for cols, widest in ((4096, 4096), (6144, 4096), (28672, 14336))] == [1024, 1024, 256]
    assert _gather_expand_columns(1, 28672, 14336, 16, split) == 64  # one token: narrow blocks, as before
    with pytest.raises(ValueError, match="expand_max_warps must be a power of two"):
        LoRAKernelChoice(expand_max_warps=6)


@pytest.mark.parametrize("name", list(SORTED_SCENARIOS))
def test_sorted_form_matches_torch_backend(name: str, interpreted_results: dict[str, dict]) -> None:
    """Tokens sorted by adapter (the engine's once-a-step order, or the backend's own sort) give the torch
    backend's deltas within the dtype's rounding, and leave rows without an adapter (graph padding) alone."""
    result = interpreted_results[name]
    assert "traceback" not in result, result.get("traceback")
    counts = SORTED_SCENARIOS[name][0]
    assert result["sorted"] == [count > SORTED_SCENARIOS[name][5].get("sort_above", 64) for count in counts]
    assert max(result["errors"]) <= result["tolerance"], f"relative errors {result['errors']}"
    assert result["own_sort_equal"], "add_delta without order= differs from add_delta given the sorted order"
    assert result["no_adapter_rows_untouched"], "add_delta changed rows of tokens without an adapter"
    if name == "sorted_around_threshold_fp32":
        assert result["splits"][1] == 4  # 9 tokens: one block, in=512 over four slices


@pytest.mark.parametrize("name", list(DENSE_SCENARIOS))
def test_dense_form_matches_torch_backend(name: str, interpreted_results: dict[str, dict]) -> None:
    """Past ``dense_above`` tokens, with the layer's dense copy of B, the deltas are the torch backend's (and the
    other forms') within the dtype's rounding, rows without an adapter and columns outside the projections left
    bit for bit; a stack of slots past ``dense_max_stack`` keeps no dense copy."""
    result = interpreted_results[name]
    assert "traceback" not in result, result.get("traceback")
    from treadle.kernels.lora_choice import LoRAKernelChoice

    counts, choice = DENSE_SCENARIOS[name][0], LoRAKernelChoice(**DENSE_SCENARIOS[name][-1])
    assert result["dense_calls"] == [count for count in counts
                                     if choice.dense_above < count <= choice.dense_max_tokens]
    assert max(result["errors"]) <= result["tolerance"], f"relative errors {result['errors']}"
    assert max(result["other_forms"]) <= 2 * result["tolerance"], f"against the other forms {result['other_forms']}"
    assert result["no_adapter_rows_untouched"] and result["outside_untouched"]
    assert result["wants_dense_b"] == [True, False]  # 32 slots x rank 16 = 512 rank rows; rank 32 is past the cap


def test_backend_passes_conformance_kit(interpreted_results: dict[str, dict]) -> None:
    result = interpreted_results["conformance_float32"]  # bfloat16 rounding: the scenarios above
    assert result.get("passed"), result.get("traceback")


def test_kernel_choice_reads_from_text() -> None:
    """The FIELD=N,... text of TREADLE_LORA_KERNELS and ``treadle bench lora --sweep --choice``."""
    from treadle.kernels.lora_choice import LoRAKernelChoice, choice_fields

    assert LoRAKernelChoice(**choice_fields("go_ahead=0, shrink_tile=16384,")).name == "go_ahead=0,shrink_tile=16384"
    assert LoRAKernelChoice(**choice_fields("")).name == "default"
    with pytest.raises(ValueError, match="'go_ahed=0'.*go_ahead"):
        choice_fields("go_ahed=0")
    with pytest.raises(ValueError, match="expand_tile must be a power of two"):
        LoRAKernelChoice(**choice_fields("expand_tile=6000"))


def test_registered_as_triton() -> None:
    from treadle.core.registry import build_registry
    from treadle.plugins.lora_backends.triton import TritonLoRABackend

    registry = build_registry(["treadle.plugins.lora_backends.triton"], load_entry_points=False)
    assert registry.get("lora_backends", "triton") is TritonLoRABackend


def test_cpu_without_interpreter_is_refused_with_alternative(monkeypatch: pytest.MonkeyPatch) -> None:
    from treadle.plugins.lora_backends.triton import TritonLoRABackend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="lora.backend: torch"):
        TritonLoRABackend(4, 16, "cpu", torch.bfloat16)


def test_missing_triton_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import treadle.kernels as kernels
    from treadle.plugins.lora_backends.triton import TritonLoRABackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check; nothing is imported or launched
    monkeypatch.setitem(sys.modules, "treadle.kernels.lora", None)
    monkeypatch.delattr(kernels, "lora", raising=False)
    with pytest.raises(RuntimeError, match="pip install triton"):
        TritonLoRABackend(4, 16, "cpu", torch.bfloat16)
