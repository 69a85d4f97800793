"""model.path as a Hugging Face hub id (offline: a cached snapshot or one clear line), and sharded loading."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treadle.core.config import ModelConfig
from treadle.core.loading.hub import HubId, default_served_name, parse_hub_id
from treadle.core.loading.model_loader import ModelLoadError, load_model
from treadle.core.registry import build_registry
from treadle.testing.models import make_tiny_llama

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def registry():
    return build_registry(plugin_modules=["treadle.plugins.models.llama"], load_entry_points=False)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty huggingface_hub cache with the hub switched off (what HF_HOME=<tmp> HF_HUB_OFFLINE=1 gives)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _cache_snapshot(cache: Path, repo_id: str, source: str, ref: str = "main") -> Path:
    """Lay out ``source``'s files as huggingface_hub's cache does: refs/<ref> -> snapshots/<commit>/."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / ref).write_text(COMMIT)
    return snapshot


def test_hub_ids_are_told_apart_from_paths():
    assert parse_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") == HubId("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert parse_hub_id("Qwen/Qwen2.5-7B@v1.0") == HubId("Qwen/Qwen2.5-7B", "v1.0")
    assert parse_hub_id("org/name@refs/pr/3") == HubId("org/name", "refs/pr/3")
    for path in ("/abs/folder", "./rel/folder", "~/models/x", "a/b/c", "model.gguf", "org/na--me", "org/"):
        assert parse_hub_id(path) is None, path


def test_uncached_hub_id_offline_fails_with_one_line(tmp_path):
    """A fresh process with HF_HUB_OFFLINE=1 and an empty HF_HOME, as a user would run it."""
    script = (
        "from treadle.core.config import ModelConfig\n"
        "from treadle.core.loading.model_loader import ModelLoadError, resolve_model_path\n"
        "try:\n"
        "    resolve_model_path(ModelConfig(path='someorg/not-downloaded@v2'))\n"
        "except ModelLoadError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout + done.stderr
    assert "'someorg/not-downloaded@v2' is a Hugging Face hub id that is not in the local cache" in lines[0]
    assert str(tmp_path / "hf" / "hub") in lines[0] and "HF_HUB_OFFLINE is set" in lines[0]
    assert "hf download someorg/not-downloaded" in lines[0]


def test_cached_hub_id_loads_offline(tiny_llama, offline_hub_cache, registry):
    snapshot = _cache_snapshot(offline_hub_cache, "tinyorg/tiny-llama", tiny_llama)
    model, hf_config, model_dir = load_model(
        ModelConfig(path="tinyorg/tiny-llama", device="cpu", dtype="float32"), registry)
    assert Path(model_dir) == snapshot
    reference, _, _ = load_model(ModelConfig(path=tiny_llama, device="cpu", dtype="float32"), registry)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name
    pinned = load_model(ModelConfig(path=f"tinyorg/tiny-llama@{COMMIT}", device="cpu", dtype="float32"), registry)
    assert Path(pinned[2]) == snapshot
    assert default_served_name("tinyorg/tiny-llama", model_dir) == "tinyorg/tiny-llama"
    assert default_served_name(tiny_llama, tiny_llama) == "llama"


def test_cached_hub_id_at_an_unknown_revision_is_one_line(tiny_llama, offline_hub_cache, registry):
    _cache_snapshot(offline_hub_cache, "tinyorg/tiny-llama", tiny_llama)
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelConfig(path="tinyorg/tiny-llama@v9", device="cpu"), registry)
    assert "'tinyorg/tiny-llama@v9' is a Hugging Face hub id that is not in the local cache" in str(info.value)
    assert "\n" not in str(info.value)


def test_sharded_save_pretrained_loads_with_a_progress_bar_over_shards(tiny_llama, tmp_path, registry, capsys):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    capsys.readouterr()
    model, _, _ = load_model(ModelConfig(path=str(tmp_path / "sharded"), device="cpu", dtype="float32"), registry)
    bar = capsys.readouterr().err
    assert "Loading safetensors shards" in bar and f"{len(shards)}/{len(shards)}" in bar
    reference, _, _ = load_model(ModelConfig(path=tiny_llama, device="cpu", dtype="float32"), registry)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name
