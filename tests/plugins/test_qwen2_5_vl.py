"""Qwen2.5-VL against HF transformers on a tiny random checkpoint: greedy tokens identical and first-step log-probs
close, for one image, two images with text around them, a short video, with chunked prefill cutting through an
image, and a repeated image served from the radix cache."""

from __future__ import annotations

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.multimodal.inputs import MultimodalInputs, MultimodalItem
from treadle.core.request import InvalidRequestError, Req
from treadle.testing.engine import assert_kv_accounted
from treadle.testing.multimodal import (
    IMAGE_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_END_ID,
    VISION_START_ID,
    hf_vl_greedy,
    make_tiny_qwen2_5_vl,
    random_image,
)

PLUGINS = ["treadle.plugins.models.qwen2_5_vl"]  # until the package is reinstalled with this branch's entry points
NEW_TOKENS = 8
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
IMAGE = [VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="module")
def images():
    return [random_image(200, 150, seed=1), random_image(90, 120, seed=2)]


def make_engine(model_dir: str, **sections) -> Engine:
    config = {"model": {"path": model_dir}, "cache": {"max_total_tokens": 4096}, "plugins": PLUGINS}
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return Engine(config)


def expanded(engine: Engine, prompt: list[int], images: list) -> list[int]:
    from treadle.core.multimodal.processor import MultimodalProcessor

    info = engine.scheduler.worker.info
    return MultimodalProcessor.for_model(info.model_dir, info.hf_config).process(prompt, images)[0]


def check_against_hf(engine: Engine, model_dir: str, prompt: list[int], images: list) -> None:
    out = engine.generate(input_ids=prompt, image_data=images, sampling_params=GREEDY, return_logprob=True,
                          top_logprobs_num=5)
    tokens, logits = hf_vl_greedy(model_dir, expanded(engine, prompt, images), images, NEW_TOKENS)
    assert out.token_ids == tokens
    top = torch.log_softmax(logits.float(), dim=-1).topk(5)
    got = dict(out.output_top_logprobs[0])
    assert set(got) == set(top.indices.tolist())
    for token, value in zip(top.indices.tolist(), top.values.tolist()):
        assert got[token] == pytest.approx(value, abs=1e-4)


PROMPTS = {
    "one-image": ([5, 17] + IMAGE + [42, 8, 99], 1),
    "two-images-text-around": ([5, 17, 42] + IMAGE + [8, 99, 3, 250] + IMAGE + [11, 7, 64, 31], 2),
    "image-first": (IMAGE + [300, 301, 9], 1),
}


@pytest.mark.parametrize("name", list(PROMPTS))
@pytest.mark.parametrize("scheduler", [{}, {"chunked_prefill_size": 7}], ids=["whole", "chunked"])
def test_matches_hf(model_dir, images, name, scheduler):
    prompt, count = PROMPTS[name]
    with make_engine(model_dir, scheduler=scheduler) as engine:
        check_against_hf(engine, model_dir, prompt, images[:count])
        assert_kv_accounted(engine)


def test_text_only_and_image_requests_batched_together(model_dir, images):
    text = [5, 17, 42, 8, 99, 3]
    with make_engine(model_dir) as engine:
        outs = engine.generate(input_ids=[text, PROMPTS["one-image"][0], PROMPTS["one-image"][0]],
                               image_data=[[], images[:1], images[:1]], sampling_params=GREEDY)  # prepared in threads
    assert outs[0].token_ids == hf_vl_greedy(model_dir, text, [], NEW_TOKENS)[0]
    assert outs[2].token_ids == outs[1].token_ids
    assert outs[1].token_ids == hf_vl_greedy(model_dir, expanded_ids(model_dir, PROMPTS["one-image"][0],
                                                                     images[:1]), images[:1], NEW_TOKENS)[0]


def expanded_ids(model_dir: str, prompt: list[int], images: list) -> list[int]:
    from transformers import AutoConfig

    from treadle.core.multimodal.processor import MultimodalProcessor

    return MultimodalProcessor.for_model(model_dir, AutoConfig.from_pretrained(model_dir)).process(prompt, images)[0]


def test_repeated_image_hits_the_cache(model_dir, images):
    prompt = [5, 17] + IMAGE + [42, 8, 99]
    with make_engine(model_dir) as engine:
        first = engine.generate(input_ids=prompt, image_data=images[:1], sampling_params=GREEDY)
        again = engine.generate(input_ids=prompt, image_data=images[:1], sampling_params=GREEDY)
        other = engine.generate(input_ids=prompt, image_data=images[1:], sampling_params=GREEDY)
        assert again.token_ids == first.token_ids
        assert again.cached_tokens == again.prompt_tokens - 1  # everything but the last token, image included
        assert other.cached_tokens <= 3  # a different image shares only the text before it
        assert_kv_accounted(engine)


