"""load_model: sharded safetensors, dummy weights, and the errors a user sees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from treadle.core.config import ModelConfig
from treadle.core.loading.model_loader import ModelLoadError, load_model, resolve_dtype
from treadle.core.registry import build_registry
from treadle.testing.models import make_tiny_llama

PLUGINS = ["treadle.plugins.models.llama", "treadle.plugins.models.mistral"]


@pytest.fixture(scope="module")
def registry():
    return build_registry(plugin_modules=PLUGINS, load_entry_points=False)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


def _cpu_fp32(path: str, **fields) -> ModelConfig:
    return ModelConfig(path=path, device="cpu", dtype="float32", **fields)


def _shard(src: str, dst: Path) -> Path:
    """Re-save a single-file checkpoint as 3 shards with an index, like large HF models."""
    dst.mkdir()
    (dst / "config.json").write_text(Path(src, "config.json").read_text())
    tensors = load_file(str(Path(src, "model.safetensors")))
    names = sorted(tensors)
    weight_map = {}
    for shard in range(3):
        file = f"model-{shard + 1:05d}-of-00003.safetensors"
        part = {n: tensors[n] for n in names[shard::3]}
        save_file(part, str(dst / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def test_sharded_checkpoint_loads_the_same_weights(tiny_llama, tmp_path, registry):
    single, _, _ = load_model(_cpu_fp32(tiny_llama), registry)
    sharded, hf_config, model_dir = load_model(_cpu_fp32(str(_shard(tiny_llama, tmp_path / "sharded"))), registry)
    assert model_dir == str(tmp_path / "sharded")
    assert hf_config.architectures == ["LlamaForCausalLM"]
    reference = load_file(str(Path(tiny_llama, "model.safetensors")))
    q_rows = hf_config.num_attention_heads * (hf_config.hidden_size // hf_config.num_attention_heads)
    stacked_q = sharded.model.layers[1].self_attn.qkv_proj.weight[:q_rows]
    assert torch.equal(stacked_q, reference["model.layers.1.self_attn.q_proj.weight"])
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


def test_dummy_weights_are_reproducible_finite_and_in_dtype(tiny_llama, registry):
    first, _, _ = load_model(_cpu_fp32(tiny_llama, load_format="dummy", seed=7), registry, dtype="bfloat16")
    again, _, _ = load_model(_cpu_fp32(tiny_llama, load_format="dummy", seed=7), registry, dtype="bfloat16")
    other, _, _ = load_model(_cpu_fp32(tiny_llama, load_format="dummy", seed=8), registry, dtype="bfloat16")
    weight = first.model.layers[0].mlp.down_proj.weight
    assert weight.dtype == torch.bfloat16 and torch.isfinite(weight).all()
    assert torch.equal(weight, again.model.layers[0].mlp.down_proj.weight)
    assert not torch.equal(weight, other.model.layers[0].mlp.down_proj.weight)
    assert 0 < weight.abs().max() <= 1e-3


def test_dummy_load_needs_no_weight_files(tiny_llama, tmp_path, registry):
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text(Path(tiny_llama, "config.json").read_text())
    model, _, _ = load_model(_cpu_fp32(str(tmp_path / "config-only"), load_format="dummy"), registry)
    assert model.lm_head.weight.shape == (512, 64)


def test_unknown_architecture_lists_available(tiny_llama, tmp_path, registry):
    folder = tmp_path / "odd"
    folder.mkdir()
    config = json.loads(Path(tiny_llama, "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"'GPTNeoXForCausalLM'.*available: LlamaForCausalLM .*MistralForCausalLM"):
        load_model(_cpu_fp32(str(folder)), registry)


def test_missing_folder_is_a_clear_error(tmp_path, registry):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(_cpu_fp32(str(tmp_path / "nowhere")), registry)


def test_folder_without_weights_is_a_clear_error(tiny_llama, tmp_path, registry):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(Path(tiny_llama, "config.json").read_text())
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weights"):
        load_model(_cpu_fp32(str(tmp_path / "empty")), registry)


def test_missing_tensor_is_named(tiny_llama, tmp_path, registry):
    folder = tmp_path / "partial"
    folder.mkdir()
    (folder / "config.json").write_text(Path(tiny_llama, "config.json").read_text())
    tensors = load_file(str(Path(tiny_llama, "model.safetensors")))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="missing from the checkpoint.*model.layers.1.mlp.up_proj.weight"):
        load_model(_cpu_fp32(str(folder)), registry)


def test_auto_dtype_is_float32_on_cpu_and_the_checkpoint_dtype_on_cuda():
    config = type("Config", (), {"dtype": "bfloat16"})()
    assert resolve_dtype("auto", config, "cpu") == torch.float32
    assert resolve_dtype("auto", config, "cuda") == torch.bfloat16
    assert resolve_dtype("float16", config, "cpu") == torch.float16
