"""A linear layer's LoRA delta (core/lora/slots.py) hands its backend the step's context: the adapter ids, and the
tokens sorted by adapter to a backend that takes them (``LoRABackend.adapter_order_above``), and declares that
it reads the order so CUDA graphs past that size sort the tokens once a step."""

from __future__ import annotations

import torch

from treadle.core.execution.batch_context import BatchContext, using_batch_context
from treadle.core.lora.slots import LayerSlots
from treadle.layers.linear import ColumnParallelLinear
from treadle.plugins.lora_backends.torch import TorchLoRABackend


class RecordsCalls(TorchLoRABackend):
    def __init__(self, order_above: int | None) -> None:
        super().__init__(2, 4, "cpu", torch.float32)
        self.adapter_order_above = order_above
        self.orders: list[torch.Tensor | None] = []

    def add_delta(self, x, weights, adapter_ids, out, **order) -> None:
        self.orders.append(order.get("order", "not passed"))
        super().add_delta(x, weights, adapter_ids, out)


def test_the_sorted_order_reaches_only_backends_that_take_it():
    context = BatchContext(torch.arange(3), torch.tensor([1, -1, 0]), adapter_order=torch.tensor([1, 2, 0]))
    for order_above, expected in ((2, [1, 2, 0]), (None, "not passed")):
        layer = ColumnParallelLinear(4, 8)
        backend = RecordsCalls(order_above)
        LayerSlots(layer, [("q_proj", None)], backend, 2, 4, torch.device("cpu"), torch.float32)
        assert layer.batch_context_reads.adapter_order_above == order_above
        with torch.inference_mode(), using_batch_context(context):
            layer(torch.ones(3, 4))
        got = backend.orders[0]
        assert (got.tolist() if isinstance(got, torch.Tensor) else got) == expected


class WantsDenseB(TorchLoRABackend):
    wants_dense_b = True


def test_loading_an_adapter_keeps_the_dense_copy_of_b_current():
    """A backend that ``wants_dense_b`` gets each slot's B transposed and scaled per projection, written when an
    adapter is loaded into the slot (zeros past its rank and for a projection it leaves alone) and cleared with
    it: what ``StackedLoRA.with_dense_b`` computes from ``b`` and the scalings."""
    from treadle.core.lora.adapter import LoRAAdapter, LoRAModule
    from treadle.layers.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(6, {"gate_proj": 5, "up_proj": 3})
    named = [("mlp.gate_proj", "gate_proj"), ("mlp.up_proj", "up_proj")]
    slots = LayerSlots(layer, named, WantsDenseB(3, 4, "cpu", torch.float32), 3, 4, torch.device("cpu"),
                       torch.float32)
    assert LayerSlots(layer, named, TorchLoRABackend(3, 4, "cpu", torch.float32), 3, 4, torch.device("cpu"),
                      torch.float32).weights.dense_b is None
    gen = torch.Generator().manual_seed(0)
    adapter = LoRAAdapter("x", "/x", {"mlp.gate_proj": LoRAModule(torch.randn(2, 6, generator=gen),
                                                                  torch.randn(5, 2, generator=gen), 1.5)})
    other = LoRAAdapter("y", "/y", {"mlp.up_proj": LoRAModule(torch.randn(4, 6, generator=gen),
                                                              torch.randn(3, 4, generator=gen), 0.25)})
    for projection in slots.projections:
        projection.load(2, adapter)
        projection.load(1, other)
    expected = slots.weights.with_dense_b().dense_b
    assert torch.equal(slots.weights.dense_b, expected)
    assert torch.equal(expected[2, :2, :5], 1.5 * adapter.modules["mlp.gate_proj"].b.T)
    assert not expected[2, 2:].any() and not expected[2, :, 5:].any() and not expected[0].any()
    for projection in slots.projections:
        projection.load(2, None)
    assert not slots.weights.dense_b[2].any() and torch.equal(slots.weights.dense_b[1], expected[1])
