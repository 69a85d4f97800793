"""The attention backend interface and the RadixAttention layer models use."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from treadle.core.execution.attention_context import AttentionContext
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from treadle.core.execution.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def head_layout(context: AttentionContext, backend_name: str) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_dim)`` of the model; raises unless query heads group evenly over KV heads."""
    num_heads, num_kv_heads = int(context.num_heads), int(context.num_kv_heads)
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{backend_name} attention needs num_heads ({num_heads}) to be a multiple of num_kv_heads ({num_kv_heads})"
        )
    return num_heads, num_kv_heads, int(context.head_dim)


class AttentionBackend(ABC):
    """Computes attention over the paged KV cache for one ForwardBatch.

    A backend is built by its registered factory as ``factory(context)``, ``context`` an
    :class:`~treadle.core.execution.attention_context.AttentionContext`: ``device``, ``dtype``, ``kv_dtype``,
    ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``page_size``, ``req_to_token_pool``,
    ``kv_cache``, ``sliding_window`` (the window every layer shares; None: full attention, or layers that
    differ), ``layer_sliding_windows`` (each layer's) and ``context_len`` (the attribute names a backend
    written for the old ``factory(model_runner)`` form read; other runner attributes still resolve, with a
    DeprecationWarning).

    Modes: DECODE batches go to ``forward_decode``; every extend-shaped mode (EXTEND, MIXED, TARGET_VERIFY,
    DRAFT_EXTEND: ``ForwardMode.is_extend()``) to ``forward_extend``. A TARGET_VERIFY batch is an extend whose
    requests all carry ``forward_batch.tokens_per_req`` new tokens, each producing logits.

    q is ``[num_tokens, num_heads * head_dim]``; k, v are
    ``[num_tokens, num_kv_heads * head_dim]``; the result has q's shape.
    With ``save_kv_cache`` the backend writes k, v at ``out_cache_loc`` first; without it the caller
    has written them already (the piecewise prefill graphs do it inside a captured piece), and a
    backend may read this step's K/V back from the cache.
    """

    supports_cuda_graph: bool = False
    # Whether TARGET_VERIFY steps may be captured too: the capture hook is then also called with
    # ``mode=TARGET_VERIFY`` and ``num_tokens = bs * tokens_per_req``, the replay hook with ``num_tokens=`` the same.
    supports_verify_cuda_graph: bool = False
    # Whether TARGET_VERIFY steps over draft trees run here (speculative.topk > 1): such a step's new tokens attend
    # to the whole prefix and to ``forward_batch.tree_mask`` (their ancestors and themselves) instead of causally.
    # With ``supports_verify_cuda_graph`` too, the capture and replay hooks of tree verify steps get the keyword
    # ``tree_mask=``: the graph's static ``[bs, t, t]`` uint8 mask (holding the step's at replay, before the hook).
    supports_tree_mask: bool = False

    @classmethod
    def auto_priority(cls, device: torch.device) -> int | None:
        """Where this backend ranks when ``attention.backend`` is ``auto`` on ``device``: the registered
        backends are built from the highest priority down until one accepts the model; None: never chosen
        automatically there."""
        return None

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Prepare per-step metadata before the layers run (no host-device sync)."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate what captured graphs will point at, once, before any capture: up to ``max_bs`` requests and
        ``max_num_tokens`` new tokens per step (``max_bs`` when only decode is captured)."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, mode: ForwardMode
    ) -> None:
        raise NotImplementedError

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        mode: ForwardMode,
        seq_lens_cpu: torch.Tensor | None = None,
        num_tokens: int | None = None,
    ) -> None:
        """Point the captured graph of ``bs`` at this step's lengths (no host-device sync). ``num_tokens``
        is passed (as a keyword) for TARGET_VERIFY replays only: ``bs * tokens_per_req``."""
        raise NotImplementedError

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def applies_rotary(self, forward_batch: ForwardBatch) -> bool:
        """Whether this backend applies the rotary embedding itself for ``forward_batch``: the model then passes q
        and k *before* it, with ``rotary=(cos, sin)`` (``[num_tokens, 1, head_dim]`` each, HF's ``rotate_half``
        layout, in q's dtype), and the backend rotates them as it reads them (one kernel per layer less). Such a
        backend's ``forward_decode``/``forward_extend`` take ``rotary`` as a keyword. Default False: q and k
        arrive rotated."""
        return False

    def verifies_by_decode(self, mode: ForwardMode, num_tokens: int) -> bool:
        """Whether a TARGET_VERIFY step of draft chains with ``num_tokens`` new tokens in all runs from the lengths on
        the device alone (``seq_lens``, ``extend_prefix_lens``): the host's ``seq_lens_cpu`` and ``seq_lens_sum`` may
        then be upper bounds and ``extend_prefix_lens_cpu`` None, as in an overlapped verify step
        (``speculative.overlap``). The answer depends on ``mode`` and ``num_tokens`` alone (a CUDA graph captured at a
        size replays the route it was captured with) and is False for other modes. A backend answering True for the
        smallest verify step (:func:`joins_overlapped_verify`) may join overlapped verify; each step is then overlapped
        only where its own token count gets True. Default False: never (on the CPU every backend joins)."""
        return False

    def decodes_by_device_lengths(self) -> bool:
        """Whether every DECODE step runs from the lengths on the device alone (``seq_lens``): the host's
        ``seq_lens_cpu`` and ``seq_lens_sum`` may then be upper bounds, as in the head's decode steps ``eagle3`` drafts
        with on the device for an overlapped verify step (it drafts there only on a backend that joins overlapped
        verify and answers True here). Default: whether the backend joins overlapped verify
        (:func:`joins_overlapped_verify`; one that reads a verify step's lengths on the device reads a decode step's
        there too); a backend that plans some decode batches from the host's lengths answers False."""
        return joins_overlapped_verify(self)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        # Backends that never apply the rotary embedding never see the keyword.
        extra = {} if rotary is None else {"rotary": rotary}
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **extra)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **extra)

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor: ...


