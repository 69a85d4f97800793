"""Llama (and Llama-shaped models such as SmolLM2), registered as ``LlamaForCausalLM``."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from treadle.core.execution.forward_batch import ForwardBatch
from treadle.core.hookspecs import Register, hookimpl
from treadle.layers import small_batch
from treadle.layers.checkpoint import load_checkpoint
from treadle.layers.decoder import DecoderLayer, HiddenStateTap, check_activation, head_dim
from treadle.layers.fp8 import split_kv_cache_scales
from treadle.layers.linear import LinearBase, ParallelLMHead, VocabParallelEmbedding
from treadle.layers.norm import RMSNorm
from treadle.layers.rotary import RotaryEmbedding, rope_parameters

# Older checkpoints store the rotary table; it is recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaModel(nn.Module):
    """Embedding and decoder layers (the final norm is applied by the causal LM to the rows it needs).

    ``make_layer(config, layer_id)`` builds each decoder layer (default: Llama's :class:`DecoderLayer`).
    """

    def __init__(self, config: Any, make_layer: Callable[[Any, int], nn.Module] | None = None) -> None:
        super().__init__()
        check_activation(config)
        make_layer = make_layer or DecoderLayer
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(config, layer_id) for layer_id in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim(config), rope_parameters(config))
        # Per layer: False (run it as a module), or the next layer's input norm it may run in its last kernel
        # (one-token decode on a GPU: a kernel launch less per layer; None for the last decoder layer of a run).
        stacked = [_runs_into_next_norm(layer) for layer in self.layers] + [False]
        self._next_norms: list[nn.Module | None | bool] = [
            (self.layers[index + 1].input_layernorm if stacked[index + 1] else None) if stacked[index] else False
            for index in range(len(self.layers))]
        self.hidden_tap: HiddenStateTap | None = None  # what LlamaForCausalLM.capture_hidden_states installs

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(last layer's output, residual stream)``; their sum is the final hidden state."""
        hidden_states = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        return self.run_layers(hidden_states, cos, sin, forward_batch)

    def run_layers(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers over input embeddings ``hidden_states`` with rotary tables ``cos``/``sin``
        (a vision-language model passes its own: image rows, M-RoPE positions)."""
        residual, normed = None, False
        tap = self.hidden_tap
        for layer_id, (layer, next_norm) in enumerate(zip(self.layers, self._next_norms)):
            if tap is not None and layer_id in tap.columns:
                tap.record(layer_id, hidden_states, residual, normed)
            if next_norm is False:
                hidden_states, residual = layer(hidden_states, residual, cos, sin, forward_batch)
            else:
                hidden_states, residual, normed = layer.forward_into_norm(hidden_states, residual, cos, sin,
                                                                          forward_batch, normed, next_norm)
        if tap is not None and len(self.layers) in tap.columns:
            tap.record(len(self.layers), hidden_states, residual, normed)
        return hidden_states, residual


def _runs_into_next_norm(layer: nn.Module) -> bool:
    """Whether ``layer`` is a :class:`DecoderLayer` whose ``forward`` is its own (a subclass that overrides it is
    run through that override)."""
    return isinstance(layer, DecoderLayer) and type(layer).forward is DecoderLayer.forward


class LlamaForCausalLM(nn.Module):
    """Llama causal LM: logits (in the model's dtype) for the rows ``forward_batch.logits_indices``.

    Built from the tensor-parallel blocks, so it runs at any ``parallel.tp_size`` that
    divides its heads; every rank returns the full logits. Other families subclass it and
    override :meth:`make_layer` (and :meth:`load_weights` to rename checkpoint tensors); the
    embedding, final norm, lm_head and weight tying stay shared.

    Its optional model members (treadle.core.execution.model_protocol.ModelTraits) are all declared here:
    ``forward_hidden``/``compute_logits`` (prefill CUDA graphs), ``weights_loaded`` and ``kv_cache_scales``; the
    two class attributes below are what families with experts override.
    """

    # Neither holds for a dense decoder: an eager prefill chunk is bound by arithmetic, not launches, and a decode
    # step reads every weight whatever rides in it.
    launch_bound_prefill = False
    prefers_mixed_chunks = False

    def __init__(self, config: Any, quant_config: Any = None) -> None:
        super().__init__()
        self.config = config
        self.quant_config = quant_config
        # Per-layer KV-cache scales an FP8 checkpoint carries (load_weights fills it; the model runner reads it).
        self.kv_cache_scales: dict[int, dict[str, float]] = {}
        self.model = LlamaModel(config, self.make_layer)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=quant_config)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        """Decoder layer ``layer_id``; Llama's has no attention window."""
        return DecoderLayer(config, layer_id, quant_config=self.quant_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.compute_logits(self.forward_hidden(input_ids, positions, forward_batch), forward_batch)

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's ``(last layer's output, residual stream)``: the part of the forward that piecewise
        CUDA graphs capture (see treadle.core.execution.piecewise_graph)."""
        return self.model(input_ids, positions, forward_batch)

    def compute_logits(self, hidden: tuple[torch.Tensor, torch.Tensor], forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits of the rows ``forward_batch.logits_indices`` from :meth:`forward_hidden`'s output, in the
        model's dtype: the sampler widens them where it computes probabilities, and a greedy step needs no
        float32 copy of a ``[batch, vocab]`` table."""
        hidden_states, residual = hidden
        # The last residual add, the norm and lm_head are row-wise: select the wanted rows first. The rows are in
        # increasing order, so as many as there are tokens (a decode step) is every row: no gather to launch.
        rows = forward_batch.logits_indices
        if rows.shape[0] != hidden_states.shape[0]:
            hidden_states, residual = hidden_states[rows], residual[rows]
        selected, _ = self.model.norm(hidden_states, residual)
        return self.lm_head(selected)

    def capture_hidden_states(self, tap: HiddenStateTap | None) -> None:
        """From the next forward on, record the hidden state entering the layers ``tap`` names into it (None: stop).
        CUDA graphs captured before do not record: capture them again."""
        self.model.hidden_tap = tap

    def compute_hidden_states(self, hidden: tuple[torch.Tensor, torch.Tensor],
                              forward_batch: ForwardBatch) -> torch.Tensor:
        """Every row's final hidden state (the final norm applied) from :meth:`forward_hidden`'s output: what an
        embedding model pools."""
        hidden_states, residual = hidden
        return self.model.norm(hidden_states, residual)[0]

    def drop_lm_head(self) -> None:
        """Serve embeddings: no output head (an embedding checkpoint has none; a causal LM's is skipped)."""
        self.lm_head = None
        self.tie_word_embeddings = False

    def weights_loaded(self) -> None:
        """Called once every weight is loaded and quantized: each linear layer's decode kernel prefetches the head
        of the next one's weight into L2 (small_batch.chain_l2_prefetch)."""
        small_batch.chain_l2_prefetch([m for m in self.modules() if isinstance(m, (LinearBase, ParallelLMHead))])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        ignored = _IGNORED_SUFFIXES + (("lm_head.weight",) if self.tie_word_embeddings or self.lm_head is None
                                       else ())
        if self.lm_head is None:
            weights = _under_model(weights)
        self.kv_cache_scales = {}
        load_checkpoint(self, split_kv_cache_scales(weights, self.kv_cache_scales), ignored_suffixes=ignored)


def _under_model(weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    """An embedding checkpoint saved from the bare transformer (``Qwen3Model``) names its tensors without the
    ``model.`` prefix."""
    for name, tensor in weights:
        yield (name if name.startswith(("model.", "lm_head.")) else f"model.{name}"), tensor


@hookimpl
def treadle_register_models(register: Register) -> None:
    register("LlamaForCausalLM", LlamaForCausalLM)
