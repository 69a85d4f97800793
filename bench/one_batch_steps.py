"""Driving a model worker through one static batch: placing its requests, a prefill, greedy decode steps.

``treadle bench one-batch`` times these and its profiler replays them; no scheduler or radix cache is involved:
a step is the model worker's forward (through its CUDA graphs where it captured them) and the greedy pick the
engine's sampler makes (``argmax_last_dim``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from treadle.core.execution.sampler import argmax_last_dim


@dataclass
class PlacedBatch:
    """Requests occupying req_to_token rows 0..bs-1, each on its own contiguous run of pages."""

    rows: torch.Tensor  # [bs] device
    slots: torch.Tensor  # [bs, max_len] device int64


def place_batch(worker: Any, bs: int, max_len: int) -> PlacedBatch:
    """Give ``bs`` requests of up to ``max_len`` tokens rows 0..bs-1 of ``req_to_token`` and contiguous slots."""
    runner = worker.runner
    page = runner.page_size
    span = round_up(max_len, page)
    slots = page + torch.arange(bs)[:, None] * span + torch.arange(max_len)[None, :]
    rows = torch.arange(bs)
    runner.req_to_token_pool.req_to_token[rows[:, None], torch.arange(max_len)[None, :]] = (
        slots.to(device=runner.device, dtype=torch.int32))
    return PlacedBatch(rows.to(runner.device), slots.to(runner.device))


def prefill(worker: Any, batch: PlacedBatch, prompts: torch.Tensor) -> torch.Tensor:
    """Prefill ``prompts`` [bs, length] (no cached prefix) and return each request's greedy next token."""
    from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode

    runner = worker.runner
    bs, length = prompts.shape
    device = runner.device
    lens = torch.full((bs,), length, dtype=torch.int64)
    starts = torch.arange(bs, dtype=torch.int64) * length
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=bs,
        input_ids=prompts.flatten().to(device), positions=torch.arange(length).repeat(bs).to(device),
        req_pool_indices=batch.rows, seq_lens=lens.to(device), seq_lens_cpu=lens,
        out_cache_loc=batch.slots[:, :length].flatten(), seq_lens_sum=bs * length,
        logits_indices=(starts + length - 1).to(device),
        req_to_token_pool=runner.req_to_token_pool, kv_cache=runner.kv_cache, attn_backend=runner.attn_backend,
        extend_seq_lens=lens.to(device), extend_prefix_lens=torch.zeros(bs, dtype=torch.int64, device=device),
        extend_start_loc=starts.to(device), extend_seq_lens_cpu=[length] * bs, extend_prefix_lens_cpu=[0] * bs,
    )
    return argmax_last_dim(worker.forward(forward_batch))


def decode_step(worker: Any, batch: PlacedBatch, next_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One greedy decode step for every request at sequence length ``seq_len`` (this token included)."""
    from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode

    runner = worker.runner
    bs = int(next_ids.shape[0])
    device = runner.device
    seq_lens_cpu = torch.full((bs,), seq_len, dtype=torch.int64)
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=next_ids,
        positions=torch.full((bs,), seq_len - 1, dtype=torch.int64, device=device),
        req_pool_indices=batch.rows, seq_lens=torch.full((bs,), seq_len, dtype=torch.int64, device=device),
        seq_lens_cpu=seq_lens_cpu, out_cache_loc=batch.slots[:, seq_len - 1].contiguous(),
        seq_lens_sum=bs * seq_len, logits_indices=torch.arange(bs, device=device),
        req_to_token_pool=runner.req_to_token_pool, kv_cache=runner.kv_cache, attn_backend=runner.attn_backend,
    )
    return argmax_last_dim(worker.forward(forward_batch))


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
