"""Tiny quantized checkpoints (GPTQ, AWQ, compressed-tensors) with their dequantized twins, for parity tests.

:func:`make_tiny_quantized` takes a tiny random checkpoint (``testing/models.py``), quantizes every decoder
projection (q/k/v/o, gate/up/down) and saves two folders: the quantized checkpoint, in the format's published layout,
and the same model with each projection replaced by its dequantized weight, which HF transformers can run.

The GPTQ and AWQ tensors are written here from the formats' published descriptions (independently of treadle's
readers in ``plugins/quantization/``):

- GPTQ (AutoGPTQ ``QuantLinear``): ``qweight`` int32 ``[K / p, N]`` (``p = 32 / bits``; input ``i*p + j`` of output
  n in bits ``bits*j`` of word ``[i, n]``), ``qzeros`` int32 ``[G, N / p]`` packed along N holding ``zero - 1``,
  ``scales`` float16 ``[G, N]``, ``g_idx`` int32 ``[K]``; ``desc_act`` numbers the groups in a permuted input order.
- AWQ (AutoAWQ GEMM): ``qweight`` int32 ``[K, N / 8]`` whose 4-bit field i holds output ``8c + [0,2,4,6,1,3,5,7][i]``,
  ``qzeros`` int32 ``[G, N / 8]`` packed likewise, ``scales`` float16 ``[G, N]``.

compressed-tensors checkpoints are written by the ``compressed-tensors`` package itself (its compressors pack the
weights; its ``calculate_qparams`` picks scales and zero points), and dequantized by its ``decompress``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_INPUT_OF = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3,
             "w1": 2, "w3": 2, "w2": 3}


def make_tiny_quantized(path: str | os.PathLike, method: str, make: Callable[..., str] | None = None, *,
                        bits: int = 4, group_size: int = 32, sym: bool = True, act_order: bool = False,
                        fmt: str = "pack-quantized", experts: bool = True, seed: int = 0) -> tuple[str, str]:
    """Save ``make(path / "base")`` (default: a tiny Llama) quantized by ``method`` ("gptq", "awq" or
    "compressed-tensors", whose ``fmt`` is "pack-quantized", "int-quantized" or "float-quantized"); returns the
    folders ``(quantized, dequantized)``. ``experts``: an MoE model's experts (Mixtral's ``w1``/``w2``/``w3``,
    Qwen3-MoE's projections under ``experts``) are quantized too; otherwise they stay 16-bit."""
    from safetensors.torch import load_file, save_file

    from treadle.testing.models import make_tiny_llama

    root = Path(path)
    base = Path((make or make_tiny_llama)(root / "base", seed=seed))
    tensors = load_file(str(base / "model.safetensors"))
    quantized, dequantized = dict(tensors), dict(tensors)
    writer = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors}[method]
    settings: dict[str, Any] = dict(bits=bits, group_size=group_size, sym=sym, act_order=act_order, fmt=fmt)
    quantization_config: dict[str, Any] = {}
    projections = PROJECTIONS + (("w1", "w2", "w3") if experts else ())
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in projections
                 and (experts or ".experts." not in n)]:
        stem = name.removesuffix(".weight")
        del quantized[name]
        # Projections of one input (q/k/v, gate/up) share it, and with it GPTQ's act-order permutation.
        settings["generator"] = torch.Generator().manual_seed(seed + 1 + _INPUT_OF.get(name.split(".")[-2], 0))
        stored, weight, quantization_config = writer(tensors[name].float(), **settings)
        quantized.update({f"{stem}.{key}": value.contiguous() for key, value in stored.items()})
        dequantized[name] = weight.to(tensors[name].dtype).contiguous()
    config = json.loads((base / "config.json").read_text())
    outputs = []
    for folder, state, quant in (("quantized", quantized, quantization_config), ("dequantized", dequantized, None)):
        out = root / folder
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**config, **({"quantization_config": quant} if quant else {})}))
        outputs.append(str(out))
    return outputs[0], outputs[1]


def quantized_tensors(method: str, weight: torch.Tensor, *, bits: int = 4, group_size: int = 32, sym: bool = True,
                      act_order: bool = False, fmt: str = "pack-quantized", seed: int = 0
                      ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, Any]]:
    """One layer's ``weight`` [N, K] quantized by ``method``: ``(its checkpoint tensors by name, the dequantized
    weight, the checkpoint's quantization_config)``."""
    writer = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors}[method]
    return writer(weight.float(), bits=bits, group_size=group_size, sym=sym, act_order=act_order, fmt=fmt,
                  generator=torch.Generator().manual_seed(seed))


