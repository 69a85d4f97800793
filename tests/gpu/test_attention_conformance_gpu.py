"""The conformance kit on the GPU backends at real sizes: 32 query heads over 8 KV heads of 128 dims,
requests up to 3000 tokens, a 1024-token sliding window, page sizes 1 and 16, CUDA-graph decode."""

from __future__ import annotations

import pytest
import torch

from treadle.testing import check_attention_backend

pytestmark = pytest.mark.gpu

REAL = dict(num_heads=32, num_kv_heads=8, head_dim=128, max_seq_len=3000, batch_size=6, sliding_window=1024)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_conforms(dtype: torch.dtype) -> None:
    from treadle.plugins.attention.triton.backend import TritonAttnBackend

    check_attention_backend(TritonAttnBackend, "cuda", dtype, **REAL)


def test_flashinfer_conforms() -> None:
    pytest.importorskip("flashinfer")
    from treadle.plugins.attention.flashinfer import FlashInferAttnBackend

    check_attention_backend(FlashInferAttnBackend, "cuda", torch.bfloat16, **REAL)


@pytest.mark.parametrize("small_decode_batch", [64, 3])  # batch_size 6: decode through triton, then flashinfer
def test_flashinfer_triton_conforms(monkeypatch: pytest.MonkeyPatch, small_decode_batch: int) -> None:
    pytest.importorskip("flashinfer")
    from treadle.plugins.attention.hybrid import FlashInferTritonAttnBackend

    monkeypatch.setattr(FlashInferTritonAttnBackend, "small_decode_batch", small_decode_batch)
    check_attention_backend(FlashInferTritonAttnBackend, "cuda", torch.bfloat16, **REAL)


def test_flashinfer_refuses_float32_with_the_alternatives() -> None:
    pytest.importorskip("flashinfer")
    from treadle.plugins.attention.flashinfer import FlashInferAttnBackend

    with pytest.raises(ValueError, match="bfloat16 or float8_e4m3fn KV caches.*triton"):
        check_attention_backend(FlashInferAttnBackend, "cuda", torch.float32, page_sizes=(1,))
