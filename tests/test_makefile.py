"""The Makefile's targets as the README describes them: serve's PORT/HOST/CONFIG/SET, PYTEST_ARGS, make shell."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _outside_make() -> dict[str, str]:
    """This environment without an enclosing make's variables (the suite runs under `make test`)."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "VIRTUAL_ENV")}


def _dry_run(*args: str) -> str:
    """The commands `make -n ARGS` would run (the last line is the target's own recipe)."""
    result = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, env=_outside_make(),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_serve_takes_port_host_config_and_any_key():
    command = _dry_run("serve", "PORT=8000", "HOST=0.0.0.0", "CONFIG=examples/configs/server.yaml",
                       "SET=scheduler.policy=lpm cache.page_size=1")
    assert command.endswith("treadle serve --config examples/configs/server.yaml --server.port 8000 "
                            "--server.host 0.0.0.0 --set scheduler.policy=lpm --set cache.page_size=1")


PARALLEL = ["-n", "auto", "--maxprocesses", "4", "--dist", "loadfile", "--durations", "15"]


def test_pytest_args_pass_through_without_a_second_quiet_flag():
    """`-q -q` would hide pytest's summary line (N passed)."""
    assert _dry_run("test", "PYTEST_ARGS=-q").split("pytest")[1].split() == [*PARALLEL, "-q"]
    assert _dry_run("test", "PYTEST_ARGS=tests/core -x").split("pytest")[1].split() == \
        ["-q", *PARALLEL, "tests/core", "-x"]
    assert _dry_run("test", "TEST_WORKERS=0").split("pytest")[1].split()[:3] == ["-q", "-n", "0"]


@pytest.mark.skipif(not (ROOT / ".venv" / ".treadle-installed").exists(), reason="the suite runs outside make's .venv")
def test_make_shell_finds_treadle_and_openai_in_the_venv():
    """A fresh shell's PATH (no venv active): `make shell` gives the commands the README shows."""
    env = {**_outside_make(), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    result = subprocess.run(["make", "shell"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                            input='command -v treadle\npython -c "import openai; print(openai.__name__)"\n')
    assert result.returncode == 0, result.stderr[-2000:]
    assert str(ROOT / ".venv" / "bin" / "treadle") in result.stdout and "\nopenai\n" in result.stdout
