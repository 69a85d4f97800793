"""Choosing the decode-sized-batch matmul (layers/small_batch.py): the row buckets, the forced modes and
their validation. Timing itself needs a GPU (tests/gpu/test_fp8_gpu.py runs FP8 models through it)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from treadle.layers import small_batch
from treadle.layers.small_batch import ROW_BUCKETS, SmallBatchKernels

pytest.importorskip("triton")

from treadle.kernels.small_batch import FP8_CONFIGS  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_mode(monkeypatch):
    monkeypatch.delenv("TREADLE_SMALL_BATCH_MATMUL", raising=False)
    yield
    small_batch.set_mode(None)


def test_a_batch_uses_the_smallest_bucket_that_holds_it():
    one, few, more = FP8_CONFIGS[4], FP8_CONFIGS[0], None
    kernels = SmallBatchKernels((one, few, more))
    assert ROW_BUCKETS == (1, 16, 32)
    assert kernels.for_rows(1) is one
    assert all(kernels.for_rows(rows) is few for rows in (2, 9, 16))
    assert all(kernels.for_rows(rows) is None for rows in (17, 32))  # the library won at 32 rows
    assert kernels.for_rows(33) is None and kernels.for_rows(4096) is None  # prefill: always the library
    assert kernels.describe() == f"1 row: triton {one}; 2-16 rows: triton {few}; 17-32 rows: library"


def test_matmul_defers_to_the_library_where_no_config_applies():
    x, weight = torch.randn(3, 32), torch.randn(8, 32)
    assert small_batch.matmul(None, x, weight, None) is None
    assert small_batch.matmul(SmallBatchKernels((None, None, None)), x, weight, None) is None
    # No rows: the library handles the empty product (a Triton grid of zero programs would not launch).
    assert small_batch.matmul(SmallBatchKernels((FP8_CONFIGS[4],) * 3), x[:0], weight, None) is None


def test_silu_mul_fuses_only_into_one_pass_kernels():
    from treadle.kernels.small_batch import SmallBatchConfig, fuses_silu_mul, small_batch_matmul

    x, weight = torch.randn(1, 32), torch.randn(16, 32)
    narrow_tile, split_gemv = SmallBatchConfig(16, 256, 4, 3), SmallBatchConfig(8, 1024, 4, 4, split_k=2, gemv=True)
    split_tile = SmallBatchConfig(32, 128, 4, 4, split_k=4)
    # Where the chosen kernel sums split-K partials, has tiles too narrow to halve for tl.dot, or is the library,
    # the layer runs its matmul and then silu_mul.
    for config in (narrow_tile, split_gemv, split_tile, None):
        assert small_batch.silu_mul_matmul(SmallBatchKernels((config,) * 3), x, weight, None) is None
    assert small_batch.silu_mul_matmul(None, x, weight, None) is None
    assert fuses_silu_mul(SmallBatchConfig(32, 256, 4, 3)) and fuses_silu_mul(SmallBatchConfig(4, 2048, 8, 4, gemv=True))
    with pytest.raises(ValueError, match="configs without split-K"):
        small_batch_matmul(x, weight, None, split_gemv, silu_mul=True)


def test_forced_modes_skip_the_timing():
    weight = torch.zeros(64, 32, dtype=torch.float8_e4m3fn)  # a CPU weight: timing would need a GPU

    def library(x, w):
        raise AssertionError("forced modes time nothing")

    small_batch.set_mode("library")
    assert small_batch.choose("fp8", weight, None, torch.bfloat16, library, FP8_CONFIGS) is None
    small_batch.set_mode("triton")
    forced = small_batch.choose("fp8", weight, None, torch.bfloat16, library, FP8_CONFIGS)
    assert forced == SmallBatchKernels((FP8_CONFIGS[0],) * len(ROW_BUCKETS))


def test_the_environment_picks_the_mode_and_a_bad_value_names_the_choices(monkeypatch):
    monkeypatch.setenv("TREADLE_SMALL_BATCH_MATMUL", "library")
    assert small_batch.mode() == "library"
    small_batch.set_mode("triton")  # an explicit choice wins over the environment
    assert small_batch.mode() == "triton"
    small_batch.set_mode(None)
    monkeypatch.setenv("TREADLE_SMALL_BATCH_MATMUL", "cublas")
    with pytest.raises(ValueError, match="TREADLE_SMALL_BATCH_MATMUL='cublas' is not one of auto, library, triton"):
        small_batch.mode()
    with pytest.raises(ValueError, match="'fast' is not one of auto, library, triton"):
        small_batch.set_mode("fast")


def test_auto_keeps_the_fastest_per_bucket_and_times_gemv_configs_at_one_row_only(monkeypatch):
    """The timing itself is faked (it needs a GPU): each candidate's 'device time' comes from a table."""
    from treadle.kernels import small_batch as small_batch_kernels

    gemv = next(c for c in FP8_CONFIGS if c.gemv)
    tiles = [c for c in FP8_CONFIGS if not c.gemv][:2]
    seconds = {  # (candidate, rows) -> time; the GEMV would win everywhere if it were timed above one row
        ("library", 1): 9.0, ("library", 16): 9.0, ("library", 32): 1.0,
        (gemv, 1): 2.0, (gemv, 16): 0.1, (gemv, 32): 0.1,
        (tiles[0], 1): 3.0, (tiles[0], 16): 2.0, (tiles[0], 32): 3.0,
        (tiles[1], 1): 4.0, (tiles[1], 16): 2.5, (tiles[1], 32): 2.0,
    }
    timed: list[tuple] = []

    def fake_seconds(run):
        candidate, rows = run(0)
        timed.append((candidate, rows))
        return seconds[candidate, rows]

    monkeypatch.setattr(small_batch, "graph_seconds", fake_seconds)
    monkeypatch.setattr(small_batch, "weight_copies", lambda weight: [weight])
    monkeypatch.setattr(small_batch_kernels, "small_batch_matmul", lambda x, w, s, config: (config, x.shape[0]))
    monkeypatch.setattr(small_batch, "_choices", {})
    weight = torch.zeros(64, 32)
    chosen = small_batch.choose("fp8", weight, None, torch.float32, lambda x, w: ("library", x.shape[0]),
                                [gemv, *tiles])
    assert chosen == SmallBatchKernels((gemv, tiles[0], None))
    assert (gemv, 16) not in timed and (gemv, 32) not in timed and len(timed) == 4 + 3 + 3
    # Once per weight shape: another layer of the same shape reuses the choice without timing.
    assert small_batch.choose("fp8", weight, None, torch.float32, lambda x, w: None, [gemv, *tiles]) is chosen
    assert len(timed) == 10


