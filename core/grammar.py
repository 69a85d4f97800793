"""Constrained decoding: the grammar-backend interface and the scheduler's per-step use of it.

A :class:`GrammarBackend` (a ``grammar_backends`` plugin) compiles a
:class:`Constraint` — a JSON schema, a regex or an EBNF grammar — for one
tokenizer, and hands out a :class:`GrammarMatcher` per request. Each step the
matcher writes its allowed tokens as one row of an int32 bitmask (bit ``t % 32``
of word ``t // 32`` set when token ``t`` may come next), then accepts the token
that was sampled. :class:`GrammarManager` is what the scheduler talks to: it
compiles (with an LRU cache), builds the step's mask only when some request is
constrained, and advances and frees matchers.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from treadle.core.request import Req, SamplingParams
from treadle.core.validation import CONSTRAINT_KINDS, InvalidRequestError

logger = logging.getLogger(__name__)


class GrammarCompileError(InvalidRequestError):
    """A constraint is invalid or uses something its backend does not support (HTTP 400)."""


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: ``kind`` is one of :data:`CONSTRAINT_KINDS`."""

    kind: str
    text: str

    @classmethod
    def from_params(cls, params: SamplingParams) -> "Constraint | None":
        for kind in CONSTRAINT_KINDS:
            text = getattr(params, kind)
            if text is not None:
                return cls(kind, text)
        return None


class GrammarMatcher(ABC):
    """One request's position in its constraint."""

    #: How many accepted tokens :meth:`rollback` can undo. Speculative decoding verifies at most this many drafts
    #: of the request per step: it walks the matcher through them to mask each verified position, then rolls it
    #: back (:meth:`GrammarManager.verify_mask`). 0, the default, keeps the request at one token per step.
    max_rollback_tokens: int = 0

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (CPU int32, ``bitmask_width`` words)."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the constraint does not allow it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the constraint is complete and admits no further token."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (at most :attr:`max_rollback_tokens`); optional."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll back (its max_rollback_tokens is 0)")


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer and creates matchers for them.

    Factories registered under ``grammar_backends`` are called as
    ``factory(tokenizer=..., vocab_size=..., stop_token_ids=..., any_whitespace=...)``:
    ``vocab_size`` is the model's logits width (it may exceed the tokenizer's),
    ``stop_token_ids`` end a completed constraint, and ``any_whitespace`` allows
    free whitespace between JSON tokens (otherwise the compact form is enforced).
    """

    name: str = "?"

    @abstractmethod
    def compile(self, constraint: Constraint) -> Any:
        """A compiled form of ``constraint``; raise GrammarCompileError when it is invalid or unsupported."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Fill ``bitmask[rows[i]]`` from ``matchers[i]`` (this backend's own); override to fill in parallel."""
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor) -> torch.Tensor:
    """``[rows, 32 * words]`` uint8 from an int32 ``bitmask``: 1 where the token's bit is set."""
    # Unpacked byte by byte (little-endian words: byte k of word w holds tokens 32w + 8k ... 32w + 8k + 7),
    # so the temporary is one uint8 per token, not one int32.
    as_bytes = bitmask.contiguous().view(torch.uint8)
    shifts = torch.arange(8, device=bitmask.device, dtype=torch.uint8)
    return ((as_bytes.unsqueeze(-1) >> shifts) & 1).flatten(1)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """The int32 bitmask row (``bitmask_width(len(allowed))`` words) of a 1-D bool ``allowed``, the inverse of
    :func:`unpack_bitmask`."""
    bits = torch.zeros(32 * bitmask_width(allowed.numel()), dtype=torch.uint8)
    bits[: allowed.numel()] = allowed.to(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8)
    return (bits.view(-1, 8) << shifts).sum(dim=1, dtype=torch.uint8).view(torch.int32)


