"""Images in a request, from what a caller sends to what the scheduler queues: decoded, preprocessed by the model's
own image processor (transformers'), and their placeholder tokens expanded to the encoder's output length.

A prompt marks each image with the model's image token (``<|image_pad|>`` for Qwen2.5-VL, one token or a run of
them) in the order of ``image_data``. An image is given as raw bytes, a ``data:`` URL, a path (``file://`` or
plain), or a PIL image; HTTP URLs are fetched by the server before they get here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from treadle.core.multimodal.inputs import MultimodalInputs, MultimodalItem
from treadle.core.validation import InvalidRequestError

DEFAULT_MAX_IMAGES = 16
DEFAULT_MAX_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may hold: a 400 names the limit broken."""

    max_images_per_request: int = DEFAULT_MAX_IMAGES
    max_image_pixels: int = DEFAULT_MAX_PIXELS


class MultimodalProcessor:
    """Turns a prompt's token ids and its images into the ids and :class:`MultimodalInputs` the scheduler takes."""

    def __init__(self, model_dir: str, hf_config: Any, limits: ImageLimits = ImageLimits()) -> None:
        self.model_dir = model_dir
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(hf_config.vision_config.spatial_merge_size)
        self.limits = limits
        self._image_processor: Any = None

    @classmethod
    def for_model(cls, model_dir: str, hf_config: Any, limits: ImageLimits = ImageLimits()
                  ) -> "MultimodalProcessor | None":
        """A processor when the model takes images (its config names an image token), else None."""
        if getattr(hf_config, "image_token_id", None) is None or getattr(hf_config, "vision_config", None) is None:
            return None
        return cls(model_dir, hf_config, limits)

    @property
    def image_processor(self) -> Any:
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            self._image_processor = AutoImageProcessor.from_pretrained(self.model_dir)
        return self._image_processor

    def process(self, input_ids: Sequence[int], image_data: Sequence[Any], param: str = "image_data"
                ) -> tuple[list[int], MultimodalInputs]:
        """``input_ids`` with each image's placeholder expanded, and the images ready for the vision encoder."""
        if len(image_data) > self.limits.max_images_per_request:
            raise InvalidRequestError(
                f"{len(image_data)} images in one request; the limit is max_images_per_request = "
                f"{self.limits.max_images_per_request}", param=param, code="too_many_images")
        images = [self.load_image(data, f"{param}[{i}]") for i, data in enumerate(image_data)]
        # The radix cache's key: a hash of the decoded image (smaller than the patches it becomes).
        hashes = [image_hash(image) for image in images]
        runs = placeholder_runs(list(input_ids), self.image_token_id)
        if len(runs) != len(images):
            raise InvalidRequestError(f"the prompt marks {len(runs)} images (image token id {self.image_token_id}) "
                                      f"but {len(images)} were given", param=param)
        processed = self.image_processor(images=images, return_tensors="pt")
        pixel_values, grids = processed["pixel_values"], processed["image_grid_thw"].tolist()
        ids: list[int] = []
        items: list[MultimodalItem] = []
        cursor = first_patch = 0
        for (start, length), grid, content_hash in zip(runs, grids, hashes):
            ids.extend(input_ids[cursor:start])
            patches = grid[0] * grid[1] * grid[2]
            tokens = patches // (self.merge * self.merge)
            items.append(MultimodalItem("image", pixel_values[first_patch:first_patch + patches],
                                        (int(grid[0]), int(grid[1]), int(grid[2])), offset=len(ids),
                                        num_tokens=tokens, content_hash=content_hash))
            ids.extend([self.image_token_id] * tokens)
            first_patch += patches
            cursor = start + length
        ids.extend(input_ids[cursor:])
        return ids, MultimodalInputs(items)

    def load_image(self, data: Any, param: str) -> Any:
        """A PIL image in RGB from bytes, a ``data:`` URL, a path or a PIL image; a 400 when it is not one."""
        from PIL import Image

        if isinstance(data, Image.Image):
            image = data
        else:
            raw = _image_bytes(data, param)
            try:
                image = Image.open(io.BytesIO(raw))
                image.load()
            except Exception as exc:  # PIL raises many kinds for a corrupt or truncated file
                raise InvalidRequestError(f"{param} is not a readable image ({type(exc).__name__}: {exc})",
                                          param=param, code="invalid_image") from None
        if image.width * image.height > self.limits.max_image_pixels:
            raise InvalidRequestError(
                f"{param} has {image.width}x{image.height} pixels; the limit is max_image_pixels = "
                f"{self.limits.max_image_pixels}", param=param, code="image_too_large")
        return image.convert("RGB")


def image_hash(image: Any) -> str:
    """A hash of an image's decoded pixels, mode and size."""
    digest = hashlib.sha256(repr((image.mode, image.size)).encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def placeholder_runs(input_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of ``token_id`` in ``input_ids``."""
    runs: list[tuple[int, int]] = []
    index = 0
    while index < len(input_ids):
        if input_ids[index] == token_id:
            end = index
            while end < len(input_ids) and input_ids[end] == token_id:
                end += 1
            runs.append((index, end - index))
            index = end
        else:
            index += 1
    return runs


def _image_bytes(data: Any, param: str) -> bytes:
    if isinstance(data, (bytes, bytearray)):
        return bytes(data)
    if not isinstance(data, str):
        raise InvalidRequestError(f"{param} must be image bytes, a data: URL or a file path, got "
                                  f"{type(data).__name__}", param=param)
    if data.startswith("data:"):
        _, _, encoded = data.partition(",")
        try:
            return base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError(f"{param} is a data: URL whose payload is not base64", param=param,
                                      code="invalid_image") from None
    path = Path(data.removeprefix("file://"))
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidRequestError(f"{param}: cannot read image file '{path}': {exc.strerror}", param=param) from None
