"""The ``poolings`` plugin kind: how an embedding model turns a prompt's final hidden states into one vector.

A pooling sees one step at a time. A prompt cut into chunks (chunked prefill) is pooled chunk by chunk:
:meth:`Pooling.reduce` gives each request's part of this step on the device, :meth:`Pooling.combine` joins it to
the parts of the request's earlier chunks on the host, and :meth:`Pooling.finish` turns the whole into the
vector once the prompt's last chunk is done. Positions before :meth:`Pooling.first_needed_position` may come
from the radix cache (their hidden states are never computed).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PoolingChunk:
    """Where each request's rows lie in one step's hidden states ``[tokens, hidden]`` (rows in request order).

    ``starts``/``lens``/``owner`` are on the device; ``first_positions`` (the sequence position of each request's
    first row) and ``prompt_lens`` are host lists.
    """

    starts: torch.Tensor  # [bs] int64: each request's first row
    lens: torch.Tensor  # [bs] int64: its rows in this step
    owner: torch.Tensor  # [tokens] int64: the request of each row
    first_positions: list[int]
    prompt_lens: list[int]

    @property
    def last_rows(self) -> torch.Tensor:
        return self.starts + self.lens - 1


class Pooling(ABC):
    """One way to pool; registered by name (``treadle_register_poolings``), built as ``factory()``."""

    def first_needed_position(self, prompt_len: int) -> int:
        """The first position whose hidden state this pooling reads (the radix cache may serve the ones before;
        at least the last position is always computed). Default 0: every position."""
        return 0

    @abstractmethod
    def reduce(self, hidden: torch.Tensor, chunk: PoolingChunk) -> torch.Tensor:
        """This step's part for every request, ``[bs, hidden]`` float32 on the device."""

    @abstractmethod
    def combine(self, earlier: torch.Tensor, part: torch.Tensor, first_position: int) -> torch.Tensor:
        """A request's parts so far (``earlier``) joined with the part of its chunk starting at ``first_position``
        (host float32 vectors)."""

    def finish(self, pooled: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """The vector of a prompt of ``prompt_len`` tokens from its combined parts (default: as it is)."""
        return pooled


class LastTokenPooling(Pooling):
    """The last token's hidden state (Qwen3-Embedding, gte-Qwen2, e5-mistral): any cached prefix is usable."""

    def first_needed_position(self, prompt_len: int) -> int:
        return prompt_len - 1

    def reduce(self, hidden: torch.Tensor, chunk: PoolingChunk) -> torch.Tensor:
        return hidden.index_select(0, chunk.last_rows).float()

    def combine(self, earlier: torch.Tensor, part: torch.Tensor, first_position: int) -> torch.Tensor:
        return part


class MeanPooling(Pooling):
    """The mean of every token's hidden state: chunks add up their sums, ``finish`` divides."""

    def reduce(self, hidden: torch.Tensor, chunk: PoolingChunk) -> torch.Tensor:
        sums = torch.zeros(int(chunk.starts.shape[0]), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        return sums.index_add_(0, chunk.owner, hidden.float())

    def combine(self, earlier: torch.Tensor, part: torch.Tensor, first_position: int) -> torch.Tensor:
        return earlier + part

    def finish(self, pooled: torch.Tensor, prompt_len: int) -> torch.Tensor:
        return pooled / prompt_len


class ClsPooling(Pooling):
    """The first token's hidden state (BERT-style [CLS])."""

    def reduce(self, hidden: torch.Tensor, chunk: PoolingChunk) -> torch.Tensor:
        return hidden.index_select(0, chunk.starts).float()

    def combine(self, earlier: torch.Tensor, part: torch.Tensor, first_position: int) -> torch.Tensor:
        return earlier  # the first chunk's first row is position 0


BUILTIN_POOLINGS: dict[str, type[Pooling]] = {"last": LastTokenPooling, "mean": MeanPooling, "cls": ClsPooling}
