"""Request bodies of the HTTP API (OpenAI-compatible and native), as pydantic models.

The sampling fields are not written here: they are derived from the fields of
:class:`treadle.core.request.SamplingParams` (the native ``sampling_params`` is
exactly them; the OpenAI bodies take them all except the two OpenAI names
otherwise, ``max_tokens`` and ``response_format``), so a new sampling field is
added once, in the core. These models check the shape of a body; ranges and
limits are checked by :mod:`treadle.core.validation`, for every entry point.

Validation failures become OpenAI-shaped 400 errors in ``server/app.py``.
Unknown fields are ignored, as OpenAI's own API does for fields it does not use.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, create_model, field_validator

from treadle.core.request_io import SamplingParams

# SamplingParams fields the OpenAI bodies name otherwise: max_tokens (or max_completion_tokens), response_format.
OPENAI_RENAMED_FIELDS = ("max_new_tokens", "json_schema")


def sampling_fields(exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """pydantic field definitions of SamplingParams's fields less ``exclude``: the type a body may send (the field's
    ``accepts`` metadata, else its type; booleans strict), its default and its ``doc``."""
    hints = get_type_hints(SamplingParams)
    definitions: dict[str, Any] = {}
    for field in dataclasses.fields(SamplingParams):
        if field.name in exclude:
            continue
        wire_type = field.metadata.get("accepts", hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        definitions[field.name] = (StrictBool if wire_type is bool else wire_type,
                                   Field(default, description=field.metadata.get("doc")))
    return definitions


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: the schema sits under ``schema`` (an alias; pydantic owns that name)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


_OpenAISamplingParams = create_model("OpenAISamplingParams", __base__=_Body, __module__=__name__,
                                     **sampling_fields(exclude=OPENAI_RENAMED_FIELDS))


class _SamplingFields(_OpenAISamplingParams):
    """Fields both OpenAI routes share: OpenAI's own (and treadle's ``priority``, ``rid``, ``timeout``) beside the
    SamplingParams fields (OpenAI's ``temperature``, ``top_p``, ..., and treadle's extras ``top_k``, ``min_p``,
    ``regex``...)."""

    # The field a route's limit errors on top_logprobs_num name (the body's log-probs count).
    top_logprobs_field: ClassVar[str]

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = Field(1, ge=1, le=128)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    rid: str | None = None
    # Constrained decoding: at most one of response_format (json_object / json_schema), regex, ebnf.
    response_format: ResponseFormat | None = None
    timeout: float | None = Field(None, gt=0, description="deadline in seconds (default server.request_timeout)")

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``: None when the client left the budget to the server."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, default_max_tokens: int, **overrides: Any) -> SamplingParams:
        """This body's SamplingParams: the shared fields as sent, the requested max tokens (else
        ``default_max_tokens``) as ``max_new_tokens``, then ``overrides`` (a constraint, ...)."""
        values = self.model_dump(include=set(_OpenAISamplingParams.model_fields))
        requested = self.requested_max_tokens
        values["max_new_tokens"] = default_max_tokens if requested is None else requested
        return SamplingParams(**{**values, **overrides})

    def field_names(self, prompt_field: str) -> dict[str, str]:
        """How this body names the core's fields, for the errors of core.validation (``prompt_field``: where the
        prompt came from)."""
        return {"prompt": prompt_field, "input_ids": prompt_field, "top_logprobs_num": self.top_logprobs_field,
                "max_new_tokens": "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"}


class TextContentPart(_Body):
    type: Literal["text"]
    text: str


class ImageUrl(_Body):
    url: str
    detail: str | None = None


class ImageUrlContentPart(_Body):
    """An image in a chat message (a vision-language model): a data: URL, an http(s) URL or a file:// path."""

    type: Literal["image_url"]
    image_url: ImageUrl


class VideoUrl(_Body):
    url: str


class VideoUrlContentPart(_Body):
    """A video in a chat message: one URL (data:, http(s) or file://) of an animated GIF, WebP or PNG."""

    type: Literal["video_url"]
    video_url: VideoUrl


class VideoFramesContentPart(_Body):
    """A video in a chat message as its frames, each an image URL (data:, http(s) or file://), taken at 2 frames
    per second (Qwen2.5-VL's tooling's ``{"type": "video", "video": [...]}``)."""

    type: Literal["video"]
    video: list[str] = Field(min_length=1)


MEDIA_PART_TYPES = ("text", "image_url", "video_url", "video")


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"


