"""TokenizerManager: the main process's side of the request flow (asyncio).

It tokenizes prompts, sends them to the scheduler process, and routes what
the detokenizer sends back to the HTTP handler waiting for each request.
Requests that share a handler (the ``n`` choices of one OpenAI request, or a
batch of prompts) share one :class:`GenerationStream`.

With several HTTP workers (``server.workers``) each worker process has its own
manager, with its ``worker_id``: it stamps that id on what it sends, receives on
its own inbox, and admits requests against every worker's count
(:mod:`treadle.server.inflight`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import zmq
import zmq.asyncio

from treadle.core.config import ServerConfig
from treadle.core import validation
from treadle.core.request_io import FinishReason, SamplingParams
from treadle.server.ipc import (
    AbortReq,
    AddRequestFailed,
    BatchStrOut,
    ControlReply,
    ControlReq,
    IpcAddresses,
    QueueTimes,
    StrOutput,
    TokenizedGenerateReq,
    bind_pull,
    connect_push,
)
from treadle.server.media import MediaLoader
from treadle.server.inflight import InflightCounts, PublishedStates
from treadle.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# A prompt text longer than context_len * this many characters has its head tokenized first:
# if the head alone overflows the context, the rest is never tokenized.
_PROBE_CHARS_PER_TOKEN = 8
# server.max_queued_requests defaults to about as many requests as the KV pool holds at this size each.
TYPICAL_REQUEST_TOKENS = 256


def inflight_limit(config: ServerConfig, model_info: dict[str, Any]) -> int:
    """How many requests may be running or queued at once (see ``server.max_queued_requests``)."""
    replicas = int(model_info.get("dp_size") or 1)  # model_info describes one data-parallel replica
    configured = config.scheduler.max_running_requests
    running = int(model_info.get("max_running_requests") or (configured if configured != "auto" else 64)) * replicas
    queued = config.server.max_queued_requests
    if queued is None:
        queued = max(running, int(model_info.get("max_total_tokens") or 0) * replicas // TYPICAL_REQUEST_TOKENS)
    return running + queued


class RequestError(Exception):
    """An error to return to the client as an OpenAI-shaped body with ``status_code``."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.type = type_
        self.code = code
        self.headers = headers


@dataclass
class StreamEvent:
    """One step of one sub-request: new text/tokens (``output``) or a failure (``error``)."""

    index: int
    output: StrOutput | None = None
    error: RequestError | None = None


@dataclass
class _ReqState:
    stream: "GenerationStream"
    index: int
    prompt_tokens: int
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None


class EventQueue:
    """``asyncio.Queue``'s ``put_nowait``/``get``/``get_nowait``/``empty`` for one reader (a stream's handler),
    without its bookkeeping for many getters and a size limit: a few microseconds less per streamed event."""

    def __init__(self) -> None:
        self._items: deque[StreamEvent] = deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, event: StreamEvent) -> None:
        self._items.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> StreamEvent:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> StreamEvent:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


class GenerationStream:
    """Events of one or more sub-requests submitted together, in arrival order."""

    def __init__(self, manager: "TokenizerManager", rids: list[str]) -> None:
        self.manager = manager
        self.rids = rids
        self.queue = EventQueue()
        self.unfinished = set(range(len(rids)))
        self.produced_tokens = False
        self.deadline: asyncio.TimerHandle | None = None

    @property
    def finished(self) -> bool:
        return not self.unfinished

    async def next_event(self) -> StreamEvent:
        return self._note(await self.queue.get())

    def ready_events(self) -> list[StreamEvent]:
        """Every event already queued, without waiting (a streaming response behind its outputs catches up)."""
        events = []
        while not self.queue.empty():
            events.append(self._note(self.queue.get_nowait()))
        return events

    def _note(self, event: StreamEvent) -> StreamEvent:
        if event.error is not None or (event.output is not None and event.output.finished_reason is not None):
            self.unfinished.discard(event.index)
            if not self.unfinished and self.deadline is not None:
                self.deadline.cancel()
        return event

    def abort(self) -> None:
        """Abort every sub-request still running (client gone, or a sibling failed)."""
        for index in list(self.unfinished):
            self.manager.abort(self.rids[index])
        self.unfinished.clear()
        if self.deadline is not None:
            self.deadline.cancel()


