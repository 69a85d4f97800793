"""Tensor parallelism on the CPU (gloo): tp > 1 generates exactly what tp 1 does, and every rank's KV is accounted.

Starting a group costs seconds per rank process, so each test packs several
behaviours (chunked prefill, retraction, radix reuse, allocators) into one group.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from multiprocessing import resource_tracker

import pytest
from batch_log import record_batches

from treadle.core.config import ConfigError, load_config
from treadle.core.engine import Engine
from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.distributed.tensor_parallel import TensorParallelError, start_scheduler
from treadle.testing import check_tensor_parallel
from treadle.testing.engine import assert_kv_accounted
from treadle.testing.models import make_tiny_llama, make_tiny_mistral

GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
# Distinct prompts longer than the prefill chunk; two share a 12-token prefix for the radix cache.
PROMPTS = [
    [5, 17, 99, 250, 7, 300, 12, 44, 91, 3, 8, 200, 201, 202, 203, 204, 205, 206, 207],
    [5, 17, 99, 250, 7, 300, 12, 44, 91, 3, 8, 200, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71],
    [400, 401, 13, 77, 123, 311, 2, 9, 9, 9, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112],
    [42, 43, 44],
]


def _generate(config: dict) -> tuple[list[list[int]], list[list[int]], Engine]:
    engine = Engine(config)
    return *_run(engine), engine


def _run(engine: Engine) -> tuple[list[list[int]], list[list[int]]]:
    first = [out.token_ids for out in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    again = [out.token_ids for out in engine.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY)]
    # Every rank samples with the request's logit bias (it travels inside the pickled request).
    banned = {**GREEDY, "logit_bias": {first[0][0]: -100}}
    again.append(engine.generate(input_ids=PROMPTS[0], sampling_params=banned).token_ids)
    assert first[0][0] not in again[-1]
    return first, again


def _config(path: str, tp_size: int, **sections: dict) -> dict:
    config = {
        "model": {"path": path, "device": "cpu", "dtype": "float32"},
        # A pool too small for every sequence at once: decode retracts and re-admits.
        "cache": {"max_total_tokens": 128},
        "scheduler": {"max_running_requests": 8, "chunked_prefill_size": 16},
        "parallel": {"tp_size": tp_size},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def test_tp2_llama_checkpoint_matches_tp1_with_chunks_retraction_and_radix(tmp_path, stores):
    path = make_tiny_llama(tmp_path / "llama", num_key_value_heads=2)
    expected_first, expected_again, reference = _generate(_config(path, 1))
    assert reference.kv_stats()["retractions"] > 0  # the workload does exercise retraction
    reference.shutdown()

    first, again, engine = _generate(_config(path, 2))  # weights read as per-rank safetensors slices
    channel = engine.model_info["step_channel"]
    try:
        assert engine.model_info["tp_size"] == 2
        assert engine.model_info["step_broadcast"] == "shared_memory" and os.path.exists(f"/dev/shm/{channel}")
        assert first == expected_first
        assert again == expected_again
        per_rank = engine.scheduler.kv_stats_per_rank()
        assert len(per_rank) == 2 and per_rank[0] == per_rank[1]
        assert per_rank[0]["retractions"] > 0 and per_rank[0]["cached_tokens_total"] > 0
        assert_kv_accounted(engine)

        # A rank that dies fails the next call at once, naming the rank; nothing hangs.
        rank1 = engine.scheduler.ranks.processes[1]
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.join(timeout=10)
        with pytest.raises(TensorParallelError, match="tensor-parallel rank 1 .* exited unexpectedly"):
            engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)
    finally:
        engine.shutdown()
    assert not list(stores.glob("treadle-tp-*")), "the group's file store outlived it"
    assert not os.path.exists(f"/dev/shm/{channel}"), "the step channel's shared memory outlived the group"


def test_tp4_mistral_replicates_kv_heads_with_paged_cache_no_radix_and_latency_chunks(tmp_path):
    # 2 KV heads over 4 ranks: each KV head lives on two ranks. Dummy weights: same values at every tp.
    # A vocabulary of 510 rows does not split evenly: the last rank's embedding and lm_head are padded.
    path = make_tiny_mistral(tmp_path / "mistral", sliding_window=6, num_key_value_heads=2, vocab_size=510)
    # Latency chunks: prompts that trickle in while others decode run as mixed steps, on every rank alike.
    config = _config(path, 1, model={"load_format": "dummy"}, cache={"kv_allocator": "paged", "page_size": 4,
                                                                     "disable_radix_cache": True},
                     scheduler={"latency_chunk_size": 8})
    expected_first, expected_again, reference = _generate(config)
    reference.shutdown()

    engine = Engine({**config, "parallel": {"tp_size": 4}})
    try:
        modes = record_batches(engine, lambda batch: batch.forward_mode)  # rank 0's own launches, under the leader
        first, again = _run(engine)
        assert ForwardMode.MIXED in modes
        assert first == expected_first and again == expected_again
        assert len({tuple(ids) for ids in first}) == len(first)  # real, distinct continuations
        assert engine.scheduler.worker.runner.num_kv_heads == 1
        assert_kv_accounted(engine)
    finally:
        engine.shutdown()


def test_a_rank_that_dies_before_the_group_forms_fails_start_at_once_naming_it(tmp_path, monkeypatch, stores):
    # Rank 1's interpreter cannot start (a broken environment on that rank): rank 0 must say so at once,
    # not wait parallel.dist_timeout_s for it inside torch's rendezvous.
    path = make_tiny_llama(tmp_path / "llama", num_key_value_heads=2)
    resource_tracker.ensure_running()  # multiprocessing's helper process, started before the environment breaks
    monkeypatch.setenv("PYTHONHOME", str(tmp_path / "no-python-here"))
    config = load_config(overrides={"model.path": path, "model.device": "cpu", "parallel.tp_size": 2,
                                    "parallel.dist_timeout_s": 120})
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 1 \(pid \d+\) exited unexpectedly "
                                                  r"\(exit code 1\)"):
        start_scheduler(config)
    assert time.monotonic() - started < 20
    assert not list(stores.glob("treadle-tp-*")), "the failed start left its file store behind"


def test_a_rank_on_another_node_that_never_arrives_fails_after_the_timeout_naming_it(tmp_path):
    # Rank 0 cannot see another node's processes: only parallel.dist_timeout_s bounds the wait.
    path = make_tiny_llama(tmp_path / "llama", num_key_value_heads=2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    config = load_config(overrides={"model.path": path, "model.device": "cpu", "parallel.tp_size": 2,
                                    "parallel.nnodes": 2, "parallel.dist_init_addr": address,
                                    "parallel.dist_timeout_s": 1})
    with pytest.raises(TimeoutError, match=rf"rank\(s\) \[1\] did not reach the rendezvous at tcp://{address}"):
        start_scheduler(config)


def test_conformance_check_passes_for_the_builtin_llama(tmp_path):
    path = make_tiny_llama(tmp_path / "llama", num_key_value_heads=1)
    tokens = check_tensor_parallel(path, tp_size=2, overrides={"model": {"load_format": "dummy"}})
    assert all(len(ids) == 8 for ids in tokens)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"num_attention_heads": 4}, "does not divide the model's 4 attention heads"),
     ({"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96},
      "does not divide the model's 6 attention heads")],
)
def test_heads_that_do_not_split_fail_before_any_rank_starts(tmp_path, overrides, message):
    path = make_tiny_llama(tmp_path / "llama", **overrides)
    with pytest.raises(TensorParallelError, match=message):
        start_scheduler(load_config(overrides={"model.path": path, "model.device": "cpu", "parallel.tp_size": 8}))


def test_kv_heads_that_cannot_be_replicated_evenly_fail(tmp_path):
    path = make_tiny_llama(tmp_path / "llama", num_attention_heads=12, num_key_value_heads=3, hidden_size=96)
    with pytest.raises(TensorParallelError, match="cannot be replicated evenly"):
        start_scheduler(load_config(overrides={"model.path": path, "model.device": "cpu", "parallel.tp_size": 4}))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"parallel.nnodes": 2, "parallel.tp_size": 2}, "needs dist_init_addr"),
     ({"parallel.nnodes": 2, "parallel.tp_size": 3, "parallel.dist_init_addr": "h:1"}, "multiple of nnodes"),
     ({"parallel.node_rank": 1}, "must be below nnodes"),
     ({"parallel.dist_init_addr": "nohost"}, "host:port"),
     ({"parallel.dp_size": 2, "parallel.dist_init_addr": "h:1"}, "one node")],
)
def test_invalid_parallel_layouts_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides, use_env=False)


EXIT_WITHOUT_SHUTDOWN = """
import sys
from treadle import Engine

