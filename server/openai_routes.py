"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

``n`` choices are separate scheduler requests sharing the prompt (the prefix
cache makes the copies cheap); choice ``j`` of prompt ``i`` has index ``i * n + j``.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from treadle.core.request_io import SamplingParams
from treadle.server.chat_tools import (
    ChatParsers,
    ChatPlan,
    ChoiceReader,
    chat_message,
    constraint_fields,
    plan_chat,
    template_messages,
)
from treadle.server.ipc import StrOutput, TokenizedGenerateReq, finish_detail
from treadle.server.lora_routes import adapter_cards, model_adapter
from treadle.server.openai_logprobs import TopLogprobs, chat_logprobs, completion_logprobs
from treadle.server.streaming import collect, first_event, json_string, sse_response
from treadle.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from treadle.server.tokenizer_manager import GenerationStream, RequestError, StreamEvent, TokenizerManager

_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class _Choice:
    """One choice's accumulated text, tokens and log-probs."""

    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)  # the prompt's, when asked (echo)
    input_top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    last: StrOutput | None = None
    started: bool = False
    reader: ChoiceReader | None = None
    text_offset: int = 0  # a streamed completion's log-probs: where the next chunk's tokens start

    def add(self, out: StrOutput) -> None:
        self.text += out.text_delta
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_output_logprobs
        self.top_logprobs += out.new_output_top_logprobs
        if out.input_token_logprobs is not None:
            self.input_logprobs = list(out.input_token_logprobs)
            self.input_top_logprobs = list(out.input_top_logprobs or [])
        self.last = out


class _Run:
    """The sub-requests of one OpenAI request and the usage they add up to."""

    def __init__(self, manager: TokenizerManager, body: _SamplingFields, prompts: list[list[int]],
                 params: list[SamplingParams], want_logprobs: int | None, echo_logprobs: bool = False,
                 multimodal: list[Any] | None = None) -> None:
        self.manager = manager
        self.body = body
        self.prompts = prompts
        self.id_prefix = body.rid or uuid.uuid4().hex
        self.lora_name = model_adapter(manager, body.model)
        self.model = body.model if self.lora_name is not None else manager.served_model_name
        self.created = int(time.time())
        self.choices = [_Choice(i) for i in range(len(prompts)) for _ in range(body.n)]
        self.stop = list(params[0].stop or [])
        reqs = []
        for index, choice in enumerate(self.choices):
            p = params[choice.prompt_index]
            if body.n > 1 and p.seed is not None:
                # The same seed would make every choice identical.
                p = SamplingParams(**{**p.__dict__, "seed": p.seed + index % body.n})
            rid = self.id_prefix if len(self.choices) == 1 else f"{self.id_prefix}-{index}"
            reqs.append(TokenizedGenerateReq(
                rid, prompts[choice.prompt_index], p, return_logprob=want_logprobs is not None,
                logprob_start_len=0 if echo_logprobs else -1, top_logprobs_num=want_logprobs or 0,
                priority=body.priority, lora_name=self.lora_name,

                multimodal=multimodal[choice.prompt_index] if multimodal else None))
        self.stream: GenerationStream = manager.submit(reqs, timeout=body.timeout)

    def add(self, event: StreamEvent) -> _Choice:
        choice = self.choices[event.index]
        choice.add(event.output)  # type: ignore[arg-type]
        return choice

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(c.last.completion_tokens for c in self.choices if c.last is not None)
        cached = sum(c.last.cached_tokens for c in self.choices[:: self.body.n] if c.last is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def include_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)


