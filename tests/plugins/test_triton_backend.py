"""The `triton` attention backend against a float64 PyTorch reference, on the CPU.

The kernels run under Triton's interpreter (TRITON_INTERPRET=1). Triton picks
interpret-or-compile when each ``@triton.jit`` function is decorated, and its
own library functions (``tl.cdiv``, ``tl.max``, ...) are decorated when
``triton`` is first imported; once anything in the process has imported
triton without the variable (torch's inductor, another test module), kernels
can no longer be interpreted there. So the kernel checks run in one fresh
subprocess per module — this file run as a script, with the variable set
before any import — and each test asserts on its scenario's result.
Checks that launch no kernel run in the pytest process.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from treadle.core.execution.attention import RadixAttention
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.memory.pools import KVCache, ReqToTokenPool

RESULT_MARKER = "TRITON_CHECKS_JSON="
LAYER_ID = 1  # a layer other than 0, so the backend must pick the right buffers


# --------------------------------------------------------------------------------------------
# Batch construction and the reference (used by the subprocess; importable anywhere)
# --------------------------------------------------------------------------------------------


@dataclass
class Batch:
    forward_batch: ForwardBatch
    layer: RadixAttention
    q: torch.Tensor  # [tokens, heads * head_dim]
    k: torch.Tensor  # [tokens, kv_heads * head_dim], this step's new tokens
    v: torch.Tensor
    full_k: list[torch.Tensor] = field(default_factory=list)  # per request [seq, kv_heads, head_dim]
    full_v: list[torch.Tensor] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)


def make_model_runner(pool: ReqToTokenPool, cache: KVCache, heads: int, kv_heads: int, head_dim: int,
                      page_size: int, window: int | None) -> SimpleNamespace:
    return SimpleNamespace(
        device=torch.device("cpu"), dtype=cache.dtype, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, page_size=page_size, req_to_token_pool=pool, kv_cache=cache,
        sliding_window=window, context_len=pool.max_context_len,
    )


def make_backend(model_runner: SimpleNamespace):
    from treadle.plugins.attention.triton.backend import TritonAttnBackend

    backend = TritonAttnBackend(model_runner)
    # Small blocks and splits so ~40-token requests cross block and split boundaries.
    backend.max_kv_splits = 4
    backend.min_split_tokens = 8
    backend.decode_block_n = 16
    backend.extend_block_m = 16
    backend.extend_block_n = 16
    return backend


def make_batch(
    mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], *, page_size: int = 1,
    heads: int = 8, kv_heads: int = 2, head_dim: int = 16, window: int | None = None,
    dtype: torch.dtype = torch.float32, backend_factory=make_backend, seed: int = 0,
    kv_dtype: torch.dtype | None = None, kv_scales: tuple[float, float] = (1.0, 1.0),
) -> tuple[Batch, object]:
    """Requests with cached prefixes and new tokens, on shuffled pages of a NaN-filled cache.

    Every slot no request owns holds NaN, so a kernel reading a wrong slot poisons its output.
    With an FP8 ``kv_dtype`` the reference sees what the kernels can: the cached tokens (and,
    in a decode, the new token, which is read back from the cache) as stored in FP8.
    """
    gen = torch.Generator().manual_seed(seed)
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_per_req = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_per_req) + 3
    pool = ReqToTokenPool(size=bs + 2, max_context_len=64, device="cpu")
    cache = KVCache(num_pages * page_size, page_size, num_layers=2, num_kv_heads=kv_heads,
                    head_dim=head_dim, dtype=kv_dtype or dtype, device="cpu")
    cache.k_scales[LAYER_ID], cache.v_scales[LAYER_ID] = kv_scales
    for buffers in (cache.k_buffers, cache.v_buffers):
        for buffer in buffers:
            buffer.fill_(float("nan"))
    # Real pages are 1..num_pages (page 0 is padding); hand them out in random order.
    pages = (torch.randperm(num_pages, generator=gen) + 1).tolist()
    pool_rows = (torch.randperm(bs + 2, generator=gen)[:bs]).tolist()

    full_k, full_v, new_k, new_v, out_cache_loc, positions = [], [], [], [], [], []
    # A MIXED batch's trailing one-token requests go to the decode kernel, which reads their new K/V
    # back from the cache (so, in FP8, as stored); the others attend to their new tokens as given.
    decode_tail_from = bs
    while mode == ForwardMode.MIXED and decode_tail_from > 0 and extend_lens[decode_tail_from - 1] == 1:
        decode_tail_from -= 1
    for i in range(bs):
        req_pages = [pages.pop() for _ in range(pages_per_req[i])]
        slots = torch.tensor([req_pages[p // page_size] * page_size + p % page_size for p in range(seq_lens[i])])
        pool.req_to_token[pool_rows[i], : seq_lens[i]] = slots.to(torch.int32)
        k = torch.randn(seq_lens[i], kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_lens[i], kv_heads, head_dim, generator=gen).to(dtype)
        prefix = slots[: prefix_lens[i]]
        cache.set_kv_buffer(LAYER_ID, prefix, k[: prefix_lens[i]], v[: prefix_lens[i]])
        if cache.is_fp8:
            # A verify step's tokens go through the decode kernel too (verify_decode_max_tokens).
            read_back = seq_lens[i] if mode.is_decode() or mode.is_verify() or i >= decode_tail_from else prefix_lens[i]
            k, v = k.clone(), v.clone()
            k[:read_back] = _fp8_round_trip(k[:read_back], kv_scales[0], cache.dtype)
            v[:read_back] = _fp8_round_trip(v[:read_back], kv_scales[1], cache.dtype)
        full_k.append(k)
        full_v.append(v)
        new_k.append(k[prefix_lens[i]:])
        new_v.append(v[prefix_lens[i]:])
        out_cache_loc.append(slots[prefix_lens[i]:])
        positions.append(torch.arange(prefix_lens[i], seq_lens[i]))

    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, heads * head_dim, generator=gen).to(dtype)
    layer = RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, LAYER_ID, sliding_window_size=window)
    backend = backend_factory(make_model_runner(pool, cache, heads, kv_heads, head_dim, page_size, window))
    starts = torch.tensor([0] + extend_lens[:-1]).cumsum(0)
    extend = mode.is_extend()
    forward_batch = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.cat(positions),
        req_pool_indices=torch.tensor(pool_rows),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),
        out_cache_loc=torch.cat(out_cache_loc),
        seq_lens_sum=sum(seq_lens),
        logits_indices=starts + torch.tensor(extend_lens) - 1,
        req_to_token_pool=pool,
        kv_cache=cache,
        attn_backend=backend,
        extend_seq_lens=torch.tensor(extend_lens) if extend else None,
        extend_prefix_lens=torch.tensor(prefix_lens) if extend else None,
        extend_start_loc=starts if extend else None,
        extend_seq_lens_cpu=list(extend_lens) if extend else None,
        extend_prefix_lens_cpu=list(prefix_lens) if extend else None,
    )
    batch = Batch(forward_batch, layer, q, torch.cat(new_k).flatten(1), torch.cat(new_v).flatten(1),
                  full_k, full_v, list(prefix_lens))
    return batch, backend


def _fp8_round_trip(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> torch.Tensor:
    return ((x / scale).to(fp8_dtype).to(x.dtype)) * scale


def reference_attention(batch: Batch) -> torch.Tensor:
    """Causal (optionally windowed) attention in float64, GQA by repeating KV heads."""
    layer = batch.layer
    group = layer.num_heads // layer.num_kv_heads
    window = layer.sliding_window_size
    q = batch.q.double().view(-1, layer.num_heads, layer.head_dim)
    outputs, start = [], 0
    for prefix, k, v in zip(batch.prefix_lens, batch.full_k, batch.full_v):
        seq = k.shape[0]
        q_req = q[start : start + seq - prefix]
        start += seq - prefix
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        q_pos = torch.arange(prefix, seq)[:, None]
        k_pos = torch.arange(seq)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = torch.einsum("qhd,khd->hqk", q_req, k) * layer.scaling
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outputs).flatten(1)


def run_backend(batch: Batch, backend) -> torch.Tensor:
    backend.init_forward_metadata(batch.forward_batch)
    return batch.layer(batch.q, batch.k, batch.v, batch.forward_batch)


def max_error(batch: Batch, out: torch.Tensor) -> float:
    return (out.double() - reference_attention(batch)).abs().max().item()


# --------------------------------------------------------------------------------------------
# Scenarios (each returns the max abs error against the reference)
# --------------------------------------------------------------------------------------------

DECODE, EXTEND, MIXED, VERIFY = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY


def _scenario(mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], **kwargs):
    def run() -> float:
        batch, backend = make_batch(mode, prefix_lens, extend_lens, **kwargs)
        return max_error(batch, run_backend(batch, backend))

    return run


def _decode(seq_lens: list[int], **kwargs):
    return _scenario(DECODE, [s - 1 for s in seq_lens], [1] * len(seq_lens), **kwargs)


def _capped_backend(target_programs: int):
    """``make_backend`` with the decode chunk cap aimed at ``target_programs`` (on a GPU: twice its SMs)."""
    def factory(model_runner: SimpleNamespace):
        backend = make_backend(model_runner)
        backend.decode_target_programs = target_programs
        return backend

    return factory


def _tuned_backend(**tunables):
    """``make_backend`` with the given tunables set (e.g. ``verify_decode_max_tokens=0``: verify steps through the
    extend kernel; ``min_split_tokens=8``: several chunks per request at these lengths)."""
    def factory(model_runner: SimpleNamespace):
        backend = make_backend(model_runner)
        for name, value in tunables.items():
            setattr(backend, name, value)
        return backend

    return factory


def _cuda_graph_hooks() -> float:
    """Decode through capture/replay metadata: identical to eager, and right after lengths change."""
    batch, backend = make_batch(DECODE, [16, 2, 33], [1, 1, 1], page_size=4)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    # Split partials a request does not use are never written, so the combine must not read them.
    backend._graph_mid_o.fill_(float("nan"))
    backend._graph_mid_lse.fill_(float("nan"))
    fb = batch.forward_batch
    backend.init_forward_metadata_capture_cuda_graph(3, 3, fb.req_pool_indices, fb.seq_lens, DECODE)
    captured = batch.layer(batch.q, batch.k, batch.v, fb)
    eager = run_backend(batch, backend)
    if not torch.equal(captured, eager):
        return float("inf")
    # Same static scratch, different lengths (fewer cached tokens: the rows are still filled).
    fb.seq_lens -= torch.tensor([5, 0, 20])
    batch.prefix_lens = (fb.seq_lens - 1).tolist()
    batch.full_k = [k[:n] for k, n in zip(batch.full_k, fb.seq_lens.tolist())]
    batch.full_v = [v[:n] for v, n in zip(batch.full_v, fb.seq_lens.tolist())]
    pool_rows = fb.req_pool_indices.tolist()
    slots = [fb.req_to_token_pool.req_to_token[r, n - 1] for r, n in zip(pool_rows, fb.seq_lens.tolist())]
    fb.out_cache_loc = torch.stack(slots).long()
    batch.k = torch.stack([k[-1] for k in batch.full_k]).flatten(1)
    batch.v = torch.stack([v[-1] for v in batch.full_v]).flatten(1)
    backend.init_forward_metadata_replay_cuda_graph(3, fb.req_pool_indices, fb.seq_lens, 0, DECODE)
    error = max_error(batch, batch.layer(batch.q, batch.k, batch.v, fb))
    # Each request's last chunk to finish resets its arrival counter, or the next step would combine early.
    if backend._graph_arrivals.any() or backend._arrivals.any():
        return float("inf")
    return error


def _rotary_fused(**kwargs):
    """Decode with q and k passed before the rotary embedding (the kernel rotates them): the output and the
    stored K/V are identical to rotating first (``fused_ops``' torch reference, as the model does) — 0.0, else inf."""
    def run() -> float:
        from treadle.kernels.fused_ops import apply_rotary_reference

        seq_lens = [1, 19, 40]
        rotated, backend = make_batch(DECODE, [s - 1 for s in seq_lens], [1] * 3, page_size=4, **kwargs)
        fused, fused_backend = make_batch(DECODE, [s - 1 for s in seq_lens], [1] * 3, page_size=4, **kwargs)
        layer, dtype = rotated.layer, rotated.q.dtype
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, layer.head_dim, 2).double() / layer.head_dim))
        freqs = rotated.forward_batch.positions.double()[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

        def rotate(x: torch.Tensor, heads: int) -> torch.Tensor:
            return apply_rotary_reference(x.view(-1, heads, layer.head_dim), cos, sin).flatten(1)

        backend.init_forward_metadata(rotated.forward_batch)
        expected = layer(rotate(rotated.q, layer.num_heads), rotate(rotated.k, layer.num_kv_heads), rotated.v,
                         rotated.forward_batch)
        fused_backend.init_forward_metadata(fused.forward_batch)
        if not fused_backend.applies_rotary(fused.forward_batch):
            return float("inf")
        got = layer(fused.q, fused.k, fused.v, fused.forward_batch, rotary=(cos, sin))
        cached = [(b.forward_batch.kv_cache.get_key_buffer(LAYER_ID), b.forward_batch.kv_cache.get_value_buffer(LAYER_ID))
                  for b in (rotated, fused)]
        same_cache = all(torch.equal(x.float().nan_to_num(), y.float().nan_to_num()) for x, y in zip(*cached))
        return 0.0 if torch.equal(got, expected) and same_cache else float("inf")

    return run


def _vs_torch_native() -> float | None:
    """Same batch through the torch_native backend when it is registered (None: not available)."""
    from treadle.core.registry import build_registry

    registry = build_registry(["treadle.plugins.attention.torch_native"], load_entry_points=False)
    if "torch_native" not in registry.names("attention"):
        return None
    factory = registry.get("attention", "torch_native")
    kwargs = dict(page_size=4, window=9, seed=3)
    ours, backend = make_batch(EXTEND, [5, 12, 0], [9, 1, 20], **kwargs)
    theirs, native = make_batch(EXTEND, [5, 12, 0], [9, 1, 20], backend_factory=factory, **kwargs)
    return (run_backend(ours, backend).double() - run_backend(theirs, native).double()).abs().max().item()


FP32_TOL, HALF_TOL = 1e-4, 2e-2
SCENARIOS = {
    # name: (check, tolerance)
    "decode_gqa_page1": (_decode([1, 19, 40]), FP32_TOL),
    "decode_gqa_page4": (_decode([1, 19, 40], page_size=4), FP32_TOL),
    "decode_mha_odd_head_dim": (_decode([7, 30], heads=2, kv_heads=2, head_dim=24), FP32_TOL),
    "decode_sliding_window_page4": (_decode([3, 7, 8, 37], page_size=4, window=7), FP32_TOL),
    # 3 requests x 2 KV heads: a target of 6 programs leaves one chunk per request, 12 two (of up to 4).
    "decode_one_chunk_per_request": (_decode([1, 19, 40], backend_factory=_capped_backend(6)), FP32_TOL),
    "decode_two_chunks_per_request": (_decode([1, 19, 40], page_size=4, backend_factory=_capped_backend(12)),
                                      FP32_TOL),
    "extend_no_prefix_page1": (_scenario(EXTEND, [0, 0], [7, 33]), FP32_TOL),
    "extend_prefix_page1": (_scenario(EXTEND, [5, 12, 13], [9, 1, 20]), FP32_TOL),
    "extend_prefix_page4": (_scenario(EXTEND, [5, 12, 13], [9, 1, 20], page_size=4), FP32_TOL),
    "extend_sliding_window_page4": (_scenario(EXTEND, [4, 16, 0], [10, 21, 17], page_size=4, window=6), FP32_TOL),
    "mixed_prefill_and_decodes": (_scenario(MIXED, [9, 0, 30], [1, 18, 1], page_size=2), FP32_TOL),
    # The trailing one-token requests go through the decode kernel (split_mixed_decodes).
    "mixed_decode_tail": (_scenario(MIXED, [4, 0, 12, 30, 5], [6, 17, 1, 1, 1]), FP32_TOL),
    "mixed_decode_tail_window_page4": (_scenario(MIXED, [0, 12, 30], [21, 1, 1], page_size=4, window=7), FP32_TOL),
    "mixed_only_one_token_requests": (_scenario(MIXED, [3, 8], [1, 1]), FP32_TOL),
    # Verify steps of draft chains: each token through the decode kernel, over its request's keys up to its own
    # position (verify_decode_max_tokens), in one chunk and in several; and through the extend kernel.
    "verify_by_decode_window_page4": (_scenario(VERIFY, [5, 30, 12], [4, 4, 4], page_size=4, window=7), FP32_TOL),
    "verify_by_decode_chunks": (_scenario(VERIFY, [1, 40], [5, 5], backend_factory=_tuned_backend(
        min_split_tokens=8)), FP32_TOL),
    "verify_by_decode_fp8_kv": (_scenario(VERIFY, [6, 33], [3, 3], page_size=2, kv_dtype=torch.float8_e4m3fn,
                                          kv_scales=(0.5, 2.0)), FP32_TOL),
    "verify_by_extend": (_scenario(VERIFY, [5, 30, 12], [4, 4, 4], page_size=4, backend_factory=_tuned_backend(
        verify_decode_max_tokens=0)), FP32_TOL),
    # No bfloat16 here: the interpreter runs tl.dot on bfloat16's raw uint16 bits (a documented
    # interpreter limitation, triton-lang/triton#11584); tests/gpu/test_triton_gpu.py covers it.
    "decode_fp16": (_decode([5, 38], page_size=4, dtype=torch.float16), HALF_TOL),
    "extend_fp16": (_scenario(EXTEND, [6, 0], [11, 20], dtype=torch.float16), HALF_TOL),
    # FP8 KV cache with per-layer scales (powers of two, so dequantizing is exact): the kernels must
    # read FP8, apply k_scale to the scores and v_scale to the values.
    "decode_fp8_kv_scaled": (_decode([5, 38, 17], page_size=4, kv_dtype=torch.float8_e4m3fn,
                                     kv_scales=(0.5, 2.0)), FP32_TOL),
    "extend_fp8_kv_scaled": (_scenario(EXTEND, [6, 13, 0], [11, 1, 20], kv_dtype=torch.float8_e4m3fn,
                                       kv_scales=(0.25, 4.0)), FP32_TOL),
    "mixed_fp8_kv": (_scenario(MIXED, [9, 0, 30], [1, 18, 1], page_size=2, kv_dtype=torch.float8_e4m3fn),
                     FP32_TOL),
    # The rotary embedding applied by the decode kernel (AttentionBackend.applies_rotary), bit for bit.
    "decode_rotary_fused": (_rotary_fused(), 0.0),
    "decode_rotary_fused_fp16_odd_head_dim": (_rotary_fused(heads=2, kv_heads=2, head_dim=24, dtype=torch.float16),
                                              0.0),
    "decode_rotary_fused_fp8_kv": (_rotary_fused(kv_dtype=torch.float8_e4m3fn, kv_scales=(0.5, 2.0)), 0.0),
    "cuda_graph_hooks": (_cuda_graph_hooks, FP32_TOL),
    "same_as_torch_native": (_vs_torch_native, FP32_TOL),
}


def _run_all() -> dict[str, dict]:
    results = {}
    for name, (check, _) in SCENARIOS.items():
        try:
            results[name] = {"error": check()}
        except Exception:  # reported per scenario so one failure does not hide the others
            results[name] = {"traceback": traceback.format_exc()}
    return results


if __name__ == "__main__":
    print(RESULT_MARKER + json.dumps(_run_all()))
    sys.exit(0)


# --------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, dict]:
    from interpreted import interpreted_results as run_interpreted

    return run_interpreted(__file__, RESULT_MARKER)


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "same_as_torch_native"])
def test_matches_reference(name: str, interpreted_results: dict[str, dict]) -> None:
    result = interpreted_results[name]
    assert "traceback" not in result, result.get("traceback")
    assert result["error"] <= SCENARIOS[name][1], f"{name}: max abs error {result['error']}"


