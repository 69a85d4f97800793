"""Images and videos in a request, from what a caller sends to what the scheduler queues: decoded, preprocessed by
the model's own image processor (transformers'), and their placeholder tokens expanded to the encoder's output length.

A prompt marks each image with the model's image token (``<|image_pad|>`` for Qwen2.5-VL, one token or a run of
them) in the order of ``image_data``, and each video with its video token (``<|video_pad|>``) in the order of
``video_data``. An image is given as raw bytes, a ``data:`` URL, a path (``file://`` or plain), or a PIL image; a
video as a list of such frames or an animated image (core/multimodal/video.py); HTTP URLs are fetched by the server
before they get here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from treadle.core.multimodal.inputs import MultimodalInputs, MultimodalItem
from treadle.core.multimodal.video import DEFAULT_VIDEO_FPS, EncodedVideo, VideoFrames, animated_frames, \
    frame_pairs, video_hash
from treadle.core.validation import InvalidRequestError

DEFAULT_MAX_IMAGES = 16
DEFAULT_MAX_PIXELS = 4096 * 4096
DEFAULT_MAX_VIDEOS = 2
DEFAULT_MAX_VIDEO_FRAMES = 64
DEFAULT_MAX_VIDEO_PIXELS = 64 * 1024 * 768
# transformers' Qwen2-VL image processor's defaults (what a checkpoint that names one limit keeps of the other).
QWEN2_VL_MIN_PIXELS = 56 * 56
QWEN2_VL_MAX_PIXELS = 28 * 28 * 1280


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images and videos may hold: a 400 names the limit broken."""

    max_images_per_request: int = DEFAULT_MAX_IMAGES
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    max_videos_per_request: int = DEFAULT_MAX_VIDEOS
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES
    max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS

    @classmethod
    def from_config(cls, config: Any) -> "ImageLimits":
        """The limits of a ``multimodal`` config section."""
        return cls(config.max_images_per_request, config.max_image_pixels, config.max_videos_per_request,
                   config.max_video_frames, config.max_video_pixels)


