"""Plugin manager and the named registries it fills.

Built-in plugins and third-party ones are found the same way: the entry-point
group ``treadle``. Modules named in the config's ``plugins:`` list are loaded
too, and tests may hand in plugin objects directly.
"""

from __future__ import annotations

import importlib
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


class Registry:
    """Every registered plugin, by kind and name, with the provider that registered it."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Registration]] = {kind: {} for kind in HOOKS_BY_KIND}

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
        entries = self._entries[kind]
        if name not in entries:
            raise PluginError(f"unknown {KIND_LABELS[kind]} '{name}'; available: {self.describe(kind)}")
        return entries[name].factory

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def describe(self, kind: str) -> str:
        entries = self._entries[kind]
        if not entries:
            return "(none)"
        return ", ".join(f"{name} (from {entries[name].provider})" for name in sorted(entries))

    def table(self) -> dict[str, dict[str, str]]:
        """``{kind: {name: provider}}`` — the shape of ``treadle plugins --json``."""
        return {
            kind: {name: reg.provider for name, reg in sorted(entries.items())}
            for kind, entries in self._entries.items()
        }


def build_registry(
    plugin_modules: Iterable[str] = (),
    extra_plugins: Iterable[Any] = (),
    load_entry_points: bool = True,
) -> Registry:
    """Discover plugins and collect their registrations.

    ``plugin_modules`` are importable module names (the config's ``plugins:``);
    ``extra_plugins`` are objects with hook implementations (in-process tests).
    """
    manager = pluggy.PluginManager(PROJECT_NAME)
    manager.add_hookspecs(Spec)
    providers: dict[int, str] = {}
    if load_entry_points:
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

    registry = Registry()
    for kind, hook_name in HOOKS_BY_KIND.items():
        hook = getattr(manager.hook, hook_name)
        # Call each implementation on its own so every registration knows its provider.
        for impl in reversed(hook.get_hookimpls()):
            provider = providers.get(id(impl.plugin), impl.plugin_name)

            def register(name: str, factory: Any, _kind: str = kind, _provider: str = provider) -> None:
                registry.add(_kind, name, factory, _provider)

            impl.function(register=register)
    return registry
