"""Per-request output deltas on the shared linear layers: a hand-rolled LoRA on q/k/v/o/gate/up/down of a tiny
Llama, two adapters and none mixed in one batch, gives each request the logits of the model with its adapter
merged into the weights (float32, CPU), through the unfused and the fused (torch-reference) paths alike, and
through the Triton one-row GEMVs with their fused epilogues (float16, under the Triton interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hand_lora import HandLora, HandSteps, model_config
from treadle.core.config import load_config
from treadle.core.execution.model_runner import ModelRunner
from treadle.core.registry import build_registry
from treadle.kernels.fused_ops import rmsnorm_reference, silu_mul
from treadle.layers.linear import LinearBase
from treadle.layers.linear_method import UnquantizedLinearMethod
from treadle.testing.models import make_tiny_llama

PLUGINS = ["treadle.plugins.models.llama", "treadle.plugins.attention.torch_native",
           "treadle.plugins.kv_allocators.token"]
# Request rows and their prompts; rows 1 and 3 run adapters 0 and 1, row 2 none.
PROMPTS = {1: [5, 17, 42, 8, 99, 3], 2: [250, 11, 7], 3: [64, 31, 2, 9, 77]}
ADAPTERS = {1: 0, 3: 1}
DECODED = {1: [3, 300], 2: [18, 2], 3: [40, 41]}  # fed back one step at a time, as greedy tokens would be


class TorchFusedMethod(UnquantizedLinearMethod):
    """The fused decode epilogues computed with torch for any batch (the kernels' references), so the fused paths
    of GatedMLP and DecoderLayer run on the CPU; counts its calls."""

    def __init__(self, calls: Counter) -> None:
        self.calls = calls

    def apply_silu_mul(self, layer, x):
        self.calls["silu_mul"] += 1
        return silu_mul(F.linear(x, layer.weight))

    def apply_add_rmsnorm(self, layer, x, residual, norm_weight, eps):
        self.calls["add_rmsnorm"] += 1
        summed = F.linear(x, layer.weight) + residual
        return rmsnorm_reference(summed, norm_weight, eps), summed


@pytest.fixture(scope="module")
def registry():
    return build_registry(PLUGINS, load_entry_points=False)


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return HandLora(make_tiny_llama(tmp_path_factory.mktemp("lora-base")))


@pytest.fixture(scope="module")
def expected(lora, registry, tmp_path_factory):
    """Each request's logits from a model with its adapter merged in (the base model for row 2), run alone."""
    folder = tmp_path_factory.mktemp("merged")
    checkpoints = {row: lora.merged_checkpoint(adapter, folder / f"adapter-{adapter}")
                   for row, adapter in ADAPTERS.items()}
    return {row: run_requests(runner(checkpoints.get(row, lora.model_dir), registry), {row: prompt})[row]
            for row, prompt in PROMPTS.items()}


def runner(model_dir: str, registry) -> ModelRunner:
    return ModelRunner(load_config(overrides=model_config(model_dir), use_env=False), registry)


def run_requests(model_runner: ModelRunner, prompts: dict[int, list[int]],
                 adapters: dict[int, int] | None = None) -> dict[int, torch.Tensor]:
    """Each request's logits: one row per prompt token (one extend step for all), then per decode step."""
    steps = HandSteps(model_runner, adapters)
    logits, start, rows = steps.extend(prompts), 0, {}
    for row, prompt in prompts.items():
        rows[row] = [logits[start:start + len(prompt)]]
        start += len(prompt)
    for step in range(len(next(iter(DECODED.values())))):
        logits = steps.decode({row: DECODED[row][step] for row in prompts})
        for index, row in enumerate(prompts):
            rows[row].append(logits[index:index + 1])
    return {row: torch.cat(parts) for row, parts in rows.items()}


def test_lora_deltas_match_the_merged_weights_per_request(lora, registry, expected):
    model_runner = runner(lora.model_dir, registry)
    lora.register(model_runner.model)
    got = run_requests(model_runner, PROMPTS, ADAPTERS)
    base = expected[2]
    for row in PROMPTS:
        torch.testing.assert_close(got[row], expected[row], atol=2e-4, rtol=1e-4)
    # The adapters move the logits by far more than the tolerance: a dropped delta could not pass.
    adapted = run_requests(runner(lora.model_dir, registry), {2: PROMPTS[1]})[2]
    assert (expected[1] - adapted).abs().max() > 0.5
    assert base.shape == (len(PROMPTS[2]) + 2, 512)


def test_fused_paths_add_the_deltas_too(lora, registry, expected):
    calls = Counter()
    model_runner = runner(lora.model_dir, registry)
    for layer in model_runner.model.modules():
        if isinstance(layer, LinearBase):
            layer.quant_method = TorchFusedMethod(calls)
    without_deltas = run_requests(model_runner, {2: PROMPTS[2]})[2]
    assert calls["silu_mul"] and calls["add_rmsnorm"]  # the fused paths do run here
    torch.testing.assert_close(without_deltas, expected[2], atol=2e-4, rtol=1e-4)

    lora.register(model_runner.model)
    calls.clear()
    got = run_requests(model_runner, PROMPTS, ADAPTERS)  # a new run: each row's K/V slots are written afresh
    for row in PROMPTS:
        torch.testing.assert_close(got[row], expected[row], atol=2e-4, rtol=1e-4)
    assert not calls  # a layer with deltas runs its matmul, the deltas, then the epilogue's math


class FusesOneRow(TorchFusedMethod):
    """Says ahead that its fused add + RMSNorm runs for one-row inputs (as the GPU's one-token GEMV does)."""

    def fuses_add_rmsnorm(self, layer, x):
        return x.shape[0] == 1


@pytest.mark.parametrize("in_place", [True, False])
def test_in_place_deltas_join_the_residual_before_the_fused_norm(in_place):
    """A row-parallel layer whose method fuses add + RMSNorm adds its in-place deltas into the residual and keeps
    the fused kernel (one row); the result is the unfused layer-then-norm's. Other rows, and deltas that return a
    tensor, run unfused with the residual untouched."""
    from treadle.layers.linear import RowParallelLinear
    from treadle.layers.norm import RMSNorm

    torch.manual_seed(0)
    calls = Counter()
    layer, norm = RowParallelLinear(16, 8), RMSNorm(8)
    layer.weight.data.normal_()
    norm.weight.data.uniform_(0.5, 1.5)
    change = torch.randn(8)
    if in_place:
        layer.add_output_delta(lambda x, context, out: out.add_(change * x[:, :1]), in_place=True)
    else:
        layer.add_output_delta(lambda x, context: change * x[:, :1])
    layer.quant_method = FusesOneRow(calls)
    for rows in (1, 3):
        x, residual = torch.randn(rows, 16), torch.randn(rows, 8)
        expected = norm(F.linear(x, layer.weight) + change * x[:, :1], residual.clone())
        kept = residual.clone()
        fused = layer.forward_add_rmsnorm(x, residual, norm)
        if rows == 1 and in_place:
            assert calls["add_rmsnorm"] == 1
            for got, want in zip(fused, expected):
                torch.testing.assert_close(got, want)
        else:
            assert fused is None and torch.equal(residual, kept)
    assert calls["add_rmsnorm"] == (1 if in_place else 0)


def test_removing_the_deltas_restores_the_base_model(lora, registry, expected):
    model_runner = runner(lora.model_dir, registry)
    removers = lora.register(model_runner.model)
    assert len(removers) == 4 * model_runner.num_layers  # qkv, o, gate_up, down per layer
    for remove in removers:
        remove()
    got = run_requests(model_runner, PROMPTS, ADAPTERS)
    torch.testing.assert_close(got[1], run_requests(runner(lora.model_dir, registry), {1: PROMPTS[1]})[1])


def test_the_triton_decode_kernels_step_aside_for_the_deltas(tmp_path):
    pytest.importorskip("triton")
    check = Path(__file__).with_name("interpreted_lora_check.py")
    proc = subprocess.run([sys.executable, str(check), str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))[8:])
    calls = results.pop("fused_calls")
    for row in ("1", "2", "3"):
        assert calls[f"reference {row}"] == {"silu_mul": 2, "add_rmsnorm": 3}  # the merged models ran them fused
        assert calls[f"with deltas {row}"] == {}  # matmul, deltas, then the epilogue's math
        # float16 logits: within a few of their last bits, a hundredth of what an adapter changes.
        assert results[row]["error"] < 0.02
    assert min(results["1"]["adapter_effect"], results["3"]["adapter_effect"]) > 1.0


