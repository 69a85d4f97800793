"""The device inputs of one step: a ForwardBatch built from the scheduler's ScheduleBatch.

The schedule batch says, per request, which positions ``[kv_start, kv_start + extend_len)`` are computed, at
which new KV slots, and which positions want logits. Token ids come from the host (prompt tokens), from the
device buffer of last sampled tokens (``input_on_device``: under overlap scheduling a decode row's token may not
have reached the host yet) or, in a TARGET_VERIFY step, from the draft tokens the caller hands over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.execution.overlap import to_device, to_device_packed
from treadle.core.multimodal.inputs import build_multimodal_batch, has_multimodal, shift_positions

if TYPE_CHECKING:
    from treadle.core.execution.attention import AttentionBackend
    from treadle.core.execution.attention_context import AttentionContext
    from treadle.core.execution.overlap import NextInputIds
    from treadle.core.scheduling.schedule_batch import BatchEntry, ScheduleBatch
    from treadle.core.speculative.tree import TreeLayout


def build_forward_batch(batch: "ScheduleBatch", context: "AttentionContext", attn_backend: "AttentionBackend",
                        next_input_ids: "NextInputIds", draft_ids: torch.Tensor | None = None,
                        tree: "TreeLayout | None" = None,
                        propose_drafts: "Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None" = None,
                        ) -> ForwardBatch:
    """The device inputs of ``batch``. Decode rows take their input token from ``next_input_ids``; a
    TARGET_VERIFY batch (every entry ``extend_len = k + 1`` tokens, ``input_on_device``) takes its first token
    per request from there and the other ``k`` from ``draft_ids`` (``[bs, k]`` on the device). ``tree``: the
    drafts form trees (core/speculative/tree.py): each token sits at ``kv_start + depth`` under a tree mask. A
    TARGET_VERIFY batch's new slots are written into the request table here too, from the same host copy. An
    overlapped one (``batch.follows`` set) gets its drafts from ``propose_drafts(positions, req_pool_indices)``
    (:func:`_overlapped_verify_forward_batch`)."""
    device = context.device
    entries = batch.entries
    mode = batch.forward_mode
    if mode.is_verify() and batch.follows is not None:
        if propose_drafts is None:
            raise ValueError("an overlapped TARGET_VERIFY batch needs propose_drafts: its drafts depend on where "
                             "each request's last token sits, known only on the device")
        return _overlapped_verify_forward_batch(batch, context, attn_backend, next_input_ids, propose_drafts)
    if mode.is_verify():
        return _verify_forward_batch(entries, context, attn_backend, next_input_ids, draft_ids, tree)
    seq_lens = torch.tensor([e.kv_start + e.extend_len for e in entries], dtype=torch.int64)
    req_pool_indices = torch.tensor([e.req.req_pool_idx for e in entries], dtype=torch.int64)
    req_pool_indices_dev = to_device(req_pool_indices, device)
    out_cache_loc = torch.cat([e.new_slots for e in entries])
    extra: dict[str, Any] = {}
    multimodal = has_multimodal(entries)
    if mode.is_decode():
        input_ids_dev = next_input_ids.gather(req_pool_indices_dev)
        positions = seq_lens - 1
        if multimodal:
            positions = shift_positions(entries, positions, [1] * len(entries))
        logits_indices = torch.arange(len(entries), dtype=torch.int64)
    else:
        input_ids_dev = _extend_input_ids(entries, next_input_ids, device)
        positions, logits_indices, extra = _extend_positions(entries, device)
        if multimodal:
            positions = shift_positions(entries, positions, extra["extend_seq_lens_cpu"])
            extra["multimodal"] = build_multimodal_batch(entries, positions, device)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(entries),
        input_ids=input_ids_dev,
        positions=to_device(positions, device) if positions.device.type == "cpu" else positions,
        req_pool_indices=req_pool_indices_dev,
        seq_lens=to_device(seq_lens, device),
        seq_lens_cpu=seq_lens,
        out_cache_loc=to_device(out_cache_loc, device),
        seq_lens_sum=int(seq_lens.sum()),
        logits_indices=to_device(logits_indices, device),
        req_to_token_pool=context.req_to_token_pool,
        kv_cache=context.kv_cache,
        attn_backend=attn_backend,
        **extra,
    )


def _extend_positions(entries: list["BatchEntry"], device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Host positions and logits rows of an extend-shaped batch, and its ``extend_*`` fields."""
    extend_lens = [e.extend_len for e in entries]
    prefix_lens = [e.kv_start for e in entries]
    starts = torch.tensor([0] + extend_lens[:-1], dtype=torch.int64).cumsum(0)
    owner, offset = token_owners(extend_lens)
    prefix = torch.tensor(prefix_lens, dtype=torch.int64)
    positions = prefix[owner] + offset
    logit_owner, logit_offset = token_owners([len(e.logit_positions) for e in entries])
    # Row of a logit position p of entry i: starts[i] + p - kv_start[i].
    first_logit = torch.tensor([e.logit_positions.start for e in entries], dtype=torch.int64)
    logits_indices = (starts - prefix + first_logit)[logit_owner] + logit_offset
    return positions, logits_indices, _extend_fields(extend_lens, prefix_lens, starts, device)


