"""The sampler's tables: greedy batches carry no tensors, penalties match a from-scratch count, logit bias."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from treadle.core.request import Req, SamplingParams
from treadle.core.execution.sampler import PenaltyBatch, PenaltyPool, Sampler, SamplingBatch

VOCAB = 50


def _req(rid: str, prompt: list[int], outputs: list[int], row: int, **params) -> Req:
    req = Req(rid=rid, origin_input_ids=prompt, sampling_params=SamplingParams(**params))
    req.output_ids = list(outputs)
    req.req_pool_idx = row
    return req


def _reference(reqs: list[Req]) -> PenaltyBatch:
    """Counts rebuilt from the whole history, as the sampler did before the pool."""
    bs = len(reqs)
    counts = torch.zeros((bs, VOCAB))
    seen = torch.zeros((bs, VOCAB), dtype=torch.bool)
    for row, req in enumerate(reqs):
        for token in req.output_ids:
            counts[row, token] += 1
        if req.sampling_params.repetition_penalty != 1.0:
            seen[row, req.all_ids] = True
    column = lambda name: torch.tensor([[getattr(r.sampling_params, name)] for r in reqs])  # noqa: E731
    return PenaltyBatch(counts, seen, column("repetition_penalty"), column("frequency_penalty"),
                        column("presence_penalty"))


def test_greedy_batches_build_no_tensors() -> None:
    reqs = [_req("a", [1, 2], [], 0, temperature=0.0), _req("b", [3], [4], 1, top_k=1, temperature=1.0)]
    batch = SamplingBatch.from_reqs(reqs, VOCAB, torch.device("cpu"))
    assert batch.all_greedy and batch.temperatures is None and batch.penalty_reqs is None
    logits = torch.randn(2, VOCAB)
    assert torch.equal(Sampler()(logits, batch).next_token_ids, logits.argmax(-1))


def test_mixed_batches_pack_parameters_per_row() -> None:
    reqs = [_req("a", [1], [5, 6], 0, temperature=0.0),
            _req("b", [2], [7], 1, temperature=0.5, top_p=0.8, top_k=10, min_p=0.1, seed=9)]
    batch = SamplingBatch.from_reqs(reqs, VOCAB, torch.device("cpu"))
    assert batch.temperatures.flatten().tolist() == [1.0, 0.5]
    assert batch.greedy.tolist() == [True, False]
    assert batch.top_ks.tolist() == [VOCAB, 10] and batch.seeds.tolist()[1] == 9
    assert batch.steps.tolist() == [2, 1]
    assert (batch.need_top_p, batch.need_top_k, batch.need_min_p) == (True, True, True)


def test_penalty_pool_counts_incrementally_and_rebuilds_rows_that_change_owner() -> None:
    pool = PenaltyPool(VOCAB, "cpu")
    a = _req("a", [1, 2, 3], [4, 4], 2, repetition_penalty=1.3, frequency_penalty=0.5)
    b = _req("b", [9], [], 0, presence_penalty=0.7)
    for step in range(4):
        got = pool.batch([a, b])
        want = _reference([a, b])
        for field in ("output_counts", "seen_in_sequence", "repetition", "frequency", "presence"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (step, field)
        a.output_ids.append(4 + step)
        b.output_ids.extend([7, 7] if step == 1 else [8])
    # Row 2 goes to a new request: it starts from zero, not from a's counts.
    c = _req("c", [5], [6], 2, frequency_penalty=1.0)
    assert torch.equal(pool.batch([c]).output_counts, _reference([c]).output_counts)
    # a comes back (after a retraction) on another row: rebuilt from its host lists.
    a.req_pool_idx = 5
    assert torch.equal(pool.batch([b, a]).output_counts, _reference([b, a]).output_counts)
    # A request released while its last step was in flight reads a zero row (its token is discarded).
    a.req_pool_idx = None
    assert pool.batch([a, b]).output_counts[0].abs().sum() == 0


def test_sampler_applies_pooled_penalties_like_the_reference() -> None:
    reqs = [_req("a", [1, 2], [3, 3, 3], 0, temperature=0.0, frequency_penalty=5.0),
            _req("b", [4], [], 1, temperature=0.0)]
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 10.0  # the favourite, until a's frequency penalty (3 x 5) pushes it below 0
    ids = Sampler()(logits, SamplingBatch.from_reqs(reqs, VOCAB, torch.device("cpu"))).next_token_ids
    assert ids[0].item() != 3 and ids[1].item() == 3


def test_logit_bias_moves_only_its_rows_tokens_and_leaves_the_logprobs_raw() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB).to(torch.bfloat16)
    favourite = logits.float().argmax(-1)
    reqs = [_req("ban", [1], [], 0, temperature=0.0, logit_bias={int(favourite[0]): -100}),
            _req("force", [1], [], 1, temperature=0.0, logit_bias={"7": 100.0, 8: -3}),
            _req("plain", [1], [], 2, temperature=0.0),
            _req("sampled", [1], [2], 3, temperature=0.8, seed=4, logit_bias={11: 100})]
    for req in reqs:
        req.return_logprob = True
    batch = SamplingBatch.from_reqs(reqs, VOCAB, torch.device("cpu"))
    assert batch.logit_bias.rows.tolist() == [0, 1, 1, 3]
    assert batch.logit_bias.token_ids.tolist() == [int(favourite[0]), 7, 8, 11]
    raw = logits.clone()
    result = Sampler()(logits, batch)
    ids = result.next_token_ids.tolist()
    biased = logits.float()
    biased[0, favourite[0]] -= 100
    assert ids[0] == biased[0].argmax().item() != favourite[0].item()
    assert ids[1:] == [7, favourite[2].item(), 11]
    assert torch.equal(logits, raw)  # the model's logits are not changed in place
    chosen = torch.log_softmax(raw.float(), -1).gather(1, result.next_token_ids[:, None]).squeeze(1)
    assert torch.equal(result.logprobs, chosen)
    # Without any bias the batch carries none.
    assert SamplingBatch.from_reqs(reqs[2:3], VOCAB, torch.device("cpu")).logit_bias is None


def test_logit_bias_is_checked_and_normalized() -> None:
    import pytest

    from treadle.core.request import InvalidRequestError

    assert SamplingParams(logit_bias={"12": 1, 3: -2.5}).logit_bias == {12: 1.0, 3: -2.5}
    for bad in ({"x": 1}, {-1: 1}, {3: "a"}, {True: 1}, [3]):
        with pytest.raises(InvalidRequestError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(InvalidRequestError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={3: 100.5}).verify()


def test_16_bit_logits_sample_what_their_float32_widening_samples() -> None:
    """Models return logits in their dtype; the sampler widens them wherever it computes probabilities."""
    torch.manual_seed(0)
    logits = (torch.randn(4, VOCAB) * 4).to(torch.bfloat16)  # bf16 rounding makes ties: argmax keeps the first
    cases = {
        "greedy": [_req(f"g{i}", [1], [2], i, temperature=0.0) for i in range(4)],
        "sampled": [_req("a", [1], [2, 3], 0, temperature=0.7, top_k=8, seed=1),
                    _req("b", [1], [], 1, temperature=1.3, top_p=0.6, min_p=0.05, seed=2),
                    _req("c", [1], [5], 2, temperature=0.0),
                    _req("d", [4], [4, 4], 3, temperature=0.9, seed=3)],
        "penalties": [_req(f"p{i}", [1, 2], [3, 3], i, temperature=0.0, repetition_penalty=1.2,
                           frequency_penalty=0.3, presence_penalty=0.4) for i in range(4)],
    }
    for name, reqs in cases.items():
        for req in reqs:
            req.return_logprob, req.top_logprobs_num = True, 3
        batch = SamplingBatch.from_reqs(reqs, VOCAB, torch.device("cpu"))
        narrow, wide = Sampler()(logits, batch), Sampler()(logits.float(), batch)
        assert torch.equal(narrow.next_token_ids, wide.next_token_ids), name
        assert torch.equal(narrow.logprobs, wide.logprobs), name
        assert all(torch.equal(n, w) for n, w in zip(narrow.top_logprobs, wide.top_logprobs)), name


def test_two_pass_argmax_picks_what_torch_argmax_picks() -> None:
    from treadle.core.execution.sampler import argmax_last_dim

    gen = torch.Generator().manual_seed(0)
    # bf16 rounding of small integers makes many ties; a NaN counts as the maximum (first NaN wins).
    x = torch.randint(0, 6, (9, 128 * 64), generator=gen).to(torch.bfloat16)
    x[3, 5000] = x[3, 7000] = float("nan")
    x[4] = 0.0  # every column ties
    x[5, -1] = 10.0  # the last group's last column
    for logits in (x, x.float(), x[:, : 128 * 64 - 32].contiguous(), x[:, ::2]):  # grouped, plain, strided
        assert torch.equal(argmax_last_dim(logits), torch.argmax(logits, dim=-1)), logits.shape
    assert argmax_last_dim(x)[3] == 5000 and argmax_last_dim(x)[5] == 128 * 64 - 1


_ARGMAX_KERNEL_CHECK = """
import torch
from treadle.kernels.argmax import argmax_rows
gen = torch.Generator().manual_seed(0)
x = torch.randint(0, 6, (9, 4096 * 2 + 37), generator=gen).to(torch.bfloat16)  # bf16 small integers: many ties
x[3, 5000] = x[3, 7000] = float("nan")  # the first NaN wins
x[4] = 0.0  # every column ties
x[5, -1] = 10.0  # the last, partial block
x[6] = float("-inf")
x[7, 100] = float("nan"); x[7, 8000] = float("inf")
x[8, 4096 + 3] = x[8, 3] = 50.0  # equal maxima in the same lane of different blocks
for logits in (x, x.float(), x.half(), x[:, 1:], torch.randn(3, 100), torch.randn(0, 10)):
    got, want = argmax_rows(logits), torch.argmax(logits, dim=-1)
    assert got.dtype == torch.int64 and torch.equal(got, want), (logits.shape, got, want)
