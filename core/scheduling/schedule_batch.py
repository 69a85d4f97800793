"""ScheduleBatch: the scheduler's view of one step, and its conversion to a device ForwardBatch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.execution.overlap import to_device
from treadle.core.request import Req

if TYPE_CHECKING:
    from treadle.core.execution.overlap import NextInputIds


@dataclass
class BatchEntry:
    """One request's share of a step: compute tokens ``[kv_start, kv_start + extend_len)``."""

    req: Req
    kv_start: int
    extend_len: int
    new_slots: torch.Tensor  # host int64, extend_len slots
    write_from: int  # req_to_token positions rewritten from here (0 when the prefix is new to the row)
    logit_positions: range = field(default_factory=lambda: range(0))  # sequence positions needing logits
    completes_sequence: bool = True  # False for a middle chunk of a chunked prefill: nothing is sampled
    # Decode: the input token is the request's last sampled one, read from the device (it may not
    # have reached the host yet under overlap scheduling).
    input_on_device: bool = False


@dataclass
class ScheduleBatch:
    """The requests of one step and where each one's logits rows are."""

    forward_mode: ForwardMode
    entries: list[BatchEntry]

    @property
    def reqs(self) -> list[Req]:
        return [entry.req for entry in self.entries]

    def last_logit_rows(self) -> list[int]:
        """Row (in the model's logits) of each request's last computed position."""
        rows, offset = [], 0
        for entry in self.entries:
            offset += len(entry.logit_positions)
            rows.append(offset - 1)
        return rows

    def write_req_to_token(self, req_to_token: torch.Tensor) -> None:
        """Record the slots of every (re)written position in the device table, in one scatter."""
        entries = self.entries
        if all(e.write_from == e.kv_start and e.extend_len == 1 for e in entries):  # decode: one slot each
            rows = torch.tensor([e.req.req_pool_idx for e in entries], dtype=torch.int64)
            cols = torch.tensor([e.kv_start for e in entries], dtype=torch.int64)
            slots = torch.cat([e.new_slots for e in entries])
        else:
            spans = [(e, e.kv_start + e.extend_len) for e in entries]
            owner, offset = token_owners([end - e.write_from for e, end in spans])
            rows = torch.tensor([e.req.req_pool_idx for e in entries], dtype=torch.int64)[owner]
            cols = torch.tensor([e.write_from for e in entries], dtype=torch.int64)[owner] + offset
            # Rows written from their first new token take the slots just allocated; reading req.kv_slots
            # would join each decode row's slot list into a tensor (~485 of them in a mixed step: ~7 ms).
            slots = torch.cat([e.new_slots if e.write_from == e.kv_start else e.req.kv_slots[e.write_from:end]
                               for e, end in spans])
        device = req_to_token.device
        req_to_token[to_device(rows, device), to_device(cols, device)] = to_device(
            slots.to(req_to_token.dtype), device)

    def to_forward_batch(self, runner, next_input_ids: "NextInputIds") -> ForwardBatch:
        """The device inputs of this step; decode rows take their input token from ``next_input_ids``."""
        device = runner.device
        entries = self.entries
        seq_lens = torch.tensor([e.kv_start + e.extend_len for e in entries], dtype=torch.int64)
        req_pool_indices = torch.tensor([e.req.req_pool_idx for e in entries], dtype=torch.int64)
        req_pool_indices_dev = to_device(req_pool_indices, device)
        out_cache_loc = torch.cat([e.new_slots for e in entries])
        if self.forward_mode.is_decode():
            input_ids_dev = next_input_ids.gather(req_pool_indices_dev)
            positions = seq_lens - 1
            logits_indices = torch.arange(len(entries), dtype=torch.int64)
            extend = {}
        else:
            input_ids_dev = self._extend_input_ids(entries, next_input_ids, device)
            extend_lens = [e.extend_len for e in entries]
            prefix_lens = [e.kv_start for e in entries]
            starts = torch.tensor([0] + extend_lens[:-1], dtype=torch.int64).cumsum(0)
            owner, offset = token_owners(extend_lens)
            prefix = torch.tensor(prefix_lens, dtype=torch.int64)
            positions = prefix[owner] + offset
            logit_counts = [len(e.logit_positions) for e in entries]
            logit_owner, logit_offset = token_owners(logit_counts)
            # Row of a logit position p of entry i: starts[i] + p - kv_start[i].
            first_logit = torch.tensor([e.logit_positions.start for e in entries], dtype=torch.int64)
            logits_indices = (starts - prefix + first_logit)[logit_owner] + logit_offset
            extend = dict(
                extend_seq_lens=to_device(torch.tensor(extend_lens, dtype=torch.int64), device),
                extend_prefix_lens=to_device(torch.tensor(prefix_lens, dtype=torch.int64), device),
                extend_start_loc=to_device(starts, device),
                extend_seq_lens_cpu=extend_lens,
                extend_prefix_lens_cpu=prefix_lens,
            )
        return ForwardBatch(
            forward_mode=self.forward_mode,
            batch_size=len(entries),
            input_ids=input_ids_dev,
            positions=to_device(positions, device),
            req_pool_indices=req_pool_indices_dev,
            seq_lens=to_device(seq_lens, device),
            seq_lens_cpu=seq_lens,
            out_cache_loc=to_device(out_cache_loc, device),
            seq_lens_sum=int(seq_lens.sum()),
            logits_indices=to_device(logits_indices, device),
            req_to_token_pool=runner.req_to_token_pool,
            kv_cache=runner.kv_cache,
            attn_backend=runner.attn_backend,
            **extend,
        )

    @staticmethod
    def _extend_input_ids(entries: list[BatchEntry], next_input_ids: "NextInputIds",
                          device: torch.device) -> torch.Tensor:
        """Prompt tokens from the host; the decode rows of a mixed batch from the device buffer."""
        ids: list[int] = []
        fed_at: list[int] = []
        fed_rows: list[int] = []
        for e in entries:
            if e.input_on_device:
                fed_at.append(len(ids))
                fed_rows.append(e.req.req_pool_idx)
                ids.append(0)
            else:
                ids.extend(e.req.all_ids[e.kv_start:e.kv_start + e.extend_len])
        input_ids = to_device(torch.tensor(ids, dtype=torch.int64), device)
        if fed_at:
            rows = to_device(torch.tensor(fed_rows, dtype=torch.int64), device)
            input_ids.index_copy_(0, to_device(torch.tensor(fed_at, dtype=torch.int64), device),
                                  next_input_ids.gather(rows))
        return input_ids


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
