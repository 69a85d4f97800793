"""Images named in HTTP requests: ``data:`` URLs, ``file://`` paths inside the configured folders, and http(s) URLs
fetched with a timeout and a size limit; then the model's image processor (core/multimodal/processor.py).

Every failure is an ``InvalidRequestError`` (a 400) naming the request field and what was wrong (an unreachable URL, a path outside
``multimodal.local_media_folders``, a corrupt image, a broken limit).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Sequence

import httpx

from treadle.core.config import MultimodalConfig
from treadle.core.multimodal.inputs import MultimodalInputs
from treadle.core.multimodal.processor import ImageLimits, MultimodalProcessor
from treadle.core.validation import InvalidRequestError as RequestError


class MediaLoader:
    """Loads a request's images and turns them into the scheduler's multimodal inputs (for one model)."""

    def __init__(self, config: MultimodalConfig, model_path: str | None) -> None:
        self.config = config
        self.model_path = model_path
        self.folders = [Path(folder).expanduser().resolve() for folder in config.local_media_folders]
        self._processor: MultimodalProcessor | None = None
        self._hf_config: Any = None

    @property
    def processor(self) -> MultimodalProcessor:
        if self._processor is None:
            from treadle.core.loading.model_loader import read_hf_config

            if self.model_path:
                self._hf_config = read_hf_config(self.model_path)
            processor = MultimodalProcessor.for_model(
                str(self.model_path), self._hf_config,
                ImageLimits(self.config.max_images_per_request, self.config.max_image_pixels)) if self._hf_config \
                else None
            if processor is None:
                raise RequestError("this model takes no images; send text only", param="messages")
            self._processor = processor
        return self._processor

    def image_placeholder(self, tokenizer: Any) -> str:
        """The text that marks one image in a rendered prompt (Qwen2.5-VL: ``<|vision_start|><|image_pad|>
        <|vision_end|>`` without the breaks)."""
        self.processor  # the model takes images, and its config is read
        config = self._hf_config
        ids = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
        return tokenizer.decode(ids, skip_special_tokens=False)

    async def prepare(self, input_ids: list[int], sources: Sequence[str], param: str
                      ) -> tuple[list[int], MultimodalInputs]:
        """``input_ids`` with its images' placeholders expanded, and the images (fetched, decoded, preprocessed)."""
        processor = self.processor
        limit = self.config.max_images_per_request
        if len(sources) > limit:
            raise RequestError(f"{len(sources)} images in one request; the limit is max_images_per_request = "
                               f"{limit}", param=param, code="too_many_images")
        data = await asyncio.gather(*(self.load(source, f"{param}[{i}]") for i, source in enumerate(sources)))
        return await asyncio.to_thread(processor.process, input_ids, data, param)

    async def load(self, source: str, param: str) -> bytes | str:
        """A ``data:`` URL as it is, a permitted local file's path, or an http(s) URL's bytes."""
        if source.startswith("data:"):
            return source
        if source.startswith("file://"):
            return str(self._permitted_path(source.removeprefix("file://"), param))
        if source.startswith(("http://", "https://")):
            return await self._fetch(source, param)
        raise RequestError(f"{param}: unsupported image URL '{source[:60]}'; use a data: URL, an http(s) URL or a "
                           "file:// path inside multimodal.local_media_folders", param=param)

    def _permitted_path(self, path: str, param: str) -> Path:
        resolved = Path(path).expanduser().resolve()
        if not any(resolved.is_relative_to(folder) for folder in self.folders):
            raise RequestError(f"{param}: file://{path} is outside the folders this server reads images from "
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
                            raise RequestError(f"{param}: the image at {url} is larger than "
                                               f"multimodal.fetch_max_bytes = {limit}", param=param,
                                               code="image_too_large")
                    return bytes(body)
        except httpx.TimeoutException:
            raise RequestError(f"{param}: fetching {url} took longer than multimodal.fetch_timeout = "
                               f"{self.config.fetch_timeout:g} s", param=param, code="image_fetch_failed") from None
        except httpx.HTTPError as exc:
            raise RequestError(f"{param}: could not fetch {url} ({type(exc).__name__}: {exc}); is the host "
                               "reachable from the server?", param=param, code="image_fetch_failed") from None
