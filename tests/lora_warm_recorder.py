"""A ``lora_backends`` plugin for the tests (imported by name, see conftest.py): the ``torch`` backend that records
each :meth:`~treadle.core.lora.backend.LoRABackend.warm_up` call the engine makes (``RecordingLoRABackend.calls``:
the number of layers and ``max_tokens``) and says it ran one batch, so the engine logs it; with ``out_of_memory``
set it raises ``torch.OutOfMemoryError`` instead."""

from __future__ import annotations

import torch

from treadle.core.hookspecs import hookimpl
from treadle.plugins.lora_backends.torch import TorchLoRABackend


class RecordingLoRABackend(TorchLoRABackend):
    calls: list[tuple[int, int]] = []
    out_of_memory = False

    def warm_up(self, layers, max_tokens: int) -> int:
        RecordingLoRABackend.calls.append((len(layers), max_tokens))
        if self.out_of_memory:
            raise torch.OutOfMemoryError("no room for the warm-up's scratch tensors")
        return 1


@hookimpl
def treadle_register_lora_backends(register) -> None:
    register("warm_up_recorder", RecordingLoRABackend)
