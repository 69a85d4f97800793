"""The ``compressed-tensors`` quantization method: checkpoints written by llm-compressor (``quant_method:
compressed-tensors``), in the formats of the ``compressed-tensors`` package:

- ``pack-quantized`` (W4A16, W8A16): ``weight_packed`` int32 ``[N, K * bits / 32]``, each row's values
  ``q + 2**(bits - 1)`` packed along K lowest bits first; ``weight_scale`` ``[N, groups]`` (one group per row for
  the ``channel`` strategy); asymmetric weights add ``weight_zero_point`` int32 ``[N * bits / 32, groups]``, packed
  the same way along N; ``weight_shape`` ``[2]``; act-order (``actorder: group``) adds ``weight_g_idx`` ``[K]``.
  ``w = (q - zero_point) * scale``.
- ``int-quantized`` (W8A16 stored unpacked): ``weight`` int8 ``[N, K]`` and ``weight_scale``.
- ``float-quantized`` (FP8 W8A8, static or dynamic activations): ``weight`` float8_e4m3fn, ``weight_scale`` per
  tensor or per channel, ``input_scale`` when static; these layers are the ``fp8`` method's.
"""

from __future__ import annotations

from typing import Any

import torch

from treadle.core.hookspecs import Register, hookimpl
from treadle.core.loading.quantization import QuantizationConfig, QuantizationError, fp8_matmul_unsupported
from treadle.core.loading.quantization_method import QuantizationMethod, QuantizationRequest, require_checkpoint
from treadle.layers.packed_int import (
    CheckpointTensor,
    IntWeightScheme,
    PackedIntConfig,
    PackedIntFormat,
    UnpackedWeight,
    unpack_last,
)

SUPPORTED = ("pack-quantized (int4/int8 weights, 16-bit activations, group or channel scales, symmetric or not), "
             "int-quantized (int8 weights, 16-bit activations), float-quantized (FP8 W8A8, static or dynamic)")


