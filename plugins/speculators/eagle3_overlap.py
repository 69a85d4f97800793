"""The EAGLE-3 head's drafts for an overlapped verify batch (``Speculator.propose_on_device``), from device state alone.

The batch follows a verify step N of draft chains that the host has not read: request ``i`` kept ``a_i`` of N's
drafts (``LaunchedStep.accepted``, on the device), so its last sampled token sits at ``L_i = P_i + a_i + 1`` where
``P_i`` is N's first position. The head's pairs at N's positions ``P_i .. P_i + a_i`` are computed in one
TARGET_VERIFY-shaped step of N's ``t`` tokens per request (so a backend that reads a verify step's lengths on the
device runs it, and CUDA graphs capture it): the features wait in the pending buffer (``after_target_forward``),
the token after position ``P_i + j`` is N's draft ``j`` for ``j < a_i`` and the target's next token for
``j = a_i``, and the KV goes to N's own slots. Rows past ``a_i`` are computed too and discarded: they attend only
after the valid rows (causally) and write to N's rejected slots, which reading N gives back. The valid last row's
output gives the first draft; ``n - 1`` decode steps at ``L_i .. L_i + n - 2`` give the rest, their KV in the
slots the host gave the new batch (already in the request table). No length or position visits the host: its
lengths are upper bounds (every draft of N kept), which only backends reading the device's use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.execution.overlap import to_device_packed
from treadle.core.execution.sampler import argmax_last_dim

if TYPE_CHECKING:
    from treadle.core.execution.overlap import LaunchedStep
    from treadle.core.scheduling.schedule_batch import ScheduleBatch
    from treadle.plugins.speculators.eagle3 import Eagle3Speculator


def propose_chains_on_device(speculator: "Eagle3Speculator", batch: "ScheduleBatch", num_drafts: int,
                             positions: torch.Tensor, req_pool_indices: torch.Tensor) -> torch.Tensor:
    """``[bs, num_drafts]`` greedy drafts of an overlapped verify batch (module docstring); ``positions``: each
    request's last sampled token's position ``L``, ``req_pool_indices`` its request-table row."""
    previous: "LaunchedStep" = batch.follows
    catch_up, last_rows = _catch_up_batch(speculator, batch, previous, positions, req_pool_indices)
    pending = speculator.pending.index_select(0, req_pool_indices)[:, :catch_up.tokens_per_req]
    hidden, logits = speculator.run_head(catch_up, pending.reshape(-1, pending.shape[-1]), last_rows)
    token = speculator.draft_to_target[argmax_last_dim(logits)]
    tokens = [token]
    bounds = np.asarray([e.kv_start for e in batch.entries], dtype=np.int64)  # host upper bounds of L
    on_cpu = speculator.device.type == "cpu"
    req_to_token = speculator.target.info.req_to_token_pool.req_to_token
    for j in range(1, num_drafts):
        at = positions + (j - 1)
        seq_lens = at + 1
        step = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(bounds), input_ids=token, positions=at,
            req_pool_indices=req_pool_indices, seq_lens=seq_lens,
            seq_lens_cpu=seq_lens if on_cpu else torch.from_numpy(bounds + j),  # on the CPU the device's are the host's
            out_cache_loc=req_to_token[req_pool_indices, at].to(torch.int64),
            seq_lens_sum=int(bounds.sum()) + j * len(bounds), logits_indices=speculator.rows_arange(len(bounds)),
            req_to_token_pool=speculator.target.info.req_to_token_pool, kv_cache=speculator.kv_cache,
            attn_backend=speculator.attn_backend)
        hidden, logits = speculator.run_head(step, hidden)
        token = speculator.draft_to_target[argmax_last_dim(logits)]
        tokens.append(token)
    return torch.stack(tokens, dim=1)


def _catch_up_batch(speculator: "Eagle3Speculator", batch: "ScheduleBatch", previous: "LaunchedStep",
                    positions: torch.Tensor, req_pool_indices: torch.Tensor) -> tuple[ForwardBatch, torch.Tensor]:
    """The TARGET_VERIFY-shaped step over N's positions (module docstring) and each request's valid last row."""
    fb = previous.forward_batch
    t, bs, device = fb.tokens_per_req, len(batch.entries), speculator.device
    follow = np.asarray(batch.follow_rows, dtype=np.int64)
    identity = len(follow) == fb.batch_size and bool((follow == np.arange(len(follow))).all())
    layout = speculator.catch_up_layouts.get((bs, t))
    if layout is None:  # the same for every step of this shape: copied once
        layout = speculator.catch_up_layouts[(bs, t)] = to_device_packed(
            [np.arange(t, dtype=np.int64)[None, :], np.arange(bs, dtype=np.int64) * t,
             np.full(bs, t, dtype=np.int64), np.arange(bs * t, dtype=np.int64)], device)
    offsets, starts, lens, logits_indices = layout
    first, accepted = fb.extend_prefix_lens, previous.accepted
    drafts, slots = previous.draft_ids, fb.out_cache_loc.view(fb.batch_size, t)
    if not identity:
        follow_dev = to_device_packed([follow], device)[0]
        first, accepted = first.index_select(0, follow_dev), accepted.index_select(0, follow_dev)
        drafts, slots = drafts.index_select(0, follow_dev), slots.index_select(0, follow_dev)
    # The token after position first + j: N's draft j while it was kept, then the target's own token.
    next_ids = speculator.target.next_input_ids.gather(req_pool_indices).unsqueeze(1)
    kept = offsets < accepted.unsqueeze(1)
    padded = torch.cat([drafts.to(torch.int64), next_ids], dim=1)
    input_ids = torch.where(kept, padded, next_ids).flatten()
    bound = fb.seq_lens_cpu.numpy()[follow]
    seq_lens = first + t
    catch_up = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=input_ids,
        positions=(first.unsqueeze(1) + offsets).flatten(), req_pool_indices=req_pool_indices, seq_lens=seq_lens,
        seq_lens_cpu=seq_lens if device.type == "cpu" else torch.from_numpy(bound),
        out_cache_loc=slots.flatten(), seq_lens_sum=int(bound.sum()), logits_indices=logits_indices,
        req_to_token_pool=speculator.target.info.req_to_token_pool, kv_cache=speculator.kv_cache,
        attn_backend=speculator.attn_backend, extend_seq_lens=lens, extend_prefix_lens=first,
        extend_start_loc=starts, extend_seq_lens_cpu=[t] * bs, extend_prefix_lens_cpu=None, tokens_per_req=t)
    return catch_up, starts + accepted  # the row of position first + a = L - 1

