"""The package's import graph: no cycles (function-level imports included), and dependencies point inward.

Imports under ``if TYPE_CHECKING:`` are for annotations only and are left out, as DESIGN.md allows.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIPPED_PARTS = {"tests", "examples", ".venv", "build", "results", "__pycache__"}


def package_modules() -> dict[str, Path]:
    """Every module of the installed ``treadle`` package, by dotted name."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if SKIPPED_PARTS & set(parts) or any(part.startswith(".") for part in parts):
            continue
        dotted = ".".join(("treadle", *parts))[: -len(".py")]
        modules[dotted.removesuffix(".__init__")] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The treadle modules ``path`` imports at run time (at any depth of the file)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(_owning_module(alias.name, modules))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else _owning_module(base, modules))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {module for module in found if module in modules and module != name}


def _owning_module(dotted: str, modules: dict[str, Path]) -> str:
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted


@functools.cache  # parsed once for all the tests below (each parse of the tree takes ~0.6 s)
def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(path, name, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def connect(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_the_package_has_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (break each by moving the shared piece down a layer):\n" + "\n".join(
        " <-> ".join(component) for component in found)


# (importer prefix, imported prefix): the importer's modules must not import the other's.
FORBIDDEN = [
    ("treadle.core", "treadle.plugins"),
    ("treadle.core", "treadle.server"),
    ("treadle.core", "treadle.lang"),
    ("treadle.core", "treadle.bench"),
    ("treadle.core", "treadle.testing"),
    ("treadle.core", "treadle.layers"),
    ("treadle.server", "treadle.bench"),
    ("treadle.plugins", "treadle.bench"),
    ("treadle.layers", "treadle.bench"),
    ("treadle.layers", "treadle.plugins"),
    ("treadle.kernels", "treadle.core"),
    ("treadle.kernels", "treadle.layers"),
    ("treadle.kernels", "treadle.plugins"),
    ("treadle.text", "treadle.core"),
    ("treadle.text", "treadle.server"),
]


@pytest.mark.parametrize("importer,imported", FORBIDDEN)
def test_dependencies_point_inward(importer, imported):
    graph = import_graph()
    wrong = sorted(f"{source} imports {target}" for source, targets in graph.items()
                   if _within(source, importer) for target in targets if _within(target, imported))
    assert not wrong, "\n".join(wrong)


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


# What each server process other than the scheduler imports at start, in order; none of it may load torch (~1.5 s of
# CPU at every server start for nothing). The HTTP workers' registry holds only the parsers (server/chat_tools.py),
# and the multimodal processors are imported at a request's first image.
TORCH_FREE_STARTS = {
    # its main module is treadle.server.launch; core.request_io, not core.request
    "the detokenizer": "import treadle.server.launch, treadle.server.detokenizer",
    # worker 0 is the main process, which also starts the others (launch._Children)
    "the HTTP workers": "import treadle.server.http_workers, treadle.server.app, treadle.server.draining, "
                        "treadle.server.metrics, treadle.server.tokenizer_manager, treadle.server.dp_controller, "
                        "treadle.core.loading.gc_freeze\nfrom treadle.core.config import ServerConfig\n"
                        "from treadle.server.chat_tools import ChatParsers\n"
                        "ChatParsers(ServerConfig(reasoning={'parser': 'think_tags'}), 'LlamaForCausalLM')",
}


def test_the_detokenizer_and_the_http_workers_start_without_torch():
    code = "import sys\n" + "".join(
        f"{imports}\nprint({process!r}, sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])\n"
        for process, imports in TORCH_FREE_STARTS.items())
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip().splitlines() == [f"{process} []" for process in TORCH_FREE_STARTS], \
        f"torch loaded at a process's start:\n{loaded}"


# Module and function sizes (STYLE.md / DESIGN.md): a module past this many lines is split by job, a function past
# this many lines is split into named steps; Triton kernels (decorated ``@triton.jit``) are exempt.
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _is_kernel(node: ast.AST) -> bool:
    return any("jit" in ast.unparse(decorator) or "autotune" in ast.unparse(decorator)
               for decorator in getattr(node, "decorator_list", []))


def test_modules_and_functions_stay_small():
    too_long = []
    for name, path in package_modules().items():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{name}: {source.count(chr(10))} lines (split it by job)")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}.{node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)
