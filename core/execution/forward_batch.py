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
    """What kind of step a batch is.

    Every mode but DECODE (and IDLE) is *extend-shaped*: each request carries ``extend_seq_lens[i]`` new tokens
    that attend causally to its prefix and to each other, and the ``extend_*`` fields are set. A backend that
    handles extend batches therefore runs a TARGET_VERIFY or DRAFT_EXTEND step eagerly as it is.
    """

    EXTEND = 1  # prefill new tokens after a (possibly cached) prefix
    DECODE = 2  # one new token per request
    MIXED = 3  # prefill chunks and decodes in one extend-shaped batch
    IDLE = 4  # nothing to run
    # Speculative decoding: the target model checks k draft tokens of every request in one step, each request
    # carrying the same ``tokens_per_req`` = k + 1 new tokens (its last accepted token, then the drafts), every
    # one of which produces logits.
    TARGET_VERIFY = 5
    DRAFT_EXTEND = 6  # an extend-shaped step of a draft model (the tokens the target just accepted)

    def is_extend(self) -> bool:
        """Extend-shaped: new tokens after a prefix, the ``extend_*`` fields set (every mode but DECODE, IDLE)."""
        return self in _EXTEND_SHAPED

    def is_decode(self) -> bool:
        """One new token per request (the ``extend_*`` fields are None)."""
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_verify(self) -> bool:
        """A TARGET_VERIFY step: ``tokens_per_req`` new tokens per request, every one with logits."""
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_cuda_graph(self) -> bool:
        """The same number of new tokens per request (DECODE: 1, TARGET_VERIFY: ``tokens_per_req``): a shape that
        CUDA graphs captured per ``(batch size, tokens_per_req)`` can replay."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


_EXTEND_SHAPED = frozenset(
    (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND))


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
    decode and verify step) means every row.

    ``tokens_per_req`` is how many new tokens every request carries in a step where they all carry the same
    number: 1 in DECODE, k + 1 in TARGET_VERIFY (where the extend fields say it too). In other extend-shaped
    steps the counts are ``extend_seq_lens`` and it stays 1.
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
    tokens_per_req: int = 1  # new tokens of every request (DECODE: 1, TARGET_VERIFY: k + 1)
    # What the layers may read during this step (adapter per token, per-request values; see batch_context.py).
    batch_context: "BatchContext | None" = None
    # A step with image or video requests: M-RoPE positions and the rows that take vision-encoder outputs
    # (core/multimodal/inputs.py); None otherwise.
    multimodal: Any = None
    # A TARGET_VERIFY step over draft trees (speculative.topk > 1): [bs, t, t] bool, True where new token b is new
    # token a or one of its ancestors (what a attends to among the step's tokens, besides the whole prefix; its
    # position is kv_start + depth). None: the new tokens attend causally. Backends that read it say
    # ``supports_tree_mask``.
    tree_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