def add_openai_routes(app: FastAPI, manager: TokenizerManager) -> None:
    parsers = ChatParsers(manager.config, manager.model_info.get("architecture"))
    _add_model_routes(app, manager)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model_adapter(manager, body.model)
        if not body.messages:
            raise RequestError("`messages` must contain at least one message", param="messages")
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        plan = plan_chat(body, parsers)
        prompt_text, prompt, multimodal = await _chat_prompt(manager, body, plan)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = _chat_params(manager, body, prompt, plan, top or 0)
        run = _Run(manager, body, [prompt], [params], top, multimodal=[multimodal])
        if body.stream:
            for choice in run.choices:
                choice.reader = ChoiceReader(plan, prompt_text)
            return await _stream_chat(run)
        await collect(request, run.stream, run.add)
        choices = []
        for i, c in enumerate(run.choices):
            message = chat_message(plan, prompt_text, c.text)
            choices.append({
                "index": i,
                "message": message,
                "logprobs": chat_logprobs(manager.decode_token, c.token_ids, c.logprobs, c.top_logprobs)
                if body.logprobs else None,
                "finish_reason": _chat_finish(c, bool(message.get("tool_calls"))),
                "matched_stop": finish_detail(c.last, run.stop) if c.last else None,
            })
        return JSONResponse({
            "id": f"chatcmpl-{run.id_prefix}", "object": "chat.completion", "created": run.created,
            "model": run.model, "choices": choices, "usage": run.usage(),
        })

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model_adapter(manager, body.model)
        if body.suffix:
            raise RequestError("`suffix` is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            # Choosing the best of several server-side is not implemented: say so rather than return n choices.
            raise RequestError(f"`best_of` is not supported (only best_of == n, got {body.best_of} with n = {body.n})",
                               param="best_of")
        prompts = _completion_prompts(manager, body.prompt)
        constraint = constraint_fields(body)
        params = [_completion_params(manager, body, p, constraint) for p in prompts]
        run = _Run(manager, body, prompts, params, body.logprobs, echo_logprobs=body.echo and body.logprobs is not None)
        echo = [manager.tokenizer.decode(p) if body.echo and manager.tokenizer is not None else "" for p in prompts]
        if body.stream:
            return await _stream_completion(run, echo)
        await collect(request, run.stream, run.add)
        return JSONResponse({
            "id": f"cmpl-{run.id_prefix}", "object": "text_completion", "created": run.created,
            "model": run.model,
            "choices": [{
                "index": i,
                "text": echo[c.prompt_index] + c.text,
                "logprobs": _choice_logprobs(run, c, c.token_ids, c.logprobs, c.top_logprobs, echoed=body.echo)
                if body.logprobs is not None else None,
                "finish_reason": c.last.finished_reason if c.last else None,
                "matched_stop": finish_detail(c.last, run.stop) if c.last else None,
            } for i, c in enumerate(run.choices)],
            "usage": run.usage(),
        })


def _add_model_routes(app: FastAPI, manager: TokenizerManager) -> None:
    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(manager), *await adapter_cards(manager)]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        if model_adapter(manager, model_id) is None:
            return JSONResponse(_model_card(manager))
        card = next((card for card in await adapter_cards(manager) if card["id"] == model_id), None)
        if card is None:
            raise RequestError(f"the model '{model_id}' does not exist (no such LoRA adapter is loaded)",
                               param="model", status_code=404, code="model_not_found")
        return JSONResponse(card)


async def _chat_prompt(manager: TokenizerManager, body: ChatCompletionRequest, plan: ChatPlan
                       ) -> tuple[str, list[int], Any]:
    """The rendered conversation, its token ids (each image's and video's placeholder expanded) and its images and
    videos (None: text)."""
    knows_tools = bool(plan.tools) and manager.template_knows_tools()
    images = [url for message in body.messages for url in message.image_urls()]
    videos = [video for message in body.messages for video in message.videos()]
    media = manager.media
    image_mark = media.image_placeholder(manager.require_tokenizer()) if images else ""
    video_mark = media.video_placeholder(manager.require_tokenizer()) if videos else ""
    prompt_text = manager.render_chat(template_messages(body.messages, plan, knows_tools, image_mark, video_mark),
                                      plan.tools if knows_tools else None)
    prompt = manager.encode_rendered(prompt_text)
    if not images and not videos:
        return prompt_text, prompt, None
    prompt, multimodal = await media.prepare(prompt, images, "messages", videos, "messages")
    return prompt_text, prompt, multimodal


