"""A TARGET_VERIFY step (a speculative decoder's check of k draft tokens per request in one forward) through the
model worker: at each of its k + 1 positions, the logits equal those of feeding the same tokens one decode step at
a time, and HF's on the whole sequence; for k = 1..4, in one batch of a request computed from scratch and one
whose prompt starts on another request's KV (a prefix-cache hit). Its sampling keeps the drafts that match the
target's greedy tokens and feeds the next token on the device.

torch_native runs in this process; triton runs its kernels under the interpreter in a fresh process (this file
as a script, TRITON_INTERPRET=1 set before anything imports triton: see tests/plugins/test_triton_backend.py).
The same check under CUDA graphs is tests/gpu/test_verify_graphs_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest
import torch

from verify_steps import hf_logits, verify_against_decode, verify_tree_against_hf

K_VALUES = (1, 2, 3, 4)
INTERPRETED_K_VALUES = (1, 4)  # the interpreter is slow: the shortest and longest; torch_native checks every k
SHARED = 6  # request 1's prompt starts with request 0's first SHARED tokens, on request 0's KV


def build_worker(model_dir: str, backend: str):
    from treadle.core.config import load_config
    from treadle.core.execution.worker import ModelWorker
    from treadle.core.registry import build_registry

    config = load_config(overrides={"model.path": model_dir, "model.device": "cpu", "model.dtype": "float32",
                                    "attention.backend": backend, "cache.max_total_tokens": 1024}, use_env=False)
    return ModelWorker(config, build_registry())


def prompts(vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    first = torch.randint(3, vocab, (9,), generator=generator).tolist()
    return [first, first[:SHARED] + torch.randint(3, vocab, (7,), generator=generator).tolist()]


def check_verify(worker, hf_model, k: int, atol: float = 1e-4) -> None:
    """Raise AssertionError unless a verify step of k drafts agrees with decode steps, HF and its own argmax."""
    run = verify_against_decode(worker, prompts(worker.info.vocab_size, seed=k), k, SHARED, seed=k)
    assert run.twins_agree
    torch.testing.assert_close(run.verify_logits, run.decode_logits, atol=atol, rtol=atol)
    for i, sequence in enumerate(run.sequences):
        torch.testing.assert_close(run.verify_logits[i], hf_logits(hf_model, sequence, k + 1), atol=atol, rtol=atol)
    greedy = run.verify_logits.argmax(-1)
    assert torch.equal(run.next_ids, greedy)
    kept = (run.drafts == greedy[:, :-1]).to(torch.int64).cumprod(1).sum(1)
    assert torch.equal(run.accepted, kept) and int(kept[1]) >= 1
    assert torch.equal(run.next_input, greedy.gather(1, kept[:, None]).squeeze(1))


def check_tree(worker, hf_model, atol: float = 1e-4) -> None:
    """Raise AssertionError unless a tree verify step's logits at every node are HF's after the node's path, the
    kept path is the right one through a second child, and the decode step after it reads the K/V moved into place."""
    run = verify_tree_against_hf(worker, hf_model, prompts(worker.info.vocab_size, seed=5)[0])
    torch.testing.assert_close(run.node_logits, run.expected_logits, atol=atol, rtol=atol)
    assert run.accepted == 2 and run.next_ids == run.greedy
    torch.testing.assert_close(run.next_logits, run.expected_next, atol=atol, rtol=atol)


def check_tree_kernels() -> None:
    """Raise AssertionError unless the draft tree kernels (kernels/draft_trees.py, what CUDA devices run) give the
    torch layout's parents, ancestors and depth, and torch's kept path, accepted count and path tokens, for chains,
    stars and mixed trees in one batch, over node tokens that match their children's drafts often."""
    from treadle.core.speculative.tree import TreeLayout, kept_path as torch_kept_path
    from treadle.kernels.draft_trees import kept_path, tree_layout

    generator = torch.Generator().manual_seed(0)
    trees = [[-1, 0, 1, 2, 3, 4, 5, 6], [-1, -1, -1, -1, -1, -1, -1, -1], [-1, -1, 1, 1, 3, 3, 5, 5],
             [int(torch.randint(-1, j, (1,), generator=generator)) for j in range(8)]]  # parents before children
    parents = torch.tensor(trees, dtype=torch.int64)
    layout = TreeLayout.by_squaring(parents)
    for got, want in zip(tree_layout(parents), (layout.parents, layout.ancestors, layout.depth)):
        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
    for _ in range(8):
        drafts = torch.randint(0, 2, parents.shape, generator=generator)
        node_tokens = torch.randint(0, 2, (parents.shape[0], parents.shape[1] + 1), generator=generator)
        path, accepted = torch_kept_path(layout, drafts, node_tokens)
        got = kept_path(layout.parents, layout.ancestors, layout.depth, drafts, node_tokens)
        for got_one, want in zip(got, (path, accepted, node_tokens.gather(1, path))):
            assert torch.equal(got_one, want), (got_one, want)


def test_tree_verify_logits_follow_each_nodes_path_with_torch_native(torch_native_worker, hf_model) -> None:
    check_tree(torch_native_worker, hf_model)


def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def torch_native_worker(tiny_llama_dir):
    return build_worker(tiny_llama_dir, "torch_native")


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return _hf(tiny_llama_dir)


@pytest.mark.parametrize("k", K_VALUES)
def test_verify_logits_equal_decode_steps_and_hf_with_torch_native(torch_native_worker, hf_model, k: int) -> None:
    check_verify(torch_native_worker, hf_model, k)


def test_verify_logits_equal_decode_steps_and_hf_with_triton_interpreted(tiny_llama_dir) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, tiny_llama_dir], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.split() == [f"verified-k={k}" for k in INTERPRETED_K_VALUES] + ["verified-tree",
                                                                                              "verified-tree-kernels"]


if __name__ == "__main__":
    model_dir = sys.argv[1]
    worker, hf = build_worker(model_dir, "triton"), _hf(model_dir)
    for k in INTERPRETED_K_VALUES:
        check_verify(worker, hf, k)
        print(f"verified-k={k}", flush=True)
    check_tree(worker, hf)
    print("verified-tree", flush=True)
    check_tree_kernels()
    print("verified-tree-kernels", flush=True)
