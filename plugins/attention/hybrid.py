"""The `flashinfer_triton` attention backend: FlashInfer for prefill and mixed batches, treadle's Triton decode
kernel for decode batches and small verify steps of draft chains.

On an H100 (Llama-3.1-8B shapes, CUDA graphs) the Triton decode step is faster than FlashInfer's at every batch size
measured: 1.09x at one request (one kernel per layer, where FlashInfer's graph decode writes the K/V, decodes and
merges split-KV partials in three) and 1.16x at 384 since its chunks follow the batch size (2026-11-26); the offline
run of 1000 requests made 2% more tokens per second with decode batches of up to 512 on Triton than with those above
256 on FlashInfer (docs/lab/benchmarks-history.md). Both backends read and write the same KV cache, so each decode batch
can go to either: ``attention.backend: auto`` picks this backend where both are installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from treadle.core.execution.attention import AttentionBackend
from treadle.core.execution.attention_context import AttentionContext
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.hookspecs import Register, hookimpl
from treadle.plugins.attention.flashinfer import FlashInferAttnBackend
from treadle.plugins.attention.triton.backend import TritonAttnBackend

if TYPE_CHECKING:
    from treadle.core.execution.attention import RadixAttention


class FlashInferTritonAttnBackend(AttentionBackend):
    """Decode batches through :class:`TritonAttnBackend` (only those of at most ``small_decode_batch`` requests
    where that is set), everything else (prefill, mixed, larger decode batches) through
    :class:`FlashInferAttnBackend`; the route depends on the batch size alone, so a CUDA graph captured for a size
    replays with the backend it was captured with.

    Accepts what both accept (16-bit or FP8 KV caches, one sliding window for every layer). The tunables of the
    two are on ``.small`` and ``.large``; ``small_decode_batch`` must not change once CUDA graphs are captured.
    TARGET_VERIFY steps of at most ``small.verify_decode_max_tokens`` tokens go to the Triton decode kernel
    (:meth:`TritonAttnBackend.verifies_by_decode`: the route depends on the token count alone, so a verify graph
    replays with the backend it was captured with; no FlashInfer plan on the host between a verify step's results
    and the next one's launch); larger ones, extend-shaped, go to FlashInfer as extend steps do.
    """

    supports_cuda_graph = True
    supports_verify_cuda_graph = True
    supports_tree_mask = True  # verify steps (chains or trees) are FlashInfer's
    small_decode_batch: int | None = None

    @classmethod
    def auto_priority(cls, device: torch.device) -> int | None:
        return 30 if device.type == "cuda" else None

    def __init__(self, context: AttentionContext) -> None:
        self.large = FlashInferAttnBackend(context)
        self.small = TritonAttnBackend(context)
        if self.small.get_cuda_graph_seq_len_fill_value() != self.large.get_cuda_graph_seq_len_fill_value():
            raise ValueError("flashinfer_triton needs both backends to pad CUDA-graph batches with one length")

    def _decode_backend(self, bs: int) -> AttentionBackend:
        return self.small if self.small_decode_batch is None or bs <= self.small_decode_batch else self.large

    def _verify_backend(self, num_tokens: int) -> AttentionBackend:
        return self.small if self.small.verifies_by_decode(ForwardMode.TARGET_VERIFY, num_tokens) else self.large

    def verifies_by_decode(self, mode: ForwardMode, num_tokens: int) -> bool:
        """Whether a TARGET_VERIFY chain of ``num_tokens`` tokens goes to the Triton decode kernel (which reads its
        lengths on the device: no plan on the host)."""
        return self.small.verifies_by_decode(mode, num_tokens)

    def decodes_by_device_lengths(self) -> bool:
        """Only while every decode batch goes to the Triton half (``small_decode_batch`` None): FlashInfer plans its
        decode steps from the host's lengths."""
        return self.small_decode_batch is None and self.small.decodes_by_device_lengths()

    def _step_backend(self, forward_batch: ForwardBatch) -> AttentionBackend:
        mode = forward_batch.forward_mode
        if mode.is_decode():
            return self._decode_backend(forward_batch.batch_size)
        if mode.is_verify() and forward_batch.tree_mask is None:  # trees go to FlashInfer's packed custom mask
            return self._verify_backend(forward_batch.num_tokens)
        return self.large

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self._step_backend(forward_batch).init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        small = max_bs if self.small_decode_batch is None else min(max_bs, self.small_decode_batch)
        # The Triton half's scratch also holds a row per token of the verify steps it runs (up to its cap).
        self.small.init_cuda_graph_state(small, max_num_tokens)
        # FlashInfer's graph page table holds max_bs requests at full context (Llama-3.1-8B: 0.5 MB each); it is
        # built when it captures decode batches or, with several tokens per request, verify steps.
        if small < max_bs or max_num_tokens > max_bs:
            self.large.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, mode: ForwardMode,
        tree_mask: torch.Tensor | None = None,
    ) -> None:
        if mode.is_decode():
            backend = self._decode_backend(bs)
        elif tree_mask is not None:
            self.large.init_forward_metadata_capture_cuda_graph(bs, num_tokens, req_pool_indices, seq_lens, mode,
                                                                tree_mask=tree_mask)
            return
        else:
            backend = self._verify_backend(num_tokens)
        backend.init_forward_metadata_capture_cuda_graph(bs, num_tokens, req_pool_indices, seq_lens, mode)

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        mode: ForwardMode,
        seq_lens_cpu: torch.Tensor | None = None,
        num_tokens: int | None = None,
        tree_mask: torch.Tensor | None = None,
    ) -> None:
        if mode.is_decode():
            self._decode_backend(bs).init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens,
                                                                             seq_lens_sum, mode, seq_lens_cpu)
        elif tree_mask is not None:
            self.large.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_sum, mode,
                                                               seq_lens_cpu, num_tokens=num_tokens, tree_mask=tree_mask)
        else:
            self._verify_backend(num_tokens or 0).init_forward_metadata_replay_cuda_graph(
                bs, req_pool_indices, seq_lens, seq_lens_sum, mode, seq_lens_cpu, num_tokens=num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.large.get_cuda_graph_seq_len_fill_value()

    def applies_rotary(self, forward_batch: ForwardBatch) -> bool:
        return forward_batch.forward_mode.is_decode() and self._decode_backend(
            forward_batch.batch_size).applies_rotary(forward_batch)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        backend = self._decode_backend(forward_batch.batch_size)
        if rotary is None:
            return backend.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return backend.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, rotary=rotary)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self._step_backend(forward_batch).forward_extend(q, k, v, layer, forward_batch, save_kv_cache)


@hookimpl
def treadle_register_attention_backends(register: Register) -> None:
    register("flashinfer_triton", FlashInferTritonAttnBackend)
