"""The integer-weight Triton kernels (kernels/packed_int.py) compile for an H100 (sm_90) on a machine without a GPU:
the interpreter accepts code the real compiler rejects (see test_triton_compiles_for_gpu.py, whose compile helper
this reuses). Both ways of unpacking, split-K, the SiLU·mul epilogue, zero points, act-order, 4 and 8 bits."""

from __future__ import annotations

import importlib.util
import json
import sys
import traceback
from pathlib import Path

import pytest

RESULT_MARKER = "AOT-RESULTS:"
POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "g_ptr": "*i32"}


def _variants() -> dict[str, tuple[str, dict[str, str], dict[str, object]]]:
    # (dup, groups per K step, zeros, split-K, SiLU·mul) for the GEMV; every constexpr branch is taken at least once.
    gemvs = [(False, 1, False, False, False), (True, 2, True, True, False), (False, 2, True, False, True),
             (True, 1, False, False, True)]
    variants = {}
    for dup, ng, zeros, atomic, silu in gemvs:
        name = f"gemv[dup={dup},groups={ng},zeros={zeros},split_k={atomic},silu_mul={silu}]"
        variants[name] = ("_int_gemv_kernel", {"out_ptr": "*fp32" if atomic else "*bf16"},
                          dict(BITS=4, GROUP=128, NG=ng, GSZ=128, HAS_ZEROS=zeros, ATOMIC=atomic, SILU_MUL=silu,
                               DUP=dup, BLOCK_N=32, BLOCK_K=128 * ng))
    for dup, bits, gidx, block_m, atomic in ((False, 4, True, 64, False), (True, 8, False, 16, True)):
        name = f"dot[dup={dup},bits={bits},act_order={gidx},block_m={block_m},split_k={atomic}]"
        variants[name] = ("_int_dot_kernel", {"out_ptr": "*fp32" if atomic else "*bf16"},
                          dict(BITS=bits, GROUP=128, HAS_ZEROS=True, HAS_GIDX=gidx, ATOMIC=atomic, DUP=dup,
                               BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128))
    variants["dequantize"] = ("_dequantize_kernel", {"out_ptr": "*bf16"},
                              dict(BITS=4, GROUP=128, HAS_ZEROS=True, HAS_GIDX=False, BLOCK_N=32, BLOCK_K=128))
    return variants


def _compile_all() -> dict[str, str | None]:
    spec = importlib.util.spec_from_file_location("aot", Path(__file__).with_name("test_triton_compiles_for_gpu.py"))
    aot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(aot)
    from treadle.kernels import packed_int

    results: dict[str, str | None] = {}
    for name, (kernel, pointers, constexprs) in _variants().items():
        try:
            aot._compile(getattr(packed_int, kernel), {**POINTERS, **pointers}, set(), constexprs)
            results[name] = None
        except Exception:  # reported per variant so one failure does not hide the others
            results[name] = traceback.format_exc()
    return results


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