def test_video_matches_hf(model_dir):
    """A video as the scheduler takes it (two temporal patches of random pixels; temporal positions step by
    tokens_per_second * seconds_per_grid = 3) and a video of three frames through Engine.generate(video_data=...)
    (frames paired, the last repeated; 2 frames per second) give HF transformers' greedy tokens."""
    generator = torch.Generator().manual_seed(3)
    pixels = torch.randn(2 * 4 * 4, 3 * 2 * 14 * 14, generator=generator)
    prompt = [5, 17, VISION_START_ID] + [VIDEO_TOKEN_ID] * 8 + [VISION_END_ID, 42, 8]
    item = MultimodalItem("video", pixels, (2, 4, 4), offset=3, num_tokens=8, seconds_per_grid=1.5)
    want = hf_vl_greedy(model_dir, prompt, [], NEW_TOKENS, videos=[item])[0]
    frames = [random_image(100, 80, seed=s) for s in range(3)]
    video_prompt = [5, 17, VISION_START_ID, VIDEO_TOKEN_ID, VISION_END_ID, 42, 8]
    with make_engine(model_dir, scheduler={"chunked_prefill_size": 6}) as engine:
        req = Req(rid="video", origin_input_ids=prompt, sampling_params=GREEDY, multimodal=MultimodalInputs([item]))
        scheduler = engine.scheduler
        scheduler.add_request(req)
        while not req.finished:
            scheduler.step()
        assert req.output_ids == want
        out = engine.generate(input_ids=video_prompt, video_data=[frames], sampling_params=GREEDY)
        ids, inputs = processor_of(engine).process(video_prompt, [], video_data=[frames])
        assert inputs.items[0].grid_thw[0] == 2 and inputs.items[0].seconds_per_grid == 1.0
        assert out.token_ids == hf_vl_greedy(model_dir, ids, [], NEW_TOKENS, videos=inputs.items)[0]
        assert_kv_accounted(engine)


def processor_of(engine: Engine, **limits):
    from treadle.core.multimodal.processor import ImageLimits, MultimodalProcessor

    info = engine.scheduler.worker.info if isinstance(engine, Engine) else engine
    return MultimodalProcessor(info.model_dir, info.hf_config, ImageLimits(**limits))


def test_video_frames_pair_up_like_the_encoder_expects(model_dir):
    """Two equal frames make exactly the patches of that frame as an image (an image is a frame shown twice); an
    animated GIF is cut into its frames at the rate its durations give; the limits and a corrupt video are 400s."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from treadle.core.multimodal.video import VideoFrames
    from treadle.testing.multimodal import animated_gif

    processor = processor_of(SimpleNamespace(model_dir=model_dir, hf_config=AutoConfig.from_pretrained(model_dir)),
                             max_videos_per_request=1, max_video_frames=4, max_video_pixels=3 * 100 * 80)
    frame, other = (random_image(100, 80, seed=seed).quantize(64).convert("RGB") for seed in (1, 2))  # GIF-exact
    video = [5, VISION_START_ID, VIDEO_TOKEN_ID, VISION_END_ID]
    _, as_video = processor.process(video, [], video_data=[[frame, frame]])
    _, as_image = processor.process(IMAGE, [frame])
    assert torch.equal(as_video.items[0].pixel_values, as_image.items[0].pixel_values)
    assert as_video.items[0].grid_thw == as_image.items[0].grid_thw
    _, from_gif = processor.process(video, [], video_data=[animated_gif([frame, other], duration_ms=250)])
    _, from_list = processor.process(video, [], video_data=[VideoFrames([frame, other], fps=4.0)])
    assert torch.equal(from_gif.items[0].pixel_values, from_list.items[0].pixel_values)
    second = processor.process(IMAGE, [other])[1].items[0].pixel_values.view(-1, 3, 2, 14, 14)[:, :, 0]
    assert torch.equal(from_list.items[0].pixel_values.view(-1, 3, 2, 14, 14)[:, :, 1], second)  # (c, t, h, w)
    assert from_gif.items[0].seconds_per_grid == 0.5 and from_gif.items[0].content_hash == \
        from_list.items[0].content_hash
    for data, message, code in [([[frame] * 5], "max_video_frames = 4", "video_too_large"),
                                ([[frame] * 4], "max_video_pixels = 24000", "video_too_large"),
                                ([[frame], [frame]], "max_videos_per_request = 1", "too_many_videos"),
                                ([b"GIF89a broken"], "not a video this server can decode", "invalid_video"),
                                ([[frame, random_image(90, 80)]], "frames of a video must be of one size",
                                 "invalid_video")]:
        with pytest.raises(InvalidRequestError, match=message) as info:
            processor.process(video * len(data), [], video_data=data)
        assert info.value.code == code


def test_bad_images_are_refused(model_dir, images):
    from treadle.core.multimodal.processor import ImageLimits, MultimodalProcessor

    with make_engine(model_dir) as engine:
        with pytest.raises(InvalidRequestError, match="not a readable image") as info:
            engine.generate(input_ids=PROMPTS["one-image"][0], image_data=[b"\x89PNG not really"])
        assert info.value.code == "invalid_image"
        with pytest.raises(InvalidRequestError, match="marks 1 images .* but 2 were given"):
            engine.generate(input_ids=PROMPTS["one-image"][0], image_data=images)
        with pytest.raises(InvalidRequestError, match="prompt log-probs are not available"):
            engine.generate(input_ids=PROMPTS["one-image"][0], image_data=images[:1], return_logprob=True,
                            logprob_start_len=0)
        info_ = engine.scheduler.worker.info
        strict = MultimodalProcessor(info_.model_dir, info_.hf_config, ImageLimits(max_images_per_request=1,
                                                                                    max_image_pixels=100 * 100))
        with pytest.raises(InvalidRequestError, match="max_images_per_request = 1"):
            strict.process(PROMPTS["two-images-text-around"][0], images)
        with pytest.raises(InvalidRequestError, match="max_image_pixels = 10000"):
            strict.process(PROMPTS["one-image"][0], images[:1])
        assert_kv_accounted(engine)


@pytest.mark.slow
def test_triton_backend_matches_torch_native(model_dir):
    """The triton backend (under the Triton interpreter, in a subprocess) gives torch_native's tokens for a prompt
    whose image chunked prefill cuts."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    script = Path(__file__).with_name("vl_triton_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(script), model_dir, "5"], capture_output=True, text=True, env=env,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS=")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    prompt = [5, 17] + IMAGE + [42, 8]
    with make_engine(model_dir, scheduler={"chunked_prefill_size": 5}) as engine:
        want = engine.generate(input_ids=prompt, image_data=[random_image(100, 80, seed=1)],
                               sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
                               return_logprob=True, top_logprobs_num=5)
    assert json.loads(lines[-1][len("TOKENS="):]) == want.token_ids
    top = [line for line in proc.stdout.splitlines() if line.startswith("TOP=")]
    got = dict(json.loads(top[-1][len("TOP="):]))
    assert set(got) == {token for token, _ in want.output_top_logprobs[0]}
    for token, value in want.output_top_logprobs[0]:
        assert got[token] == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("build", ["under-device", "moved"])
