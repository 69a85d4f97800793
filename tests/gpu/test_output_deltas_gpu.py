"""Per-request output deltas through CUDA graphs: a hand-rolled LoRA (tests/hand_lora.py) registered on a tiny
Llama gives the same logits when decode steps replay the decode graphs and prefills the piecewise graphs (the
batch context copied into their static inputs) as when both run eagerly; a batch without a context runs no
adapter."""

from __future__ import annotations

import pytest
import torch

from graph_replays import ReplayCounter
from hand_lora import HandLora, HandSteps, model_config
from treadle.core.config import load_config
from treadle.core.execution.worker import ModelWorker
from treadle.core.registry import build_registry
from treadle.testing.models import make_tiny_llama

pytestmark = pytest.mark.gpu

PROMPTS = {1: [5, 17, 42, 8, 99, 3], 2: [250, 11, 7], 3: [64, 31, 2, 9, 77]}  # 14 tokens: a piecewise graph
ADAPTERS = {1: 0, 3: 1}  # row 2: none
DECODED = [[3, 18, 40], [300, 2, 41]]  # two decode steps of three requests: the graph of 4, padded
PIECEWISE_TOKENS = 64


def _worker(model_dir: str, dtype: str, graphs: bool) -> ModelWorker:
    overrides = model_config(model_dir, **{"model.device": "cuda", "model.dtype": dtype, "attention.backend": "triton",
                                           "runtime.disable_cuda_graph": not graphs, "runtime.cuda_graph_max_bs": 8,
                                           "runtime.piecewise_cuda_graph_max_tokens": PIECEWISE_TOKENS,
                                           "scheduler.max_running_requests": 8})
    registry = build_registry(["treadle.plugins.models.llama", "treadle.plugins.attention.triton.backend",
                               "treadle.plugins.kv_allocators.token"], load_entry_points=False)
    return ModelWorker(load_config(overrides=overrides, use_env=False), registry)


class _ThroughTheWorker:
    """What HandSteps drives: the runner's pools and backend, forwards through the worker's graphs."""

    def __init__(self, worker: ModelWorker) -> None:
        self.worker = worker

    def __getattr__(self, name: str):
        return getattr(self.worker.runner, name)

    def forward(self, forward_batch):
        return self.worker.forward(forward_batch)


def _with_deltas(lora: HandLora, dtype: str, graphs: bool) -> ModelWorker:
    worker = _worker(lora.model_dir, dtype, graphs)
    lora.register(worker.runner.model)
    if graphs:  # graphs captured before the deltas were registered hold none: capture them again
        worker.capture_graphs()
        assert worker.cuda_graphs.batch_context is not None
    return worker


def _steps(worker: ModelWorker, adapters: dict[int, int] | None) -> list[torch.Tensor]:
    steps = HandSteps(_ThroughTheWorker(worker), adapters)
    logits = [steps.extend(PROMPTS)]
    for tokens in DECODED:
        logits.append(steps.decode(dict(zip(PROMPTS, tokens))))
    return logits


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-3), ("bfloat16", 6e-2)])
def test_graphs_replay_the_deltas_of_each_requests_adapter(tmp_path, dtype, tolerance):
    lora = HandLora(make_tiny_llama(tmp_path / "llama"))
    eager = _steps(_with_deltas(lora, dtype, graphs=False), ADAPTERS)
    graphed_worker = _with_deltas(lora, dtype, graphs=True)
    decode_replays = ReplayCounter(graphed_worker.cuda_graphs)
    prefill_replays = ReplayCounter(graphed_worker.piecewise_graphs)
    graphed = _steps(graphed_worker, ADAPTERS)
    assert decode_replays.count == len(DECODED) and prefill_replays.count == 1
    for got, expected in zip(graphed, eager):
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)

    base = _steps(_worker(lora.model_dir, dtype, graphs=False), None)
    for got, expected in zip(graphed, base):  # the adapters moved their requests' logits far past the tolerance
        assert (got - expected).abs().max() > 20 * tolerance
    row_2 = (slice(6, 9), slice(1, 2), slice(1, 2))  # request row 2 (no adapter): its prompt's rows, then decodes
    for got, expected, rows in zip(graphed, base, row_2):
        torch.testing.assert_close(got[rows], expected[rows], atol=tolerance, rtol=tolerance)
    # A batch without a context: the static adapter ids read "none", so every row is the base model's.
    for got, expected in zip(_steps(graphed_worker, None), base):
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
