"""AttentionContext: what an attention backend (and a CUDA-graph runner) is given about the model and its memory.

Backends used to be built as ``factory(model_runner)`` and read a dozen attributes of the whole ModelRunner.
They now get this frozen view, which answers every attribute docs/plugins.md promised under the same names
(``device``, ``dtype``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``page_size``, ``req_to_token_pool``,
``kv_cache``, ``sliding_window``, ``layer_sliding_windows``, ``context_len``) plus ``kv_dtype`` and
``num_layers``. A backend written against the old form that reads anything else still gets the runner's
attribute, with a DeprecationWarning saying which field to read instead (or that there is none).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from treadle.core.memory.pools import KVCache, ReqToTokenPool

# Runner attributes a backend could read before that the view answers under another name.
_RENAMED = {"max_total_tokens": "kv_cache.size", "kv_pool": "kv_cache"}


@dataclass(frozen=True)
class AttentionContext:
    """The model's attention shape and the KV memory of one GPU (or the CPU), as a backend sees them.

    Under tensor parallelism the head counts and the KV cache are this rank's share. ``sliding_window`` is
    the window every layer shares (None: full attention, or layers that differ); ``layer_sliding_windows``
    is each layer's, in layer order. ``dtype`` is the model's; ``kv_dtype`` the cache's (FP8 caches differ).
    """

    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    context_len: int
    req_to_token_pool: "ReqToTokenPool"
    kv_cache: "KVCache"
    sliding_window: int | None = None
    layer_sliding_windows: tuple[int | None, ...] = ()
    # The runner the view was taken from, for backends that still read other attributes (deprecated).
    _runner: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, model_runner: Any) -> "AttentionContext":
        """The view of a ModelRunner (or of any object with the documented attributes)."""
        kv_cache = model_runner.kv_cache
        windows = tuple(getattr(model_runner, "layer_sliding_windows", ()) or ())
        return cls(
            device=torch.device(model_runner.device),
            dtype=model_runner.dtype,
            kv_dtype=getattr(model_runner, "kv_dtype", None) or kv_cache.dtype,
            num_layers=int(getattr(model_runner, "num_layers", None) or kv_cache.num_layers),
            num_heads=int(model_runner.num_heads),
            num_kv_heads=int(model_runner.num_kv_heads),
            head_dim=int(model_runner.head_dim),
            page_size=int(model_runner.page_size),
            context_len=int(model_runner.context_len),
            req_to_token_pool=model_runner.req_to_token_pool,
            kv_cache=kv_cache,
            sliding_window=getattr(model_runner, "sliding_window", None),
            layer_sliding_windows=windows or (getattr(model_runner, "sliding_window", None),),
            _runner=model_runner,
        )

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not fields: the old `factory(model_runner)` form allowed them.
        runner = self.__dict__.get("_runner")
        if name.startswith("__") or runner is None or not hasattr(runner, name):
            raise AttributeError(f"AttentionContext has no attribute {name!r}; it has: {', '.join(_FIELDS)}")
        instead = _RENAMED.get(name)
        advice = (f"read `{instead}` of the AttentionContext instead" if instead is not None else
                  "the view has no field for it; if a backend needs it, ask for one (docs/plugins.md)")
        warnings.warn(
            f"attention backends get an AttentionContext, not the ModelRunner: reading `{name}` falls back to the "
            f"runner and will stop working in a later release; {advice}", DeprecationWarning, stacklevel=2)
        return getattr(runner, name)


_FIELDS = tuple(f.name for f in fields(AttentionContext) if not f.name.startswith("_"))
