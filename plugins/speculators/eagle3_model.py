"""The EAGLE-3 draft head in the layout published for Llama-3.1-8B-Instruct (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``,
the ``LlamaForCausalLMEagle3`` checkpoints SGLang and vLLM load), and its loading from a local folder.

The folder holds ``config.json`` (a Llama config with ``num_hidden_layers: 1`` and ``draft_vocab_size``, optionally
``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``) and the weights, as safetensors or
``pytorch_model.bin``:

- ``fc.weight`` ``[hidden, 3 * target_hidden]``: projects the target's low/mid/high hidden states to one feature;
- ``midlayer.*``: one decoder layer whose attention reads ``[input_layernorm(embedding), hidden_norm(feature)]``
  (``2 * hidden`` wide: ``q/k/v_proj`` take ``2 * hidden`` inputs) with the feature as its residual;
- ``norm.weight``, ``lm_head.weight`` ``[draft_vocab, hidden]``: logits over the reduced draft vocabulary;
- ``d2t`` ``[draft_vocab]``: draft id ``d`` is target id ``d + d2t[d]``; ``t2d`` (which target ids the draft
  vocabulary holds) is not needed to draft;
- ``embed_tokens.weight`` when the head has its own token embedding; without it the target's is used.

The pair at position ``q`` is (the target's feature at ``q``, the token at ``q + 1``); its output predicts the
token at ``q + 2``, and the output hidden state is the next pair's feature when the head drafts on its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from treadle.layers.checkpoint import load_checkpoint
from treadle.layers.decoder import head_dim, num_kv_heads
from treadle.layers.linear import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from treadle.layers.mlp import GatedMLP
from treadle.layers.norm import RMSNorm
from treadle.layers.rotary import RotaryEmbedding, rope_parameters
from treadle.layers.self_attention import SelfAttention

if TYPE_CHECKING:
    from treadle.core.execution.forward_batch import ForwardBatch


class Eagle3Layer(nn.Module):
    """The head's decoder layer (checkpoint prefix ``midlayer.``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attn = SelfAttention(2 * hidden, config.num_attention_heads, num_kv_heads(config),
                                       head_dim(config), layer_id=0, prefix="midlayer.self_attn")
        # The attention reads 2 * hidden features and writes hidden ones.
        self.self_attn.o_proj = RowParallelLinear(config.num_attention_heads * head_dim(config), hidden, False)
        self.mlp = GatedMLP(hidden, config.intermediate_size)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        """The output hidden state (before the final norm) of each pair (token embedding, feature)."""
        attn_in = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
        attended = self.self_attn(attn_in, cos, sin, forward_batch)
        normed, summed = self.post_attention_layernorm(attended, features)
        return self.mlp(normed) + summed


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head (module docstring). ``target_embedding`` is used when the checkpoint has none."""

    def __init__(self, config: Any, own_embedding: bool) -> None:
        super().__init__()
        hidden = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or hidden
        self.config = config
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden) if own_embedding else None
        self.rotary_emb = RotaryEmbedding(head_dim(config), rope_parameters(config))
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64), persistent=False)
        self._target_embedding: list[nn.Module] = []  # a list, so that it is not a submodule of the head

    def use_target_embedding(self, embedding: nn.Module) -> None:
        if self.embed_tokens is None:
            self._target_embedding[:] = [embedding]

    def features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``[tokens, hidden]`` features from the target's concatenated low/mid/high hidden states."""
        return self.fc(target_hidden.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        """Each pair's output hidden state ``[tokens, hidden]``."""
        embedding = self.embed_tokens if self.embed_tokens is not None else self._target_embedding[0]
        embeds = embedding(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, embeds.dtype)
        return self.midlayer(embeds, features.to(embeds.dtype), cos, sin, forward_batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (map the picked ids with :meth:`to_target_ids`)."""
        return self.lm_head(self.norm(hidden))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def load_eagle3_head(folder: str, device: torch.device, dtype: torch.dtype) -> Eagle3Head:
    """The head saved in ``folder`` (module docstring), on ``device`` in ``dtype``."""
    from transformers import LlamaConfig

    path = Path(folder)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"speculative.draft_model_path {folder}: no config.json (an EAGLE-3 head's folder "
                                "holds config.json and its weights)")
    config = LlamaConfig.from_dict(json.loads((path / "config.json").read_text()))
    weights = {_strip(name): tensor for name, tensor in _read_weights(path).items()}
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)
    with torch.device(device):
        head = Eagle3Head(config, own_embedding="embed_tokens.weight" in weights)
    load_checkpoint(head, weights.items())
    head.to(dtype=dtype)
    head.rotary_emb.inv_freq_per_dim = head.rotary_emb.inv_freq_per_dim.to(device)  # not moved lazily in a step
    if d2t is not None:
        head.d2t.copy_(d2t.to(torch.int64))
    elif head.draft_vocab_size != config.vocab_size:
        raise ValueError(f"{folder}: draft_vocab_size {head.draft_vocab_size} differs from vocab_size "
                         f"{config.vocab_size} but the checkpoint has no d2t map")
    return head.eval()


def aux_layer_ids(head_config: Any, target_layers: int) -> list[int]:
    """The target layers whose inputs the head reads: ``eagle_config.eagle_aux_hidden_state_layer_ids`` are layer
    outputs (so the inputs of the next layers); by default the inputs of layers 2, L / 2 and L - 3."""
    eagle_config = getattr(head_config, "eagle_config", None) or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    layers = [int(i) + 1 for i in ids] if ids else [2, target_layers // 2, target_layers - 3]
    if len(set(layers)) != 3 or not all(0 <= i <= target_layers for i in layers):
        raise ValueError(f"the EAGLE-3 head reads the inputs of target layers {layers}, which a target of "
                         f"{target_layers} layers does not have as three distinct layers; set "
                         "eagle_config.eagle_aux_hidden_state_layer_ids in its config.json")
    return layers


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for file in files:
            weights.update(load_file(str(file)))
        return weights
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise FileNotFoundError(f"{path}: no *.safetensors or *.bin weights for the EAGLE-3 head")
    weights = {}
    for file in bins:
        weights.update(torch.load(file, map_location="cpu", weights_only=True))
    return weights
