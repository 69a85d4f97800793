"""Vision-language throughput: Qwen2.5-VL-7B's shape (dummy weights) with one 1024x768 image per request against the
same requests without the image, in one run; and the vision encoder's time per image.

``python -m treadle.bench.vl`` sends ``--requests`` prompts (a random ``--question-tokens``-token question, then the
image) through ``Engine.generate`` (``--output-tokens`` each, greedy, ignore_eos) in groups of ``--group``
(preprocessed images are ~19 MB of float32 patches each), then the questions alone. It prints requests/s, output
tokens/s, the image processor's time per image (transformers, on the host) and the vision encoder's time per image
on the device (CUDA events over ``--encoder-runs`` calls on one image).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from treadle.bench.results_folder import default_output

QWEN2_5_VL_7B: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "bos_token_id": 151643, "eos_token_id": 151645, "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen2_5_vl_text", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    },
    "vision_config": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
        "fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112, "patch_size": 14, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "tokens_per_second": 2, "in_channels": 3, "hidden_act": "silu",
    },
    "torch_dtype": "bfloat16",
}
TINY_IDS = {"image_token_id": 500, "vision_start_token_id": 502, "vision_end_token_id": 503}
PLUGINS = ["treadle.plugins.models.qwen2_5_vl"]  # loaded once either way; for installs that predate the entry point


def _tiny_model(folder: Path) -> Path:
    from treadle.testing.multimodal import make_tiny_qwen2_5_vl

    return Path(make_tiny_qwen2_5_vl(folder / "tiny"))


def write_model(folder: Path) -> Path:
    from transformers import Qwen2VLImageProcessor

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN2_5_VL_7B))
    # Qwen2.5-VL-7B's limits, in a size dict of its own: the class's default dict may hold another model's limits
    # (some transformers releases write a processor's min_pixels/max_pixels into it).
    Qwen2VLImageProcessor(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384}, patch_size=14,
                          merge_size=2, temporal_patch_size=2).save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--group", type=int, default=100, help="requests per Engine.generate call")
    parser.add_argument("--question-tokens", type=int, default=24)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--images", type=int, default=16, help="distinct random images, cycled")
    parser.add_argument("--encoder-runs", type=int, default=20)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny random model (a CPU smoke run)")
    args = parser.parse_args(argv)

    from treadle import Engine, SamplingParams
    from treadle.testing.multimodal import random_image

    config = TINY_IDS if args.tiny else QWEN2_5_VL_7B
    rng = random.Random(0)
    vocab = 500 if args.tiny else 150000
    questions = [[rng.randrange(10, vocab) for _ in range(args.question_tokens)] for _ in range(args.requests)]
    marker = [config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"]]
    images = [random_image(args.width, args.height, seed=i) for i in range(args.images)]
    params = SamplingParams(max_new_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    report: dict[str, Any] = {"benchmark": "vl", "shape": "qwen2.5-vl-7b", "requests": args.requests,
                              "image": f"{args.width}x{args.height}", "output_tokens": args.output_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        folder = _tiny_model(Path(tmp)) if args.tiny else write_model(Path(tmp) / "qwen2.5-vl-7b")
        engine = Engine({"model": {"path": str(folder), "load_format": "dummy"}, "plugins": PLUGINS})
        try:
            engine.generate(input_ids=questions[:4], sampling_params=params)  # warm-up
            report["image_processor_s_per_image"] = _preprocess_time(engine, questions[0] + marker, images[:4])
            report["encoder_s_per_image"], report["image_tokens"] = _encoder_time(engine, images[0], config, args)
            report["with_image"] = _run(engine, [q + marker for q in questions], images, params, args.group)
            report["text_only"] = _run(engine, questions, None, params, args.group)
        finally:
            engine.shutdown()
    report["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    _print(report)
    output = args.output or default_output(f"vl_{report['device'].replace(' ', '-').lower()}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    print(f"wrote {output}")
    return report


def _run(engine: Any, prompts: list[list[int]], images: list | None, params: Any, group: int) -> dict[str, float]:
    _synchronize()
    start = time.perf_counter()
    outputs = 0
    for first in range(0, len(prompts), group):
        batch = prompts[first:first + group]
        data = [[images[(first + i) % len(images)]] for i in range(len(batch))] if images else None
        outputs += sum(len(o.token_ids) for o in engine.generate(input_ids=batch, image_data=data,
                                                                 sampling_params=params))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "requests_per_s": len(prompts) / seconds, "output_tokens_per_s": outputs / seconds}


def _preprocess_time(engine: Any, prompt: list[int], images: list) -> float:
    from treadle.core.multimodal.processor import MultimodalProcessor

    info = engine.scheduler.worker.info
    processor = MultimodalProcessor.for_model(info.model_dir, info.hf_config)
    processor.process(prompt, images[:1])
    start = time.perf_counter()
    for image in images:
        processor.process(prompt, [image])
    return (time.perf_counter() - start) / len(images)


def _encoder_time(engine: Any, image: Any, config: dict[str, Any], args: argparse.Namespace) -> tuple[float, int]:
    from treadle.core.multimodal.processor import MultimodalProcessor

    info = engine.scheduler.worker.info
    _, inputs = MultimodalProcessor.for_model(info.model_dir, info.hf_config).process(
        [config["image_token_id"]], [image])
    item = inputs.items[0]
    model = engine.scheduler.worker.runner.model
    pixels = item.pixel_values.to(info.device)
    with torch.inference_mode():
        model.visual(pixels, [item.grid_thw])
        _synchronize()
        start = time.perf_counter()
        for _ in range(args.encoder_runs):
            model.visual(pixels, [item.grid_thw])
        _synchronize()
    return (time.perf_counter() - start) / args.encoder_runs, item.num_tokens


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _print(report: dict[str, Any]) -> None:
    print(f"{'requests':<12} {'seconds':>9} {'requests/s':>11} {'out tok/s':>10}")
    for name in ("with_image", "text_only"):
        r = report[name]
        print(f"{name:<12} {r['seconds']:>9.2f} {r['requests_per_s']:>11.2f} {r['output_tokens_per_s']:>10.0f}")
    print(f"vision encoder: {report['encoder_s_per_image'] * 1000:.1f} ms per image ({report['image_tokens']} tokens); "
          f"image processor: {report['image_processor_s_per_image'] * 1000:.1f} ms per image (host)")


if __name__ == "__main__":
    main()