class SplitsMethod(UnquantizedLinearMethod):
    """Runs a split delta's halves around ``F.linear`` (as the small-batch kernel runs them around its matmul) for
    inputs of up to 2 rows; counts what it ran."""

    def __init__(self, calls: Counter) -> None:
        self.calls = calls

    def apply_split(self, layer, x, split, silu_mul=False, add_rmsnorm=None):
        delta = split() if x.shape[0] <= 2 else None
        if delta is None:
            return None
        self.calls["beside"] += delta.beside
        y = F.linear(x, layer.weight)
        if silu_mul:
            return delta.silu_mul(y)
        if add_rmsnorm is not None:
            return delta.add_rmsnorm(y, *add_rmsnorm)
        delta.add(y)
        return y


class HalvesOfADelta:
    """A SplitDelta adding ``change`` to the layer's output."""

    beside = 1

    def __init__(self, change: torch.Tensor) -> None:
        self.change = change

    def add(self, out):
        out.add_(self.change)

    def silu_mul(self, gate_up):
        return silu_mul(gate_up + self.change)

    def add_rmsnorm(self, y, residual, norm_weight, eps, gemv_warps=None):
        summed = y + self.change + residual
        return rmsnorm_reference(summed, norm_weight, eps), summed


def test_a_split_delta_runs_around_the_methods_matmul_or_apart():
    """A layer whose one delta splits hands it to its method's ``apply_split`` (plain, SiLU·mul, add + RMSNorm); where
    the method runs nothing (here: 3 rows) the in-place delta runs apart, with the same result."""
    from treadle.layers.linear import MergedColumnParallelLinear, RowParallelLinear
    from treadle.layers.norm import RMSNorm

    torch.manual_seed(0)
    calls = Counter()
    gate_up, down, norm = MergedColumnParallelLinear(16, {"gate": 8, "up": 8}), RowParallelLinear(8, 16), RMSNorm(16)
    for layer in (gate_up, down):
        layer.weight.data.normal_()
        change = torch.randn(layer.weight.shape[0])
        layer.add_output_delta(lambda x, context, out, change=change: out.add_(change), in_place=True,
                               split=lambda x, context, change=change: HalvesOfADelta(change))
        layer.quant_method = SplitsMethod(calls)
    for rows in (2, 3):
        x, residual = torch.randn(rows, 16), torch.randn(rows, 16)
        gate_up_out = F.linear(x, gate_up.weight) + gate_up.output_deltas[0].split(x, None).change
        torch.testing.assert_close(gate_up(x), gate_up_out)
        activated = gate_up.forward_silu_mul(x)
        assert (activated is not None) == (rows == 2)
        if activated is None:
            activated = silu_mul(gate_up(x))
        torch.testing.assert_close(activated, silu_mul(gate_up_out))
        summed = F.linear(activated, down.weight) + down.output_deltas[0].split(x, None).change + residual
        fused = down.forward_add_rmsnorm(activated, residual, norm)
        assert (fused is not None) == (rows == 2)
        if fused is None:
            fused = norm(down(activated), residual)
        torch.testing.assert_close(fused[1], summed)
        torch.testing.assert_close(fused[0], rmsnorm_reference(summed, norm.weight, norm.eps))
    assert calls["beside"] == 3  # rows=2: gate_up's forward, its SiLU·mul, down's add + RMSNorm


