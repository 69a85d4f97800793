"""Random EAGLE-3 heads in the hub layout of ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`` (``LlamaForCausalLMEagle3``),
for a target of any Llama-family shape: the tests' tiny ones, and 8B-shaped ones for benchmarks of the machinery
(their drafts are random: they measure what drafting costs, not what it gains)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch


def make_eagle3_head(path: str | Path, target_config: dict, draft_vocab: int, aux_layer_ids: list[int] | None = None,
                     seed: int = 0, bin_format: bool = False, scale: float = 0.2,
                     dtype: torch.dtype = torch.float32, draft_targets: Sequence[int] | None = None) -> str:
    """Save a random head for a target of ``target_config`` (an HF Llama config dict): ``config.json``, the weights
    (``model.safetensors``, or ``pytorch_model.bin``) in ``dtype``, and ``d2t``/``t2d`` mapping ``draft_vocab`` of
    the target's ids (every other one from 0) to the draft vocabulary. ``draft_targets``: map draft id ``d`` to
    ``draft_targets[d % len(draft_targets)]`` instead (a few tokens the target repeats, so that some drafts are
    kept; the weights are the same)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hidden, heads = target_config["hidden_size"], target_config["num_attention_heads"]
    kv_heads = target_config.get("num_key_value_heads", heads)
    head_dim = target_config.get("head_dim") or hidden // heads
    vocab, inter = target_config["vocab_size"], target_config["intermediate_size"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
        "max_position_embeddings": target_config.get("max_position_embeddings", 2048),
        "rms_norm_eps": target_config.get("rms_norm_eps", 1e-5), "rope_theta": target_config.get("rope_theta", 1e4),
        "rope_scaling": target_config.get("rope_scaling"), "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    (path / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    def norm() -> torch.Tensor:
        return (1.0 + torch.randn(hidden, generator=generator) * scale * 0.25).to(dtype)

    target_ids = torch.arange(draft_vocab) * 2
    if draft_targets is not None:
        target_ids = torch.tensor(list(draft_targets), dtype=torch.int64)[torch.arange(draft_vocab) % len(draft_targets)]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    weights = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden), "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": norm(), "lm_head.weight": rand(draft_vocab, hidden),
        "d2t": target_ids - torch.arange(draft_vocab), "t2d": t2d,
    }
    if bin_format:
        torch.save(weights, path / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(path / "model.safetensors"))
    return str(path)
