"""eagle3 under overlapped verify (``speculative.overlap``: its drafts proposed on the device, eagle3_overlap.py): a
stop token in the middle of a chain ends the request there (its row of the overlapped step wasted) while the others
run out of budget mid-chain, the head's KV computed on the device is the host path's, an abort with an overlapped step
in flight frees everything, and both hold with the triton backend under the interpreter (this file as a script, in a
fresh process with TRITON_INTERPRET=1). The head's drafts are kept now and then (its draft vocabulary mapped onto
tokens the tiny target repeats); every KV slot comes back. Parity over longer runs, retraction and the drafts' values:
tests/plugins/test_eagle3_speculator.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.request import Req
from treadle.testing.eagle3_heads import make_eagle3_head
from treadle.testing.engine import assert_kv_accounted
from treadle.testing.speculator_plugins import OverlappedVerifySteps

PROMPTS = [[400, 7, 7, 7, 9, 10, 11, 12, 13], [300, 301, 9], [5, 17, 42, 8, 99, 3, 250, 11]]
BUDGETS = (14, 7, 10)
LOOP_TOKENS = (8, 8, 81, 471, 315)  # what the tiny target's greedy outputs here repeat


def make_engine(model_dir: str, head_dir: str | None, backend: str = "torch_native", overlap: bool = True) -> Engine:
    config = {"model": {"path": model_dir}, "attention": {"backend": backend}, "cache": {"max_total_tokens": 1024},
              "scheduler": {"new_token_ratio": 0.0}, "plugins": ["treadle.plugins.speculators.eagle3"]}
    if head_dir is not None:
        config["speculative"] = {"method": "eagle3", "num_tokens": 3, "draft_model_path": head_dir,
                                 "max_batch_size": 8, "overlap": overlap}
    engine = Engine(config)
    if backend == "triton" and head_dir is not None:  # the interpreter runs a program per KV split, used or not
        engine.scheduler.worker.target.runner.attn_backend.max_kv_splits = 1
        engine.scheduler.worker.speculator.attn_backend.max_kv_splits = 1
    return engine


def greedy(stop: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True,
                           stop_token_ids=[stop] if stop is not None and i == 0 else None)
            for i, n in enumerate(BUDGETS)]


def looping_head(model_dir: str, path: Path, draft_targets: tuple[int, ...] = LOOP_TOKENS) -> str:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return make_eagle3_head(path, config, 128, [-1, 0, 1], draft_targets=draft_targets)


def check_stop_mid_chain(model_dir: str, head_dir: str, plain: list[list[int]], backend: str) -> None:
    """Request 0 stops at the first 81 after its run of 8s; the others (the first ``len(plain)`` of them) run out
    of budget."""
    stop = 81
    expected = plain[0][:plain[0].index(stop) + 1]
    engine = make_engine(model_dir, head_dir, backend)
    steps = OverlappedVerifySteps()
    engine.scheduler.add_observer(steps)
    outputs = engine.generate(input_ids=PROMPTS[:len(plain)], sampling_params=greedy(stop)[:len(plain)])
    assert outputs[0].token_ids == expected and outputs[0].finish_reason == "stop"
    assert [o.token_ids for o in outputs[1:]] == plain[1:]
    assert steps.overlapped > 0 and sum(o.spec_verify_steps for o in outputs) < sum(len(o.token_ids) for o in outputs)
    assert_kv_accounted(engine)
    assert not engine.scheduler.worker.speculator.states


@pytest.fixture(scope="module")
def head_dir(tiny_llama_dir, tmp_path_factory) -> str:
    return looping_head(tiny_llama_dir, tmp_path_factory.mktemp("eagle3-looping"))


@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> list[list[int]]:
    return [o.token_ids for o in make_engine(tiny_llama_dir, None).generate(input_ids=PROMPTS,
                                                                            sampling_params=greedy())]


def test_a_stop_in_the_middle_of_a_chain_ends_the_request_there(tiny_llama_dir, head_dir, plain):
    assert 81 in plain[0][5:], "the stop token must come after some kept drafts"
    check_stop_mid_chain(tiny_llama_dir, head_dir, plain, "torch_native")


def test_the_heads_kv_is_the_host_paths(tiny_llama_dir, head_dir, plain, monkeypatch):
    """Every pair the head computed on the device (catch-ups after partly kept steps) holds the K/V the host path
    computes: the head's KV cache at each finished sequence's slots (found in the radix cache), in the host path's
    run, an overlapped one, and one whose catch-ups go a request at a time (as on a GPU when the previous step had
    more tokens than the backend's decode-kernel route of verify steps takes), whose drafts are the same (so are
    its verify steps)."""
    from treadle.plugins.speculators import eagle3_overlap

    heads_kv, verify_steps = [], []
    for overlap, grouped in ((False, False), (True, False), (True, True)):
        if grouped:
            monkeypatch.setattr(eagle3_overlap, "_group_size", lambda speculator, bs, t: 1)
        engine = make_engine(tiny_llama_dir, head_dir, overlap=overlap)
        steps = OverlappedVerifySteps()
        engine.scheduler.add_observer(steps)
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=greedy())
        assert [o.token_ids for o in outputs] == plain and (steps.overlapped > 0) == overlap
        verify_steps.append([o.spec_verify_steps for o in outputs])
        cache, kv = engine.scheduler.memory.tree_cache, engine.scheduler.worker.speculator.kv_cache.kv_buffer
        # The pairs before the last verify step's (those after it hold drafts' pairs).
        heads_kv.append([kv[:, cache.match_prefix(p + ids)[0][:len(p) + len(ids) - 2 * 4]]
                         for p, ids in zip(PROMPTS, plain)])
    assert sum(kv.shape[1] for kv in heads_kv[0]) > 20 and verify_steps[1] == verify_steps[2]
    for run in heads_kv[1:]:
        for on_device, on_host in zip(run, heads_kv[0]):
            torch.testing.assert_close(on_device, on_host, rtol=1e-4, atol=1e-5)


def test_an_abort_with_an_overlapped_step_in_flight_frees_everything(tiny_llama_dir, head_dir, plain):
    engine = make_engine(tiny_llama_dir, head_dir)
    scheduler, steps = engine.scheduler, OverlappedVerifySteps()
    scheduler.add_observer(steps)
    for i, (prompt, params) in enumerate(zip(PROMPTS, greedy())):
        scheduler.add_request(Req(rid=f"r{i}", origin_input_ids=prompt, sampling_params=params))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    aborted = False
    while scheduler.has_work():
        for output in scheduler.step():
            got[output.rid].extend(output.new_token_ids)
        if not aborted and steps.overlapped > 0 and scheduler.inflight is not None:
            scheduler.abort_request("r0")
            aborted = True
    assert aborted and [got["r1"], got["r2"]] == plain[1:] and got["r0"] == plain[0][:len(got["r0"])] != plain[0]
    assert_kv_accounted(engine)
    assert not scheduler.worker.speculator.states


def test_triton_interpreted_stops_mid_chain(tiny_llama_dir, plain, tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    # Request 0 alone, drafting only its 8s (the interpreter takes a second or more a step: few steps).
    head = looping_head(tiny_llama_dir, tmp_path, draft_targets=(8,))
    proc = subprocess.run([sys.executable, __file__, tiny_llama_dir, head, repr(plain[:1])], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.split() == ["stop-mid-chain"]


if __name__ == "__main__":
    import ast

    check_stop_mid_chain(sys.argv[1], sys.argv[2], ast.literal_eval(sys.argv[3]), "triton")
    print("stop-mid-chain", flush=True)