AUTO_BACKEND = "auto"
SMALLEST_VERIFY_TOKENS = 2  # one request, one draft


def joins_overlapped_verify(backend: AttentionBackend) -> bool:
    """Whether ``backend`` may take overlapped verify steps off the CPU: it runs the smallest verify step from the
    lengths on the device (:meth:`AttentionBackend.verifies_by_decode`)."""
    return bool(backend.verifies_by_decode(ForwardMode.TARGET_VERIFY, SMALLEST_VERIFY_TOKENS))


def model_sliding_windows(model: nn.Module) -> tuple[int | None, ...]:
    """Each :class:`RadixAttention` layer's sliding window (None: full attention), in module order."""
    return tuple(m.sliding_window_size or None for m in model.modules() if isinstance(m, RadixAttention))


def build_attention_backend(registry: Any, name: str,
                            model_runner: "ModelRunner | AttentionContext") -> tuple[AttentionBackend, str]:
    """``(backend, its registered name)`` for ``attention.backend`` = ``name``, built from the runner's
    :class:`AttentionContext`. ``auto``: the registered backends that rank themselves on the device
    (``AttentionBackend.auto_priority``), highest first; one whose constructor refuses the model (a missing
    package, an unsupported dtype or window) is skipped, with its reason logged."""
    context = model_runner if isinstance(model_runner, AttentionContext) else AttentionContext.of(model_runner)
    if name != AUTO_BACKEND:
        return registry.get("attention", name)(context), name
    device = context.device
    ranked = []
    for candidate in registry.names("attention"):
        rank = getattr(registry.get("attention", candidate), "auto_priority", None)
        priority = rank(device) if callable(rank) else None
        if priority is not None:
            ranked.append((-priority, candidate))
    refusals = []
    for _, candidate in sorted(ranked):
        try:
            backend = registry.get("attention", candidate)(context)
        except Exception as exc:  # any refusal: the next candidate may accept the model
            refusals.append(f"{candidate}: {exc}")
            logger.info("attention.backend auto: skipped %s (%s)", candidate, exc)
            continue
        return backend, candidate
    raise RuntimeError(
        f"attention.backend auto found no backend for this model on {device}"
        + (": " + "; ".join(refusals) if refusals else " (no registered backend ranks itself there)")
        + "; set attention.backend to a registered backend"
    )


class RadixAttention(nn.Module):
    """An attention layer whose math is done by the batch's attention backend.

    ``sliding_window_size``: a query at position i sees keys at positions
    ``i - sliding_window_size < j <= i`` (HF's definition); None means full causal.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        sliding_window_size: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.num_kv_heads = num_kv_heads
        self.layer_id = layer_id
        self.sliding_window_size = sliding_window_size if sliding_window_size and sliding_window_size > 0 else None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention of q over the cache and this step's k, v. ``rotary=(cos, sin)``: q and k are not rotated yet and
        the backend applies the embedding (only where ``attn_backend.applies_rotary(forward_batch)``)."""
        if rotary is None:
            return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, rotary=rotary)
