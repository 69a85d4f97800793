"""The Triton kernels compile for an H100 (sm_90) on a machine without a GPU.

The CPU tests run the kernels under TRITON_INTERPRET=1, which accepts code the real compiler
rejects; compiling ahead of time to a cubin with Triton's bundled ptxas catches that here. The
compiles run in a subprocess without TRITON_INTERPRET: a test before this one may have imported
the kernel modules in interpreter mode in this process.
"""

from __future__ import annotations

import inspect
import json
import sys
import traceback

import pytest

RESULT_MARKER = "AOT-RESULTS:"
KV_TYPES = ("bf16", "fp8e4nv")


def _compile(kernel, pointers: dict[str, str], floats: set[str], constexprs: dict[str, object],
             aligned: set[str] = frozenset(), **options: object):
    """``kernel`` compiled for sm_90; ``aligned``: arguments a launch passes as multiples of 16 (pointers and ints,
    as Triton specializes them: what lets its pipeline copy tiles asynchronously); ``options``: num_warps etc."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    signature, constants = {}, {}
    for index, name in enumerate(names):
        if name in pointers:
            signature[name] = pointers[name]
        elif name in constexprs:
            signature[name] = "constexpr"
            constants[(index,)] = constexprs[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
    attrs = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(names) if name in aligned}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options or None)
    assert compiled.asm["cubin"]
    return compiled


def _attention_kernels() -> dict:
    from treadle.plugins.attention.flashinfer import _page_table_kernel
    from treadle.plugins.attention.triton import decode, extend

    checks = {}
    for kv in KV_TYPES:
        fp8 = kv != "bf16"
        # tokens: a verify step's tokens per request (each token a row of the grid).
        for store, rotary, pdl, tokens in ((False, False, False, 1), (True, False, False, 1), (True, True, False, 1),
                                           (True, True, True, 1), (False, False, False, 5)):
            name = (f"decode[{kv},store_kv={store}" + (",rotary" if rotary else "") + (",pdl" if pdl else "")
                    + (f",verify{tokens}]" if tokens > 1 else "]"))
            checks[name] = lambda kv=kv, fp8=fp8, store=store, rotary=rotary, pdl=pdl, tokens=tokens: _check_pdl(
                pdl, _compile(
                decode._decode_kernel,
                {"Q": "*bf16", "K_new": "*bf16", "V_new": "*bf16", "New_loc": "*i64", "K_cache": f"*{kv}",
                 "V_cache": f"*{kv}", "Req_to_token": "*i32", "Req_pool_indices": "*i64", "Seq_lens": "*i64",
                 "Mid_o": "*fp32", "Mid_lse": "*fp32", "Arrivals": "*i32", "O": "*bf16", "Cos": "*bf16",
                 "Sin": "*bf16"},
                {"qk_scale", "k_scale", "v_scale", "fp8_max"},
                dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64,
                     MIN_SPLIT_TOKENS=128, PRECISION="tf32", KV_FP8=fp8, STORE_KV=store, ROTARY=rotary,
                     PDL=pdl, TOKENS_PER_REQ=tokens)), triggers=False)
        for tree in (False, True):  # TREE: a draft tree's verify step (tree mask, positions by depth)
            checks[f"extend[{kv}" + (",tree]" if tree else "]")] = lambda kv=kv, fp8=fp8, tree=tree: _compile(
                extend._extend_kernel,
                {"Q": "*bf16", "K_new": "*bf16", "V_new": "*bf16", "O": "*bf16", "K_cache": f"*{kv}",
                 "V_cache": f"*{kv}", "Req_to_token": "*i32", "Req_pool_indices": "*i64", "Extend_start_loc": "*i64",
                 "Extend_seq_lens": "*i64", "Extend_prefix_lens": "*i64",
                 "Tree_mask": "*u8" if tree else "*i64", "Positions": "*i64"},
                {"qk_scale", "k_scale", "v_scale"},
                dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, PRECISION="tf32", KV_FP8=fp8,
                     TREE=tree))
    checks["flashinfer_page_table"] = lambda: _compile(
        _page_table_kernel(), {"req_to_token": "*i32", "req_pool_indices": "*i64", "seq_lens": "*i64",
                               "kv_indptr": "*i32", "kv_indices": "*i32"}, set(), dict(PAGE_SIZE=16, BLOCK=128))
    return checks


def _model_kernels() -> dict:
    from treadle.kernels import argmax as argmax_kernel, kv_store
    from treadle.kernels import exact_top_logits as exact_top_logits_kernels, fp8 as fp8_kernels, fused as fused_kernels, fused_moe as fused_moe_kernels

    return {
        "add_rmsnorm": lambda: _check_pdl(True, _compile(
            fused_kernels._add_rmsnorm_kernel,
            {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16",
             "residual_out_ptr": "*bf16"}, {"eps"}, dict(HAS_RESIDUAL=True, BLOCK=4096, PDL=True)), triggers=False),
        "rotary_qkv": lambda: _compile(
            fused_kernels._rotary_qkv_kernel,
            {"qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_ptr": "*bf16", "k_ptr": "*bf16",
             "v_ptr": "*bf16"}, set(), dict(HEADS=32, KV_HEADS=8, HALF=64)),
        "rotary_qk_float32": lambda: _compile(
            fused_kernels._rotary_qk_float32_kernel,
            {"qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16"}, set(),
            dict(HEADS=16, BLOCK=64)),
        "silu_mul": lambda: _compile(
            fused_kernels._silu_mul_kernel, {"gate_up_ptr": "*bf16", "out_ptr": "*bf16"}, set(), dict(BLOCK=1024)),
        "fp8_per_token_quant": lambda: _compile(
            fp8_kernels._per_token_quant_kernel, {"X": "*bf16", "Q": "*fp8e4nv", "Scale": "*fp32"},
            {"fp8_max", "min_scale"}, dict(BLOCK=4096, SINGLE_PASS=True)),
        "small_batch[fp8]": _small_batch("*fp8e4nv", BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=1,
                                         GEMV=False, HAS_SCALE=True),
        "small_batch[fp8,split_k]": _small_batch("*fp8e4nv", BLOCK_M=32, BLOCK_N=64, BLOCK_K=256, SPLIT_K=4,
                                                 GEMV=False, HAS_SCALE=True),
        "small_batch[fp8,gemv]": _small_batch("*fp8e4nv", BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, SPLIT_K=1,
                                              GEMV=True, HAS_SCALE=True),
        "small_batch[fp8,gemv,pdl]": _small_batch("*fp8e4nv", BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, SPLIT_K=1,
                                                  GEMV=True, HAS_SCALE=True, PDL=True),
        "small_batch[bf16,gemv,silu_mul,pdl]": _small_batch("*bf16", BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048,
                                                                 SPLIT_K=1, GEMV=True, HAS_SCALE=False, EVEN=True,
                                                                 SILU_MUL=True, PDL=True),
        "small_batch[fp8,gemv,even]": _small_batch("*fp8e4nv", BLOCK_M=1, BLOCK_N=4, BLOCK_K=2048, SPLIT_K=1,
                                                   GEMV=True, HAS_SCALE=True, EVEN=True),
        "small_batch[bf16,gemv,split_k]": _small_batch("*bf16", BLOCK_M=1, BLOCK_N=32, BLOCK_K=256,
                                                       SPLIT_K=8, GEMV=True, HAS_SCALE=False),
        "small_batch[bf16]": _small_batch("*bf16", BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1,
                                          GEMV=False, HAS_SCALE=False),
        "small_batch[fp8,gemv,silu_mul]": _small_batch("*fp8e4nv", BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048, SPLIT_K=1,
                                                       GEMV=True, HAS_SCALE=True, EVEN=True, SILU_MUL=True),
        "small_batch[bf16,gemv,silu_mul]": _small_batch("*bf16", BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048, SPLIT_K=1,
                                                        GEMV=True, HAS_SCALE=False, SILU_MUL=True),
        "small_batch[bf16,gemv,add_rmsnorm]": _small_batch("*bf16", BLOCK_M=1, BLOCK_N=4, BLOCK_K=2048, SPLIT_K=1,
                                                           GEMV=True, HAS_SCALE=False, EVEN=True, ADD_RMSNORM=True,
                                                           BLOCK_ROW=4096),
        "small_batch[fp8,gemv,split_k,add_rmsnorm]": _small_batch("*fp8e4nv", BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024,
                                                                  SPLIT_K=2, GEMV=True, HAS_SCALE=True, EVEN=True,
                                                                  ADD_RMSNORM=True, BLOCK_ROW=4096),
        "small_batch[bf16,silu_mul]": _small_batch("*bf16", BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1,
                                                   GEMV=False, HAS_SCALE=False, SILU_MUL=True),
        # The L2 prefetch of the next layer's weight must reach the PTX as an instruction (not optimized away).
        "small_batch[bf16,gemv,prefetch]": _small_batch("*bf16", BLOCK_M=1, BLOCK_N=4, BLOCK_K=2048, SPLIT_K=1,
                                                        GEMV=True, HAS_SCALE=False, EVEN=True, PREFETCH=True,
                                                        PREFETCH_BLOCK=256, expect_in_ptx="prefetch.global.L2"),
        "small_batch[fp8,split_k,prefetch]": _small_batch("*fp8e4nv", BLOCK_M=32, BLOCK_N=64, BLOCK_K=256,
                                                          SPLIT_K=4, GEMV=False, HAS_SCALE=True, PREFETCH=True,
                                                          PREFETCH_BLOCK=64, expect_in_ptx="prefetch.global.L2"),
        # W8A8 tiles run 64 rows (small_batch_matmul pads to them): FP8 x FP8 on Hopper's wgmma.
        "small_batch[fp8,w8a8]": _small_batch("*fp8e4nv", BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, SPLIT_K=1, GEMV=False,
                                              HAS_SCALE=True, W8A8=True, expect_in_ptx="f32.e4m3.e4m3"),
        "small_batch[fp8,w8a8,split_k]": _small_batch("*fp8e4nv", BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4,
                                                      GEMV=False, HAS_SCALE=True, W8A8=True),
        "small_batch[fp8,w8a8,silu_mul]": _small_batch("*fp8e4nv", BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, SPLIT_K=1,
                                                       GEMV=False, HAS_SCALE=True, W8A8=True, SILU_MUL=True),
        # Launched with PDL, a tile asks L2 for its first weight blocks before it waits for the kernel before.
        "small_batch[bf16,silu_mul,pdl]": _small_batch("*bf16", BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1,
                                                       GEMV=False, HAS_SCALE=False, SILU_MUL=True, PDL=True,
                                                       expect_in_ptx="prefetch.global.L2"),
        "small_batch[fp8,w8a8,split_k,pdl]": _small_batch("*fp8e4nv", BLOCK_M=64, BLOCK_N=64, BLOCK_K=128,
                                                          SPLIT_K=4, GEMV=False, HAS_SCALE=True, W8A8=True, PDL=True),
        "moe_grouped_gemm": lambda: _compile(
            fused_moe_kernels._grouped_gemm_kernel,
            {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "row_weight_ptr": "*bf16",
             "sorted_rows_ptr": "*i64", "block_experts_ptr": "*i64", "scale_ptr": "*fp32", "a_scale_ptr": "*fp32"},
            set(), dict(MUL_ROW_WEIGHT=True, HAS_SCALE=False, FP8_ROWS=False, IEEE_FP32=False, BLOCK_M=64, BLOCK_N=64,
                        BLOCK_K=64)),
        "store_kv[fp8e4nv]": lambda: _compile(
            kv_store._store_kv_kernel, {"K": "*bf16", "V": "*bf16", "K_cache": "*fp8e4nv", "V_cache": "*fp8e4nv",
                                        "Loc": "*i64"}, {"k_scale", "v_scale", "fp8_max"},
            dict(BLOCK=1024, TO_FP8=True)),
        "argmax": lambda: _compile(argmax_kernel._argmax_kernel, {"X": "*bf16", "Out": "*i64"}, set(),
                                   dict(BLOCK=4096)),
        "argmax_blocks": lambda: _compile(
            argmax_kernel._argmax_blocks_kernel,
            {"X": "*bf16", "Out": "*i64", "Block_value": "*fp32", "Block_at": "*i32", "Counters": "*i32"}, set(),
            dict(BLOCK=4096, BLOCKS=32)),
        "exact_top_chunks": lambda: _compile(
            exact_top_logits_kernels._chunk_top_kernel, {"Logits": "*bf16", "Values": "*fp32", "Columns": "*i32"},
            set(), dict(K=8, CHUNK=2048)),
        "exact_top_recompute": lambda: _compile(
            exact_top_logits_kernels._recompute_kernel,
            {"Values": "*fp32", "Columns": "*i32", "X": "*bf16", "W": "*bf16", "Logits": "*bf16"}, set(),
            dict(CANDIDATES=512, BLOCK_H=4096)),
        "moe_gate_up_gemv": lambda: _compile(
            fused_moe_kernels._moe_gate_up_gemv_kernel,
            {"X": "*bf16", "W13": "*bf16", "Scale": "*fp32", "Ids": "*i64", "Out": "*bf16"},
            set(), dict(BLOCK_N=4, BLOCK_K=2048, EVEN=False, HAS_SCALE=False)),
        "moe_down_gemv[fp8]": lambda: _compile(
            fused_moe_kernels._moe_down_gemv_kernel, {"Act": "*bf16", "W2": "*fp8e4nv", "Scale": "*fp32",
                                                      "Ids": "*i64", "Route_weights": "*fp32", "Out": "*bf16"},
            set(), dict(TOP_K=2, BLOCK_N=4, BLOCK_K=2048, EVEN=True, HAS_SCALE=True)),
        "moe_gate_up_gemv[fp8]": lambda: _compile(
            fused_moe_kernels._moe_gate_up_gemv_kernel,
            {"X": "*bf16", "W13": "*fp8e4nv", "Scale": "*fp32", "Ids": "*i64", "Out": "*bf16"},
            set(), dict(BLOCK_N=4, BLOCK_K=2048, EVEN=True, HAS_SCALE=True)),
        "moe_count_experts": lambda: _compile(
            fused_moe_kernels._count_experts_kernel, {"Ids": "*i64", "Chunk_counts": "*i32"}, set(),
            dict(CHUNK=4096, EXPERTS_POW2=256)),
        # One program sorting a few assignments (it counts them itself), and one chunk of a large prefill.
        "moe_align[single_chunk]": _moe_align(CHUNK=4096, EXPERTS_POW2=128, SINGLE_CHUNK=True, BLOCK_M=16, BLOCKS=32),
        "moe_align": _moe_align(CHUNK=4096, EXPERTS_POW2=256, SINGLE_CHUNK=False, BLOCK_M=128, BLOCKS=16),
        "moe_grouped_gemm[fp8]": lambda: _compile(
            fused_moe_kernels._grouped_gemm_kernel,
            {"a_ptr": "*bf16", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "row_weight_ptr": "*fp32",
             "sorted_rows_ptr": "*i64", "block_experts_ptr": "*i64", "scale_ptr": "*fp32", "a_scale_ptr": "*fp32"},
            set(), dict(MUL_ROW_WEIGHT=True, HAS_SCALE=True, FP8_ROWS=False, IEEE_FP32=False, BLOCK_M=64, BLOCK_N=64,
                        BLOCK_K=64)),
        # W8A8: FP8 rows times FP8 experts, on the FP8 tensor cores (wgmma) in 64+-row tiles; 16-row tiles (mma)
        # widen both to f16, exactly.
        **{f"moe_grouped_gemm[w8a8,{block_m}]": lambda block_m=block_m: _expect_in_ptx(_compile(
            fused_moe_kernels._grouped_gemm_kernel,
            {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "row_weight_ptr": "*fp32",
             "sorted_rows_ptr": "*i64", "block_experts_ptr": "*i64", "scale_ptr": "*fp32", "a_scale_ptr": "*fp32"},
            set(), dict(MUL_ROW_WEIGHT=True, HAS_SCALE=True, FP8_ROWS=True, IEEE_FP32=False, BLOCK_M=block_m,
                        BLOCK_N=128, BLOCK_K=128)), "f32.e4m3.e4m3" if block_m >= 64 else "mma")
           for block_m in (16, 128)},
    }


def _lora_kernels() -> dict:
    from treadle.kernels import lora, lora_dense, lora_fused, lora_sorted, lora_tiles

    shrink = {"X": "*bf16", "A": "*bf16", "Ids": "*i64", "Scalings": "*fp32", "Ranks": "*i32", "H": "*bf16"}
    expand = {"H": "*bf16", "B": "*bf16", "Ids": "*i64", "Scalings": "*fp32", "Ranks": "*i32", "Out": "*bf16"}
    fp32 = {name: "*fp32" if kind == "*bf16" else kind for name, kind in shrink.items()}
    # add_delta's halves: float32 partial sums out of the shrink, into the expand
    partials, summed = {**shrink, "H": "*fp32"}, {**expand, "H": "*fp32"}
    return {
        "lora_shrink_gather[pdl]": lambda: _check_pdl(True, _compile(
            lora._shrink_gather_kernel, shrink, set(), dict(BLOCK_R=2, BLOCK_K=4096, FINAL=True, PDL=True,
                                                            GO_AHEAD=False, AHEAD=False)), triggers=False),
        "lora_shrink_gather[in=14336]": lambda: _compile(
            lora._shrink_gather_kernel, partials, set(), dict(BLOCK_R=1, BLOCK_K=16384, FINAL=False, PDL=False,
                                                              GO_AHEAD=False, AHEAD=False)),
        "lora_shrink_gather[split-k,go-ahead]": lambda: _check_pdl(True, _compile(
            lora._shrink_gather_kernel, partials, set(), dict(BLOCK_R=4, BLOCK_K=512, FINAL=False, PDL=True,
                                                              GO_AHEAD=True, AHEAD=False))),
        # the looped form (LoRAKernelChoice.shrink_loop_above; the default past 16 tokens: 4 rows over chunks of
        # 2048, each loaded in its turn), the next chunk ahead in registers, or copied into shared memory by
        # Triton's pipeline (shrink_loop_stages)
        "lora_shrink_gather[loop,go-ahead]": lambda: _check_pdl(True, _compile(
            lora._shrink_gather_kernel, partials, set(), dict(BLOCK_R=4, BLOCK_K=2048, FINAL=False, PDL=True,
                                                              GO_AHEAD=True, AHEAD=0))),
        "lora_shrink_gather[loop,ahead]": lambda: _compile(
            lora._shrink_gather_kernel, partials, set(), dict(BLOCK_R=16, BLOCK_K=512, FINAL=False, PDL=True,
                                                              GO_AHEAD=True, AHEAD=1)),
        "lora_shrink_gather[loop,stages=3]": lambda: _check_pdl(True, _compile(
            lora._shrink_gather_kernel, shrink, set(), dict(BLOCK_R=16, BLOCK_K=512, FINAL=True, PDL=True,
                                                            GO_AHEAD=True, AHEAD=3))),
        "lora_expand_gather[pdl]": lambda: _check_pdl(True, _compile(
            lora._expand_gather_kernel, expand, set(), dict(BLOCK_N=512, BLOCK_R=16, SPLIT=1, PARTIAL=False,
                                                            PDL=True, GO_AHEAD=False)), triggers=False),
        "lora_expand_gather[split-k,go-ahead]": lambda: _check_pdl(True, _compile(
            lora._expand_gather_kernel, summed, set(), dict(BLOCK_N=64, BLOCK_R=16, SPLIT=28, PARTIAL=True,
                                                            PDL=True, GO_AHEAD=True))),
        "lora_expand_grouped": lambda: _compile(
            lora._expand_grouped_kernel, summed, set(), dict(SPAN=256, BLOCK_M=64, BLOCK_N=128, BLOCK_R=16, SPLIT=1,
                                                             PARTIAL=True, IEEE=False)),
        "lora_shrink_segmented": lambda: _compile(
            lora._shrink_segmented_kernel, partials, set(), dict(BLOCK_M=64, BLOCK_R=16, BLOCK_K=128, FINAL=False,
                                                                 IEEE=False)),
        "lora_shrink_segmented[fp32]": lambda: _compile(
            lora._shrink_segmented_kernel, fp32, set(), dict(BLOCK_M=32, BLOCK_R=64, BLOCK_K=128, FINAL=True,
                                                             IEEE=True)),
        "lora_expand_segmented": lambda: _compile(
            lora_tiles._expand_segmented_kernel, {**summed, "Order": "*i64"}, set(),
            dict(BLOCK_M=64, BLOCK_N=128, BLOCK_R=64, SPLIT=1, PARTIAL=True, SORTED=False, IEEE=False)),
        "lora_expand_segmented[sorted]": lambda: _compile(
            lora_tiles._expand_segmented_kernel, {**summed, "Order": "*i64"}, set(),
            dict(BLOCK_M=64, BLOCK_N=128, BLOCK_R=64, SPLIT=8, PARTIAL=True, SORTED=True, IEEE=False)),
        # add_delta past 64 tokens: the tokens in slot order, split-K partials in sorted rows
        "lora_shrink_sorted": lambda: _compile(
            lora_sorted._shrink_sorted_kernel, {**partials, "Order": "*i64"}, set(),
            dict(BLOCK_M=32, BLOCK_R=64, BLOCK_K=128, IEEE=False)),
        "lora_expand_sorted": lambda: _compile(
            lora_sorted._expand_sorted_kernel, {**summed, "Order": "*i64"}, set(),
            dict(GROUP=4, BLOCK_M=64, BLOCK_N=128, BLOCK_R=16, SPLIT=16, IEEE=False)),
        # kernels/lora_fused.py: a layer's LoRA in two launches (the shrink in the small-batch matmul's launch)
        "small_batch[bf16,gemv,lora_shrink,pdl]": _small_batch("*bf16", BLOCK_M=1, BLOCK_N=4, BLOCK_K=2048, SPLIT_K=1,
                                                              GEMV=True, HAS_SCALE=False, EVEN=True, PDL=True,
                                                              LORA=True, L_BLOCK_R=4, L_BLOCK_K=512),
        "lora_expand_silu_mul[pdl]": lambda: _check_pdl(True, _compile(
            lora_fused._expand_silu_mul_kernel, {**summed, "Gate_up": "*bf16"}, set(),
            dict(BLOCK_N=64, BLOCK_R=16, SPLIT=8, PDL=True, GO_AHEAD=True))),
        "lora_expand_add_rmsnorm[pdl]": lambda: _check_pdl(True, _compile(
            lora_fused._expand_add_rmsnorm_kernel,
            {**summed, "Y": "*bf16", "Residual": "*bf16", "Norm_weight": "*bf16", "Normed": "*bf16",
             "Residual_out": "*bf16", "Counts": "*i32"}, {"eps"},
            dict(BLOCK_N=64, BLOCK_R=16, SPLIT=8, BLOCK_ROW=4096, RESIDUAL_FIRST=True, PDL=True, GO_AHEAD=True))),
        "lora_dense_mask": lambda: _compile(  # q/k/v at rank 16: 48 rows a slot
            lora_dense._keep_own_slot, {"every_ptr": "*bf16", "ids_ptr": "*i64", "masked_ptr": "*bf16"}, set(),
            dict(SLOTS=32, RANK=16, PARTS=3, BLOCK_TOKENS=64, BLOCK_RANK=16)),
    }


def _stream_kernel():
    from treadle.bench.gemv_stream import _stream_kernel as kernel  # bench/gemv_stream.py's loads-only GEMV

    return kernel


def _int_weight_kernels() -> dict:
    """kernels/packed_int_natural.py's W4A16 tensor-core kernel (bf16 with PDL, and fp16 with zero points and split-K
    without): its panel's wgmmas read the widened weight from registers and wait for all that are pending once, after
    the loop."""
    from treadle.kernels import packed_int_natural

    pointers = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16",
                "partials_ptr": "*fp32", "arrivals_ptr": "*i32", "prefetch_ptr": "*i32"}
    fp16 = {name: "*fp16" if kind == "*bf16" else kind for name, kind in pointers.items()}

    def check(types: dict[str, str], **constexprs: object) -> None:
        compiled = _compile(packed_int_natural._natural_mma_kernel, types, set(),
                            {"GROUP": 128, "ASM": True, "PREFETCH_BLOCK": 1, "HEAD_LINES": 2, "SILU_MUL": False,
                             **constexprs},
                            aligned=set(types) | {"N", "k_per_split", "stride_xm", "stride_wn", "stride_sn",
                                                  "stride_om"}, num_warps=4, num_stages=4)
        ptx = compiled.asm["ptx"]
        assert f"wgmma.mma_async.sync.aligned.m64n{constexprs['BLOCK_M']}k16.f32" in ptx
        assert ptx.count("wgmma.wait_group.sync.aligned 0;") == 1
        _check_pdl(constexprs["PDL"], compiled)

    return {
        "natural_mma[bf16,32,pdl]": lambda: check(pointers, HAS_ZEROS=False, SPLIT_K=1, SUM_CHUNK=1, MAGIC16=0x4300,
                                                  EVEN_N=True, BLOCK_M=32, BLOCK_N=128, PDL=True, PREFETCH=True),
        "natural_mma[fp16,zeros,32,split_k]": lambda: check(fp16, HAS_ZEROS=True, SPLIT_K=8, SUM_CHUNK=4,
                                                            MAGIC16=0x6400, EVEN_N=False, BLOCK_M=32, BLOCK_N=128,
                                                            PDL=False, PREFETCH=False),
        "natural_mma[bf16,16,pdl,head_lines]": lambda: check(
            pointers, HAS_ZEROS=False, SPLIT_K=8, SUM_CHUNK=4, MAGIC16=0x4300, EVEN_N=True, BLOCK_M=16, BLOCK_N=128,
            PDL=True, PREFETCH=True, HEAD_LINES=8),
        "natural_mma[bf16,32,pdl,silu_mul]": lambda: check(  # partials_ptr: the matmul's bf16 output
            {**pointers, "partials_ptr": "*bf16"}, HAS_ZEROS=False, SPLIT_K=1, SUM_CHUNK=1, MAGIC16=0x4300,
            EVEN_N=True, BLOCK_M=32, BLOCK_N=128, PDL=True, PREFETCH=True, SILU_MUL=True),
        "gemv_stream": lambda: _compile(_stream_kernel(), {"w_ptr": "*i32", "out_ptr": "*i32"}, set(),
                                        {"BLOCK_N": 8, "BLOCK_W": 128}, aligned={"w_ptr", "out_ptr", "words_per_split", "stride_wn"},
                                        num_warps=1),
        "wide_mma[bf16,128x128,pdl]": lambda: _check_wide(pointers, 4, HAS_ZEROS=False, SPLIT_K=1, SUM_CHUNK=1,
                                                           MAGIC16=0x4300, EVEN_N=True, BLOCK_N=128, PDL=True),
        "wide_mma[fp16,zeros,128x256,split_k]": lambda: _check_wide(fp16, 8, HAS_ZEROS=True, SPLIT_K=4, SUM_CHUNK=1,
                                                                     MAGIC16=0x6400, EVEN_N=False, BLOCK_N=256,
                                                                     PDL=False),
        "wide_mma[bf16,tokens_m,128x128]": lambda: _check_wide(pointers, 8, HAS_ZEROS=False, SPLIT_K=1, SUM_CHUNK=1,
                                                                MAGIC16=0x4300, EVEN_N=True, BLOCK_N=128, PDL=True,
                                                                TOKENS_M=True),
    }


def _check_wide(types: dict[str, str], num_warps: int, **constexprs: object) -> None:
    """kernels/packed_int_wide.py's kernel (128 tokens a tile): 128-token wgmmas from the widened weight in registers,
    all waited for once, after the loop; the other orientation (TOKENS_M, 128 registers a thread, two stages):
    64-token wgmmas by 128 weight rows whose widened panel is stored to shared memory."""
    from treadle.kernels import packed_int_wide

    types = {name: kind for name, kind in types.items() if name != "prefetch_ptr"}
    constexprs = {"TOKENS_M": False, **constexprs}
    tokens_m = constexprs["TOKENS_M"]
    compiled = _compile(packed_int_wide._wide_mma_kernel, types, set(), dict(GROUP=128, ASM=True, BLOCK_M=128,
                                                                             **constexprs),
                        aligned=set(types) | {"N", "k_per_split", "stride_xm", "stride_wn", "stride_sn",
                                              "stride_om"}, num_warps=num_warps, num_stages=2 if tokens_m else 3,
                        **({"maxnreg": 128} if tokens_m else {}))
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32" in ptx
    if tokens_m:
        assert "st.shared" in ptx
    else:
        assert ptx.count("wgmma.wait_group.sync.aligned 0;") == 1
    _check_pdl(constexprs["PDL"], compiled)


def _expect_in_ptx(compiled, text: str) -> None:
    assert text in compiled.asm["ptx"], f"{text!r} not in the PTX"


def _check_pdl(pdl: bool, compiled, triggers: bool = True) -> None:
    """A kernel compiled for PDL waits for the kernel before it and (``triggers``) lets the next one start
    (kernels/pdl.py); compiled without, it does neither."""
    ptx = compiled.asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == pdl
    assert ("griddepcontrol.launch_dependents" in ptx) == (pdl and triggers)


def _moe_align(**constexprs: object):
    """The fused-MoE align kernel with these constexprs; its slot claims are relaxed atomics (no fence per add)."""
    from treadle.kernels import fused_moe as fused_moe_kernels

    def check() -> None:
        compiled = _compile(fused_moe_kernels._align_kernel,
                            {"Ids": "*i64", "Chunk_counts": "*i32", "Cursors": "*i32", "Sorted_rows": "*i64",
                             "Block_experts": "*i64"}, set(), constexprs)
        ptx = compiled.asm["ptx"]
        assert "atom.global.gpu.relaxed.add" in ptx and "fence" not in ptx and "membar" not in ptx

    return check


def _small_batch(weight_type: str, expect_in_ptx: str | None = None, **constexprs: object):
    """The small-batch matmul kernel with these constexprs (split-K variants also write float32 partials; bounds
    masks unless EVEN is given; SILU_MUL: the gated-MLP epilogue; 16-bit weights' tiles load with evict_first;
    PREFETCH: the L2 prefetch of the next weight), whose PTX holds ``expect_in_ptx`` if given."""
    from treadle.kernels import small_batch as small_batch_kernels

    constexprs = {"EVEN": False, "SILU_MUL": False, "EVICT_ROWS": weight_type == "*bf16", "ADD_RMSNORM": False,
                  "BLOCK_ROW": 1, "PREFETCH": False, "PREFETCH_BLOCK": 1, "W8A8": False, "PDL": False, "LORA": False,
                  "L_BLOCK_R": 1, "L_BLOCK_K": 1, "L_AHEAD": 0, **constexprs}

    def check() -> None:
        compiled = _compile(small_batch_kernels._small_batch_kernel,
                            {"X": "*fp8e4nv" if constexprs["W8A8"] else "*bf16", "W": weight_type, "Scale": "*fp32",
                             "Y": "*bf16", "Partials": "*fp32", "Arrivals": "*i32", "Residual": "*bf16",
                             "Norm_weight": "*bf16", "Normed": "*bf16", "Residual_out": "*bf16", "Prefetch": "*u8",
                             "X_scale": "*fp32", "La": "*bf16", "Lids": "*i64", "Lscalings": "*fp32",
                             "Lranks": "*i32", "Lpartials": "*fp32"}, {"eps"}, constexprs)
        assert expect_in_ptx is None or expect_in_ptx in compiled.asm["ptx"], f"no {expect_in_ptx} in the PTX"
        _check_pdl(constexprs["PDL"], compiled)

    return check


KERNELS = ["decode[bf16,store_kv=False]", "decode[bf16,store_kv=True]", "decode[bf16,store_kv=True,rotary]",
           "decode[bf16,store_kv=True,rotary,pdl]", "decode[bf16,store_kv=False,verify5]",
           "decode[fp8e4nv,store_kv=False]", "decode[fp8e4nv,store_kv=True]",
           "decode[fp8e4nv,store_kv=True,rotary]", "decode[fp8e4nv,store_kv=True,rotary,pdl]",
           "decode[fp8e4nv,store_kv=False,verify5]",
           "extend[bf16]", "extend[fp8e4nv]", "extend[bf16,tree]", "extend[fp8e4nv,tree]",
           "flashinfer_page_table", "add_rmsnorm", "rotary_qkv", "rotary_qk_float32", "silu_mul", "fp8_per_token_quant", "small_batch[fp8]",
           "small_batch[fp8,split_k]", "small_batch[fp8,gemv]", "small_batch[fp8,gemv,pdl]",
           "small_batch[bf16,gemv,silu_mul,pdl]", "small_batch[fp8,gemv,even]",
           "small_batch[bf16,gemv,split_k]", "small_batch[bf16]", "small_batch[fp8,gemv,silu_mul]",
           "small_batch[bf16,gemv,silu_mul]", "small_batch[bf16,gemv,add_rmsnorm]",
           "small_batch[fp8,gemv,split_k,add_rmsnorm]", "small_batch[bf16,silu_mul]", "small_batch[bf16,gemv,prefetch]",
           "small_batch[fp8,split_k,prefetch]", "small_batch[fp8,w8a8]", "small_batch[fp8,w8a8,split_k]",
           "small_batch[fp8,w8a8,silu_mul]", "small_batch[bf16,silu_mul,pdl]", "small_batch[fp8,w8a8,split_k,pdl]",
           "moe_grouped_gemm", "store_kv[fp8e4nv]", "argmax", "argmax_blocks", "exact_top_chunks", "exact_top_recompute", "moe_gate_up_gemv", "moe_down_gemv[fp8]",
           "moe_gate_up_gemv[fp8]", "moe_grouped_gemm[fp8]", "moe_count_experts", "moe_align[single_chunk]",
           "moe_align", "moe_grouped_gemm[w8a8,16]", "moe_grouped_gemm[w8a8,128]",
           "lora_shrink_gather[pdl]", "lora_shrink_gather[in=14336]", "lora_shrink_gather[split-k,go-ahead]",
           "lora_shrink_gather[loop,go-ahead]", "lora_shrink_gather[loop,ahead]", "lora_shrink_gather[loop,stages=3]",
           "lora_expand_gather[pdl]", "lora_expand_gather[split-k,go-ahead]", "lora_expand_grouped",
           "lora_shrink_segmented", "lora_shrink_segmented[fp32]", "lora_expand_segmented",
           "lora_expand_segmented[sorted]", "lora_shrink_sorted", "lora_expand_sorted",
           "small_batch[bf16,gemv,lora_shrink,pdl]", "lora_expand_silu_mul[pdl]", "lora_expand_add_rmsnorm[pdl]",
           "lora_dense_mask", "natural_mma[bf16,32,pdl]", "natural_mma[fp16,zeros,32,split_k]",
           "natural_mma[bf16,16,pdl,head_lines]",
           "natural_mma[bf16,32,pdl,silu_mul]",
           "wide_mma[bf16,128x128,pdl]", "wide_mma[fp16,zeros,128x256,split_k]", "wide_mma[bf16,tokens_m,128x128]",
           "gemv_stream"]


def _compile_all() -> dict[str, str | None]:
    results: dict[str, str | None] = {}
    for name, check in {**_attention_kernels(), **_model_kernels(), **_lora_kernels(),
                        **_int_weight_kernels()}.items():
        try:
            check()
            results[name] = None
        except Exception:  # reported per kernel so one failure does not hide the others
            results[name] = traceback.format_exc()
    return results


if __name__ == "__main__":
    print(RESULT_MARKER + json.dumps(_compile_all()))
    sys.exit(0)


@pytest.fixture(scope="module")
def compile_results() -> dict[str, str | None]:
    from aot_compile import compile_in_subprocess

    return compile_in_subprocess(__file__, RESULT_MARKER)


def test_every_kernel_is_checked(compile_results):
    assert sorted(compile_results) == sorted(KERNELS)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_compiles_for_sm90(kernel, compile_results):
    assert compile_results[kernel] is None, compile_results[kernel]