def test_matches_torch_native(interpreted_results: dict[str, dict]) -> None:
    result = interpreted_results["same_as_torch_native"]
    assert "traceback" not in result, result.get("traceback")
    if result["error"] is None:
        pytest.skip("torch_native backend not registered yet")
    assert result["error"] <= FP32_TOL


def test_registered_as_triton() -> None:
    from treadle.core.registry import build_registry
    from treadle.plugins.attention.triton.backend import TritonAttnBackend

    registry = build_registry(["treadle.plugins.attention.triton.backend"], load_entry_points=False)
    assert registry.get("attention", "triton") is TritonAttnBackend


def _tiny_runner(dtype: torch.dtype = torch.float32, head_dim: int = 16) -> SimpleNamespace:
    pool = ReqToTokenPool(2, 16, "cpu")
    cache = KVCache(8, 1, 1, 1, head_dim, dtype, "cpu")
    return make_model_runner(pool, cache, heads=2, kv_heads=1, head_dim=head_dim, page_size=1, window=None)


def test_cpu_without_interpreter_is_refused_with_alternative(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from treadle.plugins.attention.triton.backend import TritonAttnBackend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="torch_native"):
        TritonAttnBackend(_tiny_runner())


def test_missing_triton_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from treadle.plugins.attention.triton.backend import TritonAttnBackend

    import treadle.plugins.attention.triton as package

    # A None entry in sys.modules makes the import fail as if Triton were absent; the package
    # attribute goes too, or `from package import decode` would find an earlier import.
    monkeypatch.setitem(sys.modules, "treadle.plugins.attention.triton.decode", None)
    monkeypatch.delattr(package, "decode", raising=False)
    with pytest.raises(RuntimeError, match="pip install triton"):
        TritonAttnBackend(_tiny_runner())


