"""The ``quantization_methods`` plugin kind: how a checkpoint's quantized linear weights are read and multiplied.

A method is registered by name (``register("gptq", GptqMethod)``; the factory takes no arguments) and says which
``quantization_config.quant_method`` values of a checkpoint it reads (:attr:`QuantizationMethod.checkpoint_methods`).
At load, :func:`resolve_method` picks one: the one named by ``model.quantization``, or with ``auto`` (or empty) the
one that reads the checkpoint's ``quant_method``; a checkpoint no method reads is refused naming what is supported.
The chosen method turns the stored config into the object the model is built with (:meth:`QuantizationMethod.
build`): anything with ``get_quant_method(layer, prefix)`` returning a ``treadle.layers.linear_method.LinearMethod``
(which creates the layer's parameters under their checkpoint names, repacks them once loaded, and runs the matmul)
or None for a layer left in the model dtype. The built-in FP8 method returns core's own
:class:`~treadle.core.loading.quantization.QuantizationConfig`, which the shared layers know.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from treadle.core.loading.quantization import QuantizationError, resolve_quantization, stored_quantization

KIND = "quantization_methods"


@dataclass(frozen=True)
class QuantizationRequest:
    """What the user asked for beside the method: ``model.quantize_lm_head`` and ``model.lm_head_exact_top``, and
    the device the model is built on."""

    device: torch.device
    lm_head: bool | Literal["auto"] = False
    lm_head_exact_top: int = 0


class QuantizationMethod(ABC):
    """A registered way of storing linear weights (FP8, GPTQ, AWQ, compressed-tensors, ...)."""

    # The checkpoint quantization_config["quant_method"] values this method reads (for model.quantization: auto).
    checkpoint_methods: ClassVar[tuple[str, ...]] = ()
    # One line for error messages and `treadle plugins`: the formats it supports.
    supports: ClassVar[str] = ""

    @abstractmethod
    def build(self, stored: dict[str, Any] | None, request: QuantizationRequest) -> Any:
        """The quant_config the model is built with, from the checkpoint's ``quantization_config`` (None: a 16-bit
        checkpoint, for a method that quantizes at load). Raise :class:`QuantizationError` naming what is wrong
        and what is supported for a config this method cannot run."""


def require_checkpoint(stored: dict[str, Any] | None, quant_method: str, name: str) -> dict[str, Any]:
    """``stored`` if it is a ``quant_method`` checkpoint's quantization_config; otherwise the error that method
    ``name`` was asked of another checkpoint."""
    if not stored or stored.get("quant_method") != quant_method:
        raise QuantizationError(f"model.quantization: {name} needs a checkpoint whose quantization_config has "
                                f"quant_method {quant_method}; this one has {stored or 'none'}")
    return stored


def resolve_method(requested: str | None, hf_config: Any, request: QuantizationRequest, registry: Any) -> Any:
    """The quant_config for ``model.quantization`` = ``requested`` (None or ``"auto"``: detect from the checkpoint)
    and the checkpoint's ``quantization_config``; None for plain weights."""
    names = _registered(registry)
    if not names:  # a registry without the kind (tests that list their plugins): the FP8 logic of core, as before
        return resolve_quantization(None if requested == "auto" else requested, hf_config, request.device,
                                    lm_head=request.lm_head, lm_head_exact_top=request.lm_head_exact_top)
    stored = stored_quantization(hf_config)
    if requested in (None, "auto"):
        if stored is None:
            return resolve_quantization(None, hf_config, request.device, lm_head=request.lm_head)
        requested = method_for_checkpoint(stored, registry)
    if requested not in names:
        raise QuantizationError(f"model.quantization '{requested}' is not a registered quantization method; "
                                f"available: {registry.describe(KIND)}")
    return registry.get(KIND, requested)().build(stored, request)


def method_for_checkpoint(stored: dict[str, Any], registry: Any) -> str:
    """The registered method whose ``checkpoint_methods`` include the checkpoint's ``quant_method``."""
    quant_method = stored.get("quant_method")
    readers = {name: registry.get(KIND, name) for name in _registered(registry)}
    for name, method in readers.items():
        if quant_method in getattr(method, "checkpoint_methods", ()):
            return name
    supported = "; ".join(f"{name}: {getattr(method, 'supports', '') or name}" for name, method in readers.items())
    raise QuantizationError(f"the checkpoint's quantization_config has quant_method '{quant_method}', which no "
                            f"registered quantization method reads; supported: {supported}")


def _registered(registry: Any) -> list[str]:
    names = getattr(registry, "names", None)
    if names is None:
        return []
    try:
        return names(KIND)
    except KeyError:
        return []
