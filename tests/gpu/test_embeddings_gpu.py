"""Embeddings on the GPU: every CUDA attention backend pools the same vectors as HF transformers (float32 and
bfloat16), whole and chunked; and the embedding benchmark runs end to end on a small passage set."""

from __future__ import annotations

import pytest
import torch

from treadle import Engine
from treadle.testing.embedding import hf_embeddings, make_tiny_embedding_model

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2, 150, 77, 45, 18, 6], [300, 301, 9],
           [5, 17, 42, 8, 99, 3, 250, 11, 200, 12] * 20]


@pytest.mark.parametrize("backend, dtype", [("triton", "float32"), ("triton", "bfloat16"),
                                            ("flashinfer", "bfloat16"), ("flashinfer_triton", "bfloat16")])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_backends_match_hf(tmp_path, backend: str, dtype: str, pooling: str) -> None:
    if backend.startswith("flashinfer"):
        pytest.importorskip("flashinfer")
    path = make_tiny_embedding_model(tmp_path, "qwen3", pooling=pooling, head_dim=64)  # flashinfer's smallest
    want = hf_embeddings(path, PROMPTS, pooling, normalize=True)
    tolerance = dict(atol=2e-5, rtol=1e-4) if dtype == "float32" else dict(atol=3e-2, rtol=3e-2)
    for chunk in (None, 16):
        config = {"model": {"path": path, "dtype": dtype, "device": "cuda"}, "attention": {"backend": backend},
                  "cache": {"max_total_tokens": 4096}, "scheduler": {"chunked_prefill_size": chunk},
                  "plugins": ["treadle.plugins.poolings.builtin"]}
        with Engine(config) as engine:
            got = [torch.tensor(o.embedding) for o in engine.encode(input_ids=PROMPTS)]
        for vector, reference in zip(got, want):
            torch.testing.assert_close(vector, reference, **tolerance)


def test_embed_benchmark_runs(tmp_path) -> None:
    from treadle.bench.embed import main

    report = main(["--passages", "40", "--max-len", "128", "--output", str(tmp_path / "embed.json")])
    assert report["systems"]["treadle"]["embeddings_per_s"] > 0 and report["systems"]["hf"]["embeddings_per_s"] > 0
