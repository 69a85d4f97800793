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
lengths are upper bounds (every draft of N kept), which only backends reading the device's use. A catch-up too
large for the backend's decode-kernel route of verify steps (``verifies_by_decode``; N may have had more tokens
than the batch after it) runs in groups of requests that fit it.
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
    hidden, logits = _catch_up(speculator, batch, req_pool_indices)
    token = speculator.draft_to_target[argmax_last_dim(logits)]
    tokens = [token]
    if num_drafts < 2:
        return token.unsqueeze(1)
    bounds = np.asarray([e.kv_start for e in batch.entries], dtype=np.int64)  # host upper bounds of L
    on_cpu = speculator.device.type == "cpu"
    # Every decode step's positions, lengths and slots (already in the request table) at once, a step a row
    # ([n - 1, bs]: each step's rows contiguous, as kernels read them).
    at = positions.unsqueeze(0) + _layout(speculator, 1, num_drafts - 1)[0].view(-1, 1)
    seq_lens = at + 1
    slots = speculator.target.info.req_to_token_pool.req_to_token[req_pool_indices.unsqueeze(0), at].to(torch.int64)
    for j in range(1, num_drafts):
        step = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=len(bounds), input_ids=token, positions=at[j - 1],
            req_pool_indices=req_pool_indices, seq_lens=seq_lens[j - 1],
            # On the CPU the device's lengths are the host's.
            seq_lens_cpu=seq_lens[j - 1] if on_cpu else torch.from_numpy(bounds + j),
            out_cache_loc=slots[j - 1], seq_lens_sum=int(bounds.sum()) + j * len(bounds),
            logits_indices=speculator.rows_arange(len(bounds)),
            req_to_token_pool=speculator.target.info.req_to_token_pool, kv_cache=speculator.kv_cache,
            attn_backend=speculator.attn_backend)
        hidden, logits = speculator.run_head(step, hidden)
        token = speculator.draft_to_target[argmax_last_dim(logits)]
        tokens.append(token)
    return torch.stack(tokens, dim=1)


def _catch_up(speculator: "Eagle3Speculator", batch: "ScheduleBatch",
              req_pool_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's output hidden state and logits at each request's pair ``L - 1``, after computing the pairs at the
    previous verify step's positions (module docstring)."""
    previous: "LaunchedStep" = batch.follows
    fb = previous.forward_batch
    t, bs, device = fb.tokens_per_req, len(batch.entries), speculator.device
    follow = np.asarray(batch.follow_rows, dtype=np.int64)
    first, accepted = fb.extend_prefix_lens, previous.accepted
    drafts, slots = previous.draft_ids, fb.out_cache_loc.view(fb.batch_size, t)
    if not batch.follows_every_row():
        follow_dev = to_device_packed([follow], device)[0]
        first, accepted = first.index_select(0, follow_dev), accepted.index_select(0, follow_dev)
        drafts, slots = drafts.index_select(0, follow_dev), slots.index_select(0, follow_dev)
    offsets = _layout(speculator, 1, t)[0]
    # The token after position first + j: N's draft j while it was kept, then the target's own token.
    next_ids = speculator.target.next_input_ids.gather(req_pool_indices).unsqueeze(1)
    input_ids = torch.where(offsets < accepted.unsqueeze(1), torch.cat([drafts.to(torch.int64), next_ids], dim=1),
                            next_ids)
    features = speculator.pending.index_select(0, req_pool_indices)[:, :t]
    bound = fb.seq_lens_cpu.numpy()[follow]
    group = _group_size(speculator, bs, t)
    parts = []
    for begin in range(0, bs, group):
        rows = slice(begin, min(bs, begin + group))
        catch_up, last_rows = _catch_up_batch(speculator, input_ids[rows], first[rows], accepted[rows],
                                              slots[rows], req_pool_indices[rows], bound[rows])
        parts.append(speculator.run_head(catch_up, features[rows].reshape(-1, features.shape[-1]), last_rows))
    if len(parts) == 1:
        return parts[0]
    return torch.cat([hidden for hidden, _ in parts]), torch.cat([logits for _, logits in parts])


def _catch_up_batch(speculator: "Eagle3Speculator", input_ids: torch.Tensor, first: torch.Tensor,
                    accepted: torch.Tensor, slots: torch.Tensor, req_pool_indices: torch.Tensor,
                    bound: np.ndarray) -> tuple[ForwardBatch, torch.Tensor]:
    """The TARGET_VERIFY-shaped step of ``len(first)`` requests over the previous step's ``t`` positions from
    ``first`` (``bound``: the host's upper bounds of its lengths), and each request's valid last row."""
    bs, t = input_ids.shape
    offsets, starts, lens, logits_indices = _layout(speculator, bs, t)
    seq_lens = first + t
    catch_up = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=input_ids.flatten(),
        positions=(first.unsqueeze(1) + offsets).flatten(), req_pool_indices=req_pool_indices, seq_lens=seq_lens,
        seq_lens_cpu=seq_lens if speculator.device.type == "cpu" else torch.from_numpy(bound),
        out_cache_loc=slots.flatten(), seq_lens_sum=int(bound.sum()), logits_indices=logits_indices,
        req_to_token_pool=speculator.target.info.req_to_token_pool, kv_cache=speculator.kv_cache,
        attn_backend=speculator.attn_backend, extend_seq_lens=lens, extend_prefix_lens=first,
        extend_start_loc=starts, extend_seq_lens_cpu=[t] * bs, extend_prefix_lens_cpu=None, tokens_per_req=t)
    return catch_up, starts + accepted  # the row of position first + accepted = L - 1


def _layout(speculator: "Eagle3Speculator", bs: int, t: int) -> list[torch.Tensor]:
    """``(offsets [1, t], starts, extend lengths, logits rows)`` of a catch-up of ``bs`` requests: copied once."""
    layout = speculator.catch_up_layouts.get((bs, t))
    if layout is None:
        layout = speculator.catch_up_layouts[(bs, t)] = to_device_packed(
            [np.arange(t, dtype=np.int64)[None, :], np.arange(bs, dtype=np.int64) * t,
             np.full(bs, t, dtype=np.int64), np.arange(bs * t, dtype=np.int64)], speculator.device)
    return layout


def _group_size(speculator: "Eagle3Speculator", bs: int, t: int) -> int:
    """Requests per catch-up step: all of them where the backend runs them from device lengths (the CPU, or up to
    its decode-kernel route's token count), else as many as fit that route."""
    backend = speculator.attn_backend
    if speculator.device.type == "cpu":
        return bs
    group = bs
    while group > 1 and not backend.verifies_by_decode(ForwardMode.TARGET_VERIFY, group * t):
        group -= 1
    return group
