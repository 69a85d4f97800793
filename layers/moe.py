"""Sparse mixture-of-experts blocks a model family reuses: the router, the fused expert weights,
and :class:`SparseMoE` (a drop-in ``mlp`` for :class:`~treadle.layers.decoder.DecoderLayer`).

Expert weights live in two fused tensors, ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj``
``[E, H, I]`` (HF transformers 5's in-memory layout). Checkpoints in that layout load as they are;
the classic one-tensor-per-expert names (Mixtral's ``experts.{e}.w1/w2/w3``, Qwen-MoE's
``experts.{e}.gate_proj/up_proj/down_proj``) go into their slices. With tensor parallelism each
rank holds a slice of every expert's intermediate dimension and the block all-reduces its output.

FP8 checkpoints (``quant_method: fp8``: each expert's ``float8_e4m3fn`` ``weight`` with its ``weight_scale``, one
per tensor or per output row) keep their experts in FP8, with a float32 scale per weight row
(``gate_up_scale`` ``[E, 2I]``, ``down_scale`` ``[E, H]``) that the kernels apply (W8A16); a static
``input_scale`` is read and ignored. ``model.quantization: fp8`` on a 16-bit checkpoint quantizes the experts
once they are loaded, one scale per weight row, as it does the dense layers. Where the device has no FP8 matmuls
(``QuantizationConfig.dequantize``) an FP8 checkpoint's experts are dequantized at load into the model dtype
instead, rounded as a dense FP8 layer's are. Integer checkpoints (GPTQ, AWQ, compressed-tensors) keep their experts
packed (``layers/int_experts.py``: W4A16/W8A16 through the int fused-MoE kernels) where the shapes are whole groups
and there is no act-order; otherwise the experts are dequantized as they load: 16-bit here, or quantized to FP8
once loaded where the device multiplies FP8 (``experts_fp8``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from treadle.core.loading.lazy_weights import lazy_parameter
from treadle.core.distributed.parallel import get_tp_rank, get_tp_size, tp_all_reduce
from treadle.core.loading.quantization import FP8_DTYPE
from treadle.layers.fused_moe import fused_experts, route_top_k
from treadle.layers.int_experts import (
    create_int_expert_params, fused_int_experts, int_experts_fit, leave_int_experts, load_int_expert,
)
from treadle.layers.packed_int import IntWeightScheme, UnpackedWeight, dequantize_unpacked
from treadle.kernels.fp8_ops import dequantize, quantize_per_channel
from treadle.layers.linear import CheckpointError, loaded_shape, narrow_loaded, set_weight_attrs

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Config keys of MoE variants this block does not implement; a config that sets one is refused.
# (Which layers are sparse is the family's choice, e.g. Qwen3-MoE's mlp_only_layers.)
_UNSUPPORTED_MOE_KEYS = {
    "shared_expert_intermediate_size": "shared experts (Qwen2-MoE)",
    "n_shared_experts": "shared experts (DeepSeek)",
    "num_shared_experts": "shared experts",
}

_EXPERT_SHARDS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}
_CANONICAL_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


class SparseMoE(nn.Module):
    """Top-k routed experts: ``gate`` (the router, ``[E, H]``) scores the experts per token, the ``top_k``
    best run their gated MLPs, and their outputs are summed weighted by the (renormalised) softmax scores."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool = True,
        fp8: bool = False, quantize_at_load: bool = False, int_scheme: IntWeightScheme | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({num_experts})")
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        # The router is small and every rank needs all its scores: replicated, never quantized.
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        local = intermediate_size // self.tp_size
        keep_int = int_experts_fit(int_scheme, hidden_size, local)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, self.tp_rank, self.tp_size, fp8=fp8,
                                    lazy=quantize_at_load and not keep_int, int_scheme=int_scheme, keep_int=keep_int)
        if quantize_at_load and not keep_int:
            self.experts.quant_method = _QuantizeExpertsAtLoad()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = route_top_k(self.gate(hidden_states), self.top_k, self.renormalize)
        experts = self.experts
        if experts.int_scheme is not None:
            out = fused_int_experts(hidden_states, experts, topk_weights, topk_ids)
        else:
            out = fused_experts(hidden_states, experts.gate_up_proj, experts.down_proj, topk_weights, topk_ids,
                                experts.gate_up_scale, experts.down_scale)
        return tp_all_reduce(out) if self.tp_size > 1 else out