def apply_vocab_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token whose bit is clear in ``bitmask`` (same rows, on the device) set to -inf."""
    allowed = unpack_bitmask(bitmask)[:, : logits.shape[-1]]
    return logits.masked_fill(allowed == 0, float("-inf"))


class GrammarManager:
    """The scheduler's grammar state: a lazily built backend, a compile cache, the step's mask.

    Matchers live on ``req.grammar``; a retracted request keeps its matcher (its
    accepted tokens stay accepted while its KV is recomputed).
    """

    def __init__(
        self,
        backend_factory: Callable[..., GrammarBackend],
        backend_name: str,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        device: torch.device,
        cache_size: int = 256,
        any_whitespace: bool = False,
    ) -> None:
        self._factory = backend_factory
        self.backend_name = backend_name
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._any_whitespace = any_whitespace
        self.device = device
        self.cache_size = cache_size
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self._host_masks: list[torch.Tensor] = []
        self._next_host_mask = 0
        self.cache_hits = 0
        self.cache_misses = 0

    @classmethod
    def from_config(cls, config: Any, registry: Any, tokenizer: Any, vocab_size: int,
                    stop_token_ids: Sequence[int], device: torch.device) -> "GrammarManager":
        grammar = config.grammar
        return cls(registry.get("grammar_backends", grammar.backend), grammar.backend, tokenizer, vocab_size,
                   stop_token_ids, device, cache_size=grammar.cache_size, any_whitespace=grammar.any_whitespace)

    @property
    def backend(self) -> GrammarBackend:
        """The backend, built on first use so that servers without constrained requests never load it."""
        if self._backend is None:
            if self._tokenizer is None:
                raise InvalidRequestError("constrained decoding needs the model's tokenizer; this model has none",
                                          param="json_schema")
            self._backend = self._factory(tokenizer=self._tokenizer, vocab_size=self.vocab_size,
                                          stop_token_ids=list(self._stop_token_ids),
                                          any_whitespace=self._any_whitespace)
        return self._backend

    def check(self, req: Req) -> None:
        """Compile ``req``'s constraint (if any) into the cache, so an invalid one fails before it is queued."""
        constraint = Constraint.from_params(req.sampling_params)
        if constraint is not None:
            self.compile(constraint)

    def attach(self, req: Req) -> None:
        """Compile ``req``'s constraint (if any) and give it a matcher; InvalidRequestError when invalid."""
        constraint = Constraint.from_params(req.sampling_params)
        if constraint is None or req.grammar is not None:
            return
        req.grammar = self.backend.new_matcher(self.compile(constraint))

    def compile(self, constraint: Constraint) -> Any:
        key = (self.backend_name, _tokenizer_key(self._tokenizer, self.vocab_size), constraint.kind + ":" + constraint.text)
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return compiled
        self.cache_misses += 1
        try:
            compiled = self.backend.compile(constraint)
        except GrammarCompileError:
            raise
        except Exception as exc:  # a backend library's own error type: still the request's fault
            raise GrammarCompileError(f"invalid {constraint.kind} for grammar backend '{self.backend_name}': {exc}",
                                      param=constraint.kind) from None
        if self.cache_size > 0:
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def vocab_mask(self, reqs: Sequence[Req]) -> torch.Tensor | None:
        """The step's bitmask on the device, or None (no work at all) when no request is constrained."""
        if all(req.grammar is None for req in reqs):
            return None
        host = self._host_mask(len(reqs))
        host.fill_(-1)  # every bit set: unconstrained rows keep their logits
        rows = [row for row, req in enumerate(reqs) if req.grammar is not None]
        self.backend.fill_bitmasks([reqs[row].grammar for row in rows], host, rows)
        return host.to(self.device, non_blocking=True)

    def verify_mask(self, reqs: Sequence[Req], draft_ids: Callable[[], list[list[int]]]) -> torch.Tensor | None:
        """A verify step's bitmask on the device, a row per verified position, or None when no request is
        constrained. ``draft_ids()``: each request's ``k`` drafts on the host (called only when one is constrained).

        Row ``i * (k + 1) + j`` is what request ``i``'s constraint allows after its drafts ``0 .. j - 1``: the
        matcher is walked through them, then rolled back, so that only the tokens the step keeps advance it (in
        :meth:`accept`, as in plain decoding). A draft the constraint forbids ends the walk: its own row forbids
        it, so the target rejects it, greedy or sampled, and the rows after it (positions that cannot be kept)
        allow everything; so does every row after a draft that completes the constraint.
        """
        if all(req.grammar is None for req in reqs):
            return None
        drafts = draft_ids()
        per_req = len(drafts[0]) + 1
        host = self._host_mask(len(reqs) * per_req)
        host.fill_(-1)
        walking = [i for i, req in enumerate(reqs) if req.grammar is not None]
        walked = dict.fromkeys(walking, 0)
        for j in range(per_req):
            self.backend.fill_bitmasks([reqs[i].grammar for i in walking], host, [i * per_req + j for i in walking])
            if j == per_req - 1:
                break
            still = []
            for i in walking:
                token, matcher = drafts[i][j], reqs[i].grammar
                if _allows(host[i * per_req + j], token) and matcher.accept_token(token):
                    walked[i] += 1
                    if not matcher.is_terminated():
                        still.append(i)
            walking = still
        for i, count in walked.items():
            if count:
                reqs[i].grammar.rollback(count)
        return host.to(self.device, non_blocking=True)

    def accept(self, req: Req, token_id: int) -> bool:
        """Advance ``req``'s matcher past its sampled token; True when the constraint is now complete."""
        matcher = req.grammar
        if matcher is None:
            return False
        if not matcher.accept_token(token_id):
            # Only reachable if the mask was bypassed; end the request rather than emit off-grammar text.
            logger.warning("request %s: token %d is outside its constraint; finishing it", req.rid, token_id)
            return True
        return matcher.is_terminated()

    def release(self, req: Req) -> None:
        req.grammar = None

    def _host_mask(self, rows: int) -> torch.Tensor:
        # Two alternating buffers: a step fills one while the previous copy may still read the other.
        width = bitmask_width(self.vocab_size)
        if not self._host_masks or self._host_masks[0].shape[0] < rows:
            pin = self.device.type == "cuda"
            self._host_masks = [torch.empty((max(rows, 64), width), dtype=torch.int32, pin_memory=pin)
                                for _ in range(2)]
        self._next_host_mask ^= 1
        return self._host_masks[self._next_host_mask][:rows]


def _allows(row: torch.Tensor, token_id: int) -> bool:
    """Whether bitmask ``row`` (host int32) has ``token_id``'s bit set."""
    return 0 <= token_id < 32 * row.numel() and (int(row[token_id >> 5]) >> (token_id & 31)) & 1 == 1


def _tokenizer_key(tokenizer: Any, vocab_size: int) -> str:
    return f"{getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}:{len(tokenizer or ())}:{vocab_size}"
