"""The ``gptq`` quantization method: checkpoints written by AutoGPTQ / GPTQModel (``quant_method: gptq``).

The layout (AutoGPTQ's ``QuantLinear``, ``checkpoint_format: gptq``), for a layer of K inputs and N outputs,
``bits`` 4 or 8 (``p = 32 / bits`` values per int32, lowest bits first), groups of ``group_size`` inputs:

- ``qweight`` int32 ``[K / p, N]``: word ``[i, n]`` holds inputs ``i*p .. i*p + p - 1`` of output n, unsigned;
- ``qzeros`` int32 ``[groups, N / p]``: the zero points packed along N, stored minus one
  (``checkpoint_format: gptq_v2`` stores them as they are);
- ``scales`` float16 ``[groups, N]``; ``g_idx`` int32 ``[K]``: each input's group (used with ``desc_act``).

``w[k, n] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])``; ``sym`` checkpoints store the midpoint
``2**(bits - 1)`` as every zero.
"""

from __future__ import annotations

from typing import Any

import torch

from treadle.core.hookspecs import Register, hookimpl
from treadle.core.loading.quantization import QuantizationError
from treadle.core.loading.quantization_method import QuantizationMethod, QuantizationRequest, require_checkpoint
from treadle.layers.packed_int import (
    CheckpointTensor,
    IntWeightScheme,
    PackedIntConfig,
    PackedIntFormat,
    UnpackedWeight,
    unpack_last,
)


class GptqFormat(PackedIntFormat):
    """AutoGPTQ's tensors (see the module docstring)."""

    def __init__(self, scheme: IntWeightScheme, zeros_minus_one: bool = True) -> None:
        super().__init__(scheme)
        self.zeros_minus_one = zeros_minus_one

    def tensors(self, out_features: int, in_features: int, in_full: int, row_parallel: bool
                ) -> list[CheckpointTensor]:
        per_word, group = 32 // self.scheme.bits, self.scheme.group(in_full)
        groups, group_dim = self.scheme.group_layout(in_features, in_full, row_parallel, 0)
        return [
            CheckpointTensor("qweight", (in_features // per_word, out_features), torch.int32, 1, 1, 0, per_word),
            CheckpointTensor("qzeros", (groups, out_features // per_word), torch.int32, 1, per_word, group_dim, group),
            CheckpointTensor("scales", (groups, out_features), torch.float16, 1, 1, group_dim, group),
            CheckpointTensor("g_idx", (in_features,), torch.int32, None, 1, 0, 1),
        ]

    def unpack(self, stored: dict[str, torch.Tensor], out_features: int, in_features: int) -> UnpackedWeight:
        bits = self.scheme.bits
        values = unpack_last(stored["qweight"].t().contiguous(), bits)
        zeros = unpack_last(stored["qzeros"], bits) + (1 if self.zeros_minus_one else 0)
        g_idx = stored["g_idx"] if self.scheme.act_order else None
        return UnpackedWeight(values, stored["scales"].t().float(), zeros.t().float(), g_idx)


class GptqMethod(QuantizationMethod):
    """GPTQ checkpoints: 4 or 8 bits, any group size (or -1), ``desc_act`` (act-order), ``sym`` or not."""

    checkpoint_methods = ("gptq",)
    supports = "GPTQ 4-bit and 8-bit, any group_size, desc_act, sym or asym (checkpoint_format gptq or gptq_v2)"

    def build(self, stored: dict[str, Any] | None, request: QuantizationRequest) -> PackedIntConfig:
        stored = require_checkpoint(stored, "gptq", "gptq")
        bits = int(stored.get("bits", 4))
        if bits not in (4, 8):
            raise QuantizationError(f"the GPTQ checkpoint has {bits}-bit weights; supported: {self.supports}")
        fmt = stored.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantizationError(f"GPTQ checkpoint_format '{fmt}' is not supported; supported: gptq, gptq_v2")
        scheme = IntWeightScheme(bits, int(stored.get("group_size", 128)), bool(stored.get("desc_act", False)))
        ignored = tuple(stored.get("modules_to_not_convert") or ())
        return PackedIntConfig("gptq", GptqFormat(scheme, zeros_minus_one=fmt == "gptq"), ignored, request.device,
                               request.lm_head, request.lm_head_exact_top)


@hookimpl
def treadle_register_quantization_methods(register: Register) -> None:
    register("gptq", GptqMethod)