class TokenizerManager:
    """Tokenizes, submits to the scheduler, and routes outputs back to waiting handlers.

    ``worker_id`` is this HTTP worker's index (0 with one worker); ``inflight`` the counts shared with the
    other workers (None with one worker).
    """

    def __init__(self, config: ServerConfig, model_info: dict[str, Any], tokenizer: Any,
                 addresses: IpcAddresses, metrics: ServerMetrics, worker_id: int = 0,
                 inflight: InflightCounts | None = None) -> None:
        self.config = config
        self.model_info = model_info
        self.tokenizer = tokenizer
        self.addresses = addresses
        self.metrics = metrics
        self.context_len = int(model_info.get("context_len") or 0)
        self.request_limits = validation.RequestLimits.from_model_info(model_info)
        self.served_model_name = str(
            config.model.served_model_name or model_info.get("served_model_name") or model_info.get("model_path")
            or "default"
        )
        self.worker_id = worker_id
        self.inflight = inflight
        self.states: dict[str, _ReqState] = {} if inflight is None else PublishedStates(inflight)
        self._control_waiters: dict[str, asyncio.Future] = {}
        self._sync_context = zmq.Context()
        self._async_context = zmq.asyncio.Context()
        self._to_scheduler = connect_push(self._sync_context, addresses.scheduler_input)
        self._from_workers = bind_pull(self._async_context, addresses.worker_inputs[worker_id])
        self._recv_task: asyncio.Task | None = None
        self.dead_reason: str | None = None
        self._template_knows_tools: bool | None = None
        self.draining = False  # set on SIGTERM: new requests get 503 while running ones finish
        self.max_inflight_requests = inflight_limit(config, model_info)
        self._timed_out: set[str] = set()
        self.media = MediaLoader(config.multimodal, model_info.get("model_path"))  # images in requests

    # ------------------------------------------------------------ lifecycle

    def start(self, on_fatal: Callable[[str], None] | None = None) -> None:
        """Start routing outputs; ``on_fatal(reason)`` is called if the routing task itself dies."""
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())
        if on_fatal is not None:
            self._recv_task.add_done_callback(lambda task: self._recv_task_done(task, on_fatal))

    def _recv_task_done(self, task: asyncio.Task, on_fatal: Callable[[str], None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        reason = f"the tokenizer manager stopped routing outputs ({type(exc).__name__}: {exc}); shutting down"
        logger.error(reason)
        self.fail_all(reason)
        on_fatal(reason)

    def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
        self._to_scheduler.close(linger=0)
        self._from_workers.close(linger=0)
        self._sync_context.term()
        self._async_context.term()
        if self.inflight is not None:
            self.inflight.publish(0)

    def fail_all(self, reason: str) -> None:
        """A worker process died: fail every waiting request so no handler hangs."""
        self.dead_reason = reason
        for rid, state in list(self.states.items()):
            state.stream.queue.put_nowait(StreamEvent(state.index, error=RequestError(
                reason, status_code=503, type_="server_error", code="service_unavailable")))
            self.states.pop(rid, None)
        for waiter in self._control_waiters.values():
            if not waiter.done():
                waiter.set_exception(RequestError(reason, status_code=503, type_="server_error"))

    # ------------------------------------------------------------ tokenization

    def require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer; send token ids (`input_ids` on /generate)")
        return self.tokenizer

    def tokenize(self, text: str, param: str = "prompt") -> list[int]:
        return self._encode(text, param)

    def _encode(self, text: str, param: str, **kwargs: Any) -> list[int]:
        """Tokenize, refusing a prompt longer than the context without tokenizing all of a huge text."""
        tokenizer = self.require_tokenizer()
        limit = self.context_len
        window = limit * _PROBE_CHARS_PER_TOKEN
        if limit and len(text) > window:
            head = len(tokenizer.encode(text[:window], **kwargs))
            # The cut can merge differently from the whole text by a token; beyond that, more is more.
            if head - 1 >= limit:
                raise RequestError(
                    f"the prompt is too long: its first {window} characters alone are {head} tokens and this "
                    f"model's context length is {limit} tokens; shorten the prompt", param=param,
                    code="context_length_exceeded")
        return list(tokenizer.encode(text, **kwargs))

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.encode_rendered(self.render_chat(messages, tools))

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of a conversation (``tools`` go to templates that take them)."""
        tokenizer = self.require_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("the model's tokenizer has no chat template; use /v1/completions", param="messages")
        try:
            return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                 tokenize=False)
        except Exception as exc:  # templates raise for conversations they do not support (e.g. role order)
            raise RequestError(f"the chat template rejected these messages: {exc}", param="messages") from None

    def encode_rendered(self, prompt: str) -> list[int]:
        # The template already contains BOS and friends; don't add them twice.
        return self._encode(prompt, "messages", add_special_tokens=False)

    def template_knows_tools(self) -> bool:
        """Whether the chat template renders a ``tools=`` argument (checked once with a probe tool)."""
        if self._template_knows_tools is None:
            probe = [{"type": "function", "function": {"name": "treadle_probe_tool", "parameters": {}}}]
            try:
                text = self.render_chat([{"role": "user", "content": "hi"}], probe)
            except RequestError:
                text = ""
            self._template_knows_tools = "treadle_probe_tool" in text
        return self._template_knows_tools

    def decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ------------------------------------------------------------ requests

    def new_rid(self) -> str:
        return uuid.uuid4().hex

    def check_request(self, input_ids: Sequence[int], params: SamplingParams, names: Mapping[str, str],
                      top_logprobs_num: int = 0, output_must_fit: bool = False) -> None:
        """Raise InvalidRequestError (a 400) for anything the scheduler would refuse, before it is queued: the
        checks of :func:`core.validation.check_request` against the limits the scheduler reported. ``names``
        maps the core's field names to the route's (``{"prompt": "messages", "max_new_tokens": "max_tokens"}``)."""
        validation.check_request(input_ids, params, self.request_limits, top_logprobs_num=top_logprobs_num,
                                 output_must_fit=output_must_fit, names=names)

    def submit(self, reqs: list[TokenizedGenerateReq], timeout: float | None = None) -> GenerationStream:
        """Send requests to the scheduler; their outputs arrive on the returned stream.

        ``timeout`` (default ``server.request_timeout``) is the deadline in seconds
        from now: see :meth:`_expire`. Refused with 503 when the server already
        holds ``max_inflight_requests`` (running + queued).
        """
        if self.dead_reason is not None:
            raise RequestError(self.dead_reason, status_code=503, type_="server_error")
        if self.draining:
            raise RequestError("the server is shutting down and accepts no new requests", status_code=503,
                               type_="server_error", code="server_shutting_down", headers={"Retry-After": "5"})
        self._admit(len(reqs))
        task = str(self.model_info.get("task") or "generate")
        for req in reqs:
            validation.check_task(req.wants_embedding, task)
            if req.rid in self.states:
                raise RequestError(f"a request with rid '{req.rid}' is already running", param="rid")
        if len({req.rid for req in reqs}) != len(reqs):
            raise RequestError("rids must be unique", param="rid")
        stream = GenerationStream(self, [req.rid for req in reqs])
        for index, req in enumerate(reqs):
            self.states[req.rid] = _ReqState(stream, index, len(req.input_ids))
            req.worker_id = self.worker_id
            self._to_scheduler.send_pyobj(req)
        self.metrics.requests_received.inc(len(reqs))
        timeout = timeout if timeout is not None else self.config.server.request_timeout
        if timeout is not None:
            stream.deadline = asyncio.get_running_loop().call_later(timeout, self._expire, stream, timeout)
        return stream

    def _admit(self, count: int) -> None:
        """Admission control: 400 for a request that can never fit, 503 + Retry-After when full now."""
        limit = self.max_inflight_requests
        if count > limit:
            self.metrics.requests_rejected.labels(reason="too_many_sequences").inc()
            raise RequestError(
                f"this request asks for {count} sequences (prompts x n) but the server holds at most {limit} "
                "requests at once (scheduler.max_running_requests + server.max_queued_requests); lower n or "
                "send fewer prompts per request", param="n", code="too_many_sequences")
        inflight = self.inflight_requests()
        if inflight + count > limit:
            self.metrics.requests_rejected.labels(reason="queue_full").inc()
            raise RequestError(
                f"the server is at capacity ({inflight} requests running or queued, limit {limit} = "
                "scheduler.max_running_requests + server.max_queued_requests); retry after a moment",
                status_code=503, type_="server_error", code="server_overloaded", headers={"Retry-After": "1"})

    def inflight_requests(self) -> int:
        """Requests running or queued in the whole server (every HTTP worker's)."""
        return len(self.states) if self.inflight is None else self.inflight.total()

    def _expire(self, stream: GenerationStream, timeout: float) -> None:
        """A stream reached its deadline: abort what still runs.

        Before any token: every sub-request fails with 408. After: each one
        ends with what it generated so far and ``finish_reason`` ``length``
        (detail ``timeout``). Either way the scheduler frees its KV.
        """
        running = [i for i in stream.unfinished if stream.rids[i] in self.states]
        if not running:
            return
        self.metrics.requests_timed_out.inc(len(running))
        if not stream.produced_tokens:
            for index in running:
                self.abort(stream.rids[index], count_abort=False)
                stream.queue.put_nowait(StreamEvent(index, error=RequestError(
                    f"the request produced no token within its timeout of {timeout:g} s (the server is busy); "
                    "retry later or raise `timeout`", param="timeout", status_code=408, code="request_timeout")))
            return
        for index in running:
            rid = stream.rids[index]
            self._timed_out.add(rid)
            self.abort(rid, keep_waiting=True, count_abort=False)

    def abort(self, rid: str, keep_waiting: bool = False, count_abort: bool = True) -> bool:
        """Abort ``rid`` in the scheduler, which frees its KV slots.

        By default its handler is forgotten at once (the client is gone); with
        ``keep_waiting`` the handler still receives the final 'abort' output.
        """
        state = self.states.get(rid) if keep_waiting else self.states.pop(rid, None)
        self._to_scheduler.send_pyobj(AbortReq(rid))
        if state is not None and count_abort:
            self.metrics.requests_aborted.inc()
        return state is not None

    async def control(self, kind: str, timeout: float = 10.0, args: dict[str, Any] | None = None) -> dict[str, Any]:
        """Ask the scheduler process (with data parallelism: every replica, once) something (``flush_cache``,
        ``stats``, ``abort_request``, the LoRA adapters: see ``ControlReq``) and wait for the answer, which comes back
        to this worker."""
        if self.dead_reason is not None:
            raise RequestError(self.dead_reason, status_code=503, type_="server_error")
        request_id = uuid.uuid4().hex
        waiter = asyncio.get_running_loop().create_future()
        self._control_waiters[request_id] = waiter
        try:
            self._to_scheduler.send_pyobj(ControlReq(request_id, kind, self.worker_id, dict(args or {})))
            return await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise RequestError(f"the scheduler did not answer '{kind}' within {timeout:.0f} s",
                               status_code=503, type_="server_error") from None
        finally:
            self._control_waiters.pop(request_id, None)

    # ------------------------------------------------------------ receiving

    async def _recv_loop(self) -> None:
        while True:
            message = await self._from_workers.recv_pyobj()
            try:
                self._dispatch(message)
            except Exception:  # one bad message must not stop every other request's outputs
                logger.exception("failed to route a message from the scheduler/detokenizer")

    def _dispatch(self, message: Any) -> None:
        if isinstance(message, BatchStrOut):
            now = time.perf_counter()
            for output in message.outputs:
                self._on_output(output, now)
        elif isinstance(message, AddRequestFailed):
            state = self.states.pop(message.rid, None)
            if state is not None:
                error = RequestError(message.message, param=message.param, status_code=message.status_code,
                                     type_="invalid_request_error" if message.status_code < 500 else "server_error")
                state.stream.queue.put_nowait(StreamEvent(state.index, error=error))
        elif isinstance(message, QueueTimes):
            for seconds in message.seconds:
                self.metrics.queue_time.observe(seconds)
        elif isinstance(message, ControlReply):
            waiter = self._control_waiters.get(message.request_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(message.payload)
        else:
            logger.warning("ignoring unexpected message %r", type(message).__name__)

    def _on_output(self, output: StrOutput, now: float) -> None:
        state = self.states.get(output.rid)
        if state is None:
            return  # aborted: the handler is gone
        tokens = len(output.new_token_ids)
        if output.finished_reason is not None and output.rid in self._timed_out:
            self._timed_out.discard(output.rid)
            if output.finished_reason == FinishReason.ABORT:  # not one that finished on its own meanwhile
                output.finished_reason, output.finished_detail = FinishReason.LENGTH, "timeout"
        if tokens:
            state.stream.produced_tokens = True
            if state.first_token_at is None:
                state.first_token_at = now
                self.metrics.time_to_first_token.observe(now - state.created)
            elif state.last_token_at is not None:
                self.metrics.inter_token_latency.observe((now - state.last_token_at) / tokens)
            state.last_token_at = now
        if output.new_verify_lengths:
            self.metrics.on_verified(output)
        if output.finished_reason is not None:
            self.states.pop(output.rid, None)
            self.metrics.on_finished(output, now - state.created)
        state.stream.queue.put_nowait(StreamEvent(state.index, output=output))