class HalvesApart(HalvesOfADelta):
    """A SplitDelta whose first half cannot run in a matmul's launch: ``apart`` records the input it ran on."""

    beside = None

    def __init__(self, change: torch.Tensor, order: list) -> None:
        super().__init__(change)
        self.order = order

    def apart(self, x):
        self.order.append(("apart", x))

    def add(self, out):
        self.order.append("add")
        super().add(out)


def test_beside_a_library_matmul_the_split_runs_its_first_half_apart():
    """The plain method on the library matmul (no small-batch config: the CPU, or TREADLE_SMALL_BATCH_MATMUL=library)
    splits too: F.linear, ``apart(x)`` on the layer's input, then the second half; a split without ``apart`` (written
    before it) leaves the layer to run its delta whole."""
    from treadle.layers.linear import RowParallelLinear

    torch.manual_seed(1)
    layer = RowParallelLinear(8, 16)
    layer.weight.data.normal_()
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.small_batch is None
    change, order, x = torch.randn(16), [], torch.randn(3, 8)
    remove = layer.add_output_delta(lambda x, context, out: out.add_(change), in_place=True,
                                    split=lambda x, context: HalvesApart(change, order))
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight) + change)
    assert order[0][0] == "apart" and order[0][1] is x and order[1:] == ["add"]
    remove()
    order.clear()

    def whole(x, context, out):
        order.append("whole")
        out.add_(change)

    layer.add_output_delta(whole, in_place=True, split=lambda x, context: HalvesOfADelta(change))  # beside only
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight) + change)
    assert order == ["whole"]
