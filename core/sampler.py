"""Batched sampling: temperature, top-k, top-p, min-p, penalties, per-request seeds, log-probabilities.

Every request draws its noise from a counter-based hash of (seed, output
position, token id), so a seeded request samples the same tokens whatever
batch it shares a step with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treadle.core.request import Req

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    """Per-request sampling parameters as device tensors for one step."""

    temperatures: torch.Tensor  # [bs, 1] float32 (greedy rows hold 1.0)
    greedy: torch.Tensor  # [bs] bool
    top_ps: torch.Tensor  # [bs]
    top_ks: torch.Tensor  # [bs] int64 (vocab size when off)
    min_ps: torch.Tensor  # [bs]
    seeds: torch.Tensor  # [bs] int64
    steps: torch.Tensor  # [bs] int64: how many tokens the request has produced
    all_greedy: bool
    need_top_p: bool
    need_top_k: bool
    need_min_p: bool
    penalties: "PenaltyBatch | None"
    return_logprob: bool
    top_logprobs_num: int

    @classmethod
    def from_reqs(cls, reqs: list[Req], vocab_size: int, device: torch.device) -> "SamplingBatch":
        params = [req.sampling_params for req in reqs]
        greedy = [p.is_greedy for p in params]
        top_ks = [vocab_size if (p.top_k < 1 or p.top_k > vocab_size) else p.top_k for p in params]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperatures=tensor([[1.0 if g else p.temperature] for p, g in zip(params, greedy)], torch.float32),
            greedy=tensor(greedy, torch.bool),
            top_ps=tensor([p.top_p for p in params], torch.float32),
            top_ks=tensor(top_ks, torch.int64),
            min_ps=tensor([p.min_p for p in params], torch.float32),
            seeds=tensor([req.sample_seed for req in reqs], torch.int64),
            steps=tensor([len(req.output_ids) for req in reqs], torch.int64),
            all_greedy=all(greedy),
            need_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
            need_top_k=any(k < vocab_size and not g for k, g in zip(top_ks, greedy)),
            need_min_p=any(p.min_p > 0 and not g for p, g in zip(params, greedy)),
            penalties=PenaltyBatch.from_reqs(reqs, vocab_size, device),
            return_logprob=any(req.return_logprob for req in reqs),
            top_logprobs_num=max((req.top_logprobs_num for req in reqs), default=0),
        )


@dataclass
class PenaltyBatch:
    """Token counts and penalty strengths; None when no request in the batch uses penalties."""

    output_counts: torch.Tensor  # [bs, vocab] float32
    seen_in_sequence: torch.Tensor  # [bs, vocab] bool (prompt + output), for the repetition penalty
    repetition: torch.Tensor  # [bs, 1]
    frequency: torch.Tensor  # [bs, 1]
    presence: torch.Tensor  # [bs, 1]

    @classmethod
    def from_reqs(cls, reqs: list[Req], vocab_size: int, device: torch.device) -> "PenaltyBatch | None":
        if not any(req.sampling_params.has_penalties for req in reqs):
            return None
        bs = len(reqs)
        output_counts = torch.zeros((bs, vocab_size), dtype=torch.float32, device=device)
        seen = torch.zeros((bs, vocab_size), dtype=torch.bool, device=device)
        out_ids, out_rows = _flatten([req.output_ids for req in reqs])
        if out_ids:
            rows = torch.tensor(out_rows, device=device)
            ids = torch.tensor(out_ids, device=device)
            output_counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        rep_ids, rep_rows = _flatten(
            [req.all_ids if req.sampling_params.repetition_penalty != 1.0 else [] for req in reqs]
        )
        if rep_ids:
            seen[torch.tensor(rep_rows, device=device), torch.tensor(rep_ids, device=device)] = True
        params = [req.sampling_params for req in reqs]
        column = lambda values: torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)  # noqa: E731
        return cls(
            output_counts=output_counts,
            seen_in_sequence=seen,
            repetition=column([p.repetition_penalty for p in params]),
            frequency=column([p.frequency_penalty for p in params]),
            presence=column([p.presence_penalty for p in params]),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # Repetition penalty (CTRL): shrink positive logits, grow negative ones, of seen tokens.
        penalized = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(self.seen_in_sequence, penalized, logits)
        logits = logits - self.frequency * self.output_counts
        return logits - self.presence * (self.output_counts > 0).float()


@dataclass
class SampleResult:
    next_token_ids: torch.Tensor  # [bs] int64
    logprobs: torch.Tensor | None  # [bs] log-prob of the chosen token (raw distribution)
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None  # (values, ids) [bs, k]


class Sampler:
    """Turns last-token logits into next tokens for a batch, with no per-token Python work."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
        raw_logits = logits
        if batch.penalties is not None:
            logits = batch.penalties.apply(logits)
        if batch.all_greedy:
            next_ids = torch.argmax(logits, dim=-1)
        else:
            next_ids = self._sample(logits, batch)
        logprobs = top = None
        if batch.return_logprob:
            log_probs = torch.log_softmax(raw_logits.float(), dim=-1)
            logprobs = log_probs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            if batch.top_logprobs_num > 0:
                top = torch.topk(log_probs, batch.top_logprobs_num, dim=-1)
                top = (top.values, top.indices)
        return SampleResult(next_ids, logprobs, top)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
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
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p (normalization not needed).
        noise = exponential_noise(batch.seeds, batch.steps, probs.shape[-1])
        sampled = torch.argmax(probs / noise, dim=-1)
        return torch.where(batch.greedy, torch.argmax(logits, dim=-1), sampled)


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


def _flatten(lists: list[list[int]]) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    rows: list[int] = []
    for row, values in enumerate(lists):
        ids.extend(values)
        rows.extend([row] * len(values))
    return ids, rows