def _extend_fields(extend_lens: list[int], prefix_lens: list[int], starts: torch.Tensor,
                   device: torch.device) -> dict[str, Any]:
    return dict(
        extend_seq_lens=to_device(torch.tensor(extend_lens, dtype=torch.int64), device),
        extend_prefix_lens=to_device(torch.tensor(prefix_lens, dtype=torch.int64), device),
        extend_start_loc=to_device(starts, device),
        extend_seq_lens_cpu=extend_lens,
        extend_prefix_lens_cpu=prefix_lens,
    )


def _extend_input_ids(entries: list["BatchEntry"], next_input_ids: "NextInputIds",
                      device: torch.device) -> torch.Tensor:
    """Prompt tokens from the host; the first token of each ``input_on_device`` entry (a mixed batch's decode
    rows) from the device buffer, the rest of such an entry from the host."""
    ids: list[int] = []
    fed_at: list[int] = []
    fed_rows: list[int] = []
    for e in entries:
        if e.input_on_device:
            fed_at.append(len(ids))
            fed_rows.append(e.req.req_pool_idx)
            ids.append(0)
            if e.extend_len > 1:
                ids.extend(e.req.all_ids[e.kv_start + 1:e.kv_start + e.extend_len])
        else:
            ids.extend(e.req.all_ids[e.kv_start:e.kv_start + e.extend_len])
    input_ids = to_device(torch.tensor(ids, dtype=torch.int64), device)
    if fed_at:
        rows = to_device(torch.tensor(fed_rows, dtype=torch.int64), device)
        input_ids.index_copy_(0, to_device(torch.tensor(fed_at, dtype=torch.int64), device),
                              next_input_ids.gather(rows))
    return input_ids


def _verify_forward_batch(entries: list["BatchEntry"], context: "AttentionContext",
                          attn_backend: "AttentionBackend", next_input_ids: "NextInputIds",
                          draft_ids: torch.Tensor | None, tree: "TreeLayout | None") -> ForwardBatch:
    """A TARGET_VERIFY batch's inputs (every entry ``extend_len = t``, ``input_on_device``): its first token per
    request from ``next_input_ids``, the other ``t - 1`` from ``draft_ids``. Its new slots are also written into
    the request table here (``ScheduleBatch.write_req_to_token``'s job for other steps): every host index moves in
    one copy, as this runs between a verify step's results and the next step's launch while the device waits."""
    t = entries[0].extend_len
    if any(e.extend_len != t or not e.input_on_device or e.write_from != e.kv_start for e in entries):
        raise ValueError("a TARGET_VERIFY batch needs the same extend_len (k + 1) for every entry, each with "
                         "input_on_device (its first token is the last one sampled) and write_from = kv_start")
    bs, device = len(entries), context.device
    if draft_ids is None or tuple(draft_ids.shape) != (bs, t - 1):
        shape = None if draft_ids is None else tuple(draft_ids.shape)
        raise ValueError(f"a TARGET_VERIFY batch of {bs} requests with {t} tokens each needs "
                         f"draft_ids of shape ({bs}, {t - 1}), got {shape}")
    prefix_lens = [e.kv_start for e in entries]
    prefix = np.asarray(prefix_lens, dtype=np.int64)
    seq_lens = prefix + t
    rows = np.asarray([e.req.req_pool_idx for e in entries], dtype=np.int64)
    positions_2d = prefix[:, None] + np.arange(t, dtype=np.int64)
    req_to_token = context.req_to_token_pool.req_to_token
    # Chain positions are the table's: each token's flat index in the (contiguous) table, so the slots go in with
    # one index_copy_ (cheaper to launch than a two-index index_put_).
    table_index = (rows[:, None] * req_to_token.shape[1] + positions_2d).reshape(-1)
    new_slots = _new_slots(entries)
    (req_pool_indices, seq_lens_dev, prefix_dev, starts, extend_lens, positions, logits_indices,
     out_cache_loc, table_index) = to_device_packed(
        [rows, seq_lens, prefix, np.arange(bs, dtype=np.int64) * t, np.full(bs, t, dtype=np.int64),
         positions_2d.reshape(-1), np.arange(bs * t, dtype=np.int64), new_slots, table_index], device)
    req_to_token.view(-1).index_copy_(0, table_index, out_cache_loc.to(req_to_token.dtype))
    input_ids = _verify_input_ids(next_input_ids, req_pool_indices, draft_ids)
    tree_mask = None
    if tree is not None:  # each node sits at kv_start + its depth, under the tree mask
        tree_mask = tree.ancestors
        positions = (prefix_dev.unsqueeze(1) + tree.depth).flatten()
    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=input_ids,
        positions=positions, req_pool_indices=req_pool_indices, seq_lens=seq_lens_dev,
        seq_lens_cpu=torch.from_numpy(seq_lens), out_cache_loc=out_cache_loc,
        seq_lens_sum=sum(prefix_lens) + bs * t, logits_indices=logits_indices,
        req_to_token_pool=context.req_to_token_pool, kv_cache=context.kv_cache,
        attn_backend=attn_backend, extend_seq_lens=extend_lens, extend_prefix_lens=prefix_dev,
        extend_start_loc=starts, extend_seq_lens_cpu=[t] * bs, extend_prefix_lens_cpu=prefix_lens,
        tokens_per_req=t, tree_mask=tree_mask,
    )


