"""Every fenced example in README.md and docs/*.md runs as written, so the docs cannot drift from the code.

What runs, and how:
- ``python`` fences: each document's blocks run in order in one fresh Python process, sharing one namespace
  (a later block may use the ``client`` an earlier one made), as a reader pasting them would.
- ``bash`` / ``sh`` / ``shell`` fences: each block runs under ``bash -e -o pipefail`` from the repository root,
  with this virtualenv's ``bin`` first on ``PATH`` (as after ``source .venv/bin/activate``); ``curl`` gets
  ``--fail-with-body``, so an HTTP error fails the example.
- ``yaml`` fences are treadle configs: each must load as a ``ServerConfig`` (files are checked, not run).
- Other fences (``json``, ``toml``, diagrams without a language) are not checked.

Examples talking to a server (``curl``, the ``openai`` client, ``RuntimeEndpoint``) reach one real server on the
default model (the embedded SmolLM2), started once for the session: the examples' ``127.0.0.1:30000`` and
``localhost:30000`` are pointed at its port. Outputs shown in comments (``# The capital of France is Paris.``) are
not compared: an example must run without error.

A fence that cannot run on a CPU machine in a test — a GPU command, a server or benchmark that runs until stopped,
a package install — has a marker on the line before it (the reason is required)::

    <!-- docs-test: skip (GPU only) -->

and a whole document opts out with ``<!-- docs-test: skip-file (why) -->`` anywhere in it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell"}
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)[^`]*$")
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
SKIP_FILE = re.compile(r"<!--\s*docs-test:\s*skip-file\s*\((?P<reason>[^)]+)\)\s*-->")
DOCUMENTED_PORT = re.compile(r"(127\.0\.0\.1|localhost):30000")


@dataclass(frozen=True)
class Example:
    """One fenced block: where it is, its language, its text, and why it is skipped (if it is)."""

    document: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    skip_reason: str | None

    @property
    def name(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def read_examples(document: Path) -> list[Example]:
    text = document.read_text()
    file_skip = SKIP_FILE.search(text)
    lines = text.splitlines()
    examples, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language, start = opening.group(1), opening.group(2).lower(), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        before = next((line for line in reversed(lines[:start]) if line.strip()), "")
        marker = SKIP.search(before)
        reason = file_skip.group("reason") if file_skip else marker.group("reason") if marker else None
        examples.append(Example(document, start + 1, language, "\n".join(body) + "\n", reason))
        i += 1
    return examples


EXAMPLES = [example for document in DOCUMENTS for example in read_examples(document)]
PYTHON_DOCUMENTS = sorted({e.document for e in EXAMPLES if e.language == "python" and not e.skip_reason})


def _param(example: Example):
    marks = [pytest.mark.skip(reason=example.skip_reason)] if example.skip_reason else []
    return pytest.param(example, id=example.name, marks=marks)


@pytest.fixture(scope="module")
def docs_server():
    """The default server (embedded SmolLM2) on a free port, for the examples that call one."""
    from treadle.core.config import ServerConfig
    from treadle.server.launch import launch_server

    config = ServerConfig.model_validate({"server": {"port": 0, "log_level": "warning"}})
    handle = launch_server(config, timeout=300)
    yield handle
    handle.shutdown()


def _environment() -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": "", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def _at_port(code: str, port: int) -> str:
    return DOCUMENTED_PORT.sub(f"127.0.0.1:{port}", code)


def test_every_skip_marker_sits_on_a_fence_and_says_why():
    for document in DOCUMENTS:
        lines = document.read_text().splitlines()
        for number, line in enumerate(lines):
            if not line.lstrip().startswith("<!--") or "docs-test:" not in line or SKIP_FILE.search(line):
                continue  # not a marker (prose may name one in backticks), or the whole document's
            assert SKIP.search(line), f"{document.name}:{number + 1}: a marker is <!-- docs-test: skip (reason) -->"
            following = next((later for later in lines[number + 1:] if later.strip()), "")
            assert FENCE.match(following), f"{document.name}:{number + 1}: no fenced block follows the marker"


@pytest.mark.parametrize("document", PYTHON_DOCUMENTS, ids=lambda d: str(d.relative_to(ROOT)))
def test_python_examples_run(document: Path, docs_server, tmp_path):
    blocks = [e for e in EXAMPLES if e.document == document and e.language == "python" and not e.skip_reason]
    driver = ["import sys", "namespace = {'__name__': '__main__'}"]
    for block in blocks:
        code = _at_port(block.code, docs_server.port)
        driver.append(f"print('--- running {block.name}', file=sys.stderr, flush=True)")
        driver.append(f"exec(compile({code!r}, {block.name!r}, 'exec'), namespace)")
    script = tmp_path / "examples.py"
    script.write_text("\n".join(driver) + "\n")
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=_environment(), capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, f"{document.name}'s examples failed:\n{result.stderr[-6000:]}"


@pytest.mark.parametrize("example", [_param(e) for e in EXAMPLES if e.language in SHELL_LANGUAGES])
def test_shell_examples_run(example: Example, docs_server):
    script = "curl() { command curl --fail-with-body --silent --show-error \"$@\"; }\n" + \
        _at_port(example.code, docs_server.port)
    result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=ROOT, env=_environment(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (
        f"{example.name} failed ({result.returncode}):\n{textwrap.indent(example.code, '  ')}\n"
        f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")


@pytest.mark.parametrize("example", [_param(e) for e in EXAMPLES if e.language in ("yaml", "yml")])
def test_yaml_examples_are_valid_configs(example: Example, tmp_path):
    from treadle.core.config import load_config

    path = tmp_path / "example.yaml"
    path.write_text(example.code)
    load_config(str(path), use_env=False)
