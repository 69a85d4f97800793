"""treadle: an LLM serving engine with a thin core and pluggy plugins.

``from treadle import Engine, SamplingParams`` is the offline API;
``treadle serve`` starts the OpenAI-compatible server.
"""

from __future__ import annotations

from typing import Any

from treadle import moved

moved.install()  # old import paths of moved modules keep working, with a DeprecationWarning

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "ServerConfig", "GenerateOutput", "default_model", "__version__"]

_LAZY = {
    "Engine": ("treadle.core.engine", "Engine"),
    "GenerateOutput": ("treadle.core.engine", "GenerateOutput"),
    "SamplingParams": ("treadle.core.request", "SamplingParams"),
    "ServerConfig": ("treadle.core.config", "ServerConfig"),
    "default_model": ("treadle.core.loading.default_model", "default_model"),
}


def __getattr__(name: str) -> Any:
    # Lazy so that `treadle plugins` and config tools start without importing torch.
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'treadle' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names too, so that dir(treadle) and tab completion show Engine and its friends.
    return sorted(set(globals()) | set(_LAZY))
