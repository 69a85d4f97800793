"""Weights quantized at load, created empty and filled one layer at a time.

``model.quantization: fp8`` on a 16-bit checkpoint quantizes each linear layer (and each layer's experts) once its
weights are loaded. Built the usual way, the whole model would first exist in 16 bits: Mixtral-8x7B's 93 GB, which
no 80 GB GPU holds, although its FP8 weights (47 GB) fit. So such a layer creates its 16-bit weight with
:func:`lazy_parameter` (on the meta device: no memory), the checkpoint loader calls :func:`materialize` before it
copies the layer's first tensor in, and :class:`LoadTracker` quantizes the layer (:func:`finish_module`) as soon as
its last tensor has arrived, which frees the 16-bit copy. Checkpoints store a layer's tensors together, so the
peak is the quantized model plus the layers being loaded. The model loader finishes whatever is left at the end
and refuses a parameter that nothing filled (a plugin's loader that bypasses the parameters' ``weight_loader``).
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable

import torch
from torch import nn


def lazy_parameter(shape: tuple[int, ...], dtype: torch.dtype | None = None) -> nn.Parameter:
    """A parameter of ``shape`` that holds no memory until :func:`materialize` puts it on the device that is the
    default now (the model loader builds models under ``torch.device(target)``)."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
    param.materialize_on = torch.get_default_device()
    return param


def materialize(param: nn.Parameter) -> None:
    """Give a :func:`lazy_parameter` its (uninitialized) memory; nothing for any other parameter."""
    if _is_lazy(param):
        attributes = dict(param.__dict__)  # weight_loader and the like; the swap exchanges them too
        # A meta tensor's data cannot be replaced by a real one; swapping keeps the object that modules and the
        # checkpoint loader refer to.
        real = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=param.materialize_on),
                            requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, real)
        param.__dict__.update(attributes)


def finish_module(module: nn.Module) -> None:
    """Run ``module.quant_method.process_weights_after_loading(module)`` (quantize or repack its loaded weights)
    once; later calls do nothing."""
    if getattr(module, "weights_finished", False):
        return
    lazy = [param for param in module.parameters(recurse=False) if hasattr(param, "materialize_on")]
    method = getattr(module, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(module)
    module.weights_finished = True
    # A quantized weight replaces the 16-bit parameter, which the loader's own lists still refer to: empty it so
    # its memory is freed now, not when loading ends.
    kept = {id(param) for param in module.parameters(recurse=False)}
    for param in lazy:
        if id(param) not in kept:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def lazy_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that own a :func:`lazy_parameter` not yet materialized."""
    return [module for module in model.modules()
            if any(_is_lazy(param) for param in module.parameters(recurse=False))]


def unloaded_parameters(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters still on the meta device (nothing loaded into them)."""
    return [name for name, param in model.named_parameters() if param.is_meta]


class LoadTracker:
    """Finishes each of a set of modules as soon as every key it waits for (checkpoint names, parameters) is
    loaded. ``waits`` maps each module to its keys."""

    def __init__(self, waits: Iterable[tuple[nn.Module, set[Hashable]]]) -> None:
        self._pending: dict[int, tuple[nn.Module, set[Hashable]]] = {}
        self._modules_of: dict[Hashable, list[int]] = {}
        for module, keys in waits:
            if not keys:
                continue
            self._pending[id(module)] = (module, set(keys))
            for key in keys:
                self._modules_of.setdefault(key, []).append(id(module))

    def loaded(self, keys: Iterable[Hashable]) -> None:
        """``keys`` are in place: finish every module that now waits for nothing."""
        for key in keys:
            for module_id in self._modules_of.pop(key, ()):
                entry = self._pending.get(module_id)
                if entry is None:
                    continue
                entry[1].discard(key)
                if not entry[1]:
                    del self._pending[module_id]
                    finish_module(entry[0])


def _is_lazy(param: Any) -> bool:
    return param.is_meta and hasattr(param, "materialize_on")
