"""``attention.backend: auto``: the registered backends ranked by ``auto_priority`` on the device, the first
whose constructor accepts the model; explicit names bypass the ranking."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from treadle.core.execution.attention import AttentionBackend, RadixAttention, build_attention_backend, model_sliding_windows
from treadle.core.execution.attention_context import AttentionContext
from treadle.core.registry import build_registry


def _context(device: str) -> AttentionContext:
    """A backend's view of a model on ``device`` (the refusals below never reach the pools)."""
    return AttentionContext(device=torch.device(device), dtype=torch.float16, kv_dtype=torch.float16, num_layers=1,
                            num_heads=2, num_kv_heads=1, head_dim=8, page_size=1, context_len=16,
                            req_to_token_pool=None, kv_cache=None)  # type: ignore[arg-type]


class _Backend(AttentionBackend):
    priority: dict[str, int] = {}
    refuses = False

    @classmethod
    def auto_priority(cls, device: torch.device) -> int | None:
        return cls.priority.get(device.type)

    def __init__(self, context) -> None:
        if self.refuses:
            raise ValueError(f"{type(self).__name__} does not take this model")

    def init_forward_metadata(self, forward_batch) -> None: ...
    def forward_extend(self, *args, **kwargs): ...
    def forward_decode(self, *args, **kwargs): ...


class Fast(_Backend):
    priority = {"cuda": 20}


class Fallback(_Backend):
    priority = {"cuda": 10}


class Anywhere(_Backend):
    priority = {"cuda": 0, "cpu": 0}


class Unranked(_Backend):
    pass


class _Registry:
    def __init__(self, backends: dict) -> None:
        self.backends = backends

    def names(self, kind: str) -> list[str]:
        return sorted(self.backends)

    def get(self, kind: str, name: str):
        return self.backends[name]


def _registry(**refusing: bool) -> _Registry:
    classes = {"fast": Fast, "fallback": Fallback, "anywhere": Anywhere, "unranked": Unranked}
    return _Registry({name: type(cls.__name__, (cls,), {"refuses": refusing.get(name, False)})
                      for name, cls in classes.items()})


def test_auto_takes_the_highest_ranked_backend_on_the_device() -> None:
    backend, name = build_attention_backend(_registry(), "auto", _context("cuda:0"))
    assert name == "fast" and type(backend).__name__ == "Fast"
    _, name = build_attention_backend(_registry(), "auto", _context("cpu"))
    assert name == "anywhere"  # the GPU-only backends do not rank themselves on the CPU


def test_auto_skips_a_backend_that_refuses_the_model_and_logs_why(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="treadle.core.execution.attention"):
        _, name = build_attention_backend(_registry(fast=True), "auto", _context("cuda"))
    assert name == "fallback"
    assert "skipped fast (Fast does not take this model)" in caplog.text


def test_auto_without_any_accepting_backend_says_what_each_refused() -> None:
    with pytest.raises(RuntimeError) as exc:
        build_attention_backend(_registry(anywhere=True), "auto", _context("cpu"))
    assert "anywhere: Anywhere does not take this model" in str(exc.value)
    assert "set attention.backend" in str(exc.value)


def test_an_explicit_name_is_built_even_when_unranked() -> None:
    backend, name = build_attention_backend(_registry(), "unranked", _context("cpu"))
    assert name == "unranked" and type(backend).__name__ == "Unranked"


def test_built_in_ranking_on_cuda_and_on_the_cpu() -> None:
    registry = build_registry()

    def ranked(device: str) -> list[str]:
        ranks = {name: registry.get("attention", name).auto_priority(torch.device(device))
                 for name in registry.names("attention")}
        return sorted((n for n, r in ranks.items() if r is not None), key=lambda n: -ranks[n])

    assert ranked("cuda")[:4] == ["flashinfer_triton", "flashinfer", "triton", "torch_native"]
    assert ranked("cpu") == ["torch_native"]


def test_flashinfer_refuses_layers_with_different_windows_so_auto_moves_on() -> None:
    from treadle.plugins.attention.flashinfer import FlashInferAttnBackend

    runner = SimpleNamespace(device="cuda", layer_sliding_windows=(None, 4096, None), sliding_window=None)
    with pytest.raises(ValueError, match="one sliding window for every layer.*attention.backend: triton"):
        FlashInferAttnBackend(runner)


def test_model_sliding_windows_lists_each_layer() -> None:
    layers = torch.nn.ModuleList([RadixAttention(4, 8, 0.3, 2, 0, sliding_window_size=None),
                                  RadixAttention(4, 8, 0.3, 2, 1, sliding_window_size=16),
                                  RadixAttention(4, 8, 0.3, 2, 2, sliding_window_size=0)])
    assert model_sliding_windows(layers) == (None, 16, None)
