"""Tiny random HF checkpoints (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral) for parity tests
and plugin authors.

Each helper builds the model with transformers from a fixed seed, saves it as
safetensors plus config.json into ``path`` and returns ``path``. They are small
enough (about 0.1-0.5 M parameters) to run in milliseconds on a CPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def make_tiny_llama(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random ``LlamaForCausalLM`` to ``path``; ``overrides`` replace config fields
    (e.g. ``tie_word_embeddings=True``, ``attention_bias=True``, ``head_dim=32``,
    ``rope_scaling={"rope_type": "llama3", ...}``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_LLAMA_CONFIG, **overrides})
    return _save_random(LlamaForCausalLM, config, path, seed)


def make_tiny_mistral(path: str | os.PathLike, sliding_window: int | None = 8, seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random ``MistralForCausalLM`` whose layers see at most ``sliding_window`` keys."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**{**TINY_LLAMA_CONFIG, "sliding_window": sliding_window, **overrides})
    return _save_random(MistralForCausalLM, config, path, seed)


def make_tiny_qwen2(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random ``Qwen2ForCausalLM`` (biased q/k/v); e.g. ``use_sliding_window=True,
    sliding_window=6, max_window_layers=1`` makes layer 1 a sliding-window layer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**TINY_LLAMA_CONFIG, **overrides})
    return _save_random(Qwen2ForCausalLM, config, path, seed, spread_vectors=True)


def make_tiny_qwen3(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random ``Qwen3ForCausalLM`` (q/k norms; ``head_dim`` 32, so q_proj is wider than hidden)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**TINY_LLAMA_CONFIG, "head_dim": 32, **overrides})
    return _save_random(Qwen3ForCausalLM, config, path, seed, spread_vectors=True)


def make_tiny_mixtral(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random ``MixtralForCausalLM``: 4 experts, top-2 routing, no sliding window by default."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        **{**TINY_LLAMA_CONFIG, "intermediate_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2,
           "sliding_window": None, **overrides}
    )
    return _save_random(MixtralForCausalLM, config, path, seed, spread_vectors=True)


def make_tiny_qwen3_moe(path: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random ``Qwen3MoeForCausalLM``: 4 experts, top-2 (not renormalised, as Qwen3-MoE's default),
    layer 1 dense (``mlp_only_layers=[1]``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **{**TINY_LLAMA_CONFIG, "head_dim": 32, "moe_intermediate_size": 48, "num_experts": 4,
           "num_experts_per_tok": 2, "mlp_only_layers": [1], **overrides}
    )
    return _save_random(Qwen3MoeForCausalLM, config, path, seed, spread_vectors=True)


def _save_random(model_cls: Any, config: Any, path: str | os.PathLike, seed: int, spread_vectors: bool = False) -> str:
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    # HF initializes with std 0.02, which makes logits nearly flat; a wider spread gives
    # clear greedy choices so parity tests compare real decisions, not near-ties.
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                param.normal_(0.0, 0.08, generator=generator)
            elif spread_vectors and (name.endswith("bias") or name.endswith("norm.weight")):
                # Biases start at zero and norms at one; random ones make the parity tests check them.
                param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1, generator=generator)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_tiny_fp8_llama(
    path: str | os.PathLike, *, per_tensor: bool = False, input_scale: float | None = None,
    kv_scales: tuple[float, float] | None = None, seed: int = 0, **overrides: Any,
) -> str:
    """Save a tiny random Llama as an FP8 checkpoint in the HF ``quantization_config`` format
    (``quant_method: fp8``): every decoder projection as ``float8_e4m3fn`` ``weight`` plus a float32
    ``weight_scale`` — one per output row (``[out, 1]``), or with ``per_tensor`` one per tensor (``[]``) —
    and, when ``input_scale`` is given, a static activation scale per projection; ``kv_scales`` adds each
    layer's ``self_attn.k_scale`` / ``self_attn.v_scale`` for an FP8 KV cache. The embeddings and
    lm_head stay float32."""
    out = Path(make_tiny_llama(path, seed=seed, **overrides))
    return _to_fp8_checkpoint(out, FP8_PROJECTIONS, per_tensor, input_scale, kv_scales)


def make_tiny_fp8_mixtral(path: str | os.PathLike, *, per_tensor: bool = False, input_scale: float | None = None,
                          seed: int = 0, **overrides: Any) -> str:
    """:func:`make_tiny_mixtral` saved as an FP8 checkpoint like :func:`make_tiny_fp8_llama`: the attention
    projections and every expert's ``w1``/``w2``/``w3`` in ``float8_e4m3fn`` with their scales (the router and
    lm_head stay float32), as FP8 Mixtral checkpoints on the hub store them."""
    out = Path(make_tiny_mixtral(path, seed=seed, **overrides))
    return _to_fp8_checkpoint(out, FP8_PROJECTIONS + ("w1", "w2", "w3"), per_tensor, input_scale, None)


def _to_fp8_checkpoint(out: Path, projections: tuple[str, ...], per_tensor: bool, input_scale: float | None,
                       kv_scales: tuple[float, float] | None) -> str:
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    fp8 = torch.float8_e4m3fn
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in projections]:
        weight = tensors[name].float()
        amax = weight.abs().amax() if per_tensor else weight.abs().amax(dim=1, keepdim=True)
        scale = (amax / torch.finfo(fp8).max).clamp(min=1e-12)
        tensors[name] = (weight / scale).clamp(-448, 448).to(fp8)
        stem = name.removesuffix(".weight")
        tensors[f"{stem}.weight_scale"] = scale.to(torch.float32).contiguous()
        if input_scale is not None:
            tensors[f"{stem}.input_scale"] = torch.tensor(input_scale, dtype=torch.float32)
    if kv_scales is not None:
        for layer in range(json.loads((out / "config.json").read_text())["num_hidden_layers"]):
            tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(kv_scales[0], dtype=torch.float32)
            tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(kv_scales[1], dtype=torch.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "static" if input_scale is not None else "dynamic",
        "ignored_layers": ["lm_head"],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out)
