"""A draft model's memory: one request-table row and a list of KV slots per request it drafts for.

The draft keeps no prefix cache: a request's draft KV is computed from its first token and lives until the
request leaves the running batch (``DraftMemory.release``). Slots are only ever added (a position keeps its
slot while the request lives), so a rejected draft's slot is simply overwritten by the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from treadle.core.config import ModelConfig, validate_config
from treadle.core.execution.overlap import to_device
from treadle.core.memory.pools import KVCache

if TYPE_CHECKING:
    from treadle.core.execution.worker import WorkerInfo
    from treadle.core.request import Req
    from treadle.core.resolved_config import ResolvedConfig

GiB = 1024**3
# Device memory the draft needs besides its weights and KV pool (its request table, CUDA graphs, activations).
DRAFT_SLACK_BYTES = GiB


@dataclass
class DraftSequence:
    """One request as the draft model knows it.

    ``slots[q]`` is the draft KV slot of position ``q``; positions ``[0, seen)`` hold the K/V of the request's
    real tokens. A proposal made at position ``proposed_at`` (the request's last sampled token) wrote the K/V
    of its first ``proposed - 1`` drafts after it; until the target has verified them (``settle``) they count
    as seen. ``drafts_at`` is where the drafts kept in the speculator's device buffer were proposed.
    """

    row: int
    slots: list[int] = field(default_factory=list)
    seen: int = 0
    proposed_at: int = -1
    proposed: int = 0
    drafts_at: int = -1

    def settle(self, kv_start: int) -> None:
        """The request's last sampled token is now at ``kv_start``: a proposal made before it was verified,
        keeping ``kv_start - proposed_at - 1`` drafts, whose K/V stays valid (up to the drafts the draft model
        itself computed K/V for)."""
        if 0 <= self.proposed_at < kv_start:
            accepted = kv_start - self.proposed_at - 1
            self.seen = min(self.seen, self.proposed_at + 1 + min(accepted, self.proposed - 1))
            self.proposed_at = -1


class DraftMemory:
    """The draft model's request-table rows and KV slots, per request (keyed by request id)."""

    def __init__(self, info: "WorkerInfo") -> None:
        self.allocator = info.allocator
        self.req_to_token_pool = info.req_to_token_pool
        self.sequences: dict[str, DraftSequence] = {}

    def sequence(self, req: "Req") -> DraftSequence | None:
        """``req``'s draft state, created (with a request-table row) on first use; None when no row is free."""
        seq = self.sequences.get(req.rid)
        if seq is None:
            row = self.req_to_token_pool.alloc()
            if row is None:
                return None
            seq = self.sequences[req.rid] = DraftSequence(row)
        return seq

    def reserve(self, seqs: list[DraftSequence | None], lengths: list[int]) -> list[bool]:
        """Give each sequence a slot for every position below ``lengths[i]``; False for a sequence that got none
        (the pool is short: it sits this step out) or is None. New slots go into the request table in one
        scatter."""
        short = [(i, seq, length - len(seq.slots)) for i, (seq, length) in enumerate(zip(seqs, lengths))
                 if seq is not None and length > len(seq.slots)]
        ok = [seq is not None for seq in seqs]
        if not short:
            return ok
        slots = self._alloc(short)
        if slots is None:  # short of memory: one at a time, as far as it goes
            for i, seq, count in short:
                got = self._alloc([(i, seq, count)])
                if got is None:
                    ok[i] = False
                else:
                    self._append(got, [(i, seq, count)])
            return ok
        self._append(slots, short)
        return ok

    def release(self, req: "Req") -> None:
        """Free ``req``'s row and slots (it finished, was aborted or retracted)."""
        seq = self.sequences.pop(req.rid, None)
        if seq is None:
            return
        if seq.slots:
            self.allocator.free(torch.tensor(seq.slots, dtype=torch.int64))
        self.req_to_token_pool.free(seq.row)

    def _alloc(self, short: list[tuple[int, DraftSequence, int]]) -> torch.Tensor | None:
        paged = self.allocator.page_size > 1
        return self.allocator.alloc_extend(
            [len(seq.slots) for _, seq, _ in short], [count for _, _, count in short],
            [seq.slots[-1] if paged and seq.slots else -1 for _, seq, _ in short])

    def _append(self, slots: torch.Tensor, short: list[tuple[int, DraftSequence, int]]) -> None:
        rows, cols = [], []
        for _, seq, count in short:
            rows.extend([seq.row] * count)
            cols.extend(range(len(seq.slots), len(seq.slots) + count))
        new = slots.tolist()
        start = 0
        for _, seq, count in short:
            seq.slots.extend(new[start:start + count])
            start += count
        table = self.req_to_token_pool.req_to_token
        device = table.device
        table[to_device(torch.tensor(rows, dtype=torch.int64), device),
              to_device(torch.tensor(cols, dtype=torch.int64), device)] = to_device(slots.to(table.dtype), device)


# ---------------------------------------------------------------------- sizing


def draft_kv_tokens(target: "WorkerInfo", num_draft_tokens: int, draft_path: str | None = None,
                    mem_fraction: float = 0.85) -> int:
    """The draft's KV pool in tokens: every running request's tokens at most (the target's pool, or every row at
    full context if that is less) plus the drafts each computes past its last token. On CUDA, at most what the
    device has left after the target for the draft's weights (their size on disk) and its KV; a request that
    finds the pool short drafts nothing that step (the target decodes it alone)."""
    rows = target.max_running_requests + 1
    wanted = min(target.max_total_tokens, rows * target.context_len) + rows * (num_draft_tokens + 1)
    if target.device.type != "cuda" or draft_path is None:
        return wanted
    from treadle.core.loading.model_loader import read_hf_config, resolve_model_path
    from treadle.layers.decoder import head_dim, num_kv_heads

    folder = resolve_model_path(ModelConfig(path=draft_path))
    hf = read_hf_config(folder)
    per_token = KVCache.bytes_per_token(hf.num_hidden_layers, num_kv_heads(hf), head_dim(hf), target.dtype)
    weights = sum(file.stat().st_size for file in Path(folder).glob("*.safetensors")) or _weight_bytes_of(hf)
    free, _ = torch.cuda.mem_get_info(target.device)
    fits = int((free - weights - DRAFT_SLACK_BYTES) // per_token)
    if fits < rows * (num_draft_tokens + 1):
        raise RuntimeError(
            f"no GPU memory left for the draft model {draft_path} ({weights / GiB:.1f} GiB of weights) and its KV "
            f"pool after the target's: {free / GiB:.1f} GiB free; lower cache.mem_fraction (now {mem_fraction}) "
            f"to leave room (docs/speculative.md, 'Memory')")
    return min(wanted, fits)


def _weight_bytes_of(hf: Any) -> int:
    """A Llama-shaped model's 16-bit weight bytes from its config (dummy weights: no files to measure)."""
    hidden, inter = hf.hidden_size, getattr(hf, "intermediate_size", 4 * hf.hidden_size)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter
    return 2 * (hf.num_hidden_layers * per_layer + 2 * hf.vocab_size * hidden)


def draft_server_config(config: "ResolvedConfig", target: "WorkerInfo", draft_path: str, kv_tokens: int,
                        spare_rows: int = 0) -> Any:
    """The draft model's ServerConfig: the target's, with the draft's folder, its own KV pool (``kv_tokens``
    slots, page size 1), the target's context length, dtype, device and running limit (plus ``spare_rows``
    request-table rows: a draft tree's scratch rows), decode graphs up to the largest verify batch (times
    ``speculative.topk``: a tree's levels decode that many rows per request)."""
    values = config.model_dump()
    values["model"] = {"path": draft_path, "dtype": config.model.dtype, "device": config.model.device,
                       "seed": config.model.seed, "context_length": target.context_len,
                       # A benchmark of the machinery drafts with dummy weights beside a dummy target.
                       "load_format": "dummy" if config.model.load_format == "dummy" else "auto"}
    values["cache"] = {"kv_allocator": "token", "page_size": 1, "disable_radix_cache": True,
                       "max_total_tokens": kv_tokens, "mem_fraction": config.cache.mem_fraction,
                       "kv_dtype": "fp8_e4m3" if config.cache.kv_dtype == "fp8_e4m3" else "auto"}
    # The draft decodes only verify batches: no larger than speculative.max_batch_size.
    values["runtime"]["cuda_graph_max_bs"] = max(1, min(config.runtime.cuda_graph_max_bs,
                                                        config.speculative.max_batch_size * config.speculative.topk))
    values["scheduler"]["max_running_requests"] = config.scheduler.max_running_requests + spare_rows
    values.pop("speculative", None)
    values.pop("lora", None)  # the draft serves no adapters (and the resolved section has keys a config refuses)
    return validate_config(values)
