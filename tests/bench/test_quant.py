"""bench/quant.py's summary: the W4A16 rows of one run against bf16's and the targets."""

from __future__ import annotations

import dataclasses
import json

import torch

from treadle.bench.quant import summary
from treadle.bench.shapes import MODEL_SHAPES


def _row(system: str, bs: int, ms: float, fraction: float) -> dict:
    return {"system": system, "batch_size": bs, "decode_step_ms": ms, "roofline_fraction": fraction, "engine": False}


def test_summary_gives_each_batch_size_its_speed_up_and_roofline():
    one_batch = {"results": [_row("treadle triton graphs=on [model.path=/t/bf]", 1, 5.5, 0.8),
                             _row("treadle triton graphs=on [model.path=/t/q]", 1, 2.2, 0.82),
                             _row("treadle triton graphs=on [model.path=/t/bf]", 32, 7.0, 0.7),
                             _row("treadle triton graphs=on [model.path=/t/q]", 32, 4.0, 0.5)]}
    offline = {"systems": [{"output_throughput_tok_s": 12000.0}, {"output_throughput_tok_s": 13200.0}]}
    lines = summary(one_batch, offline, "/t/q").splitlines()
    assert "2.50x" in lines[1] and "82%" in lines[1] and "1.75x" in lines[2] and "1.10x" in lines[3]


def test_the_w4a16_shape_is_llama_8b_with_a_pack_quantized_config():
    shape = MODEL_SHAPES["llama-3.1-8b-w4a16"]
    assert shape["hidden_size"] == 4096 and shape["quantization_config"]["format"] == "pack-quantized"


def _dummy_w4a16_model(tmp_path):
    from treadle.bench.shapes import TINY, W4A16_CONFIG, write_config
    from treadle.core.config import ModelConfig
    from treadle.core.loading.model_loader import load_model
    from treadle.core.registry import build_registry

    model_dir = write_config(tmp_path, {**TINY, "quantization_config": W4A16_CONFIG})
    registry = build_registry(plugin_modules=["treadle.plugins.models.llama",
                                              "treadle.plugins.quantization.compressed_tensors"],
                              load_entry_points=False)
    model, _, _ = load_model(ModelConfig(path=model_dir, load_format="dummy", device="cpu", dtype="float32"),
                             registry)
    return model


