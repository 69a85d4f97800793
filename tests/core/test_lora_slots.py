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
