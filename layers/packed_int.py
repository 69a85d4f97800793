"""Integer weights with group scales (W4A16, W8A16): the layer side of the ``gptq``, ``awq`` and
``compressed-tensors`` quantization methods.

Each checkpoint format declares its tensors (:class:`CheckpointTensor`: name, shape, which dimension holds the
output and input features and how many values share one stored element there) and how to read them into one
layout, :class:`UnpackedWeight`; once loaded, :class:`PackedIntLinearMethod` repacks that into what the kernels
read (``kernels/packed_int.py``), whatever the format:

- ``weight``: int32 ``[N, K * bits / 32]``, the unsigned values ``u`` of each row packed along K, lowest bits first,
  in panels of 16 words (:func:`pack_panels`): value slot ``j`` (bits ``bits * j`` up) of a panel's word ``c`` holds
  the panel's element ``16 * j + c``, so one slot of a panel's words meets 16 contiguous activations (``panels``
  True; a K that is not whole panels packs plainly, element ``k`` in word ``k // (32 / bits)``, and runs the torch
  path);
- ``weight_scales``: ``[N, groups]`` in the model dtype; ``weight_zeros``: ``[N, groups]`` (the unsigned zero
  point) or None for symmetric weights, whose zero is ``2**(bits - 1)``;
- act-order (GPTQ ``desc_act``): the input columns are sorted by group once (``input_perm``, applied to ``x``) and
  ``g_idx`` gives each sorted column's group.

So ``w[n, k] = (u[n, k] - zero[n, g(k)]) * scale[n, g(k)]``. On the CPU (and for batches no kernel takes) the layer
multiplies by that dequantized weight (torch reference code); on a GPU, Triton kernels read the packed weight.

Tensor parallelism: column-parallel layers take their output rows of every tensor (a packed dimension in whole
words), row-parallel ones their input columns (in whole groups; with act-order every rank keeps all groups' scales
and its own columns' ``g_idx``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from treadle.core.loading.quantization import QuantizationError, fp8_matmul_unsupported
from treadle.layers.int_kernel_choice import int_kernel_plan, reserve_dequant_buffer
from treadle.layers.linear import CheckpointError, loaded_shape, narrow_loaded
from treadle.layers.linear_method import LinearMethod, set_weight_attrs

if TYPE_CHECKING:
    from treadle.layers.linear import LinearBase


# Words per panel of the kernels' layout (:func:`pack_panels`; kernels/packed_int.py reads the same).
PANEL_WORDS = 16


@dataclass(frozen=True)
class IntWeightScheme:
    """How one checkpoint's linear weights are quantized: ``bits`` (4 or 8), ``group_size`` (-1: one group per
    row), ``act_order`` (GPTQ's ``desc_act``: ``g_idx`` orders the groups)."""

    bits: int
    group_size: int
    act_order: bool = False

    def group_layout(self, in_features: int, in_full: int, row_parallel: bool, dim: int) -> tuple[int, int | None]:
        """How many groups this rank's scales hold and the dimension that splits them with the input (``dim``):
        with act-order a row-parallel rank's inputs may come from any group, so it keeps every group's scales."""
        group = self.group(in_full)
        return (in_full // group, None) if self.act_order and row_parallel else (in_features // group, dim)

    def group(self, in_features: int) -> int:
        return in_features if self.group_size in (-1, 0) else self.group_size


@dataclass(frozen=True)
class CheckpointTensor:
    """One checkpoint tensor of a quantized layer, as this rank stores it: ``shape``; ``out_dim`` the dimension of
    output features (None: not split by output) with ``out_per`` features per stored element; likewise ``in_dim``
    and ``in_per`` for the input features (``in_dim`` None: row-parallel ranks keep it whole)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dim: int | None
    out_per: int = 1
    in_dim: int | None = None
    in_per: int = 1


@dataclass
class UnpackedWeight:
    """A layer's weight read from its checkpoint tensors: unsigned values ``u`` [N, K] (int32), ``scales`` [N, G],
    ``zeros`` [N, G] (unsigned zero points; None: symmetric), ``g_idx`` [K] (None: column k is in group
    k // group_size)."""

    values: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None = None


class PackedIntFormat:
    """A checkpoint layout of integer weights: its tensors and how to read them (see the module docstring)."""

    def __init__(self, scheme: IntWeightScheme) -> None:
        if scheme.bits not in (4, 8):
            raise QuantizationError(f"{scheme.bits}-bit weights are not supported; treadle runs 4-bit and 8-bit")
        self.scheme = scheme

    def tensors(self, out_features: int, in_features: int, in_full: int, row_parallel: bool
                ) -> list[CheckpointTensor]:
        """This rank's tensors for a layer of ``out_features`` x ``in_features`` (``in_full`` before splitting)."""
        raise NotImplementedError

    def unpack(self, stored: dict[str, torch.Tensor], out_features: int, in_features: int) -> UnpackedWeight:
        """The loaded tensors (by name) as an :class:`UnpackedWeight`."""
        raise NotImplementedError


class PackedIntConfig:
    """The quant_config of a model with integer weights: each linear layer not in ``ignored`` (module names, or
    ``re:`` regular expressions, as compressed-tensors writes them) gets a :class:`PackedIntLinearMethod` reading
    ``fmt``; ``method`` names the quantization method for messages. MoE experts arrive as each expert's
    :class:`UnpackedWeight` (:meth:`checkpoint_stream`): the fused experts keep them packed (``expert_scheme``,
    ``layers/int_experts.py``) where their shapes allow, else dequantize them, and then, on a ``device`` with FP8
    matmuls (a GPU of compute capability 8.9+), quantize them to FP8 as each layer loads (``experts_fp8``).
    Act-order experts (a permutation of the input per expert) are always dequantized.

    ``lm_head`` (``model.quantize_lm_head``, :func:`fp8_lm_head`) and ``lm_head_exact_top`` ask the model's
    ``ParallelLMHead`` for an FP8 head as an FP8 checkpoint's: at one token per step a 16-bit head is a fifth of what
    a W4A16 Llama-3.1-8B reads (1.05 of 5.3 GB), and its best logits per row recomputed from the 16-bit weight keep
    greedy tokens exact."""

    def __init__(self, method: str, fmt: PackedIntFormat, ignored: tuple[str, ...] = (),
                 device: torch.device | None = None, lm_head: bool | str = False, lm_head_exact_top: int = 0) -> None:
        self.method, self.fmt, self.ignored = method, fmt, ignored
        self.experts_fp8 = device is not None and experts_in_fp8(device)
        self.expert_scheme = None if fmt.scheme.act_order else fmt.scheme
        self.lm_head = fp8_lm_head(lm_head, device)
        self.lm_head_exact_top = lm_head_exact_top

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if prefix and is_listed(prefix, self.ignored):
            return None
        return PackedIntLinearMethod(self.fmt)

    def checkpoint_stream(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``weights`` with each MoE expert's quantized tensors (names under ``.experts.``) replaced, once all of
        them have arrived, by ``<expert>.weight``: its :class:`UnpackedWeight`, which the fused experts keep packed
        or dequantize (``layers/int_experts.py``)."""
        names = {spec.name for spec in self.fmt.tensors(256, 256, 256, False)}
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, loaded in weights:
            stem, _, kind = name.rpartition(".")
            if ".experts." not in name or kind not in names:
                yield name, loaded
                continue
            parts = pending.setdefault(stem, {})
            parts[kind] = loaded if isinstance(loaded, torch.Tensor) else loaded[...]
            if len(parts) == len(names):
                yield f"{stem}.weight", self.fmt.unpack(pending.pop(stem), 0, 0)
        if pending:
            stem, parts = next(iter(pending.items()))
            raise CheckpointError(f"expert tensors missing from the checkpoint: {stem} has only {sorted(parts)}; "
                                  f"a {self.method} expert needs {sorted(names)}")


def experts_in_fp8(device: torch.device) -> bool:
    """Whether dequantized MoE experts are quantized to FP8 on ``device``: GPUs with FP8 matmuls (on the CPU they
    stay 16-bit, as the parity tests want them)."""
    return device.type == "cuda" and fp8_matmul_unsupported(device) is None


def fp8_lm_head(requested: bool | str, device: torch.device | None) -> bool | str:
    """An integer model's ``lm_head`` setting for ``model.quantize_lm_head`` = ``requested``: ``"auto"`` (FP8 where
    the head's shape allows) on GPUs with FP8 matmuls (on the CPU the head stays 16-bit, as the parity tests want
    it), True where asked and the device multiplies FP8, else False."""
    if requested is False or device is None:
        return False
    reason = fp8_matmul_unsupported(device)
    if requested is True:
        if reason is not None:
            raise QuantizationError(f"model.quantize_lm_head: true needs FP8 matmuls and this device {reason}; "
                                    "set it to auto or false")
        return True
    return "auto" if reason is None and torch.device(device).type == "cuda" else False


def is_listed(prefix: str, names: tuple[str, ...]) -> bool:
    """Whether the layer ``prefix`` (or, for a merged layer, its first part) is named in ``names``."""
    parent, _, name = prefix.rpartition(".")
    first = {"qkv_proj": "q_proj", "gate_up_proj": "gate_proj"}.get(name)
    candidates = [prefix] + ([f"{parent}.{first}" if parent else first] if first else [])
    for entry in names:
        if entry.startswith("re:"):
            if any(re.match(entry[3:], candidate) for candidate in candidates):
                return True
        elif entry in candidates or any(candidate.endswith("." + entry) for candidate in candidates):
            return True
    return False


class PackedIntLinearMethod(LinearMethod):
    """Integer weights read from a checkpoint ``fmt`` and repacked once loaded (see the module docstring)."""

    def __init__(self, fmt: PackedIntFormat) -> None:
        self.fmt = fmt
        self.scheme = fmt.scheme

    def create_weights(
        self, layer: "LinearBase", input_size_per_partition: int, output_partition_sizes: list[int],
        input_size: int, output_size: int, params_dtype: torch.dtype,
    ) -> None:
        out_features = sum(output_partition_sizes)
        group = self.scheme.group(input_size)
        if input_size % group or (not layer.splits_output and input_size_per_partition % group
                                  and not self.scheme.act_order):
            raise QuantizationError(f"{type(layer).__name__} with {input_size} inputs ({input_size_per_partition} on "
                                    f"this rank) does not split into whole groups of {group}")
        layer.register_parameter("weight", None)
        layer.int_out_dtype = params_dtype
        layer.checkpoint_tensors = self.fmt.tensors(out_features, input_size_per_partition, input_size,
                                                    not layer.splits_output)
        for spec in layer.checkpoint_tensors:
            param = nn.Parameter(torch.empty(spec.shape, dtype=spec.dtype), requires_grad=False)
            set_weight_attrs(param, weight_loader=_sharded_loader(layer, spec), dummy_fills_rank=True,
                             keep_dtype=not spec.dtype.is_floating_point)
            layer.register_parameter(spec.name, param)

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        stored = {spec.name: getattr(layer, spec.name).data for spec in layer.checkpoint_tensors}
        in_features = stored_in_features(layer)
        unpacked = self.fmt.unpack(stored, _out_features(layer), in_features)
        for spec in layer.checkpoint_tensors:
            delattr(layer, spec.name)
        repack_into(layer, unpacked, self.scheme, layer.int_out_dtype)

    def apply(self, layer: "LinearBase", x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        leading = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if layer.input_perm is not None:
            x2 = x2.index_select(1, layer.input_perm)
        plan = layer.int_kernels
        if plan is not None:
            y = plan.run(x2 if x2.stride(-1) == 1 else x2.contiguous(), layer.weight, layer.weight_scales,
                         layer.weight_zeros, layer.g_idx, _prefetch(layer), getattr(layer, "dequant_buffer", None))
        else:
            y = F.linear(x2, dequantize_layer(layer).to(x.dtype))
        if bias is not None:
            y = y + bias
        return y.reshape(*leading, y.shape[-1])

    def apply_silu_mul(self, layer: "LinearBase", x: torch.Tensor) -> torch.Tensor | None:
        plan = layer.int_kernels
        if plan is None or x.dim() != 2 or layer.input_perm is not None or x.stride(-1) != 1:
            return None
        return plan.run_silu_mul(x, layer.weight, layer.weight_scales, layer.weight_zeros, _prefetch(layer))

    def apply_add_rmsnorm(self, layer: "LinearBase", x: torch.Tensor, residual: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.fuses_add_rmsnorm(layer, x):
            return None
        return layer.int_kernels.run_add_rmsnorm(x, layer.weight, layer.weight_scales, layer.weight_zeros,
                                                 residual, norm_weight, eps, _prefetch(layer))

    def fuses_add_rmsnorm(self, layer: "LinearBase", x: torch.Tensor) -> bool:
        # One token through the GEMV: the layer's weights need no input permutation or per-column groups.
        return (layer.int_kernels is not None and x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1
                and layer.input_perm is None and layer.g_idx is None)


def _prefetch(layer: nn.Module) -> torch.Tensor | None:
    """The head of the weight the model reads after this layer's (``small_batch.chain_l2_prefetch``), which the
    GEMV's and ``magic_mma``'s last programs ask L2 for; None: nothing to prefetch."""
    return getattr(layer, "l2_prefetch", None)


def stored_in_features(layer: "LinearBase") -> int:
    """This rank's input features."""
    return layer.input_size_per_partition if not layer.splits_output else layer.input_size


def _out_features(layer: "LinearBase") -> int:
    return layer.output_size_per_partition if layer.splits_output else layer.output_size


def repack_into(layer: nn.Module, unpacked: UnpackedWeight, scheme: IntWeightScheme, dtype: torch.dtype) -> None:
    """Store ``unpacked`` on ``layer`` in the kernels' layout (``weight``, ``weight_scales``, ``weight_zeros``,
    ``input_perm``, ``g_idx``, ``bits``, ``group_size``) and pick its GPU kernels."""
    values, g_idx = unpacked.values, unpacked.g_idx
    in_features = values.shape[1]
    group = scheme.group(layer.in_features)
    layer.input_perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if torch.equal(g_idx, torch.arange(in_features, device=g_idx.device) // group):
            g_idx = None  # act-order in name only: the groups are in order
        else:
            layer.input_perm = torch.argsort(g_idx, stable=True)
            g_idx = g_idx[layer.input_perm]
            values = values[:, layer.input_perm]
            layer.input_perm = layer.input_perm.to(torch.int32 if values.is_cuda else torch.int64)
            if torch.equal(g_idx, torch.arange(in_features, device=g_idx.device) // group):
                g_idx = None  # GPTQ's act-order: sorted, every group is whole, so the kernels need no g_idx
    if unpacked.values.max() >= 1 << scheme.bits or unpacked.values.min() < 0:
        raise QuantizationError(f"{type(layer).__name__}: stored values do not fit {scheme.bits} bits")
    layer.bits, layer.group_size = scheme.bits, group
    layer.panels = in_features % (PANEL_WORDS * 32 // scheme.bits) == 0
    packed = pack_panels(values, scheme.bits) if layer.panels else pack_rows(values, scheme.bits)
    layer.weight = nn.Parameter(packed, requires_grad=False)
    zeros = unpacked.zeros
    if zeros is not None and bool((zeros == 1 << (scheme.bits - 1)).all()):
        zeros = None  # symmetric after all: the kernels use the midpoint
    # Parameters, so that what a decode step reads (the roofline of bench/one_batch.py) counts them.
    layer.weight_scales = nn.Parameter(unpacked.scales.to(dtype).contiguous(), requires_grad=False)
    layer.weight_zeros = None if zeros is None else nn.Parameter(zeros.to(dtype).contiguous(), requires_grad=False)
    layer.g_idx = None if g_idx is None else nn.Parameter(g_idx.to(torch.int32).contiguous(), requires_grad=False)
    layer.int_kernels = int_kernel_plan(layer)
    layer.dequant_buffer = reserve_dequant_buffer(layer)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``values`` [N, K] (each below ``2**bits``) packed along K into int32 words, lowest bits first."""
    per_word = 32 // bits
    rows, cols = values.shape
    if cols % per_word:
        raise QuantizationError(f"{cols} input features do not pack into whole 32-bit words of {bits}-bit values")
    shifts = torch.arange(per_word, device=values.device, dtype=torch.int64) * bits
    words = (values.to(torch.int64).view(rows, cols // per_word, per_word) << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).contiguous()


def pack_panels(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``values`` [N, K] packed for the kernels: each row in panels of ``PANEL_WORDS`` int32 words whose
    value slot ``j`` of word ``c`` holds the panel's element ``PANEL_WORDS * j + c`` (K a multiple of the panel)."""
    rows, cols = values.shape
    per_word = 32 // bits
    panels = values.reshape(rows, cols // (PANEL_WORDS * per_word), per_word, PANEL_WORDS).transpose(-1, -2)
    return pack_rows(panels.reshape(rows, cols), bits)


def unpack_panels(words: torch.Tensor, bits: int) -> torch.Tensor:
    """The values [N, K] (int32) of :func:`pack_panels`' ``words``."""
    values = unpack_last(words, bits)
    rows, cols = values.shape
    per_word = 32 // bits
    panels = values.reshape(rows, cols // (PANEL_WORDS * per_word), PANEL_WORDS, per_word).transpose(-1, -2)
    return panels.reshape(rows, cols)


def unpack_last(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``words`` [..., C] unpacked along the last dimension, lowest bits first: [..., C * 32 / bits] (int32)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=words.device, dtype=torch.int32) * bits
    values = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*words.shape[:-1], words.shape[-1] * per_word)


def dequantize_unpacked(unpacked: UnpackedWeight, scheme: IntWeightScheme) -> torch.Tensor:
    """``unpacked``'s weight [N, K] in float32."""
    values = unpacked.values.to(torch.float32)
    columns = values.shape[1]
    groups = (unpacked.g_idx.to(torch.int64) if unpacked.g_idx is not None
              else torch.arange(columns, device=values.device) // scheme.group(columns))
    zeros = (float(1 << (scheme.bits - 1)) if unpacked.zeros is None
             else unpacked.zeros.to(torch.float32).index_select(1, groups))
    return (values - zeros) * unpacked.scales.to(torch.float32).index_select(1, groups)


def dequantize_layer(layer: nn.Module) -> torch.Tensor:
    """The layer's weight [N, K] in float32, its columns in the (sorted) order its kernels see them."""
    unpack = unpack_panels if getattr(layer, "panels", False) else unpack_last
    values = unpack(layer.weight.data, layer.bits).to(torch.float32)
    columns = values.shape[1]
    groups = (layer.g_idx.to(torch.int64) if layer.g_idx is not None
              else torch.arange(columns, device=values.device) // layer.group_size)
    scales = layer.weight_scales.to(torch.float32).index_select(1, groups)
    zeros = (float(1 << (layer.bits - 1)) if layer.weight_zeros is None
             else layer.weight_zeros.to(torch.float32).index_select(1, groups))
    return (values - zeros) * scales


def _sharded_loader(layer: "LinearBase", spec: CheckpointTensor) -> Callable[..., None]:
    """Copies this rank's part of a full checkpoint tensor (or a merged layer's part) into the parameter."""
    def load(param: nn.Parameter, loaded: Any, shard_id: str | None = None) -> None:
        expected = list(param.shape)
        source, dest = loaded, param.data
        if layer.splits_output and spec.out_dim is not None:
            offset, rows = layer.shards[shard_id] if shard_id is not None else (0, layer.output_size_per_partition)
            full = layer.full_sizes[shard_id] if shard_id is not None else layer.output_size
            start = layer._source_row(shard_id, rows) if shard_id is not None else layer.tp_rank * rows
            expected[spec.out_dim] = full // spec.out_per
            if rows % spec.out_per or offset % spec.out_per:
                raise QuantizationError(f"{rows} output rows of a {type(layer).__name__} part do not split into "
                                        f"whole packed elements of {spec.out_per}")
            dest = dest.narrow(spec.out_dim, offset // spec.out_per, rows // spec.out_per)
            _check(loaded, expected)
            source = narrow_loaded(loaded, spec.out_dim, start // spec.out_per, rows // spec.out_per)
        elif not layer.splits_output and spec.in_dim is not None and layer.tp_size > 1:
            cols = layer.input_size_per_partition // spec.in_per
            expected[spec.in_dim] = layer.input_size // spec.in_per
            _check(loaded, expected)
            source = narrow_loaded(loaded, spec.in_dim, layer.tp_rank * cols, cols)
        else:
            _check(loaded, expected)
        source = source if isinstance(source, torch.Tensor) else source[...]
        if spec.out_dim is None and spec.in_dim is not None and shard_id is not None:
            _check_same_for_every_part(layer, spec.name, shard_id, dest, source)
        with torch.no_grad():
            dest.copy_(source.to(dest.dtype) if source.dtype != dest.dtype else source)

    return load


def _check_same_for_every_part(layer: "LinearBase", name: str, shard_id: str, dest: torch.Tensor,
                               source: torch.Tensor) -> None:
    """The parts of a merged layer share their input, so a per-input tensor (``g_idx``) must be the same for all."""
    loaded = layer.__dict__.setdefault("_per_input_loaded", set())
    if name in loaded and not torch.equal(dest, source.to(dest.device, dest.dtype)):
        raise QuantizationError(f"{shard_id}.{name} differs from the other parts of its merged layer "
                                f"({', '.join(layer.shard_ids)}); treadle needs one {name} per input")
    loaded.add(name)


def _check(loaded: Any, expected: list[int]) -> None:
    shape = loaded_shape(loaded)
    if shape != tuple(expected):
        raise CheckpointError(f"has shape {shape} but the model expects {tuple(expected)}")
