"""Driving a ModelWorker by hand through prefills, TARGET_VERIFY steps and one-token decode steps, as a speculative
decoder will (shared by the CPU and GPU verify tests; imported by name, see conftest.py).

``verify_against_decode`` is the whole check: for each of two prompts, one request verifies ``k`` drafts in one
TARGET_VERIFY step (both in one batch) while a twin request feeds the same tokens one decode step at a time;
the second prompt reuses the first ``shared`` tokens of the first one's KV (a prefix-cache hit).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.request import Req, SamplingParams
from treadle.core.scheduling.schedule_batch import BatchEntry, ScheduleBatch


@dataclass
class VerifyRun:
    verify_logits: torch.Tensor  # [bs, k + 1, vocab], float32 on the host
    decode_logits: torch.Tensor  # [bs, k + 1, vocab], the same tokens fed one decode step at a time
    sequences: list[list[int]]  # prompt, first sampled token, drafts: what the k + 1 logits rows follow
    drafts: torch.Tensor  # [bs, k]
    twins_agree: bool  # each twin sampled the same first token as its verifying request
    next_ids: torch.Tensor  # [bs, k + 1] the verify step's greedy token at each position
    accepted: torch.Tensor  # [bs] drafts kept
    next_input: torch.Tensor  # [bs] what the next step would be fed (the worker's device buffer)


class HandDriver:
    """Requests placed by hand in a worker's request table and KV pool (page size 1)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.allocator = worker.info.allocator
        self.pool = worker.info.req_to_token_pool

    def prefill(self, prompt: list[int], donor: Req | None = None, shared: int = 0) -> Req:
        """A new request with ``prompt`` computed, its first ``shared`` positions on ``donor``'s KV slots (a
        prefix-cache hit); its first token is sampled greedily (appended to ``output_ids`` and, on the
        device, fed to its next step)."""
        req = Req(Req.new_rid(), list(prompt), SamplingParams(temperature=0.0, max_new_tokens=16))
        req.req_pool_idx = self.pool.alloc()
        slots = self.allocator.alloc_extend([shared], [len(prompt) - shared], [-1])
        prefix = donor.kv_slots[:shared] if donor is not None else torch.empty(0, dtype=torch.int64)
        req.kv_slots = torch.cat([prefix, slots])
        entry = BatchEntry(req, shared, len(prompt) - shared, slots, write_from=0,
                           logit_positions=range(len(prompt) - 1, len(prompt)))
        step = self.worker.launch_forward(ScheduleBatch(ForwardMode.EXTEND, [entry]))
        self.worker.launch_sampling(step)
        req.output_ids.append(int(step.results.wait()["next_ids"][0]))
        return req

    def verify(self, reqs: list[Req], drafts: torch.Tensor, parents: torch.Tensor | None = None):
        """One TARGET_VERIFY step over ``reqs`` with ``drafts`` [bs, k] (a tree's with ``parents``); returns the
        launched step (logits kept)."""
        k = int(drafts.shape[1])
        entries = []
        for req in reqs:
            start = req.kv_len  # the last sampled token's position: its KV is computed now
            slots = self.allocator.alloc_extend([start], [k + 1], [-1])
            req.kv_slots = torch.cat([req.kv_slots, slots])
            entries.append(BatchEntry(req, start, k + 1, slots, write_from=start,
                                      logit_positions=range(start, start + k + 1), input_on_device=True))
        device = self.worker.info.device
        batch = ScheduleBatch(ForwardMode.TARGET_VERIFY, entries)
        if parents is None:
            return self.worker.launch_forward(batch, draft_ids=drafts.to(device))
        return self.worker.launch_forward(batch, draft_ids=drafts.to(device), draft_parents=parents.to(device))

    def decode(self, req: Req, token: int | None) -> torch.Tensor:
        """One decode step of ``req`` fed ``token`` (None: the token sampled last, already on the device);
        its logits row (float32, host)."""
        worker = self.worker
        rows = torch.tensor([req.req_pool_idx], device=worker.info.device)
        if token is not None:
            worker.next_input_ids.record(rows, torch.tensor([token], device=worker.info.device))
        start = req.kv_len
        slots = self.allocator.alloc_extend([start], [1], [-1])
        req.kv_slots = torch.cat([req.kv_slots, slots])
        entry = BatchEntry(req, start, 1, slots, write_from=start, logit_positions=range(start, start + 1),
                           input_on_device=True)
        step = worker.launch_forward(ScheduleBatch(ForwardMode.DECODE, [entry]))
        return step.logits[0].float().cpu()


