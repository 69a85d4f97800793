"""The batch context layers read (core/execution/batch_context.py): a batch's per-token rows, the current context
around a forward, what a model's modules declare they read, and the static copies CUDA graphs replay from."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from treadle.core.execution.batch_context import (
    NO_ADAPTER,
    BatchContext,
    BatchContextLayout,
    ContextTensor,
    StaticBatchContext,
    current_batch_context,
    model_context_layout,
    using_batch_context,
)
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.execution.worker import adapter_context
from treadle.kernels.lora_choice import LoRAKernelChoice
from treadle.layers.linear import ColumnParallelLinear, RowParallelLinear
from treadle.plugins.lora_backends import triton as triton_lora
from treadle.plugins.lora_backends.torch import TorchLoRABackend

STEERING = BatchContextLayout(per_request={"steer": ContextTensor((4,), torch.float32)})


def _batch(mode: ForwardMode, tokens: int, batch_size: int, extend_lens: list[int] | None = None) -> ForwardBatch:
    lens = torch.tensor(extend_lens) if extend_lens is not None else None
    return ForwardBatch(
        forward_mode=mode, batch_size=batch_size, input_ids=torch.zeros(tokens, dtype=torch.int64),
        positions=torch.zeros(tokens, dtype=torch.int64), req_pool_indices=torch.arange(batch_size),
        seq_lens=torch.ones(batch_size, dtype=torch.int64), seq_lens_cpu=torch.ones(batch_size, dtype=torch.int64),
        out_cache_loc=torch.zeros(tokens, dtype=torch.int64), seq_lens_sum=batch_size,
        logits_indices=torch.arange(batch_size), req_to_token_pool=None, kv_cache=None, attn_backend=None,
        extend_seq_lens=lens)


def test_an_extend_batch_maps_each_token_to_its_request_and_adapter():
    batch = _batch(ForwardMode.EXTEND, 6, 3, [3, 1, 2])
    steer = torch.arange(12.0).view(3, 4)
    context = BatchContext.for_batch(batch, torch.tensor([1, NO_ADAPTER, 0]), per_request={"steer": steer})
    assert context.token_requests.tolist() == [0, 0, 0, 1, 2, 2]
    assert context.adapter_ids.tolist() == [1, 1, 1, NO_ADAPTER, 0, 0]
    assert context.adapter_order.tolist() == [3, 4, 5, 0, 1, 2]  # by slot, stable: what LoRA kernels sort by
    assert torch.equal(context.request_values("steer"), steer[[0, 0, 0, 1, 2, 2]])


def test_a_step_sorts_its_adapters_only_for_a_lora_backend_that_reads_the_order(monkeypatch):
    # The triton backend built without Triton: only its adapter_order_above (LoRAKernelChoice.sort_above) is read.
    monkeypatch.setattr(triton_lora, "_interpreting", lambda: True)
    monkeypatch.setattr(triton_lora, "_import_kernels", lambda: SimpleNamespace(choice_from_env=LoRAKernelChoice))
    backends = TorchLoRABackend(4, 8, "cpu", torch.float32), triton_lora.TritonLoRABackend(4, 8, "cpu", torch.float32)
    above = backends[1].kernel_choice.sort_above
    batch = SimpleNamespace(entries=[SimpleNamespace(req=SimpleNamespace(lora_slot=s)) for s in (2, NO_ADAPTER, 0, 2)])

    def order(backend, tokens: int) -> torch.Tensor | None:
        step = _batch(ForwardMode.DECODE, tokens, 4)
        return adapter_context(batch, step, backend.adapter_order_above).adapter_order

    assert order(backends[0], 4 * above) is None  # the torch backend never reads it
    assert order(backends[1], above) is None and order(backends[0], above + 4) is None
    tokens = above + 4  # four requests of 17 tokens: slots 2, none, 0, 2
    assert order(backends[1], tokens).tolist() == [*range(17, 34), *range(34, 51), *range(0, 17), *range(51, 68)]


def test_a_decode_batch_has_one_row_per_request_or_equal_runs_of_them():
    assert BatchContext.for_batch(_batch(ForwardMode.DECODE, 3, 3)).token_requests.tolist() == [0, 1, 2]
    # Several new tokens per request (a verify step): each request's run of tokens, in order.
    assert BatchContext.for_batch(_batch(ForwardMode.DECODE, 6, 3)).token_requests.tolist() == [0, 0, 1, 1, 2, 2]
    assert BatchContext.for_batch(_batch(ForwardMode.DECODE, 3, 3)).adapter_ids is None


def test_the_context_is_current_inside_the_block_only():
    outer, inner = BatchContext(torch.zeros(1)), BatchContext(torch.ones(1))
    assert current_batch_context() is None
    with using_batch_context(outer):
        with using_batch_context(inner):
            assert current_batch_context() is inner
        assert current_batch_context() is outer
        with using_batch_context(None):  # a batch without a context hides the outer one
            assert current_batch_context() is None
    assert current_batch_context() is None


def test_a_model_reads_what_its_layers_deltas_declare():
    model = torch.nn.Sequential(ColumnParallelLinear(4, 8), RowParallelLinear(8, 4))
    assert model_context_layout(model) is None  # nothing registered: graphs capture no context
    model[0].add_output_delta(lambda x, context: None, BatchContextLayout(adapter_ids=True))
    remove = model[1].add_output_delta(lambda x, context: None, STEERING)
    model[1].add_output_delta(lambda x, context: None)  # reads nothing
    layout = model_context_layout(model)
    assert layout.adapter_ids and dict(layout.per_request) == dict(STEERING.per_request)
    assert layout.adapter_order_above is None
    model[0].add_output_delta(lambda x, context: None, BatchContextLayout(adapter_ids=True, adapter_order_above=64))
    model[1].add_output_delta(lambda x, context: None, BatchContextLayout(adapter_ids=True, adapter_order_above=8))
    assert model_context_layout(model).adapter_order_above == 8  # the order for every reader that wants it
    remove()
    assert model_context_layout(model) == BatchContextLayout(adapter_ids=True, adapter_order_above=8)


def test_two_readers_must_agree_on_a_tensors_shape():
    other = BatchContextLayout(per_request={"steer": ContextTensor((8,), torch.float32)})
    with pytest.raises(ValueError, match="'steer'"):
        STEERING.merge(other)


def test_a_static_context_takes_a_batch_and_pads_with_no_adapter_and_zeros():
    with torch.inference_mode():  # as graph runners replay: inside ModelRunner.forward
        _check_static_context()


def _check_static_context() -> None:
    layout = BatchContextLayout(adapter_ids=True, per_request=STEERING.per_request,
                                per_token={"scale": ContextTensor((), torch.float32)}, adapter_order_above=2)
    static = StaticBatchContext(layout, max_tokens=8, max_requests=8, device="cpu")
    captured = static.view(4, 4)  # what a graph of 4 rows was captured with
    assert static.view(2, 2).adapter_order is None  # a graph of 2 rows: no reader wants the order
    batch = _batch(ForwardMode.DECODE, 3, 3)
    batch.batch_context = BatchContext.for_batch(batch, torch.tensor([2, NO_ADAPTER, 0]),
                                                 per_request={"steer": torch.ones(3, 4)},
                                                 per_token={"scale": torch.tensor([0.5, 1.5, 2.5])})
    static.per_request["steer"].fill_(7.0)  # stale values of an earlier, larger batch
    static.load(batch, padded_tokens=4, padded_batch_size=4)
    assert captured.adapter_ids.tolist() == [2, NO_ADAPTER, 0, NO_ADAPTER]
    assert captured.adapter_order.tolist() == [1, 3, 2, 0]  # the padded rows sorted, in the captured tensor
    assert captured.token_requests.tolist() == [0, 1, 2, 0]
    assert captured.per_request["steer"].sum(dim=1).tolist() == [4.0, 4.0, 4.0, 0.0]
    assert captured.per_token["scale"].tolist() == [0.5, 1.5, 2.5, 0.0]
    # A batch without a context: no adapter anywhere, zero values, its own request rows.
    static.load(_batch(ForwardMode.DECODE, 2, 2), padded_tokens=4, padded_batch_size=4)
    assert captured.adapter_ids.tolist() == [NO_ADAPTER] * 4 and captured.token_requests.tolist() == [0, 1, 0, 0]
    assert captured.adapter_order.tolist() == [0, 1, 2, 3]
    assert not captured.per_request["steer"].any() and not captured.per_token["scale"].any()
