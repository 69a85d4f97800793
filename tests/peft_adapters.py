"""Random LoRA adapters saved by PEFT itself, and HF transformers + PEFT greedy output as the reference (imported by
name from the LoRA tests, see conftest.py)."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def make_peft_adapter(base_dir: str, out_dir: str | Path, rank: int = 8, alpha: float | None = None,
                      targets: list[str] | None = None, seed: int = 1, use_rslora: bool = False,
                      std: float = 0.1) -> str:
    """A PEFT LoRA adapter of ``base_dir`` with random A and B (std ``std``), saved with ``save_pretrained``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, target_modules=targets or ATTENTION,
                        use_rslora=use_rslora, lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


def peft_greedy(base_dir: str, adapter_dir: str | None, prompts: list[list[int]], max_new_tokens: int
                ) -> list[list[int]]:
    """Greedy continuations from HF transformers with the adapter applied by PEFT (None: the base model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(input_ids=torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens)
            outputs.append(out[0, len(ids):].tolist())
    return outputs
