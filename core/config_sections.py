"""Config sections shared by every part of the tree (``Section``, the ``auto``-or-number checks) and the sections of
the features layered on the engine: LoRA adapters, speculative decoding, images in requests. ``core.config``
assembles them into ``ServerConfig`` and re-exports them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def positive_or_auto(value: int | str, key: str) -> int | str:
    if value != "auto" and value < 1:
        raise ValueError(f"{key} must be a positive integer or 'auto', got {value}")
    return value


def at_least_or_auto(value: int | str, least: int, key: str) -> int | str:
    if value != "auto" and value < least:
        raise ValueError(f"{key} must be {least} or more, or 'auto', got {value}")
    return value


class MultimodalConfig(Section):
    """Images and videos in requests to a vision-language model (docs/multimodal.md)."""

    max_images_per_request: int = Field(16, ge=0, description="more images in one request are a 400")
    max_image_pixels: int = Field(4096 * 4096, gt=0, description="an image (or a video frame) of more pixels (width x "
                                                                  "height) is a 400")
    max_videos_per_request: int = Field(2, ge=0, description="more videos in one request are a 400")
    max_video_frames: int = Field(64, gt=0, description="a video of more frames is a 400")
    max_video_pixels: int = Field(64 * 1024 * 768, gt=0, description="a video whose frames hold more pixels in all "
                                                                     "(width x height x frames) is a 400")
    local_media_folders: list[str] = Field(
        default_factory=list, description="folders whose files requests may name as file:// image or video URLs (the "
                                          "server refuses every other path; none: file:// is refused)")
    fetch_timeout: float = Field(10.0, gt=0, description="seconds to fetch an http(s) image or video URL")
    fetch_max_bytes: int = Field(20 * 1024 * 1024, gt=0, description="largest http(s) image or video the server fetches")


class LoraConfig(Section):
    paths: dict[str, str] = Field(default_factory=dict, description="adapter name -> PEFT LoRA folder "
                                  "(adapter_config.json + adapter_model.safetensors), loaded at start")
    max_loras_per_batch: int = Field(8, ge=1, description="adapters resident on the device at once (slots); "
                                     "a request whose adapter has no free slot waits")
    max_loaded_loras: int | None = Field(
        None, ge=1, description="adapters kept in host memory, the least recently used one not in use evicted "
                                "(read again from its folder when asked for); null: all of them")
    max_rank: int | Literal["auto"] = Field(
        "auto", description="largest adapter rank served (1-256; sizes the device slots); auto: the largest rank "
                            "among lora.paths, 16 when there are none")
    backend: str = Field("auto", description="lora_backends plugin; auto: triton on CUDA where registered, else torch")
    allowed_dirs: list[str] = Field(
        default_factory=list, description="folders under which /load_lora_adapter may load adapters at run time; "
                                          "empty: loading at run time is refused (lora.paths are always allowed)")

    @field_validator("max_rank")
    @classmethod
    def _rank_range(cls, value: int | str) -> int | str:
        if value != "auto" and not 1 <= value <= 256:
            raise ValueError(f"max_rank must be between 1 and 256, or 'auto', got {value}")
        return value

    @property
    def requested(self) -> bool:
        """Whether adapters are served at all (any ``lora`` key away from its default); otherwise nothing of LoRA
        is built. Judged by value, not by which keys were given: a config crosses processes as a dump."""
        return any(getattr(self, name) != info.get_default(call_default_factory=True)
                   for name, info in LoraConfig.model_fields.items())


# Speculators that read a second set of weights from speculative.draft_model_path.
DRAFT_MODEL_METHODS = ("draft", "eagle3", "eagle")
# Built-in speculators by the draft shapes they propose (speculative.topk > 1: trees; a plugin's own are not checked).
TREE_METHODS = ("draft", "eagle3", "ngram")
CHAIN_ONLY_METHODS = ("eagle",)


class SpeculativeConfig(Section):
    method: str | None = Field(
        None, description="speculators plugin that proposes draft tokens the model verifies in one step (ngram, "
                          "draft, eagle3, or a plugin's name); null: speculative decoding off")
    num_tokens: int = Field(4, ge=1, le=16, description="draft tokens per request and step (k): a decode step "
                                                        "verifies k + 1 positions and keeps 1 to k + 1 tokens")
    topk: int = Field(1, ge=1, description="draft tree width (draft, eagle3: the children a node of the draft tree "
                                            "may have; ngram: the most continuations branching in one tree); "
                                            "1: a chain of drafts")
    draft_model_path: str | None = Field(
        None, description="HF folder or .gguf file of the draft weights (draft: a small model of the same "
                          "tokenizer; eagle3: the EAGLE-3 heads' folder)")
    ngram_min: int = Field(1, ge=1, description="ngram: the shortest suffix of a request matched in its own "
                                                 "prompt and output")
    ngram_max: int = Field(4, ge=1, description="ngram: the longest suffix matched (longer matches win)")
    max_batch_size: int | Literal["auto"] = Field(
        "auto", description="decode steps of more running requests than this verify no drafts (one token each, "
                            "as without speculation: at large batches a verify step costs more than it "
                            "saves); auto: 32 on CUDA, 4 on the CPU")

    overlap: bool | Literal["auto"] = Field(
        "auto", description="overlapped verify: queue a verify step before the host reads the previous one's "
                            "results, every input that depends on them computed on the device (chains, a speculator "
                            "with propose_on_device, page size 1, an attention backend that reads a verify step's "
                            "lengths on the device: triton, flashinfer_triton, for steps of at most 20 tokens; "
                            "docs/speculative.md); auto: on where supported (eagle3 on CUDA: not yet); true: an "
                            "error at start-up where it is not")

    @field_validator("max_batch_size")
    @classmethod
    def _positive_batch(cls, value: int | str) -> int | str:
        return positive_or_auto(value, "max_batch_size")

    @model_validator(mode="after")
    def _combination(self) -> "SpeculativeConfig":
        if self.topk > 1 and self.method in CHAIN_ONLY_METHODS:
            raise ValueError(f"topk {self.topk}: method '{self.method}' proposes chains only; use topk 1 with it, "
                             f"or a method that drafts trees ({', '.join(TREE_METHODS)})")
        if self.topk > self.num_tokens:
            raise ValueError(f"topk {self.topk} must not exceed num_tokens {self.num_tokens} (a tree holds "
                             "num_tokens drafts, topk of them at the first level at most)")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min {self.ngram_min} must not exceed ngram_max {self.ngram_max}")
        if self.method in DRAFT_MODEL_METHODS and not self.draft_model_path:
            raise ValueError(f"method '{self.method}' needs draft_model_path (the draft weights' folder or "
                             ".gguf file)")
        return self