class PackQuantizedFormat(PackedIntFormat):
    """compressed-tensors' ``pack-quantized`` tensors (see the module docstring)."""

    def __init__(self, scheme: IntWeightScheme, symmetric: bool) -> None:
        super().__init__(scheme)
        self.symmetric = symmetric

    def tensors(self, out_features: int, in_features: int, in_full: int, row_parallel: bool
                ) -> list[CheckpointTensor]:
        per_word, group = 32 // self.scheme.bits, self.scheme.group(in_full)
        groups, group_dim = self.scheme.group_layout(in_features, in_full, row_parallel, 1)
        specs = [
            CheckpointTensor("weight_packed", (out_features, in_features // per_word), torch.int32, 0, 1, 1, per_word),
            CheckpointTensor("weight_scale", (out_features, groups), torch.float32, 0, 1, group_dim, group),
            CheckpointTensor("weight_shape", (2,), torch.int64, None),
        ]
        if not self.symmetric:
            specs.append(CheckpointTensor("weight_zero_point", (out_features // per_word, groups), torch.int32,
                                          0, per_word, group_dim, group))
        if self.scheme.act_order:
            specs.append(CheckpointTensor("weight_g_idx", (in_features,), torch.int32, None, 1, 0, 1))
        return specs

    def unpack(self, stored: dict[str, torch.Tensor], out_features: int, in_features: int) -> UnpackedWeight:
        bits = self.scheme.bits
        zeros = None
        if not self.symmetric:
            zeros = unpack_last(stored["weight_zero_point"].t().contiguous(), bits).t().float()
        return UnpackedWeight(unpack_last(stored["weight_packed"], bits), stored["weight_scale"].float(), zeros,
                              stored.get("weight_g_idx"))


class IntQuantizedFormat(PackedIntFormat):
    """compressed-tensors' ``int-quantized`` 8-bit weights: ``weight`` int8 [N, K] and ``weight_scale``."""

    def tensors(self, out_features: int, in_features: int, in_full: int, row_parallel: bool
                ) -> list[CheckpointTensor]:
        group = self.scheme.group(in_full)
        return [CheckpointTensor("weight", (out_features, in_features), torch.int8, 0, 1, 1, 1),
                CheckpointTensor("weight_scale", (out_features, in_features // group), torch.float32, 0, 1, 1, group)]

    def unpack(self, stored: dict[str, torch.Tensor], out_features: int, in_features: int) -> UnpackedWeight:
        return UnpackedWeight(stored["weight"].to(torch.int32) + 128, stored["weight_scale"].float(), None)


class CompressedTensorsMethod(QuantizationMethod):
    """llm-compressor checkpoints: W4A16 / W8A16 (pack-quantized or int-quantized) and FP8 W8A8."""

    checkpoint_methods = ("compressed-tensors",)
    supports = SUPPORTED

    def build(self, stored: dict[str, Any] | None, request: QuantizationRequest) -> Any:
        stored = require_checkpoint(stored, "compressed-tensors", "compressed-tensors")
        fmt, scheme = _one_scheme(stored)
        ignored = tuple(stored.get("ignore") or ())
        weights, inputs = scheme.get("weights") or {}, scheme.get("input_activations")
        if fmt in ("float-quantized", "naive-quantized") and weights.get("type") == "float":
            return _fp8_config(weights, inputs, ignored, request)
        if inputs is not None:
            raise QuantizationError(f"compressed-tensors {fmt} with quantized activations ({inputs.get('type')} "
                                    f"{inputs.get('num_bits')}-bit) is not supported; supported: {SUPPORTED}")
        strategy = weights.get("strategy")
        if weights.get("type") != "int" or strategy not in ("group", "channel"):
            raise QuantizationError(f"compressed-tensors weights of type {weights.get('type')}, strategy {strategy} "
                                    f"are not supported; supported: {SUPPORTED}")
        bits = int(weights.get("num_bits", 0))
        group = int(weights.get("group_size") or -1) if strategy == "group" else -1
        act_order = weights.get("actorder") in ("group", "weight", True)
        if fmt == "pack-quantized" and bits in (4, 8):
            form = PackQuantizedFormat(IntWeightScheme(bits, group, act_order), bool(weights.get("symmetric", True)))
        elif fmt == "int-quantized" and bits == 8 and weights.get("symmetric", True) and not act_order:
            form = IntQuantizedFormat(IntWeightScheme(8, group))
        else:
            raise QuantizationError(f"compressed-tensors format {fmt} with {bits}-bit weights is not supported; "
                                    f"supported: {SUPPORTED}")
        return PackedIntConfig("compressed-tensors", form, ignored, request.device, request.lm_head,
                               request.lm_head_exact_top)


def _one_scheme(stored: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    groups = list((stored.get("config_groups") or {}).values())
    if not groups:
        raise QuantizationError("the compressed-tensors quantization_config has no config_groups")
    schemes = [{k: v for k, v in group.items() if k != "targets"} for group in groups]
    if any(scheme != schemes[0] for scheme in schemes):
        raise QuantizationError("the compressed-tensors checkpoint mixes several quantization schemes; treadle "
                                "runs one scheme for every quantized layer")
    if any(target not in ("Linear", "re:.*") for group in groups for target in group.get("targets", ["Linear"])):
        raise QuantizationError("compressed-tensors config_groups must target Linear layers; "
                                f"these target {[g.get('targets') for g in groups]}")
    return schemes[0].get("format") or stored.get("format", "dense"), schemes[0]


def _fp8_config(weights: dict[str, Any], inputs: dict[str, Any] | None, ignored: tuple[str, ...],
                request: QuantizationRequest) -> QuantizationConfig:
    if weights.get("num_bits") != 8 or weights.get("strategy") not in ("tensor", "channel"):
        raise QuantizationError(f"compressed-tensors float weights of {weights.get('num_bits')} bits, strategy "
                                f"{weights.get('strategy')} are not supported; supported: {SUPPORTED}")
    if any(name.startswith("re:") for name in ignored if name != "lm_head"):
        raise QuantizationError(f"compressed-tensors FP8 checkpoints with regular expressions in ignore ({ignored}) "
                                "are not supported; list the layers by name")
    scheme = "dynamic" if inputs is None or inputs.get("dynamic", False) else "static"
    dequantize = fp8_matmul_unsupported(request.device) is not None
    return QuantizationConfig(checkpoint_quantized=True, activation_scheme=scheme, ignored_layers=ignored,
                              dequantize=dequantize, lm_head=False if dequantize else request.lm_head,
                              lm_head_exact_top=request.lm_head_exact_top)


@hookimpl
def treadle_register_quantization_methods(register: Register) -> None:
    register("compressed-tensors", CompressedTensorsMethod)
