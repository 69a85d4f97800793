import pytest

from treadle.core.config import ConfigError, ServerConfig, load_config, validate_plugin_choices
from treadle.core.registry import build_registry


def test_defaults_match_the_documented_values():
    config = load_config(use_env=False)
    assert config.model.path is None
    assert config.attention.backend == "auto"
    assert config.scheduler.policy == "fcfs"
    assert config.cache.kv_allocator == "token"
    assert config.server.port == 30000
    assert config.plugins == []


def test_yaml_then_env_then_cli_precedence(tmp_path, monkeypatch):
    path = tmp_path / "server.yaml"
    path.write_text("scheduler:\n  policy: lpm\n  max_running_requests: 8\nserver:\n  port: 31000\n")
    monkeypatch.setenv("TREADLE_SCHEDULER__POLICY", "random")
    monkeypatch.setenv("TREADLE_SERVER__PORT", "32000")
    config = load_config(path, overrides=["server.port=33000"])
    assert config.scheduler.max_running_requests == 8  # from the file
    assert config.scheduler.policy == "random"  # env beats the file
    assert config.server.port == 33000  # CLI beats env


def test_cli_values_are_parsed_as_yaml_scalars():
    config = load_config(overrides={"cache.disable_radix_cache": "true", "scheduler.chunked_prefill_size": "null"},
                         use_env=False)
    assert config.cache.disable_radix_cache is True
    assert config.scheduler.chunked_prefill_size is None


def test_unknown_key_names_its_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("scheduler:\n  polcy: lpm\n")
    with pytest.raises(ConfigError, match=r"scheduler\.polcy: unknown key"):
        load_config(path, use_env=False)


def test_out_of_range_value_is_an_error():
    with pytest.raises(ConfigError, match=r"server\.port"):
        load_config(overrides=["server.port=70000"], use_env=False)


def test_token_allocator_rejects_pages():
    with pytest.raises(ConfigError, match="page_size"):
        load_config(overrides=["cache.page_size=4"], use_env=False)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_plugin_choices_are_checked_against_the_registry():
    config = ServerConfig(attention={"backend": "flashinfr"})
    with pytest.raises(ConfigError, match=r"attention\.backend: unknown attention backend 'flashinfr'; available: .*torch_native"):
        validate_plugin_choices(config, build_registry())


def test_every_config_key_is_documented():
    from pathlib import Path

    reference = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()
    config = ServerConfig()
    for section_name in ServerConfig.model_fields:
        section = getattr(config, section_name)
        if section_name == "plugins":
            assert "## `plugins`" in reference
            continue
        for key in type(section).model_fields:
            assert f"`{section_name}.{key}`" in reference, f"{section_name}.{key} is missing from docs/config.md"


def test_prefill_cuda_graphs_may_be_set_under_tensor_parallelism():
    # auto leaves them off there (core/auto_size.py); a token count is taken as given.
    for value in ("auto", 0, 512):
        config = load_config(overrides={"parallel.tp_size": 2, "runtime.piecewise_cuda_graph_max_tokens": value})
        assert config.runtime.piecewise_cuda_graph_max_tokens == value
