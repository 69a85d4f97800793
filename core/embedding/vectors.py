"""What a caller may ask of an embedding's vector: fewer ``dimensions`` (Matryoshka truncation)."""

from __future__ import annotations

import math
from typing import Any, Mapping

from treadle.core.validation import InvalidRequestError


def check_dimensions(dimensions: int | None, embedding_info: Mapping[str, Any]) -> None:
    """Raise InvalidRequestError unless ``dimensions`` (None: the whole vector) may be asked of this model
    (``embedding_info``: the scheduler's ``model_info["embedding"]``)."""
    if dimensions is None:
        return
    size = int(embedding_info["dimensions"])
    if not embedding_info.get("matryoshka"):
        raise InvalidRequestError(
            f"this model's embeddings have {size} dimensions and cannot be shortened (it is not a Matryoshka "
            "model; set model.matryoshka: true if it is); leave out `dimensions`", param="dimensions")
    if not 1 <= dimensions <= size:
        raise InvalidRequestError(f"dimensions must be between 1 and {size} (this model's embedding size), "
                                  f"got {dimensions}", param="dimensions")


def truncate(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """The vector's first ``dimensions`` values, scaled back to unit length when the model normalizes."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    if not normalize:
        return head
    norm = math.sqrt(sum(value * value for value in head)) or 1.0
    return [value / norm for value in head]
