"""Plugin manager and the named registries it fills.

Built-in plugins and third-party ones are found the same way: the entry-point
group ``treadle``. Modules named in the config's ``plugins:`` list are loaded
too, and tests may hand in plugin objects directly.

A registry of only some kinds (the HTTP workers want the tool and reasoning
parsers) skips importing treadle's own plugins of the other kinds: the
attention and model plugins import torch, which costs a process
about a second and a half of CPU for nothing.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any, Iterable

import pluggy

from treadle.core.hookspecs import HOOKS_BY_KIND, KIND_LABELS, PROJECT_NAME, Spec


class PluginError(Exception):
    """A plugin could not be loaded, registered twice, or was asked for by an unknown name."""


@dataclass(frozen=True)
class Registration:
    name: str
    factory: Any
    provider: str


# The kind of the built-ins in each folder of treadle/plugins/ (each built-in registers only its folder's kind:
# tests/structure/test_plugin_folders.py checks it).
BUILTIN_FOLDER_KINDS: dict[str, str] = {
    "attention": "attention",
    "models": "models",
    "schedulers": "schedule_policies",
    "kv_allocators": "kv_allocators",
    "tool_parsers": "tool_parsers",
    "reasoning_parsers": "reasoning_parsers",
    "grammar": "grammar_backends",
    "speculators": "speculators",
    "lora_backends": "lora_backends",
    "quantization": "quantization_methods",
    "poolings": "poolings",
}
_BUILTIN_PREFIX = f"{PROJECT_NAME}.plugins."


class Registry:
    """Every registered plugin, by kind and name, with the provider that registered it."""

    def __init__(self, kinds: Iterable[str] = tuple(HOOKS_BY_KIND)) -> None:
        self._entries: dict[str, dict[str, Registration]] = {kind: {} for kind in kinds}

    def add(self, kind: str, name: str, factory: Any, provider: str) -> None:
        entries = self._entries[kind]
        if name in entries:
            raise PluginError(
                f"duplicate {KIND_LABELS[kind]} '{name}': registered by both "
                f"'{entries[name].provider}' and '{provider}'"
            )
        entries[name] = Registration(name, factory, provider)

    def get(self, kind: str, name: str) -> Any:
        """The factory registered as ``name``; an unknown name lists what is available."""
        entries = self._kind(kind)
        if name not in entries:
            raise PluginError(f"unknown {KIND_LABELS[kind]} '{name}'; available: {self.describe(kind)}")
        return entries[name].factory

    def names(self, kind: str) -> list[str]:
        return sorted(self._kind(kind))

    def describe(self, kind: str) -> str:
        entries = self._kind(kind)
        if not entries:
            return "(none)"
        return ", ".join(f"{name} (from {entries[name].provider})" for name in sorted(entries))

    def table(self) -> dict[str, dict[str, str]]:
        """``{kind: {name: provider}}`` — the shape of ``treadle plugins --json``."""
        return {
            kind: {name: reg.provider for name, reg in sorted(entries.items())}
            for kind, entries in self._entries.items()
        }

    def _kind(self, kind: str) -> dict[str, Registration]:
        if kind not in self._entries:
            raise PluginError(f"this registry was built for {', '.join(self._entries)} only, not for "
                              f"{KIND_LABELS[kind]}s (build_registry(kinds=...))")
        return self._entries[kind]


def build_registry(
    plugin_modules: Iterable[str] = (),
    extra_plugins: Iterable[Any] = (),
    load_entry_points: bool = True,
    kinds: Iterable[str] | None = None,
) -> Registry:
    """Discover plugins and collect their registrations.

    ``plugin_modules`` are importable module names (the config's ``plugins:``);
    ``extra_plugins`` are objects with hook implementations (in-process tests).
    ``kinds`` (default: all) limits the registry to those plugin kinds: treadle's
    own entry points of other kinds are then not imported. Every other entry
    point and module is, since one module may register plugins of any kind.
    """
    kinds = tuple(HOOKS_BY_KIND) if kinds is None else tuple(kinds)
    unknown = sorted(set(kinds) - set(HOOKS_BY_KIND))
    if unknown:
        raise PluginError(f"unknown plugin kind(s) {', '.join(unknown)}; the kinds are {', '.join(HOOKS_BY_KIND)}")
    manager = pluggy.PluginManager(PROJECT_NAME)
    manager.add_hookspecs(Spec)
    providers: dict[int, str] = {}
    if load_entry_points:
        for entry_point in _builtin_entry_points_outside(kinds):
            manager.set_blocked(entry_point)
        manager.load_setuptools_entrypoints(PROJECT_NAME)
        for plugin, dist in manager.list_plugin_distinfo():
            providers[id(plugin)] = dist.project_name
    for module_name in plugin_modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise PluginError(f"cannot import plugin module '{module_name}' listed under plugins: {exc}; it must be "
                              "installed or in a folder on PYTHONPATH (the treadle command also looks in the "
                              "working directory)") from exc
        if manager.is_registered(module):
            continue
        manager.register(module, name=module_name)
        providers[id(module)] = module_name
    for plugin in extra_plugins:
        name = getattr(plugin, "__name__", type(plugin).__name__)
        manager.register(plugin, name=name)
        providers[id(plugin)] = name

    registry = Registry(kinds)
    for kind in kinds:
        hook = getattr(manager.hook, HOOKS_BY_KIND[kind])
        # Call each implementation on its own so every registration knows its provider.
        for impl in reversed(hook.get_hookimpls()):
            provider = providers.get(id(impl.plugin), impl.plugin_name)

            def register(name: str, factory: Any, _kind: str = kind, _provider: str = provider) -> None:
                registry.add(_kind, name, factory, _provider)

            impl.function(register=register)
    return registry


def _builtin_entry_points_outside(kinds: tuple[str, ...]) -> list[str]:
    """The names of treadle's own entry points whose plugins are of none of ``kinds``."""
    if set(HOOKS_BY_KIND) <= set(kinds):
        return []
    skipped = []
    for entry_point in importlib.metadata.entry_points(group=PROJECT_NAME):
        if not entry_point.value.startswith(_BUILTIN_PREFIX):
            continue
        kind = BUILTIN_FOLDER_KINDS.get(entry_point.value.removeprefix(_BUILTIN_PREFIX).split(".")[0])
        if kind is not None and kind not in kinds:  # a folder not in the table: loaded, whatever it registers
            skipped.append(entry_point.name)
    return skipped
