import json
import subprocess
import sys

from treadle.cli import main


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "treadle", *args], capture_output=True, text=True, timeout=120)


def test_plugins_json_lists_every_kind_with_providers():
    result = _run("plugins", "--json")
    assert result.returncode == 0, result.stderr
    table = json.loads(result.stdout)
    assert {"attention", "models", "schedule_policies", "kv_allocators", "tool_parsers", "reasoning_parsers",
            "grammar_backends"} <= set(table)
    assert {"llama3_json", "mistral", "hermes"} <= set(table["tool_parsers"])
    assert table["reasoning_parsers"]["think_tags"] == "treadle"
    assert table["grammar_backends"] == {"llguidance": "treadle", "xgrammar": "treadle"}
    assert table["schedule_policies"]["shortest-prompt-first"] == "treadle-plugin-example"
    assert {"fcfs", "lpm", "random", "dfs-weight", "lof", "priority"} <= set(table["schedule_policies"])
    assert {"token", "paged"} <= set(table["kv_allocators"])
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "MixtralForCausalLM", "Qwen3MoeForCausalLM"} <= set(table["models"])


def test_config_show_prints_resolved_yaml(tmp_path, capsys):
    path = tmp_path / "server.yaml"
    path.write_text("scheduler:\n  policy: shortest-prompt-first\n")
    assert main(["config", "--show", "--config", str(path), "--server.port", "31234"]) == 0
    out = capsys.readouterr().out
    assert "policy: shortest-prompt-first" in out
    assert "port: 31234" in out


def test_config_show_never_prints_keys(monkeypatch, capsys):
    monkeypatch.setenv("TREADLE_SERVER__API_KEY", "env-secret")
    assert main(["config", "--show", "--server.admin_api_key", "cli-secret"]) == 0
    out = capsys.readouterr().out
    assert "env-secret" not in out and "cli-secret" not in out
    assert "api_key: '**********'" in out and "admin_api_key: '**********'" in out


def test_config_show_reports_errors_with_nonzero_exit(tmp_path, capsys):
    path = tmp_path / "server.yaml"
    path.write_text("cache:\n  kv_alocator: paged\n")
    assert main(["config", "--show", "--config", str(path)]) != 0
    assert "cache.kv_alocator: unknown key" in capsys.readouterr().err


def test_unknown_plugin_choice_fails_listing_available(capsys):
    assert main(["config", "--show", "--scheduler.policy", "fifo"]) != 0
    err = capsys.readouterr().err
    assert "unknown schedule policy 'fifo'" in err and "shortest-prompt-first (from treadle-plugin-example)" in err


def test_later_subcommands_exist():
    result = _run("--help")
    for command in ("plugins", "config", "serve", "generate", "bench"):
        assert command in result.stdout