def test_buckets_with_only_the_library_time_nothing(monkeypatch):
    """Offered GEMV configs only, the 16- and 32-row buckets keep the library without timing it."""
    gemv = next(c for c in FP8_CONFIGS if c.gemv)
    timed: list[tuple] = []

    def fake_seconds(run):
        timed.append(run(0))
        return {"library": 2.0, gemv: 1.0}[run(0)[0]]

    from treadle.kernels import small_batch as small_batch_kernels

    monkeypatch.setattr(small_batch, "graph_seconds", fake_seconds)
    monkeypatch.setattr(small_batch, "weight_copies", lambda weight: [weight])
    monkeypatch.setattr(small_batch_kernels, "small_batch_matmul", lambda x, w, s, config: (config, x.shape[0]))
    monkeypatch.setattr(small_batch, "_choices", {})
    chosen = small_batch.choose("16-bit", torch.zeros(64, 32), None, torch.float32,
                                lambda x, w: ("library", x.shape[0]), [gemv])
    assert chosen == SmallBatchKernels((gemv, None, None))
    assert timed == [("library", 1), (gemv, 1)]


def test_llama_links_each_linear_layer_to_the_next_ones_weight(tmp_path, monkeypatch):
    """After loading, every linear layer (forward order: each layer's qkv, o, gate_up, down, then lm_head) holds
    the head of the next one's weight for its decode kernel to prefetch; lm_head's is layer 0's qkv (next step)."""
    from treadle.core.config import ModelConfig
    from treadle.core.loading.model_loader import load_model
    from treadle.core.registry import build_registry
    from treadle.testing.models import make_tiny_llama

    limits = []
    # A stand-in for the uint8 view of the weight's head (a Parameter would be registered on the layer).
    monkeypatch.setattr(small_batch, "l2_prefetch_bytes",
                        lambda weight, limit: limits.append(limit) or SimpleNamespace(of=weight))
    monkeypatch.setenv("TREADLE_L2_PREFETCH_MB", "0.5")
    registry = build_registry(plugin_modules=["treadle.plugins.models.llama"], load_entry_points=False)
    model, _, _ = load_model(ModelConfig(path=make_tiny_llama(tmp_path / "llama"), device="cpu", dtype="float32"),
                             registry)
    layers = model.model.layers
    expected = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                for layer in layers]
    order = [linear for group in expected for linear in group] + [model.lm_head]
    for linear, following in zip(order, order[1:] + order[:1]):
        assert linear.l2_prefetch.of is following.weight
    assert set(limits) == {2**19} and len(limits) == len(order)


def test_l2_prefetch_is_off_on_the_cpu_and_at_zero_megabytes(monkeypatch):
    weight = torch.zeros(64, 64)
    assert small_batch.l2_prefetch_bytes(weight, 2**20) is None  # a CPU tensor
    layers = [torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)]
    monkeypatch.setenv("TREADLE_L2_PREFETCH_MB", "0")
    monkeypatch.setattr(small_batch, "l2_prefetch_bytes",
                        lambda weight, limit: None if limit < 128 else pytest.fail("prefetch asked at 0 MB"))
    small_batch.chain_l2_prefetch(layers)
    assert all(layer.l2_prefetch is None for layer in layers)


def test_a_cpu_forward_needs_no_triton():
    """Triton is an optional extra: off a GPU no small-batch kernel is chosen, so a gated MLP (whose gate_up asks
    for the fused SiLU·mul first) runs without importing it."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from treadle.layers.mlp import GatedMLP\n"
            "print(tuple(GatedMLP(64, 128)(torch.randn(3, 64)).shape))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "(3, 64)", proc.stderr[-2000:]
