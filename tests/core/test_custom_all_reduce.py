"""The peer-to-peer all-reduce's logic without GPUs: which algorithm a size takes, when it falls back to NCCL and
how the ranks agree on it, the buffer layout, and the kernels' flag protocol under Triton's interpreter."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treadle.core.distributed import custom_all_reduce
from treadle.core.distributed.custom_all_reduce import (
    NCCL,
    ONE_SHOT,
    TWO_SHOT,
    AllReducePlan,
    PeerBufferLayout,
    agreed_reason,
    setup_custom_all_reduce,
    unsupported_reason,
)
from treadle.core.distributed.parallel import TensorParallelGroup

MiB = 1 << 20


def test_two_ranks_take_one_shot_up_to_the_limit_and_nccl_above():
    plan = AllReducePlan.for_world(2)
    assert [plan.algorithm(n) for n in (2, 8192, 256 * 1024, 8 * MiB)] == [ONE_SHOT] * 4
    assert plan.algorithm(8 * MiB + 2) == NCCL


@pytest.mark.parametrize("world, one_shot_max", [(4, 512 * 1024), (8, 256 * 1024)])
def test_more_ranks_switch_to_two_shot_for_larger_messages(world, one_shot_max):
    plan = AllReducePlan.for_world(world)
    assert plan.algorithm(one_shot_max) == ONE_SHOT
    assert plan.algorithm(one_shot_max + 2) == TWO_SHOT
    assert plan.algorithm(plan.max_bytes) == TWO_SHOT
    assert plan.algorithm(plan.max_bytes + 2) == NCCL


@pytest.mark.parametrize(("rows", "block", "most", "slices"), [
    (1, 8192, 8, 4), (1, 16384, 8, 8), (1, 4096, 8, 1), (1, 8192, 2, 2), (8, 8192, 8, 4), (16, 8192, 8, 2),
    (32, 8192, 8, 1), (1, 8192, 1, 1)])
def test_rows_of_8192_and_more_are_pushed_in_slices_of_2048(rows, block, most, slices):
    from treadle.core.distributed.custom_all_reduce import slices_per_row

    assert slices_per_row(rows, block, most, programs=32) == slices


def test_buffer_layout_holds_flags_then_two_halves_of_slots_per_rank():
    layout = PeerBufferLayout(world_size=2, programs=32, slot_bytes=8 * MiB)
    assert layout.flag_bytes == 1024  # 2 phases x 2 ranks x 32 programs x 8 bytes
    assert layout.total_bytes == 1024 + 2 * 2 * 8 * MiB
    assert layout.slot_elems(torch.bfloat16) == 4 * MiB and layout.slot_elems(torch.float32) == 2 * MiB


@pytest.mark.parametrize("kwargs, reason", [
    (dict(device=torch.device("cpu"), world_size=2, nnodes=1), "the ranks run on cpu, not CUDA"),
    (dict(device=torch.device("cuda", 0), world_size=2, nnodes=2), "the group spans 2 nodes"),
    (dict(device=torch.device("cuda", 0), world_size=3, nnodes=1), "tp_size 3 is not one of 2, 4, 6, 8"),
    (dict(device=torch.device("cuda", 1), world_size=2, nnodes=1, local_devices=[0, 1],
          peer_access=lambda a, b: False), "GPU 1 has no peer access to GPU 0"),
])
def test_unsupported_layouts_name_why(kwargs, reason):
    assert reason in unsupported_reason(**kwargs)


def test_gpus_with_peer_access_are_supported():
    assert unsupported_reason(torch.device("cuda", 0), 2, 1, peer_access=lambda a, b: True,
                              local_devices=[0, 1]) is None


def test_one_rank_that_cannot_makes_every_rank_fall_back():
    assert agreed_reason([None, None]) is None
    assert agreed_reason([None, "no peer access"]) == "rank 1: no peer access"


@pytest.fixture
def two_cpu_ranks(monkeypatch):
    """This process as either rank of a 2-rank group whose ranks all report what this one does."""
    monkeypatch.setattr(custom_all_reduce, "get_tp_group", lambda: TensorParallelGroup(rank=0, size=2))
    monkeypatch.setattr(custom_all_reduce, "tp_gather_objects", lambda obj: [obj, obj])


def test_auto_falls_back_where_the_ranks_cannot(two_cpu_ranks):
    assert setup_custom_all_reduce("auto", torch.device("cpu"), nnodes=1) is None


def test_true_where_it_cannot_run_fails_start_naming_the_reason(two_cpu_ranks):
    with pytest.raises(RuntimeError, match="custom_all_reduce is true but .*rank 0: the ranks run on cpu, not CUDA"):
        setup_custom_all_reduce(True, torch.device("cpu"), nnodes=1)


def test_a_failed_buffer_setup_means_nccl_under_auto(two_cpu_ranks, monkeypatch, caplog):
    monkeypatch.setattr(custom_all_reduce, "unsupported_reason", lambda *a, **k: None)
    monkeypatch.setattr(custom_all_reduce, "_try_build", lambda group, device: (None, "setting up failed: boom"))
    with caplog.at_level("INFO"):
        assert setup_custom_all_reduce("auto", torch.device("cuda", 0), nnodes=1) is None
    assert "all-reduce: NCCL only (rank 0: setting up failed: boom)" in caplog.text


def test_ranks_with_different_earlier_rendezvous_keep_to_nccl(two_cpu_ranks, monkeypatch, caplog):
    """A second tensor-parallel engine in one process: rank 0's process made a symmetric-memory rendezvous for the
    first group, the new ranks' processes none; torch's per-process exchange numbers would make them wait for each
    other forever (seen on 2 x H200), so the peer all-reduce is not set up, and true fails naming why."""
    monkeypatch.setattr(custom_all_reduce, "unsupported_reason", lambda *a, **k: None)
    monkeypatch.setattr(custom_all_reduce, "_try_build", lambda group, device: pytest.fail("built"))
    monkeypatch.setattr(custom_all_reduce, "tp_gather_objects", lambda obj: [(None, 1), (None, 0)])
    with caplog.at_level("INFO"):
        assert setup_custom_all_reduce("auto", torch.device("cuda", 0), nnodes=1) is None
    assert "NCCL only" in caplog.text and "earlier groups [1, 0] times" in caplog.text
    with pytest.raises(RuntimeError, match="would wait for each other"):
        setup_custom_all_reduce(True, torch.device("cuda", 0), nnodes=1)


def test_false_never_sets_anything_up(two_cpu_ranks, monkeypatch):
    monkeypatch.setattr(custom_all_reduce, "_try_build", lambda group, device: pytest.fail("built"))
    assert setup_custom_all_reduce(False, torch.device("cuda", 0), nnodes=1) is None


@pytest.fixture(scope="module")
def interpreted():
    script = Path(__file__).with_name("interpreted_peer_all_reduce.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_four_interpreted_ranks_sum_in_rank_order_identically(interpreted):
    fused = [s for s in interpreted if "fused" in s]
    assert [(s["rows"], s["split"]) for s in fused] == [(1, 4), (2, 2), (3, 1)]
    for s in fused:  # 1-4 programs to a row: each pushes its slice, all of them norm the whole sum
        assert s["sums_exact"] and s["norms_close"] and s["errors"] == 0, s
    scenarios = [s for s in interpreted if "kernel" in s]
    assert len(scenarios) == 2
    for s in scenarios:
        assert s["exact"] and s["identical"] and s["errors"] == 0, s
        assert s["epochs"] == [3], s  # every program counted three calls


def test_a_wait_whose_peer_never_pushes_gives_up_and_counts_an_error(interpreted):
    starved = next(s for s in interpreted if "starved_errors" in s)
    # The 8 elements are program 0's; the others have nothing to exchange and neither wait nor raise a flag.
    assert starved["starved_errors"] == 1
    assert starved["peer_flags"] == [1, 0, 0, 0] and starved["pushed"] == [1.0] * 8


def test_kernels_compile_for_hopper_with_system_scope_flags_vector_accesses_and_no_multicast():
    script = Path(__file__).with_name("interpreted_peer_all_reduce.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script), "--ptx"], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0 and "ptxas" in done.stderr:
        pytest.skip("no ptxas in this triton install")
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(facts) == 4
    for name, kernel in facts.items():
        assert kernel == {"release_flag": True, "acquire_wait": True, "vector_data": True, "multimem": False,
                          "pdl": True}, name


def test_two_rank_processes_sum_through_each_others_memory_run_after_run(tmp_path, monkeypatch):
    """Real concurrency on the CPU: two spawned ranks, buffers mapped from shared files, interpreted kernels
    spinning on each other's flags; one-shot, two-shot and the gloo fallback chosen by size, both halves of the
    buffer reused, every result the rank-order sum on both ranks; then all-reduces fused with the residual add and
    RMSNorm."""
    from treadle.testing.all_reduce import run_ranks

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ranks = importlib.import_module("peer_all_reduce_ranks")
    for rank in range(2):
        (tmp_path / f"rank{rank}.buf").write_bytes(bytes(ranks.buffer_bytes(2)))
    reports = run_ranks(2, ranks.interpreted_rank, (str(tmp_path),), timeout_s=300)
    custom = sum(1 for dtype, n in ranks.CALLS if n * torch.empty((), dtype=dtype).element_size() <= 1024)
    for report in reports:
        assert report["exact"] and report["identical"] and report["errors"] == 0, report
        assert report["custom_calls"] == custom == 14
        assert report["fused_sums_exact"] and report["fused_norms_close"], report
        assert report["fused_identical"] and report["fused_input_untouched"], report
        # every program counted every peer call (the fused ones too), on both ranks
        assert report["epochs"] == [custom + len(ranks.FUSED)] * 4
