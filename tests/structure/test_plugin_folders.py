"""Each built-in plugin registers only the kind of its folder under plugins/, as core/registry.py's
BUILTIN_FOLDER_KINDS says: a registry of some kinds (an HTTP worker's parsers) skips the other folders unimported."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from treadle.core.hookspecs import HOOKS_BY_KIND
from treadle.core.registry import BUILTIN_FOLDER_KINDS

ROOT = Path(__file__).resolve().parents[2]


def test_every_builtin_entry_point_registers_only_its_folders_kind():
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["treadle"]
    wrong = []
    for name, module in entry_points.items():
        parts = module.split(".")
        kind = BUILTIN_FOLDER_KINDS.get(parts[2])
        tree = ast.parse(ROOT.joinpath(*parts[1:]).with_suffix(".py").read_text())
        defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        hooks = defined & set(HOOKS_BY_KIND.values())
        if kind is None or hooks != {HOOKS_BY_KIND[kind]}:
            wrong.append(f"{name} = {module}: implements {sorted(hooks)}; its folder's kind is {kind}")
    assert not wrong, "\n".join(wrong)


def test_every_plugin_folder_has_a_kind():
    folders = {path.parent.name for path in (ROOT / "plugins").glob("*/__init__.py")}
    assert folders == set(BUILTIN_FOLDER_KINDS)