def test_vision_encoder_keeps_to_the_input_device(build):
    """The encoder makes its index and rotary tensors on the device of its input and weights, whether it was built
    under ``torch.device`` (as the loader builds it) or moved after: on the meta device a tensor left on the host
    fails as it does on CUDA ("Expected all tensors to be on the same device")."""
    from types import SimpleNamespace

    from treadle.plugins.models.qwen2_5_vl_vision import VisionTransformer

    config = SimpleNamespace(spatial_merge_size=2, patch_size=14, window_size=56, fullatt_block_indexes=[1],
                             hidden_size=32, in_channels=3, num_heads=2, depth=2, intermediate_size=64,
                             out_hidden_size=64, temporal_patch_size=2)
    if build == "under-device":
        with torch.device("meta"):
            encoder = VisionTransformer(config)
    else:
        encoder = VisionTransformer(config).to("meta")
    merged = encoder(torch.empty(2 * 8 * 8 + 4 * 4, 3 * 2 * 14 * 14, device="meta"), [(2, 8, 8), (1, 4, 4)])
    assert merged.device.type == "meta" and merged.shape == (36, 64)


@pytest.fixture(scope="module")
def loaded_model(model_dir):
    with make_engine(model_dir) as engine:
        yield engine.scheduler.worker.runner.model


def test_vision_encoder_matches_hf(model_dir, loaded_model):
    """Images and a video of several sizes in one call (windows cut by the right and bottom edges, frames of
    different lengths: the layout's gathered paths) give HF's encoder output."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    grids = [(1, 16, 12), (2, 8, 10), (1, 6, 6)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * 14 * 14,
                         generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf.model.visual(pixels, grid_thw=torch.tensor(grids)).pooler_output
        got = loaded_model.visual(pixels, grids)
    assert got.shape == want.shape == (48 + 40 + 9, 64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_mrope_tables_are_the_rotary_tables_of_equal_positions(loaded_model):
    """M-RoPE with three equal positions is the ordinary rotary embedding, values and row-major layout alike (the
    fused rotary kernel on CUDA reads each token's angles as one contiguous row: column-major tables from a
    transposed product rotated every prefill with images by the wrong angles there)."""
    model = loaded_model
    positions = torch.tensor([0, 3, 4, 9, 17])
    cos, sin = model._mrope_cos_sin(positions.expand(3, -1), torch.float32)
    want_cos, want_sin = model.model.rotary_emb.cos_sin(positions, torch.float32)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert cos.stride() == want_cos.stride() and sin.stride() == want_sin.stride()
