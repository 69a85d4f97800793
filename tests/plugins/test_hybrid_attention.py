"""`flashinfer_triton` routes each decode batch by its size alone (small: Triton, large: FlashInfer) and every
prefill or mixed batch to FlashInfer, for eager steps and CUDA-graph capture and replay alike. The two real
backends need a GPU (tests/gpu checks the real pair); here each is a recorder."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from treadle.core.execution.forward_batch import ForwardMode
from treadle.plugins.attention import hybrid
from treadle.plugins.speculators.eagle3 import reads_device_lengths


class _Recorder:
    fill_value = 1

    def __init__(self, model_runner) -> None:
        self.calls: list[tuple] = []

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.fill_value

    def __getattr__(self, name):
        if name.startswith(("init_", "forward_")):
            return lambda *args, **kwargs: self.calls.append((name, *args, *kwargs.values())) or name
        raise AttributeError(name)


class _Large(_Recorder):
    pass


class _Small(_Recorder):
    def verifies_by_decode(self, mode: ForwardMode, num_tokens: int) -> bool:
        return mode.is_verify() and num_tokens <= 20

    def decodes_by_device_lengths(self) -> bool:
        return True


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(hybrid, "FlashInferAttnBackend", _Large)
    monkeypatch.setattr(hybrid, "TritonAttnBackend", _Small)
    built = hybrid.FlashInferTritonAttnBackend(SimpleNamespace())
    built.small_decode_batch = 8
    return built


def _batch(mode: ForwardMode, bs: int, tokens_per_req: int = 1, tree_mask: object = None) -> SimpleNamespace:
    return SimpleNamespace(forward_mode=mode, batch_size=bs, num_tokens=bs * tokens_per_req, tree_mask=tree_mask)


def _names(recorder: _Recorder) -> list[str]:
    return [call[0] for call in recorder.calls]


def test_decode_batches_go_by_size_and_prefills_to_flashinfer(backend) -> None:
    for mode, bs in ((ForwardMode.DECODE, 8), (ForwardMode.DECODE, 9), (ForwardMode.EXTEND, 2),
                     (ForwardMode.MIXED, 3)):
        batch = _batch(mode, bs)
        backend.init_forward_metadata(batch)
        backend.forward("q", "k", "v", "layer", batch)
    assert _names(backend.small) == ["init_forward_metadata", "forward_decode"]
    assert backend.small.calls[1][-2].batch_size == 8
    assert _names(backend.large) == ["init_forward_metadata", "forward_decode", "init_forward_metadata",
                                     "forward_extend", "init_forward_metadata", "forward_extend"]


def test_cuda_graphs_capture_and_replay_each_size_with_one_backend(backend) -> None:
    backend.init_cuda_graph_state(32, 32)
    # Scratch only for the sizes it runs (and, up to its own cap, a row per token of the verify steps it runs).
    assert backend.small.calls == [("init_cuda_graph_state", 8, 32)]
    assert backend.large.calls == [("init_cuda_graph_state", 32, 32)]
    for bs in (1, 8, 16, 32):
        backend.init_forward_metadata_capture_cuda_graph(bs, bs, "pool", "lens", ForwardMode.DECODE)
        backend.init_forward_metadata_replay_cuda_graph(bs, "pool", "lens", bs, ForwardMode.DECODE, "lens_cpu")
    captured = {name: [call[1] for call in r.calls if call[0].endswith("capture_cuda_graph")]
                for name, r in (("small", backend.small), ("large", backend.large))}
    replayed = {name: [call[1] for call in r.calls if call[0].endswith("replay_cuda_graph")]
                for name, r in (("small", backend.small), ("large", backend.large))}
    assert captured == replayed == {"small": [1, 8], "large": [16, 32]}


def test_backends_that_pad_graphs_differently_are_refused(monkeypatch) -> None:
    monkeypatch.setattr(hybrid, "FlashInferAttnBackend", _Large)
    monkeypatch.setattr(hybrid, "TritonAttnBackend", type("_Odd", (_Recorder,), {"fill_value": 0}))
    with pytest.raises(ValueError, match="pad CUDA-graph batches with one length"):
        hybrid.FlashInferTritonAttnBackend(SimpleNamespace())


def test_without_flashinfer_the_constructor_refuses_so_auto_moves_on() -> None:
    pytest.importorskip("triton")
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        pass
    else:  # pragma: no cover - only where FlashInfer is installed
        pytest.skip("FlashInfer is installed here")
    runner = SimpleNamespace(device="cuda", layer_sliding_windows=(None,))
    with pytest.raises(RuntimeError, match="needs FlashInfer"):
        hybrid.FlashInferTritonAttnBackend(runner)


def test_every_decode_batch_goes_to_triton_by_default(monkeypatch) -> None:
    monkeypatch.setattr(hybrid, "FlashInferAttnBackend", _Large)
    monkeypatch.setattr(hybrid, "TritonAttnBackend", _Small)
    built = hybrid.FlashInferTritonAttnBackend(SimpleNamespace())
    for bs in (1, 512, 4096):
        built.init_forward_metadata(_batch(ForwardMode.DECODE, bs))
    assert [call[-1].batch_size for call in built.small.calls] == [1, 512, 4096]
    assert built.large.calls == []
    built.init_cuda_graph_state(512, 512)
    assert built.small.calls[-1] == ("init_cuda_graph_state", 512, 512)
    assert built.large.calls == []  # no decode batch replays through FlashInfer: no graph page table for it


def test_rotary_is_applied_by_the_decode_backend_only_for_its_decode_batches(monkeypatch) -> None:
    class _Rotating(_Small):
        def applies_rotary(self, forward_batch) -> bool:
            return forward_batch.forward_mode.is_decode()

    class _Plain(_Large):
        def applies_rotary(self, forward_batch) -> bool:
            return False

    monkeypatch.setattr(hybrid, "FlashInferAttnBackend", _Plain)
    monkeypatch.setattr(hybrid, "TritonAttnBackend", _Rotating)
    built = hybrid.FlashInferTritonAttnBackend(SimpleNamespace())
    built.small_decode_batch = 8
    decode, large_decode, prefill = _batch(ForwardMode.DECODE, 8), _batch(ForwardMode.DECODE, 9), _batch(
        ForwardMode.EXTEND, 2)
    assert built.applies_rotary(decode)
    assert not built.applies_rotary(large_decode) and not built.applies_rotary(prefill)
    built.forward("q", "k", "v", "layer", decode, rotary=("cos", "sin"))
    built.forward("q", "k", "v", "layer", large_decode)
    assert built.small.calls == [("forward_decode", "q", "k", "v", "layer", decode, True, ("cos", "sin"))]
    assert built.large.calls == [("forward_decode", "q", "k", "v", "layer", large_decode, True)]


def test_verify_steps_go_to_the_triton_decode_kernel_up_to_its_token_cap(backend) -> None:
    small, large = _batch(ForwardMode.TARGET_VERIFY, 4, 5), _batch(ForwardMode.TARGET_VERIFY, 5, 5)
    for batch in (small, large):
        backend.init_forward_metadata(batch)
        backend.forward("q", "k", "v", "layer", batch)
        backend.init_forward_metadata_capture_cuda_graph(batch.batch_size, batch.num_tokens, "pool", "lens",
                                                         ForwardMode.TARGET_VERIFY)
        backend.init_forward_metadata_replay_cuda_graph(batch.batch_size, "pool", "lens", 0,
                                                        ForwardMode.TARGET_VERIFY, "lens_cpu", batch.num_tokens)
    steps = ["init_forward_metadata", "forward_extend", "init_forward_metadata_capture_cuda_graph",
             "init_forward_metadata_replay_cuda_graph"]
    assert _names(backend.small) == _names(backend.large) == steps
    assert backend.small.calls[1][-2] is small and backend.large.calls[1][-2] is large


def test_draft_tree_verify_steps_go_to_flashinfer_whatever_their_size(backend) -> None:
    tree = _batch(ForwardMode.TARGET_VERIFY, 1, 5, tree_mask="mask")  # 5 tokens: under the Triton half's cap
    backend.init_forward_metadata(tree)
    backend.forward("q", "k", "v", "layer", tree)
    backend.init_forward_metadata_capture_cuda_graph(1, 5, "pool", "lens", ForwardMode.TARGET_VERIFY, tree_mask="mask")
    backend.init_forward_metadata_replay_cuda_graph(1, "pool", "lens", 0, ForwardMode.TARGET_VERIFY, "lens_cpu", 5,
                                                    tree_mask="mask")
    assert _names(backend.small) == []
    assert _names(backend.large) == ["init_forward_metadata", "forward_extend",
                                     "init_forward_metadata_capture_cuda_graph",
                                     "init_forward_metadata_replay_cuda_graph"]


def test_eagle3_drafts_on_the_device_only_while_every_decode_batch_goes_to_triton(backend) -> None:
    # FlashInfer plans its decode steps from the host's lengths, which an overlapped verify step leaves as upper
    # bounds (decodes_by_device_lengths); on the CPU host and device are one.
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not backend.decodes_by_device_lengths()
    assert not reads_device_lengths(backend, cuda) and reads_device_lengths(backend, cpu)
    backend.small_decode_batch = None
    assert backend.decodes_by_device_lengths() and reads_device_lengths(backend, cuda)
