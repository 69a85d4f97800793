"""Instruction counts of the one-token W4A16 GEMVs' inner loops, compiled for an H100 (sm_90) on any machine:
``python -m treadle.bench.int_sass`` (CPU only, about 20 s; Triton's ahead-of-time compile and the ``cuobjdump``
it ships). Per kernel and launch config: the loop's instructions per 16 bytes of packed weight (one thread's
16-byte load, 32 4-bit values), by opcode. Pointers and integer sizes are specialized 16-aligned as Triton
specializes the loader's shapes; the GPU's Triton may differ by a few instructions.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile
from typing import Any, Sequence

POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "out_ptr": "*bf16",
            "partials_ptr": "*fp32", "arrivals_ptr": "*i32", "residual_ptr": "*bf16", "norm_weight_ptr": "*bf16",
            "normed_ptr": "*bf16", "residual_out_ptr": "*bf16", "prefetch_ptr": "*u8"}


def configs() -> dict[str, Any]:
    """Name -> tiles of the launches counted (symmetric weights, groups of 128): the loader's first GEMV config
    (the H200 sweep's best at qkv and gate_up: 8 rows x 64 words with the subnormal widening), plain and subnormal,
    and two panels a step (8 x 128, the loader's second kind)."""
    from treadle.kernels.packed_int import IntTiles

    return {
        "gemv plain 8x64": IntTiles(0, 8, 64, 4, 1),
        "gemv subnormal 8x64 (qkv, gate_up)": IntTiles(0, 8, 64, 4, 1, subnormal=True),
        "gemv subnormal 8x128": IntTiles(0, 8, 128, 2, 1, subnormal=True),
    }


def loop_counts(kernel: Any, constexprs: dict[str, Any], num_warps: int) -> tuple[collections.Counter, int]:
    """(opcode -> count in the longest loop, registers a thread) of ``kernel`` compiled for sm_90 with
    ``constexprs``; the count of ``LDG128`` is the loop's 16-byte loads."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants, attrs = {}, {}, {}
    for index, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in constexprs:
            signature[name], constants[(index,)] = "constexpr", constexprs[name]
        else:
            signature[name] = POINTERS.get(name, "fp32" if name == "eps" else "i32")
            if name != "eps":
                attrs[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    sass, registers = _sass(compiled.asm["cubin"])
    return _longest_loop(sass), registers


def count(tiles: Any) -> tuple[float, collections.Counter, int]:
    """(instructions per 16 bytes of packed weight, opcode -> count per 16 bytes, registers a thread) of one
    launch's inner loop (an unrolled loop's steps counted together)."""
    from treadle.kernels import packed_int

    counts, registers = loop_counts(packed_int._int_gemv_kernel, dict(
        BITS=4, GROUP=128, HAS_ZEROS=False, SPLIT_K=tiles.split_k, SILU_MUL=False, ADD_RMSNORM=False, BLOCK_ROW=1,
        BLOCK_N=tiles.block_n, BLOCK_W=tiles.block_w, PDL=True, SUBNORMAL=tiles.subnormal, PREFETCH=False,
        PREFETCH_BLOCK=1), tiles.num_warps)
    loads = counts.pop("LDG128")  # the packed words' 16-byte loads: one thread's 32 values each
    per = collections.Counter({op: n / loads for op, n in counts.items()})
    return sum(per.values()), per, registers


def _sass(cubin: bytes) -> tuple[str, int]:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run([tool, "-sass", file.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", file.name], capture_output=True, text=True, check=True).stdout
    return sass, int(re.search(r"REG:(\d+)", usage).group(1))


def longest_loop_lines(sass: str) -> list[str]:
    """The instructions between the target of a backward branch and the branch, for the longest such loop."""
    instructions = [(int(m.group(1), 16), m.group(2).strip()) for m in
                    (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    loops = [(int(m.group(1), 16), address) for address, text in instructions
             if (m := re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)) and int(m.group(1), 16) < address]
    first, last = max(loops, key=lambda loop: loop[1] - loop[0])
    return [text for address, text in instructions if first <= address <= last]


def _longest_loop(sass: str) -> collections.Counter:
    """Opcodes (without modifiers) of :func:`longest_loop_lines`."""
    opcodes = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for text in longest_loop_lines(sass)]
    counts = collections.Counter(opcode.split(".")[0] for opcode in opcodes)
    counts["LDG128"] = sum(opcode.startswith("LDG") and opcode.endswith(".128") for opcode in opcodes)
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m treadle.bench.int_sass", description=__doc__.split("\n")[0]).parse_args(
        argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as the GPU's Triton compiles
    for name, tiles in configs().items():
        total, per, registers = count(tiles)
        top = ", ".join(f"{op} {n:.1f}" for op, n in per.most_common(10))
        print(f"{name:<40}{total:7.1f} per 16 B  ({total / 32:.2f} a value, {registers} registers)  {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
