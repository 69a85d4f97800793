"""The Triton fused-MoE kernel equals the PyTorch expert loop (the reference HF parity is tested on).

Triton runs on the CPU only through its interpreter, which must be switched on before triton is
first imported; the kernel checks run in a fresh subprocess and report one result per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from treadle.layers.fused_moe import fused_experts_reference, route_top_k
from treadle.layers.moe import SparseMoE, sparse_moe_from_config

CHECKS = r'''
import json, torch
from treadle.layers import fused_moe as R
from treadle.kernels import fused_moe as K

def case(tokens, experts, top_k, hidden, inter, dtype, seed=0, config=None, gemv=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    weights, ids = R.route_top_k(torch.randn(tokens, experts, generator=g), top_k)
    if gemv:
        got = K.fused_experts_gemv(x, w13, w2, weights, ids)
        # A few tokens take the GEMV path by default, and it is the same computation as the grouped path.
        assert torch.equal(got, K.fused_experts(x, w13, w2, weights, ids))
        grouped = K.fused_experts(x, w13, w2, weights, ids, K.default_config(tokens * top_k, dtype)).float()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-3
        assert (got.float() - grouped).abs().max().item() <= tolerance * grouped.abs().max().item()
    else:
        got = K.fused_experts(x, w13, w2, weights, ids, config)
    want = R.fused_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    return (got.float() - want).abs().max().item() / want.abs().max().item()

def fp8_experts(tokens, experts, top_k, hidden, inter, seed=10, config=None):
    # FP8 experts with a scale per weight row, against the loop over the same weights dequantized.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5
    def quantize(w):
        scale = w.abs().amax(dim=2) / 448
        return (w / scale[..., None]).to(torch.float8_e4m3fn), scale
    (q13, s13), (q2, s2) = quantize(w13), quantize(w2)
    weights, ids = R.route_top_k(torch.randn(tokens, experts, generator=g), top_k)
    got = K.fused_experts(x, q13, q2, weights, ids, config, w13_scale=s13, w2_scale=s2)
    want = R.fused_experts_reference(x, q13.float() * s13[..., None], q2.float() * s2[..., None], weights, ids)
    assert torch.equal(R.fused_experts_reference(x, q13, q2, weights, ids, s13, s2), want)
    return (got - want).abs().max().item() / want.abs().max().item()

def strided_experts(seed=9):
    # Expert weights without unit stride along their last dim take the grouped path, which reads any strides.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 64, generator=g)
    w13 = torch.randn(4, 64, 2 * 48, generator=g).transpose(1, 2) * 0.125
    w2 = torch.randn(4, 48, 64, generator=g).transpose(1, 2) * 0.15
    weights, ids = R.route_top_k(torch.randn(1, 4, generator=g), 2)
    got = K.fused_experts(x, w13, w2, weights, ids)
    want = R.fused_experts_reference(x, w13, w2, weights, ids)
    return (got - want).abs().max().item() / want.abs().max().item()

def alignment(tokens, experts, top_k, block_m, seed=0):
    ids = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(seed))
    rows, block_experts = K.align_by_expert(ids, experts, block_m)
    flat = ids.flatten()
    real = rows[rows < flat.numel()]
    ok = sorted(real.tolist()) == list(range(flat.numel()))  # every assignment exactly once
    slot_expert = block_experts.repeat_interleave(block_m)
    ok &= bool((slot_expert[rows < flat.numel()] == flat[real]).all())  # each in a block of its own expert
    return ok

def triton_sort(tokens, experts, top_k, block_m, seed=0, every=1):
    # The Triton sort against the PyTorch one: int64 outputs of the same sizes, the same expert per block and, per
    # block, the same rows in any order. every > 1 leaves the experts between multiples of it without rows.
    ids = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(seed)) // every * every
    rows, block_experts = K.align_by_expert(ids, experts, block_m)
    want_rows, want_experts = K.align_by_expert_reference(ids, experts, block_m)
    ok = rows.dtype == block_experts.dtype == torch.int64 and rows.shape == want_rows.shape
    ok = ok and torch.equal(block_experts, want_experts)
    return ok and torch.equal(rows.view(-1, block_m).sort(dim=1).values, want_rows.view(-1, block_m).sort(dim=1).values)

def row_order_within_runs(tokens, experts, top_k, seed=12):
    # fused_experts through the Triton sort against it through the PyTorch sort, also with each block's rows
    # reversed (padding first): a tile computes every row on its own, so only float rounding may differ (the
    # interpreter's matmuls may sum in another order for another row order). Also reported: the same call with
    # each block given the next expert, the size of error a wrong row-to-expert pairing makes.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g).half()
    w13 = (torch.randn(experts, 2 * 48, 64, generator=g) * 0.125).half()
    w2 = (torch.randn(experts, 64, 48, generator=g) * 0.15).half()
    weights, ids = R.route_top_k(torch.randn(tokens, experts, generator=g), top_k)
    config = K.default_config(tokens * top_k, torch.float16)
    got = K.fused_experts(x, w13, w2, weights, ids, config).float()
    triton_align = K.align_by_expert

    def run_with(align):
        K.align_by_expert = align
        try:
            return K.fused_experts(x, w13, w2, weights, ids, config).float()
        finally:
            K.align_by_expert = triton_align

    def torch_align(reverse):
        def align(topk_ids, num_experts, block_m):
            rows, block_experts = K.align_by_expert_reference(topk_ids, num_experts, block_m)
            return (rows.view(-1, block_m).flip(1).reshape(-1) if reverse else rows), block_experts
        return align

    def next_expert(topk_ids, num_experts, block_m):
        rows, block_experts = K.align_by_expert_reference(topk_ids, num_experts, block_m)
        return rows, (block_experts + 1) % num_experts

    scale = got.abs().max().item()
    reordered = max((run_with(torch_align(reverse)) - got).abs().max().item() for reverse in (False, True))
    wrong = (run_with(next_expert) - got).abs().max().item()
    return {"reordered": reordered / scale, "wrong_expert": wrong / scale}

results = {
    "fp32_decode_one_token": case(1, 4, 2, 64, 96, torch.float32, config=K.default_config(2, torch.float32)),
    # The GEMV path of a few tokens: K and N not multiples of the blocks, top-3, and experts hit more than once.
    "fp32_gemv_one_token": case(1, 8, 2, 64, 96, torch.float32, gemv=True),
    "fp32_gemv_odd_sizes_top3": case(3, 10, 3, 48, 42, torch.float32, seed=7, gemv=True),
    "fp16_gemv_repeated_experts": case(3, 8, 2, 64, 96, torch.float16, seed=8, gemv=True),
    "fp32_strided_experts": strided_experts(),
    "fp32_fp8_experts_gemv": fp8_experts(3, 8, 2, 64, 40),
    "fp32_fp8_experts_grouped": fp8_experts(37, 8, 2, 48, 40, seed=11),
    "fp32_prefill_odd_sizes": case(37, 8, 2, 48, 40, torch.float32, seed=1),
    "fp32_top1_some_experts_idle": case(5, 8, 1, 64, 64, torch.float32, seed=2),
    "fp32_top3_many_blocks": case(70, 3, 3, 32, 24, torch.float32, seed=3),
    "fp16_prefill": case(29, 4, 2, 64, 96, torch.float16, seed=4),
    # The large-prefill tiles of default_config (4096 rows or more), on rows the interpreter can afford.
    "fp16_prefill_large_tiles": case(150, 4, 2, 128, 160, torch.float16, seed=6,
                                     config=K.default_config(4096, torch.float16)),
    # Qwen3-30B-A3B's routing (top-8 of 128 experts) through the grouped GEMM.
    "fp16_prefill_128_experts_top8": case(40, 128, 8, 32, 16, torch.float16, seed=13),
    "alignment_small": alignment(3, 8, 2, 16),
    "alignment_many": alignment(200, 5, 2, 16, seed=5),
    "triton_sort_one_token_128_experts_top8": triton_sort(1, 128, 8, 16),
    "triton_sort_one_program_at_its_limit": triton_sort(512, 128, 8, 64, seed=1),
    "triton_sort_two_launches": triton_sort(600, 128, 8, 64, seed=2),
    "triton_sort_60_experts": triton_sort(37, 60, 4, 16, seed=3),
    "triton_sort_idle_experts": triton_sort(5, 20, 2, 16, seed=4, every=3),
    "triton_sort_idle_experts_two_launches": triton_sort(700, 20, 8, 16, seed=5, every=3),
    "triton_sort_fewer_rows_than_experts": triton_sort(1, 256, 1, 128, seed=6),
    # 16384 prefill tokens at top-8 (131072 assignments, 32 chunks) over 256 experts.
    "triton_sort_large_prefill": triton_sort(16384, 256, 8, 128, seed=7),
    "row_order_within_runs": row_order_within_runs(40, 16, 4),
}
print("RESULTS " + json.dumps(results))
'''

TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3}


@pytest.fixture(scope="module")
def kernel_results() -> dict:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


@pytest.mark.parametrize(
    "name",
    ["fp32_decode_one_token", "fp32_gemv_one_token", "fp32_gemv_odd_sizes_top3", "fp16_gemv_repeated_experts",
     "fp32_strided_experts", "fp32_fp8_experts_gemv", "fp32_fp8_experts_grouped",
     "fp32_prefill_odd_sizes", "fp32_top1_some_experts_idle", "fp32_top3_many_blocks",
     "fp16_prefill", "fp16_prefill_large_tiles", "fp16_prefill_128_experts_top8"],
)
def test_triton_kernel_matches_torch_experts(kernel_results, name):
    assert kernel_results[name] <= TOLERANCE[name.split("_")[0]], f"{name}: relative error {kernel_results[name]}"


@pytest.mark.parametrize("name", ["alignment_small", "alignment_many"])
def test_sorting_puts_every_assignment_once_in_a_block_of_its_expert(kernel_results, name):
    assert kernel_results[name]


@pytest.mark.parametrize(
    "name",
    ["triton_sort_one_token_128_experts_top8", "triton_sort_one_program_at_its_limit", "triton_sort_two_launches",
     "triton_sort_60_experts", "triton_sort_idle_experts", "triton_sort_idle_experts_two_launches",
     "triton_sort_fewer_rows_than_experts", "triton_sort_large_prefill"],
)
def test_triton_sort_puts_the_torch_sorts_rows_in_each_block(kernel_results, name):
    assert kernel_results[name]


def test_grouped_experts_do_not_depend_on_the_row_order_within_a_run(kernel_results):
    """Equal up to float16 rounding, not bit-equal: the Triton interpreter's matmuls (numpy's BLAS) may sum a tile in
    another order when its rows come in another order, which changes the last bit on some CPUs."""
    differences = kernel_results["row_order_within_runs"]
    assert differences["reordered"] <= TOLERANCE["fp16"], differences
    # The tolerance is far below what pairing rows with the wrong expert does.
    assert differences["wrong_expert"] > 50 * TOLERANCE["fp16"], differences


def test_router_renormalises_the_top_k_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route_top_k(logits, 2)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.tensor([[1 / (1 + torch.e**-1), 1 - 1 / (1 + torch.e**-1)]]))
    raw, _ = route_top_k(logits, 2, renormalize=False)
    torch.testing.assert_close(raw, torch.softmax(logits, -1)[:, :2])


def test_reference_equals_a_dense_loop_over_tokens():
    torch.manual_seed(0)
    moe = SparseMoE(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(6, 16)
    weights, ids = route_top_k(moe.gate(x), 2)
    expected = torch.zeros_like(x)
    for t in range(6):
        for j in range(2):
            gate_up = moe.experts.gate_up_proj[ids[t, j]] @ x[t]
            hidden = torch.nn.functional.silu(gate_up[:8]) * gate_up[8:]
            expected[t] += weights[t, j] * (moe.experts.down_proj[ids[t, j]] @ hidden)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            fused_experts_reference(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, ids), expected,
            atol=1e-5, rtol=1e-5,
        )


def test_the_gemvs_take_the_batch_sizes_where_they_measured_faster():
    """The crossovers measured on an H100 (docs/lab/benchmarks-history.md, "Fused MoE", and fused_moe_kernels.py): 16-bit
    experts run the GEMVs while there are fewer assignments than experts, FP8 experts (against the W8A8 grouped
    GEMM) up to 0.75 per expert."""
    from treadle.kernels import fused_moe as K

    mixtral, qwen3 = (8, 2), (128, 8)  # (experts, top-k)
    assert [t for t in range(1, 40) if K.takes_gemv(t, mixtral[1], mixtral[0])] == [1, 2, 3]
    assert [t for t in range(1, 40) if K.takes_gemv(t, qwen3[1], qwen3[0])] == list(range(1, 16))
    assert [t for t in range(1, 40) if K.takes_gemv(t, mixtral[1], mixtral[0], fp8=True)] == [1, 2, 3]
    assert [t for t in range(1, 40) if K.takes_gemv(t, qwen3[1], qwen3[0], fp8=True)] == list(range(1, 13))


def test_too_many_experts_per_token_is_refused():
    config = type("Config", (), {"hidden_size": 8, "intermediate_size": 8, "num_local_experts": 2,
                                 "num_experts_per_tok": 3})()
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(3\) must be between 1 and the number of experts \(2\)"):
        sparse_moe_from_config(config)


TP_WORKER = r'''
import sys, torch
from safetensors import safe_open
from treadle.core.distributed.parallel import destroy_tensor_parallel, init_tensor_parallel
from treadle.layers.moe import SparseMoE

rank, port, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s=60)
x, expected = torch.load(f"{folder}/io.pt")
for layout in ("per_expert", "fused"):
    moe = SparseMoE(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2)
    assert moe.experts.gate_up_proj.shape == (4, 8, 16), moe.experts.gate_up_proj.shape  # half of 2 * 8 rows
    with safe_open(f"{folder}/{layout}.safetensors", framework="pt") as reader:
        for name in reader.keys():
            if name == "gate.weight":
                moe.gate.weight.data.copy_(reader.get_tensor(name))
            else:  # lazy slices, as the loader passes them under tensor parallelism
                assert moe.experts.load_checkpoint_tensor(name.removeprefix("experts."), reader.get_slice(name))
    with torch.no_grad():
        error = (moe(x) - expected).abs().max().item()
    print(f"{layout} {error}", flush=True)
destroy_tensor_parallel()
'''


def test_tensor_parallel_experts_split_the_intermediate_dim_and_sum_to_tp1(tmp_path):
    import socket

    from safetensors.torch import save_file

    torch.manual_seed(0)
    moe = SparseMoE(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.save((x, moe(x)), tmp_path / "io.pt")
    w13, w2 = moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()
    per_expert = {"gate.weight": moe.gate.weight.detach().clone()}
    for e in range(4):
        per_expert[f"experts.{e}.w1.weight"] = w13[e, :8].clone()
        per_expert[f"experts.{e}.w3.weight"] = w13[e, 8:].clone()
        per_expert[f"experts.{e}.w2.weight"] = w2[e].clone()
    save_file(per_expert, tmp_path / "per_expert.safetensors")
    save_file({"gate.weight": per_expert["gate.weight"], "experts.gate_up_proj": w13.clone(),
               "experts.down_proj": w2.clone()}, tmp_path / "fused.safetensors")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", TP_WORKER, str(rank), str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    for proc in ranks:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        errors = dict(line.split() for line in out.splitlines())
        assert set(errors) == {"per_expert", "fused"} and max(map(float, errors.values())) < 1e-5, out
