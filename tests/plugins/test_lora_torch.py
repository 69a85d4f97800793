"""The `torch` LoRA backend passes the conformance kit's check (core/lora/backend.py's arithmetic)."""

from __future__ import annotations

import pytest
import torch

from treadle.plugins.lora_backends.torch import TorchLoRABackend
from treadle.testing import check_lora_backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_backend_conforms(dtype):
    check_lora_backend(TorchLoRABackend, "cpu", dtype)
