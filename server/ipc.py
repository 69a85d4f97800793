"""Messages between the server's processes, and the ZMQ sockets that carry them.

Traffic flows one way around a ring (see docs/server.md)::

    TokenizerManager ──► Scheduler ──► Detokenizer ──► TokenizerManager
           ▲                 │
           └── control replies (errors, flush/stats answers)

With ``server.workers > 1`` there are several TokenizerManagers (one per HTTP
worker process), each with its own inbox. A request carries its worker's id
(``worker_id``), and everything about it goes back to that worker's inbox:
the detokenizer's text (it learns the id from ``RegisterDecode``), the
scheduler's errors and control answers (:class:`WorkerSockets`). With
``server.detokenizers > 1`` the scheduler splits its outputs over the
detokenizers by the worker each request came from (:class:`DetokenizerSockets`).

Every socket is PUSH/PULL over ``ipc://`` files in a private temporary folder;
the receiving side binds, so start order does not matter. Messages are
dataclasses pickled with ``send_pyobj``; a step's outputs travel as one message
by field (:mod:`treadle.server.output_columns`), not one object per request.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Sequence

import zmq

from treadle.core.request_io import ReqOutput, SamplingParams
from treadle.server.output_columns import OutputColumns

# model_info's key for the scheduler's live config ("auto" settings resolved); /get_server_info shows it.
RESOLVED_CONFIG_KEY = "resolved_config"

# ---------------------------------------------------------------- TokenizerManager → Scheduler


@dataclass
class TokenizedGenerateReq:
    """A tokenized generation request, ready for ``Scheduler.add_request``."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    priority: int = 0
    lora_name: str | None = None  # the LoRA adapter (None: the base model)
    wants_embedding: bool = False  # /v1/embeddings: pool the prompt into a vector, sample nothing
    multimodal: Any = None  # the prompt's images (core.multimodal.inputs.MultimodalInputs), None for text
    worker_id: int = 0  # the HTTP worker that sent it: its outputs go back there


@dataclass
class AbortReq:
    """Abort a request (client gone, ``/abort_request``); frees its KV slots."""

    rid: str


@dataclass
class ControlReq:
    """A request the scheduler answers with a :class:`ControlReply` carrying the same ``request_id``.

    ``kind`` is ``"flush_cache"``, ``"stats"``, ``"abort_request"`` (``args["rid"]``: that request and its
    ``<rid>-<i>`` siblings, on whichever worker they run), ``"lora_adapters"``, ``"load_lora_adapter"`` (``args``:
    ``lora_name``, ``lora_path``) or ``"unload_lora_adapter"`` (``args``: ``lora_name``; answered once the adapter's
    requests have finished). The reply goes to worker ``worker_id``.
    """

    request_id: str
    kind: str
    worker_id: int = 0
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class ShutdownReq:
    """Ask the scheduler process to leave its loop and exit."""


# ---------------------------------------------------------------- Scheduler → TokenizerManager


@dataclass
class ControlReply:
    """The answer to a :class:`ControlReq`."""

    request_id: str
    payload: dict[str, Any]


@dataclass
class QueueTimes:
    """Seconds that requests admitted in the last step waited in the queue (for /metrics)."""

    seconds: list[float]
    worker_id: int = 0


@dataclass
class AddRequestFailed:
    """``Scheduler.add_request`` refused a request; the HTTP handler turns this into an error response."""

    rid: str
    message: str
    param: str | None = None
    status_code: int = 400
    worker_id: int = 0


@dataclass
class ReplicaFinished:
    """A data-parallel replica's requests that finished (or were aborted) this step; only sent to the
    data-parallel controller, which keeps per-replica load counts from them."""

    rids: list[str]


# ---------------------------------------------------------------- Scheduler → Detokenizer


@dataclass
class DetokenizerInit:
    """First message to the detokenizer: the tokenizer to decode with (None for a model without one)."""

    tokenizer: Any


@dataclass
class RegisterDecode:
    """Sent when a request is admitted, before any of its outputs: how to turn its tokens into text."""

    rid: str
    skip_special_tokens: bool
    stop: list[str]
    worker_id: int = 0


class _OutputBatch:
    """Outputs of one step, held and pickled by field (:class:`~treadle.server.output_columns.OutputColumns`)."""

    def __init__(self, outputs: Sequence[ReqOutput] = (), columns: OutputColumns | None = None) -> None:
        self.columns = columns if columns is not None else OutputColumns.of(outputs)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self.columns == other.columns  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.outputs!r})"  # type: ignore[attr-defined]


class BatchTokenIDOut(_OutputBatch):
    """What one scheduler step produced (new token ids, finish reasons, log-probs); ``outputs`` rebuilds the
    ReqOutputs."""

    @property
    def outputs(self) -> list[ReqOutput]:
        return self.columns.rows()


# ---------------------------------------------------------------- Detokenizer → TokenizerManager


@dataclass
class StrOutput(ReqOutput):
    """One request's new text (plus everything the scheduler reported) from one scheduler step."""

    text_delta: str = ""


