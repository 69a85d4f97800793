"""The pre-norm decoder layer of Llama-family models, and the HF config readings its families share.

The math follows HF transformers' Llama exactly (float32 RMSNorm statistics, float32 rotary angles,
``rotate_half`` convention) so greedy output matches it token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from treadle.core.execution.forward_batch import ForwardBatch
from treadle.layers.mlp import GatedMLP
from treadle.layers.norm import RMSNorm
from treadle.layers.self_attention import SelfAttention


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    Built from the HF config like Llama's; the keyword options swap in what other families differ by:
    ``qkv_bias``/``o_bias`` (default: ``config.attention_bias`` for both), ``qk_norm`` (Qwen3),
    and ``mlp`` (any module mapping ``[tokens, hidden]`` to the same shape, e.g.
    :class:`~treadle.layers.moe.SparseMoE`; default a :class:`GatedMLP` of
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


class HiddenStateTap:
    """Where a decoder stack records the hidden state entering chosen layers, for a reader outside the model (an
    EAGLE-3 speculator reads its target's). Off unless a model's ``capture_hidden_states`` installs one.

    Layer ``i``'s input (``i == num_layers``: the last layer's output, before the final norm) of every token of a
    forward goes to columns ``[k * hidden, (k + 1) * hidden)`` of one buffer, ``k`` being ``i``'s index in
    ``layer_ids``: row ``t`` is token ``t``. Forwards of up to ``static_rows`` tokens write one preallocated buffer
    (its address fixed, so CUDA graphs captured with the tap on write it too); longer (eager) forwards write one
    that grows. :meth:`output` is the buffer a forward of ``num_tokens`` tokens wrote, valid until the next forward.
    """

    def __init__(self, layer_ids: Sequence[int], hidden_size: int, static_rows: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.columns = {layer_id: slice(k * hidden_size, (k + 1) * hidden_size)
                        for k, layer_id in enumerate(self.layer_ids)}
        self.width = hidden_size * len(self.layer_ids)
        self.static = torch.empty(max(static_rows, 1), self.width, dtype=dtype, device=device)
        self.large: torch.Tensor | None = None

    def output(self, num_tokens: int) -> torch.Tensor:
        if num_tokens <= self.static.shape[0]:
            return self.static[:num_tokens]
        if self.large is None or self.large.shape[0] < num_tokens:
            self.large = torch.empty(num_tokens, self.width, dtype=self.static.dtype, device=self.static.device)
        return self.large[:num_tokens]

    def record(self, layer_id: int, hidden_states: torch.Tensor, residual: torch.Tensor | None, normed: bool) -> None:
        """Layer ``layer_id``'s input: ``hidden_states + residual``, or ``residual`` alone when ``normed`` (the
        layer before ran this one's input norm, so ``residual`` holds the sum), or ``hidden_states`` (no residual
        yet)."""
        out = self.output(hidden_states.shape[0])[:, self.columns[layer_id]]
        if residual is None:
            out.copy_(hidden_states)
        elif normed:
            out.copy_(residual)
        else:
            torch.add(hidden_states, residual, out=out)


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
