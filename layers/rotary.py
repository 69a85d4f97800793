"""Rotary position embedding: HF configs' rope settings (default and llama3 scaling), cos/sin tables in float32."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rotary settings of an HF config as one dict with ``rope_theta`` and ``rope_type``.

    Reads transformers 5's ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``.
    """
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        merged = dict(params)
    else:
        merged = dict(getattr(config, "rope_scaling", None) or {})
        merged["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    merged["rope_type"] = merged.get("rope_type") or merged.get("type") or "default"
    return merged


def rope_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies (float32, on the CPU) for rope types ``default`` and ``llama3``."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type in ("default", "mrope"):  # mrope: default frequencies, positions per section (Qwen2.5-VL)
        return inv_freq
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(f"unsupported rope type '{rope_type}' in the model config; supported: default, llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1's frequency-dependent scaling: long wavelengths are divided by `factor`,
    # short ones kept, the band between interpolated smoothly.
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in HF's ``rotate_half`` layout.

    ``inv_freq_per_dim`` is a plain float32 attribute rather than a buffer so that
    casting the model to bf16/fp16 never rounds it; it follows the positions' device.
    """

    def __init__(self, head_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, params)
        # Each frequency twice (rotate_half's layout), so one multiply gives every angle: a decode step launches
        # five small kernels here instead of seven.
        self.inv_freq_per_dim = torch.cat((inv_freq, inv_freq))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[num_tokens, 1, head_dim]``, computed in float32 then cast to ``dtype``."""
        if self.inv_freq_per_dim.device != positions.device:
            self.inv_freq_per_dim = self.inv_freq_per_dim.to(positions.device)
        # int64 x float32 promotes to float32: the same products as converting the positions first.
        angles = (positions[:, None] * self.inv_freq_per_dim)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)