def test_unsupported_kv_dtype_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from treadle.plugins.attention.triton.backend import TritonAttnBackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="float32, float16, bfloat16 or float8_e4m3fn"):
        TritonAttnBackend(_tiny_runner(torch.float64))


def test_cuda_graphs_capture_decode_and_verify_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from treadle.plugins.attention.triton.backend import ExtendMetadata, TritonAttnBackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = TritonAttnBackend(_tiny_runner())
    assert backend.supports_cuda_graph and backend.supports_verify_cuda_graph
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=8)
    indices, lens = torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    with pytest.raises(NotImplementedError, match="DECODE and TARGET_VERIFY, not EXTEND"):
        backend.init_forward_metadata_capture_cuda_graph(2, 2, indices, lens, ForwardMode.EXTEND)
    with pytest.raises(ValueError, match="built for 8 rows"):  # 2 requests, or the 8 tokens of a verify step
        backend.init_forward_metadata_capture_cuda_graph(9, 9, indices, lens, ForwardMode.DECODE)
    # A verify step of up to verify_decode_max_tokens tokens runs the decode kernel over each of its
    # tokens_per_req = num_tokens / bs new tokens per request, a scratch row each; a larger one the extend kernel.
    backend.init_forward_metadata_capture_cuda_graph(2, 8, indices, lens + 3, ForwardMode.TARGET_VERIFY)
    metadata = backend.forward_metadata
    assert metadata.max_extend_len == 4 and metadata.verify_by_decode and metadata.decode.mid_o.shape[0] == 8
    backend.verify_decode_max_tokens = 4
    backend.init_forward_metadata_replay_cuda_graph(2, indices, lens + 2, 6, ForwardMode.TARGET_VERIFY, num_tokens=6)
    assert backend.forward_metadata == ExtendMetadata(max_extend_len=3)
    with pytest.raises(ValueError, match="num_tokens = bs \\* tokens_per_req"):
        backend.init_forward_metadata_replay_cuda_graph(2, indices, lens, 2, ForwardMode.TARGET_VERIFY)


