"""The model's tokenizer and the token ids that end a generation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(path: str | None) -> Any:
    """The HF tokenizer in ``path``, or None when the folder has none (ids-only serving)."""
    if path is None:
        return None
    folder = Path(path)
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def eos_token_ids(hf_config: Any, model_dir: str, tokenizer: Any) -> set[int]:
    """Token ids that stop generation: from config.json, generation_config.json and the tokenizer."""
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    generation_config = Path(model_dir) / "generation_config.json"
    if generation_config.exists():
        add(json.loads(generation_config.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids
