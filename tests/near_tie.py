"""Comparing a run's greedy tokens with a plain run's where low precision may flip a near-tie (shared by the GPU
speculative tests; imported by name, see conftest.py)."""

from __future__ import annotations

NEAR_TIE = 2e-3  # log-prob gap under which the two best tokens may swap between two numerically different runs
# The logits leave a bfloat16 lm_head in bfloat16. At the real-shape test model's logit sizes (16-64) neighbouring
# bfloat16 values lie 0.125-0.25 apart, so two bfloat16 runs whose matmuls round differently (a verify step's
# 5-row GEMM against decode's one-row GEMV) can swap two tokens one or two spacings apart: every such parting
# seen on an H100 had a gap that is a multiple of 1/16 (0.0625, 0.125, 0.25).
BF16_LOGIT_TIE = 0.26
# How far a bfloat16 run's token may trail the greedy one when scored by another bfloat16 pass (a prefill): the
# real-shape model's bfloat16 log-probs sit up to ~0.5 from float32 ones (docs/parallel.md).
BF16_SCORED_TIE = 0.5


def assert_plain_or_near_tie(outputs, plain, min_equal: int, near_tie: float = NEAR_TIE) -> None:
    """Each output equals its plain twin, or parts from it first at a near-tie of the plain run's top two tokens
    (and takes one of them there); at least ``min_equal`` outputs are equal throughout."""
    for i, (got, want) in enumerate(zip(outputs, plain)):
        part = next((j for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), None)
        if part is None:
            assert len(got.token_ids) == len(want.token_ids)
            continue
        (first, top1), (second, top2) = want.output_top_logprobs[part][:2]
        assert top1 - top2 <= near_tie and got.token_ids[part] in (first, second), (
            f"request {i} parted from the plain run at token {part}, not at a near-tie ({top1} vs {top2})")
    assert sum(o.token_ids == p.token_ids for o, p in zip(outputs, plain)) >= min_equal


def assert_greedy_under(engine, prompts, outputs, tolerance: float = BF16_SCORED_TIE) -> None:
    """Every token of each output is ``engine``'s greedy choice within ``tolerance``, scored teacher-forced: the
    prompt and the output go through ``engine`` as one prefill, and at each output position the chosen token's
    log-prob may trail the best one by at most ``tolerance``. Unlike comparing with a plain run token by token, this
    holds past a point where rounding swapped two near-tied tokens, and a wrong token (typically nats behind) fails."""
    from treadle import SamplingParams

    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        scored = engine.generate(input_ids=[list(prompt) + list(output.token_ids)],
                                 sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
                                 return_logprob=True, top_logprobs_num=1, logprob_start_len=len(prompt))[0]
        chosen, best = scored.input_token_logprobs, scored.input_top_logprobs
        assert len(chosen) == len(output.token_ids), (i, len(chosen), len(output.token_ids))
        for j, (token, (top_token, top)) in enumerate(zip(output.token_ids, (b[0] for b in best))):
            assert top - chosen[j] <= tolerance, (
                f"request {i} token {j}: chose {token} at {chosen[j]:.3f}, the greedy choice {top_token} scores {top:.3f}")