def _overlapped_verify_forward_batch(batch: "ScheduleBatch", context: "AttentionContext",
                                     attn_backend: "AttentionBackend", next_input_ids: "NextInputIds",
                                     propose_drafts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                                     ) -> ForwardBatch:
    """A TARGET_VERIFY batch queued while the verify step it follows (``batch.follows``) is still in flight: each
    request's last token sits at that step's ``kv_start + accepted + 1``, known only on the device, so its positions,
    lengths, request-table entries (its new slots, one host copy) and drafts are computed there. The host's lengths
    (``seq_lens_cpu``, ``seq_lens_sum``) are upper bounds (every draft of the previous step kept) and its prefix
    lengths are left to the device (``extend_prefix_lens_cpu`` None): only backends that read a verify step's
    lengths on the device take such a batch (``SpeculativeWorker.overlaps_verify``)."""
    entries, previous = batch.entries, batch.follows
    t, bs, device = entries[0].extend_len, len(entries), context.device
    if previous.accepted is None or any(e.extend_len != t for e in entries):
        raise ValueError("an overlapped TARGET_VERIFY batch follows a verify step of draft chains, every entry "
                         "with the same extend_len")
    req_to_token = context.req_to_token_pool.req_to_token
    rows = np.asarray([e.req.req_pool_idx for e in entries], dtype=np.int64)
    follow = np.asarray(batch.follow_rows, dtype=np.int64)
    new_slots = _new_slots(entries)
    # Few kernels on the device (each one adds to the step): what the host knows is packed into the one copy.
    (req_pool_indices, row_starts, follow_dev, offsets, starts, extend_lens, logits_indices,
     out_cache_loc) = to_device_packed(
        [rows, rows[:, None] * req_to_token.shape[1], follow, np.arange(t, dtype=np.int64)[None, :],
         np.arange(bs, dtype=np.int64) * t, np.full(bs, t, dtype=np.int64), np.arange(bs * t, dtype=np.int64),
         new_slots], device)
    kept_end = previous.forward_batch.extend_prefix_lens + previous.accepted  # the last token's position - 1
    if not batch.follows_every_row():
        kept_end = kept_end.index_select(0, follow_dev)
    prefix = kept_end + 1  # where each request's last sampled token sits
    positions_2d = prefix.unsqueeze(1) + offsets
    table_index = (row_starts + positions_2d).flatten()
    req_to_token.view(-1).index_copy_(0, table_index, out_cache_loc.to(req_to_token.dtype))
    draft_ids = propose_drafts(prefix, req_pool_indices)
    input_ids = _verify_input_ids(next_input_ids, req_pool_indices, draft_ids)
    bound = np.asarray([e.kv_start for e in entries], dtype=np.int64) + t  # every previous draft kept
    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=input_ids,
        positions=positions_2d.flatten(), req_pool_indices=req_pool_indices, seq_lens=kept_end + (t + 1),
        seq_lens_cpu=torch.from_numpy(bound), out_cache_loc=out_cache_loc, seq_lens_sum=int(bound.sum()),
        logits_indices=logits_indices, req_to_token_pool=context.req_to_token_pool, kv_cache=context.kv_cache,
        attn_backend=attn_backend, extend_seq_lens=extend_lens, extend_prefix_lens=prefix,
        extend_start_loc=starts, extend_seq_lens_cpu=[t] * bs, extend_prefix_lens_cpu=None, tokens_per_req=t,
    )


def _new_slots(entries: list["BatchEntry"]) -> np.ndarray:
    """The entries' new KV slots end to end (host int64)."""
    if len(entries) == 1:
        return entries[0].new_slots.numpy()
    return np.concatenate([e.new_slots.numpy() for e in entries])


def _verify_input_ids(next_input_ids: "NextInputIds", req_pool_indices: torch.Tensor,
                      draft_ids: torch.Tensor) -> torch.Tensor:
    """A verify step's input ids, request by request: its last sampled token (on the device), then its drafts."""
    first = next_input_ids.gather(req_pool_indices)
    drafts = draft_ids.to(device=first.device, dtype=torch.int64)
    return torch.cat([first.unsqueeze(1), drafts], dim=1).flatten()


def token_owners(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For runs of ``lengths`` laid end to end: each element's run index and its offset inside the run.

    One vectorized pass in numpy: torch's CPU ``searchsorted`` and ``repeat_interleave`` wake OpenMP
    threads at any size, which cost 0.5-2 ms per call on a 16-core GPU host, three times per prefill step.
    """
    counts = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    offset = np.arange(owner.size, dtype=np.int64) - starts[owner]
    return torch.from_numpy(owner), torch.from_numpy(offset)
