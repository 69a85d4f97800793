"""The model-family example in docs/plugins.md works as written: registered from the docs' code alone,
it serves a Qwen2-style checkpoint token-identical to HF transformers."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from treadle import Engine, SamplingParams
from treadle.testing.models import make_tiny_qwen2

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def _example_module() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    return next(block for block in blocks if "class AcmeForCausalLM" in block)


def test_the_documented_family_matches_hf(tmp_path, monkeypatch):
    (tmp_path / "acme_family.py").write_text(_example_module())
    monkeypatch.syspath_prepend(str(tmp_path))
    path = make_tiny_qwen2(tmp_path / "acme", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = [5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2]
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, min_new_tokens=10,
                                     pad_token_id=0)[0, len(prompt):].tolist()
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["AcmeForCausalLM"]
    config_file.write_text(json.dumps(config))

    engine = Engine({"model": {"path": path}, "plugins": ["acme_family"], "cache": {"max_total_tokens": 512}})
    output = engine.generate(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=10, temperature=0.0,
                                                                              ignore_eos=True))
    sys.modules.pop("acme_family", None)
    assert output.token_ids == expected
