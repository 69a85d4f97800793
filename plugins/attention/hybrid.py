"""The `flashinfer_triton` attention backend: FlashInfer for prefill and large decode batches, treadle's Triton
decode kernel for small ones.

On an H100 (Llama-3.1-8B shapes, CUDA graphs) the Triton decode step is 3–11% faster from 1 to 32 requests (one
kernel per layer, where FlashInfer's graph decode writes the K/V, decodes and merges split-KV partials in three),
while FlashInfer's kernels are faster at the hundreds of requests of a saturated server or an offline batch
(docs/benchmarks.md). Both backends read and write the same KV cache, so each decode batch can go to either:
``attention.backend: auto`` picks this backend where both are installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from treadle.core.attention import AttentionBackend
from treadle.core.forward_batch import ForwardBatch, ForwardMode
from treadle.core.hookspecs import Register, hookimpl
from treadle.plugins.attention.flashinfer import FlashInferAttnBackend
from treadle.plugins.attention.triton.backend import TritonAttnBackend

if TYPE_CHECKING:
    from treadle.core.attention import RadixAttention


class FlashInferTritonAttnBackend(AttentionBackend):
    """Decode batches of at most ``small_decode_batch`` requests through :class:`TritonAttnBackend`, everything
    else (prefill, mixed, larger decode batches) through :class:`FlashInferAttnBackend`; the route depends on the
    batch size alone, so a CUDA graph captured for a size replays with the backend it was captured with.

    Accepts what both accept (16-bit or FP8 KV caches, one sliding window for every layer). The tunables of the
    two are on ``.small`` and ``.large``; ``small_decode_batch`` must not change once CUDA graphs are captured.
    """

    supports_cuda_graph = True
    # Triton's decode step measured 5-12% faster from 1 to 192 requests on an H100 and even at 256.
    small_decode_batch = 256

    @classmethod
    def auto_priority(cls, device: torch.device) -> int | None:
        return 30 if device.type == "cuda" else None

    def __init__(self, model_runner: Any) -> None:
        self.large = FlashInferAttnBackend(model_runner)
        self.small = TritonAttnBackend(model_runner)
        if self.small.get_cuda_graph_seq_len_fill_value() != self.large.get_cuda_graph_seq_len_fill_value():
            raise ValueError("flashinfer_triton needs both backends to pad CUDA-graph batches with one length")

    def _decode_backend(self, bs: int) -> AttentionBackend:
        return self.small if bs <= self.small_decode_batch else self.large

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.forward_mode.is_decode():
            self._decode_backend(forward_batch.batch_size).init_forward_metadata(forward_batch)
        else:
            self.large.init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.large.init_cuda_graph_state(max_bs, max_num_tokens)
        small = min(max_bs, self.small_decode_batch)
        self.small.init_cuda_graph_state(small, min(max_num_tokens, small))

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, mode: ForwardMode
    ) -> None:
        self._decode_backend(bs).init_forward_metadata_capture_cuda_graph(bs, num_tokens, req_pool_indices,
                                                                          seq_lens, mode)

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        mode: ForwardMode,
        seq_lens_cpu: torch.Tensor | None = None,
    ) -> None:
        self._decode_backend(bs).init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens,
                                                                         seq_lens_sum, mode, seq_lens_cpu)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.large.get_cuda_graph_seq_len_fill_value()

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self._decode_backend(forward_batch.batch_size).forward_decode(q, k, v, layer, forward_batch,
                                                                             save_kv_cache)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self.large.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)


@hookimpl
def treadle_register_attention_backends(register: Register) -> None:
    register("flashinfer_triton", FlashInferTritonAttnBackend)
