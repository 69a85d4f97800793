"""Tiny random embedding checkpoints: a bare transformer (``Qwen3Model``/``Qwen2Model``) saved with the
sentence-transformers files that say how to pool it, as Qwen3-Embedding and gte-Qwen2 ship."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from treadle.testing.models import TINY_LLAMA_CONFIG

_POOLING_FLAGS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def make_tiny_embedding_model(path: str | os.PathLike, family: str = "qwen3", pooling: str | None = "last",
                              normalize: bool = True, seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random bare ``Qwen3Model`` (or ``Qwen2Model``: ``family="qwen2"``) to ``path``; with ``pooling``
    also ``modules.json``, ``1_Pooling/config.json`` and (``normalize``) a Normalize module."""
    from transformers import Qwen2Config, Qwen2Model, Qwen3Config, Qwen3Model

    config_cls, model_cls, extra = {
        "qwen3": (Qwen3Config, Qwen3Model, {"head_dim": 32}), "qwen2": (Qwen2Config, Qwen2Model, {})}[family]
    config = config_cls(**{**TINY_LLAMA_CONFIG, **extra, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                param.normal_(0.0, 0.08, generator=generator)
            elif name.endswith("bias") or name.endswith("norm.weight"):
                param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1, generator=generator)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (out / "modules.json").write_text(json.dumps(modules))
        (out / "1_Pooling").mkdir(exist_ok=True)
        flags = {flag: name == pooling for name, flag in _POOLING_FLAGS.items()}
        (out / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": config.hidden_size,
                                                                   **flags}))
    return str(out)


def hf_embeddings(model_dir: str, prompts: list[list[int]], pooling: str, normalize: bool) -> list[torch.Tensor]:
    """HF transformers' pooled final hidden states of each prompt (float32, one prompt at a time)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    vectors = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
            vectors.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return vectors


def check_pooling(factory: Any, hidden_size: int = 8, seed: int = 0) -> None:
    """A ``poolings`` plugin pools a prompt the same whole or cut into chunks: every request's vector from one
    step equals the one its chunks (of 1, 2, 3... tokens, several requests a step) combine to; parts are float32
    ``[bs, hidden]``; ``first_needed_position`` lies inside the prompt."""
    from treadle.core.embedding.pooling import PoolingChunk

    pooling = factory()
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = [1, 5, 9]
    hidden = [torch.randn(n, hidden_size, generator=generator) for n in prompt_lens]

    def step(rows: list[torch.Tensor], first_positions: list[int]) -> torch.Tensor:
        lens = torch.tensor([r.shape[0] for r in rows])
        starts = torch.cumsum(lens, 0) - lens
        owner = torch.repeat_interleave(torch.arange(len(rows)), lens)
        chunk = PoolingChunk(starts, lens, owner, first_positions, [prompt_lens[i] for i in range(len(rows))])
        parts = pooling.reduce(torch.cat(rows), chunk)
        assert parts.dtype == torch.float32 and tuple(parts.shape) == (len(rows), hidden_size), \
            f"reduce must return float32 [bs, hidden], got {parts.dtype} {tuple(parts.shape)}"
        return parts

    whole = step(hidden, [0] * len(hidden))
    for index, (states, length) in enumerate(zip(hidden, prompt_lens)):
        first = pooling.first_needed_position(length)
        assert 0 <= first <= length - 1, f"first_needed_position({length}) = {first} is outside the prompt"
        for size in (1, 2, 3):
            pooled = None
            for start in range(0, length, size):
                part = step([states[start:start + size]], [start])[0]
                pooled = part if pooled is None else pooling.combine(pooled, part, start)
            torch.testing.assert_close(pooling.finish(pooled, length), pooling.finish(whole[index], length),
                                       msg=f"request {index} pooled in chunks of {size} differs from whole")