class MultimodalProcessor:
    """Turns a prompt's token ids, its images and its videos into the ids and :class:`MultimodalInputs` the
    scheduler takes."""

    def __init__(self, model_dir: str, hf_config: Any, limits: ImageLimits = ImageLimits()) -> None:
        self.model_dir = model_dir
        self.image_token_id = int(hf_config.image_token_id)
        video_token = getattr(hf_config, "video_token_id", None)
        self.video_token_id = int(video_token) if video_token is not None else None
        vision = hf_config.vision_config
        self.merge = int(vision.spatial_merge_size)
        self.temporal_patch = int(getattr(vision, "temporal_patch_size", 2))
        self.patch = int(getattr(vision, "patch_size", 14))
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
            self._image_processor = load_image_processor(self.model_dir)
        return self._image_processor

    def process(self, input_ids: Sequence[int], image_data: Sequence[Any], param: str = "image_data",
                video_data: Sequence[Any] = (), video_param: str = "video_data"
                ) -> tuple[list[int], MultimodalInputs]:
        """``input_ids`` with each image's and video's placeholder expanded, and both ready for the vision encoder.

        A video is a list of frames (:class:`VideoFrames`, or a plain list at 2 frames per second) or an animated
        image (bytes, a ``data:`` URL, a path or a PIL image)."""
        self.check_counts(len(image_data), len(video_data), param, video_param)
        images = [self.load_image(data, f"{param}[{i}]") for i, data in enumerate(image_data)]
        videos = [self.load_video(data, f"{video_param}[{i}]") for i, data in enumerate(video_data)]
        runs = self._runs(list(input_ids), len(images), len(videos), param, video_param)
        encoded = iter(self._encode_images(images))
        encoded_videos = iter(self._encode_video(frames, f"{video_param}[{i}]") for i, frames in enumerate(videos))
        ids: list[int] = []
        items: list[MultimodalItem] = []
        cursor = 0
        for start, length, kind in runs:
            ids.extend(input_ids[cursor:start])
            if kind == "image":
                pixel_values, grid, content_hash = next(encoded)
                seconds, token = 1.0, self.image_token_id
            else:
                video = next(encoded_videos)
                pixel_values, grid, content_hash = video.pixel_values, video.grid_thw, video.content_hash
                seconds, token = video.seconds_per_grid, self.video_token_id
            tokens = grid[0] * grid[1] * grid[2] // (self.merge * self.merge)
            items.append(MultimodalItem(kind, pixel_values, grid, offset=len(ids), num_tokens=tokens,
                                        seconds_per_grid=seconds, content_hash=content_hash))
            ids.extend([token] * tokens)
            cursor = start + length
        ids.extend(input_ids[cursor:])
        return ids, MultimodalInputs(items)

    def check_counts(self, images: int, videos: int, param: str = "image_data", video_param: str = "video_data"
                     ) -> None:
        """A 400 when a request holds more images or videos than the limits allow, or videos the model cannot
        take."""
        limits = self.limits
        if images > limits.max_images_per_request:
            raise InvalidRequestError(f"{images} images in one request; the limit is max_images_per_request = "
                                      f"{limits.max_images_per_request}", param=param, code="too_many_images")
        if videos and self.video_token_id is None:
            raise InvalidRequestError("this model takes no video (its config names no video_token_id)",
                                      param=video_param)
        if videos > limits.max_videos_per_request:
            raise InvalidRequestError(f"{videos} videos in one request; the limit is max_videos_per_request = "
                                      f"{limits.max_videos_per_request}", param=video_param, code="too_many_videos")

    def _runs(self, input_ids: list[int], images: int, videos: int, param: str, video_param: str
              ) -> list[tuple[int, int, str]]:
        """``(start, length, kind)`` of each image and video placeholder run, in prompt order."""
        runs = [(start, length, "image") for start, length in placeholder_runs(input_ids, self.image_token_id)]
        if self.video_token_id is not None:
            runs += [(start, length, "video") for start, length in placeholder_runs(input_ids, self.video_token_id)]
        marked_images = sum(kind == "image" for *_, kind in runs)
        if marked_images != images:
            raise InvalidRequestError(f"the prompt marks {marked_images} images (image token id "
                                      f"{self.image_token_id}) but {images} were given", param=param)
        if len(runs) - marked_images != videos:
            raise InvalidRequestError(f"the prompt marks {len(runs) - marked_images} videos (video token id "
                                      f"{self.video_token_id}) but {videos} were given", param=video_param)
        return sorted(runs)

    def _encode_images(self, images: list[Any]) -> list[tuple[torch.Tensor, tuple[int, int, int], str]]:
        """Each image's patches, grid and content hash (one call of the image processor for all of them)."""
        if not images:
            return []
        # The radix cache's key: a hash of the decoded image (smaller than the patches it becomes).
        hashes = [image_hash(image) for image in images]
        processed = self.image_processor(images=images, return_tensors="pt")
        pixel_values, grids = processed["pixel_values"], processed["image_grid_thw"].tolist()
        out, first = [], 0
        for grid, content_hash in zip(grids, hashes):
            patches = grid[0] * grid[1] * grid[2]
            out.append((pixel_values[first:first + patches], (int(grid[0]), int(grid[1]), int(grid[2])),
                        content_hash))
            first += patches
        return out

    def load_video(self, data: Any, param: str) -> VideoFrames:
        """A video's frames as RGB PIL images (each checked like an image) and its rate; a 400 naming the limit
        when it has too many frames or pixels."""
        limits = self.limits
        if isinstance(data, VideoFrames) or isinstance(data, (list, tuple)):
            video = data if isinstance(data, VideoFrames) else VideoFrames(list(data))
            if len(video.frames) > limits.max_video_frames:
                raise InvalidRequestError(f"{param} has {len(video.frames)} frames; the limit is max_video_frames = "
                                          f"{limits.max_video_frames}", param=param, code="video_too_large")
        else:
            video = animated_frames(data, None if _is_image(data) else _image_bytes(data, param),
                                    limits.max_video_frames, param)
        if not video.frames:
            raise InvalidRequestError(f"{param} has no frames", param=param, code="invalid_video")
        frames = [self.load_image(frame, f"{param}[{i}]") for i, frame in enumerate(video.frames)]
        pixels = sum(frame.width * frame.height for frame in frames)
        if pixels > limits.max_video_pixels:
            raise InvalidRequestError(f"{param} has {pixels} pixels in its {len(frames)} frames; the limit is "
                                      f"max_video_pixels = {limits.max_video_pixels}", param=param,
                                      code="video_too_large")
        return VideoFrames(frames, video.fps)

    def _encode_video(self, video: VideoFrames, param: str) -> EncodedVideo:
        frames = list(video.frames)
        sizes = {frame.size for frame in frames}
        if len(sizes) > 1:
            raise InvalidRequestError(f"{param}: the frames of a video must be of one size, got "
                                      f"{sorted(sizes)}", param=param, code="invalid_video")
        processed = self.image_processor(images=frames, return_tensors="pt")
        _, height, width = (int(v) for v in processed["image_grid_thw"][0].tolist())
        patches = frame_pairs(processed["pixel_values"], len(frames), self.temporal_patch, self.patch)
        groups = -(-len(frames) // self.temporal_patch)
        fps = video.fps or DEFAULT_VIDEO_FPS
        return EncodedVideo(patches, (groups, height, width), self.temporal_patch / fps,
                            video_hash([image_hash(frame) for frame in frames], fps))

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


def load_image_processor(model_dir: str) -> Any:
    """transformers' image processor of ``model_dir``, with a ``size`` of its own.

    Some transformers releases (5.17 among them) write the ``min_pixels``/``max_pixels`` of a checkpoint that names no
    ``size`` into the processor class's shared default ``size`` dict: every later processor of that class in the
    process, of any model, then scaled images to the first one's limits. A fresh ``size`` dict, built from the
    checkpoint's own limits, keeps them to it."""
    from transformers import AutoImageProcessor

    settings_file = Path(model_dir) / "preprocessor_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    overrides: dict[str, Any] = {}
    if settings.get("size") is None and ("min_pixels" in settings or "max_pixels" in settings):
        overrides["size"] = {"shortest_edge": settings.get("min_pixels") or QWEN2_VL_MIN_PIXELS,
                             "longest_edge": settings.get("max_pixels") or QWEN2_VL_MAX_PIXELS}
    return AutoImageProcessor.from_pretrained(model_dir, **overrides)


def _is_image(data: Any) -> bool:
    from PIL import Image

    return isinstance(data, Image.Image)


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
