"""Embedding throughput: treadle's ``Engine.encode`` against HF transformers on the same GPU, in the same run.

``python -m treadle.bench.embed`` builds an 8B embedding model's shape (Qwen3-Embedding-8B: a bare ``Qwen3Model``
with last-token pooling, normalized) with dummy weights, embeds ``--passages`` random passages of
``--min-len``..``--max-len`` tokens with HF transformers (``AutoModel``, sdpa attention, batches of
``--hf-batch-size`` passages sorted by length and right-padded, the last real token pooled), then with treadle, and
prints embeddings/s and tokens/s of each. Results go to ``--output`` (default: the results folder).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from treadle.bench.results_folder import default_output

QWEN3_8B_EMBEDDING: dict[str, Any] = {
    "architectures": ["Qwen3Model"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151665,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "torch_dtype": "float32"}


def write_embedding_model(folder: Path, shape: dict[str, Any] = QWEN3_8B_EMBEDDING) -> Path:
    """``config.json`` plus the sentence-transformers files of a last-token, normalized embedding model."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    return folder


def passages(count: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def run_treadle(folder: Path, prompts: list[list[int]], overrides: dict[str, Any]) -> dict[str, Any]:
    from treadle import Engine

    # The built-in poolings by module too, for an install whose entry points predate them (loaded once either way).
    config = {"model": {"path": str(folder), "load_format": "dummy", "dtype": "auto"},
              "plugins": ["treadle.plugins.poolings.builtin"], **overrides}
    engine = Engine(config)
    try:
        engine.encode(input_ids=prompts[:32])  # warm-up: kernels compiled, the allocator grown
        engine.flush_cache()
        _synchronize()
        start = time.perf_counter()
        outputs = engine.encode(input_ids=prompts)
        seconds = time.perf_counter() - start
        assert len(outputs) == len(prompts)
        resolved = engine.resolved_config
        details = {"attention_backend": resolved.attention.backend,
                   "chunked_prefill_size": resolved.scheduler.chunked_prefill_size}
    finally:
        engine.shutdown()
    return {"seconds": seconds, **details}


@torch.inference_mode()
def run_hf(folder: Path, prompts: list[list[int]], batch_size: int) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(folder)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        dtype = torch.bfloat16 if device == "cuda" else torch.float32  # as treadle's dtype: auto
        model = AutoModel.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]

    def embed(batch: list[int]) -> torch.Tensor:
        longest = max(len(prompts[i]) for i in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.int64)
        mask = torch.zeros(len(batch), longest, dtype=torch.int64)
        for row, i in enumerate(batch):
            ids[row, :len(prompts[i])] = torch.tensor(prompts[i])
            mask[row, :len(prompts[i])] = 1
        hidden = model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        last = mask.sum(1).to(device) - 1
        return torch.nn.functional.normalize(hidden[torch.arange(len(batch), device=device), last].float(), dim=-1)

    embed(batches[-1][:4])  # warm-up
    _synchronize()
    start = time.perf_counter()
    for batch in batches:
        embed(batch)
    _synchronize()
    return {"seconds": time.perf_counter() - start, "batch_size": batch_size}


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=1000)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--no-hf", action="store_true", help="treadle only")
    parser.add_argument("--chunked-prefill-size", type=int, default=None, help="treadle's (default: auto)")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family (a CPU smoke run)")
    args = parser.parse_args(argv)

    shape = {**QWEN3_8B_EMBEDDING, **(TINY if args.tiny else {})}
    prompts = passages(args.passages, args.min_len, args.max_len, shape["vocab_size"], args.seed)
    tokens = sum(len(p) for p in prompts)
    overrides: dict[str, Any] = {}
    if args.chunked_prefill_size:
        overrides["scheduler"] = {"chunked_prefill_size": args.chunked_prefill_size}
    systems: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_embedding_model(Path(tmp) / "qwen3-embedding", shape)
        # HF first: its model is gone (and its memory back) when it returns, so treadle's KV pool is sized on a
        # clean device; an engine shut down first may still hold memory the HF model would then need.
        if not args.no_hf:
            systems["hf"] = run_hf(folder, prompts, args.hf_batch_size)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        systems["treadle"] = run_treadle(folder, prompts, overrides)
    for result in systems.values():
        result["embeddings_per_s"] = len(prompts) / result["seconds"]
        result["tokens_per_s"] = tokens / result["seconds"]
    print(f"{'system':<10} {'seconds':>9} {'embeddings/s':>13} {'tokens/s':>11}")
    for name, result in systems.items():
        print(f"{name:<10} {result['seconds']:>9.2f} {result['embeddings_per_s']:>13.1f} {result['tokens_per_s']:>11.0f}")
    if "hf" in systems:
        print(f"treadle / hf: {systems['treadle']['embeddings_per_s'] / systems['hf']['embeddings_per_s']:.2f}x")
    report = {"benchmark": "embed", "shape": "tiny" if args.tiny else "qwen3-8b-embedding", "device": _device_name(),
              "passages": len(prompts), "tokens": tokens, "min_len": args.min_len, "max_len": args.max_len,
              "systems": systems}
    output = args.output or default_output(f"embed_{_device_name().replace(' ', '-').lower()}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    print(f"wrote {output}")
    return report


if __name__ == "__main__":
    main()
