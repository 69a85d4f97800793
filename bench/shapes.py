"""Model shapes that `treadle bench one-batch` builds with ``load_format: dummy`` weights.

Each is an HF ``config.json`` as a dict; ``write_config`` puts one in a folder that
``model.path`` can name. The GPU scripts (tests/gpu/*.sh) do it with
``python -m treadle.bench.shapes NAME FOLDER``, which prints the folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3",
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
# Llama-3.1-70B's shape: does not fit one 80 GB GPU in bf16 (141 GB); run it with --tp 2 on H200s.
LLAMA_3_1_70B: dict[str, Any] = {
    **LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8,
}
SHAPES = {"llama-3.1-8b": LLAMA_3_1_8B, "llama-3.1-70b": LLAMA_3_1_70B}
# Qwen3-30B-A3B's shape (48 layers of 128 experts, top-8; 61 GB in bf16), for offline and serving runs of an MoE
# model (tests/gpu/device.sh: OFFLINE_SHAPE=qwen3-30b-a3b). Not in SHAPES: one-batch's roofline counts every
# weight, and a decode step of one token reads 8 of each layer's 128 experts.
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
# Mixtral-8x7B's shape (32 layers of 8 experts, top-2; 93 GB in bf16, 47 GB with FP8 experts: bf16 needs an H200,
# `model.quantization: fp8` fits one H100, quantizing layer by layer at load), for offline and serving runs.
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
# Llama-3.1-8B's shape with 4-bit weights (bench/quant.py): the quantization_config of an llm-compressor W4A16
# checkpoint (compressed-tensors pack-quantized, symmetric, groups of 128, lm_head left in 16 bits), and AutoAWQ's.
W4A16_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
    "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}},
}
AWQ_CONFIG: dict[str, Any] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                              "version": "gemm"}
MODEL_SHAPES = {**SHAPES, "qwen3-30b-a3b": QWEN3_30B_A3B, "mixtral-8x7b": MIXTRAL_8X7B,  # what write_config may write
                "llama-3.1-8b-w4a16": {**LLAMA_3_1_8B, "quantization_config": W4A16_CONFIG},
                "llama-3.1-8b-awq": {**LLAMA_3_1_8B, "quantization_config": AWQ_CONFIG},
                # The attention and the experts in 4 bits (the experts through the integer fused-MoE kernels).
                "mixtral-8x7b-w4a16": {**MIXTRAL_8X7B, "quantization_config": W4A16_CONFIG},
                "mixtral-8x7b-awq": {**MIXTRAL_8X7B, "quantization_config": AWQ_CONFIG}}
# A few-layer model of the same kind, for smoke tests on the CPU.
TINY: dict[str, Any] = {
    **LLAMA_3_1_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
}


def write_config(folder: Path, config: dict[str, Any]) -> str:
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


def main(argv: Sequence[str] | None = None) -> int:
    """``NAME FOLDER``: write the ``MODEL_SHAPES`` entry NAME as FOLDER/config.json (creating FOLDER); print FOLDER."""
    name, folder = argv if argv is not None else sys.argv[1:]
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    print(write_config(path, MODEL_SHAPES[name]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
