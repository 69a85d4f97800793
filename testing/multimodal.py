"""A tiny random Qwen2.5-VL checkpoint (with its image processor) and HF transformers' greedy output for it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

from treadle.testing.models import TINY_LLAMA_CONFIG

IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 500, 501, 502, 503
PATCH = 14


def make_tiny_qwen2_5_vl(path: str | os.PathLike, seed: int = 0, **vision_overrides: Any) -> str:
    """Save a tiny random ``Qwen2_5_VLForConditionalGeneration`` (2 text layers of width 64; a 4-block vision
    encoder of width 32 with 56-pixel windows, blocks 1 and 3 full attention) and a Qwen2-VL image processor
    (images scaled to 3136..50176 pixels) to ``path``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    text = {**TINY_LLAMA_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                       "mrope_section": [4, 2, 2]}}
    text.pop("rope_theta", None)
    vision = {"depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "fullatt_block_indexes": [1, 3], "window_size": 56, "patch_size": PATCH, "spatial_merge_size": 2,
              "temporal_patch_size": 2, "tokens_per_second": 2, **vision_overrides}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID,
                              video_token_id=VIDEO_TOKEN_ID, vision_start_token_id=VISION_START_ID,
                              vision_end_token_id=VISION_END_ID, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                param.normal_(0.0, 0.08, generator=generator)
            elif name.endswith("bias") or name.endswith("norm.weight") or name.endswith("ln_q.weight"):
                param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1, generator=generator)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # A size dict of its own: some transformers releases write min_pixels/max_pixels into the class's shared default.
    Qwen2VLImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 224 * 224}, patch_size=PATCH, merge_size=2,
                          temporal_patch_size=2).save_pretrained(out)
    return str(out)


def random_image(width: int, height: int, seed: int = 0) -> Any:
    """A PIL image of random colours."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def animated_gif(frames: Sequence[Any], duration_ms: int = 500) -> bytes:
    """``frames`` (PIL images) as the bytes of an animated GIF showing each for ``duration_ms``."""
    import io

    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=list(frames[1:]), duration=duration_ms, loop=0)
    return buffer.getvalue()


def hf_vl_greedy(model_dir: str, input_ids: list[int], images: list[Any], max_new_tokens: int,
                 videos: Sequence[Any] = ()) -> tuple[list[int], torch.Tensor]:
    """HF transformers' greedy tokens for a prompt whose image and video tokens are already expanded (as treadle
    expands them), and the logits of its first step. ``videos``: the prompt's video items (``MultimodalItem``s of
    kind ``video``, as treadle's processor makes them)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from treadle.core.multimodal.processor import load_image_processor

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([input_ids])
    kwargs: dict[str, Any] = {"mm_token_type_ids": (ids == IMAGE_TOKEN_ID).int() + 2 * (ids == VIDEO_TOKEN_ID).int()}
    if images:
        processed = load_image_processor(model_dir)(images=images, return_tensors="pt")
        kwargs.update(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"])
    if videos:
        kwargs.update(pixel_values_videos=torch.cat([video.pixel_values for video in videos]),
                      video_grid_thw=torch.tensor([video.grid_thw for video in videos]),
                      second_per_grid_ts=torch.tensor([video.seconds_per_grid for video in videos]))
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kwargs)
    return out.sequences[0, len(input_ids):].tolist(), out.logits[0][0]
