"""Run by test_qwen2_5_vl.py under TRITON_INTERPRET=1: the tiny Qwen2.5-VL on the triton backend (CPU interpreter),
one image, chunked through it; prints the greedy tokens as JSON."""

import json
import sys

from treadle import Engine, SamplingParams
from treadle.testing.multimodal import IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID, random_image

model_dir, chunk = sys.argv[1], int(sys.argv[2])
config = {"model": {"path": model_dir}, "attention": {"backend": "triton"}, "cache": {"max_total_tokens": 1024},
          "scheduler": {"chunked_prefill_size": chunk}, "plugins": ["treadle.plugins.models.qwen2_5_vl"]}
prompt = [5, 17, VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID, 42, 8]
with Engine(config) as engine:
    out = engine.generate(input_ids=prompt, image_data=[random_image(100, 80, seed=1)],
                          sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
print("TOKENS=" + json.dumps(out.token_ids))
