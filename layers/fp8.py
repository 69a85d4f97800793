"""FP8 linear layers: ``Fp8LinearMethod`` for :class:`~treadle.layers.linear.LinearBase`.

Weights are ``float8_e4m3fn`` ``[out, in]`` with one float32 scale per output
row (a per-tensor checkpoint scale is broadcast over its rows, so a merged
q/k/v or gate/up layer keeps each part's scale). Activations are quantized per
token on the fly (``dynamic``) or with the checkpoint's ``input_scale``
(``static``), and ``torch._scaled_mm`` multiplies them with row-wise scales:
``y[m, n] = (sum_k xq[m, k] wq[n, k]) * x_scale[m] * w_scale[n]``.
See ``core/loading/quantization.py`` for when which path is used.

On a GPU, decode-sized batches may run the Triton kernel of ``small_batch_kernels.py`` instead (FP8 weights
widened in registers, 16-bit activations, no activation quantization), where it times faster at load
(``small_batch.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from treadle.core.loading.lazy_weights import lazy_parameter
from treadle.core.loading.quantization import FP8_DTYPE, QuantizationConfig, QuantizationError
from treadle.layers import small_batch
from treadle.layers.exact_top_logits import recompute_top_logits
from treadle.kernels.fp8_ops import (
    dequantize,
    fp8_matmul,
    quantize_per_channel,
    quantize_per_token,
    quantize_static,
)
from treadle.layers.linear_method import LinearMethod, set_weight_attrs
from treadle.layers.small_batch import SmallBatchKernels

if TYPE_CHECKING:
    from treadle.layers.linear import LinearBase


class Fp8LinearMethod(LinearMethod):
    """FP8 weights and ``torch._scaled_mm`` for one linear layer (see the module docstring).

    With ``config.checkpoint_quantized`` the layer has FP8 ``weight``, float32 ``weight_scale`` [N, 1] and,
    for the static scheme, ``input_scale`` [1] parameters that the checkpoint fills; otherwise it loads a
    model-dtype weight and quantizes it in :meth:`process_weights_after_loading`. With
    ``config.dequantize`` (no FP8 matmul on this device) the FP8 weights are widened once loaded and
    the layer runs ``F.linear``.
    """

    def __init__(self, config: QuantizationConfig) -> None:
        self.config = config
        self.static_input = config.activation_scheme == "static"

    def create_weights(
        self, layer: LinearBase, input_size_per_partition: int, output_partition_sizes: list[int],
        input_size: int, output_size: int, params_dtype: torch.dtype,
    ) -> None:
        rows = sum(output_partition_sizes)
        layer.fp8_out_dtype = params_dtype
        if not self.config.checkpoint_quantized:
            # Quantized once loaded: no memory until the checkpoint fills it (core/loading/lazy_weights.py).
            layer.register_parameter("weight", lazy_parameter((rows, input_size_per_partition), params_dtype))
            return
        layer.register_parameter("weight", _param(torch.empty(rows, input_size_per_partition, dtype=FP8_DTYPE)))
        weight_scale = _param(torch.ones(rows, 1, dtype=torch.float32))
        set_weight_attrs(weight_scale, weight_loader=_scale_loader(layer), keep_dtype=True)
        layer.register_parameter("weight_scale", weight_scale)
        if self.static_input:
            input_scale = _param(torch.zeros(1, dtype=torch.float32))
            set_weight_attrs(input_scale, weight_loader=_max_loader, keep_dtype=True)
            layer.register_parameter("input_scale", input_scale)
        layer.weight.keep_dtype = True

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        weight = layer.weight.data
        if not hasattr(layer, "fp8_out_dtype"):  # a layer this method did not create (the lm_head)
            layer.fp8_out_dtype = weight.dtype
        if self.config.dequantize:
            layer.weight = _param(dequantize(weight, layer.weight_scale.data, layer.fp8_out_dtype))
            del layer.weight_scale
            if self.static_input:
                del layer.input_scale
            return
        if not self.config.checkpoint_quantized:
            quantized, scale = quantize_per_channel(weight)
            layer.weight = _param(quantized)
            layer.weight_scale = _param(scale)
        elif self.static_input and not bool((layer.input_scale.data > 0).all()):
            raise QuantizationError(f"{type(layer).__name__}: the static FP8 checkpoint has no positive input_scale")
        rows, cols = layer.weight.shape
        if layer.weight.is_cuda and (rows % 16 or cols % 16):
            raise QuantizationError(
                f"FP8 matmuls on the GPU need in/out features that are multiples of 16; a layer has "
                f"{cols} in and {rows} out; list it in the checkpoint's ignored_layers or drop model.quantization"
            )
        layer.small_batch = None
        if layer.weight.is_cuda and layer.fp8_out_dtype in (torch.float16, torch.bfloat16):
            layer.small_batch = self._small_batch_kernels(layer)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.config.dequantize:
            return F.linear(x, layer.weight, bias)
        leading = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        y = small_batch.matmul(layer.small_batch, x2, layer.weight, layer.weight_scale, layer.l2_prefetch)
        if y is None:
            if self.static_input:
                xq, x_scale = quantize_static(x2, layer.input_scale)
            else:
                xq, x_scale = quantize_per_token(x2)
            y = fp8_matmul(xq, x_scale, layer.weight, layer.weight_scale, x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*leading, y.shape[-1])

    def apply_silu_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        if self.config.dequantize:
            return None
        return small_batch.silu_mul_matmul(layer.small_batch, x, layer.weight, layer.weight_scale, layer.l2_prefetch)

    def apply_add_rmsnorm(self, layer: LinearBase, x: torch.Tensor, residual: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.config.dequantize:
            return None
        return small_batch.add_rmsnorm_matmul(layer.small_batch, x, layer.weight, layer.weight_scale, residual,
                                              norm_weight, eps, layer.l2_prefetch)

    def fuses_add_rmsnorm(self, layer: LinearBase, x: torch.Tensor) -> bool:
        return not self.config.dequantize and small_batch.fuses_add_rmsnorm(layer.small_batch, x)

    def _small_batch_kernels(self, layer: LinearBase) -> SmallBatchKernels | None:
        from treadle.kernels.small_batch import FP8_CONFIGS

        weight, scale, dtype = layer.weight.data, layer.weight_scale.data, layer.fp8_out_dtype
        return small_batch.choose("fp8", weight, scale, dtype,
                                  lambda x, w: fp8_matmul(*quantize_per_token(x), w, scale, dtype), FP8_CONFIGS)


class Fp8LmHeadMethod(Fp8LinearMethod):
    """The method of an lm_head quantized at load (``model.quantize_lm_head``): its 16-bit weight becomes FP8
    with a scale per vocabulary row, whatever the checkpoint stores for the other layers. With ``exact_top`` > 0
    the 16-bit weight is kept (a tied embedding's is the embedding itself) and each row's ``exact_top`` best logits
    are recomputed from it (``exact_top_logits.py``)."""

    def __init__(self, exact_top: int) -> None:
        super().__init__(QuantizationConfig())
        self.exact_top = exact_top

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        sixteen_bit = layer.weight.data
        super().process_weights_after_loading(layer)
        layer.exact_weight = sixteen_bit if self.exact_top else None

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().apply(layer, x, bias)
        if self.exact_top:
            recompute_top_logits(logits.view(-1, logits.shape[-1]), x.reshape(-1, x.shape[-1]), layer.exact_weight,
                                 self.exact_top)
        return logits


def lm_head_method(exact_top: int) -> Fp8LmHeadMethod:
    """The method of an lm_head quantized at load (see :class:`Fp8LmHeadMethod`)."""
    return Fp8LmHeadMethod(exact_top)


def linear_method(config: QuantizationConfig, layer: nn.Module, prefix: str) -> LinearMethod | None:
    """The method for a linear layer named ``prefix`` under ``config`` (None: unquantized)."""
    if config.method != "fp8":
        raise QuantizationError(f"quantization method '{config.method}' has no linear layers; supported: fp8")
    if config.is_ignored(prefix):
        return None
    return Fp8LinearMethod(config)


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _scale_loader(layer: LinearBase) -> Any:
    """Loads a ``weight_scale`` (one per tensor, or one per output row) into the rows of its shard."""

    def load(param: nn.Parameter, loaded: Any, shard_id: str | None = None) -> None:
        scale = (loaded if isinstance(loaded, torch.Tensor) else loaded[...]).to(torch.float32)
        if scale.numel() == 1:
            offset, rows = layer.shards[shard_id] if shard_id is not None else (0, param.shape[0])
            with torch.no_grad():
                param.data.narrow(0, offset, rows).fill_(scale.reshape(()))
            return
        scale = scale.reshape(-1, 1)
        if not layer.splits_output:  # a row-parallel layer: output rows are not split across ranks
            with torch.no_grad():
                param.data.copy_(scale)
        elif shard_id is None:
            layer.weight_loader(param, scale)
        else:
            layer.weight_loader(param, scale, shard_id)

    return load


def _max_loader(param: nn.Parameter, loaded: Any, shard_id: str | None = None) -> None:
    """Static activation scales of merged projections share one input: keep the largest."""
    value = (loaded if isinstance(loaded, torch.Tensor) else loaded[...]).to(torch.float32).max()
    with torch.no_grad():
        param.data.copy_(torch.maximum(param.data, value.reshape(1).to(param.device)))


# Checkpoint names of per-layer KV-cache scales (FP8 checkpoints made for an FP8 KV cache).
_KV_SCALE_SUFFIXES = {
    ".self_attn.k_scale": ("k",), ".self_attn.v_scale": ("v",), ".self_attn.kv_scale": ("k", "v"),
    ".self_attn.k_proj.output_scale": ("k",), ".self_attn.v_proj.output_scale": ("v",),
}


def split_kv_cache_scales(weights: Iterable[tuple[str, Any]], into: dict[int, dict[str, float]]
                          ) -> Iterator[tuple[str, Any]]:
    """Pass ``weights`` through, minus per-layer KV-cache scales, which go into ``into[layer] = {"k": .., "v": ..}``
    (the model runner hands them to an FP8 KV cache; a 16-bit cache does not need them)."""
    for name, loaded in weights:
        parts = next((parts for suffix, parts in _KV_SCALE_SUFFIXES.items() if name.endswith(suffix)), None)
        if parts is None or ".layers." not in name:
            yield name, loaded
            continue
        layer_id = int(name.split(".layers.")[1].split(".")[0])
        value = float((loaded if isinstance(loaded, torch.Tensor) else loaded[...]).float().max())
        for part in parts:
            into.setdefault(layer_id, {})[part] = value
