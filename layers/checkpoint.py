"""Loading an HF checkpoint into a model built from the shared layers, through each parameter's ``weight_loader``."""

from __future__ import annotations

from typing import Any, Iterable, Protocol, runtime_checkable

from torch import nn

from treadle.core.loading.lazy_weights import LoadTracker, lazy_modules, materialize
from treadle.core.loading.model_loader import listed_names
from treadle.layers.linear import CheckpointError, default_weight_loader


def load_checkpoint(
    model: nn.Module, weights: Iterable[tuple[str, Any]], ignored_suffixes: tuple[str, ...] = ()
) -> None:
    """Copy HF-named tensors into ``model`` through each parameter's ``weight_loader``.

    A tensor may be a full ``torch.Tensor`` or a safetensors lazy slice (then a tensor-parallel
    rank reads only its part). Separate HF projections (``q_proj``...) go into their shard of a
    stacked layer (one with ``shard_ids``); tensors under a :class:`LoadsOwnCheckpoint` module
    are handed to it. Values are cast to each parameter's dtype and device.
    Raises :class:`CheckpointError` naming unexpected tensors, missing ones, or a shape mismatch.
    """
    targets = checkpoint_targets(model)
    owners = {prefix: module for prefix, module in model.named_modules() if prefix and isinstance(module, LoadsOwnCheckpoint)}
    owned = tuple(f"{prefix}." for prefix in owners)
    owned_names = {prefix: {f"{prefix}.{name}" for name in owner.checkpoint_names()}
                   for prefix, owner in owners.items()}
    pending = {name for name in targets if not name.startswith(owned)}.union(*owned_names.values())
    tracker = _quantize_as_loaded(model, targets, owners, owned_names)
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(ignored_suffixes):
            continue
        try:
            covered = _load_owned(name, tensor, owners) if name.startswith(owned) else None
            if covered is not None:
                pending.difference_update(covered)
                tracker.loaded(covered)
                continue
            target = targets.get(name)
            if target is None:
                unexpected.append(name)
                continue
            param, shard_id = target
            materialize(param)
            loader = getattr(param, "weight_loader", default_weight_loader)
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except CheckpointError as exc:
            raise CheckpointError(
                f"checkpoint tensor '{name}' {exc}; does config.json match the weights?"
            ) from None
        pending.discard(name)
        tracker.loaded((name,))
    if unexpected:
        raise CheckpointError(
            f"unexpected tensors in the checkpoint for {type(model).__name__}: {listed_names(unexpected)}")
    if pending:
        raise CheckpointError(
            f"tensors missing from the checkpoint for {type(model).__name__}: {listed_names(sorted(pending))}")


@runtime_checkable
class LoadsOwnCheckpoint(Protocol):
    """A module that maps checkpoint tensors onto its parameters itself (e.g. fused MoE experts, whose
    checkpoints may store one tensor per expert). Names are relative to the module."""

    def checkpoint_names(self) -> set[str]:
        """Every name a complete checkpoint provides for this module."""
        ...

    def load_checkpoint_tensor(self, name: str, loaded: Any) -> set[str] | None:
        """Copy ``loaded`` (a tensor or a safetensors lazy slice) in; returns the names of
        :meth:`checkpoint_names` it covered, or None if ``name`` is not this module's.
        Raises :class:`CheckpointError` (``"has shape ... but the model expects ..."``) on a mismatch."""
        ...


def _quantize_as_loaded(model: nn.Module, targets: dict[str, tuple[nn.Parameter, str | None]],
                        owners: dict[str, Any], owned_names: dict[str, set[str]]) -> LoadTracker:
    """Each module with weights quantized at load (core/loading/lazy_weights.py) is quantized as soon as the last of its
    checkpoint tensors is in, so the 16-bit model never exists whole."""
    lazy = {id(module): module for module in lazy_modules(model)}
    waits: dict[int, set[str]] = {}
    owner_of = {id(param): id(module) for module in lazy.values() for param in module.parameters(recurse=False)}
    for name, (param, _) in targets.items():
        if id(param) in owner_of:
            waits.setdefault(owner_of[id(param)], set()).add(name)
    for prefix, owner in owners.items():
        if id(owner) in lazy:
            waits.setdefault(id(owner), set()).update(owned_names[prefix])
    return LoadTracker((lazy[module_id], names) for module_id, names in waits.items())


def _load_owned(name: str, loaded: Any, owners: dict[str, Any]) -> set[str] | None:
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:cut])
        owner = owners.get(prefix)
        if owner is not None:
            for param in owner.parameters(recurse=False):
                materialize(param)
            covered = owner.load_checkpoint_tensor(".".join(parts[cut:]), loaded)
            return None if covered is None else {f"{prefix}.{n}" for n in covered}
    return None


def checkpoint_targets(model: nn.Module) -> dict[str, tuple[nn.Parameter, str | None]]:
    """HF checkpoint name → ``(parameter, shard id)``; a stacked layer's parameter appears once per shard
    (``...self_attn.q_proj.weight`` → ``(qkv_proj.weight, "q_proj")``); a tied parameter under its first name."""
    targets: dict[str, tuple[nn.Parameter, str | None]] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        parent = module_name.rpartition(".")[0]
        shard_ids = getattr(module, "shard_ids", None)
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if shard_ids:
                for shard_id in shard_ids:
                    targets[f"{parent + '.' if parent else ''}{shard_id}.{param_name}"] = (param, shard_id)
            else:
                targets[f"{prefix}{param_name}"] = (param, None)
    return targets
