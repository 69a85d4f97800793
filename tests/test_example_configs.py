"""Every example config validates, with every plugin name it picks registered."""

from __future__ import annotations

from pathlib import Path

import pytest

from treadle.core.config import load_config, validate_plugin_choices
from treadle.core.registry import build_registry

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_example_config_is_valid(path):
    config = load_config(path, use_env=False)
    validate_plugin_choices(config, build_registry(config.plugins))


def test_there_are_example_configs():
    assert len(CONFIGS) >= 3
