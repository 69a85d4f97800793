"""bench/quant.py's summary: the W4A16 rows of one run against bf16's and the targets."""

from __future__ import annotations

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
