"""One prefill's logits from a loaded model without a KV pool (causal SDPA over the one sequence), for tests that
compare a model's weights with a reference run."""

from __future__ import annotations

import torch

from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode


class CausalAttentionWithoutCache:
    """Prefill-only attention: causal SDPA over the one sequence, nothing stored."""

    def applies_rotary(self, forward_batch) -> bool:
        return False

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        n = q.shape[0]
        q = q.view(n, layer.num_heads, layer.head_dim).transpose(0, 1)
        k = k.view(n, layer.num_kv_heads, layer.head_dim).transpose(0, 1)
        v = v.view(n, layer.num_kv_heads, layer.head_dim).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scaling,
                                                               enable_gqa=True)
        return out.transpose(0, 1).reshape(n, -1)


def prefill_logits(model, tokens: list[int]) -> torch.Tensor:
    """The logits of every position of ``tokens`` in one prefill step."""
    n = len(tokens)
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.tensor(tokens),
        positions=torch.arange(n), req_pool_indices=torch.zeros(1, dtype=torch.int64),
        seq_lens=torch.tensor([n]), seq_lens_cpu=torch.tensor([n]), out_cache_loc=torch.arange(n),
        seq_lens_sum=n, logits_indices=torch.arange(n), req_to_token_pool=None, kv_cache=None,
        attn_backend=CausalAttentionWithoutCache(),
    )
    with torch.inference_mode():
        return model(batch.input_ids, batch.positions, batch)
