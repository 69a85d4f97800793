"""The benchmark shapes are the published models' configs: HF transformers builds each with its known size."""

from __future__ import annotations

import pytest
import torch

from treadle.bench.shapes import MODEL_SHAPES


@pytest.mark.parametrize(("name", "billions"), [("llama-3.1-8b", 8.03), ("llama-3.1-70b", 70.55),
                                                ("qwen3-30b-a3b", 30.53), ("mixtral-8x7b", 46.70)])
def test_each_shape_builds_the_published_model_size(name, billions):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(MODEL_SHAPES[name])
    config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == config.architectures[0]
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)


def test_the_gpu_scripts_write_a_shape_into_a_folder_a_model_path_can_name(tmp_path, capsys):
    import json

    from treadle.bench.shapes import main

    folder = tmp_path / "qwen3-30b-a3b"
    assert main(["qwen3-30b-a3b", str(folder)]) == 0
    assert capsys.readouterr().out.strip() == str(folder)
    assert json.loads((folder / "config.json").read_text()) == MODEL_SHAPES["qwen3-30b-a3b"]
