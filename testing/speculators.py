"""``check_speculator``: does a Speculator plugin keep the contract a speculative worker relies on?"""

from __future__ import annotations

import tempfile
from typing import Any, Callable

import torch

from treadle.core.hookspecs import hookimpl
from treadle.core.registry import build_registry
from treadle.core.speculative.speculator import Drafts, Speculator

SpeculatorFactory = Callable[..., Speculator]

_PROMPTS = [[5, 17, 42, 8, 99, 3, 5, 17, 42, 8], [300, 301, 9], [60, 61, 62, 60, 61, 62, 60]]
_BUDGETS = (14, 6, 11)


def check_speculator(factory: SpeculatorFactory, *, model_dir: str | None = None, num_tokens: int = 3,
                     overrides: dict[str, Any] | None = None) -> None:
    """Assert that ``factory(target_worker, resolved_config, registry)`` builds a conforming :class:`Speculator`.

    It runs behind a speculative worker in an offline Engine over ``model_dir`` (default: a tiny random Llama
    built in a temporary folder), greedy, with requests that finish at different steps. Checked:

    - every ``propose(batch, n)`` returns :class:`Drafts` whose ``token_ids`` are ``[bs, n]`` int64 on the
      target's device with ids inside the vocabulary, whose ``parents`` (a tree's, with ``speculative.topk`` > 1 in
      ``overrides``) are None or ``[bs, n]`` int64 each -1 or an earlier draft's index, and whose ``probs`` are None
      or ``[bs, n, vocab]`` float32
      there; on CUDA, ``propose`` does not synchronize the device (``torch.cuda.set_sync_debug_mode``);
    - a speculator with ``proposes_on_device``: ``propose_on_device`` is asked for drafts once verify steps
      overlap (``speculative.overlap``, on where the config allows) and returns a chain the same way (no
      ``probs``, no ``parents``), without synchronizing the device;
    - the outputs are the plain run's token for token, and every KV slot comes back;
    - ``request_released`` is called for every request and may be called again for the same one.

    ``overrides``: more config values (``{"speculative": {"draft_model_path": ...}}``). Raises AssertionError
    naming the broken rule.
    """
    from treadle import Engine, SamplingParams
    from treadle.testing.engine import assert_kv_accounted
    from treadle.testing.models import make_tiny_llama

    name = getattr(factory, "__name__", repr(factory))
    if model_dir is None:
        model_dir = make_tiny_llama(tempfile.mkdtemp(prefix="treadle-speculator-check-"))
    checked = _Checked(factory)
    registry = build_registry(extra_plugins=[checked])
    config = {"model": {"path": model_dir}, "cache": {"max_total_tokens": 2048}, **(overrides or {})}
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in _BUDGETS]
    plain = [o.token_ids for o in Engine(config, registry=registry).generate(input_ids=_PROMPTS,
                                                                               sampling_params=params)]
    spec = {**config.get("speculative", {}), "method": _Checked.NAME, "num_tokens": num_tokens, "max_batch_size": 64}
    engine = Engine({**config, "speculative": spec}, registry=registry)
    outputs = [o.token_ids for o in engine.generate(input_ids=_PROMPTS, sampling_params=params)]
    _expect(checked.proposals > 0, f"{name}: no verify step asked it for drafts")
    if engine.scheduler.worker.overlap_verify:
        _expect(checked.device_proposals > 0, f"{name}: proposes_on_device, but no overlapped verify step asked it "
                                              "for drafts")
    _expect(outputs == plain, f"{name}: greedy outputs with its drafts differ from the plain run's: {outputs} vs "
                              f"{plain} (drafts must never change what the target computes)")
    assert_kv_accounted(engine)
    speculator = checked.built
    _expect(len(checked.released) >= len(_PROMPTS), f"{name}: request_released was called for "
                                                    f"{len(checked.released)} of {len(_PROMPTS)} requests")
    for req in checked.released[:1]:
        speculator.request_released(req)  # a second time: must be harmless


