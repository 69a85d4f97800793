"""FP8 (e4m3) tensor math for linear layers: quantize weights per output row and activations per token,
dequantize, and the scaled matmul (``torch._scaled_mm`` with row-wise scales).

``x ≈ q * scale`` with ``q`` in ``float8_e4m3fn`` (|q| <= 448) and float32 scales.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0

# A zero row/column still needs a positive scale; this one maps it to zero without dividing by zero.
_MIN_SCALE = 1e-12


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] → (FP8 [N, K], float32 scales [N, 1]) with ``weight ≈ q * scale`` row by row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] → (FP8 [M, K], float32 scales [M, 1]); one Triton launch on a GPU."""
    if x.is_cuda:
        from treadle.kernels.fp8 import per_token_quant

        return per_token_quant(x, FP8_DTYPE, FP8_MAX, _MIN_SCALE)
    return quantize_per_channel(x)


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] with one fixed float32 scale (shape [1]) → (FP8 [M, K], scales [M, 1])."""
    q = (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, input_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (``scale`` broadcasts: [N, 1] per row, or a scalar)."""
    return (q.float() * scale).to(dtype)


def fp8_matmul(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """``(xq * x_scale) @ (wq * w_scale).T`` through ``torch._scaled_mm``; xq [M, K], wq [N, K], scales [M, 1], [N, 1]."""
    # CUDA's row-wise scaled matmul writes bfloat16 only; float16 models get a cast.
    mm_dtype = torch.bfloat16 if xq.is_cuda and out_dtype != torch.bfloat16 else out_dtype
    y = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=mm_dtype)
    return y if y.dtype == out_dtype else y.to(out_dtype)
