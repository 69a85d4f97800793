"""Request bodies of the HTTP API (OpenAI-compatible and native), as pydantic models.

Validation failures become OpenAI-shaped 400 errors in ``server/app.py``.
Unknown fields are ignored, as OpenAI's own API does for fields it does not use.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator


# ``logit_bias``: token id (a JSON object's keys are strings of digits) -> bias added to its logit.
LogitBiasMap = dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100, le=100)]]


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


class _SamplingFields(_Body):
    """Sampling fields shared by both OpenAI routes, plus treadle's extras."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=128)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: LogitBiasMap | None = None
    user: str | None = None
    # treadle / SGLang extras
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: StrictBool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: StrictBool = True
    priority: int = 0
    rid: str | None = None
    # Constrained decoding: at most one of response_format (json_object / json_schema), regex, ebnf.
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    timeout: float | None = Field(None, gt=0, description="deadline in seconds (default server.request_timeout)")


class TextContentPart(_Body):
    type: Literal["text"]
    text: str


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
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Without this, an image part fails every member of the union and the 400 lists their three complaints.
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: this server takes text only")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


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

    messages: list[ChatMessage]
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt`` may be text, a list of texts, token ids or a list of those."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class NativeSamplingParams(_Body):
    """``sampling_params`` of POST /generate (fields of core.request.SamplingParams)."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: StrictBool = False
    seed: int | None = None
    skip_special_tokens: StrictBool = True
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    logit_bias: LogitBiasMap | None = None


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


class AbortRequest(_Body):
    """POST /abort_request."""

    rid: str


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """The OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
