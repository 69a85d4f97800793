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
from treadle.server.ipc import (
    BatchStrOut,
    BatchTokenIDOut,
    DetokenizerInit,
    IpcAddresses,
    RegisterDecode,
    WorkerSockets,
    bind_pull,
)
from treadle.server.front_profile import start_profile
from treadle.server.output_columns import OutputColumns
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
            columns = message.columns
            return BatchStrOut(columns=columns.select(range(len(columns)), self._texts(columns)))
        self._note(message)
        return None

    def handle_routed(self, message: Any) -> dict[int, BatchStrOut]:
        """Like :meth:`handle`, with the text split by the HTTP worker that owns each request."""
        if not isinstance(message, BatchTokenIDOut):
            self._note(message)
            return {}
        columns = message.columns
        worker_of = self.worker_of
        workers = [worker_of.get(rid, 0) for rid in columns.rids]
        texts = self._texts(columns)
        first = workers[0] if workers else 0
        if all(worker_id == first for worker_id in workers):  # one worker's requests (or one worker): as they came
            return {first: BatchStrOut(columns=columns.select(range(len(columns)), texts))} if workers else {}
        by_worker: dict[int, list[int]] = {}
        for i, worker_id in enumerate(workers):
            by_worker.setdefault(worker_id, []).append(i)
        return {worker_id: BatchStrOut(columns=columns.select(indices, [texts[i] for i in indices]))
                for worker_id, indices in by_worker.items()}

    def _texts(self, columns: OutputColumns) -> list[str]:
        """Each output's new text (empty without a tokenizer); forgets the requests that finished."""
        decoders = self.decoders
        texts = [""] * len(columns)
        if decoders:
            for i, (rid, ids) in enumerate(zip(columns.rids, columns.token_ids)):
                decoder = decoders.get(rid)
                if decoder is not None:
                    texts[i] = self._decode(decoder, rid, ids, columns.finished.get(i))
        for i in columns.finished:
            rid = columns.rids[i]
            decoders.pop(rid, None)
            self.stop_strings.pop(rid, None)
            self.worker_of.pop(rid, None)
        return texts

    def _decode(self, decoder: IncrementalDecoder, rid: str, ids: list[int],
                finished: tuple[str, str | None] | None) -> str:
        if finished is None:
            return decoder.feed(ids)
        if ids and stopped_by_token(finished[0], finished[1], self.stop_strings.get(rid)):
            ids = ids[:-1]
        return decoder.feed(ids) + decoder.finish()

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
