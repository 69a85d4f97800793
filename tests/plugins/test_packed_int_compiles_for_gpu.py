"""The integer-weight Triton kernels (kernels/packed_int.py) compile for an H100 (sm_90) on a machine without a GPU:
the interpreter accepts code the real compiler rejects (see test_triton_compiles_for_gpu.py, whose compile helper
this reuses). Split-K, the SiLU·mul and add+RMSNorm epilogues, zero points, both ways of widening, act-order, 4 and 8
bits, the L2 prefetch of the next weight (inline PTX, which the interpreter cannot run), the integer experts' fused-MoE
kernels (the magic-widening grouped GEMM too), and the sweep's candidate tiles (kernels/packed_int_mma.py, and
kernels/packed_int_magic.py's, inline PTX included)."""

from __future__ import annotations

import importlib.util
import json
import sys
import traceback
from pathlib import Path

import pytest

RESULT_MARKER = "AOT-RESULTS:"
POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "g_ptr": "*i32",
            "partials_ptr": "*fp32", "arrivals_ptr": "*i32", "residual_ptr": "*bf16", "norm_weight_ptr": "*bf16",
            "normed_ptr": "*bf16", "residual_out_ptr": "*bf16", "prefetch_ptr": "*u8"}


def _variants() -> dict[str, tuple[str, dict[str, str], dict[str, object]]]:
    # (words per step, zeros, split-K, SiLU·mul, add+RMSNorm, bits) for the GEMV; every constexpr branch is taken
    # at least once.
    gemvs = [(16, False, 1, False, False, 4), (32, True, 4, False, False, 4), (16, True, 1, True, False, 4),
             (32, False, 2, False, False, 8), (16, False, 1, False, True, 4), (32, False, 8, False, True, 4)]
    variants = {}
    for block_w, zeros, split, silu, norm, bits in gemvs:
        name = f"gemv[words={block_w},zeros={zeros},split_k={split},silu_mul={silu},add_rmsnorm={norm},bits={bits}]"
        variants[name] = ("_int_gemv_kernel", {"out_ptr": "*bf16"},
                          dict(BITS=bits, GROUP=128, HAS_ZEROS=zeros, SPLIT_K=split, SILU_MUL=silu, ADD_RMSNORM=norm,
                               BLOCK_ROW=4096 if norm else 1, BLOCK_N=16, BLOCK_W=block_w, PDL=True, SUBNORMAL=False,
                               **_prefetch(split > 1)))
    # The subnormal widening (the loader's 4-bit configs), with the SiLU·mul epilogue and with split-K and zero
    # points.
    for zeros, split, silu in ((False, 1, True), (True, 4, False)):
        variants[f"gemv[subnormal,zeros={zeros},split_k={split},silu_mul={silu}]"] = (
            "_int_gemv_kernel", {"out_ptr": "*bf16"},
            dict(BITS=4, GROUP=128, HAS_ZEROS=zeros, SPLIT_K=split, SILU_MUL=silu, ADD_RMSNORM=False, BLOCK_ROW=1,
                 BLOCK_N=8, BLOCK_W=64, PDL=True, SUBNORMAL=True, **_prefetch(silu)))
    for i16, bits, block_m, split, group in ((True, 4, 16, 2, 128), (False, 8, 64, 1, 32), (False, 4, 64, 1, 64)):
        name = f"dot[i16={i16},bits={bits},block_m={block_m},split_k={split},group={group}]"
        variants[name] = ("_int_dot_kernel", {"out_ptr": "*bf16"},
                          dict(BITS=bits, GROUP=group, HAS_ZEROS=True, SPLIT_K=split, I16=i16, MAGIC16=0x4300,
                               OFFSET16=128.0, BLOCK_M=block_m, BLOCK_N=64))
    # The sweep's candidate tiles (kernels/packed_int_mma.py): per-slot dots, whole panels scaled after the dot, two
    # panels scaled before it (groups smaller than the step) with the weight as the second operand.
    mma = dict(BITS=4, MAGIC16=0x4300, OFFSET16=128.0, BLOCK_M=16, BLOCK_N=128, PANELS=1, SWAP=True,
               SCALE_IN_REGS=False, I16=True, PER_SLOT=False)
    for name, switches in {"per_slot": dict(PER_SLOT=True, HAS_ZEROS=True, SPLIT_K=2, GROUP=128),
                           "panel": dict(HAS_ZEROS=False, SPLIT_K=1, GROUP=128),
                           "panels_scaled": dict(PANELS=2, SCALE_IN_REGS=True, I16=False, SWAP=False, BLOCK_M=32,
                                                 HAS_ZEROS=True, SPLIT_K=1, GROUP=64)}.items():
        variants[f"mma[{name}]"] = ("packed_int_mma._int_mma_kernel", {"out_ptr": "*bf16"}, {**mma, **switches})
    # kernels/packed_int_magic.py's tensor-core kernel with the inline PTX widening (fp16's magic number scaled after
    # the dots, bf16's with zero points scaled before them).
    for dtype, magic, offset, scaled in (("fp16", 0x6400, 1024.0, False), ("bf16", 0x4300, 128.0, True)):
        variants[f"magic_mma[{dtype}{',scaled' if scaled else ''}]"] = (
            "packed_int_magic._magic_mma_kernel", {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "s_ptr": f"*{dtype}",
                                                   "z_ptr": f"*{dtype}"},
            dict(GROUP=128, HAS_ZEROS=dtype == "bf16", SPLIT_K=2, MAGIC16=magic, OFFSET16=offset, ASM=True,
                 SCALED=scaled, BLOCK_M=16 if dtype == "bf16" else 32, BLOCK_N=128, **_prefetch(scaled)))
    # The large batches' dequantization: a group per two value slots, per column (act-order) at 8 bits (a group per
    # panel: the 16-byte check below).
    for bits, group, zeros, gidx in ((4, 32, True, False), (8, 128, True, True)):
        variants[f"dequantize[bits={bits},group={group},zeros={zeros},g_idx={gidx}]"] = (
            "packed_int_dequant._dequantize_kernel", {"out_ptr": "*bf16"},
            dict(BITS=bits, GROUP=group, HAS_ZEROS=zeros, HAS_GIDX=gidx, BLOCK_N=32))
    # The integer experts' fused-MoE kernels (kernels/packed_int_moe.py).
    moe = {"ids_ptr": "*i64", "out_ptr": "*bf16", "act_ptr": "*bf16", "a_ptr": "*bf16", "route_ptr": "*fp32",
           "c_ptr": "*bf16", "row_weight_ptr": "*fp32", "sorted_rows_ptr": "*i64", "block_experts_ptr": "*i64"}
    gemv = dict(BITS=4, GROUP=128, HAS_ZEROS=True, BLOCK_N=16, BLOCK_W=32)
    variants["moe_gate_up_gemv"] = ("packed_int_moe._moe_int_gate_up_kernel", moe, gemv)
    variants["moe_down_gemv"] = ("packed_int_moe._moe_int_down_kernel", moe, {**gemv, "TOP_K": 2})
    variants["moe_grouped"] = ("packed_int_moe._grouped_int_kernel", moe,
                               dict(BITS=4, GROUP=128, HAS_ZEROS=False, I16=True, MAGIC16=0x4300, OFFSET16=128.0,
                                    MUL_ROW_WEIGHT=True, BLOCK_M=64, BLOCK_N=128))
    # The magic-widening grouped GEMM (kernels/packed_int_moe_magic.py): scaled before the dots, and after them with
    # zero points, on 16- and 128-row token tiles.
    for block_m, scaled, zeros in ((16, True, False), (128, False, True)):
        variants[f"moe_grouped_magic[block_m={block_m},scaled={scaled}]"] = (
            "packed_int_moe_magic._grouped_magic_kernel", moe,
            dict(GROUP=128, HAS_ZEROS=zeros, MAGIC16=0x4300, OFFSET16=128.0, ASM=True, SCALED=scaled,
                 MUL_ROW_WEIGHT=not zeros, BLOCK_M=block_m, BLOCK_N=128))
    return variants


