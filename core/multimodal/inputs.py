"""What a multimodal request carries (:class:`MultimodalInputs`) and what one step hands the model
(:class:`MultimodalBatch`).

A request's prompt holds, for each image (or video), a run of placeholder tokens as long as the vision encoder's
output for it. Once queued, each run is replaced in ``Req.origin_input_ids`` by pseudo token ids derived from the
image's content hash (all ``>= vocab_size``): the radix cache then keys those positions by the image, so a repeated
image is a cache hit and two different images never share KV. The model never embeds those ids: their rows get the
vision encoder's output. The model's positions (M-RoPE: temporal, height, width per token) are computed once per
request by the model (``ModelTraits.multimodal_positions``); a decode step's position is its sequence position plus
``mrope_delta`` (M-RoPE with three equal positions is the ordinary rotary embedding).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from treadle.core.execution.overlap import to_device
from treadle.core.validation import InvalidRequestError

if TYPE_CHECKING:
    from treadle.core.request import Req
    from treadle.core.scheduling.schedule_batch import BatchEntry

# Pseudo ids span this many values above the vocabulary (a hash collision between two images is one in 2**30).
PSEUDO_ID_SPAN = 1 << 30


@dataclass(eq=False)
class MultimodalItem:
    """One image (``t == 1``) or video (frames in pairs: ``t`` temporal patches) as the vision encoder takes it.

    ``pixel_values``: ``[t * h * w, channels * temporal_patch * patch * patch]`` flattened patches (the model's
    image processor's output); ``grid_thw``: ``(t, h, w)`` in patches; ``offset``/``num_tokens``: where its
    placeholder run lies in the prompt; ``seconds_per_grid``: a video's seconds per temporal patch.
    """

    kind: str  # "image" or "video"
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    offset: int = 0
    num_tokens: int = 0
    seconds_per_grid: float = 1.0
    content_hash: str = ""
    # The vision encoder's output, kept by the model while a chunked prefill has rows of this item still to come.
    encoder_output: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.content_hash:
            digest = hashlib.sha256(self.pixel_values.detach().cpu().contiguous().numpy().tobytes())
            digest.update(repr((self.kind, self.grid_thw)).encode())
            self.content_hash = digest.hexdigest()

    def pseudo_id(self, vocab_size: int) -> int:
        return vocab_size + int(self.content_hash[:16], 16) % PSEUDO_ID_SPAN


@dataclass(eq=False)
class MultimodalInputs:
    """A request's images and videos, in prompt order, and its model positions (set when it is queued)."""

    items: list[MultimodalItem]
    mrope_positions: torch.Tensor | None = None  # [3, prompt_len] int64, host
    mrope_delta: int = 0  # a position past the prompt: sequence position + delta

    def key_by_content(self, input_ids: list[int], vocab_size: int) -> list[int]:
        """``input_ids`` with each item's placeholder run replaced by its pseudo ids (the radix cache's key)."""
        keyed = list(input_ids)
        for item in self.items:
            keyed[item.offset:item.offset + item.num_tokens] = [item.pseudo_id(vocab_size)] * item.num_tokens
        return keyed


@dataclass
class ImageRows:
    """Rows ``[first, first + end - start)`` of a step take item ``item``'s encoder output ``[start, end)``."""

    item: MultimodalItem
    start: int
    end: int
    first_row: int


@dataclass
class MultimodalBatch:
    """What the model needs beyond token ids in a step with multimodal requests: every row's M-RoPE positions
    (``[3, tokens]`` on the device) and which rows take which encoder outputs."""

    mrope_positions: torch.Tensor
    image_rows: list[ImageRows] = field(default_factory=list)


def has_multimodal(entries: list["BatchEntry"]) -> bool:
    return any(entry.req.multimodal is not None for entry in entries)


def shift_positions(entries: list["BatchEntry"], positions: torch.Tensor, extend_lens: list[int]) -> torch.Tensor:
    """1-D positions with each multimodal request's ``mrope_delta`` added (what its decode rows use)."""
    deltas = torch.tensor([e.req.multimodal.mrope_delta if e.req.multimodal is not None else 0 for e in entries],
                          dtype=torch.int64)
    return positions + torch.repeat_interleave(deltas, torch.tensor(extend_lens))


def build_multimodal_batch(entries: list["BatchEntry"], positions: torch.Tensor, device: torch.device
                           ) -> MultimodalBatch:
    """The step's :class:`MultimodalBatch` (``positions``: the 1-D host positions, deltas already added)."""
    columns: list[torch.Tensor] = []
    image_rows: list[ImageRows] = []
    row = 0
    for entry in entries:
        mm = entry.req.multimodal
        start, end = entry.kv_start, entry.kv_start + entry.extend_len
        prompt_len = len(entry.req.origin_input_ids)
        if mm is None or mm.mrope_positions is None or start >= prompt_len:
            columns.append(positions[row:row + entry.extend_len].expand(3, -1))
        else:
            inside = mm.mrope_positions[:, start:min(end, prompt_len)]
            past = torch.arange(prompt_len, max(end, prompt_len), dtype=torch.int64) + mm.mrope_delta  # a mixed step's decode tokens
            columns.append(torch.cat([inside, past.expand(3, -1)], dim=1))
            for item in mm.items:
                low, high = max(item.offset, start), min(item.offset + item.num_tokens, end)
                if low < high:
                    image_rows.append(ImageRows(item, low - item.offset, high - item.offset, row + low - start))
        row += entry.extend_len
    return MultimodalBatch(to_device(torch.cat(columns, dim=1).contiguous(), device), image_rows)


def check_request(req: "Req", multimodal_positions: Callable[..., tuple[torch.Tensor, int]] | None) -> None:
    """Raise InvalidRequestError when a request with images can never run on this model."""
    if multimodal_positions is None:
        raise InvalidRequestError("this model takes no images or video; send text only", param="image_data")
    if req.return_logprob and req.logprob_start_len >= 0:
        raise InvalidRequestError("prompt log-probs are not available for a prompt with images (its image "
                                  "positions predict no token); leave logprob_start_len at -1", param="logprob_start_len")
    prompt_len = len(req.origin_input_ids)
    for item in req.multimodal.items:
        if item.offset < 0 or item.offset + item.num_tokens > prompt_len:
            raise InvalidRequestError(f"an {item.kind}'s placeholder tokens [{item.offset}, "
                                      f"{item.offset + item.num_tokens}) lie outside the {prompt_len}-token prompt",
                                      param="image_data")


def prepare_request(req: "Req", multimodal_positions: Callable[..., tuple[torch.Tensor, int]],
                    vocab_size: int) -> None:
    """Once, when a checked request with images is queued: its model positions, and its prompt keyed by content."""
    mm: MultimodalInputs = req.multimodal
    if mm.mrope_positions is None:
        mm.mrope_positions, mm.mrope_delta = multimodal_positions(len(req.origin_input_ids), mm.items)
        req.origin_input_ids = mm.key_by_content(req.origin_input_ids, vocab_size)
