"""Streaming responses: one that fell behind its outputs catches up in one write per wake-up, and every
event is one line, whatever line breaks the text holds."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from treadle.server.streaming import sse_response
from treadle.server.ipc import StrOutput
from treadle.server.tokenizer_manager import GenerationStream, StreamEvent


class _Manager:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def _event(index: int, token: int, finished: bool = False) -> StreamEvent:
    return StreamEvent(index, StrOutput(rid=f"r{index}", new_token_ids=[token],
                                        finished_reason="length" if finished else None, finished_detail=None,
                                        prompt_tokens=3, completion_tokens=0, cached_tokens=0,
                                        text_delta=f"<{token}>"))


def _writes(groups: list[list[StreamEvent]], accumulate: bool) -> list[list[Any]]:
    """The response body's writes, parsed, when ``groups[0]`` (one event) starts the response and each later
    group of events arrives, all at once, while the previous write goes out."""

    async def run() -> list[bytes]:
        stream = GenerationStream(_Manager(), ["r0", "r1"])  # type: ignore[arg-type]
        ids: dict[int, list[int]] = {0: [], 1: []}

        def add(event: StreamEvent) -> None:
            ids[event.index] += event.output.new_token_ids  # type: ignore[union-attr]

        def render(event: StreamEvent) -> list[dict[str, Any]]:
            if accumulate:
                return [{"index": event.index, "output_ids": list(ids[event.index])}]
            return [{"index": event.index, "delta": event.output.new_token_ids}]  # type: ignore[union-attr]

        (first,) = groups[0]
        response = sse_response(stream, stream._note(first), render, accumulate=add if accumulate else None)
        writes, later = [], iter(groups[1:])
        async for data in response.body_iterator:
            writes.append(data)
            for event in next(later, []):
                stream.queue.put_nowait(event)
        return writes

    parsed = []
    for data in asyncio.run(run()):
        lines = [line[6:] for line in data.decode().split("\n\n") if line.startswith("data: ")]
        parsed.append([json.loads(line) if line != "[DONE]" else "[DONE]" for line in lines])
    return parsed


def test_waiting_events_go_out_in_one_write_with_each_sub_requests_latest_state() -> None:
    groups = [[_event(0, 10)], [_event(1, 20), _event(0, 11), _event(1, 21)], [_event(0, 12, True)],
              [_event(1, 22, True)]]
    writes = _writes(groups, accumulate=True)
    assert writes == [
        [{"index": 0, "output_ids": [10]}],
        [{"index": 1, "output_ids": [20, 21]}, {"index": 0, "output_ids": [10, 11]}],
        [{"index": 0, "output_ids": [10, 11, 12]}],
        [{"index": 1, "output_ids": [20, 21, 22]}, "[DONE]"],
    ]


def test_delta_chunks_are_all_kept_in_order() -> None:
    groups = [[_event(0, 10)], [_event(0, 11), _event(0, 12)], [_event(0, 13, True), _event(1, 20, True)]]
    writes = _writes(groups, accumulate=False)
    assert writes == [
        [{"index": 0, "delta": [10]}],
        [{"index": 0, "delta": [11]}, {"index": 0, "delta": [12]}],
        [{"index": 0, "delta": [13]}, {"index": 1, "delta": [20]}, "[DONE]"],
    ]


def test_an_error_after_waiting_events_sends_them_then_the_error() -> None:
    from treadle.server.tokenizer_manager import RequestError

    groups = [[_event(0, 10)], [_event(0, 11), StreamEvent(1, error=RequestError("boom", status_code=500))]]
    writes = _writes(groups, accumulate=True)
    assert len(writes) == 2 and writes[1][0] == {"index": 0, "output_ids": [10, 11]}
    assert writes[1][1]["error"]["message"] == "boom" and writes[1][2] == "[DONE]"


def test_an_event_is_one_line_for_readers_that_split_on_unicode_line_breaks() -> None:
    text = "a\x85b\u2028c\u2029d é"  # JSON leaves these raw; str.splitlines (httpx's iter_lines) splits at each

    async def run() -> bytes:
        stream = GenerationStream(_Manager(), ["r0"])  # type: ignore[arg-type]
        response = sse_response(stream, stream._note(_event(0, 10, finished=True)), lambda event: [{"text": text}])
        return b"".join([data async for data in response.body_iterator])

    lines = [line for line in asyncio.run(run()).decode().splitlines() if line]
    assert len(lines) == 2 and json.loads(lines[0].removeprefix("data: ")) == {"text": text}, lines
    assert lines[1] == "data: [DONE]"


@pytest.mark.parametrize("return_logprob", [True, False])
def test_native_stream_chunks_serialize_like_the_response_dict(return_logprob: bool) -> None:
    import json

    from treadle.server.native_routes import _NativeResult
    from treadle.server.ipc import StrOutput
    from treadle.server.protocol import GenerateRequest

    body = GenerateRequest(input_ids=[1, 2, 3], return_logprob=return_logprob)
    result = _NativeResult("r-1", [1, 2, 3], body)
    assert json.loads(result.to_json_text([])) == result.to_json([])  # before any output
    outputs = [
        StrOutput("r-1", [7], None, None, 3, 1, 0, new_output_logprobs=[-0.5], text_delta="héllo",
                  input_token_logprobs=[None, -1.0, -2.0]),
        StrOutput("r-1", [8, 9], None, None, 3, 3, 0, new_output_logprobs=[-0.1, -0.2], text_delta=' "x"\n'),
        StrOutput("r-1", [10], "stop", "</s>", 3, 4, 0, new_output_logprobs=[-0.3], text_delta=""),
    ]
    for out in outputs:
        result.add(out)
        assert json.loads(result.to_json_text([])) == result.to_json([])
        assert json.loads(result.to_json_text([], index=2)) == {**result.to_json([]), "index": 2}
        meta = json.dumps(result.to_json([])["meta_info"], ensure_ascii=False)  # the same bytes, key order too
        assert result.to_json_text([]).endswith(f'"meta_info": {meta}}}')
    assert result.to_json([])["output_ids"] == [7, 8, 9, 10]


@pytest.mark.parametrize("include_usage", [True, False])
def test_completion_chunks_are_the_bytes_json_dumps_writes(include_usage: bool) -> None:
    from treadle.server.openai_routes import CompletionChunkText

    base = {"id": "cmpl-\u00e9\"x", "object": "text_completion", "created": 1700000000, "model": "m/ö"}
    chunk = CompletionChunkText(base, include_usage)
    for index, text, reason in [(0, "", None), (3, 'a "b"\\\n\té\u2028\x00😀', None), (1, "end", "length")]:
        payload = {**base, "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}]}
        if include_usage:
            payload["usage"] = None
        assert chunk(index, text, reason) == json.dumps(payload, ensure_ascii=False)
