"""Images and videos named in HTTP requests: ``data:`` URLs, ``file://`` paths inside the configured folders, and
http(s) URLs fetched with a timeout and a size limit; then the model's image processor (core/multimodal/processor.py).
A video is one URL (an animated image) or a list of frame URLs.

Every failure is an ``InvalidRequestError`` (a 400) naming the request field and what was wrong (an unreachable URL, a path outside
``multimodal.local_media_folders``, a corrupt image, a broken limit).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import httpx

from treadle.core.config import MultimodalConfig
from treadle.core.validation import InvalidRequestError as RequestError

if TYPE_CHECKING:
    from treadle.core.multimodal.inputs import MultimodalInputs
    from treadle.core.multimodal.processor import MultimodalProcessor
    from treadle.core.multimodal.video import VideoFrames


class MediaLoader:
    """Loads a request's images and videos and turns them into the scheduler's multimodal inputs (for one model)."""

    def __init__(self, config: MultimodalConfig, model_path: str | None) -> None:
        self.config = config
        self.model_path = model_path
        self.folders = [Path(folder).expanduser().resolve() for folder in config.local_media_folders]
        self._processor: MultimodalProcessor | None = None
        self._hf_config: Any = None

    @property
    def processor(self) -> MultimodalProcessor:
        if self._processor is None:
            # Here, not at the top: the processors import torch, which a text-only HTTP worker never loads.
            from treadle.core.loading.model_loader import read_hf_config
            from treadle.core.multimodal.processor import ImageLimits, MultimodalProcessor

            if self.model_path:
                self._hf_config = read_hf_config(self.model_path)
            processor = MultimodalProcessor.for_model(
                str(self.model_path), self._hf_config,
                ImageLimits.from_config(self.config)) if self._hf_config \
                else None
            if processor is None:
                raise RequestError("this model takes no images; send text only", param="messages")
            self._processor = processor
        return self._processor

    def image_placeholder(self, tokenizer: Any) -> str:
        """The text that marks one image in a rendered prompt (Qwen2.5-VL: ``<|vision_start|><|image_pad|>
        <|vision_end|>`` without the breaks)."""
        return self._placeholder(tokenizer, self._hf_config_of_vision_model().image_token_id)

    def video_placeholder(self, tokenizer: Any) -> str:
        """The text that marks one video (Qwen2.5-VL: ``<|vision_start|><|video_pad|><|vision_end|>``)."""
        config = self._hf_config_of_vision_model()
        if getattr(config, "video_token_id", None) is None:
            raise RequestError("this model takes no video (its config names no video_token_id)", param="messages")
        return self._placeholder(tokenizer, config.video_token_id)

    def _hf_config_of_vision_model(self) -> Any:
        self.processor  # the model takes images, and its config is read
        return self._hf_config

    def _placeholder(self, tokenizer: Any, token_id: int) -> str:
        config = self._hf_config
        return tokenizer.decode([config.vision_start_token_id, token_id, config.vision_end_token_id],
                                skip_special_tokens=False)

    async def prepare(self, input_ids: list[int], sources: Sequence[str], param: str,
                      videos: Sequence[str | Sequence[str]] = (), video_param: str = "video_data"
                      ) -> tuple[list[int], MultimodalInputs]:
        """``input_ids`` with its images' and videos' placeholders expanded, and the images and videos (fetched,
        decoded, preprocessed). A video is a URL (an animated image) or a list of frame URLs."""
        processor = self.processor
        processor.check_counts(len(sources), len(videos), param, video_param)  # before fetching anything
        data = await asyncio.gather(*(self.load(source, f"{param}[{i}]") for i, source in enumerate(sources)))
        video_data = [await self._load_video(video, f"{video_param}[{i}]") for i, video in enumerate(videos)]
        return await asyncio.to_thread(processor.process, input_ids, data, param, video_data, video_param)

    async def _load_video(self, source: str | Sequence[str], param: str) -> bytes | str | VideoFrames:
        from treadle.core.multimodal.video import VideoFrames

        if isinstance(source, str):
            return await self.load(source, param)
        limit = self.config.max_video_frames
        if len(source) > limit:
            raise RequestError(f"{param} has {len(source)} frames; the limit is max_video_frames = {limit}",
                               param=param, code="video_too_large")
        frames = await asyncio.gather(*(self.load(frame, f"{param}[{i}]") for i, frame in enumerate(source)))
        return VideoFrames(list(frames))

    async def load(self, source: str, param: str) -> bytes | str:
        """A ``data:`` URL as it is, a permitted local file's path, or an http(s) URL's bytes."""
        if source.startswith("data:"):
            return source
        if source.startswith("file://"):
            return str(self._permitted_path(source.removeprefix("file://"), param))
        if source.startswith(("http://", "https://")):
            return await self._fetch(source, param)
        raise RequestError(f"{param}: unsupported image or video URL '{source[:60]}'; use a data: URL, an http(s) URL "
                           "or a file:// path inside multimodal.local_media_folders", param=param)

    def _permitted_path(self, path: str, param: str) -> Path:
        resolved = Path(path).expanduser().resolve()
        if not any(resolved.is_relative_to(folder) for folder in self.folders):
            raise RequestError(f"{param}: file://{path} is outside the folders this server reads images and videos from "
                               "(multimodal.local_media_folders)", param=param, code="media_path_not_allowed")
        return resolved

    async def _fetch(self, url: str, param: str) -> bytes:
        limit = self.config.fetch_max_bytes
        try:
            async with httpx.AsyncClient(timeout=self.config.fetch_timeout, follow_redirects=True) as client:
                async with client.stream("GET", url) as response:
                    if response.status_code >= 400:
                        raise RequestError(f"{param}: fetching {url} answered HTTP {response.status_code}",
                                           param=param, code="image_fetch_failed")
                    body = bytearray()
                    async for chunk in response.aiter_bytes():
                        body.extend(chunk)
                        if len(body) > limit:
                            raise RequestError(f"{param}: the file at {url} is larger than "
                                               f"multimodal.fetch_max_bytes = {limit}", param=param,
                                               code="image_too_large")
                    return bytes(body)
        except httpx.TimeoutException:
            raise RequestError(f"{param}: fetching {url} took longer than multimodal.fetch_timeout = "
                               f"{self.config.fetch_timeout:g} s", param=param, code="image_fetch_failed") from None
        except httpx.HTTPError as exc:
            raise RequestError(f"{param}: could not fetch {url} ({type(exc).__name__}: {exc}); is the host "
                               "reachable from the server?", param=param, code="image_fetch_failed") from None
