"""Run by test_qwen2_5_vl.py under TRITON_INTERPRET=1: the tiny Qwen2.5-VL on the triton backend (CPU interpreter),
one image, chunked through it; prints the greedy tokens as JSON. The fused layer kernels (RMSNorm, rotary, silu_mul)
run interpreted too, as they run on CUDA: the model's path on a GPU, which the reference ops on the CPU skip (the
fused rotary read M-RoPE's column-major tables as rows, and only CUDA showed it)."""

import json
import sys

import treadle.kernels.fused_ops as fused_ops

fused_ops._use_triton = lambda x: True

from treadle import Engine, SamplingParams
from treadle.testing.multimodal import IMAGE_TOKEN_ID, VISION_END_ID, VISION_START_ID, random_image

model_dir, chunk = sys.argv[1], int(sys.argv[2])
config = {"model": {"path": model_dir}, "attention": {"backend": "triton"}, "cache": {"max_total_tokens": 1024},
          "scheduler": {"chunked_prefill_size": chunk}, "plugins": ["treadle.plugins.models.qwen2_5_vl"]}
prompt = [5, 17, VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID, 42, 8]
with Engine(config) as engine:
    out = engine.generate(input_ids=prompt, image_data=[random_image(100, 80, seed=1)],
                          sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
                          return_logprob=True, top_logprobs_num=5)
print("TOKENS=" + json.dumps(out.token_ids))
print("TOP=" + json.dumps([[token, value] for token, value in out.output_top_logprobs[0]]))
