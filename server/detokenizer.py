"""The detokenizer process: scheduler token ids in, text deltas out.

It keeps one :class:`~treadle.text.incremental_decode.IncrementalDecoder` per
running request (created on ``RegisterDecode``, dropped when the request
finishes), so the HTTP processes never spend time decoding, and sends each
request's text to the HTTP worker that owns it (``RegisterDecode.worker_id``).
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

import zmq

from treadle.core.loading.gc_freeze import freeze_startup_objects
from treadle.text.incremental_decode import IncrementalDecoder, stopped_by_token
from treadle.core.request_io import ReqOutput
from treadle.server.ipc import (
    BatchStrOut,
    BatchTokenIDOut,
    DetokenizerInit,
    IpcAddresses,
    RegisterDecode,
    StrOutput,
    WorkerSockets,
    bind_pull,
)
from treadle.server.front_profile import start_profile
from treadle.server.process_utils import before_exit_on_sigterm, configure_child_process

logger = logging.getLogger("treadle.detokenizer")

_IDLE_POLL_MS = 500


def run_detokenizer_process(addresses: IpcAddresses, log_level: str, shard: int = 0) -> None:
    """Process entry point of detokenizer ``shard``: decode until the parent goes away or SIGTERM arrives."""
    parent_pid = configure_child_process(log_level)
    write_profile = start_profile(f"detokenizer-{shard}")
    if write_profile is not None:  # the server stops its detokenizers with SIGTERM
        before_exit_on_sigterm(write_profile)
    context = zmq.Context()
    inbox = bind_pull(context, addresses.detokenizer_inputs[shard])
    outboxes = WorkerSockets(context, addresses.worker_inputs)
    detokenizer = Detokenizer()
    try:
        while True:
            if not inbox.poll(_IDLE_POLL_MS):
                if os.getppid() != parent_pid:
                    logger.error("the server process is gone; the detokenizer exits")
                    return
                continue
            message = inbox.recv_pyobj()
            for worker_id, reply in detokenizer.handle_routed(message).items():
                outboxes.send(worker_id, reply)
            if isinstance(message, DetokenizerInit):
                freeze_startup_objects()  # the tokenizer and transformers: keep full collections off them
    except Exception:
        logger.error("the detokenizer crashed:\n%s", traceback.format_exc())
        raise SystemExit(1)
    finally:
        context.destroy(linger=0)


class Detokenizer:
    """Turns BatchTokenIDOut into BatchStrOut, one incremental decoder per request."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.decoders: dict[str, IncrementalDecoder] = {}
        self.stop_strings: dict[str, list[str]] = {}
        self.worker_of: dict[str, int] = {}  # rid -> the HTTP worker its text goes to

    def handle(self, message: Any) -> BatchStrOut | None:
        """The text of a BatchTokenIDOut (every request's, whichever worker owns it); None for other messages."""
        if isinstance(message, BatchTokenIDOut):
            return BatchStrOut([self._convert(output) for output in message.outputs])
        self._note(message)
        return None

    def handle_routed(self, message: Any) -> dict[int, BatchStrOut]:
        """Like :meth:`handle`, with the text split by the HTTP worker that owns each request."""
        if not isinstance(message, BatchTokenIDOut):
            self._note(message)
            return {}
        by_worker: dict[int, list[StrOutput]] = {}
        for output in message.outputs:
            worker_id = self.worker_of.get(output.rid, 0)
            by_worker.setdefault(worker_id, []).append(self._convert(output))
        return {worker_id: BatchStrOut(outputs) for worker_id, outputs in by_worker.items()}

    def _note(self, message: Any) -> None:
        if isinstance(message, RegisterDecode):
            if self.tokenizer is not None:
                self.decoders[message.rid] = IncrementalDecoder(
                    self.tokenizer, message.skip_special_tokens, message.stop)
            self.stop_strings[message.rid] = message.stop
            self.worker_of[message.rid] = message.worker_id
        elif isinstance(message, DetokenizerInit):
            self.tokenizer = message.tokenizer
        else:
            logger.warning("ignoring unexpected message %r", type(message).__name__)

    def _convert(self, output: ReqOutput) -> StrOutput:
        decoder = self.decoders.get(output.rid)
        text = ""
        if decoder is not None:
            ids = list(output.new_token_ids)
            if ids and stopped_by_token(output.finished_reason, output.finished_detail,
                                        self.stop_strings.get(output.rid)):
                ids = ids[:-1]
            text = decoder.feed(ids)
            if output.finished_reason is not None:
                text += decoder.finish()
        if output.finished_reason is not None:
            self.decoders.pop(output.rid, None)
            self.stop_strings.pop(output.rid, None)
            self.worker_of.pop(output.rid, None)
        return StrOutput(**{**vars(output), "text_delta": text})
