"""The interface of a model family's class: :class:`CausalLM` (required), its optional members, and
:class:`ModelTraits`, which reads those once with their defaults.

A family registers its class under the HF architecture name (``treadle_register_models``); the loader builds
it as ``cls(hf_config)``, or ``cls(hf_config, quant_config=...)`` for quantized weights where the constructor
takes ``quant_config``. Everything else the engine asks of a model is an optional member, read through
:meth:`ModelTraits.of` only, so a model that lacks one gets the default and ``docs/plugins.md`` lists them
all in one table.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from treadle.core.execution.forward_batch import ForwardBatch


@runtime_checkable
class CausalLM(Protocol):
    """What every model must have.

    ``forward`` returns the logits (float32 or the model's dtype) of the rows ``forward_batch.logits_indices``;
    ``load_weights`` takes ``(HF name, tensor or safetensors lazy slice)`` pairs and copies each into its
    parameter. The optional members are :class:`ModelTraits`' fields (and :class:`SplitForwardModel`'s pair).
    """

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None: ...


@runtime_checkable
class SplitForwardModel(Protocol):
    """A model whose forward is ``compute_logits(forward_hidden(input_ids, positions, batch), batch)``: its
    prefills replay piecewise CUDA graphs (core/execution/piecewise_graph.py).

    ``forward_hidden`` may read ``forward_batch`` only through its attention layers (and the current batch
    context) and returns a tensor or a tuple of tensors with one row per token; ``compute_logits`` maps that
    to the logits (float32 or the model's dtype) of the rows ``forward_batch.logits_indices``.
    """

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       forward_batch: "ForwardBatch") -> Any: ...

    def compute_logits(self, hidden: Any, forward_batch: "ForwardBatch") -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelTraits:
    """A model's optional members, each with the default a model without it gets.

    - ``launch_bound_prefill`` (class attribute): its prefill stays bound by kernel launches even at a whole
      chunk; ``runtime.piecewise_cuda_graph_max_tokens: auto`` then captures up to the largest prefill step.
    - ``prefers_mixed_chunks`` (class attribute): its decode steps read the weights a prefill chunk reads (a
      mixture of experts); ``scheduler.enable_mixed_chunk: auto`` is then on on CUDA.
    - ``kv_cache_scales`` (set by ``load_weights``): ``{layer: {"k": scale, "v": scale}}`` found in an FP8
      checkpoint, used by an FP8 KV cache.
    - ``weights_loaded()`` (method): called once every weight is loaded and each layer's quantization method
      has processed it.
    - ``splits_forward``: the model is a :class:`SplitForwardModel` (``forward_hidden`` + ``compute_logits``).
    - ``capture_hidden_states(tap)`` (method): from the next forward on, record the hidden state entering the layers
      ``tap`` (a ``treadle.layers.decoder.HiddenStateTap``) names into it; None stops (an EAGLE-3 speculator reads
      its target's this way).
    - ``compute_hidden_states(hidden, forward_batch)`` (method, with ``forward_hidden``): every row's final hidden
      state (after the final norm) from ``forward_hidden``'s output; what ``model.task: embed`` pools.
    - ``multimodal_positions(prompt_len, items)`` (method): a vision-language model's positions of a prompt with
      images (``[3, prompt_len]`` M-RoPE positions, and the delta a position past the prompt adds); its
      ``forward``/``forward_hidden`` then read ``forward_batch.multimodal`` (core/multimodal/inputs.py).
    - ``drop_lm_head()`` (method): called before the weights load when the model serves embeddings: the output
      head is neither built nor loaded (embedding checkpoints have none).
    """

    launch_bound_prefill: bool = False
    prefers_mixed_chunks: bool = False
    kv_cache_scales: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    weights_loaded: Callable[[], None] | None = None
    splits_forward: bool = False
    capture_hidden_states: Callable[[Any], None] | None = None
    compute_hidden_states: Callable[[Any, "ForwardBatch"], torch.Tensor] | None = None
    drop_lm_head: Callable[[], None] | None = None
    multimodal_positions: Callable[..., Any] | None = None

    @property
    def embeds(self) -> bool:
        """Whether the model can serve embeddings (``forward_hidden`` and ``compute_hidden_states``)."""
        return self.splits_forward and self.compute_hidden_states is not None

    @classmethod
    def of(cls, model: Any) -> "ModelTraits":
        """``model``'s traits, read now (``kv_cache_scales`` is known once its weights are loaded)."""
        finish = getattr(model, "weights_loaded", None)
        return cls(
            launch_bound_prefill=bool(getattr(model, "launch_bound_prefill", cls.launch_bound_prefill)),
            prefers_mixed_chunks=bool(getattr(model, "prefers_mixed_chunks", cls.prefers_mixed_chunks)),
            kv_cache_scales=dict(getattr(model, "kv_cache_scales", None) or {}),
            weights_loaded=finish if callable(finish) else None,
            splits_forward=isinstance(model, SplitForwardModel),
            capture_hidden_states=_method(model, "capture_hidden_states"),
            compute_hidden_states=_method(model, "compute_hidden_states"),
            drop_lm_head=_method(model, "drop_lm_head"),
            multimodal_positions=_method(model, "multimodal_positions"),
        )


def _method(model: Any, name: str) -> Callable[..., Any] | None:
    member = getattr(model, name, None)
    return member if callable(member) else None


def accepts_quant_config(model_cls: Any) -> bool:
    """Whether ``model_cls``'s constructor takes ``quant_config`` (so it can be built with quantized weights)."""
    return "quant_config" in inspect.signature(model_cls).parameters