if __name__ == "__main__":
    engine = Engine({"model": {"path": sys.argv[1], "device": "cpu"}, "parallel": {"tp_size": 2},
                     "server": {"log_level": "warning"}})
    print(engine.generate(input_ids=[5, 17, 99], sampling_params={"max_new_tokens": 3}).token_ids)
"""


def test_a_script_ending_without_shutdown_stops_its_ranks_cleanly(tmp_path):
    """No 'exited unexpectedly', no leaked-semaphore warning, no file store left: the ranks are told to stop."""
    import subprocess
    import sys

    path = make_tiny_llama(tmp_path / "llama", num_key_value_heads=2)
    script = tmp_path / "script.py"
    script.write_text(EXIT_WITHOUT_SHUTDOWN)
    stores = tmp_path / "tmp"
    stores.mkdir()
    result = subprocess.run([sys.executable, str(script), path], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TMPDIR": str(stores)})
    assert result.returncode == 0, result.stderr[-3000:]
    for alarm in ("unexpectedly", "leaked", "resource_tracker", "Traceback"):
        assert alarm not in result.stderr, result.stderr[-3000:]
    assert not list(stores.glob("treadle-tp-*"))


def test_tp2_with_ngram_speculation_matches_tp1_plain(tmp_path, stores):
    """Every rank runs its own speculative worker; the n-gram drafts depend only on what each rank's scheduler read,
    so the ranks verify the same drafts and keep the same tokens (with retraction under the small pool). The step
    commands go over gloo here (``parallel.step_broadcast: gloo``), the path of groups that span nodes."""
    path = make_tiny_llama(tmp_path / "llama", num_key_value_heads=2)
    expected, _, reference = _generate(_config(path, 1))
    reference.shutdown()
    speculative = {"method": "ngram", "num_tokens": 3, "max_batch_size": 8}
    engine = Engine(_config(path, 2, speculative=speculative, parallel={"step_broadcast": "gloo"})
                    | {"plugins": ["treadle.plugins.speculators.ngram"]})
    try:
        assert engine.model_info["step_broadcast"] == "gloo" and engine.model_info["step_channel"] is None
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o.token_ids for o in outputs] == expected
        assert sum(o.spec_verify_steps for o in outputs) > 0
        per_rank = engine.scheduler.kv_stats_per_rank()
        assert per_rank[0] == per_rank[1]
        assert_kv_accounted(engine)
    finally:
        engine.shutdown()
