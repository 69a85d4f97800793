"""The HF transformers ``generate`` baseline of ``treadle bench offline`` (``--compare hf``).

HF runs the same prompts on the same weights, dtype and device as the first
treadle system, greedily, with ``min_new_tokens`` so that every request
generates exactly its output length.

How HF is batched (fair to HF): requests are sorted by (output length, input
length) and cut into static batches of ``--hf-batch-size``, left-padded with an
attention mask; each batch generates its longest request's output length and
only the tokens each request asked for are counted (the extra tokens shorter
requests in a batch decode are reported as ``generated_tokens``).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Sequence

import torch

from treadle.bench.offline_results import SystemResult
from treadle.bench.offline_treadle import synchronize
from treadle.bench.workloads import Workload
from treadle.core.config import ServerConfig

HF = "hf"


def hf_target(engine: Any, config: ServerConfig) -> dict[str, Any]:
    """What HF must load to match a treadle engine: its model folder, dtype, device, load format and pad id."""
    return {
        "model_path": engine.model_info["model_path"],
        "dtype": engine.model_info["dtype"],
        "device": engine.model_info["device"],
        "load_format": config.model.load_format,
        "pad_token_id": _pad_token_id(engine),
    }


def run_hf(
    workload: Workload, batch_size: int, target: dict[str, Any], warmup_prompts: int, progress: bool
) -> SystemResult:
    """HF transformers ``generate``: static left-padded batches sorted by output length, greedy."""
    from tqdm import tqdm

    model = _load_hf_model(target)
    device = torch.device(target["device"])
    pad_id = target["pad_token_id"]
    order = sorted(range(workload.num_requests),
                   key=lambda i: (workload.requests[i].output_len, len(workload.requests[i].input_ids)))
    batches = [[workload.requests[i] for i in order[s:s + batch_size]] for s in range(0, len(order), batch_size)]
    if warmup_prompts > 0:
        _hf_generate(model, workload.requests[:min(warmup_prompts, batch_size)], 4, pad_id, device)
    generated = 0
    bar = tqdm(total=workload.num_requests, desc=HF, unit="req", disable=not progress, file=sys.stderr)
    with bar:
        synchronize(device)
        start = time.perf_counter()
        for batch in batches:
            new_tokens = max(r.output_len for r in batch)
            _hf_generate(model, batch, new_tokens, pad_id, device)
            generated += new_tokens * len(batch)
            bar.update(len(batch))
        synchronize(device)
        elapsed = time.perf_counter() - start
    del model
    return SystemResult(
        name=HF,
        kind="hf",
        overrides=[],
        config={"batch_size": batch_size, "attn_implementation": "default (sdpa)", **target},
        total_time_s=elapsed,
        num_requests=workload.num_requests,
        input_tokens=workload.input_tokens,
        output_tokens=workload.output_tokens,
        generated_tokens=generated,
        extra={"transformers_version": _version("transformers")},
    )


def _load_hf_model(target: dict[str, Any]) -> Any:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    dtype = getattr(torch, target["dtype"])
    if target["load_format"] == "dummy":
        # Random weights at the same shapes: throughput does not depend on the values.
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target["model_path"]))
    else:
        model = AutoModelForCausalLM.from_pretrained(target["model_path"], dtype=dtype)
    return model.to(device=target["device"], dtype=dtype).eval()


@torch.inference_mode()
def _hf_generate(model: Any, batch: Sequence[Any], new_tokens: int, pad_id: int, device: torch.device) -> None:
    width = max(len(r.input_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, r in enumerate(batch):
        input_ids[row, width - len(r.input_ids):] = torch.tensor(r.input_ids)
        attention_mask[row, width - len(r.input_ids):] = 1
    out = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), do_sample=False,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id,
        temperature=None, top_p=None, top_k=None,
    )
    if out.shape[1] - width != new_tokens:
        raise RuntimeError(f"HF generate produced {out.shape[1] - width} tokens instead of {new_tokens}")


def _pad_token_id(engine: Any) -> int:
    tokenizer = engine.tokenizer
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    eos = engine.model_info["eos_token_ids"]
    return eos[0] if eos else 0


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
