"""EngineBackend: programs run against an in-process :class:`treadle.core.engine.Engine`."""

from __future__ import annotations

import threading
from typing import Any, Iterator

from treadle.lang.backend import Backend, Completion, Scored, slice_scores


class EngineBackend(Backend):
    """Runs programs on an in-process Engine (``EngineBackend(Engine(config))``, or give it a config).

    The Engine is not thread-safe, so every call to it holds one lock; programs
    run by ``run_batch`` in several threads therefore take turns on the model.
    Streaming steps the Engine's scheduler directly (under the same lock) and
    decodes tokens as they come.
    """

    def __init__(self, engine: Any = None, **engine_kwargs: Any) -> None:
        if not hasattr(engine, "generate"):  # None, a ServerConfig, a dict or a YAML path
            from treadle.core.engine import Engine

            engine = Engine(engine, **engine_kwargs)
        self.engine = engine
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        if self.engine.tokenizer is None:
            raise RuntimeError("the engine's model has no tokenizer; treadle.lang needs one to build prompts")
        return self.engine.tokenizer

    def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> Completion:
        with self._lock:
            output = self.engine.generate(input_ids=input_ids, sampling_params=dict(sampling_params))
        return Completion(
            text=output.text,
            output_ids=list(output.token_ids),
            finish_reason=output.finish_reason,
            matched_stop=output.matched_stop,
            prompt_tokens=output.prompt_tokens,
            completion_tokens=output.completion_tokens,
            cached_tokens=output.cached_tokens,
        )

    def generate_stream(self, input_ids: list[int], sampling_params: dict[str, Any]) -> Iterator[str | Completion]:
        scheduler = getattr(self.engine, "scheduler", None)
        if scheduler is None:  # an Engine-like object without a scheduler: one chunk at the end
            yield self.generate(input_ids, sampling_params)
            return
        yield from self._stream_from_scheduler(scheduler, input_ids, sampling_params)

    def score(self, sequences: list[list[int]], starts: list[int]) -> list[Scored]:
        logprob_start_len = min(starts)
        with self._lock:
            outputs = self.engine.generate(
                input_ids=sequences,
                sampling_params={"max_new_tokens": 0},
                return_logprob=True,
                logprob_start_len=logprob_start_len,
            )
        scored = slice_scores(sequences, starts, logprob_start_len, [o.input_token_logprobs for o in outputs])
        for result, output in zip(scored, outputs):
            result.cached_tokens = output.cached_tokens
        return scored

    def _stream_from_scheduler(
        self, scheduler: Any, input_ids: list[int], sampling_params: dict[str, Any]
    ) -> Iterator[str | Completion]:
        from treadle.text.incremental_decode import IncrementalDecoder
        from treadle.core.request import Req, SamplingParams

        params = SamplingParams.from_any(dict(sampling_params))
        params.verify()
        req = Req(rid=Req.new_rid(), origin_input_ids=list(input_ids), sampling_params=params)
        decoder = IncrementalDecoder(self.tokenizer, params.skip_special_tokens, params.stop)
        # Engine.generate steps the scheduler for its own requests only and drops
        # the outputs of others, so the lock is held for the whole request.
        final = None
        with self._lock:
            scheduler.add_request(req)
            try:
                while final is None:
                    if not scheduler.has_work():
                        raise RuntimeError(f"the scheduler went idle before request {req.rid} finished")
                    for output in scheduler.step():
                        if output.rid != req.rid:
                            continue
                        delta = decoder.feed(output.new_token_ids)
                        if output.finished_reason is not None:
                            final = output
                            delta += decoder.finish()
                        if delta:
                            yield delta
            finally:
                if final is None:  # the consumer stopped early or a step failed
                    scheduler.abort_request(req.rid)
        yield Completion(
            text=decoder.output_text,
            output_ids=list(req.output_ids),
            finish_reason=final.finished_reason,
            matched_stop=_matched_stop(final, params.stop),
            prompt_tokens=final.prompt_tokens,
            completion_tokens=final.completion_tokens,
            cached_tokens=final.cached_tokens,
        )


def _matched_stop(final: Any, stop: list[str]) -> str | int | None:
    """The stop string, or the stop token id, that ended the request (as Engine.generate reports it)."""
    if final.finished_reason != "stop" or final.finished_detail is None:
        return None
    detail = final.finished_detail
    return detail if detail in stop else int(detail)