@pytest.mark.parametrize("dtype, head_dim, wide", [(torch.bfloat16, 128, True), (torch.float16, 64, True),
                                                   (torch.bfloat16, 256, False), (torch.float32, 128, False)])
def test_decode_block_widens_for_small_batches(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, head_dim: int,
                                               wide: bool) -> None:
    pytest.importorskip("triton")
    from treadle.plugins.attention.triton.backend import WIDE_DECODE_BLOCK_MAX_REQUESTS, TritonAttnBackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = TritonAttnBackend(_tiny_runner(dtype, head_dim=head_dim))
    small, large = backend._decode_block(1), backend._decode_block(WIDE_DECODE_BLOCK_MAX_REQUESTS + 1)
    assert (small, large) == ((128, 64) if wide else (64, 64))
    assert backend._decode_block(WIDE_DECODE_BLOCK_MAX_REQUESTS) == small
    backend.decode_block_n = 32  # a set value wins at every size
    assert backend._decode_block(1) == backend._decode_block(100) == 32


def test_decode_launch_defaults_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from treadle.plugins.attention.triton.backend import TritonAttnBackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = TritonAttnBackend(_tiny_runner(torch.bfloat16, head_dim=128))
    # No GPU: no SM count to aim the chunk cap at, and no Hopper shared memory for a third stage.
    assert backend._decode_launch() == {"num_stages": 2, "target_programs": 0}
    backend.decode_target_programs, backend.decode_num_stages = 264, 3
    assert backend._decode_launch() == {"num_stages": 3, "target_programs": 264}
