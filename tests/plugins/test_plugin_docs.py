"""The model-family example in docs/plugins.md works as written: registered from the docs' code alone, it serves a
Qwen2-style checkpoint token-identical to HF transformers; it rebuilds ``o_proj`` from the old layer's
``in_features``/``out_features`` as a plugin would rebuild an ``nn.Linear``. The same code importing the shared
layers from their old place (``treadle.plugins.models.layers``, before they moved to ``treadle.layers``) works too."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.testing.models import make_tiny_qwen2

DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
PROMPT = [5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2]
# How the shared layers were imported before they moved (moved.py keeps these working, with a DeprecationWarning).
OLD_IMPORTS = {"from treadle.layers.decoder import": "from treadle.plugins.models.layers import",
               "from treadle.layers.linear import": "from treadle.plugins.models.linear import"}


def _example_module() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    return next(block for block in blocks if "class AcmeForCausalLM" in block)


@pytest.fixture(scope="module")
def acme(tmp_path_factory) -> tuple[str, list[int]]:
    """A Qwen2-style checkpoint renamed to ``AcmeForCausalLM``, and HF transformers' greedy tokens for PROMPT."""
    path = make_tiny_qwen2(tmp_path_factory.mktemp("acme"), use_sliding_window=True, sliding_window=5,
                           max_window_layers=1)
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=10, min_new_tokens=10,
                                     pad_token_id=0)[0, len(PROMPT):].tolist()
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["AcmeForCausalLM"]
    config_file.write_text(json.dumps(config))
    return path, expected


def _serve(source: str, module: str, model_dir: str, tmp_path: Path, monkeypatch) -> list[int]:
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = Engine({"model": {"path": model_dir}, "plugins": [module], "cache": {"max_total_tokens": 512}})
    try:
        output = engine.generate(input_ids=PROMPT, sampling_params=SamplingParams(max_new_tokens=10, temperature=0.0,
                                                                                  ignore_eos=True))
        return output.token_ids
    finally:
        engine.shutdown()
        sys.modules.pop(module, None)


def test_the_documented_family_matches_hf(acme, tmp_path, monkeypatch):
    source = _example_module()
    assert "old.in_features" in source and "old.out_features" in source  # the rebuild this test is about
    model_dir, expected = acme
    assert _serve(source, "acme_family", model_dir, tmp_path, monkeypatch) == expected


def test_the_documented_family_with_the_old_import_paths_matches_hf(acme, tmp_path, monkeypatch):
    source = _example_module()
    for new, old in OLD_IMPORTS.items():
        assert new in source
        source = source.replace(new, old)
    model_dir, expected = acme
    assert _serve(source, "acme_family_old_imports", model_dir, tmp_path, monkeypatch) == expected


def test_the_documented_family_splits_over_ranks(acme, tmp_path, monkeypatch):
    """At tp 2 the rebuilt ``o_proj`` is sized from the whole layer (``in_features`` is not a rank's share)."""
    from treadle.testing import check_tensor_parallel

    (tmp_path / "acme_family_tp.py").write_text(_example_module())
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        check_tensor_parallel(acme[0], tp_size=2, overrides={"plugins": ["acme_family_tp"]})
    finally:
        sys.modules.pop("acme_family_tp", None)
