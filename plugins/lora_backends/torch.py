"""The ``torch`` LoRA backend: the reference arithmetic of the ``lora_backends`` contract in plain torch ops.

Shrink is one matmul against every slot's ``A`` at once (``[T, slots * R]``, a few times a projection's rank) and
a gather of each token's own slot; expand is one small matmul per slot with the other slots' rows masked to zero.
A layer's stacked projections (``add_delta``) shrink in one matmul and expand per projection into the output.
Both run the same ops whatever the adapter ids are, with no host-device sync, so CUDA graphs capture them; the
work grows with the number of slots, which is what the ``triton`` backend's kernels avoid.
"""

from __future__ import annotations

import torch

from treadle.core.hookspecs import hookimpl
from treadle.core.lora.backend import LoRABackend, StackedLoRA


class TorchLoRABackend(LoRABackend):
    """Shrink and expand in torch ops (module docstring); any device and dtype."""

    def __init__(self, max_slots: int, max_rank: int, device: torch.device | str, dtype: torch.dtype) -> None:
        self.max_slots, self.max_rank = max_slots, max_rank

    def shrink(self, x: torch.Tensor, a: torch.Tensor, adapter_ids: torch.Tensor, scalings: torch.Tensor,
               ranks: torch.Tensor) -> torch.Tensor:
        slots, rank, in_features = a.shape
        every = (x @ a.reshape(slots * rank, in_features).T).view(-1, slots, rank)
        chosen = adapter_ids.clamp(min=0)
        own = every.gather(1, chosen.view(-1, 1, 1).expand(-1, 1, rank)).squeeze(1)
        # NO_ADAPTER rows (and CUDA-graph padding) get a zero scale: no branch on the ids.
        scale = scalings.index_select(0, chosen) * (adapter_ids >= 0).to(scalings.dtype)
        return (own * scale.unsqueeze(1).to(own.dtype)).to(x.dtype)

    def add_delta(self, x: torch.Tensor, weights: StackedLoRA, adapter_ids: torch.Tensor, out: torch.Tensor) -> None:
        slots, rows, in_features = weights.a.shape
        rank = weights.rank_dim
        every = (x @ weights.a.reshape(slots * rows, in_features).T).view(-1, slots, rows)
        chosen = adapter_ids.clamp(min=0)
        own = every.gather(1, chosen.view(-1, 1, 1).expand(-1, 1, rows)).squeeze(1)
        scale = weights.scalings.index_select(1, chosen).T * (adapter_ids >= 0).to(weights.scalings.dtype)[:, None]
        h = (own * scale.repeat_interleave(rank, dim=1).to(own.dtype)).to(x.dtype)
        for p, (start, end) in enumerate(weights.segments):
            self.expand(h[:, p * rank:(p + 1) * rank], weights.b[:, start:end], adapter_ids, weights.ranks[p],
                        out[:, start:end])

    def expand(self, h: torch.Tensor, b: torch.Tensor, adapter_ids: torch.Tensor, ranks: torch.Tensor,
               out: torch.Tensor) -> None:
        for slot in range(b.shape[0]):
            mine = (adapter_ids == slot).unsqueeze(1).to(h.dtype)
            out += ((h * mine) @ b[slot].T).to(out.dtype)


@hookimpl
def treadle_register_lora_backends(register) -> None:
    register("torch", TorchLoRABackend)