def test_dummy_packed_weights_load_and_run(tmp_path):
    # What the bench loads on the GPU: a W4A16 config.json and load_format dummy (no checkpoint).
    from prefill_logits import prefill_logits

    model = _dummy_w4a16_model(tmp_path)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.int32 and layer.weight.shape == (256, 512 // 8)
    assert layer.weight_scales.shape == (256, 4)
    assert torch.isfinite(prefill_logits(model, [5, 6, 7])).all()


def test_memory_fit_counts_packed_int_weights_in_their_bits():
    from treadle.bench.memory_fit import memory_need

    gib = 1 << 30
    bf16, w4a16, awq, mixtral = (memory_need(MODEL_SHAPES[name], "bfloat16", 0).weights / gib for name in (
        "llama-3.1-8b", "llama-3.1-8b-w4a16", "llama-3.1-8b-awq", "mixtral-8x7b-w4a16"))
    # 8B: 13.0 GiB of projections at 2 bytes become 0.5 + 2/128 (scales) bytes; AWQ's zeros add as much again.
    assert 14.9 < bf16 < 15.0 and 5.2 < w4a16 < 5.4 and w4a16 < awq < w4a16 + 0.15
    assert mixtral < 24  # a 4-bit Mixtral-8x7B fits one 80 GB GPU with room for its KV cache


def test_dummy_packed_weights_fill_a_tensor_parallel_rank(tmp_path, monkeypatch):
    # Rank 1 of 2 (no group is needed to build and fill one): the packed layers' tensors are filled in their
    # rank's shapes, not through the loader, which expects the full checkpoint tensors.
    from treadle.core.distributed import parallel

    monkeypatch.setattr(parallel, "_group", parallel.TensorParallelGroup(rank=1, size=2))
    model = _dummy_w4a16_model(tmp_path)
    down = model.model.layers[0].mlp.down_proj
    assert down.weight.dtype == torch.int32 and down.weight.shape == (256, 256 // 8)
    assert down.weight_scales.shape == (256, 2) and bool((down.weight_scales != 0).any())


def test_precompile_compiles_the_loaders_launches_before_the_runs(tmp_path, monkeypatch):
    # --precompile JOBS: every launch the loader times, in JOBS processes, before any model loads (AWQ: zero points).
    from treadle.bench import one_batch, quant, quant_sweep

    calls = []
    monkeypatch.setattr(quant_sweep, "precompile_loader", lambda jobs, zeros: calls.append(("compile", jobs, zeros)))
    def run_one_batch(argv):
        calls.append(("one-batch",))
        (tmp_path / "one_batch_quant.json").write_text('{"results": []}')

    monkeypatch.setattr(one_batch, "main", run_one_batch)
    monkeypatch.setattr(quant, "summary", lambda *args: "")
    quant.main(["--runs", "one-batch", "--quick", "--precompile", "3", "--format", "awq", "--out", str(tmp_path)])
    assert calls == [("compile", 3, True), ("one-batch",)]


def test_profile_asks_one_batch_for_every_batch_sizes_decode_profile_and_no_prefill(tmp_path, monkeypatch, capsys):
    from treadle.bench import one_batch, quant

    runs = []

    def run_one_batch(argv):
        runs.append(one_batch._parser().parse_args(argv))
        profile = _profile("treadle triton [model.path=x-w4a16]", 32, [("_magic_mma_kernel", 4000.0, 128.0)], 9.0)
        (tmp_path / "one_batch_quant.json").write_text(json.dumps({"results": [], "profiles": {"w": profile}}))

    monkeypatch.setattr(one_batch, "main", run_one_batch)
    quant.main(["--runs", "one-batch", "--quick", "--profile", "--out", str(tmp_path)])
    args = runs[0]
    assert not args.no_profile and args.profile_batch_sizes == "1,32" and args.prefill_profile == "none"
    assert "_magic_mma_kernel" in capsys.readouterr().out


def test_the_kernels_each_shape_chose_are_printed(monkeypatch):
    from treadle.bench import quant
    from treadle.kernels.int_kernel_plan import plan_kernels
    from treadle.layers import int_kernel_choice

    plan = plan_kernels(4096, 4096, 4, 128, 132)
    monkeypatch.setattr(int_kernel_choice, "_plans", {(4096, 4096, 4, 128, False, "bf16", "cuda:0"): plan,
                                                      (64, 100, 4, 128, False, "bf16", "cuda:0"): None})
    text = quant.chosen_kernels()
    assert text.splitlines()[:2] == ["kernels chosen at load:", f"4096 x 4096: 1 row {plan.gemv}"]
    assert f"32 rows {plan.medium}" in text and "64 x 100" not in text
    assert "the tl.dot kernels up to 256 rows, then dequantize" in text
    # With the loader's timings: each kept launch's, and the shapes' sum per decode step where every shape has one.
    monkeypatch.setattr(int_kernel_choice, "_kept_seconds", {(4096, 4096, 1): 5e-6, (4096, 4096, 32): 1.2e-5})
    timed = quant.chosen_kernels(layers=32).splitlines()
    assert timed[1] == f"4096 x 4096: 1 row {plan.gemv} (5.0 us)" and "(12.0 us)" in timed[3]
    assert timed[-2:] == ["the kept launches at 1 row, as the loader timed them: 0.16 ms per decode step (32 layers)",
                          "the kept launches at 32 rows, as the loader timed them: 0.38 ms per decode step (32 layers)"]
    # A plan with wide_mma buckets: each printed with its timing, the fused kernels up to the last bucket.
    from treadle.kernels.packed_int_wide import WideMmaTiles

    wide = dataclasses.replace(plan, dot_max_rows=64, wide=((128, WideMmaTiles(128, 128, 8)),
                                                            (256, WideMmaTiles(128, 256, 4, 8))))
    monkeypatch.setattr(int_kernel_choice, "_plans", {(4096, 4096, 4, 128, False, "bf16", "cuda:0"): wide})
    monkeypatch.setattr(int_kernel_choice, "_kept_seconds", {(4096, 4096, 128): 2e-5, (4096, 4096, 256): 3e-5})
    text = quant.chosen_kernels(layers=32)
    assert f"  up to 128 rows {WideMmaTiles(128, 128, 8)} (20.0 us)" in text.splitlines()
    assert "the tl.dot kernels up to 256 rows, then dequantize" in text
    assert text.splitlines()[-1] == ("the kept launches at 256 rows, as the loader timed them: 0.96 ms per decode "
                                     "step (32 layers)")


def _profile(system: str, bs: int, kernels: list[tuple[str, float, float]], idle: float) -> dict:
    top = [{"name": name, "us_per_step": us, "calls_per_step": calls} for name, us, calls in kernels]
    return {"system": system, "what": f"bs={bs} decode", "steps": 20, "wall_us_per_step_profiled": 5000.0,
            "gpu_busy_us_per_step": sum(us for _, us, _ in kernels), "gpu_union_us_per_step": 4000.0,
            "gpu_idle_in_step_us_per_step": idle, "kernels_per_step": sum(c for _, _, c in kernels),
            "by_category_us_per_step": {"matmul (weights)": kernels[0][1]}, "top_kernels": top,
            "host_us_per_step": {"runner.forward (host, until the graph is launched)": 100.0 + idle / 10},
            "gpu_idle_before_us_per_step": {kernels[0][0]: idle}}


def test_profile_table_puts_each_batch_sizes_decode_profiles_side_by_side():
    from treadle.bench.quant import profile_table

    profiles = {  # as one_batch's JSON keys them; its prefill profiles are left out
        "bf16": _profile("treadle triton [model.path=/t/llama]", 1, [("_small_batch_kernel", 3500.0, 129.0)], 150.0),
        "w4a16": _profile("treadle triton [model.path=/t/llama-w4a16]", 1,
                          [("_int_gemv_kernel", 1900.0, 128.0), ("_chunk_top_kernel", 9.0, 1.0)], 700.0),
        "w4a16 bs=32": _profile("treadle triton [model.path=/t/llama-w4a16]", 32,
                                [("_magic_mma_kernel", 4000.0, 128.0)], 900.0),
        "w4a16 prefill": {**_profile("treadle triton [model.path=/t/llama-w4a16]", 1, [("x", 1.0, 1.0)], 0.0),
                          "what": "prefill of 300 tokens"},
    }
    lines = profile_table(profiles, "/t/llama-w4a16").splitlines()
    idle = [line for line in lines if line.startswith("GPU idle")]
    assert idle[0].split()[-3:] == ["150", "700", "550"] and idle[1].split()[-3:] == ["-", "900", "-"]
    waited = lines[lines.index(next(line for line in lines if "idle just before" in line)) + 1].split("|")
    assert waited[0].split() == ["150", "_small_batch_kernel"] and waited[1].split() == ["700", "_int_gemv_kernel"]
    top = lines[lines.index(next(line for line in lines if "top kernels" in line)) + 1]
    assert "_small_batch_kernel" in top.split("|")[0] and "_int_gemv_kernel" in top.split("|")[1]
    assert sum("decode bs=" in line for line in lines) == 2
    assert next(line for line in lines if "runner.forward" in line).split()[-3:] == ["115", "170", "55"]
    assert lines[-1].split("|")[0].strip() == ""  # bs=32: w4a16's kernels alone, one line (no bf16 profile there)


def test_gpu_timeline_counts_overlaps_once_and_idle_only_inside_steps():
    from treadle.bench.one_batch_profile import gpu_timeline

    # Two steps: kernels 0-10 and 8-20 (overlapping, as under PDL), a 5 us hand-over to 25-30; the next step 500 us on.
    busy, idle, before = gpu_timeline([(25.0, 30.0, "c"), (0.0, 10.0, "a"), (8.0, 20.0, "b"), (530.0, 540.0, "a"),
                                       (542.0, 543.0, "c")])
    assert (busy, idle, before) == (36.0, 7.0, {"c": 7.0})


def test_integer_kernels_count_as_weight_matmuls():
    from treadle.bench.one_batch import parse_prefill_shapes
    from treadle.bench.step_meter import kernel_category

    for name in ("_int_gemv_kernel", "_magic_mma_kernel", "_int_mma_kernel", "_int_dot_kernel", "_dequantize_kernel"):
        assert kernel_category(name) == "matmul (weights)"
    assert kernel_category("_chunk_top_kernel") == "sampling/reductions"
    assert parse_prefill_shapes("none", 4, 300) == [] and parse_prefill_shapes("2x400", 4, 300) == [(2, 300)]


def test_large_batch_summary_adds_the_shapes_up_per_step():
    from treadle.bench.quant_large import summary

    rows = [{"rows": 128, "bf16_us": 100.0, "dequantize_us": 20.0, "path_us": 125.0, "best_path_us": 120.0,
             "dot_best_us": 150.0, "wide_best_us": 80.0, "kept_us": 80.0},
            {"rows": 128, "bf16_us": 50.0, "dequantize_us": 10.0, "path_us": 62.5, "best_path_us": 60.0,
             "dot_best_us": 70.0, "wide_best_us": 70.0, "kept_us": 62.5},
            {"rows": 512, "bf16_us": 400.0, "dequantize_us": 30.0, "path_us": 440.0, "best_path_us": 430.0}]
    lines = summary(rows, [128, 512]).splitlines()
    # 32 layers: (100 + 50) us -> 4.80 ms of bf16, the path 1.25x, wide_mma 4.80 ms, the faster of the two per
    # shape 4.56 ms (0.95x); no tl.dot or wide_mma timing at 512 rows: the path kept.
    assert lines[1].split()[1:8] == ["4.80", "0.96", "6.00", "5.76", "7.04", "4.80", "4.56"]
    assert "(1.25x, 0.95x" in lines[1]
    assert lines[2].split()[1:8] == ["12.80", "0.96", "14.08", "13.76", "-", "-", "14.08"] and "(1.10x" in lines[2]


def test_offline_variants_run_both_models_again_with_their_overrides(tmp_path, monkeypatch, capsys):
    from treadle.bench import offline_throughput, quant

    seen = []

    def run_offline(argv):
        seen.append(argv[argv.index("--compare") + 1].split(","))
        systems = [{"output_throughput_tok_s": tok_s} for tok_s in (12000.0, 11000.0, 12100.0, 12500.0)]
        (tmp_path / "offline_quant.json").write_text(json.dumps({"systems": systems}))

    monkeypatch.setattr(offline_throughput, "main", run_offline)
    quant.main(["--runs", "offline", "--out", str(tmp_path), "--offline-variant", "scheduler.max_running_requests=1024"])
    variants = seen[0]
    assert len(variants) == 4 and variants[2].endswith("llama-3.1-8b;scheduler.max_running_requests=1024")
    assert variants[3].endswith("llama-3.1-8b-w4a16;scheduler.max_running_requests=1024")
    out = capsys.readouterr().out
    assert "0.92x" in out and "1.03x" in out  # each pair against its own bf16
