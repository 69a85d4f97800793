"""Overlapped verify (speculative.overlap): the next verify step of draft chains is queued before the host reads the
previous one's results, its positions, request-table entries and drafts (the test ``oracle`` speculator's
``propose_on_device``) computed on the device. Greedy outputs stay the plain run's token for token with every draft
kept, with steps keeping two of four (the rest's KV given back one step late), when a stop token or the token budget
ends a request in the middle of a chain (its row of the overlapped step wasted), when a small KV pool forces
retractions, and when a request is aborted with an overlapped step in flight; every KV slot comes back. torch_native
runs here; triton runs under the interpreter in a fresh process (this file as a script, TRITON_INTERPRET=1 set before
anything imports triton)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.execution.attention import AttentionBackend
from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.request import Req
from treadle.core.speculative.worker import overlapped_verify_support
from treadle.testing.engine import assert_kv_accounted
from treadle.testing.speculator_plugins import OverlappedVerifySteps

PLUGINS = ["treadle.testing.speculator_plugins", "treadle.plugins.speculators.ngram"]
PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 11], [300, 301, 9], [60, 61, 62, 63, 60, 61]]
BUDGETS = (12, 7, 18)  # none a whole number of k + 1 = 5 after the prefill's token: the budget ends mid-chain


def make_engine(model_dir: str, method: str | None, backend: str = "torch_native", pool: int = 2048,
                overlap: bool | str = True) -> Engine:
    config = {"model": {"path": model_dir}, "attention": {"backend": backend}, "plugins": PLUGINS,
              "cache": {"max_total_tokens": pool}, "scheduler": {"new_token_ratio": 0.0}}
    if method is not None:
        config["speculative"] = {"method": method, "num_tokens": 4, "max_batch_size": 16, "overlap": overlap}
    return Engine(config)


def greedy(stop_token_ids=None) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True,
                           stop_token_ids=stop_token_ids if i == 0 else None) for i, n in enumerate(BUDGETS)]


def oracle_engine(model_dir: str, plain: list[list[int]], backend: str = "torch_native", wrong_at: int | None = None,
                  pool: int = 2048) -> tuple[Engine, OverlappedVerifySteps]:
    """An engine whose oracle drafts ``plain`` (wrong from ``wrong_at`` on, if set), with a counter of its verify
    steps."""
    engine = make_engine(model_dir, "oracle", backend, pool)
    assert engine.scheduler.worker.overlap_verify
    if backend == "triton":  # the interpreter runs a program per KV split, used or not: 2 cover these lengths
        engine.scheduler.worker.target.runner.attn_backend.max_kv_splits = 2
    oracle = engine.scheduler.worker.speculator
    oracle.references = {tuple(p): ids for p, ids in zip(PROMPTS, plain)}
    oracle.wrong_at = wrong_at
    steps = OverlappedVerifySteps()
    engine.scheduler.add_observer(steps)
    return engine, steps


def oracle_run(model_dir: str, plain: list[list[int]], backend: str, wrong_at: int | None = None,
               pool: int = 2048, stop_token_ids=None) -> tuple[list, Engine, OverlappedVerifySteps]:
    """The oracle's run of the first ``len(plain)`` prompts."""
    engine, steps = oracle_engine(model_dir, plain, backend, wrong_at, pool)
    outputs = engine.generate(input_ids=PROMPTS[:len(plain)], sampling_params=greedy(stop_token_ids)[:len(plain)])
    assert_kv_accounted(engine)
    return outputs, engine, steps


def check_parity(model_dir: str, plain: list[list[int]], backend: str) -> None:
    """Every draft kept, then two of four kept a step: the plain tokens, most verify steps overlapped."""
    for wrong_at in (None, 2):
        outputs, _, steps = oracle_run(model_dir, plain, backend, wrong_at)
        assert [o.token_ids for o in outputs] == plain, wrong_at
        assert steps.overlapped >= steps.verify // 2 > 0, (steps.overlapped, steps.verify)


def check_stop_mid_chain(model_dir: str, plain: list[list[int]], backend: str, wrong_at: int | None = 2) -> None:
    """Request 0 stops at its 8th token (in the middle of a verify step's chain); the others run to their budget."""
    stop = plain[0][7]
    expected = plain[0][:plain[0].index(stop) + 1]
    outputs, _, steps = oracle_run(model_dir, plain, backend, wrong_at, stop_token_ids=[stop])
    assert outputs[0].token_ids == expected and outputs[0].finish_reason == "stop"
    assert [o.token_ids for o in outputs[1:]] == plain[1:] and steps.overlapped > 0


@pytest.fixture(scope="module")
def plain(tiny_llama_dir) -> list[list[int]]:
    engine = make_engine(tiny_llama_dir, None)
    return [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=greedy())]


def test_overlapped_verify_gives_the_plain_tokens_with_torch_native(tiny_llama_dir, plain):
    check_parity(tiny_llama_dir, plain, "torch_native")


def test_a_stop_in_the_middle_of_a_chain_ends_the_request_there(tiny_llama_dir, plain):
    check_stop_mid_chain(tiny_llama_dir, plain, "torch_native")


