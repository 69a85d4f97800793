"""The `triton` attention backend: treadle's own Triton kernels for decode and extend.

Registered even where Triton is missing (so ``treadle plugins`` lists it);
building it there fails with the install hint. Triton is imported only when
the backend is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from treadle.core.execution.attention import AttentionBackend, head_layout
from treadle.core.execution.attention_context import AttentionContext
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.hookspecs import Register, hookimpl

if TYPE_CHECKING:
    from treadle.core.execution.attention import RadixAttention

_SUPPORTED_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)
# Decode batches of up to this many requests read 128 keys per kernel iteration, larger ones 64 (see _decode_block).
WIDE_DECODE_BLOCK_MAX_REQUESTS = 8


@dataclass
class DecodeMetadata:
    """Scratch for the split-KV partial results of one decode step, shared by all layers."""

    mid_o: torch.Tensor  # [bs, num_heads, max_kv_splits, head_dim]
    mid_lse: torch.Tensor  # [bs, num_heads, max_kv_splits], log2 of each chunk's softmax sum
    arrivals: torch.Tensor  # int32 zeros [>= bs * num_kv_heads]: each request's chunks count in here


@dataclass
class ExtendMetadata:
    """What the extend kernel's grid needs from the host.

    A MIXED batch's trailing one-token requests (the running decodes) form a decode tail:
    requests ``[decode_from, bs)``, tokens ``[decode_tokens_from, num_tokens)``, attended by
    the decode kernel with ``decode`` as its scratch (a one-token extend is exactly a decode).
    A TARGET_VERIFY chain of at most ``verify_decode_max_tokens`` tokens (``verify_by_decode``) runs the decode
    kernel over every token, ``decode`` its scratch (one row per token).
    """

    max_extend_len: int
    tree_mask: torch.Tensor | None = None  # a tree verify step's, as uint8 (ForwardBatch.tree_mask)
    decode_from: int | None = None
    decode_tokens_from: int = 0
    decode: DecodeMetadata | None = None
    verify_by_decode: bool = False


class TritonAttnBackend(AttentionBackend):
    """Attention through treadle's Triton kernels (split-KV decode, prefix-aware extend).

    Supports GQA, per-layer sliding windows, any page size (keys are read
    through ``req_to_token``) and float32/float16/bfloat16 KV caches, or FP8 (e4m3) caches with
    per-layer scales (``cache.kv_dtype: fp8_e4m3``). MIXED
    batches run the extend kernel for their prompt chunks and the decode kernel
    for their trailing one-token requests (``split_mixed_decodes``). CUDA graphs are supported for decode: the
    grid is ``(bs, num_kv_heads, max_kv_splits)`` whatever the lengths, and
    each request's split count is derived on the device from ``seq_lens``. TARGET_VERIFY steps (every request
    ``tokens_per_req`` new tokens) run the extend kernel, whose grid depends only on the batch size and
    ``tokens_per_req``, so they are captured too.

    Tunables (plain attributes, read at each launch): ``max_kv_splits``,
    ``min_split_tokens`` (a request uses ``min(max_kv_splits,
    ceil(visible_keys / min_split_tokens), decode_target_programs // (bs * num_kv_heads))`` chunks, at least one;
    ``decode_target_programs`` None: twice the GPU's SMs, 0: no such cap), ``decode_block_n`` (None: 128 keys
    per iteration for batches of up to 8 requests with heads of at most 128, else 64), ``decode_num_stages``
    (None: 3 for such heads on GPUs with Hopper's shared memory, else 2), ``verify_decode_max_tokens`` (a
    TARGET_VERIFY step of draft chains with at most this many tokens, requests times tokens per request, runs the
    decode kernel over every token, each seeing its request's keys up to its own position, instead of the extend
    kernel: at one request and k = 4 the extend kernel took 20 us a layer on an H100 and the decode kernel ~10 us
    for one token; set before CUDA graphs are captured),
    ``extend_block_m`` / ``extend_block_n`` (None: chosen per head size and dtype),
    ``split_mixed_decodes`` / ``min_mixed_decode_tail`` (the fewest trailing one-token
    requests worth a decode-kernel launch), ``decode_applies_rotary`` (True: decode batches take q and k before
    the rotary embedding and the decode kernel rotates them, see ``AttentionBackend.applies_rotary``; set before
    CUDA graphs are captured). ``max_kv_splits`` must not change after ``init_cuda_graph_state``.
    """

    supports_cuda_graph = True
    supports_verify_cuda_graph = True
    supports_tree_mask = True

    @classmethod
    def auto_priority(cls, device: torch.device) -> int | None:
        return 10 if device.type == "cuda" else None

    def __init__(self, context: AttentionContext) -> None:
        self._decode, self._extend = _import_kernels()
        self.device = torch.device(context.device)
        if self.device.type != "cuda" and not _interpreting():
            raise RuntimeError(
                f"the triton attention backend runs on a CUDA device, not '{self.device}'; use "
                "attention_backend: torch_native there (or set TRITON_INTERPRET=1 to run the kernels "
                "slowly on the CPU for testing)"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = head_layout(context, "triton")
        kv_cache = getattr(context, "kv_cache", None)
        kv_dtype = kv_cache.dtype if kv_cache is not None else context.dtype
        if kv_dtype not in _SUPPORTED_KV_DTYPES:
            raise ValueError(
                f"triton attention supports KV caches of float32, float16, bfloat16 or float8_e4m3fn, not {kv_dtype}"
            )
        self.max_kv_splits = 16
        self.min_split_tokens = 128
        self.decode_block_n: int | None = None
        # On an H100 (Llama-3.1-8B shapes) 128 keys per iteration made a one-request decode step 0.14 ms faster
        # than 64 and 64 requests 0.2 ms slower (docs/lab/benchmarks-history.md); wider heads or float32 caches keep 64 so
        # a tile's K and V fit in shared memory.
        self._wide_decode_blocks = self.head_dim <= 128 and kv_dtype != torch.float32
        # Splitting a request's keys over more programs pays only while the batch's (request, KV head) pairs leave
        # SMs idle; on an H100 one pipelining stage more read KV 8-9% faster from 32 to 256 requests (both in
        # docs/lab/benchmarks-history.md). Three stages of 128-key K and V tiles need Hopper's ~227 KB of shared memory.
        self.decode_target_programs: int | None = None
        self.decode_num_stages: int | None = None
        props = torch.cuda.get_device_properties(self.device) if self.device.type == "cuda" else None
        self._sm_count = props.multi_processor_count if props is not None else 0
        shared_memory = getattr(props, "shared_memory_per_block_optin", 0) if props is not None else 0
        self._deep_decode_pipeline = self._wide_decode_blocks and shared_memory >= 200 * 1024
        self.extend_block_m: int | None = None
        self.extend_block_n: int | None = None
        self.split_mixed_decodes = True
        self.min_mixed_decode_tail = 1
        self.decode_applies_rotary = True
        # Each token's row reads its request's keys itself (the request's t rows share them through L2): cheaper
        # than the extend kernel's tiles at a few requests, not at many long ones.
        self.verify_decode_max_tokens = 20
        self.forward_metadata: DecodeMetadata | ExtendMetadata | None = None
        self._graph_mid_o: torch.Tensor | None = None
        self._graph_mid_lse: torch.Tensor | None = None
        self._graph_arrivals: torch.Tensor | None = None
        self._arrivals = torch.zeros(0, dtype=torch.int32, device=self.device)

    # -- metadata -------------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_decode():
            metadata: DecodeMetadata | ExtendMetadata | None = self._decode_scratch(forward_batch.batch_size)
        elif mode.is_extend():
            lens = forward_batch.extend_seq_lens_cpu
            # Without host lengths, the token count bounds every request's extend length.
            metadata = ExtendMetadata(max(lens, default=0) if lens is not None else forward_batch.num_tokens)
            if self.verifies_by_decode(mode, forward_batch.num_tokens) and forward_batch.tree_mask is None:
                metadata.verify_by_decode = True
                metadata.decode = self._decode_scratch(forward_batch.num_tokens)
            elif forward_batch.tree_mask is not None:
                metadata.tree_mask = forward_batch.tree_mask.to(torch.uint8)
            elif lens is not None and self.split_mixed_decodes:
                self._split_decode_tail(metadata, lens)
        else:
            metadata = None
        self.forward_metadata = metadata
        forward_batch.attn_metadata = metadata

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        # A row per request of a decode step, per token of a verify step run by the decode kernel.
        rows = max(max_bs, min(max_num_tokens, self.verify_decode_max_tokens))
        shape = (rows, self.num_heads, self.max_kv_splits, self.head_dim)
        self._graph_mid_o = torch.empty(shape, dtype=torch.float32, device=self.device)
        self._graph_mid_lse = torch.empty(shape[:3], dtype=torch.float32, device=self.device)
        # Their own counters: a captured graph keeps pointing at them while eager steps may grow theirs.
        self._graph_arrivals = torch.zeros(rows * self.num_kv_heads, dtype=torch.int32, device=self.device)

    def init_forward_metadata_capture_cuda_graph(
        self, bs: int, num_tokens: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, mode: ForwardMode,
        tree_mask: torch.Tensor | None = None,  # read from the static forward batch instead
    ) -> None:
        self.forward_metadata = self._graph_decode_metadata(bs, mode, num_tokens)

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
        # The captured kernels read req_pool_indices and seq_lens (and a verify step's extend fields) from the
        # runner's static buffers and derive split counts from them on the device, so only the scratch needs
        # re-pointing.
        self.forward_metadata = self._graph_decode_metadata(bs, mode, num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # -- attention ------------------------------------------------------------------------------

    def verifies_by_decode(self, mode: ForwardMode, num_tokens: int) -> bool:
        """Whether a TARGET_VERIFY step of ``num_tokens`` tokens (of draft chains) runs the decode kernel over
        every token (``verify_decode_max_tokens``)."""
        return mode.is_verify() and 0 < num_tokens <= self.verify_decode_max_tokens

    def decodes_by_device_lengths(self) -> bool:
        """Always: the decode kernel reads ``seq_lens`` on the device (nothing is planned on the host)."""
        return True

    def applies_rotary(self, forward_batch: ForwardBatch) -> bool:
        return self.decode_applies_rotary and forward_batch.forward_mode.is_decode()

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        metadata = self.forward_metadata
        if not isinstance(metadata, DecodeMetadata):
            raise RuntimeError("forward_decode ran without decode metadata; call init_forward_metadata first")
        if rotary is not None:
            # The kernel reads each token's angles as one row of head_dim values.
            rotary = tuple(t.reshape(q.shape[0], layer.head_dim).contiguous() for t in rotary)
        kv_cache = forward_batch.kv_cache
        q = _heads_view(q, layer.num_heads, layer.head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        # The kernel stores the new K/V itself (what kv_cache.set_kv_buffer would, one launch less).
        new_kv = (
            _heads_view(k, layer.num_kv_heads, layer.head_dim), _heads_view(v, layer.num_kv_heads, layer.head_dim),
            forward_batch.out_cache_loc,
        ) if save_kv_cache else None
        self._decode.decode_attention(
            q,
            kv_cache.get_key_buffer(layer.layer_id),
            kv_cache.get_value_buffer(layer.layer_id),
            out,
            forward_batch.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            metadata.mid_o,
            metadata.mid_lse,
            metadata.arrivals,
            layer.scaling,
            layer.sliding_window_size,
            self.max_kv_splits,
            self.min_split_tokens,
            self._decode_block(q.shape[0]),
            *kv_scales(kv_cache, layer.layer_id),
            new_kv=new_kv,
            rotary=rotary,
            **self._decode_launch(),
        )
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        metadata = self.forward_metadata
        if not isinstance(metadata, ExtendMetadata):
            raise RuntimeError("forward_extend ran without extend metadata; call init_forward_metadata first")
        kv_cache = forward_batch.kv_cache
        if save_kv_cache:
            kv_cache.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        q = _heads_view(q, layer.num_heads, layer.head_dim)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if metadata.verify_by_decode and forward_batch.tree_mask is None:
            return self._verify_by_decode(q, out, layer, forward_batch, metadata.decode)
        split = metadata.decode_from
        requests = slice(0, split)  # the whole batch when there is no decode tail
        # A tree verify step's mask: converted once per step eagerly; a captured graph's is a uint8 static input.
        tree_mask = metadata.tree_mask if metadata.tree_mask is not None else forward_batch.tree_mask
        tokens = slice(0, metadata.decode_tokens_from if split is not None else q.shape[0])
        if split is None or split > 0:
            self._extend.extend_attention(
                q[tokens],
                _heads_view(k[tokens], layer.num_kv_heads, layer.head_dim),
                _heads_view(v[tokens], layer.num_kv_heads, layer.head_dim),
                out[tokens],
                kv_cache.get_key_buffer(layer.layer_id),
                kv_cache.get_value_buffer(layer.layer_id),
                forward_batch.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices[requests],
                forward_batch.extend_start_loc[requests],
                forward_batch.extend_seq_lens[requests],
                forward_batch.extend_prefix_lens[requests],
                metadata.max_extend_len,
                layer.scaling,
                layer.sliding_window_size,
                self.extend_block_m,
                self.extend_block_n,
                *kv_scales(kv_cache, layer.layer_id),
                tree_mask=tree_mask,
                positions=forward_batch.positions if tree_mask is not None else None,
            )
        if split is not None:
            assert metadata.decode is not None
            tail = slice(metadata.decode_tokens_from, q.shape[0])
            # The tail's new K/V were saved above, so the decode kernel reads them from the cache.
            self._decode.decode_attention(
                q[tail], kv_cache.get_key_buffer(layer.layer_id), kv_cache.get_value_buffer(layer.layer_id),
                out[tail], forward_batch.req_to_token_pool.req_to_token,
                forward_batch.req_pool_indices[split:], forward_batch.seq_lens[split:],
                metadata.decode.mid_o, metadata.decode.mid_lse, metadata.decode.arrivals, layer.scaling,
                layer.sliding_window_size,
                self.max_kv_splits, self.min_split_tokens, self._decode_block(q.shape[0] - metadata.decode_tokens_from),
                *kv_scales(kv_cache, layer.layer_id),
                **self._decode_launch(),
            )
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)

    # -- helpers --------------------------------------------------------------------------------

    def _verify_by_decode(self, q: torch.Tensor, out: torch.Tensor, layer: "RadixAttention",
                          forward_batch: ForwardBatch, scratch: DecodeMetadata | None) -> torch.Tensor:
        """A verify step's tokens through the decode kernel, each over its request's keys up to its own position
        (their K/V stored above)."""
        assert scratch is not None
        kv_cache = forward_batch.kv_cache
        tokens = q.shape[0]
        self._decode.decode_attention(
            q, kv_cache.get_key_buffer(layer.layer_id), kv_cache.get_value_buffer(layer.layer_id), out,
            forward_batch.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
            scratch.mid_o[:tokens], scratch.mid_lse[:tokens], scratch.arrivals, layer.scaling,
            layer.sliding_window_size, self.max_kv_splits, self.min_split_tokens, self._decode_block(tokens),
            *kv_scales(kv_cache, layer.layer_id), tokens_per_req=tokens // forward_batch.batch_size,
            **self._decode_launch(),
        )
        return out.view(tokens, layer.num_heads * layer.head_dim)


    def _decode_block(self, requests: int) -> int:
        """Keys the decode kernel reads per iteration for a batch of ``requests``."""
        if self.decode_block_n is not None:
            return self.decode_block_n
        return 128 if self._wide_decode_blocks and requests <= WIDE_DECODE_BLOCK_MAX_REQUESTS else 64

    def _decode_launch(self) -> dict[str, int]:
        """The decode kernel's pipelining depth and the programs its chunk cap aims at (see the class doc)."""
        stages = self.decode_num_stages or (3 if self._deep_decode_pipeline else 2)
        target = self.decode_target_programs
        return {"num_stages": stages, "target_programs": 2 * self._sm_count if target is None else target}

    def _split_decode_tail(self, metadata: ExtendMetadata, lens: list[int]) -> None:
        """Send the trailing one-token requests to the decode kernel: the extend kernel tiles queries
        by ``extend_block_m`` rows, so a one-token request wastes most of its tile and reads its whole
        prefix per query head (a 512-decode MIXED batch took 40 ms of extend kernel per step on an H100)."""
        first = len(lens)
        while first > 0 and lens[first - 1] == 1:
            first -= 1
        if len(lens) - first < self.min_mixed_decode_tail:
            return
        metadata.decode_from = first
        metadata.decode_tokens_from = sum(lens[:first])
        metadata.max_extend_len = max(lens[:first], default=0)
        metadata.decode = self._decode_scratch(len(lens) - first)

    def _decode_scratch(self, bs: int) -> DecodeMetadata:
        shape = (bs, self.num_heads, self.max_kv_splits, self.head_dim)
        if self._arrivals.numel() < bs * self.num_kv_heads:
            # Kernels run one after another on one stream, each leaving the counters zero, so one set serves all.
            self._arrivals = torch.zeros(max(bs, 64) * self.num_kv_heads, dtype=torch.int32, device=self.device)
        return DecodeMetadata(
            mid_o=torch.empty(shape, dtype=torch.float32, device=self.device),
            mid_lse=torch.empty(shape[:3], dtype=torch.float32, device=self.device),
            arrivals=self._arrivals,
        )

    def _graph_decode_metadata(self, bs: int, mode: ForwardMode,
                               num_tokens: int | None = None) -> DecodeMetadata | ExtendMetadata:
        if not mode.is_decode():
            metadata = _graph_verify_metadata(bs, mode, num_tokens)
            if self.verifies_by_decode(mode, bs * metadata.max_extend_len):
                metadata.verify_by_decode = True
                metadata.decode = self._graph_decode_metadata(bs * metadata.max_extend_len, ForwardMode.DECODE)
            return metadata
        if self._graph_mid_o is None or self._graph_mid_lse is None or self._graph_arrivals is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs, max_num_tokens) before capturing CUDA graphs")
        if bs > self._graph_mid_o.shape[0] or self._graph_mid_o.shape[2] != self.max_kv_splits:
            raise ValueError(
                f"CUDA-graph state was built for {self._graph_mid_o.shape[0]} rows (max_bs, or a verify step's tokens) "
                f"and max_kv_splits={self._graph_mid_o.shape[2]}; got {bs} rows, max_kv_splits={self.max_kv_splits}"
            )
        return DecodeMetadata(mid_o=self._graph_mid_o[:bs], mid_lse=self._graph_mid_lse[:bs],
                              arrivals=self._graph_arrivals)


