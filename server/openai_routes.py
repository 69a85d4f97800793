"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

``n`` choices are separate scheduler requests sharing the prompt (the prefix
cache makes the copies cheap); choice ``j`` of prompt ``i`` has index ``i * n + j``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from treadle.core.request import SamplingParams
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
from treadle.server.streaming import collect, first_event, sse_response
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
    last: StrOutput | None = None
    started: bool = False
    reader: ChoiceReader | None = None

    def add(self, out: StrOutput) -> None:
        self.text += out.text_delta
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_output_logprobs
        self.top_logprobs += out.new_output_top_logprobs
        self.last = out


class _Run:
    """The sub-requests of one OpenAI request and the usage they add up to."""

    def __init__(self, manager: TokenizerManager, body: _SamplingFields, prompts: list[list[int]],
                 params: list[SamplingParams], want_logprobs: int | None) -> None:
        self.manager = manager
        self.body = body
        self.prompts = prompts
        self.id_prefix = body.rid or uuid.uuid4().hex
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
                top_logprobs_num=want_logprobs or 0, priority=body.priority))
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

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(manager)]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        _check_model(manager, model_id)
        return JSONResponse(_model_card(manager))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(manager, body.model)
        if not body.messages:
            raise RequestError("`messages` must contain at least one message", param="messages")
        plan = plan_chat(body, parsers)
        knows_tools = bool(plan.tools) and manager.template_knows_tools()
        prompt_text = manager.render_chat(template_messages(body.messages, plan, knows_tools),
                                          plan.tools if knows_tools else None)
        prompt = manager.encode_rendered(prompt_text)
        params = _sampling_params(manager, body, len(prompt), default_max_tokens=None)
        params = _chat_params(params, plan)
        manager.check_request(prompt, params, "messages")
        top = (body.top_logprobs or 0) if body.logprobs else None
        run = _Run(manager, body, [prompt], [params], top)
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
                "logprobs": _chat_logprobs(manager, c.token_ids, c.logprobs, c.top_logprobs) if body.logprobs else None,
                "finish_reason": _chat_finish(c, bool(message.get("tool_calls"))),
                "matched_stop": finish_detail(c.last, run.stop) if c.last else None,
            })
        return JSONResponse({
            "id": f"chatcmpl-{run.id_prefix}", "object": "chat.completion", "created": run.created,
            "model": manager.served_model_name, "choices": choices, "usage": run.usage(),
        })

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(manager, body.model)
        if body.suffix:
            raise RequestError("`suffix` is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            # Choosing the best of several server-side is not implemented: say so rather than return n choices.
            raise RequestError(f"`best_of` is not supported (only best_of == n, got {body.best_of} with n = {body.n})",
                               param="best_of")
        prompts = _completion_prompts(manager, body.prompt)
        params = [_sampling_params(manager, body, len(p), _COMPLETIONS_DEFAULT_MAX_TOKENS) for p in prompts]
        constraint = constraint_fields(body)
        if constraint:
            _check_constraint_support(constraint)
            params = [dataclasses.replace(p, **constraint) for p in params]
        for p, sp in zip(prompts, params):
            manager.check_request(p, sp, "prompt")
        run = _Run(manager, body, prompts, params, body.logprobs)
        echo = [manager.tokenizer.decode(p) if body.echo and manager.tokenizer is not None else "" for p in prompts]
        if body.stream:
            return await _stream_completion(run, echo)
        await collect(request, run.stream, run.add)
        return JSONResponse({
            "id": f"cmpl-{run.id_prefix}", "object": "text_completion", "created": run.created,
            "model": manager.served_model_name,
            "choices": [{
                "index": i,
                "text": echo[c.prompt_index] + c.text,
                "logprobs": _completion_logprobs(manager, c.token_ids, c.logprobs, c.top_logprobs)
                if body.logprobs is not None else None,
                "finish_reason": c.last.finished_reason if c.last else None,
                "matched_stop": finish_detail(c.last, run.stop) if c.last else None,
            } for i, c in enumerate(run.choices)],
            "usage": run.usage(),
        })


async def _stream_chat(run: _Run) -> Response:
    first = await first_event(run.stream)
    body = run.body
    assert isinstance(body, ChatCompletionRequest)
    base = {"id": f"chatcmpl-{run.id_prefix}", "object": "chat.completion.chunk", "created": run.created,
            "model": run.manager.served_model_name}

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
            logprobs = _chat_logprobs(run.manager, out.new_token_ids, out.new_output_logprobs,
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
            "model": run.manager.served_model_name}

    def render(event: StreamEvent) -> list[dict[str, Any]]:
        choice = run.add(event)
        out = event.output
        assert out is not None
        text = out.text_delta
        if not choice.started:
            choice.started = True
            text = echo[choice.prompt_index] + text
        if not text and out.finished_reason is None:
            return []
        logprobs = _completion_logprobs(run.manager, out.new_token_ids, out.new_output_logprobs,
                                        out.new_output_top_logprobs) if body.logprobs is not None else None
        payload = {**base, "choices": [{"index": event.index, "text": text, "logprobs": logprobs,
                                        "finish_reason": out.finished_reason}]}
        if run.include_usage():
            payload["usage"] = None
        return [payload]

    def closing() -> list[dict[str, Any]]:
        return [{**base, "choices": [], "usage": run.usage()}] if run.include_usage() else []

    return sse_response(run.stream, first, render, closing)


def _chat_finish(choice: _Choice, made_calls: bool) -> str | None:
    """OpenAI says ``tool_calls`` when the model stopped after making calls."""
    reason = choice.last.finished_reason if choice.last else None
    return "tool_calls" if made_calls and reason == "stop" else reason


def _chat_params(params: SamplingParams, plan: ChatPlan) -> SamplingParams:
    """Add the plan's grammar constraint; keep special tokens when the call format is made of them."""
    changes: dict[str, object] = dict(plan.constraint)
    _check_constraint_support(changes)
    if plan.call_format is not None and plan.call_format.needs_special_tokens:
        changes["skip_special_tokens"] = False
    return dataclasses.replace(params, **changes) if changes else params


def _check_constraint_support(constraint: dict[str, object]) -> None:
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    for key in constraint:
        if key not in known:
            raise RequestError(f"this treadle build has no constrained decoding ({key}); it needs a grammar backend",
                               param=key)


def _check_model(manager: TokenizerManager, model: str | None) -> None:
    accepted = {manager.served_model_name, str(manager.model_info.get("model_path"))}
    if model is not None and model not in accepted:
        raise RequestError(f"the model '{model}' does not exist; this server serves '{manager.served_model_name}'",
                           param="model", status_code=404, code="model_not_found")


def _model_card(manager: TokenizerManager) -> dict[str, Any]:
    return {"id": manager.served_model_name, "object": "model", "created": 0, "owned_by": "treadle",
            "root": manager.model_info.get("model_path"), "max_model_len": manager.context_len}


def _sampling_params(manager: TokenizerManager, body: _SamplingFields, prompt_len: int,
                     default_max_tokens: int | None) -> SamplingParams:
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if manager.context_len and prompt_len >= manager.context_len:
        param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise RequestError(
            f"the prompt is too long: it has {prompt_len} tokens and this model's context length is "
            f"{manager.context_len} tokens (prompt + output must fit); shorten the prompt", param=param,
            code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = default_max_tokens if default_max_tokens is not None else max(manager.context_len - prompt_len, 0)
    elif manager.context_len and prompt_len + max_tokens > manager.context_len:
        # As OpenAI does: an explicit budget that cannot fit is an error, not silently shortened.
        raise RequestError(
            f"this model's context length is {manager.context_len} tokens, but the prompt has {prompt_len} and "
            f"max_tokens asks for {max_tokens} more; lower max_tokens to at most {manager.context_len - prompt_len}",
            param="max_tokens", code="context_length_exceeded")
    return SamplingParams(
        max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        min_p=body.min_p, repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty, stop=body.stop, stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos, seed=body.seed, skip_special_tokens=body.skip_special_tokens,
        logit_bias=body.logit_bias,
    )


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


def _token_text(manager: TokenizerManager, token_id: int) -> str:
    return manager.decode_token(token_id)


def _chat_logprobs(manager: TokenizerManager, ids: list[int], logprobs: list[float],
                   tops: list[list[tuple[int, float]]]) -> dict[str, Any]:
    content = []
    for pos, (tid, lp) in enumerate(zip(ids, logprobs)):
        text = _token_text(manager, tid)
        top = tops[pos] if pos < len(tops) else []
        content.append({
            "token": text, "logprob": lp, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := _token_text(manager, i)), "logprob": v, "bytes": list(t.encode())}
                             for i, v in top],
        })
    return {"content": content}


def _completion_logprobs(manager: TokenizerManager, ids: list[int], logprobs: list[float],
                         tops: list[list[tuple[int, float]]]) -> dict[str, Any]:
    tokens = [_token_text(manager, tid) for tid in ids]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs[: len(ids)]),
        "top_logprobs": [{_token_text(manager, i): v for i, v in top} for top in tops[: len(ids)]],
        "text_offset": offsets,
    }
