"""Engine: the in-process offline API over the same Scheduler the server runs."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from treadle.core.config import ServerConfig, load_config, validate_config
from treadle.core.registry import Registry
from treadle.core.request import InvalidRequestError, Req, ReqOutput, SamplingParams
from treadle.core.resolved_config import ResolvedConfig

logger = logging.getLogger(__name__)

ConfigLike = ServerConfig | Mapping[str, Any] | str | os.PathLike | None
# Engine.generate keeps at most this many unfinished requests per running slot in the scheduler.
QUEUED_PER_RUNNING_REQUEST = 4


@dataclass
class GenerateOutput:
    """One finished generation."""

    text: str
    token_ids: list[int]
    finish_reason: str
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_verify_steps: int = 0  # verify steps that gave it tokens (speculative decoding; 0 without it)
    input_token_logprobs: list[float | None] = field(default_factory=list)
    output_token_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[Any] = field(default_factory=list)
    output_top_logprobs: list[Any] = field(default_factory=list)


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (``Engine.encode``)."""

    embedding: list[float]
    prompt_tokens: int = 0
    cached_tokens: int = 0


def as_server_config(config: ConfigLike) -> ServerConfig:
    """A ServerConfig from a ServerConfig, a dict shaped like the YAML, a YAML path, or None (defaults)."""
    if config is None:
        return load_config()
    if isinstance(config, ServerConfig):
        return config
    if isinstance(config, Mapping):
        return validate_config(config)
    return load_config(Path(config))


