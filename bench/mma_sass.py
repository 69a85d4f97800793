"""What the GPU runs of the W4A16 tensor-core kernels for 2 to 64 tokens, compiled for an H100/H200 (sm_90) on any
machine: ``python -m treadle.bench.mma_sass`` (CPU only, about 30 s; Triton's ahead-of-time compile and the
``cuobjdump`` it ships, so run it with the GPU's Triton, ``.venv/triton-3.6.0/bin/python``, for its exact code).

Per kernel and launch config (the sweep's best ``magic_mma`` launches at 32 tokens, and ``natural_mma``'s): the
main loop's instructions a K step (one 128-value panel of the tile's weight rows) per thread, its wgmmas (HGMMA)
and the waits for all of them to finish (``WARPGROUP.DEPBAR.LE gsb0, 0x0``), barriers, shared-memory stores and
loads (the activations re-laid out between the pipeline's copy and the MMA), asynchronous copies (LDGSTS) against
plain loads (LDG), local-memory spill instructions (STL and LDL) in the whole kernel, and the registers and shared
memory a program takes, so how many programs an SM holds.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
from typing import Any, Sequence

from treadle.bench.int_sass import POINTERS, _sass, longest_loop_lines

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 227 * 1024


def configs() -> dict[str, Any]:
    """Name -> tiles: ``magic_mma``'s best launches at 32 tokens on an H200 (gate_up and qkv; o and down), and
    ``natural_mma``'s first loader launch at 16, 32 and 64 tokens and its two-warp-group trial,
    ``wide_mma``'s three loader launches (and the first with split-K)."""
    from treadle.kernels.packed_int_magic import MagicMmaTiles
    from treadle.kernels.packed_int_natural import NaturalMmaTiles
    from treadle.kernels.packed_int_wide import WideMmaTiles

    return {
        "magic_mma 32x128 split 2": MagicMmaTiles(32, 128, 2, scaled=True),
        "magic_mma 32x128 split 8": MagicMmaTiles(32, 128, 8, scaled=True),
        "natural_mma 16x128 split 8": NaturalMmaTiles(16, 128, 8),
        "natural_mma 32x128 split 2": NaturalMmaTiles(32, 128, 2),
        "natural_mma 32x128 split 16": NaturalMmaTiles(32, 128, 16),
        "natural_mma 64x128 split 2": NaturalMmaTiles(64, 128, 2),
        "natural_mma 32x256 split 2 (8 warps)": NaturalMmaTiles(32, 256, 2, num_warps=8),
        "natural_mma 64x128 split 8": NaturalMmaTiles(64, 128, 8),
        "wide_mma 128x128": WideMmaTiles(128, 128),
        "wide_mma 128x128 split 4": WideMmaTiles(128, 128, 4),
        "wide_mma 128x256 (8 warps)": WideMmaTiles(128, 256, num_warps=8),
        "wide_mma 128x128 tokens as M (8 warps)": WideMmaTiles(128, 128, 1, 8, 2, tokens_m=True, max_registers=128),
    }


def compiled(tiles: Any) -> Any:
    """The launch ``tiles`` configures compiled for sm_90 (bf16, symmetric groups of 128), pointers and sizes
    specialized 16-aligned as Triton specializes the loader's shapes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from treadle.kernels import packed_int_magic, packed_int_natural, packed_int_wide

    constexprs = dict(GROUP=128, HAS_ZEROS=False, SPLIT_K=tiles.split_k, MAGIC16=0x4300, ASM=True,
                      BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, PREFETCH=False, PREFETCH_BLOCK=1)
    if isinstance(tiles, packed_int_magic.MagicMmaTiles):
        kernel = packed_int_magic._magic_mma_kernel
        constexprs.update(OFFSET16=128.0, SCALED=tiles.scaled)
    else:
        wide = isinstance(tiles, packed_int_wide.WideMmaTiles)
        kernel = packed_int_wide._wide_mma_kernel if wide else packed_int_natural._natural_mma_kernel
        # Llama-3.1-8B's shapes are whole row tiles; on Hopper it launches with PDL
        constexprs.update(EVEN_N=True, SUM_CHUNK=tiles.sum_chunk(), PDL=True,
                          TOKENS_M=getattr(tiles, "tokens_m", False))
        if not wide:  # natural_mma's launch options (kernels/packed_int_natural.py)
            constexprs.update(HEAD_LINES=tiles.head_lines, SILU_MUL=False)
    signature, constants, attrs = {}, {}, {}
    for index, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in constexprs:
            signature[name], constants[(index,)] = "constexpr", constexprs[name]
            continue
        signature[name] = POINTERS.get(name, "i32")
        if name not in ("M", "prefetch_lines", "first_prefetcher"):
            attrs[(index,)] = [["tt.divisibility", 16]]
    registers = getattr(tiles, "max_registers", 0)
    capped = {"maxnreg": registers} if registers else {}
    return triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages, **capped})


def loop_report(tiles: Any) -> dict[str, Any]:
    """The main loop's counts (module docstring) and the program's registers, shared memory and programs per SM."""
    kernel = compiled(tiles)
    sass, registers = _sass(kernel.asm["cubin"])
    loop = longest_loop_lines(sass)
    opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", line).split()[0].split(".")[0] for line in loop)
    shared = kernel.metadata.shared
    threads = 32 * tiles.num_warps
    return {"instructions": len(loop), "HGMMA": opcodes["HGMMA"],
            "wait_all": sum("DEPBAR.LE gsb0, 0x0" in line for line in loop), "BAR": opcodes["BAR"],
            "STS": opcodes["STS"], "LDS": opcodes["LDS"] + opcodes["LDSM"], "LDGSTS": opcodes["LDGSTS"],
            "LDG": opcodes["LDG"], "spills": len(re.findall(r"\b(?:STL|LDL)\b", sass)), "registers": registers,
            "shared": shared,
            "programs_per_sm": min(REGISTERS_PER_SM // (registers * threads), SHARED_PER_SM // max(shared, 1),
                                   64 // tiles.num_warps),
            "top": ", ".join(f"{op} {n}" for op, n in opcodes.most_common(6))}


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m treadle.bench.mma_sass", description=__doc__.split("\n")[0]).parse_args(
        argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as the GPU's Triton compiles
    import triton

    print(f"Triton {triton.__version__}, sm_90: the main loop a K step (128 values of each weight row), per thread")
    print(f"{'':<38}{'instr':>6}{'HGMMA':>6}{'wait0':>6}{'BAR':>4}{'STS':>4}{'LDS':>4}{'LDGSTS':>7}{'LDG':>4}"
          f"{'spill':>6}{'regs':>5}{'smem KB':>8}{'progs/SM':>9}  most")
    for name, tiles in configs().items():
        r = loop_report(tiles)
        print(f"{name:<38}{r['instructions']:>6}{r['HGMMA']:>6}{r['wait_all']:>6}{r['BAR']:>4}{r['STS']:>4}"
              f"{r['LDS']:>4}{r['LDGSTS']:>7}{r['LDG']:>4}{r['spills']:>6}{r['registers']:>5}{r['shared'] / 1024:>8.1f}"
              f"{r['programs_per_sm']:>9}  {r['top']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
