"""Batched sampling: temperature, top-k, top-p, min-p, penalties, logit bias, per-request seeds, log-probabilities.

Every request draws its noise from a counter-based hash of (seed, output
position, token id), so a seeded request samples the same tokens whatever
batch it shares a step with, and whether its tokens come one per step or
several per step (a verify step samples ``tokens_per_req`` positions per
request, position j as the request's output position ``len(output_ids) + j``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treadle.core.grammar import apply_vocab_mask
from treadle.core.request import Req

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    """Per-request sampling parameters as device tensors for one step.

    An all-greedy batch carries no tensors at all (argmax needs none). Otherwise the
    parameters travel in two host-to-device copies (one float, one int64 table).
    Penalties are built by the Sampler from its :class:`PenaltyPool` (token counts
    kept on the device across steps) for ``penalty_reqs``. Requests' ``logit_bias`` entries
    travel as one sparse (rows, token ids, biases) triple, greedy batches included.

    With ``tokens_per_req`` t > 1 (a verify step) the rows are every position of every request, request i's
    at ``i * t + j``; its parameters repeat per position and ``steps`` counts on. Penalties then count the tokens
    produced before the step (not the drafts before position j).
    """

    temperatures: torch.Tensor | None  # [bs, 1] float32 (greedy rows hold 1.0)
    greedy: torch.Tensor | None  # [bs] bool
    top_ps: torch.Tensor | None  # [bs]
    top_ks: torch.Tensor | None  # [bs] int64 (vocab size when off)
    min_ps: torch.Tensor | None  # [bs]
    seeds: torch.Tensor | None  # [bs] int64
    steps: torch.Tensor | None  # [bs] int64: how many tokens the request has produced
    all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    penalties: "PenaltyBatch | None"
    return_logprob: bool
    top_logprobs_num: int
    penalty_reqs: list[Req] | None = None  # the batch's requests, when any of them uses penalties
    logit_bias: "LogitBias | None" = None
    tokens_per_req: int = 1  # rows per request (a verify step's k + 1)

    @classmethod
    def from_reqs(cls, reqs: list[Req], vocab_size: int, device: torch.device,
                  tokens_per_req: int = 1) -> "SamplingBatch":
        params = [req.sampling_params for req in reqs]
        all_greedy = all(p.is_greedy for p in params)
        penalty_reqs = reqs if any(p.has_penalties for p in params) else None
        return_logprob = any(req.return_logprob for req in reqs)
        top_logprobs_num = max((req.top_logprobs_num for req in reqs), default=0)
        logit_bias = LogitBias.from_reqs(reqs, device, tokens_per_req)
        if all_greedy:
            return cls(None, None, None, None, None, None, None, True, False, False, False, None,
                       return_logprob, top_logprobs_num, penalty_reqs, logit_bias, tokens_per_req)
        floats, ints = [], []
        need_top_p = need_top_k = need_min_p = False
        for req, p in zip(reqs, params):
            greedy = p.is_greedy
            top_k = vocab_size if (p.top_k < 1 or p.top_k > vocab_size) else p.top_k
            floats.append((1.0 if greedy else p.temperature, p.top_p, p.min_p))
            ints.append((top_k, req.sample_seed, len(req.output_ids), greedy))
            if not greedy:
                need_top_p |= p.top_p < 1.0
                need_top_k |= top_k < vocab_size
                need_min_p |= p.min_p > 0
        float_host, int_host = torch.tensor(floats, dtype=torch.float32), torch.tensor(ints, dtype=torch.int64)
        if tokens_per_req > 1:
            float_host, int_host = _per_position(float_host, int_host, tokens_per_req)
        float_table = _to_device(float_host, device)
        int_table = _to_device(int_host, device)
        return cls(
            temperatures=float_table[:, 0:1],
            greedy=int_table[:, 3].bool(),
            top_ps=float_table[:, 1],
            top_ks=int_table[:, 0],
            min_ps=float_table[:, 2],
            seeds=int_table[:, 1],
            steps=int_table[:, 2],
            all_greedy=False,
            need_top_p=need_top_p,
            need_top_k=need_top_k,
            need_min_p=need_min_p,
            penalties=None,
            return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
            penalty_reqs=penalty_reqs,
            logit_bias=logit_bias,
            tokens_per_req=tokens_per_req,
        )


def _per_position(floats: torch.Tensor, ints: torch.Tensor, tokens_per_req: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's row repeated for its ``tokens_per_req`` positions, the output step (column 2) counting on."""
    floats = floats.repeat_interleave(tokens_per_req, dim=0)
    ints = ints.repeat_interleave(tokens_per_req, dim=0)
    ints[:, 2] += torch.arange(tokens_per_req).repeat(ints.shape[0] // tokens_per_req)
    return floats, ints


@dataclass
class LogitBias:
    """The ``logit_bias`` entries of one step's rows: ``logits[rows[i], token_ids[i]] += biases[i]``."""

    rows: torch.Tensor  # [entries] int64
    token_ids: torch.Tensor  # [entries] int64
    biases: torch.Tensor  # [entries] float32

    @classmethod
    def from_reqs(cls, reqs: list[Req], device: torch.device, tokens_per_req: int = 1) -> "LogitBias | None":
        """The entries of the rows whose requests have a ``logit_bias`` (None when none has), from each request's
        ``logit_bias_table``: two host-to-device copies for the whole batch. With ``tokens_per_req`` t, request
        i's entries apply to each of its rows ``i * t .. i * t + t - 1``."""
        biased = [(row, req.logit_bias_table) for row, req in enumerate(reqs) if req.logit_bias_table is not None]
        if not biased:
            return None
        token_ids = torch.cat([ids for _, (ids, _) in biased])
        rows = torch.repeat_interleave(torch.tensor([row for row, _ in biased]),
                                       torch.tensor([len(ids) for _, (ids, _) in biased]))
        biases = torch.cat([values for _, (_, values) in biased])
        if tokens_per_req > 1:
            rows = (rows[None, :] * tokens_per_req + torch.arange(tokens_per_req)[:, None]).flatten()
            token_ids, biases = token_ids.repeat(tokens_per_req), biases.repeat(tokens_per_req)
        index_table = _to_device(torch.stack([rows, token_ids]), device)
        return cls(index_table[0], index_table[1], _to_device(biases, device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of ``logits`` with the biases added (``logits`` itself is left as it was: the raw
        distribution gives the log-probabilities)."""
        return logits.float().index_put((self.rows, self.token_ids), self.biases, accumulate=True)


@dataclass
class PenaltyBatch:
    """Token counts and penalty strengths of one step's rows."""

    output_counts: torch.Tensor  # [bs, vocab] float32
    seen_in_sequence: torch.Tensor  # [bs, vocab] bool (prompt + output), for the repetition penalty
    repetition: torch.Tensor  # [bs, 1]
    frequency: torch.Tensor  # [bs, 1]
    presence: torch.Tensor  # [bs, 1]

    def per_position(self, tokens_per_req: int) -> "PenaltyBatch":
        """Each row repeated for a request's ``tokens_per_req`` positions (a verify step)."""
        return PenaltyBatch(*(t.repeat_interleave(tokens_per_req, dim=0) for t in (
            self.output_counts, self.seen_in_sequence, self.repetition, self.frequency, self.presence)))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # Repetition penalty (CTRL): shrink positive logits, grow negative ones, of seen tokens.
        penalized = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(self.seen_in_sequence, penalized, logits)
        logits = logits - self.frequency * self.output_counts
        return logits - self.presence * (self.output_counts > 0).float()


class PenaltyPool:
    """Per-request output-token counts and seen-token flags kept on the device between steps.

    Row ``req.req_pool_idx + 1`` belongs to the request while it runs; a step adds only the
    tokens produced since the last one (one scatter for the whole batch). A row is
    rebuilt from the request's host token lists when it changed owner (a new request,
    or a retracted one that came back on another row). Allocated on first use.
    """

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts = torch.zeros((0, vocab_size), dtype=torch.float32, device=self.device)
        self.seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=self.device)
        self._owners: dict[int, tuple[str, int]] = {}  # row -> (rid, output tokens counted)

    def batch(self, reqs: list[Req]) -> PenaltyBatch:
        # Pool row = req_pool_idx + 1. Row 0 stays zero: it serves a request already finished while
        # its last step was in flight (overlap scheduling), whose token is discarded anyway.
        rows = [req.req_pool_idx + 1 if req.req_pool_idx is not None else 0 for req in reqs]
        self._grow(max(rows) + 1)
        reset_rows: list[int] = []
        count_rows: list[int] = []
        count_ids: list[int] = []
        seen_rows: list[int] = []
        seen_ids: list[int] = []
        for row, req in zip(rows, reqs):
            if row == 0:
                continue
            owner = self._owners.get(row)
            counted = owner[1] if owner is not None and owner[0] == req.rid else -1
            if counted < 0 or counted > len(req.output_ids):
                reset_rows.append(row)
                counted = 0
                if req.sampling_params.repetition_penalty != 1.0:
                    seen_rows.extend([row] * len(req.origin_input_ids))
                    seen_ids.extend(req.origin_input_ids)
            new = req.output_ids[counted:]
            if new:
                count_rows.extend([row] * len(new))
                count_ids.extend(new)
                if req.sampling_params.repetition_penalty != 1.0:
                    seen_rows.extend([row] * len(new))
                    seen_ids.extend(new)
            self._owners[row] = (req.rid, len(req.output_ids))
        if reset_rows:
            index = self._ids(reset_rows)
            self.counts.index_fill_(0, index, 0.0)
            self.seen.index_fill_(0, index, False)
        if count_ids:
            r, i = self._ids(count_rows), self._ids(count_ids)
            self.counts.index_put_((r, i), torch.ones_like(i, dtype=torch.float32), accumulate=True)
        if seen_ids:
            r, i = self._ids(seen_rows), self._ids(seen_ids)
            self.seen.index_put_((r, i), torch.ones_like(i, dtype=torch.bool))
        index = self._ids(rows)
        strengths = torch.tensor(
            [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
             for p in (req.sampling_params for req in reqs)], dtype=torch.float32)
        strengths = _to_device(strengths, self.device)
        return PenaltyBatch(
            output_counts=self.counts.index_select(0, index),
            seen_in_sequence=self.seen.index_select(0, index),
            repetition=strengths[:, 0:1],
            frequency=strengths[:, 1:2],
            presence=strengths[:, 2:3],
        )

    def _ids(self, values: list[int]) -> torch.Tensor:
        return _to_device(torch.tensor(values, dtype=torch.int64), self.device)

    def _grow(self, rows: int) -> None:
        if rows <= self.counts.shape[0]:
            return
        rows = max(rows, 2 * self.counts.shape[0])
        counts = torch.zeros((rows, self.vocab_size), dtype=torch.float32, device=self.device)
        seen = torch.zeros((rows, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[: self.counts.shape[0]] = self.counts
        seen[: self.seen.shape[0]] = self.seen
        self.counts, self.seen = counts, seen


@dataclass
class SampleResult:
    next_token_ids: torch.Tensor  # [bs] int64
    logprobs: torch.Tensor | None  # [bs] log-prob of the chosen token (raw distribution)
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None  # (values, ids) [bs, k]
    accepted: torch.Tensor | None = None  # a verify step with draft distributions: drafts kept per request [bs]


class Sampler:
    """Turns last-token logits into next tokens for a batch, with no per-token Python work.

    Holds the PenaltyPool (device-resident token counts) of the scheduler that owns it.
    """

    def __init__(self) -> None:
        self.penalty_pool: PenaltyPool | None = None

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, vocab_mask: torch.Tensor | None = None,
                 draft_ids: torch.Tensor | None = None, draft_probs: torch.Tensor | None = None) -> SampleResult:
        """``logits``: ``[bs * batch.tokens_per_req, vocab]``, float32 or 16-bit (widened here wherever
        probabilities are computed).

        ``vocab_mask``: an int32 bitmask ``[bs, ceil(vocab / 32)]`` of allowed tokens (constrained decoding).
        ``draft_ids`` ``[bs, k]`` and ``draft_probs`` ``[bs, k, vocab]``: a verify step whose drafts were sampled
        from known distributions, decided by rejection sampling (:func:`rejection_sample`; greedy rows keep the
        drafts equal to their argmax); the result then carries ``accepted``.
        """
        raw_logits = logits
        if vocab_mask is not None:
            logits = apply_vocab_mask(logits, vocab_mask)
        penalties = batch.penalties
        if penalties is None and batch.penalty_reqs:
            if self.penalty_pool is None or self.penalty_pool.device != logits.device:
                self.penalty_pool = PenaltyPool(logits.shape[-1], logits.device)
            penalties = self.penalty_pool.batch(batch.penalty_reqs)
            if batch.tokens_per_req > 1:
                penalties = penalties.per_position(batch.tokens_per_req)
        if penalties is not None:
            logits = penalties.apply(logits.float())
        if batch.logit_bias is not None:
            logits = batch.logit_bias.apply(logits)
        accepted = None
        if batch.all_greedy:
            # No float32 copy: widening a 16-bit logit is exact, so its argmax is the same token.
            next_ids = argmax_last_dim(logits)
        elif draft_probs is not None:
            next_ids, accepted = self._verify(logits.float(), batch, draft_ids, draft_probs)
        else:
            next_ids = self._sample(logits.float(), batch)
        logprobs = top = None
        if batch.return_logprob:
            log_probs = torch.log_softmax(raw_logits.float(), dim=-1)
            logprobs = log_probs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            if batch.top_logprobs_num > 0:
                top = torch.topk(log_probs, batch.top_logprobs_num, dim=-1)
                top = (top.values, top.indices)
        return SampleResult(next_ids, logprobs, top, accepted)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = self._filtered_probs(logits, batch)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p (normalization not needed).
        noise = exponential_noise(batch.seeds, batch.steps, probs.shape[-1])
        sampled = argmax_last_dim(probs / noise)
        return torch.where(batch.greedy, argmax_last_dim(logits), sampled)

    def _verify(self, logits: torch.Tensor, batch: SamplingBatch, draft_ids: torch.Tensor,
                draft_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        token_ids, accepted = rejection_sample(self._filtered_probs(logits, batch), draft_ids, draft_probs,
                                               batch.seeds, batch.steps)
        bs, t = token_ids.shape
        greedy_rows = batch.greedy.view(bs, t)[:, 0]
        greedy_ids = argmax_last_dim(logits).view(bs, t)
        token_ids = torch.where(greedy_rows.unsqueeze(1), greedy_ids, token_ids)
        accepted = torch.where(greedy_rows, accepted_draft_counts(draft_ids, greedy_ids), accepted)
        return token_ids.view(-1), accepted

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Each row's distribution after temperature, top-k, top-p and min-p (not renormalized)."""
        probs = torch.softmax(logits / batch.temperatures, dim=-1)
        if batch.need_top_k or batch.need_top_p:
            sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True)
            ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
            drop = ranks >= batch.top_ks.unsqueeze(1)
            if batch.need_top_p:
                mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
                drop |= mass_before > batch.top_ps.unsqueeze(1)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, sorted_ids, sorted_probs)
        if batch.need_min_p:
            threshold = probs.max(dim=-1, keepdim=True).values * batch.min_ps.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs


def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row is sampled from: after temperature, top-k, top-p and min-p (not renormalized).
    A draft model that samples its drafts the way the target samples (plugins/speculators) uses it."""
    return Sampler._filtered_probs(logits, batch)


def accepted_draft_counts(draft_ids: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """How many of each request's drafts ``[bs, k]`` the target kept: the leading ones equal to the target's own
    tokens ``[bs, k + 1]`` at the same positions (so ``token_ids[i, count]`` is the request's next token).

    Exact for drafts without distributions under sampling too (:func:`rejection_sample`'s docstring)."""
    matches = draft_ids.to(token_ids.dtype) == token_ids[:, :-1]
    return matches.to(torch.int64).cumprod(dim=1).sum(dim=1)


def rejection_sample(probs: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor, seeds: torch.Tensor,
                     steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_ids [bs, k + 1], accepted [bs])`` of a verify step whose drafts were sampled from known
    distributions (a draft model).

    For each request, draft ``d_j`` (drawn from ``q_j``) is kept with probability ``min(1, p_j(d_j) / q_j(d_j))``,
    where ``p_j`` is the target's distribution at position ``j`` after temperature, top-k, top-p and min-p (what plain
    decoding samples from). At the first rejection the token is drawn from the residual ``max(0, p_j - q_j)``
    normalized; when every draft is kept, the next token is drawn from ``p_k``. The output then has the target's
    distribution exactly, whatever ``q`` is (Leviathan et al., Chen et al., 2023).

    Drafts without distributions (``q`` one-hot: a lookup, a greedy draft) need none of this: keeping ``d_j`` when the
    target's own seeded sample at ``j`` equals it happens with probability ``p_j(d_j)``, and a sample that differs
    is distributed as ``p_j`` without ``d_j``, which is the residual. That is the worker's
    path (:func:`accepted_draft_counts`), and it gives a seeded request the very tokens plain decoding gives it.

    The uniforms and the residual's sample are drawn from the counter-based noise of the sampler (seed, output
    position), so a seeded request samples the same tokens whatever batch it is in. Nothing here leaves the device.

    ``probs`` ``[bs * (k + 1), vocab]``: the target's filtered distributions (need not be normalized), request
    ``i``'s position ``j`` at row ``i * (k + 1) + j``; ``draft_ids`` ``[bs, k]``; ``draft_probs`` ``[bs, k, vocab]``;
    ``seeds``/``steps`` ``[bs * (k + 1)]``: each row's seed and output position. ``token_ids[i, :accepted[i]]`` are
    the kept drafts and ``token_ids[i, accepted[i]]`` the token drawn after them.
    """
    bs, k = draft_ids.shape
    t, vocab = k + 1, probs.shape[-1]
    p = probs / probs.sum(dim=-1, keepdim=True)
    p = p.view(bs, t, vocab)
    q = draft_probs.float()
    ids = draft_ids.to(torch.int64).unsqueeze(-1)
    p_draft = p[:, :k].gather(2, ids).squeeze(-1)
    q_draft = q.gather(2, ids).squeeze(-1)
    first_rows = seeds.view(bs, t)[:, :k].reshape(-1)
    uniform = torch.exp(-exponential_noise(first_rows ^ _ACCEPT_SALT, steps.view(bs, t)[:, :k].reshape(-1), 1))
    keep = uniform.view(bs, k) * q_draft < p_draft  # probability min(1, p / q)
    accepted = keep.to(torch.int64).cumprod(dim=1).sum(dim=1)
    residual = torch.cat([(p[:, :k] - q).clamp_min(0.0), p[:, k:]], dim=1)
    # p == q at a position leaves no residual; a rejection cannot happen there, any row will do.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    noise = exponential_noise(seeds, steps, vocab).view(bs, t, vocab)
    drawn = argmax_last_dim((residual / noise).view(bs * t, vocab)).view(bs, t)
    drafts_then_drawn = torch.cat([draft_ids.to(torch.int64), drawn[:, k:]], dim=1)
    positions = torch.arange(t, device=probs.device).unsqueeze(0)
    token_ids = torch.where(positions < accepted.unsqueeze(1), drafts_then_drawn, drawn)
    return token_ids, accepted


# Mixed into a request's seed for its acceptance uniforms, so they are independent of the same position's
# sampling noise.
_ACCEPT_SALT = 0x5BD1E995

_ARGMAX_GROUPS = (256, 128, 64)


def argmax_last_dim(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` of a ``[rows, vocab]`` tensor, the same index (the lowest among equal maxima, a
    NaN counting as the maximum). On a GPU one Triton launch (kernels/argmax.py); elsewhere two passes where the
    vocabulary splits into groups of 64-256: each group's max, then the best group. One argmax over a 128k
    vocabulary ran as a single 30 µs reduction per decode step on an H100, the two passes as five launches
    (docs/lab/benchmarks-history.md)."""
    rows, vocab = x.shape
    if x.is_cuda and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32):
        from treadle.kernels.argmax import argmax_rows

        return argmax_rows(x)
    group = next((g for g in _ARGMAX_GROUPS if vocab % g == 0 and vocab >= 16 * g), None)
    if group is None or not x.is_contiguous():
        return torch.argmax(x, dim=-1)
    values, within = x.view(rows, vocab // group, group).max(dim=-1)
    best = values.argmax(dim=-1, keepdim=True)
    return (best * group + within.gather(1, best)).squeeze(1)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise ``[bs, vocab]`` that depends only on (seed, step, token id)."""
    row = (seeds * 0x9E3779B1 + steps * 0x85EBCA77 + 0x165667B1) & _MASK32
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    h = (row.unsqueeze(1) + ids.unsqueeze(0) * 0xC2B2AE3D) & _MASK32
    # A 32-bit integer finalizer (murmur3-style); products wrap in int64 but the low 32 bits are exact.
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _MASK32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & _MASK32
    h = h ^ (h >> 16)
    uniform = (h.to(torch.float64) + 0.5) / 4294967296.0
    return (-torch.log(uniform)).to(torch.float32)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One asynchronous host-to-device copy (from pinned memory on CUDA)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