class Engine:
    """Runs generation in this process: ``Engine(config).generate(prompts, sampling_params)``.

    With ``parallel.tp_size > 1`` this process is tensor-parallel rank 0 and starts the other
    ranks as processes (call :meth:`shutdown`, or use ``with``, to stop them). Custom plugins
    must then be importable by name (``plugins:``) so the other ranks find them too.
    Not thread-safe: one caller at a time.
    """

    def __init__(self, config: ConfigLike = None, registry: Registry | None = None) -> None:
        from treadle.core.distributed.tensor_parallel import start_scheduler

        self.config = as_server_config(config)  # the caller's; self.resolved_config has every "auto" resolved
        # At parallel.tp_size > 1 this process is rank 0 and the other ranks run as child processes. An offline
        # batch resolves its "auto" sizes for throughput (larger prefill chunks, no latency chunks).
        self.scheduler = start_scheduler(self.config, registry, offline=True)
        self.tokenizer = self.scheduler.tokenizer
        self._multimodal_processor: Any = None  # built on the first request with images

    @property
    def resolved_config(self) -> "ResolvedConfig":
        """The config the engine runs with: every ``auto`` replaced by the value chosen for this model and
        device (frozen)."""
        return self.scheduler.config

    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Mapping[str, Any] | Sequence[Any] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        priority: int | Sequence[int] | None = None,
        lora_path: str | Sequence[str | None] | None = None,
        image_data: Sequence[Any] | None = None,
        video_data: Sequence[Any] | None = None,
    ) -> GenerateOutput | list[GenerateOutput]:
        """Generate for one prompt (returns one output) or a list of prompts (returns a list, in order).

        ``lora_path``: the LoRA adapter (a name from ``lora.paths``, or one loaded with
        :meth:`load_lora_adapter`) for every prompt, or one per prompt (None: the base model).
        ``image_data`` (a vision-language model): the images of one prompt (a list of bytes, ``data:`` URLs, paths
        or PIL images), or for a list of prompts one such list each; the prompt marks each image with the model's
        image token (docs/multimodal.md). ``video_data``: likewise the videos, each a list of frames (as images are
        given) or an animated image, marked in the prompt with the model's video token."""
        single, token_lists = self._token_lists(prompt, input_ids)
        token_lists, multimodal = self._with_media(single, token_lists, image_data, video_data)
        count = len(token_lists)
        params = _per_request(sampling_params, count, SamplingParams.from_any, "sampling_params")
        priorities = _per_request(priority, count, lambda p: int(p or 0), "priority")
        adapters = _per_request(lora_path, count, lambda name: name or None, "lora_path")
        reqs = [
            Req(
                rid=Req.new_rid(),
                origin_input_ids=ids,
                sampling_params=_copy_params(p),
                priority=prio,
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len,
                top_logprobs_num=top_logprobs_num,
                lora_name=adapter,
                multimodal=mm,
            )
            for ids, p, prio, adapter, mm in zip(token_lists, params, priorities, adapters, multimodal)
        ]
        scheduler = self.scheduler
        for req in reqs:
            scheduler.check_request(req)  # a prompt that can never run fails the call before any step
        finished = self._run(reqs, queue_order([p.max_new_tokens for p in params], self.config.scheduler.batch_order))
        outputs = [self._to_output(req, finished[req.rid]) for req in reqs]
        return outputs[0] if single else outputs

    def encode(
        self,
        prompt: str | Sequence[str] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        dimensions: int | None = None,
    ) -> EmbeddingOutput | list[EmbeddingOutput]:
        """Embed one prompt (returns one output) or a list of prompts (a list, in order) with an embedding model
        (``model.task: embed``); ``dimensions`` shortens a Matryoshka model's vectors (renormalized)."""
        from treadle.core.embedding.vectors import check_dimensions, truncate

        single, token_lists = self._token_lists(prompt, input_ids)
        scheduler = self.scheduler
        if scheduler.embeds:
            check_dimensions(dimensions, scheduler.embedding_info)
        reqs = [Req(rid=Req.new_rid(), origin_input_ids=ids, sampling_params=SamplingParams(max_new_tokens=1),
                    wants_embedding=True) for ids in token_lists]
        for req in reqs:
            scheduler.check_request(req)
        finished = self._run(reqs, range(len(reqs)))
        normalize = scheduler.config.model.normalize_embeddings
        outputs = [EmbeddingOutput(truncate(finished[req.rid].embedding or [], dimensions, normalize),
                                   len(req.origin_input_ids), req.cached_tokens) for req in reqs]
        return outputs[0] if single else outputs

    def _run(self, reqs: list[Req], order: Sequence[int]) -> dict[str, ReqOutput]:
        """Run ``reqs`` (queued in ``order``) to the end; each one's final output by id."""
        scheduler = self.scheduler
        queue = iter(order)
        # The scheduler's per-step work grows with its queue (policy order, admission), so a large batch is
        # fed as requests finish: it holds at most this many unfinished requests, several batches' worth.
        window = QUEUED_PER_RUNNING_REQUEST * scheduler.config.scheduler.max_running_requests
        added: list[Req] = []
        finished: dict[str, ReqOutput] = {}
        try:
            while len(finished) < len(reqs):
                while len(added) - len(finished) < window and (i := next(queue, None)) is not None:
                    scheduler.add_request(reqs[i])
                    added.append(reqs[i])
                for output in scheduler.step():
                    if output.finished_reason is not None:
                        finished[output.rid] = output
        except BaseException:
            for req in added:
                scheduler.abort_request(req.rid)  # a finished one is no longer there: nothing happens
            raise
        return finished

    def kv_stats(self) -> dict[str, int]:
        """``total_slots``, ``free_slots``, ``cached_slots`` (held by the radix cache), and more."""
        return self.scheduler.kv_stats()

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def load_lora_adapter(self, name: str, path: str | os.PathLike) -> None:
        """Serve the PEFT adapter folder ``path`` as ``name`` (needs a ``lora`` section in the config)."""
        self.scheduler.load_lora_adapter(name, str(path))

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name`` (no request of this engine is running between calls to generate)."""
        if not self.scheduler.unload_lora_adapter(name):
            raise RuntimeError(f"LoRA adapter {name!r} is still used by queued requests")

    @property
    def model_info(self) -> dict[str, Any]:
        return self.scheduler.model_info

    def shutdown(self) -> None:
        """Release the model and the KV memory (and stop the other tensor-parallel ranks)."""
        if self.scheduler is None:
            return
        stop_ranks = getattr(self.scheduler, "shutdown", None)
        if stop_ranks is not None:
            stop_ranks()
        self.scheduler = None  # type: ignore[assignment]
        import gc

        from treadle.core.loading.gc_freeze import release_startup_objects

        release_startup_objects()  # what start_scheduler froze, this engine included, can be collected again
        gc.collect()
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _with_media(self, single: bool, token_lists: list[list[int]], image_data: Any, video_data: Any
                    ) -> tuple[list[list[int]], list[Any]]:
        """Each prompt's ids with its images' and videos' placeholders expanded, and its multimodal inputs (None:
        text)."""
        if image_data is None and video_data is None:
            return token_lists, [None] * len(token_lists)
        from treadle.core.multimodal.processor import ImageLimits, MultimodalProcessor

        per_prompt = {}
        for name, given in (("image_data", image_data), ("video_data", video_data)):
            per_prompt[name] = ([given] if single else list(given)) if given is not None else [()] * len(token_lists)
            if len(per_prompt[name]) != len(token_lists):
                raise InvalidRequestError(f"{name} has {len(per_prompt[name])} entries for {len(token_lists)} "
                                          "prompts", param=name)
        if self._multimodal_processor is None:
            info = self.scheduler.worker.info
            self._multimodal_processor = MultimodalProcessor.for_model(
                info.model_dir, info.hf_config, ImageLimits.from_config(self.config.multimodal))
        processor = self._multimodal_processor
        if processor is None:
            raise InvalidRequestError("this model takes no images or video; leave out image_data and video_data",
                                      param="image_data" if image_data is not None else "video_data")

        def prepare(ids: list[int], images: Any, videos: Any) -> tuple[list[int], Any]:
            return processor.process(ids, images or (), video_data=videos or ()) if images or videos else (ids, None)

        jobs = list(zip(token_lists, per_prompt["image_data"], per_prompt["video_data"]))
        if sum(bool(images or videos) for _, images, videos in jobs) > 1:
            # The image processor's resize and normalize run in numpy and PIL, which let go of the GIL: many
            # prompts' images are prepared side by side (a 1024x768 image takes ~0.1 s on one core).
            with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
                prepared = list(pool.map(lambda job: prepare(*job), jobs))
        else:
            prepared = [prepare(*job) for job in jobs]
        return [ids for ids, _ in prepared], [mm for _, mm in prepared]

    def _token_lists(self, prompt: Any, input_ids: Any) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("give exactly one of prompt or input_ids", param="prompt")
        if input_ids is not None:
            if len(input_ids) and isinstance(input_ids[0], int):
                return True, [list(input_ids)]
            return False, [list(ids) for ids in input_ids]
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; pass input_ids", param="prompt")
        single = isinstance(prompt, str)
        texts = [prompt] if single else list(prompt)
        return single, [self.tokenizer.encode(text) for text in texts]

    def _to_output(self, req: Req, final: ReqOutput) -> GenerateOutput:
        from treadle.text.incremental_decode import stopped_by_token, trim_at_stop

        text = ""
        if self.tokenizer is not None:
            ids = req.output_ids
            if ids and stopped_by_token(final.finished_reason, final.finished_detail, req.sampling_params.stop):
                ids = ids[:-1]  # the stop token is not part of the text (as the server does)
            text = self.tokenizer.decode(ids, skip_special_tokens=req.sampling_params.skip_special_tokens)
            if final.finished_reason == "stop" and isinstance(final.finished_detail, str):
                text = trim_at_stop(text, req.sampling_params.stop)
        matched: str | int | None = final.finished_detail
        if final.finished_reason == "stop" and matched is not None and matched not in req.sampling_params.stop:
            matched = int(matched)
        return GenerateOutput(
            text=text,
            token_ids=list(req.output_ids),
            finish_reason=final.finished_reason or "abort",
            matched_stop=matched if final.finished_reason == "stop" else None,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            spec_verify_steps=req.spec_verify_steps,
            input_token_logprobs=list(req.input_token_logprobs),
            output_token_logprobs=list(req.output_token_logprobs),
            input_top_logprobs=list(req.input_top_logprobs),
            output_top_logprobs=list(req.output_top_logprobs),
        )


def queue_order(max_new_tokens: Sequence[int], batch_order: str) -> list[int]:
    """The indices of one batch's requests in the order to queue them (``scheduler.batch_order``).

    ``longest_output_first`` puts the largest output budgets first, a stable sort. A batch call returns
    when its last request ends, so the order costs no caller any latency; starting the longest first is
    the classic makespan heuristic (longest processing time first): the short ones fill the batch around
    them instead of leaving a few long ones to decode alone at the end. ``submission`` keeps the order given.
    """
    if batch_order == "submission":
        return list(range(len(max_new_tokens)))
    return sorted(range(len(max_new_tokens)), key=lambda i: -max_new_tokens[i])


def _per_request(value: Any, count: int, convert, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)) and not isinstance(value, str):
        if len(value) != count:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {count} prompts", param=name)
        return [convert(v) for v in value]
    return [convert(value)] * count


def _copy_params(params: SamplingParams) -> SamplingParams:
    # Each request may clamp max_new_tokens; never let that leak into a shared object.
    from dataclasses import replace

    return replace(params)