def test_overlapped_verify_under_retraction_keeps_the_plain_tokens(tiny_llama_dir):
    """Budgets long enough that requests overlap their verify steps around the retractions a 48-slot pool forces
    (no step overlaps while a retracted request waits)."""
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (30, 25, 40)]
    plain = [o.token_ids for o in make_engine(tiny_llama_dir, None).generate(input_ids=PROMPTS, sampling_params=params)]
    engine, steps = oracle_engine(tiny_llama_dir, plain, wrong_at=2, pool=48)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert [o.token_ids for o in outputs] == plain
    assert engine.kv_stats()["retractions"] > 0, "the small pool must force a retraction"
    assert steps.overlapped > 0
    assert_kv_accounted(engine)


@pytest.mark.parametrize("abort_after", [3, 5])
def test_an_abort_with_overlapped_steps_in_flight_frees_everything(tiny_llama_dir, plain, abort_after):
    engine, steps = oracle_engine(tiny_llama_dir, plain, wrong_at=2)
    scheduler = engine.scheduler
    for i, (prompt, params) in enumerate(zip(PROMPTS, greedy())):
        scheduler.add_request(Req(rid=f"r{i}", origin_input_ids=prompt, sampling_params=params))
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    for count in range(1, 100):
        if not scheduler.has_work():
            break
        for output in scheduler.step():
            got[output.rid].extend(output.new_token_ids)
        if count == abort_after:
            assert steps.overlapped > 0 and scheduler.inflight is not None
            scheduler.abort_request("r0")
    assert [got["r1"], got["r2"]] == plain[1:] and got["r0"] == plain[0][:len(got["r0"])] != plain[0]
    assert_kv_accounted(engine)


def test_cutting_kv_positions_out_of_the_middle_keeps_the_later_ones_in_order():
    req = Req(rid="r", origin_input_ids=[1, 2], sampling_params=SamplingParams())
    req.kv_slots = torch.tensor([10, 11, 12], dtype=torch.int64)
    req.extend_kv_slots([13, 14, 15, 16])
    assert req.cut_kv(4, 6) == [14, 15]  # within the recent slots (kept as ints)
    assert req.cut_kv(1, 3) == [11, 12]  # reaching into the older ones
    assert req.kv_slots.tolist() == [10, 13, 16] and req.kv_len == 3


def test_overlap_true_needs_a_speculator_that_proposes_on_the_device(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"speculative.overlap: true needs a speculator that proposes on the "
                                         r"device .*'ngram' does not"):
        make_engine(tiny_llama_dir, "ngram")
    assert not make_engine(tiny_llama_dir, "ngram", overlap="auto").scheduler.worker.overlap_verify


class _HostLengthsBackend(AttentionBackend):  # never run: only its verify route is asked
    init_forward_metadata = forward_extend = forward_decode = None


class _DeviceLengthsBackend(_HostLengthsBackend):
    def verifies_by_decode(self, mode: ForwardMode, num_tokens: int) -> bool:
        return mode.is_verify() and num_tokens <= 8


def test_a_backend_joins_overlapped_verify_off_the_cpu_by_answering_verifies_by_decode():
    def worker(backend: AttentionBackend) -> SimpleNamespace:
        config = SimpleNamespace(speculative=SimpleNamespace(topk=1, method="oracle"), attention=SimpleNamespace(
            backend="mine"), scheduler=SimpleNamespace(disable_overlap=False))
        return SimpleNamespace(config=config, speculator=SimpleNamespace(proposes_on_device=True),
                               info=SimpleNamespace(page_size=1, device=torch.device("cuda")),
                               target=SimpleNamespace(runner=SimpleNamespace(attn_backend=backend)))

    assert overlapped_verify_support("auto", worker(_DeviceLengthsBackend()))
    assert not overlapped_verify_support("auto", worker(_HostLengthsBackend()))
    with pytest.raises(ValueError, match=r"reads a verify step's lengths on the device "
                                         r"\(AttentionBackend.verifies_by_decode.*not mine"):
        overlapped_verify_support(True, worker(_HostLengthsBackend()))


def test_overlapped_verify_stops_mid_chain_with_triton_interpreted(tiny_llama_dir, plain):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, tiny_llama_dir, repr(plain)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.split() == ["stop-mid-chain"]


def test_no_step_is_queued_that_a_fully_kept_chain_would_waste(tiny_llama_dir, plain):
    """Budget 9: the prefill's token, then chains of 5 leave 3 for the second verify step, whose drafts all kept
    end the request. Overlapping it with a third step would throw that step away whole: none is launched."""
    engine, steps = oracle_engine(tiny_llama_dir, plain)
    params = SamplingParams(max_new_tokens=9, temperature=0.0, ignore_eos=True)
    (output,) = engine.generate(input_ids=PROMPTS[:1], sampling_params=params)
    assert output.token_ids == plain[0][:9]
    assert steps.verify == output.spec_verify_steps == 2 and steps.overlapped == 1
    assert_kv_accounted(engine)


if __name__ == "__main__":
    import ast

    # One run (the interpreter takes a second or more a step): every draft kept, request 0 stopped
    # mid-chain, the others out of budget mid-chain.
    model_dir, plain_ids = sys.argv[1], ast.literal_eval(sys.argv[2])
    check_stop_mid_chain(model_dir, plain_ids, "triton", wrong_at=None)
    print("stop-mid-chain", flush=True)
