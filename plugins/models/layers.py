"""Building blocks shared by the Llama-family models: norms, rotary embedding, MLP, decoder layer, weight loading.

The math follows HF transformers' Llama exactly (float32 RMSNorm statistics,
float32 rotary angles, ``rotate_half`` convention) so greedy output matches it
token for token. Projections that read the same input are stacked into one
matmul (``qkv_proj``, ``gate_up_proj``) built from the tensor-parallel blocks of
:mod:`.linear`; :func:`load_checkpoint` maps the HF checkpoint's separate tensors
into their slices through each parameter's ``weight_loader``.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Protocol, runtime_checkable

import torch
from torch import nn

from treadle.core.attention import RadixAttention
from treadle.core.forward_batch import ForwardBatch
from treadle.core.lazy_weights import LoadTracker, lazy_modules, materialize
from treadle.core.model_loader import listed_names
from treadle.plugins.models.fused_ops import add_rmsnorm, rotary_qkv, silu_mul
from treadle.plugins.models.linear import (  # noqa: F401  (CheckpointError is re-exported)
    CheckpointError,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm; statistics in float32, result in the input's dtype (as HF Llama).

    Given a ``residual`` it first adds it (``x + residual``) and returns ``(normed, sum)``,
    one fused kernel on the GPU.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        normed, summed = add_rmsnorm(x, residual, self.weight, self.eps)
        return normed if residual is None else (normed, summed)


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
    if rope_type == "default":
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


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up in one matmul; tensor-parallel over the intermediate dim."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, quant_config: Any = None, prefix: str = ""
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._activated(x))

    def forward_into_norm(self, x: torch.Tensor, residual: torch.Tensor,
                          norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``(*norm(self(x), residual), True)`` where ``down_proj``'s kernel can add the residual and run the norm
        (``norm`` an RMSNorm; one-token GEMVs on a GPU: a kernel launch less per layer), else
        ``(self(x), residual, False)``."""
        activated = self._activated(x)
        fused = self.down_proj.forward_add_rmsnorm(activated, residual, norm)
        if fused is not None:
            return fused[0], fused[1], True
        return self.down_proj(activated), residual, False

    def _activated(self, x: torch.Tensor) -> torch.Tensor:
        activated = self.gate_up_proj.forward_silu_mul(x)
        return activated if activated is not None else silu_mul(self.gate_up_proj(x))


class SelfAttention(nn.Module):
    """QKV projection, optional per-head q/k RMSNorm, rotary embedding, RadixAttention, output projection.

    ``num_heads``/``num_kv_heads`` are the model's totals; under tensor parallelism each
    rank runs its share of the heads (``self.num_heads``/``self.num_kv_heads`` per rank).
    ``qkv_bias`` and ``o_bias`` are separate because families differ (Qwen2: biased q/k/v, plain o_proj).
    ``qk_norm_eps`` (None: off) adds Qwen3's ``q_norm``/``k_norm``: an RMSNorm over each head's
    ``head_dim`` features, applied to q and k before the rotary embedding.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_id: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        sliding_window_size: int | None = None,
        quant_config: Any = None,
        prefix: str = "",
        qk_norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(
            num_heads * head_dim, hidden_size, o_bias, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.attn = RadixAttention(
            self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads, layer_id,
            sliding_window_size=sliding_window_size,
        )

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self.o_proj(self.attend(hidden_states, cos, sin, forward_batch))

    def attend(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """The attention output before ``o_proj`` (which :class:`DecoderLayer` runs with the norm after it)."""
        qkv = self.qkv_proj(hidden_states)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        if forward_batch.attn_backend.applies_rotary(forward_batch):
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            return self.attn(q, k, v, forward_batch, rotary=(cos, sin))
        q, k, v = rotary_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        return self.attn(q, k, v, forward_batch)

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(-1, self.q_size)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(-1, self.kv_size)
        return torch.cat((q, k, v), dim=-1)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Built from the HF config like Llama's; the keyword options swap in what other families differ by:
    ``qkv_bias``/``o_bias`` (default: ``config.attention_bias`` for both), ``qk_norm`` (Qwen3),
    and ``mlp`` (any module mapping ``[tokens, hidden]`` to the same shape, e.g.
    :class:`~treadle.plugins.models.moe.SparseMoE`; default a :class:`GatedMLP` of
    ``config.intermediate_size``). ``prefix`` (default ``model.layers.{layer_id}``) names the
    layer for ``quant_config``.
    """

    def __init__(
        self, config: Any, layer_id: int, sliding_window_size: int | None = None,
        quant_config: Any = None, prefix: str = "", *,
        qkv_bias: bool | None = None, o_bias: bool | None = None, qk_norm: bool = False, mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        prefix = prefix or f"model.layers.{layer_id}"
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = SelfAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=num_kv_heads(config),
            head_dim=head_dim(config),
            layer_id=layer_id,
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            sliding_window_size=sliding_window_size,
            quant_config=quant_config,
            prefix=f"{prefix}.self_attn",
            qk_norm_eps=config.rms_norm_eps if qk_norm else None,
        )
        if mlp is None:
            mlp = GatedMLP(
                config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)),
                quant_config=quant_config, prefix=f"{prefix}.mlp",
            )
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        forward_batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream)``; the caller adds them (fused into the next norm)."""
        hidden_states, residual, _ = self.forward_into_norm(hidden_states, residual, cos, sin, forward_batch)
        return hidden_states, residual

    def forward_into_norm(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        forward_batch: ForwardBatch,
        normed: bool = False,
        next_norm: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """:meth:`forward` for a stack of layers: ``normed`` says ``hidden_states`` is already this layer's normed
        input (the layer before ran this layer's ``input_layernorm``, ``residual`` being the sum); given the next
        layer's ``next_norm``, the MLP's last kernel may run it (one-token decode on a GPU: a kernel launch less per
        layer). Returns ``(hidden_states, residual, whether hidden_states is next_norm's output)``."""
        if not normed and residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        elif not normed:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        attended = self.self_attn.attend(hidden_states, cos, sin, forward_batch)
        # o_proj's one-token GEMV can add the residual and norm in its last program: one kernel less.
        fused = self.self_attn.o_proj.forward_add_rmsnorm(attended, residual, self.post_attention_layernorm)
        if fused is None:
            fused = self.post_attention_layernorm(self.self_attn.o_proj(attended), residual)
        hidden_states, residual = fused
        if next_norm is not None and isinstance(self.mlp, GatedMLP):
            return self.mlp.forward_into_norm(hidden_states, residual, next_norm)
        return self.mlp(hidden_states), residual, False


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def layer_sliding_window(config: Any, layer_id: int) -> int | None:
    """Layer ``layer_id``'s attention window: per ``config.layer_types`` (HF's ``"sliding_attention"`` /
    ``"full_attention"``) when the config has it, else ``config.sliding_window`` (None: full) for every layer."""
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return int(window) if window else None
    kind = layer_types[layer_id]
    if kind == "full_attention":
        return None
    if kind == "sliding_attention":
        if window is None:
            raise ValueError(f"config.layer_types marks layer {layer_id} 'sliding_attention' but sliding_window is unset")
        return int(window)
    raise ValueError(
        f"unsupported layer type '{kind}' (layer {layer_id}) in the model config; "
        "supported: full_attention, sliding_attention"
    )


def check_activation(config: Any) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act '{act}' in the model config; this model supports 'silu'")


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
    """Each module with weights quantized at load (core/lazy_weights.py) is quantized as soon as the last of its
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