class MessageToolCall(_Body):
    """A call the assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart | ImageUrlContentPart | VideoUrlContentPart | VideoFramesContentPart] | None \
        = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Without this, an unknown part fails every member of the union and the 400 lists all their complaints.
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind not in MEDIA_PART_TYPES:
                raise ValueError(f"content parts of type {kind!r} are not supported: this server takes text, "
                                 "image_url, video_url and video parts")
        return content

    def text(self, image_placeholder: str = "", video_placeholder: str = "") -> str:
        """The message's text, each image part written as ``image_placeholder``, each video as
        ``video_placeholder``."""
        if isinstance(self.content, list):
            return "".join(part.text if isinstance(part, TextContentPart) else
                           image_placeholder if isinstance(part, ImageUrlContentPart) else video_placeholder
                           for part in self.content)
        return self.content or ""

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImageUrlContentPart)]

    def videos(self) -> list[str | list[str]]:
        """Each video part: its URL, or its frames' URLs."""
        if not isinstance(self.content, list):
            return []
        return [part.video_url.url if isinstance(part, VideoUrlContentPart) else list(part.video)
                for part in self.content if isinstance(part, (VideoUrlContentPart, VideoFramesContentPart))]


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    top_logprobs_field = "top_logprobs"

    messages: list[ChatMessage]
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt`` may be text, a list of texts, token ids or a list of those."""

    top_logprobs_field = "logprobs"

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class _ClosedBody(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt sampling parameter is an error, not a silent default


NativeSamplingParams = create_model(
    "NativeSamplingParams", __base__=_ClosedBody, __module__=__name__, __doc__="``sampling_params`` of POST "
    "/generate: the fields of core.request.SamplingParams, by the same names.", **sampling_fields())


class GenerateRequest(_Body):
    """POST /generate (native API): ``text`` or ``input_ids``, one prompt or a batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    return_logprob: StrictBool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = Field(0, ge=0, le=20)
    stream: StrictBool = False
    rid: str | list[str] | None = None
    priority: int = 0
    timeout: float | None = Field(None, gt=0, description="deadline in seconds (default server.request_timeout)")
    lora_path: str | list[str | None] | None = Field(
        None, description="the LoRA adapter's name (one for every prompt, or one per prompt; null: the base model)")
    image_data: str | list[str | list[str] | None] | None = Field(
        None, description="a vision-language model's images (data: URLs, http(s) URLs, file:// paths): for one "
                          "prompt an image or a list; for a batch one entry (an image, a list or null) per prompt")
    video_data: str | list[str | list[str] | list[str | list[str]] | None] | None = Field(
        None, description="a vision-language model's videos, each a URL (an animated GIF, WebP or PNG) or a list of "
                          "frame URLs: for one prompt a video URL or a list of videos; for a batch one entry (a "
                          "video URL, a list of videos or null) per prompt")


class EmbeddingRequest(_Body):
    """POST /v1/embeddings (OpenAI's shape): ``input`` is a string, a list of strings, token ids or lists of them."""

    model: str | None = None
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    rid: str | None = None
    priority: int = 0
    timeout: float | None = Field(None, gt=0, description="deadline in seconds (default server.request_timeout)")


class ScoreRequest(_Body):
    """POST /v1/score (vLLM's shape): ``text_1`` scored against each of ``text_2`` (one text_1), or pairwise."""

    model: str | None = None
    text_1: StrictStr | list[StrictStr] = Field(min_length=1)
    text_2: StrictStr | list[StrictStr] = Field(min_length=1)
    rid: str | None = None
    priority: int = 0
    timeout: float | None = Field(None, gt=0, description="deadline in seconds (default server.request_timeout)")


class RerankRequest(_Body):
    """POST /v1/rerank (Jina's and Cohere's shape): ``documents`` ordered by their score against ``query``."""

    model: str | None = None
    query: StrictStr
    documents: list[StrictStr] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    rid: str | None = None
    priority: int = 0
    timeout: float | None = Field(None, gt=0, description="deadline in seconds (default server.request_timeout)")


class AbortRequest(_Body):
    """POST /abort_request."""

    rid: str


class LoadLoraAdapterRequest(_Body):
    """POST /load_lora_adapter: serve the PEFT adapter folder ``lora_path`` as ``lora_name``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Body):
    """POST /unload_lora_adapter: stop serving ``lora_name`` (once its requests have finished)."""

    lora_name: str = Field(min_length=1)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
