"""How a linear layer stores its weight and multiplies by it: the :class:`LinearMethod` interface and the
plain (unquantized) method. Quantized methods (``layers/fp8.py``) implement the same interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from treadle.kernels.fused_ops import use_triton
from treadle.layers import small_batch

if TYPE_CHECKING:
    from treadle.layers.linear import LinearBase


class LinearMethod(ABC):
    """How a linear layer stores its weight and multiplies by it (plain, FP8, ...)."""

    @abstractmethod
    def create_weights(
        self, layer: "LinearBase", input_size_per_partition: int, output_partition_sizes: list[int],
        input_size: int, output_size: int, params_dtype: torch.dtype,
    ) -> None:
        """Register the layer's weight parameters (at least ``weight``) for this rank's partition."""

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        """Called once every checkpoint tensor is loaded (e.g. to quantize or repack)."""

    @abstractmethod
    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` for this rank's partition."""

    def apply_silu_mul(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of an unbiased ``[gate | up]`` layer's output in one kernel, where the method has
        one for ``x``'s batch; None (the default): the caller runs :meth:`apply`, then ``silu_mul``."""
        return None

    def apply_add_rmsnorm(self, layer: "LinearBase", x: torch.Tensor, residual: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rmsnorm(y + residual) * norm_weight, y + residual)`` for this unbiased layer's output ``y`` in one
        kernel, where the method has one for ``x``'s batch; None (the default): the caller runs :meth:`apply`,
        then the norm."""
        return None

    def fuses_add_rmsnorm(self, layer: "LinearBase", x: torch.Tensor) -> bool:
        """Whether :meth:`apply_add_rmsnorm` runs its kernel for ``x`` (known before the call: a layer with output
        deltas adds them into the residual first, then lets the kernel add its output). False: not known."""
        return False

    def apply_split(self, layer: "LinearBase", x: torch.Tensor, split: Callable[[], Any],
                    silu_mul: bool = False, add_rmsnorm: tuple[torch.Tensor, torch.Tensor, float] | None = None
                    ) -> Any:
        """What :meth:`apply` (``silu_mul``: :meth:`apply_silu_mul`; ``add_rmsnorm`` = ``(residual, norm_weight,
        eps)``: :meth:`apply_add_rmsnorm`) returns for the unbiased ``layer``, plus its output delta split in two
        (``layers/output_delta.py``'s ``SplitDelta``, from ``split()``; None from it: not this step): the delta's
        ``beside`` run in this method's matmul launch (or its ``apart`` in a launch of its own, where the matmul
        cannot run it), then its second half. None (the default, and wherever the method cannot split for ``x``):
        nothing ran, the layer adds its deltas apart."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    """A plain ``[out, in]`` weight in the model dtype and ``F.linear``; on a GPU, decode-sized batches of a 16-bit
    weight may run the Triton kernel of ``small_batch_kernels.py`` instead, where it times faster at load."""

    def create_weights(
        self, layer: "LinearBase", input_size_per_partition: int, output_partition_sizes: list[int],
        input_size: int, output_size: int, params_dtype: torch.dtype,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        weight = layer.weight.data
        layer.small_batch = None
        if weight.is_cuda and weight.dtype in (torch.float16, torch.bfloat16) and use_triton(weight):
            from treadle.kernels.small_batch import SIXTEEN_BIT_CONFIGS

            layer.small_batch = small_batch.choose("16-bit", weight, None, weight.dtype, F.linear,
                                                   SIXTEEN_BIT_CONFIGS)

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = small_batch.matmul(layer.small_batch, x, layer.weight, None, layer.l2_prefetch)
        if y is not None:
            return y if bias is None else y + bias
        return F.linear(x, layer.weight, bias)

    def apply_silu_mul(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor | None:
        return small_batch.silu_mul_matmul(layer.small_batch, x, layer.weight, None, layer.l2_prefetch)

    def apply_add_rmsnorm(self, layer: "LinearBase", x: torch.Tensor, residual: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        return small_batch.add_rmsnorm_matmul(layer.small_batch, x, layer.weight, None, residual, norm_weight, eps,
                                              layer.l2_prefetch)

    def fuses_add_rmsnorm(self, layer: "LinearBase", x: torch.Tensor) -> bool:
        return small_batch.fuses_add_rmsnorm(layer.small_batch, x)

    def apply_split(self, layer: "LinearBase", x: torch.Tensor, split: Callable[[], Any],
                    silu_mul: bool = False, add_rmsnorm: tuple[torch.Tensor, torch.Tensor, float] | None = None
                    ) -> Any:
        return small_batch.split_matmul(layer.small_batch, x, layer.weight, split, layer.l2_prefetch, silu_mul,
                                        add_rmsnorm, library=F.linear)


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> None:
    """Attach loading metadata (``weight_loader``, ``full_shards``) to a parameter."""
    for key, value in attrs.items():
        setattr(param, key, value)
