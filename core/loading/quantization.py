"""Which quantization a model is loaded with: ``model.quantization`` and the checkpoint's ``quantization_config``.

This module only decides and validates (pure data); the linear layers of the
model plugins read the resulting :class:`QuantizationConfig` and pick their
matmul method from it (``layers/fp8.py`` for ``fp8``).

FP8 here is OCP ``float8_e4m3fn`` (max 448) with float32 scales:
- weights: one scale per output channel (``quantization: fp8`` on a bf16/fp16
  checkpoint), or the checkpoint's per-tensor / per-channel ``weight_scale``;
- activations: one scale per token computed on the fly (``dynamic``), or the
  checkpoint's ``input_scale`` (``static``).
The matmul is ``torch._scaled_mm``. A GPU without FP8 tensor cores (compute
capability below 8.9) refuses ``quantization: fp8`` and dequantizes an FP8
checkpoint to the model dtype at load instead (same weights, no speed-up).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Literal

import torch

from treadle.kernels.fp8_ops import FP8_DTYPE, FP8_MAX  # noqa: F401  (re-exported: the format's facts)

logger = logging.getLogger(__name__)

# Merged projections and the checkpoint names of their parts (for ``ignored_layers`` lists that name the parts).
MERGED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class QuantizationError(ValueError):
    """The requested or stored quantization cannot be used; the message says why and what would work."""


@dataclass(frozen=True)
class QuantizationConfig:
    """How the linear layers of one model are quantized.

    ``checkpoint_quantized``: the checkpoint stores FP8 weights (+ ``weight_scale``) to load as they are;
    otherwise weights are quantized after loading. ``dequantize``: no FP8 matmul on this device, so FP8
    checkpoint weights are widened to the model dtype at load. ``ignored_layers``: module names kept in
    the model dtype (the embeddings are never quantized). ``lm_head``: the output projection is FP8 too (True), or
    where its shape allows (``"auto"``); ``lm_head_exact_top``: how many of each row's best FP8 logits it
    recomputes from its 16-bit weight (``layers/exact_top_logits.py``).
    """

    method: Literal["fp8"] = "fp8"
    checkpoint_quantized: bool = False
    activation_scheme: Literal["dynamic", "static"] = "dynamic"
    ignored_layers: tuple[str, ...] = field(default_factory=tuple)
    dequantize: bool = False
    lm_head: bool | Literal["auto"] = False
    lm_head_exact_top: int = 0

    def is_ignored(self, prefix: str) -> bool:
        """Whether the layer named ``prefix`` (e.g. ``model.layers.0.self_attn.qkv_proj``) stays unquantized."""
        if not self.ignored_layers or not prefix:
            return False
        if prefix in self.ignored_layers:
            return True
        parent, _, name = prefix.rpartition(".")
        parts = [f"{parent}.{part}" if parent else part for part in MERGED_PARTS.get(name, ())]
        hits = [part for part in parts if part in self.ignored_layers]
        if hits and len(hits) != len(parts):
            raise QuantizationError(
                f"ignored_layers names {hits} but not the other parts of the merged layer {prefix}; "
                "the parts of one merged projection must all be quantized or all be ignored"
            )
        return bool(hits)


def resolve_quantization(requested: str | None, hf_config: Any, device: torch.device,
                         lm_head: bool | Literal["auto"] = False, lm_head_exact_top: int = 0
                         ) -> QuantizationConfig | None:
    """The quantization for ``model.quantization`` = ``requested`` (and ``model.quantize_lm_head`` = ``lm_head``,
    ``model.lm_head_exact_top``) and the checkpoint's ``quantization_config``."""
    stored = stored_quantization(hf_config)
    if stored is None and requested is None:
        if lm_head is True:
            raise QuantizationError("model.quantize_lm_head needs FP8 weights: set model.quantization: fp8 "
                                    "(or load an FP8 checkpoint), or drop model.quantize_lm_head")
        return None
    if requested not in (None, "fp8"):
        raise QuantizationError(f"model.quantization '{requested}' is not supported; use fp8 or leave it empty")
    reason = fp8_matmul_unsupported(device)
    if stored is None:
        if reason is not None:
            raise QuantizationError(f"model.quantization: fp8 {reason}; leave model.quantization empty on this device")
        return QuantizationConfig(lm_head=lm_head, lm_head_exact_top=lm_head_exact_top)
    config = _checkpoint_config(stored)
    if reason is not None:
        logger.warning("FP8 checkpoint: this device %s, so its weights are dequantized at load", reason)
        return QuantizationConfig(checkpoint_quantized=True, activation_scheme=config.activation_scheme,
                                  ignored_layers=config.ignored_layers, dequantize=True)
    return replace(config, lm_head=lm_head, lm_head_exact_top=lm_head_exact_top)


def fp8_matmul_unsupported(device: torch.device | str) -> str | None:
    """None when ``torch._scaled_mm`` runs FP8 on ``device``; otherwise why not (a phrase after "this device")."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return gpu_fp8_unsupported(torch.cuda.get_device_name(device), (major, minor))
    if device.type == "cpu":
        return None if _cpu_scaled_mm_works() else "has no FP8 matmul (torch._scaled_mm) on the CPU in this torch build"
    return f"has no FP8 matmul on '{device.type}'"


def gpu_fp8_unsupported(name: str, capability: tuple[int, int]) -> str | None:
    """Why a GPU of this compute capability cannot run FP8 matmuls (None when it can)."""
    if capability >= (8, 9):
        return None
    return (f"needs FP8 tensor cores (compute capability 8.9 or newer: L4, L40S, H100, H200, B200); "
            f"this GPU ({name}) is {capability[0]}.{capability[1]}")


def stored_quantization(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a dict (None when it has none)."""
    stored = getattr(hf_config, "quantization_config", None)
    if stored is None:
        return None
    if not isinstance(stored, dict):
        stored = stored.to_dict() if hasattr(stored, "to_dict") else dict(vars(stored))
    return stored


def _checkpoint_config(stored: dict[str, Any]) -> QuantizationConfig:
    method = stored.get("quant_method")
    if method != "fp8":
        raise QuantizationError(
            f"the checkpoint's quantization_config has quant_method '{method}', which treadle cannot load; "
            "supported: fp8 (per-tensor or per-channel weight_scale)"
        )
    if stored.get("weight_block_size"):
        raise QuantizationError(
            f"the checkpoint is block-wise FP8 (weight_block_size {stored['weight_block_size']}); treadle loads "
            "per-tensor or per-channel FP8 only"
        )
    scheme = stored.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantizationError(f"the checkpoint's activation_scheme '{scheme}' is not supported; dynamic or static")
    ignored = stored.get("ignored_layers") or stored.get("modules_to_not_convert") or []
    return QuantizationConfig(checkpoint_quantized=True, activation_scheme=scheme, ignored_layers=tuple(ignored))


@lru_cache(maxsize=1)
def _cpu_scaled_mm_works() -> bool:
    a = torch.ones(1, 16, dtype=FP8_DTYPE)
    b = torch.ones(16, 16, dtype=FP8_DTYPE).t()
    one = torch.ones(1, 1)
    try:
        torch._scaled_mm(a, b, scale_a=one, scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True