class _Checked:
    """A plugin registering ``factory`` under NAME, its speculator wrapped so every call is checked."""

    NAME = "conformance-check"

    def __init__(self, factory: SpeculatorFactory) -> None:
        self.factory = factory
        self.built: Speculator | None = None
        self.proposals = 0
        self.device_proposals = 0
        self.released: list[Any] = []
        self.__name__ = "treadle.testing.speculators"

    @hookimpl
    def treadle_register_speculators(self, register) -> None:
        register(self.NAME, self._build)

    def _build(self, target: Any, config: Any, registry: Any) -> Speculator:
        speculator = self.factory(target, config, registry)
        name = getattr(self.factory, "__name__", repr(self.factory))
        _expect(isinstance(speculator, Speculator), f"{name} built a {type(speculator).__name__}, not a Speculator")
        self.built = speculator
        propose, release = speculator.propose, speculator.request_released
        propose_on_device = speculator.propose_on_device
        device, vocab = target.info.device, target.info.vocab_size

        def checked_propose(batch: Any, num_drafts: int) -> Drafts:
            drafts = _without_sync(device, propose, batch, num_drafts)
            _check_drafts(name, drafts, (len(batch.entries), num_drafts), device, vocab)
            self.proposals += 1
            return drafts

        def checked_propose_on_device(batch: Any, num_drafts: int, positions: Any, req_pool_indices: Any) -> Drafts:
            drafts = _without_sync(device, propose_on_device, batch, num_drafts, positions, req_pool_indices)
            _check_drafts(f"{name} (propose_on_device)", drafts, (len(batch.entries), num_drafts), device, vocab)
            _expect(drafts.probs is None and drafts.parents is None,
                    f"{name}.propose_on_device: an overlapped verify step takes a chain without probs")
            self.proposals += 1
            self.device_proposals += 1
            return drafts

        def checked_release(req: Any) -> None:
            self.released.append(req)
            release(req)

        speculator.propose = checked_propose  # type: ignore[method-assign]
        if getattr(speculator, "proposes_on_device", False):
            speculator.propose_on_device = checked_propose_on_device  # type: ignore[method-assign]
        speculator.request_released = checked_release  # type: ignore[method-assign]
        return speculator


def _without_sync(device: torch.device, call: Callable[..., Drafts], *args: Any) -> Drafts:
    """``call(*args)``, an error on CUDA if it synchronizes the device."""
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        return call(*args)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def _check_drafts(name: str, drafts: Any, shape: tuple[int, int], device: torch.device, vocab: int) -> None:
    _expect(isinstance(drafts, Drafts), f"{name}.propose returned a {type(drafts).__name__}, not Drafts")
    ids = drafts.token_ids
    _expect(tuple(ids.shape) == shape and ids.dtype == torch.int64,
            f"{name}.propose: token_ids must be int64 {list(shape)}, got {ids.dtype} {list(ids.shape)}")
    _expect(ids.device.type == device.type, f"{name}.propose: token_ids on {ids.device}, the target is on {device}")
    if device.type == "cpu":
        _expect(bool(((ids >= 0) & (ids < vocab)).all()), f"{name}.propose: a token id outside [0, {vocab})")
    if drafts.probs is not None:
        probs = drafts.probs
        _expect(tuple(probs.shape) == (*shape, vocab) and probs.dtype == torch.float32
                and probs.device.type == device.type,
                f"{name}.propose: probs must be float32 {[*shape, vocab]} on {device}, got {probs.dtype} "
                f"{list(probs.shape)} on {probs.device}")
    if drafts.parents is not None:
        parents = drafts.parents
        _expect(tuple(parents.shape) == shape and parents.dtype == torch.int64 and parents.device.type == device.type,
                f"{name}.propose: parents must be int64 {list(shape)} on {device}, got {parents.dtype} "
                f"{list(parents.shape)} on {parents.device}")
        if device.type == "cpu":
            below = torch.arange(shape[1]).unsqueeze(0)
            _expect(bool(((parents >= -1) & (parents < below)).all()),
                    f"{name}.propose: a draft's parent must be -1 (the last token) or an earlier draft's index")


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
