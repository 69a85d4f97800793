"""Exact sampling of verify steps: rejection sampling of drafts drawn from a known distribution q keeps the target's
distribution p (after temperature 0.7 and top-p 0.9) at every position, checked by chi-square over many seeded
requests; drafts drawn from p itself are all kept; greedy rows keep exactly the drafts equal to their argmax; a
seeded request samples the same tokens in any batch. (Drafts without q, the n-gram kind, take the sampler's
match path: tests/plugins/test_ngram_speculator.py checks seeded outputs equal plain decoding's.)"""

from __future__ import annotations

import torch

from treadle.core.execution.sampler import Sampler, SamplingBatch
from treadle.core.request import Req, SamplingParams

from chi_square import chi_square_passes

VOCAB, K, REQUESTS = 12, 2, 30000
T = K + 1
TEMPERATURE, TOP_P = 0.7, 0.9


def reqs(count: int, **params) -> list[Req]:
    made = []
    for i in range(count):
        req = Req(rid=f"r{i}", origin_input_ids=[1, 2], sampling_params=SamplingParams(**params))
        req.sample_seed = 1000 + i
        made.append(req)
    return made


def target_distribution(logits: torch.Tensor) -> torch.Tensor:
    """Softmax at TEMPERATURE, then the smallest set of most likely tokens whose mass reaches TOP_P, renormalized."""
    probs = torch.softmax(logits / TEMPERATURE, dim=-1)
    order = probs.argsort(descending=True)
    kept = torch.zeros_like(probs)
    mass = 0.0
    for token in order.tolist():
        if mass > TOP_P:
            break
        kept[token] = probs[token]
        mass += float(probs[token])
    return kept / kept.sum()


def setup(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    position_logits = torch.randn(T, VOCAB, generator=generator) * 0.6  # the same target at every request
    q = torch.distributions.Dirichlet(torch.ones(VOCAB)).sample((K,))  # the drafts' distribution per position
    drafts = torch.stack([torch.multinomial(q[j], REQUESTS, replacement=True, generator=generator)
                          for j in range(K)], dim=1)
    logits = position_logits.repeat(REQUESTS, 1)
    return position_logits, q, drafts, logits


def test_rejection_sampling_keeps_the_targets_distribution_at_every_position():
    position_logits, q, drafts, logits = setup()
    batch = SamplingBatch.from_reqs(reqs(REQUESTS, temperature=TEMPERATURE, top_p=TOP_P), VOCAB,
                                    torch.device("cpu"), tokens_per_req=T)
    result = Sampler()(logits, batch, draft_ids=drafts, draft_probs=q.expand(REQUESTS, K, VOCAB))
    tokens, accepted = result.next_token_ids.view(REQUESTS, T), result.accepted
    p = [target_distribution(position_logits[j]) for j in range(T)]
    assert torch.equal(tokens[:, :K][accepted.unsqueeze(1) > torch.arange(K)],
                       drafts[accepted.unsqueeze(1) > torch.arange(K)]), "kept tokens are the drafts"
    # Position 0 is always emitted; position j only after j kept drafts, and then it follows p_j.
    assert chi_square_passes(tokens[:, 0], p[0])
    assert chi_square_passes(tokens[accepted >= 1, 1], p[1])
    assert chi_square_passes(tokens[accepted == K, K], p[K])
    # A draft is kept with probability sum_x min(p(x), q(x)).
    expected_rate = float(torch.minimum(p[0], q[0]).sum())
    assert abs(float((accepted >= 1).double().mean()) - expected_rate) < 0.02
    # A wrong sampler fails the same check: the drafts' own distribution is not p.
    assert not chi_square_passes(drafts[:, 0], p[0])


def test_drafts_drawn_from_the_target_itself_are_all_kept():
    position_logits, _, _, logits = setup(1)
    p = torch.stack([target_distribution(position_logits[j]) for j in range(K)])
    generator = torch.Generator().manual_seed(2)
    drafts = torch.stack([torch.multinomial(p[j], REQUESTS, replacement=True, generator=generator)
                          for j in range(K)], dim=1)
    batch = SamplingBatch.from_reqs(reqs(REQUESTS, temperature=TEMPERATURE, top_p=TOP_P), VOCAB,
                                    torch.device("cpu"), tokens_per_req=T)
    result = Sampler()(logits, batch, draft_ids=drafts, draft_probs=p.expand(REQUESTS, K, VOCAB))
    assert result.accepted.tolist() == [K] * REQUESTS


def test_greedy_rows_keep_the_drafts_equal_to_their_argmax_and_seeds_fix_the_rest():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(4 * T, VOCAB, generator=generator)
    argmax = logits.argmax(dim=-1).view(4, T)
    drafts = argmax[:, :K].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % VOCAB  # request 1: its second draft is wrong
    drafts[3, 0] = (drafts[3, 0] + 1) % VOCAB
    q = torch.softmax(torch.randn(4, K, VOCAB, generator=generator), dim=-1)
    mixed = reqs(4, temperature=0.0)
    mixed[2].sampling_params = mixed[3].sampling_params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P)
    batch = SamplingBatch.from_reqs(mixed, VOCAB, torch.device("cpu"), tokens_per_req=T)
    result = Sampler()(logits, batch, draft_ids=drafts, draft_probs=q)
    tokens = result.next_token_ids.view(4, T)
    assert result.accepted[:2].tolist() == [K, 1]
    assert torch.equal(tokens[:2], argmax[:2])
    # The sampled rows alone in a batch draw the same tokens and keep the same drafts.
    alone = SamplingBatch.from_reqs(mixed[2:], VOCAB, torch.device("cpu"), tokens_per_req=T)
    again = Sampler()(logits[2 * T:], alone, draft_ids=drafts[2:], draft_probs=q[2:])
    assert torch.equal(again.accepted, result.accepted[2:])
    for i in range(2):
        kept = int(again.accepted[i]) + 1
        assert torch.equal(again.next_token_ids.view(2, T)[i, :kept], tokens[2 + i, :kept])
