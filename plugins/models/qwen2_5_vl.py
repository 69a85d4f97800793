"""Qwen2.5-VL, registered as ``Qwen2_5_VLForConditionalGeneration``: a Qwen2 language model with multimodal rotary
positions (M-RoPE) and the vision encoder of :mod:`qwen2_5_vl_vision`, for images and video frames.

A step with images (``forward_batch.multimodal``, core/multimodal/inputs.py) embeds its text tokens, runs the vision
encoder over the images whose tokens it holds (all of them in one call) and writes their rows, and rotates with each
token's three positions (temporal, height, width: the ``mrope_section`` parts of the rotary dimensions). Every other
step is the Qwen2 forward, decode CUDA graphs included: past the prompt a request's three positions are equal, which
is the ordinary rotary embedding at the position the scheduler shifts by ``mrope_delta``.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn

from treadle.core.execution.forward_batch import ForwardBatch
from treadle.core.execution.overlap import to_device
from treadle.core.hookspecs import Register, hookimpl
from treadle.core.multimodal.inputs import MultimodalBatch, MultimodalItem
from treadle.layers.decoder import DecoderLayer, layer_sliding_window
from treadle.layers.rotary import rope_parameters
from treadle.plugins.models.llama import LlamaForCausalLM
from treadle.plugins.models.qwen2_5_vl_vision import VisionTransformer

# transformers 5 saves the language model under model.language_model and the encoder under model.visual; the
# published checkpoints have model.* and visual.*.
_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """Qwen2.5-VL: text, images and video frames in, tokens out."""

    def __init__(self, config: Any, quant_config: Any = None) -> None:
        super().__init__(config, quant_config)
        vision = config.vision_config
        self.visual = VisionTransformer(vision)
        self.spatial_merge = int(vision.spatial_merge_size)
        self.tokens_per_second = float(getattr(vision, "tokens_per_second", 2))
        section = list(rope_parameters(config).get("mrope_section") or ())
        if sum(section) * 2 != self.model.rotary_emb.head_dim:
            raise ValueError(f"rope mrope_section {section} must split half the head dim "
                             f"({self.model.rotary_emb.head_dim // 2}) in three")
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        self._rotary_axis = torch.cat([axis, axis])  # which position (t, h or w) each rotary dimension reads

    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        return DecoderLayer(config, layer_id, layer_sliding_window(config, layer_id), quant_config=self.quant_config,
                            qkv_bias=True, o_bias=False)

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        multimodal: MultimodalBatch | None = forward_batch.multimodal
        if multimodal is None:
            return self.model(input_ids, positions, forward_batch)
        model = self.model
        # Image rows hold pseudo ids past the vocabulary (the radix cache's key); their embeddings are replaced.
        hidden = model.embed_tokens(input_ids.clamp(max=self.config.vocab_size - 1))
        if multimodal.image_rows:
            hidden = self._write_vision_rows(hidden, multimodal)
        cos, sin = self._mrope_cos_sin(multimodal.mrope_positions, hidden.dtype)
        return model.run_layers(hidden, cos, sin, forward_batch)

    def _write_vision_rows(self, hidden: torch.Tensor, multimodal: MultimodalBatch) -> torch.Tensor:
        """The encoder's output for every image with rows in this step, one encoder call for all of them (an image
        a chunked prefill cuts keeps its output until its last rows are written)."""
        fresh: dict[int, MultimodalItem] = {}
        for rows in multimodal.image_rows:
            if rows.item.encoder_output is None:
                fresh.setdefault(id(rows.item), rows.item)
        if fresh:
            # Each image through pinned memory, then joined on the device: no pageable copy for the step to wait on.
            pixels = torch.cat([to_device(item.pixel_values, hidden.device) for item in fresh.values()])
            encoded = self.visual(pixels, [item.grid_thw for item in fresh.values()])
            for item, output in zip(fresh.values(), encoded.split([item.num_tokens for item in fresh.values()])):
                item.encoder_output = output
        for rows in multimodal.image_rows:
            item = rows.item
            hidden[rows.first_row:rows.first_row + rows.end - rows.start] = \
                item.encoder_output[rows.start:rows.end].to(hidden.dtype)
            if rows.end == item.num_tokens:
                item.encoder_output = None  # its last rows: no later chunk needs it
        return hidden

    def _mrope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[tokens, 1, head_dim]`` of three positions per token (``[3, tokens]``), float32 angles."""
        rotary = self.model.rotary_emb
        if self._rotary_axis.device != positions.device:  # once: a host tensor's copy would stall every such step
            self._rotary_axis = self._rotary_axis.to(positions.device)
            rotary.inv_freq_per_dim = rotary.inv_freq_per_dim.to(positions.device)
        inv_freq, axis = rotary.inv_freq_per_dim, self._rotary_axis
        # Row-major [tokens, head_dim] (a transposed product would be column-major, which the fused rotary kernel
        # on CUDA read as rows: every prefill with images rotated by the wrong angles).
        angles = (positions.t().index_select(1, axis) * inv_freq)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def multimodal_positions(self, prompt_len: int, items: Sequence[MultimodalItem]) -> tuple[torch.Tensor, int]:
        """M-RoPE positions ``[3, prompt_len]`` of a prompt with images and videos, and the delta of the positions
        past it: text advances all three by one a token; an image's tokens take ``(start, start + row,
        start + column)`` in merged patches (a video's first position steps ``tokens_per_second * seconds`` a
        frame pair), and the text after it starts at ``start + max(rows, columns)``."""
        parts: list[torch.Tensor] = []
        cursor = start = 0
        for item in sorted(items, key=lambda i: i.offset):
            text = item.offset - cursor
            parts.append(torch.arange(text).expand(3, -1) + start)
            start += text
            t, h, w = item.grid_thw[0], item.grid_thw[1] // self.spatial_merge, item.grid_thw[2] // self.spatial_merge
            step = self.tokens_per_second * item.seconds_per_grid if item.kind == "video" else 1.0
            times = (torch.arange(t) * step).long()
            grid_t, grid_h, grid_w = torch.meshgrid(times, torch.arange(h), torch.arange(w), indexing="ij")
            parts.append(torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + start)
            start += max(h, w)
            cursor = item.offset + item.num_tokens
        parts.append(torch.arange(prompt_len - cursor).expand(3, -1) + start)
        positions = torch.cat(parts, dim=1).to(torch.int64)
        return positions, int(positions.max()) + 1 - prompt_len

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights))


def _renamed(weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    for name, tensor in weights:
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, tensor


@hookimpl
def treadle_register_models(register: Register) -> None:
    register("Qwen2_5_VLForConditionalGeneration", Qwen2_5_VLForConditionalGeneration)
