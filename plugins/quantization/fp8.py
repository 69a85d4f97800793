"""The ``fp8`` quantization method: FP8 checkpoints (``quant_method: fp8``) and ``model.quantization: fp8`` on a
16-bit checkpoint (quantized at load). The layers are ``treadle.layers.fp8``; core's
:class:`~treadle.core.loading.quantization.QuantizationConfig` says how (see docs/quantization.md)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from treadle.core.hookspecs import Register, hookimpl
from treadle.core.loading.quantization import QuantizationConfig, resolve_quantization
from treadle.core.loading.quantization_method import QuantizationMethod, QuantizationRequest


class Fp8Method(QuantizationMethod):
    """OCP FP8 weights with per-tensor or per-channel scales, dynamic or static activation scales."""

    checkpoint_methods = ("fp8",)
    supports = "FP8 checkpoints (per-tensor or per-channel weight_scale), or any 16-bit checkpoint quantized at load"

    def build(self, stored: dict[str, Any] | None, request: QuantizationRequest) -> QuantizationConfig | None:
        return resolve_quantization("fp8", SimpleNamespace(quantization_config=stored), request.device,
                                    lm_head=request.lm_head, lm_head_exact_top=request.lm_head_exact_top)


@hookimpl
def treadle_register_quantization_methods(register: Register) -> None:
    register("fp8", Fp8Method)
