"""ScheduleBatch: the scheduler's view of one step, and its conversion to a device ForwardBatch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treadle.core.forward_batch import ForwardBatch, ForwardMode
from treadle.core.request import Req


@dataclass
class BatchEntry:
    """One request's share of a step: compute tokens ``[kv_start, kv_start + extend_len)``."""

    req: Req
    kv_start: int
    extend_len: int
    new_slots: torch.Tensor  # host int64, extend_len slots
    write_from: int  # req_to_token positions rewritten from here (0 when the prefix is new to the row)
    logit_positions: range = field(default_factory=lambda: range(0))  # sequence positions needing logits

    @property
    def completes_sequence(self) -> bool:
        """True unless this is a middle chunk of a chunked prefill."""
        return self.kv_start + self.extend_len == self.req.seq_len


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
            rows = torch.cat([torch.full((end - e.write_from,), e.req.req_pool_idx, dtype=torch.int64)
                              for e, end in spans])
            cols = torch.cat([torch.arange(e.write_from, end, dtype=torch.int64) for e, end in spans])
            slots = torch.cat([e.req.kv_slots[e.write_from:end] for e, end in spans])
        device = req_to_token.device
        req_to_token[rows.to(device), cols.to(device)] = slots.to(device=device, dtype=req_to_token.dtype)

    def to_forward_batch(self, runner) -> ForwardBatch:
        device = runner.device
        entries = self.entries
        seq_lens = torch.tensor([e.kv_start + e.extend_len for e in entries], dtype=torch.int64)
        req_pool_indices = torch.tensor([e.req.req_pool_idx for e in entries], dtype=torch.int64)
        out_cache_loc = torch.cat([e.new_slots for e in entries])
        if self.forward_mode.is_decode():
            input_ids = torch.tensor([e.req.token_at(e.kv_start) for e in entries], dtype=torch.int64)
            positions = seq_lens - 1
            logits_indices = torch.arange(len(entries), dtype=torch.int64)
            extend = {}
        else:
            input_ids = torch.tensor(
                [tok for e in entries for tok in e.req.all_ids[e.kv_start:e.kv_start + e.extend_len]],
                dtype=torch.int64,
            )
            extend_lens = [e.extend_len for e in entries]
            prefix_lens = [e.kv_start for e in entries]
            starts = torch.tensor([0] + extend_lens[:-1], dtype=torch.int64).cumsum(0)
            positions = torch.cat([torch.arange(e.kv_start, e.kv_start + e.extend_len) for e in entries])
            logits_indices = torch.cat([
                torch.arange(p.start, p.stop) - e.kv_start + start
                for e, p, start in zip(entries, (e.logit_positions for e in entries), starts.tolist())
            ])
            extend = dict(
                extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int64).to(device, non_blocking=True),
                extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64).to(device, non_blocking=True),
                extend_start_loc=starts.to(device, non_blocking=True),
                extend_seq_lens_cpu=extend_lens,
                extend_prefix_lens_cpu=prefix_lens,
            )
        return ForwardBatch(
            forward_mode=self.forward_mode,
            batch_size=len(entries),
            input_ids=input_ids.to(device, non_blocking=True),
            positions=positions.to(device, non_blocking=True),
            req_pool_indices=req_pool_indices.to(device, non_blocking=True),
            seq_lens=seq_lens.to(device, non_blocking=True),
            seq_lens_cpu=seq_lens,
            out_cache_loc=out_cache_loc.to(device, non_blocking=True),
            seq_lens_sum=int(seq_lens.sum()),
            logits_indices=logits_indices.to(device, non_blocking=True),
            req_to_token_pool=runner.req_to_token_pool,
            kv_cache=runner.kv_cache,
            attn_backend=runner.attn_backend,
            **extend,
        )
