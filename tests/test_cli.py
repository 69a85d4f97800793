import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


TREADLE = str(Path(sys.executable).with_name("treadle"))  # the console script a user runs (no cwd on its path)


@pytest.mark.parametrize("option, message", [
    (["--model.path", "/no/such/model"], "model.path '/no/such/model' does not exist"),
    (["--parallel.tp_size", "7"], "parallel.tp_size=7 does not divide"),
])
def test_generate_reports_a_user_error_in_one_line(option, message):
    result = subprocess.run([TREADLE, "generate", "--prompt", "hi", *option], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_serve_help_shows_the_common_keys_and_where_every_key_is():
    out = _run("serve", "--help").stdout
    assert "--server.port" in out and "(default: 30000)" in out
    assert "--model.path" in out and "--attention.backend" in out and "docs/config.md" in out


def test_generate_help_describes_every_option_with_its_default():
    out = _run("generate", "--help").stdout
    assert "most tokens to generate (default: 64)" in out
    assert "0 is greedy (default: 0)" in out and "the user's message" in out


def test_plugins_set_loads_a_module_from_the_working_directory(tmp_path):
    (tmp_path / "lab_policies.py").write_text(
        "from treadle.core.hookspecs import hookimpl\n"
        "from treadle.plugins.schedulers.policies import FCFSPolicy\n\n"
        "@hookimpl\n"
        "def treadle_register_schedule_policies(register):\n"
        "    register('lab-fcfs', FCFSPolicy)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([TREADLE, "plugins", "--json", "--set", "plugins=[lab_policies]"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["schedule_policies"]["lab-fcfs"] == "lab_policies"


def test_plugins_into_a_closed_pipe_exits_quietly():
    """`treadle plugins --json | head -1`: the reader goes away before the output is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([TREADLE, "plugins", "--json"], stdout=write_end, stderr=subprocess.PIPE, text=True,
                                timeout=120)
    finally:
        os.close(write_end)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_engine_is_in_dir_of_the_package():
    import treadle

    assert {"Engine", "SamplingParams", "ServerConfig"} <= set(dir(treadle))