def _prefetch(on: bool) -> dict[str, object]:
    """The L2 prefetch of the next weight's head (the GEMV's and magic_mma's last programs), on or off."""
    return dict(PREFETCH=on, PREFETCH_BLOCK=64)


def _compile_all() -> dict[str, str | None]:
    spec = importlib.util.spec_from_file_location("aot", Path(__file__).with_name("test_triton_compiles_for_gpu.py"))
    aot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aot)
    from treadle.kernels import (packed_int, packed_int_dequant, packed_int_magic, packed_int_mma, packed_int_moe,
                                 packed_int_moe_magic)

    modules = {"packed_int": packed_int, "packed_int_moe": packed_int_moe, "packed_int_mma": packed_int_mma,
               "packed_int_magic": packed_int_magic, "packed_int_dequant": packed_int_dequant,
               "packed_int_moe_magic": packed_int_moe_magic}
    results: dict[str, str | None] = {}
    for name, (kernel, pointers, constexprs) in _variants().items():
        module, _, kernel = kernel.rpartition(".")
        try:
            aot._compile(getattr(modules[module or "packed_int"], kernel), {**POINTERS, **pointers}, {"eps"},
                         constexprs)
            results[name] = None
        except Exception:  # reported per variant so one failure does not hide the others
            results[name] = traceback.format_exc()
    for name, check in (("gemv[16-byte loads]", lambda: _gemv_loads(packed_int._int_gemv_kernel)),
                        ("dequantize[16-byte loads and stores]",
                         lambda: _dequantize_accesses(packed_int_dequant._dequantize_kernel))):
        try:
            results[name] = check()
        except Exception:
            results[name] = traceback.format_exc()
    return results


