"""The `flashinfer` attention backend: FlashInfer's paged prefill and decode wrappers.

Registered everywhere (so ``treadle plugins`` lists it); building it without
FlashInfer installed fails with the install hint. FlashInfer and Triton are
imported only when the backend is built.

treadle's KV buffers are ``[num_slots, num_kv_heads, head_dim]`` per layer with
slots ``[0, page_size)`` as padding, so with page size ``P`` they are viewed as
``[num_slots // P, P, num_kv_heads, head_dim]`` pages (FlashInfer's NHD layout)
and page ``0`` is the padding page. Each step's page table (``kv_indptr``,
``kv_indices``, ``last_page_len``) is derived from ``req_to_token``: the page
counts on the host from the host copy of the sequence lengths, the page ids
on the device by a small Triton kernel, so building it never waits on the GPU.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from treadle.core.execution.attention import AttentionBackend, head_layout
from treadle.core.execution.attention_context import AttentionContext
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.hookspecs import Register, hookimpl
from treadle.kernels.tree_mask import pack_tree_mask, tree_mask_bytes

if TYPE_CHECKING:
    from treadle.core.execution.attention import RadixAttention

_SUPPORTED_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
# Split-KV decode keeps partial outputs here: 128 MiB overflowed at 512 running requests (168 MB needed).
_WORKSPACE_BYTES = 512 * 1024 * 1024
# FlashInfer's tensor-core decode (its prefill kernel with one query row) beats the
# CUDA-core decode kernel once each KV head serves this many query heads.
_TENSOR_CORE_MIN_GROUP = 4


class FlashInferAttnBackend(AttentionBackend):
    """Attention through FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (extend, mixed) and
    ``BatchDecodeWithPagedKVCacheWrapper`` (decode, also inside CUDA graphs).

    Supports GQA, a sliding window (``context.sliding_window``, the same for every
    layer), any page size, and float16/bfloat16 KV caches, or FP8 (e4m3) caches with per-layer
    scales under a float16/bfloat16 model (``cache.kv_dtype: fp8_e4m3``). Tunables, plain attributes
    read when a wrapper is first built (the first step, or CUDA-graph capture):
    ``prefill_backend`` (FlashInfer's ``backend`` argument; ``"fa2"`` by default so
    prefill and tensor-core decode share one JIT module) and ``use_tensor_cores``
    (decode through FlashInfer's prefill kernel; default when a KV head serves 4 or
    more query heads). TARGET_VERIFY steps go through the prefill wrapper, and are captured in CUDA graphs
    through a CUDA-graph prefill wrapper per ``(batch size, tokens_per_req)``. A verify step over draft trees
    (``forward_batch.tree_mask``) is planned with a packed custom mask (kernels/tree_mask.py) built on the device at
    plan time; its graphs' wrappers hold a shared mask buffer that each replay's plan fills.
    """

    supports_cuda_graph = True
    supports_verify_cuda_graph = True
    supports_tree_mask = True

    @classmethod
    def auto_priority(cls, device: torch.device) -> int | None:
        # After flashinfer_triton (its large-batch half): the fastest decode at hundreds of requests here.
        return 20 if device.type == "cuda" else None

    def __init__(self, context: AttentionContext) -> None:
        windows = set(getattr(context, "layer_sliding_windows", ()))
        if len(windows) > 1:
            raise ValueError(
                f"the flashinfer backend plans one sliding window for every layer; this model's layers use "
                f"{sorted(windows, key=lambda w: w or 0)} (None: full attention); use attention.backend: triton"
            )
        self._flashinfer = _import_flashinfer()
        self.device = torch.device(context.device)
        if self.device.type != "cuda":
            raise RuntimeError(
                f"the flashinfer attention backend runs on a CUDA device, not '{self.device}'; "
                "use attention.backend: torch_native there"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = head_layout(context, "flashinfer")
        kv_cache = context.kv_cache
        self.kv_dtype: torch.dtype = kv_cache.dtype
        if self.kv_dtype not in _SUPPORTED_KV_DTYPES:
            raise ValueError(
                f"flashinfer attention supports float16, bfloat16 or float8_e4m3fn KV caches, not {self.kv_dtype}; "
                "set model.dtype to bfloat16 or float16, or use attention.backend: triton"
            )
        # Queries stay in the model dtype over an FP8 cache; otherwise they match the cache.
        self.q_dtype: torch.dtype = self.kv_dtype
        if getattr(kv_cache, "is_fp8", False):
            self.q_dtype = context.dtype
            if self.q_dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(
                    f"flashinfer attention over an FP8 KV cache needs a float16 or bfloat16 model, not {self.q_dtype}"
                )
        self.page_size = int(context.page_size)
        self.req_to_token_pool = context.req_to_token_pool
        self.context_len = int(context.context_len)
        window = getattr(context, "sliding_window", None)
        self.sliding_window: int | None = int(window) if window else None
        # HF's window W shows keys i - W < j <= i; FlashInfer's window_left counts keys left of i.
        self.window_left = self.sliding_window - 1 if self.sliding_window else -1
        self.default_scale = 1.0 / math.sqrt(self.head_dim)
        self.use_tensor_cores = self.num_heads // self.num_kv_heads >= _TENSOR_CORE_MIN_GROUP
        self.prefill_backend = "fa2"

        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._prefill_wrapper: Any = None  # built on first use, from the tunables as they are then
        self._decode_wrapper: Any = None
        self._page_table_kernel = _page_table_kernel()
        self._forward_wrapper: Any = None  # the wrapper planned for the current step
        self._forward_decodes = False  # whether that wrapper is a decode one
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_verify_wrappers: dict[tuple[int, int], Any] = {}  # by (batch size, tokens_per_req)
        self._verify_qo_indptrs: dict[tuple[int, int], torch.Tensor] = {}  # pinned host, likewise
        self._graph_qo_indptr: torch.Tensor | None = None
        self._graph_kv_indptr: torch.Tensor | None = None
        self._graph_kv_indices: torch.Tensor | None = None
        self._graph_last_page_len: torch.Tensor | None = None
        self._graph_mask: torch.Tensor | None = None  # tree verify graphs' packed masks (the largest one's size)
        self._graph_mask_indptr: torch.Tensor | None = None

    @property
    def prefill_wrapper(self) -> Any:
        if self._prefill_wrapper is None:
            self._prefill_wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", backend=self.prefill_backend
            )
        return self._prefill_wrapper

    @property
    def decode_wrapper(self) -> Any:
        if self._decode_wrapper is None:
            self._decode_wrapper = self._new_decode_wrapper()
        return self._decode_wrapper

    # -- metadata -------------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_decode():
            self._plan_decode(self.decode_wrapper, forward_batch.req_pool_indices, forward_batch.seq_lens,
                              forward_batch.seq_lens_cpu)
        elif mode.is_extend():
            extend_lens = _host_lens(forward_batch.extend_seq_lens_cpu, forward_batch.extend_seq_lens)
            prefix_lens = _host_lens(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_prefix_lens)
            seq_lens_cpu = torch.tensor(extend_lens, dtype=torch.int64) + torch.tensor(prefix_lens, dtype=torch.int64)
            self._plan_extend(forward_batch, torch.tensor(extend_lens, dtype=torch.int64), seq_lens_cpu,
                              forward_batch.tree_mask)
        else:
            self._forward_wrapper = None
        forward_batch.attn_metadata = self._forward_wrapper

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        pages_per_request = -(-(self.context_len + self.page_size) // self.page_size)
        self._graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self._graph_kv_indices = torch.zeros(max_bs * pages_per_request, dtype=torch.int32, device=self.device)
        self._graph_qo_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_mask_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_wrappers = {}
        self._graph_verify_wrappers = {}

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, mode: ForwardMode,
        tree_mask: torch.Tensor | None = None,
    ) -> None:
        if self._graph_kv_indptr is None or self._graph_last_page_len is None or self._graph_kv_indices is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs, max_num_tokens) before capturing CUDA graphs")
        if not mode.is_decode():
            self._capture_verify(bs, num_tokens, req_pool_indices, seq_lens, mode, tree_mask)
            return
        wrapper = self._new_decode_wrapper(
            use_cuda_graph=True,
            paged_kv_indptr_buffer=self._graph_kv_indptr[: bs + 1],
            paged_kv_indices_buffer=self._graph_kv_indices,
            paged_kv_last_page_len_buffer=self._graph_last_page_len[:bs],
        )
        self._graph_wrappers[bs] = wrapper
        seq_lens_cpu = seq_lens.to("cpu")  # capture time: a sync here is harmless
        self._plan_decode(wrapper, req_pool_indices, seq_lens, seq_lens_cpu)

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
        if seq_lens_cpu is None:
            raise ValueError("the flashinfer backend needs seq_lens_cpu to plan a CUDA-graph replay without a sync")
        if not mode.is_decode():
            self._replay_verify(bs, req_pool_indices, seq_lens, seq_lens_cpu, mode, num_tokens, tree_mask)
            return
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            raise ValueError(f"no CUDA graph was captured for batch size {bs}; captured: {sorted(self._graph_wrappers)}")
        self._plan_decode(wrapper, req_pool_indices, seq_lens, seq_lens_cpu)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # -- attention ------------------------------------------------------------------------------

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, expect_decode=True)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        # The new tokens' K/V are read back from the paged cache: without save_kv_cache the caller wrote them.
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, expect_decode=False)

    def _run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
        forward_batch: ForwardBatch, save_kv_cache: bool, expect_decode: bool,
    ) -> torch.Tensor:
        wrapper = self._forward_wrapper
        if wrapper is None or self._forward_decodes != expect_decode:
            kind = "decode" if expect_decode else "extend"
            raise RuntimeError(f"forward_{kind} ran without {kind} metadata; call init_forward_metadata first")
        if (layer.sliding_window_size or None) != self.sliding_window:
            raise ValueError(
                f"layer {layer.layer_id} has sliding window {layer.sliding_window_size} but the flashinfer backend "
                f"was planned for {self.sliding_window} (context.sliding_window); per-layer windows are "
                "not supported"
            )
        kv_cache = forward_batch.kv_cache
        if save_kv_cache:
            kv_cache.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        pages = (self._paged(kv_cache.get_key_buffer(layer.layer_id)),
                 self._paged(kv_cache.get_value_buffer(layer.layer_id)))
        q = q.reshape(-1, layer.num_heads, layer.head_dim)
        if q.dtype != self.q_dtype:
            q = q.to(self.q_dtype)
        ratio = layer.scaling / self.default_scale
        q_scale = None if abs(ratio - 1.0) < 1e-6 else ratio
        k_scale, v_scale = _kv_scales(kv_cache, layer.layer_id)
        out = wrapper.run(q, pages, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
        return out.view(-1, layer.num_heads * layer.head_dim)

    # -- planning -------------------------------------------------------------------------------

    def _plan_decode(self, wrapper: Any, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     seq_lens_cpu: torch.Tensor) -> None:
        kv_indptr_cpu, last_page_len_cpu, kv_indices = self._page_table(req_pool_indices, seq_lens, seq_lens_cpu)
        wrapper.plan(
            kv_indptr_cpu, kv_indices, last_page_len_cpu,
            self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
            window_left=self.window_left, q_data_type=self.q_dtype, kv_data_type=self.kv_dtype,
        )
        self._forward_wrapper = wrapper
        self._forward_decodes = True

    def _plan_extend(self, forward_batch: ForwardBatch, extend_lens_cpu: torch.Tensor,
                     seq_lens_cpu: torch.Tensor, tree_mask: torch.Tensor | None = None) -> None:
        qo_indptr_cpu = torch.zeros(len(extend_lens_cpu) + 1, dtype=torch.int32)
        torch.cumsum(extend_lens_cpu, 0, out=qo_indptr_cpu[1:])
        self._plan_prefill(self.prefill_wrapper, qo_indptr_cpu.pin_memory(), forward_batch.req_pool_indices,
                           forward_batch.seq_lens, seq_lens_cpu, tree_mask)

    def _plan_prefill(self, wrapper: Any, qo_indptr_cpu: torch.Tensor, req_pool_indices: torch.Tensor,
                      seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, tree_mask: torch.Tensor | None = None
                      ) -> None:
        """Plan ``wrapper`` for these requests: causally, or over draft trees (``tree_mask`` ``[bs, t, t]``, a
        verify step's) with their packed mask (kernels/tree_mask.py), which carries the sliding window too (a node
        counts it from its depth's position, not its place in the step)."""
        kv_indptr_cpu, last_page_len_cpu, kv_indices = self._page_table(req_pool_indices, seq_lens, seq_lens_cpu)
        mask = {}
        if tree_mask is not None:
            packed = torch.empty(tree_mask_bytes(tree_mask.shape[1], seq_lens_cpu), dtype=torch.uint8,
                                 device=self.device)
            mask = {"packed_custom_mask": pack_tree_mask(tree_mask, seq_lens, packed, self.sliding_window)}
        wrapper.plan(
            qo_indptr_cpu, kv_indptr_cpu, kv_indices, last_page_len_cpu,
            self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
            causal=tree_mask is None, window_left=self.window_left if tree_mask is None else -1,
            q_data_type=self.q_dtype,
            kv_data_type=self.kv_dtype, **mask,
        )
        self._forward_wrapper = wrapper
        self._forward_decodes = False

    # -- TARGET_VERIFY under CUDA graphs --------------------------------------------------------

    def _capture_verify(self, bs: int, num_tokens: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                        mode: ForwardMode, tree_mask: torch.Tensor | None = None) -> None:
        tokens_per_req = _tokens_per_req(bs, num_tokens, mode)
        assert self._graph_qo_indptr is not None and self._graph_kv_indptr is not None
        mask_buffers = {}
        if tree_mask is not None:  # a packed mask of up to bs requests at full context
            mask_buffers = {"custom_mask_buf": self._graph_mask_buffer(
                bs * tokens_per_req * (self.context_len + tokens_per_req)),
                            "mask_indptr_buf": self._graph_mask_indptr[: bs + 1]}
        wrapper = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            qo_indptr_buf=self._graph_qo_indptr[: bs + 1],
            paged_kv_indptr_buf=self._graph_kv_indptr[: bs + 1],
            paged_kv_indices_buf=self._graph_kv_indices,
            paged_kv_last_page_len_buf=self._graph_last_page_len[:bs],
            backend=self.prefill_backend, **mask_buffers,
        )
        self._graph_verify_wrappers[(bs, tokens_per_req)] = wrapper
        seq_lens_cpu = seq_lens.to("cpu")  # capture time: a sync here is harmless
        self._plan_prefill(wrapper, self._verify_qo_indptr(bs, tokens_per_req), req_pool_indices, seq_lens,
                           seq_lens_cpu, tree_mask)

    def _graph_mask_buffer(self, num_bytes: int) -> torch.Tensor:
        """The tree verify graphs' packed-mask buffer, shared by every graph (the largest is captured first); a
        wrapper keeps the buffer it was built with."""
        if self._graph_mask is None or self._graph_mask.numel() < num_bytes:
            self._graph_mask = torch.zeros(num_bytes, dtype=torch.uint8, device=self.device)
        return self._graph_mask

    def _replay_verify(self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       seq_lens_cpu: torch.Tensor, mode: ForwardMode, num_tokens: int | None,
                       tree_mask: torch.Tensor | None = None) -> None:
        tokens_per_req = _tokens_per_req(bs, num_tokens, mode)
        wrapper = self._graph_verify_wrappers.get((bs, tokens_per_req))
        if wrapper is None:
            raise ValueError(f"no TARGET_VERIFY CUDA graph was captured for batch size {bs} and {tokens_per_req} "
                             f"tokens per request; captured: {sorted(self._graph_verify_wrappers)}")
        self._plan_prefill(wrapper, self._verify_qo_indptr(bs, tokens_per_req), req_pool_indices, seq_lens,
                           seq_lens_cpu, tree_mask)

    def _verify_qo_indptr(self, bs: int, tokens_per_req: int) -> torch.Tensor:
        """Pinned host ``[0, t, 2t, ..., bs * t]`` (int32), built once per shape."""
        key = (bs, tokens_per_req)
        if key not in self._verify_qo_indptrs:
            indptr = torch.arange(bs + 1, dtype=torch.int32) * tokens_per_req
            self._verify_qo_indptrs[key] = indptr.pin_memory()
        return self._verify_qo_indptrs[key]

    def _page_table(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host ``kv_indptr`` [bs + 1] and ``last_page_len`` [bs] (int32, pinned, so plan()'s copies of them are
        truly asynchronous) and the device ``kv_indices`` (each request's page ids read from ``req_to_token``).
        Both host arrays come from numpy in one pinned buffer, whose one copy also gives the page-table kernel its
        ``kv_indptr``: a verify step plans between its predecessor's results and its own launch."""
        page = self.page_size
        lens = np.asarray(seq_lens_cpu, dtype=np.int64)
        bs = lens.shape[0]
        pages = (lens + page - 1) // page
        counts = np.empty(2 * bs + 1, dtype=np.int32)
        counts[0] = 0
        np.cumsum(pages, out=counts[1:bs + 1])
        counts[bs + 1:] = lens - (pages - 1) * page
        host = torch.from_numpy(counts).pin_memory()
        kv_indptr = host[:bs + 1].to(self.device, non_blocking=True)
        kv_indices = torch.empty(max(int(counts[bs]), 1), dtype=torch.int32, device=self.device)
        req_to_token = self.req_to_token_pool.req_to_token
        self._page_table_kernel[(bs,)](
            req_to_token, req_to_token.stride(0), req_pool_indices, seq_lens, kv_indptr, kv_indices,
            PAGE_SIZE=page, BLOCK=256,
        )
        return host[:bs + 1], host[bs + 1:], kv_indices

    def _paged(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.view(-1, self.page_size, self.num_kv_heads, self.head_dim)

    def _new_decode_wrapper(self, **graph_buffers: Any) -> Any:
        return self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores, **graph_buffers
        )


def _tokens_per_req(bs: int, num_tokens: int | None, mode: ForwardMode) -> int:
    if not mode.is_verify():
        raise NotImplementedError(f"the flashinfer backend captures CUDA graphs for DECODE and TARGET_VERIFY, "
                                  f"not {mode.name}")
    if not num_tokens or num_tokens % bs:
        raise ValueError(f"a TARGET_VERIFY graph needs num_tokens = bs * tokens_per_req, got {num_tokens} for bs={bs}")
    return num_tokens // bs


def _kv_scales(kv_cache: Any, layer_id: int) -> tuple[float | None, float | None]:
    """An FP8 cache's per-layer ``(k_scale, v_scale)``; None where the scale is 1 (FlashInfer then skips it)."""
    if not getattr(kv_cache, "is_fp8", False):
        return None, None
    k_scale, v_scale = float(kv_cache.k_scales[layer_id]), float(kv_cache.v_scales[layer_id])
    return (None if k_scale == 1.0 else k_scale), (None if v_scale == 1.0 else v_scale)


def _host_lens(host: list[int] | None, device_values: torch.Tensor | None) -> list[int]:
    if host is not None:
        return [int(n) for n in host]
    if device_values is None:
        raise ValueError("an extend ForwardBatch needs extend_seq_lens and extend_prefix_lens")
    return [int(n) for n in device_values.tolist()]


def _import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as exc:
        raise RuntimeError(
            f"the flashinfer attention backend needs FlashInfer, which could not be imported ({exc}); "
            "pip install 'treadle[flashinfer]'  (FlashInfer 0.6.18.post1 is the tested version), "
            "or use attention.backend: triton"
        ) from exc
    return flashinfer


_KERNEL: Any = None


def _page_table_kernel() -> Any:
    """The Triton kernel writing ``kv_indices[kv_indptr[i] + j] = req_to_token[row_i, j * P] // P``."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def page_table_kernel(req_to_token, row_stride, req_pool_indices, seq_lens, kv_indptr, kv_indices,
                          PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        row = tl.load(req_pool_indices + i).to(tl.int64)
        num_pages = (tl.load(seq_lens + i) + PAGE_SIZE - 1) // PAGE_SIZE
        start = tl.load(kv_indptr + i)
        for first in range(0, num_pages, BLOCK):
            page = first + tl.arange(0, BLOCK)
            mask = page < num_pages
            slot = tl.load(req_to_token + row * row_stride + page * PAGE_SIZE, mask=mask, other=0)
            tl.store(kv_indices + start + page, (slot // PAGE_SIZE).to(tl.int32), mask=mask)

    _KERNEL = page_table_kernel
    return _KERNEL


@hookimpl
def treadle_register_attention_backends(register: Register) -> None:
    register("flashinfer", FlashInferAttnBackend)