class BatchStrOut(_OutputBatch):
    """A batch of :class:`StrOutput`, one per request that advanced, held and pickled by field (the columns'
    ``text_deltas`` set); ``outputs`` rebuilds the StrOutputs."""

    def __init__(self, outputs: Sequence[StrOutput] = (), columns: OutputColumns | None = None) -> None:
        if columns is None:
            columns = OutputColumns.of(outputs, [out.text_delta for out in outputs])
        super().__init__(outputs, columns)
        if self.columns.text_deltas is None:
            self.columns.text_deltas = [""] * len(self.columns)

    @property
    def outputs(self) -> list[StrOutput]:  # type: ignore[override]
        return self.columns.rows(StrOutput)


# ---------------------------------------------------------------- addresses and sockets


@dataclass(frozen=True)
class IpcAddresses:
    """The ZMQ endpoint each process binds to receive on.

    ``tokenizer_input`` is HTTP worker 0's inbox (for a data-parallel replica: its controller's), and
    ``extra_worker_inputs`` those of workers 1, 2, ...; ``detokenizer_input`` is detokenizer 0's and
    ``extra_detokenizer_inputs`` those of detokenizers 1, 2, ... (``server.detokenizers``).
    """

    scheduler_input: str
    detokenizer_input: str
    tokenizer_input: str
    folder: str
    extra_worker_inputs: tuple[str, ...] = ()
    extra_detokenizer_inputs: tuple[str, ...] = ()

    @classmethod
    def new(cls, http_workers: int = 1, detokenizers: int = 1) -> "IpcAddresses":
        folder = tempfile.mkdtemp(prefix="treadle-ipc-")
        return cls(
            scheduler_input=f"ipc://{os.path.join(folder, 'scheduler')}",
            detokenizer_input=f"ipc://{os.path.join(folder, 'detokenizer')}",
            tokenizer_input=f"ipc://{os.path.join(folder, 'tokenizer')}",
            folder=folder,
            extra_worker_inputs=tuple(f"ipc://{os.path.join(folder, f'tokenizer-w{worker}')}"
                                      for worker in range(1, http_workers)),
            extra_detokenizer_inputs=tuple(f"ipc://{os.path.join(folder, f'detokenizer-{shard}')}"
                                           for shard in range(1, detokenizers)),
        )

    @property
    def worker_inputs(self) -> tuple[str, ...]:
        """Every HTTP worker's inbox, indexed by worker id."""
        return (self.tokenizer_input, *self.extra_worker_inputs)

    @property
    def detokenizer_inputs(self) -> tuple[str, ...]:
        """Every detokenizer's inbox, indexed by shard."""
        return (self.detokenizer_input, *self.extra_detokenizer_inputs)


class DetokenizerSockets:
    """PUSH sockets to the detokenizers: HTTP worker ``w``'s requests are decoded by detokenizer ``w % shards``.

    With one detokenizer every message goes there as it is; with several, each step's outputs are split by the
    shard of each request's worker (known from its ``RegisterDecode`` until its final output).
    """

    def __init__(self, context: zmq.Context, addresses: Sequence[str]) -> None:
        self.sockets = [connect_push(context, address) for address in addresses]
        self.worker_of: dict[str, int] = {}  # rid -> HTTP worker, with several shards only

    def send_to_all(self, message: Any) -> None:
        for sock in self.sockets:
            sock.send_pyobj(message)

    def register(self, message: RegisterDecode) -> None:
        shards = len(self.sockets)
        if shards > 1:
            self.worker_of[message.rid] = message.worker_id
        self.sockets[message.worker_id % shards].send_pyobj(message)

    def send_outputs(self, outputs: list[ReqOutput]) -> None:
        shards = len(self.sockets)
        if shards == 1:
            self.sockets[0].send_pyobj(BatchTokenIDOut(outputs))  # one message a step, by field
            return
        by_shard: dict[int, list[ReqOutput]] = {}
        for output in outputs:
            worker_id = self.worker_of.get(output.rid, 0)
            if output.finished_reason is not None:
                self.worker_of.pop(output.rid, None)
            by_shard.setdefault(worker_id % shards, []).append(output)
        for shard, shard_outputs in by_shard.items():
            self.sockets[shard].send_pyobj(BatchTokenIDOut(shard_outputs))


class WorkerSockets:
    """PUSH sockets to every HTTP worker's inbox: a message goes to the worker its request came from."""

    def __init__(self, context: zmq.Context, addresses: Sequence[str]) -> None:
        self.sockets = [connect_push(context, address) for address in addresses]

    def send(self, worker_id: int, message: Any) -> None:
        # One inbox (one worker, or a data-parallel replica's controller, which routes on) takes everything.
        sock = self.sockets[worker_id] if len(self.sockets) > 1 else self.sockets[0]
        sock.send_pyobj(message)


def bind_pull(context: zmq.Context, address: str) -> zmq.Socket:
    """A PULL socket bound to ``address`` (the receiving end of one direction)."""
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


def connect_push(context: zmq.Context, address: str) -> zmq.Socket:
    """A PUSH socket connected to ``address`` (the sending end of one direction)."""
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def finish_detail(out: StrOutput, stop: list[str]) -> str | int | None:
    """The matched stop string, or the stop token id as an int."""
    detail = out.finished_detail
    if isinstance(detail, str) and detail not in stop and detail.lstrip("-").isdigit():
        return int(detail)
    return detail