print("OK")
"""


def test_argmax_kernel_picks_what_torch_argmax_picks() -> None:
    """The GPU's one-launch argmax (kernels/argmax.py) under the Triton interpreter."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _ARGMAX_KERNEL_CHECK], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_a_verify_step_samples_each_position_as_a_one_token_step_at_that_output_position_would() -> None:
    """Rows ``i * t + j`` of a step of t tokens per request are request i's position j: its parameters, its logit
    bias, and the seeded noise of output position ``len(output_ids) + j`` (so speculation does not change what a
    seeded request samples)."""
    t = 3
    reqs = [_req("a", [1], [5, 6], 0, temperature=0.0, logit_bias={7: 50.0}),
            _req("b", [2], [7], 1, temperature=0.7, top_p=0.9, top_k=20, seed=11),
            _req("c", [3, 4], [], 2, temperature=1.3, min_p=0.05, seed=5, logit_bias={3: 2.0})]
    logits = torch.randn(len(reqs) * t, VOCAB, generator=torch.Generator().manual_seed(0))
    batch = SamplingBatch.from_reqs(reqs, VOCAB, torch.device("cpu"), tokens_per_req=t)
    result = Sampler()(logits, batch)
    assert result.next_token_ids.shape == (len(reqs) * t,)
    for i, req in enumerate(reqs):
        for j in range(t):
            alone = _req(req.rid, req.origin_input_ids, req.output_ids + [0] * j, i, temperature=1.0)
            alone.sampling_params, alone.sample_seed = req.sampling_params, req.sample_seed
            alone.logit_bias_table = req.logit_bias_table
            one = Sampler()(logits[i * t + j:i * t + j + 1], SamplingBatch.from_reqs([alone], VOCAB, torch.device("cpu")))
            assert int(result.next_token_ids[i * t + j]) == int(one.next_token_ids[0]), (req.rid, j)
    assert result.next_token_ids[:t].tolist() == [7] * t  # the bias reaches every row of request a


def test_penalties_repeat_for_every_position_of_a_verify_step() -> None:
    reqs = [_req("a", [1], [4, 4], 0, temperature=0.0, frequency_penalty=0.5),
            _req("b", [2], [9], 1, temperature=0.0, repetition_penalty=1.5)]
    one_token = PenaltyPool(VOCAB, "cpu").batch(reqs)
    per_position = one_token.per_position(2)
    assert per_position.output_counts.shape == (4, VOCAB)
    for j in range(2):
        assert torch.equal(per_position.output_counts[j::2], one_token.output_counts)
        assert torch.equal(per_position.seen_in_sequence[j::2], one_token.seen_in_sequence)
        assert torch.equal(per_position.frequency[j::2], one_token.frequency)
