"""HF transformers peers of `treadle bench one-batch`: ``generate`` on the weights of treadle's runner.

``run_hf`` copies the runner's weights into an HF model of the same config and times
``generate`` eagerly with its dynamic cache, or (``compiled``) with a ``StaticCache``,
on which ``generate`` compiles the decode step with torch.compile.
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import torch

from treadle.bench.one_batch_report import HF_COMPILED, Measurement, measurement, whole_call_steps
from treadle.bench.roofline import free_memory, roofline_seconds, synchronize


def run_hf(runner: Any, prompts: torch.Tensor, args: argparse.Namespace, bandwidth: float,
           compiled: bool = False) -> Measurement:
    """HF ``generate`` eager with its dynamic cache, or (``compiled``) with a static cache and torch.compile."""
    model = _hf_model_with_weights_of(runner)
    device = runner.device
    ids = prompts.to(device)
    mask = torch.ones_like(ids)
    bs, input_len = prompts.shape
    cache = None
    if compiled:
        from transformers import StaticCache

        # One cache length for every call, so the compiled decode step is built (and graph-captured) once.
        cache = StaticCache(config=model.config, max_cache_len=input_len + args.decode_steps + 8)

    def generate(new_tokens: int) -> tuple[float, torch.Tensor]:
        kwargs: dict[str, Any] = {}
        if cache is not None:
            cache.reset()
            kwargs["past_key_values"] = cache
        synchronize(device)
        start = time.perf_counter()
        with warnings.catch_warnings():
            # Newer transformers (5.2x) renamed generate's past_key_values to cache; the GPU machine's 5.17
            # knows only the old name, so the bench keeps it and silences the rename's notice.
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)
        synchronize(device)
        return time.perf_counter() - start, out

    with torch.inference_mode():
        generate(4)  # warm-up (compiles the decode step)
        if compiled:
            generate(8)
        one, steps, out = whole_call_steps(generate, args.decode_steps, args.generate_repeats)
    first_tokens = out[0, input_len:input_len + 16].tolist()
    name = "HF generate, static cache + torch.compile" if compiled else "HF transformers generate"
    result = measurement(name, HF_COMPILED if compiled else None, None, bs, one, steps, first_tokens,
                         roofline_seconds(runner.model, runner, bs, input_len, args.decode_steps, bandwidth))
    model = None  # the HF copy goes before free_memory() (a del would leave generate() a dangling name)
    free_memory()
    return result


def _hf_model_with_weights_of(runner: Any) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(runner.model_dir)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(runner.dtype)
    try:
        with torch.device(runner.device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(runner.dtype).eval()
    params = dict(model.named_parameters())
    copied = set()
    with torch.no_grad():
        for name, tensor in hf_named_weights(runner.model):
            if name in params:
                params[name].copy_(tensor)
                copied.add(name)
    missing = sorted(set(params) - copied)
    if missing:
        raise RuntimeError(f"HF model parameters not filled from treadle's weights: {missing[:5]}")
    return model


def hf_named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """treadle's parameters under HF checkpoint names (stacked projections split back into their shards;
    FP8 weights widened with their scales, so HF runs the same weights)."""
    named = []
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if param_name == "weight_scale":
                continue
            if param_name == "weight" and hasattr(module, "weight_scale"):
                param = (param.float() * module.weight_scale.float()).to(module.fp8_out_dtype)
            if getattr(module, "shard_ids", None):
                parent = module_name.rpartition(".")[0]
                for shard, (offset, rows) in module.shards.items():
                    named.append((f"{parent}.{shard}.{param_name}", param.narrow(0, offset, rows)))
            else:
                named.append((f"{module_name}.{param_name}", param))
    return named
