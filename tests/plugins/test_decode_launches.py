"""A W4A16 decode step launches what a 16-bit one does, GEMV for GEMV: the integer layers take the one-token fused
epilogues (SiLU·mul in gate_up's GEMV, the residual add and the next RMSNorm in o_proj's and down_proj's) and add
no per-layer cast, copy, dequantization or memset. Recorded under the Triton interpreter from a tiny Llama in float16
and its W4A16 twin, with the kernels a GPU picks for one row (interpreted_decode_launches.py); on a GPU the lm_head
of an integer model is FP8 instead (not on the CPU)."""

from __future__ import annotations

from pathlib import Path


def test_a_w4a16_decode_step_launches_the_16_bit_steps_kernels():
    from interpreted import interpreted_results

    launches = interpreted_results(str(Path(__file__).with_name("interpreted_decode_launches.py")), "LAUNCHES ")
    bf16, w4a16 = launches["bf16"], launches["w4a16"]
    layers = 2  # bench/shapes.py's TINY
    assert w4a16.count("_int_gemv_kernel") == 4 * layers and "_int_gemv_kernel" not in bf16
    # The lm_head (16-bit on the CPU) runs the 16-bit GEMV in both; every layer's matmul is one integer GEMV.
    assert [name.replace("_int_gemv_kernel", "_small_batch_kernel") for name in w4a16] == bf16
    assert bf16.count("_add_rmsnorm_kernel") == 2  # the first layer's input norm and the final norm: the others fused