def _aligned_ptx(kernel, constexprs: dict[str, object], unaligned: tuple[str, ...] = ()) -> str:
    """The sm_90 PTX of ``kernel`` with its pointers and integers 16-aligned but for ``unaligned`` (as Triton
    specializes the loader's shapes)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants, attrs = {}, {}, {}
    for index, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in constexprs:
            signature[name], constants[(index,)] = "constexpr", constexprs[name]
        else:
            signature[name] = POINTERS.get(name, "*bf16" if name == "out_ptr" else "fp32" if name == "eps" else "i32")
            if name != "eps" and name not in unaligned:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def _dequantize_accesses(kernel) -> str | None:
    """None if the dequantization (4-bit, groups of 128 with zero points) loads its packed words and stores its
    16-bit values 16 bytes at a time (the row count, panel counts and scale stride left unaligned); else the global
    accesses its PTX has."""
    import re

    ptx = _aligned_ptx(kernel, dict(BITS=4, GROUP=128, HAS_ZEROS=True, HAS_GIDX=False, BLOCK_N=32),
                       ("N", "panels", "per_program", "stride_sn"))
    accesses = sorted(set(re.findall(r"(?:ld|st)\.global[\w.:]*", ptx)))
    words = [access for access in accesses if "evict_first" in access]
    stores = [access for access in accesses if access.startswith("st.")]
    good = words and stores and all(access.endswith(".v4.b32") for access in words + stores)
    return None if good else f"global accesses: {accesses}"


def _gemv_loads(kernel) -> str | None:
    """None if the subnormal GEMV, its pointers and integer sizes 16-aligned (as Triton specializes the loader's
    shapes), loads its packed words as 16-byte vectors and its activations as 8-byte ones (the word offsets hinted
    whole panels; without the hints 8 and 4); else the loads its PTX has."""
    import re

    constexprs = dict(BITS=4, GROUP=128, HAS_ZEROS=False, SPLIT_K=4, SILU_MUL=False, ADD_RMSNORM=False, BLOCK_ROW=1,
                      BLOCK_N=8, BLOCK_W=64, PDL=True, SUBNORMAL=True, PREFETCH=True, PREFETCH_BLOCK=64)
    ptx = _aligned_ptx(kernel, constexprs)
    loads = sorted(set(re.findall(r"ld\.global[\w.:]*", ptx)))
    words = [load for load in loads if "evict_first" in load]
    vectors = words and all(load.endswith(".v4.b32") for load in words) and "ld.global.v2.b32" in loads
    return None if vectors else f"loads: {loads}"


if __name__ == "__main__":
    print(RESULT_MARKER + json.dumps(_compile_all()))
    sys.exit(0)


@pytest.fixture(scope="module")
def compile_results() -> dict[str, str | None]:
    from aot_compile import compile_in_subprocess

    return compile_in_subprocess(__file__, RESULT_MARKER)


@pytest.mark.parametrize("variant", list(_variants()))
def test_int_kernel_compiles_for_sm90(variant, compile_results):
    assert compile_results[variant] is None, compile_results[variant]


def test_the_gemv_loads_its_packed_words_16_bytes_at_a_time(compile_results):
    assert compile_results["gemv[16-byte loads]"] is None, compile_results["gemv[16-byte loads]"]


def test_the_dequantization_moves_its_words_and_values_16_bytes_at_a_time(compile_results):
    result = compile_results["dequantize[16-byte loads and stores]"]
    assert result is None, result
