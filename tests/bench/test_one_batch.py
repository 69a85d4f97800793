"""`treadle bench one-batch` runs end to end on the CPU (a tiny model of the 8B's kind) and writes its JSON."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from treadle.bench.one_batch import _build_worker, main
from treadle.bench.one_batch_profile import profile_decode, profile_prefill
from treadle.bench.shapes import TINY, write_config


def test_one_batch_smoke_writes_results(tmp_path):
    output = tmp_path / "one_batch.json"
    assert main(["--tiny", "--device", "cpu", "--batch-sizes", "1,2", "--decode-steps", "3", "--input-len", "8",
                 "--backends", "torch_native", "--no-hf", "--no-profile", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    rows = result["results"]
    assert {row["batch_size"] for row in rows} == {1, 2}
    assert all(row["decode_step_ms"] > 0 and row["decode_tokens_per_s"] > 0 for row in rows)
    # The host's part of a synchronized step, and the steps again back to back (no synchronize between them).
    assert all(0 < row["decode_host_ms"] <= row["decode_step_ms"] for row in rows)
    assert all(row["decode_step_ms_back_to_back"] > 0 for row in rows)
    assert result["command"].startswith("treadle bench one-batch")


def test_one_batch_baseline_ratio(tmp_path, capsys):
    args = ["--tiny", "--device", "cpu", "--batch-sizes", "1", "--decode-steps", "3", "--input-len", "8",
            "--backends", "torch_native", "--no-hf", "--no-profile"]
    assert main(args + ["--output", str(tmp_path / "earlier.json")]) == 0
    assert main(args + ["--output", str(tmp_path / "now.json"), "--baseline", str(tmp_path / "earlier.json")]) == 0
    earlier = json.loads((tmp_path / "earlier.json").read_text())["results"][0]
    now = json.loads((tmp_path / "now.json").read_text())["results"][0]
    assert now["ratio_vs_baseline"] == pytest.approx(now["decode_tokens_per_s"] / earlier["decode_tokens_per_s"])
    assert "x baseline" in capsys.readouterr().out


def test_hf_compiled_peer_uses_a_static_cache_and_matches_hf(tmp_path):
    """On the CPU generate does not compile, but the static-cache path and its row are the GPU run's."""
    import torch

    from treadle.bench import one_batch
    from treadle.bench.hf_peers import run_hf
    from treadle.bench.one_batch_report import HF_COMPILED, format_table
    from treadle.bench.shapes import TINY, write_config

    args = one_batch._parser().parse_args(["--tiny", "--device", "cpu", "--decode-steps", "4", "--input-len", "8"])
    model_dir = write_config(tmp_path, TINY)
    runner = one_batch._build_worker(model_dir, "torch_native", {}, False, 2, args, torch.device("cpu")).runner
    prompts = torch.randint(100, 1000, (2, 8))
    eager = run_hf(runner, prompts, args, 1e9)
    compiled = run_hf(runner, prompts, args, 1e9, compiled=True)
    assert compiled.backend == HF_COMPILED and eager.backend is None
    assert compiled.first_tokens == eager.first_tokens
    assert "x hf-compiled" in format_table([eager, compiled])


def test_one_batch_compares_bf16_and_fp8_weights(tmp_path, capsys):
    output = tmp_path / "fp8.json"
    assert main(["--tiny", "--device", "cpu", "--batch-sizes", "1", "--decode-steps", "2", "--input-len", "8",
                 "--backends", "torch_native", "--no-hf", "--no-profile", "--output", str(output),
                 "--compare", "model.quantization=null,model.quantization=fp8"]) == 0
    rows = {row["system"]: row for row in json.loads(output.read_text())["results"]}
    plain = rows["treadle torch_native graphs=off [model.quantization=null]"]
    fp8 = rows["treadle torch_native graphs=off [model.quantization=fp8]"]
    # The roofline counts FP8 weights at one byte: the decoder's linear layers halve, the embeddings do not.
    assert 0.5 * plain["roofline_ms"] < fp8["roofline_ms"] < 0.8 * plain["roofline_ms"]
    # Each variant against the first, at the same batch size: the table's "x first" column.
    assert plain["ratio_vs_first"] == 1.0
    assert fp8["ratio_vs_first"] == pytest.approx(fp8["decode_tokens_per_s"] / plain["decode_tokens_per_s"])
    assert "x first" in capsys.readouterr().out


def test_first_ratios_only_where_a_batch_size_has_several_treadle_systems():
    from treadle.bench.one_batch_report import fill_first_ratios, format_table, measurement

    hf = measurement("HF generate", None, None, 1, 0.1, [0.04], [], 0.01)
    only = measurement("treadle triton graphs=on", "triton", True, 1, 0.1, [0.02], [], 0.01)
    fill_first_ratios([hf, only])
    assert only.ratio_vs_first is None and "x first" not in format_table([hf, only])
    a, b = (measurement(f"treadle triton graphs=on [{v}]", "triton", True, 32, 0.1, [t], [], 0.01)
            for v, t in (("bf16", 0.008), ("fp8", 0.005)))
    fill_first_ratios([hf, only, a, b])
    assert only.ratio_vs_first is None and hf.ratio_vs_first is None
    assert a.ratio_vs_first == 1.0 and b.ratio_vs_first == pytest.approx(1.6)


