"""Qwen2.5-VL on the GPU: the tiny checkpoint gives HF transformers' greedy tokens on the CUDA attention backends
for two images and for a video of three frames (float32; decode through CUDA graphs, which run M-RoPE requests as
shifted 1-D rotary), whole and chunked; its vision encoder gives HF's output on CUDA, without a host sync; and the
vision-language benchmark runs end to end at Qwen2.5-VL-7B's shape on a few requests."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from treadle import Engine, SamplingParams
from treadle.core.multimodal.processor import MultimodalProcessor
from treadle.testing.multimodal import IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_END_ID, VISION_START_ID, \
    hf_vl_greedy, make_tiny_qwen2_5_vl, random_image

pytestmark = pytest.mark.gpu

PLUGINS = ["treadle.plugins.models.qwen2_5_vl"]
IMAGE = [VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID]
PROMPT = [5, 17, 42] + IMAGE + [8, 99, 3, 250] + IMAGE + [11, 7]
VIDEO_PROMPT = [5, 17, VISION_START_ID, VIDEO_TOKEN_ID, VISION_END_ID, 42, 8]


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
def test_matches_hf_on_cuda(tmp_path, backend: str) -> None:
    path = make_tiny_qwen2_5_vl(tmp_path)
    images = [random_image(200, 150, seed=1), random_image(90, 120, seed=2)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    frames = [random_image(100, 80, seed=seed) for seed in (3, 4, 5)]
    video_ids, video = MultimodalProcessor.for_model(path, AutoConfig.from_pretrained(path)).process(
        VIDEO_PROMPT, [], video_data=[frames])
    want_video = hf_vl_greedy(path, video_ids, [], 12, videos=video.items)[0]
    for chunk in (None, 9):
        config = {"model": {"path": path, "dtype": "float32", "device": "cuda"}, "attention": {"backend": backend},
                  "cache": {"max_total_tokens": 4096}, "scheduler": {"chunked_prefill_size": chunk},
                  "plugins": PLUGINS}
        with Engine(config) as engine:
            info = engine.scheduler.worker.info
            ids = MultimodalProcessor.for_model(info.model_dir, info.hf_config).process(PROMPT, images)[0]
            outs = engine.generate(input_ids=[PROMPT, PROMPT[:3], VIDEO_PROMPT], image_data=[images, [], []],
                                   video_data=[[], [], [frames]], sampling_params=params)
        assert outs[0].token_ids == hf_vl_greedy(path, ids, images, 12)[0]
        assert outs[1].token_ids == hf_vl_greedy(path, PROMPT[:3], [], 12)[0]
        assert outs[2].token_ids == want_video


GRIDS = [(1, 16, 12), (2, 8, 10), (1, 6, 6)]  # windows cut by the edges; frames of different lengths


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """HF's Qwen2.5-VL (float32, on the host) and treadle's vision encoder with its weights on CUDA."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from treadle.layers.checkpoint import load_checkpoint
    from treadle.plugins.models.qwen2_5_vl_vision import VisionTransformer

    path = make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_vl"))
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    encoder = VisionTransformer(hf.config.vision_config)
    prefix = "model.visual."
    load_checkpoint(encoder, [(n[len(prefix):], t) for n, t in hf.state_dict().items() if n.startswith(prefix)])
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), 3 * 2 * 14 * 14,
                         generator=torch.Generator().manual_seed(0))
    return hf, encoder.cuda(), pixels


def test_vision_encoder_matches_hf_on_cuda(encoders) -> None:
    hf, encoder, pixels = encoders
    with torch.no_grad():
        want = hf.model.visual(pixels, grid_thw=torch.tensor(GRIDS)).pooler_output
        got = encoder(pixels.cuda(), GRIDS)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-4)


def test_vision_encoder_runs_without_a_host_sync(encoders) -> None:
    _, encoder, pixels = encoders
    on_device = pixels.cuda()
    with torch.no_grad():
        encoder(on_device, GRIDS)  # Triton compiles here
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            encoder(on_device, GRIDS)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_vl_benchmark_runs(tmp_path) -> None:
    from treadle.bench.vl import main

    report = main(["--requests", "16", "--group", "8", "--output-tokens", "8", "--encoder-runs", "3",
                   "--output", str(tmp_path / "vl.json")])
    assert report["with_image"]["requests_per_s"] > 0 and report["encoder_s_per_image"] > 0
    assert report["image_tokens"] > 900  # a 1024x768 image: about a thousand language-model tokens