def verify_against_decode(worker, prompts: list[list[int]], k: int, shared: int, seed: int = 0) -> VerifyRun:
    """The check of the module docstring. Request 0's drafts are random; request 1's first draft is the token the
    target picks there (so at least one is kept), the rest random."""
    driver = HandDriver(worker)
    vocab = worker.info.vocab_size
    generator = torch.Generator().manual_seed(seed)
    verifying = [driver.prefill(prompts[0])]
    verifying.append(driver.prefill(prompts[1], donor=verifying[0], shared=shared))
    # The twins compute their prompts as the verifying requests do (request 1's on request 0's prefix KV too).
    twins = [driver.prefill(prompts[0]), driver.prefill(prompts[1], donor=verifying[0], shared=shared)]
    drafts = torch.randint(3, vocab, (len(prompts), k), generator=generator)
    # Decode one step at a time first: the twin of request 1 tells which token its first draft should be.
    decode_rows: list[list[torch.Tensor]] = []
    for i, twin in enumerate(twins):
        rows = [driver.decode(twin, None)]
        if i == 1:
            drafts[1, 0] = int(rows[0].argmax())
        for j in range(k):
            rows.append(driver.decode(twin, int(drafts[i, j])))
        decode_rows.append(rows)
    step = driver.verify(verifying, drafts)
    verify_logits = step.logits.float().cpu().view(len(prompts), k + 1, -1).clone()
    worker.launch_sampling(step)
    host = step.results.wait()
    rows = torch.tensor([req.req_pool_idx for req in verifying], device=worker.info.device)
    return VerifyRun(
        verify_logits=verify_logits,
        decode_logits=torch.stack([torch.stack(r) for r in decode_rows]),
        sequences=[req.origin_input_ids + req.output_ids + drafts[i].tolist() for i, req in enumerate(verifying)],
        drafts=drafts, twins_agree=all(t.output_ids[0] == v.output_ids[0] for t, v in zip(twins, verifying)),
        next_ids=host["next_ids"].cpu(), accepted=host["accepted"].cpu(),
        next_input=worker.next_input_ids.gather(rows).cpu(),
    )


def hf_logits(hf_model, sequence: list[int], positions: int) -> torch.Tensor:
    """HF's float32 logits at the last ``positions`` positions of ``sequence``."""
    with torch.no_grad():
        return hf_model(torch.tensor([sequence], device=hf_model.device)).logits[0, -positions:].float().cpu()


@dataclass
class TreeRun:
    node_logits: torch.Tensor  # [t, vocab]: the tree verify step's logits at each node
    expected_logits: torch.Tensor  # [t, vocab]: HF's after the prompt, the first token and each node's path
    accepted: int
    next_ids: list[int]  # the step's kept drafts and the target's token after them
    greedy: list[int]  # HF's greedy continuation after the first token (3 tokens)
    next_logits: torch.Tensor  # the decode step after it, on the kept path's K/V moved into place
    expected_next: torch.Tensor  # HF's on the prompt, the first token and ``greedy``


def verify_tree_against_hf(worker, hf_model, prompt: list[int]) -> TreeRun:
    """A tree of 5 drafts (root -> 0, 1; 0 -> 2; 1 -> 3 -> 4) whose right path, HF's greedy one, goes through the
    second child (1 -> 3; 4 is wrong): one verify step, then one decode step on the K/V it kept."""
    driver = HandDriver(worker)
    vocab = worker.info.vocab_size
    req = driver.prefill(prompt)
    sequence = prompt + req.output_ids
    greedy: list[int] = []
    for _ in range(3):
        greedy.append(int(hf_logits(hf_model, sequence + greedy, 1)[0].argmax()))
    g1, g2, g3 = greedy
    drafts = torch.tensor([[(g1 + 1) % vocab, g1, (g2 + 5) % vocab, g2, (g3 + 1) % vocab]])
    parents = torch.tensor([[-1, -1, 0, 1, 3]])
    paths = [[], [0], [1], [0, 2], [1, 3], [1, 3, 4]]
    kv_start = req.kv_len
    step = driver.verify([req], drafts, parents)
    node_logits = step.logits.float().cpu().clone()
    expected = torch.stack([hf_logits(hf_model, sequence + drafts[0, path].tolist(), 1)[0] for path in paths])
    worker.launch_sampling(step)
    host = step.results.wait()
    accepted = int(host["accepted"][0])
    driver.allocator.free(torch.tensor(req.truncate_kv(kv_start + accepted + 1), dtype=torch.int64))
    req.output_ids.extend(host["next_ids"][0, :accepted + 1].tolist())
    next_logits = driver.decode(req, None)
    return TreeRun(node_logits, expected, accepted, host["next_ids"][0, :accepted + 1].tolist(), greedy, next_logits,
                   hf_logits(hf_model, sequence + greedy, 1)[0])