def test_hf_peer_of_an_fp8_runner_gets_the_widened_fp8_weights(tmp_path):
    import torch

    from treadle.bench import one_batch
    from treadle.bench.hf_peers import hf_named_weights
    from treadle.bench.shapes import TINY, write_config
    from treadle.kernels.fp8_ops import dequantize

    args = one_batch._parser().parse_args(["--tiny", "--device", "cpu", "--decode-steps", "2", "--input-len", "8"])
    model_dir = write_config(tmp_path, TINY)
    runner = one_batch._build_worker(model_dir, "torch_native", {}, False, 1, args, torch.device("cpu"),
                                     "model.quantization=fp8").runner
    named = dict(hf_named_weights(runner.model))
    down = runner.model.model.layers[0].mlp.down_proj
    assert not any(name.endswith("weight_scale") for name in named)
    assert torch.equal(named["model.layers.0.mlp.down_proj.weight"],
                       dequantize(down.weight, down.weight_scale, torch.bfloat16))


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_profiles_of_decode_and_of_a_small_prefill_time_the_host_and_restore_the_worker():
    """The profile windows (run on the GPU by default) work on the CPU too: host time is measured through
    wrappers that are removed afterwards."""
    args = argparse.Namespace(input_len=16, decode_steps=8, page_size=1, dtype="float32", context_length=256)
    with tempfile.TemporaryDirectory() as scratch:
        worker = _build_worker(write_config(Path(scratch), TINY), "torch_native", {}, False, 2, args,
                               torch.device("cpu"))
        decode = profile_decode(worker, "torch_native", torch.randint(100, 1000, (1, 8)), steps=3)
        prefill = profile_prefill(worker, "torch_native", prompt_len=16, steps=2)
        chunk = profile_prefill(worker, "torch_native", prompt_len=8, steps=1, prompts=2)
    assert decode["what"] == "bs=1 decode" and prefill["what"] == "prefill of 16 tokens"
    assert chunk["what"] == "prefill of 2 x 8 tokens"
    for profile in (decode, prefill, chunk):
        assert profile["wall_us_per_step_profiled"] > 0
        assert all(us > 0 for key, us in profile["host_us_per_step"].items() if "forward" in key)
    assert "forward" not in vars(worker), "the host timer must be removed after the window"



def test_prefill_profile_shapes_are_capped_at_the_prompt_length_and_checked_against_the_batch_rows():
    from treadle.bench.one_batch import parse_prefill_shapes

    assert parse_prefill_shapes("1x300,7X292", 32, 512) == [(1, 300), (7, 292)]
    assert parse_prefill_shapes("1x300", 1, 16) == [(1, 16)]
    for bad in ("7x292", "x3", "0x5"):
        with pytest.raises(SystemExit):
            parse_prefill_shapes(bad, 4, 512)


def test_variants_set_the_small_batch_matmul_and_reset_it_for_the_next():
    from treadle.bench.one_batch import _variant_overrides
    from treadle.layers import small_batch

    try:
        assert _variant_overrides("model.quantization=fp8;small_batch_matmul=library") == {"model.quantization": "fp8"}
        assert small_batch.mode() == "library"
        assert _variant_overrides("model.quantization=null") == {"model.quantization": None}
        assert small_batch.mode() == "auto"
    finally:
        small_batch.set_mode(None)


def test_variants_set_treadle_environment_variables_for_themselves_only(monkeypatch):
    from treadle.bench.one_batch import _variant_overrides

    monkeypatch.setenv("TREADLE_SMALL_BATCH_MATMUL", "library")
    monkeypatch.delenv("TREADLE_TEST_ONLY_SWITCH", raising=False)
    try:
        overrides = _variant_overrides("TREADLE_SMALL_BATCH_MATMUL=triton;TREADLE_TEST_ONLY_SWITCH=1;model.dtype=float32")
        assert overrides == {"model.dtype": "float32"}
        assert os.environ["TREADLE_SMALL_BATCH_MATMUL"] == "triton" and os.environ["TREADLE_TEST_ONLY_SWITCH"] == "1"
    finally:
        assert _variant_overrides("") == {}
    assert os.environ["TREADLE_SMALL_BATCH_MATMUL"] == "library"  # the value from before the variants
    assert "TREADLE_TEST_ONLY_SWITCH" not in os.environ


