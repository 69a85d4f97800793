"""Messages between the server's processes, and the ZMQ sockets that carry them.

Traffic flows one way around a ring (see docs/server.md)::

    TokenizerManager ──► Scheduler ──► Detokenizer ──► TokenizerManager
           ▲                 │
           └── control replies (errors, flush/stats answers)

With ``server.workers > 1`` there are several TokenizerManagers (one per HTTP
worker process), each with its own inbox. A request carries its worker's id
(``worker_id``), and everything about it goes back to that worker's inbox:
the detokenizer's text (it learns the id from ``RegisterDecode``), the
scheduler's errors and control answers (:class:`WorkerSockets`).

Every socket is PUSH/PULL over ``ipc://`` files in a private temporary folder;
the receiving side binds, so start order does not matter. Messages are
dataclasses pickled with ``send_pyobj``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Sequence

import zmq

from treadle.core.request import ReqOutput, SamplingParams

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
    worker_id: int = 0  # the HTTP worker that sent it: its outputs go back there


@dataclass
class AbortReq:
    """Abort a request (client gone, ``/abort_request``); frees its KV slots."""

    rid: str


@dataclass
class ControlReq:
    """A request the scheduler answers with a :class:`ControlReply` carrying the same ``request_id``.

    ``kind`` is ``"flush_cache"``, ``"stats"`` or ``"abort_request"`` (``args["rid"]``: that request and its
    ``<rid>-<i>`` siblings, on whichever worker they run). The reply goes to worker ``worker_id``.
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


@dataclass
class BatchTokenIDOut:
    """What one scheduler step produced (new token ids, finish reasons, log-probs)."""

    outputs: list[ReqOutput]


# ---------------------------------------------------------------- Detokenizer → TokenizerManager


@dataclass
class StrOutput(ReqOutput):
    """One request's new text (plus everything the scheduler reported) from one scheduler step."""

    text_delta: str = ""


@dataclass
class BatchStrOut:
    """A batch of :class:`StrOutput`, one per request that advanced."""

    outputs: list[StrOutput]


# ---------------------------------------------------------------- addresses and sockets


@dataclass(frozen=True)
class IpcAddresses:
    """The ZMQ endpoint each process binds to receive on.

    ``tokenizer_input`` is HTTP worker 0's inbox (for a data-parallel replica: its controller's), and
    ``extra_worker_inputs`` those of workers 1, 2, ...
    """

    scheduler_input: str
    detokenizer_input: str
    tokenizer_input: str
    folder: str
    extra_worker_inputs: tuple[str, ...] = ()

    @classmethod
    def new(cls, http_workers: int = 1) -> "IpcAddresses":
        folder = tempfile.mkdtemp(prefix="treadle-ipc-")
        return cls(
            scheduler_input=f"ipc://{os.path.join(folder, 'scheduler')}",
            detokenizer_input=f"ipc://{os.path.join(folder, 'detokenizer')}",
            tokenizer_input=f"ipc://{os.path.join(folder, 'tokenizer')}",
            folder=folder,
            extra_worker_inputs=tuple(f"ipc://{os.path.join(folder, f'tokenizer-w{worker}')}"
                                      for worker in range(1, http_workers)),
        )

    @property
    def worker_inputs(self) -> tuple[str, ...]:
        """Every HTTP worker's inbox, indexed by worker id."""
        return (self.tokenizer_input, *self.extra_worker_inputs)


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