def sparse_moe_from_config(config: Any, quant_config: Any = None) -> SparseMoE:
    """A :class:`SparseMoE` from an HF config: ``num_local_experts`` (or ``num_experts``), ``num_experts_per_tok``,
    ``moe_intermediate_size`` (or ``intermediate_size``), ``norm_topk_prob`` (default true). With the model's
    ``quant_config``: an FP8 checkpoint's experts stay FP8 (unless the device dequantizes FP8 weights), and
    ``model.quantization: fp8`` quantizes 16-bit experts once loaded.
    Refuses configs asking for MoE features this block lacks (e.g. shared experts), naming them."""
    for key, feature in _UNSUPPORTED_MOE_KEYS.items():
        if getattr(config, key, None):
            raise ValueError(
                f"unsupported MoE feature in the model config: {key}={getattr(config, key)!r} ({feature}); "
                "treadle's SparseMoE supports routed experts only"
            )
    # Another method's quant config (int4/int8 weights): its experts stay packed (layers/int_experts.py) where their
    # shapes allow, else arrive dequantized.
    fp8_config = quant_config if hasattr(quant_config, "checkpoint_quantized") else None
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not num_experts:
        raise ValueError("the model config names no expert count (num_local_experts or num_experts)")
    return SparseMoE(
        hidden_size=config.hidden_size,
        intermediate_size=getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
        num_experts=int(num_experts),
        top_k=int(config.num_experts_per_tok),
        renormalize=bool(getattr(config, "norm_topk_prob", True)),
        fp8=bool(fp8_config is not None and fp8_config.checkpoint_quantized and not fp8_config.dequantize),
        quantize_at_load=bool(fp8_config is not None and not fp8_config.checkpoint_quantized)
        or bool(getattr(quant_config, "experts_fp8", False)),
        int_scheme=getattr(quant_config, "expert_scheme", None),
    )