def test_engine_rows_time_engine_generate_like_the_hf_peers_and_give_the_runners_tokens(tmp_path):
    """The Engine.generate row (on the GPU it runs per graphs-on variant) on the CPU: same dummy weights, same greedy
    tokens as the runner's steps, a decode step from two timed generate calls, ratios only among engine rows."""
    from treadle.bench import one_batch
    from treadle.bench.one_batch_engine import run_engine
    from treadle.bench.one_batch_report import fill_first_ratios

    args = one_batch._parser().parse_args(["--tiny", "--device", "cpu", "--decode-steps", "5", "--input-len", "8"])
    model_dir = write_config(tmp_path, TINY)
    prompts = {bs: torch.randint(100, 1000, (bs, 8)) for bs in (1, 2)}
    worker = one_batch._build_worker(model_dir, "torch_native", {}, False, 2, args, torch.device("cpu"))
    stepped = one_batch.run_treadle(worker, "torch_native graphs=off", "torch_native", False, prompts[2], args, 1e9)
    one_batch._release(worker)
    rows = run_engine(model_dir, "torch_native", {}, "torch_native graphs=on", prompts, args, torch.device("cpu"),
                      1e9)
    assert [(r.batch_size, r.engine, r.system) for r in rows] == [
        (bs, True, "treadle Engine.generate torch_native graphs=on") for bs in (1, 2)]
    assert rows[1].first_tokens == stepped.first_tokens[:5]  # decode-steps tokens, the first from the prefill
    assert all(r.decode_step_ms > 0 and r.decode_step_ms_back_to_back is None for r in rows)
    fp8 = run_engine(model_dir, "torch_native", {"model.quantization": "fp8"}, "x", {2: prompts[2]}, args,
                     torch.device("cpu"), 1e9)[0]
    assert fp8.roofline_ms < rows[1].roofline_ms  # the variant's overrides reached the Engine
    fill_first_ratios([stepped, rows[1], fp8])
    assert stepped.ratio_vs_first is None and rows[1].ratio_vs_first == 1.0
    assert fp8.ratio_vs_first == pytest.approx(fp8.decode_tokens_per_s / rows[1].decode_tokens_per_s)


def test_whole_call_steps_alternate_the_calls_and_take_the_median_pair():
    from treadle.bench.one_batch_report import measurement, whole_call_steps

    calls = []
    # 1 token takes 0.1 s; N = 11 tokens take 0.1 + 10 steps of 0.01 s, except one call with a 0.05 s hiccup.
    times = iter([0.1, 0.2, 0.1, 0.25, 0.1, 0.2])

    def generate(n):
        calls.append(n)
        return next(times), f"output {len(calls)}"

    prefill, steps, output = whole_call_steps(generate, 11, repeats=3)
    assert calls == [1, 11, 1, 11, 1, 11] and output == "output 6"
    assert prefill == pytest.approx(0.1)
    assert steps == pytest.approx([0.01, 0.015, 0.01])
    row = measurement("x", None, None, 1, prefill, steps, [], 0.005)
    assert row.decode_step_ms == pytest.approx(10.0), "the hiccup's pair does not move the median"


def test_parameter_count_of_the_8b_shape_is_llama_3_1_8b():
    from treadle.bench.memory_fit import dense_parameter_count
    from treadle.bench.shapes import LLAMA_3_1_8B, MIXTRAL_8X7B

    assert dense_parameter_count(LLAMA_3_1_8B) == 8_030_261_248  # the published checkpoint's count
    assert 46.6e9 < dense_parameter_count(MIXTRAL_8X7B) < 46.8e9  # every expert counts (all are held)


def test_fp8_variants_count_one_byte_per_projection_weight():
    """Mixtral-8x7B in bf16 needs more than one 80 GB H100; with FP8 experts it fits (47.5 GB measured at load)."""
    from treadle.bench.memory_fit import GIB, memory_need
    from treadle.bench.shapes import MIXTRAL_8X7B

    assert memory_need(MIXTRAL_8X7B, "bfloat16", 16 * 545).total > 80 * 10**9
    assert 40 * GIB < memory_need(MIXTRAL_8X7B, "bfloat16", 16 * 545, fp8=True).total < 50 * GIB
    fp8_checkpoint = {**MIXTRAL_8X7B, "quantization_config": {"quant_method": "fp8"}}
    assert memory_need(fp8_checkpoint, "bfloat16", 0) == memory_need(MIXTRAL_8X7B, "bfloat16", 0, fp8=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_one_batch_refuses_full_shapes_at_once_without_a_gpu():
    """The README's GPU command on a CPU machine: one error line within seconds, not an OOM kill minutes later."""
    import subprocess
    import sys
    import time

    treadle = str(Path(sys.executable).with_name("treadle"))
    start = time.monotonic()
    result = subprocess.run([treadle, "bench", "one-batch", "--backends", "triton,flashinfer"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and time.monotonic() - start < 60
    assert result.stderr.startswith("error: one-batch measures llama-3.1-8b shapes on a GPU"), result.stderr
    assert "--tiny" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_one_batch_refuses_a_shape_that_does_not_fit_the_memory():
    from treadle.bench.memory_fit import available_bytes, memory_need
    from treadle.bench.shapes import LLAMA_3_1_70B

    if memory_need(LLAMA_3_1_70B, "bfloat16", 0).total < available_bytes(torch.device("cpu")):
        pytest.skip("this machine holds the 70B shape")
    with pytest.raises(SystemExit, match=r"needs about \d+\.\d GiB .* GiB is available on this machine; try"):
        main(["--device", "cpu", "--shape", "llama-3.1-70b", "--backends", "torch_native", "--no-hf"])