def quantize_groups(weight: torch.Tensor, groups: torch.Tensor, bits: int, sym: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round ``weight`` [N, K] to ``bits``-bit unsigned values with one float16 scale and zero per output row and
    group (``groups[k]``: input k's group): returns ``(values [N, K], scales [N, G], zeros [N, G])``."""
    top = (1 << bits) - 1
    count = int(groups.max()) + 1
    index = groups.expand_as(weight)
    low = torch.zeros(weight.shape[0], count).scatter_reduce(1, index, weight, "amin", include_self=False)
    high = torch.zeros(weight.shape[0], count).scatter_reduce(1, index, weight, "amax", include_self=False)
    if sym:
        scales = (torch.maximum(high.abs(), low.abs()) / (top // 2)).clamp(min=1e-6).half().float()
        zeros = torch.full_like(scales, float((top + 1) // 2))
    else:
        low, high = low.clamp(max=0), high.clamp(min=0)
        scales = ((high - low) / top).clamp(min=1e-6).half().float()
        zeros = (-low / scales).round().clamp(0, top)
    values = (weight / scales.gather(1, index)).round() + zeros.gather(1, index)
    return values.clamp(0, top).to(torch.int64), scales, zeros


def _pack(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Unsigned ``values`` [R, C] packed along C into int32, lowest bits first (field i holds column
    ``order[i]`` of its word's columns)."""
    per_word = 32 // bits
    rows, cols = values.shape
    fields = values.view(rows, cols // per_word, per_word)
    if order is not None:
        fields = fields[:, :, list(order)]
    words = torch.zeros(rows, cols // per_word, dtype=torch.int64)
    for i in range(per_word):
        words |= fields[:, :, i] << (bits * i)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _gptq(weight: torch.Tensor, bits: int, group_size: int, sym: bool, act_order: bool, generator: torch.Generator,
          **_: Any) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, Any]]:
    columns = weight.shape[1]
    order = torch.randperm(columns, generator=generator) if act_order else torch.arange(columns)
    g_idx = torch.empty(columns, dtype=torch.int64)
    g_idx[order] = torch.arange(columns) // group_size
    values, scales, zeros = quantize_groups(weight, g_idx, bits, sym)
    stored = {
        "qweight": _pack_input_rows(values.t().contiguous(), bits),
        # Stored minus one, in `bits` bits: a zero point of 0 wraps around and reads back as 2**bits (a quirk of
        # the format that readers reproduce), so the dequantized weight below uses what the format means.
        "qzeros": _pack((zeros.t().to(torch.int64) - 1) & ((1 << bits) - 1), bits),
        "scales": scales.t().half(),
        "g_idx": g_idx.to(torch.int32),
    }
    zeros = ((zeros.to(torch.int64) - 1) & ((1 << bits) - 1)) + 1
    dequantized = (values - zeros[:, g_idx]) * scales[:, g_idx]
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": sym,
              "checkpoint_format": "gptq"}
    return stored, dequantized, config


def _pack_input_rows(values_k_by_n: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight: [K, N] values packed along K (rows) into [K / p, N]."""
    return _pack(values_k_by_n.t().contiguous(), bits).t()


def _awq(weight: torch.Tensor, group_size: int, generator: torch.Generator, **_: Any
         ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, Any]]:
    groups = torch.arange(weight.shape[1]) // group_size
    values, scales, zeros = quantize_groups(weight, groups, 4, sym=False)
    stored = {
        "qweight": _pack(values.t().contiguous(), 4, AWQ_ORDER),
        "qzeros": _pack(zeros.t().contiguous().to(torch.int64), 4, AWQ_ORDER),
        "scales": scales.t().half(),
    }
    dequantized = (values - zeros[:, groups]) * scales[:, groups]
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    return stored, dequantized, config


def _compressed_tensors(weight: torch.Tensor, bits: int, group_size: int, sym: bool, fmt: str, **_: Any
                        ) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, Any]]:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    if fmt == "float-quantized":
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
        inputs = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)
        low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    else:
        strategy = "group" if group_size > 0 else "channel"
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy,
                                group_size=group_size if group_size > 0 else None)
        inputs = None
        shaped = weight.view(weight.shape[0], -1, group_size) if group_size > 0 else weight.unsqueeze(1)
        low, high = shaped.amin(-1), shaped.amax(-1)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=inputs)
    scale, zero_point = calculate_qparams(low, high, args)
    state = {"weight": weight, "weight_scale": scale}
    if not sym:
        state["weight_zero_point"] = zero_point
    compressor = BaseCompressor.load_from_registry(fmt)
    stored = compressor.compress(state, scheme)
    dequantized = compressor.decompress(dict(stored), scheme)["weight"]
    config = {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
              "quantization_status": "compressed",
              "config_groups": {"group_0": scheme.model_dump(exclude_none=True)}}
    return stored, dequantized.float(), config
