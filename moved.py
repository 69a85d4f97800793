"""Old import paths of modules that moved, kept working with a DeprecationWarning.

Plugins written against earlier releases import, for example, ``treadle.core.schedule_policy`` or
``treadle.plugins.models.layers``. Importing an old name gives the module at its new place (the same
module object, so classes keep their identity) and warns once, naming the new path. The table is the
list of moves; ``docs/plugins.md`` shows it to plugin authors.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED_MODULES: dict[str, str] = {
    "treadle.core.schedule_policy": "treadle.core.scheduling.policy",
    "treadle.core.scheduler": "treadle.core.scheduling.scheduler",
    "treadle.core.schedule_batch": "treadle.core.scheduling.schedule_batch",
    "treadle.core.overlap": "treadle.core.execution.overlap",
    "treadle.core.forward_batch": "treadle.core.execution.forward_batch",
    "treadle.core.attention": "treadle.core.execution.attention",
    "treadle.core.cuda_graph": "treadle.core.execution.cuda_graph",
    "treadle.core.piecewise_graph": "treadle.core.execution.piecewise_graph",
    "treadle.core.model_runner": "treadle.core.execution.model_runner",
    "treadle.core.sampler": "treadle.core.execution.sampler",
    "treadle.core.memory_pool": "treadle.core.memory.pools",
    "treadle.core.kv_allocator": "treadle.core.memory.allocator",
    "treadle.core.radix_cache": "treadle.core.memory.radix_cache",
    "treadle.core.model_loader": "treadle.core.loading.model_loader",
    "treadle.core.hub": "treadle.core.loading.hub",
    "treadle.core.default_model": "treadle.core.loading.default_model",
    "treadle.core.lazy_weights": "treadle.core.loading.lazy_weights",
    "treadle.core.quantization": "treadle.core.loading.quantization",
    "treadle.core.parallel": "treadle.core.distributed.parallel",
    "treadle.core.tensor_parallel": "treadle.core.distributed.tensor_parallel",
    "treadle.core.tokenizer": "treadle.text.tokenizer",
    "treadle.core.incremental_decode": "treadle.text.incremental_decode",
    "treadle.core.tool_parser": "treadle.text.tool_parser",
    "treadle.core.forced_tools": "treadle.text.forced_tools",
    "treadle.core.reasoning_parser": "treadle.text.reasoning_parser",
    "treadle.core.pdl": "treadle.kernels.pdl",
    "treadle.plugins.models.layers": "treadle.layers",
    "treadle.plugins.models.linear": "treadle.layers.linear",
    "treadle.plugins.models.moe": "treadle.layers.moe",
    "treadle.plugins.models.fused_ops": "treadle.kernels.fused_ops",
    "treadle.plugins.models.fp8": "treadle.layers.fp8",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name in :data:`MOVED_MODULES` and loads it as the module at its new name."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new_name = MOVED_MODULES[spec.name]
        warnings.warn(f"{spec.name} moved to {new_name}; import it from there (the old path will be removed)",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new_name)
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the old name's spec on the module; it stays the module at its new name.
        module.__spec__ = self._real_spec


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
