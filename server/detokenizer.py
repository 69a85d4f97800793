"""The detokenizer process: scheduler token ids in, text deltas out.

It keeps one :class:`~treadle.core.incremental_decode.IncrementalDecoder` per
running request (created on ``RegisterDecode``, dropped when the request
finishes), so the main process never spends time decoding.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

import zmq

from treadle.core.gc_freeze import freeze_startup_objects
from treadle.core.incremental_decode import IncrementalDecoder
from treadle.core.request import FinishReason, ReqOutput
from treadle.server.ipc import (
    BatchStrOut,
    BatchTokenIDOut,
    DetokenizerInit,
    IpcAddresses,
    RegisterDecode,
    StrOutput,
    bind_pull,
    connect_push,
)
from treadle.server.process_utils import configure_child_process

logger = logging.getLogger("treadle.detokenizer")

_IDLE_POLL_MS = 500


def run_detokenizer_process(addresses: IpcAddresses, log_level: str) -> None:
    """Process entry point: decode until the parent goes away or SIGTERM arrives."""
    parent_pid = configure_child_process(log_level)
    context = zmq.Context()
    inbox = bind_pull(context, addresses.detokenizer_input)
    outbox = connect_push(context, addresses.tokenizer_input)
    detokenizer = Detokenizer()
    try:
        while True:
            if not inbox.poll(_IDLE_POLL_MS):
                if os.getppid() != parent_pid:
                    logger.error("the server process is gone; the detokenizer exits")
                    return
                continue
            message = inbox.recv_pyobj()
            reply = detokenizer.handle(message)
            if reply is not None:
                outbox.send_pyobj(reply)
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

    def handle(self, message: Any) -> BatchStrOut | None:
        if isinstance(message, BatchTokenIDOut):
            return BatchStrOut([self._convert(output) for output in message.outputs])
        if isinstance(message, RegisterDecode):
            if self.tokenizer is not None:
                self.decoders[message.rid] = IncrementalDecoder(
                    self.tokenizer, message.skip_special_tokens, message.stop)
            self.stop_strings[message.rid] = message.stop
        elif isinstance(message, DetokenizerInit):
            self.tokenizer = message.tokenizer
        else:
            logger.warning("ignoring unexpected message %r", type(message).__name__)
        return None

    def _convert(self, output: ReqOutput) -> StrOutput:
        decoder = self.decoders.get(output.rid)
        text = ""
        if decoder is not None:
            ids = list(output.new_token_ids)
            if ids and _stopped_by_token(output, self.stop_strings.get(output.rid, [])):
                ids = ids[:-1]  # like OpenAI, the stop token itself is not part of the text
            text = decoder.feed(ids)
            if output.finished_reason is not None:
                text += decoder.finish()
        if output.finished_reason is not None:
            self.decoders.pop(output.rid, None)
            self.stop_strings.pop(output.rid, None)
        return StrOutput(**{**vars(output), "text_delta": text})


def _stopped_by_token(output: ReqOutput, stop_strings: list[str]) -> bool:
    """Whether the request ended on a stop token (EOS or stop_token_ids) rather than a stop string.

    A stop token always records its id as the detail; a STOP without a detail (a grammar
    that completed on an ordinary token) keeps its last token.
    """
    if output.finished_reason != FinishReason.STOP:
        return False
    return output.finished_detail is not None and output.finished_detail not in stop_strings
