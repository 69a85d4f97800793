"""What a checkpoint says about serving it for embeddings, and the embedding settings resolved from it.

A sentence-transformers folder (``modules.json``) is an embedding model; its Pooling module's config
(``1_Pooling/config.json``) names the pooling and a ``Normalize`` module asks for unit vectors. An architecture
named like a bare transformer (``Qwen3Model``, ``MistralModel``) is one too: it is served by the family
registered for ``...ForCausalLM`` without its output head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# sentence-transformers' Pooling config flags -> pooling names (the registered ones, or a plugin's).
_POOLING_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
DEFAULT_POOLING = "last"


@dataclass(frozen=True)
class CheckpointEmbedding:
    """What the checkpoint says (None: it says nothing)."""

    is_embedding: bool = False
    pooling: str | None = None
    normalize: bool | None = None
    matryoshka: bool = False


@dataclass(frozen=True)
class EmbeddingSettings:
    """``model.task`` and the embedding settings, every ``auto`` resolved."""

    task: str
    pooling: str
    normalize: bool
    matryoshka: bool


def read_checkpoint_embedding(model_dir: str, hf_config: Any) -> CheckpointEmbedding:
    """What ``model_dir`` (and its config) say about embeddings."""
    folder = Path(model_dir)
    matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or getattr(hf_config, "matryoshka_dimensions", None))
    modules = _read_json(folder / "modules.json")
    if isinstance(modules, list):
        pooling = normalize = None
        for module in modules:
            kind = str(module.get("type", ""))
            if kind.endswith(".Pooling"):
                pooling = _pooling_name(_read_json(folder / str(module.get("path", "")) / "config.json") or {})
            elif kind.endswith(".Normalize"):
                normalize = True
        return CheckpointEmbedding(True, pooling, bool(normalize), matryoshka)
    if any(is_bare_model_architecture(name) for name in getattr(hf_config, "architectures", None) or []):
        return CheckpointEmbedding(True, None, None, matryoshka)
    return CheckpointEmbedding(matryoshka=matryoshka)


def resolve_embedding(model_config: Any, checkpoint: CheckpointEmbedding) -> EmbeddingSettings:
    """``model.task``/``pooling``/``normalize_embeddings``/``matryoshka`` with each ``auto`` resolved."""
    task = model_config.task
    if task == "auto":
        task = "embed" if checkpoint.is_embedding else "generate"
    pooling = model_config.pooling
    if pooling == "auto":
        pooling = checkpoint.pooling or DEFAULT_POOLING
    normalize = model_config.normalize_embeddings
    if normalize == "auto":
        normalize = checkpoint.normalize if checkpoint.normalize is not None else True
    matryoshka = model_config.matryoshka
    if matryoshka == "auto":
        matryoshka = checkpoint.matryoshka
    return EmbeddingSettings(task, pooling, bool(normalize), bool(matryoshka))


def is_bare_model_architecture(name: str) -> bool:
    """``Qwen3Model``-style names: a transformer without a head (what embedding checkpoints declare)."""
    return name.endswith("Model") and not name.endswith("PreTrainedModel")


def causal_lm_architecture(name: str) -> str:
    """The causal-LM name a bare-model architecture is served by (``Qwen3Model`` -> ``Qwen3ForCausalLM``)."""
    return name[: -len("Model")] + "ForCausalLM" if is_bare_model_architecture(name) else name


def _pooling_name(pooling_config: dict[str, Any]) -> str | None:
    return next((name for key, name in _POOLING_MODES.items() if pooling_config.get(key)), None)


def _read_json(path: Path) -> Any:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None
