"""Videos in a request as the vision encoder takes them: frames (a list of images, or the frames of an animated
GIF/WebP/PNG), resized and normalized by the model's image processor, laid out as frame pairs.

No video container (mp4, webm) is decoded: treadle depends on no video library. A caller that has one decodes and
samples the frames itself and sends them as a list of images.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from treadle.core.validation import InvalidRequestError

# Frames per second of a video given as a list of frames (what Qwen2.5-VL's own tooling samples at).
DEFAULT_VIDEO_FPS = 2.0


@dataclass
class VideoFrames:
    """A video as its frames (each anything an image may be: bytes, a ``data:`` URL, a path, a PIL image) and the
    rate they were taken at (None: :data:`DEFAULT_VIDEO_FPS`)."""

    frames: Sequence[Any]
    fps: float | None = None


@dataclass
class EncodedVideo:
    """One video's patches (frame pairs, as the encoder takes them), grid and timing."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    seconds_per_grid: float
    content_hash: str


def animated_frames(data: Any, raw: bytes | None, max_frames: int, param: str) -> VideoFrames:
    """An animated image (``raw``: its bytes, or ``data`` a PIL image) cut into its frames, at the rate its frame
    durations give; a 400 when it is no image or has more than ``max_frames`` frames."""
    from PIL import Image, ImageSequence

    try:
        image = data if isinstance(data, Image.Image) else Image.open(io.BytesIO(raw or b""))
        count = getattr(image, "n_frames", 1)
        if count > max_frames:
            raise InvalidRequestError(f"{param} has {count} frames; the limit is max_video_frames = {max_frames}",
                                      param=param, code="video_too_large")
        frames, durations = [], []
        for frame in ImageSequence.Iterator(image):
            frames.append(frame.convert("RGB"))
            durations.append(frame.info.get("duration") or 0)
    except InvalidRequestError:
        raise
    except Exception as exc:  # PIL raises many kinds for a file it cannot read
        raise InvalidRequestError(
            f"{param} is not a video this server can decode ({type(exc).__name__}: {exc}); send its frames as a list "
            "of images, or an animated GIF, WebP or PNG (no video container decoder is installed)", param=param,
            code="invalid_video") from None
    mean_ms = sum(durations) / len(durations)
    return VideoFrames(frames, 1000.0 / mean_ms if mean_ms > 0 else None)


def frame_pairs(pixel_values: torch.Tensor, frames: int, temporal: int, patch: int) -> torch.Tensor:
    """Per-frame patches from the image processor (``[frames * patches, channels * temporal * patch * patch]``,
    each frame repeated ``temporal`` times) -> the video's patches, ``temporal`` consecutive frames in each (the
    last frame repeated to fill the last group)."""
    per_frame = pixel_values.view(frames, -1, pixel_values.shape[-1] // (temporal * patch * patch),
                                  temporal, patch, patch)[:, :, :, 0]
    if frames % temporal:
        per_frame = torch.cat([per_frame, per_frame[-1:].expand(temporal - frames % temporal, *per_frame.shape[1:])])
    groups = per_frame.shape[0] // temporal
    grouped = per_frame.view(groups, temporal, *per_frame.shape[1:]).permute(0, 2, 3, 1, 4, 5)
    return grouped.reshape(groups * per_frame.shape[1], -1)


def video_hash(frame_hashes: Sequence[str], fps: float) -> str:
    digest = hashlib.sha256(repr(("video", fps)).encode())
    for frame_hash in frame_hashes:
        digest.update(frame_hash.encode())
    return digest.hexdigest()
