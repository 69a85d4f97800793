"""The ``awq`` quantization method: checkpoints written by AutoAWQ in its GEMM layout (``quant_method: awq``,
``version: gemm``).

For a layer of K inputs and N outputs, 4-bit values, groups of ``group_size`` inputs:

- ``qweight`` int32 ``[K, N / 8]``: eight outputs per word, interleaved: the word's 4-bit field i (lowest first)
  holds output ``8 * j + [0, 2, 4, 6, 1, 3, 5, 7][i]`` of word column j, unsigned;
- ``qzeros`` int32 ``[groups, N / 8]``, packed the same way (no offset);
- ``scales`` float16 ``[groups, N]``.

``w[k, n] = scales[k // group_size, n] * (q[k, n] - zero[k // group_size, n])``.
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

# Field i of a word holds output AWQ_ORDER[i] of its eight; output j sits in field AWQ_FIELD_OF[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_FIELD_OF = (0, 4, 1, 5, 2, 6, 3, 7)


class AwqFormat(PackedIntFormat):
    """AutoAWQ's GEMM tensors (see the module docstring)."""

    def tensors(self, out_features: int, in_features: int, in_full: int, row_parallel: bool
                ) -> list[CheckpointTensor]:
        group = self.scheme.group(in_full)
        groups = in_features // group
        return [
            CheckpointTensor("qweight", (in_features, out_features // 8), torch.int32, 1, 8, 0, 1),
            CheckpointTensor("qzeros", (groups, out_features // 8), torch.int32, 1, 8, 0, group),
            CheckpointTensor("scales", (groups, out_features), torch.float16, 1, 1, 0, group),
        ]

    def unpack(self, stored: dict[str, torch.Tensor], out_features: int, in_features: int) -> UnpackedWeight:
        return UnpackedWeight(_in_output_order(stored["qweight"]).t(), stored["scales"].t().float(),
                              _in_output_order(stored["qzeros"]).t().float())


def _in_output_order(words: torch.Tensor) -> torch.Tensor:
    fields = unpack_last(words, 4)
    rows, columns = fields.shape
    order = torch.tensor(AWQ_FIELD_OF, device=words.device)
    return fields.view(rows, columns // 8, 8).index_select(2, order).reshape(rows, columns)


class AwqMethod(QuantizationMethod):
    """AWQ checkpoints: 4-bit GEMM layout with zero points, group sizes 32-128."""

    checkpoint_methods = ("awq",)
    supports = "AWQ 4-bit, GEMM layout (version gemm), zero points, group_size 32 to 128"

    def build(self, stored: dict[str, Any] | None, request: QuantizationRequest) -> PackedIntConfig:
        stored = require_checkpoint(stored, "awq", "awq")
        bits = int(stored.get("bits", stored.get("w_bit", 4)))
        version = str(stored.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise QuantizationError(f"the AWQ checkpoint is {bits}-bit, version {version}; supported: {self.supports}")
        group = int(stored.get("group_size", stored.get("q_group_size", 128)))
        ignored = tuple(stored.get("modules_to_not_convert") or ())
        return PackedIntConfig("awq", AwqFormat(IntWeightScheme(4, group)), ignored, request.device, request.lm_head,
                               request.lm_head_exact_top)


@hookimpl
def treadle_register_quantization_methods(register: Register) -> None:
    register("awq", AwqMethod)