class FusedExperts(nn.Module):
    """All experts' weights as two tensors: ``gate_up_proj`` ``[E, 2I/tp, H]`` (each expert's gate rows, then
    its up rows) and ``down_proj`` ``[E, H, I/tp]``. Loads fused or per-expert checkpoint tensors itself. With
    ``fp8`` they are FP8, loaded as an FP8 checkpoint stores them, with float32 scales per weight row
    (``gate_up_scale`` ``[E, 2I/tp]``, ``down_scale`` ``[E, H]``); otherwise the scales are None. ``lazy``: the
    16-bit weights take memory only once the checkpoint's first expert tensor arrives (they are quantized at load,
    core/loading/lazy_weights.py)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp_rank: int = 0, tp_size: int = 1,
                 fp8: bool = False, lazy: bool = False, int_scheme: IntWeightScheme | None = None,
                 keep_int: bool = False):
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(
                f"the experts' intermediate size {intermediate_size} is not divisible by parallel.tp_size={tp_size}"
            )
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.local_size = intermediate_size // tp_size
        self.local_start = tp_rank * self.local_size
        self.fp8 = fp8
        weight_dtype = FP8_DTYPE if fp8 else None
        make = lazy_parameter if lazy and not fp8 else _parameter
        self.gate_up_proj = make((num_experts, 2 * self.local_size, hidden_size), weight_dtype)
        self.down_proj = make((num_experts, hidden_size, self.local_size), weight_dtype)
        self.gate_up_scale: nn.Parameter | None = None
        self.down_scale: nn.Parameter | None = None
        if fp8:
            self.gate_up_scale = nn.Parameter(torch.ones(num_experts, 2 * self.local_size), requires_grad=False)
            self.down_scale = nn.Parameter(torch.ones(num_experts, hidden_size), requires_grad=False)
            for param in (self.gate_up_proj, self.down_proj, self.gate_up_scale, self.down_scale):
                set_weight_attrs(param, keep_dtype=True)
        # An integer checkpoint's experts (layers/int_experts.py): kept packed, or dequantized as they load.
        self.checkpoint_scheme, self.int_scheme = int_scheme, None
        if keep_int and int_scheme is not None:
            create_int_expert_params(self, int_scheme)
        # FP8 checkpoints: an expert's weight and its scale may arrive in either order.
        self._fp8_unscaled: set[tuple[int, str]] = set()
        self._fp8_scales: dict[tuple[int, str], torch.Tensor] = {}

    def checkpoint_names(self) -> set[str]:
        kinds = ("weight", "weight_scale") if self.fp8 else ("weight",)
        return {f"{e}.{name}.{kind}" for e in range(self.num_experts) for name in ("w1", "w2", "w3") for kind in kinds}

    def load_checkpoint_tensor(self, name: str, loaded: Any) -> set[str] | None:
        experts = range(self.num_experts)
        inter, hidden, start, local = self.intermediate_size, self.hidden_size, self.local_start, self.local_size
        if self.fp8 and name in ("gate_up_proj", "down_proj"):
            raise CheckpointError("fused expert tensors in an FP8 checkpoint are not supported (per-expert ones are)")
        if name == "gate_up_proj":
            _check_shape(loaded, (self.num_experts, 2 * inter, hidden))
            self._copy(self.gate_up_proj.data[:, :local], narrow_loaded(loaded, 1, start, local))
            self._copy(self.gate_up_proj.data[:, local:], narrow_loaded(loaded, 1, inter + start, local))
            return {f"{e}.{w}.weight" for e in experts for w in ("w1", "w3")}
        if name == "down_proj":
            _check_shape(loaded, (self.num_experts, hidden, inter))
            self._copy(self.down_proj.data, narrow_loaded(loaded, 2, start, local))
            return {f"{e}.w2.weight" for e in experts}
        parts = name.split(".")
        if (len(parts) != 3 or not parts[0].isdigit() or parts[1] not in _EXPERT_SHARDS
                or parts[2] not in ("weight", "weight_scale", "input_scale")):
            return None
        expert, shard = int(parts[0]), _EXPERT_SHARDS[parts[1]]
        if expert >= self.num_experts:
            return None
        if parts[2] == "input_scale":
            return set()  # a static activation scale: the experts run unquantized activations
        if isinstance(loaded, UnpackedWeight):  # an integer checkpoint's expert (PackedIntConfig.checkpoint_stream)
            if self.int_scheme is not None:
                load_int_expert(self, expert, shard, loaded)
                return {f"{expert}.{_CANONICAL_NAMES[shard]}.weight"}
            loaded = dequantize_unpacked(loaded, self.checkpoint_scheme)
        elif self.int_scheme is not None:
            leave_int_experts(self)  # a checkpoint that quantized the rest of the model, not its experts
        if self.fp8:
            return self._load_fp8(expert, shard, parts[2], loaded)
        key = (expert, shard)
        if parts[2] == "weight_scale":
            self._fp8_scales[key] = self._scale_rows(shard, loaded)
        else:
            _check_shape(loaded, (hidden, inter) if shard == "down" else (inter, hidden))
            source = narrow_loaded(loaded, 1 if shard == "down" else 0, start, local)
            self._copy(self._slice(expert, shard), source)  # exact: every FP8 value is one of the model dtype's
            if source.dtype in _FP8_DTYPES:
                self._fp8_unscaled.add(key)
        if key in self._fp8_unscaled and key in self._fp8_scales:
            weight = self._slice(expert, shard)
            self._copy(weight, dequantize(weight, self._fp8_scales.pop(key), weight.dtype))
            self._fp8_unscaled.discard(key)
        if key in self._fp8_unscaled or key in self._fp8_scales:
            return set()  # its other half (weight or scale) is still to come; until then the weight counts as missing
        return {f"{expert}.{_CANONICAL_NAMES[shard]}.weight"}

    def _load_fp8(self, expert: int, shard: str, kind: str, loaded: Any) -> set[str]:
        """An FP8 checkpoint's expert weight, as stored, or its scale, into this rank's rows."""
        name = f"{expert}.{_CANONICAL_NAMES[shard]}.{kind}"
        if kind == "weight_scale":
            scales = self.down_scale if shard == "down" else self.gate_up_scale
            rows = slice(None) if shard == "down" else slice(0, self.local_size) if shard == "gate" else slice(
                self.local_size, None)
            with torch.no_grad():
                scales.data[expert, rows] = self._scale_rows(shard, loaded).reshape(-1)
            return {name}
        _check_shape(loaded, (self.hidden_size, self.intermediate_size) if shard == "down"
                     else (self.intermediate_size, self.hidden_size))
        source = narrow_loaded(loaded, 1 if shard == "down" else 0, self.local_start, self.local_size)
        if source.dtype != FP8_DTYPE:
            raise CheckpointError(f"is {source.dtype}, but the FP8 checkpoint's experts are stored as {FP8_DTYPE}")
        self._copy(self._slice(expert, shard), source)
        return {name}

    def _slice(self, expert: int, shard: str) -> torch.Tensor:
        """This rank's part of one expert's gate, up or down weight."""
        if shard == "down":
            return self.down_proj.data[expert]
        rows = 0 if shard == "gate" else self.local_size
        return self.gate_up_proj.data[expert, rows : rows + self.local_size]

    def _scale_rows(self, shard: str, loaded: Any) -> torch.Tensor:
        """An FP8 weight's scale (a scalar, or one per output row), as it applies to this rank's slice."""
        scale = (loaded if isinstance(loaded, torch.Tensor) else loaded[...]).to(torch.float32)
        out_rows = self.hidden_size if shard == "down" else self.intermediate_size
        if scale.numel() == 1:
            return scale.reshape(())
        if tuple(scale.shape) not in ((out_rows, 1), (out_rows,)):
            raise CheckpointError(f"FP8 weight_scale has shape {tuple(scale.shape)}; expected one value per tensor "
                                  f"or one per output row ({out_rows})")
        scale = scale.reshape(out_rows, 1)
        return scale if shard == "down" else scale[self.local_start : self.local_start + self.local_size]

    @staticmethod
    def _copy(destination: torch.Tensor, source: torch.Tensor) -> None:
        with torch.no_grad():
            destination.copy_(source)


class _QuantizeExpertsAtLoad:
    """``model.quantization: fp8`` for the experts of a 16-bit checkpoint: once every weight is loaded (the model
    loader calls :meth:`process_weights_after_loading` on a module's ``quant_method``), each expert's rows become
    FP8 with one float32 scale per row, as the dense layers are quantized."""

    def process_weights_after_loading(self, experts: FusedExperts) -> None:
        scales = []
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name).data
            quantized = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
            scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
            for expert in range(weight.shape[0]):  # one expert at a time: no float32 copy of them all
                q, s = quantize_per_channel(weight[expert])
                quantized[expert], scale[expert] = q, s.reshape(-1)
            setattr(experts, name, nn.Parameter(quantized, requires_grad=False))
            scales.append(nn.Parameter(scale, requires_grad=False))
        experts.gate_up_scale, experts.down_scale = scales
        experts.fp8 = True


def _parameter(shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def _check_shape(loaded: Any, expected: tuple[int, ...]) -> None:
    shape = loaded_shape(loaded)
    if shape != expected:
        raise CheckpointError(f"has shape {shape} but the model expects {expected}")