def _graph_verify_metadata(bs: int, mode: ForwardMode, num_tokens: int | None) -> ExtendMetadata:
    """A captured TARGET_VERIFY step: the extend kernel over ``num_tokens // bs`` new tokens per request."""
    if not mode.is_verify():
        raise NotImplementedError(f"the triton backend captures CUDA graphs for DECODE and TARGET_VERIFY, not {mode.name}")
    if not num_tokens or num_tokens % bs:
        raise ValueError(f"a TARGET_VERIFY graph needs num_tokens = bs * tokens_per_req, got {num_tokens} for bs={bs}")
    return ExtendMetadata(max_extend_len=num_tokens // bs)


def _heads_view(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """``[tokens, heads * head_dim]`` as ``[tokens, heads, head_dim]`` with unit stride on the last dim."""
    x = x.reshape(x.shape[0], num_heads, head_dim)
    return x if x.stride(-1) == 1 else x.contiguous()


def kv_scales(kv_cache: Any, layer_id: int) -> tuple[float, float]:
    """``(k_scale, v_scale)`` of a layer: the FP8 cache's per-layer scales, 1.0 for other caches."""
    if not getattr(kv_cache, "is_fp8", False):
        return 1.0, 1.0
    return float(kv_cache.k_scales[layer_id]), float(kv_cache.v_scales[layer_id])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _import_kernels() -> tuple[Any, Any]:
    try:
        from treadle.plugins.attention.triton import decode, extend
    except ImportError as exc:
        raise RuntimeError(
            f"the triton attention backend needs Triton, which could not be imported ({exc}); "
            "pip install triton  (or: pip install 'treadle[triton]')"
        ) from exc
    return decode, extend


@hookimpl
def treadle_register_attention_backends(register: Register) -> None:
    register("triton", TritonAttnBackend)