async def _stream_chat(run: _Run) -> Response:
    first = await first_event(run.stream)
    body = run.body
    assert isinstance(body, ChatCompletionRequest)
    base = {"id": f"chatcmpl-{run.id_prefix}", "object": "chat.completion.chunk", "created": run.created,
            "model": run.model}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        payload = {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": finish}]}
        if run.include_usage():
            payload["usage"] = None
        return payload

    def render(event: StreamEvent) -> list[dict[str, Any]]:
        choice = run.add(event)
        out = event.output
        assert out is not None
        chunks = []
        reader = choice.reader
        assert reader is not None
        if not choice.started:
            choice.started = True
            chunks.append(chunk(event.index, {"role": "assistant", "content": ""}))
        delta = reader.feed(out.text_delta)
        if out.finished_reason is not None:
            for key, value in reader.finish().items():
                delta[key] = delta.get(key, [] if key == "tool_calls" else "") + value
        if body.logprobs and out.new_token_ids and not delta:
            delta = {"content": ""}
        if delta:
            logprobs = chat_logprobs(run.manager.decode_token, out.new_token_ids, out.new_output_logprobs,
                                     out.new_output_top_logprobs) if body.logprobs else None
            chunks.append(chunk(event.index, delta, logprobs=logprobs))
        if out.finished_reason is not None:
            chunks.append(chunk(event.index, {}, _chat_finish(choice, reader.calls_made > 0)))
        return chunks

    def closing() -> list[dict[str, Any]]:
        return [{**base, "choices": [], "usage": run.usage()}] if run.include_usage() else []

    return sse_response(run.stream, first, render, closing)


async def _stream_completion(run: _Run, echo: list[str]) -> Response:
    first = await first_event(run.stream)
    body = run.body
    assert isinstance(body, CompletionRequest)
    base = {"id": f"cmpl-{run.id_prefix}", "object": "text_completion", "created": run.created,
            "model": run.model}
    plain_chunk = CompletionChunkText(base, run.include_usage())

    def render(event: StreamEvent) -> list[dict[str, Any]] | list[str]:
        choice = run.add(event)
        out = event.output
        assert out is not None
        text, first = out.text_delta, not choice.started
        if first:
            choice.started = True
            text = echo[choice.prompt_index] + text
        new_logprobs = body.logprobs is not None and bool(out.new_token_ids or (first and choice.input_logprobs))
        if not text and out.finished_reason is None and not new_logprobs:  # a token whose text is held back
            return []
        if body.logprobs is None:
            return [plain_chunk(event.index, text, out.finished_reason)]
        logprobs = _choice_logprobs(run, choice, out.new_token_ids, out.new_output_logprobs,
                                    out.new_output_top_logprobs, echoed=first and body.echo)
        payload = {**base, "choices": [{"index": event.index, "text": text, "logprobs": logprobs,
                                        "finish_reason": out.finished_reason}]}
        if run.include_usage():
            payload["usage"] = None
        return [payload]

    def closing() -> list[dict[str, Any]]:
        return [{**base, "choices": [], "usage": run.usage()}] if run.include_usage() else []

    return sse_response(run.stream, first, render, closing)


class CompletionChunkText:
    """A streamed completion chunk without log-probs, as ``json.dumps`` writes its dict, written from the parts
    that never change (the HTTP process writes one per streamed token of every stream)."""

    def __init__(self, base: dict[str, Any], include_usage: bool) -> None:
        self.head = json.dumps(base, ensure_ascii=False)[:-1] + ', "choices": [{"index": '
        self.tail = ', "usage": null}' if include_usage else "}"

    def __call__(self, index: int, text: str, finish_reason: str | None) -> str:
        reason = "null" if finish_reason is None else json.dumps(finish_reason, ensure_ascii=False)
        return (f'{self.head}{index}, "text": {json_string(text)}, "logprobs": null, "finish_reason": {reason}}}]'
                f'{self.tail}')


def _chat_finish(choice: _Choice, made_calls: bool) -> str | None:
    """OpenAI says ``tool_calls`` when the model stopped after making calls."""
    reason = choice.last.finished_reason if choice.last else None
    return "tool_calls" if made_calls and reason == "stop" else reason


def _chat_params(manager: TokenizerManager, body: ChatCompletionRequest, prompt: list[int], plan: ChatPlan,
                 top_logprobs: int) -> SamplingParams:
    """The chat body's SamplingParams, checked: ``max_tokens`` defaults to what the context has room for; the plan's
    grammar constraint; special tokens kept when the call format is made of them."""
    changes: dict[str, object] = dict(plan.constraint)
    _check_constraint_support(changes)
    if plan.call_format is not None and plan.call_format.needs_special_tokens:
        changes["skip_special_tokens"] = False
    params = body.sampling_params(max(manager.context_len - len(prompt), 0), **changes)
    manager.check_request(prompt, params, body.field_names("messages"), top_logprobs,
                          output_must_fit=body.requested_max_tokens is not None)
    return params


def _completion_params(manager: TokenizerManager, body: CompletionRequest, prompt: list[int],
                       constraint: dict[str, str]) -> SamplingParams:
    """The completion body's SamplingParams for one prompt, checked: ``max_tokens`` defaults to OpenAI's 16."""
    _check_constraint_support(constraint)
    params = body.sampling_params(_COMPLETIONS_DEFAULT_MAX_TOKENS, **constraint)
    manager.check_request(prompt, params, body.field_names("prompt"), body.logprobs or 0,
                          output_must_fit=body.requested_max_tokens is not None)
    return params


def _check_constraint_support(constraint: dict[str, object]) -> None:
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    for key in constraint:
        if key not in known:
            raise RequestError(f"this treadle build has no constrained decoding ({key}); it needs a grammar backend",
                               param=key)


def _model_card(manager: TokenizerManager) -> dict[str, Any]:
    return {"id": manager.served_model_name, "object": "model", "created": 0, "owned_by": "treadle",
            "root": manager.model_info.get("model_path"), "max_model_len": manager.context_len}


def _completion_prompts(manager: TokenizerManager, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [manager.tokenize(prompt)]
    if not prompt:
        raise RequestError("`prompt` is empty", param="prompt")
    if isinstance(prompt[0], str):
        return [manager.tokenize(p) for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _choice_logprobs(run: _Run, choice: _Choice, ids: list[int], logprobs: list[float],
                     tops: list[list[tuple[int, float]]], echoed: bool) -> dict[str, Any]:
    """A completion choice's log-probs for these new tokens (after its echoed prompt's, if ``echoed``)."""
    all_ids: Sequence[int] = ids
    all_logprobs: list[float | None] = list(logprobs)
    all_tops: list[TopLogprobs | None] = _padded(tops, len(ids))
    if echoed:
        prompt = run.prompts[choice.prompt_index]
        all_ids = prompt + ids
        all_logprobs = _padded(choice.input_logprobs, len(prompt)) + all_logprobs
        all_tops = _padded(choice.input_top_logprobs, len(prompt)) + all_tops
    payload, choice.text_offset = completion_logprobs(run.manager.decode_token, all_ids, all_logprobs, all_tops,
                                                      choice.text_offset)
    return payload


def _padded(values: list[Any], length: int) -> list[Any]:
    """``values`` cut or padded with None to ``length`` entries (one per token)."""
    return list(values[:length]) + [None] * (length - len(values))
