"""ForwardMode and ForwardBatch: one model step's inputs, on the device."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from treadle.core.execution.attention import AttentionBackend
    from treadle.core.execution.batch_context import BatchContext
    from treadle.core.memory.pools import KVCache, ReqToTokenPool


class ForwardMode(IntEnum):
    """What kind of step a batch is."""

    EXTEND = 1  # prefill new tokens after a (possibly cached) prefix
    DECODE = 2  # one new token per request
    MIXED = 3  # prefill chunks and decodes in one extend-shaped batch
    IDLE = 4  # nothing to run

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """Inputs of one forward pass.

    Tokens of all requests are flattened: request ``i`` owns tokens
    ``extend_start_loc[i] : extend_start_loc[i] + extend_seq_lens[i]`` (decode:
    exactly token ``i``). ``seq_lens`` count every token whose KV exists after
    this step (prefix + new). ``out_cache_loc`` is where each new token's K/V is
    written. ``logits_indices`` picks the token rows whose logits the model
    returns (the last token of each request, plus input positions that want
    log-probabilities), in increasing order: as many rows as tokens (every
    decode step) means every row.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64
    seq_lens_cpu: torch.Tensor  # [bs] int64, on the host
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    seq_lens_sum: int
    logits_indices: torch.Tensor  # [num_logits] int64
    req_to_token_pool: "ReqToTokenPool"
    kv_cache: "KVCache"
    attn_backend: "AttentionBackend"
    # Extend only (None for decode):
    extend_seq_lens: torch.Tensor | None = None  # [bs]
    extend_prefix_lens: torch.Tensor | None = None  # [bs]
    extend_start_loc: torch.Tensor | None = None  # [bs]
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    # Backend-private metadata, set by init_forward_metadata.
    attn_metadata: Any = None
    # What the layers may read during this step (adapter per token, per-request values; see batch_context.py).
    batch_context: "BatchContext | None" = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
