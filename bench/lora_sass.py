"""Registers, shared memory, spills and inner-loop instructions of the LoRA gather shrink's launches at bs=32 over
Llama-3.1-8B's shapes (rank 16), compiled for an H100 (sm_90) on any machine: ``python -m treadle.bench.lora_sass``
(CPU only, about 20 s; Triton's ahead-of-time compile and the ``cuobjdump`` it ships). Per kernel choice (the
default full-row form and the looped candidates of kernels/lora_choice.py, ``shrink_loop_*``) and layer (q/k/v: 48
stacked rows of in=4096; down: 16 of in=14336): the launch's blocks (kernels/lora.py's ``_gather_shrink_blocks``),
its warps, registers a thread, shared memory, spill bytes, and its longest loop's instructions (some opcodes
counted: global loads, asynchronous copies into shared memory, shared loads, float math, shuffles, barriers). Pointers and sizes
are specialized 16-aligned and unit strides as 1, as Triton specializes them at launch; the GPU's Triton may differ
by a few instructions.
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

from treadle.bench.int_sass import _longest_loop

POINTERS = {"X": "*bf16", "A": "*bf16", "Ids": "*i32", "Scalings": "*fp32", "Ranks": "*i32", "H": "*fp32"}
UNIT_STRIDES = ("stride_xk", "stride_ak")
LAYERS = {"qkv": (48, 4096), "down": (16, 14336)}
LOOP_OPCODES = ("LDG", "LDGSTS", "LDS", "FFMA", "FMUL", "FADD", "SHFL", "BAR")
CHOICES = ({}, {"shrink_loop_above": 1 << 20}, {"shrink_loop_warps": 8}, {"shrink_loop_stages": 1},
           {"shrink_loop_stages": 3}, {"shrink_loop_rows": 8, "shrink_loop_k": 1024},
           {"shrink_loop_rows": 16, "shrink_loop_k": 512, "shrink_loop_programs": 256, "shrink_loop_chunks": 1 << 20,
            "shrink_loop_stages": 1, "shrink_loop_warps": 8})


def compile_shrink(block_r: int, block_k: int, ahead: int, num_warps: int) -> dict[str, Any]:
    """The partial-sum gather shrink (``add_delta``'s, PDL and go-ahead on) with these blocks, compiled for sm_90:
    registers, shared bytes, spill (stack and local) bytes and the longest loop's opcode counts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from treadle.kernels import lora

    constexprs = dict(BLOCK_R=block_r, BLOCK_K=block_k, FINAL=False, PDL=True, GO_AHEAD=True, AHEAD=ahead)
    kernel = lora._shrink_gather_kernel
    signature, constants, attrs = {}, {}, {}
    for index, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in constexprs or name in UNIT_STRIDES:
            signature[name], constants[(index,)] = "constexpr", constexprs.get(name, 1)
        else:
            signature[name] = POINTERS.get(name, "i32")
            if name != "num_tokens":  # not specialized (do_not_specialize)
                attrs[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(compiled.asm["cubin"])
        file.flush()
        sass = subprocess.run([tool, "-sass", file.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", file.name], capture_output=True, text=True, check=True).stdout
    fields = {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    return {"registers": fields["REG"], "shared": max(fields["SHARED"], compiled.metadata.shared),
            "spills": fields["STACK"] + fields["LOCAL"],
            "loop": _longest_loop(sass) if re.search(r"BRA", sass) else collections.Counter()}


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m treadle.bench.lora_sass", description=__doc__.split("\n")[0]).parse_args(
        argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as the GPU's Triton compiles
    from treadle.kernels.lora import _gather_shrink_blocks, _gather_warps
    from treadle.kernels.lora_choice import LoRAKernelChoice

    for fields in CHOICES:
        choice = LoRAKernelChoice(**fields)
        for layer, (rows, in_features) in LAYERS.items():
            blocks = _gather_shrink_blocks(32, rows, in_features, True, choice)
            warps = blocks.warps or _gather_warps(blocks.block_r * blocks.block_k)
            result = compile_shrink(blocks.block_r, blocks.block_k, blocks.ahead, warps)
            programs = 32 * -(-rows // blocks.block_r) * blocks.split
            loop = result["loop"]
            top = ", ".join(f"{op} {loop[op]}" for op in LOOP_OPCODES if loop[op])
            print(f"{choice.name:<70}{layer:<5} [{blocks.block_r}x{blocks.block_k}] {blocks.split} slices, "
                  f"{programs} programs, {warps} warps: {result['registers']} registers, {result['shared']} B "
                  f"shared, {result['spills']} B spilled; loop: {loop.total() - loop['LDG128']} instructions, "
                  f"{top}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
