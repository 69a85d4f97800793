"""Whether a benchmark's model fits this machine, checked before anything is built.

A dense decoder's weights are counted from its HF ``config.json`` (embedding, attention and
MLP projections, norms, the output head unless tied), its KV cache from the slots the run
reserves; they are compared with the memory free on the device (the GPU's free memory, or
the host's available memory on the CPU). A run that cannot fit is refused with what it needs,
what is there and what to change, instead of being killed by the kernel a minute later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GIB = 1 << 30


class DoesNotFit(SystemExit):
    """The run's model cannot be held here; the message says what it needs and what would run."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes one run holds at once, by what holds them."""

    weights: int
    kv_cache: int
    peer_copy: int  # a second copy of the weights (HF transformers' model, loaded from treadle's)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.peer_copy


def dense_parameter_count(hf: dict[str, Any]) -> int:
    """Parameters of a dense or mixture-of-experts decoder described by ``hf`` (an HF ``config.json`` as a dict)."""
    return sum(parameter_counts(hf))


def parameter_counts(hf: dict[str, Any]) -> tuple[int, int]:
    """(the decoder layers' projections, everything else: embedding, output head, norms) of ``hf``'s model."""
    hidden, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o, k and v
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 1
    intermediate = hf.get("moe_intermediate_size") if experts > 1 and hf.get("moe_intermediate_size") else \
        hf["intermediate_size"]
    mlp = 3 * hidden * intermediate * experts
    head = 0 if hf.get("tie_word_embeddings") else vocab * hidden
    return layers * (attention + mlp), vocab * hidden + head + (2 * layers + 1) * hidden


def kv_cache_bytes(hf: dict[str, Any], slots: int, dtype_bytes: int) -> int:
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return 2 * hf["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes * slots


def memory_need(hf: dict[str, Any], dtype: str, kv_slots: int, tp_size: int = 1, with_peer: bool = False,
                fp8: bool = False) -> MemoryNeed:
    """What one rank of a ``tp_size`` group holds: its share of the weights and KV, and a peer's copy.
    ``fp8`` (or an FP8 checkpoint): the layers' projections take one byte a parameter (quantized as they load);
    an integer checkpoint's (GPTQ, AWQ, compressed-tensors), their packed bits plus their group scales and zeros."""
    size = DTYPE_BYTES[dtype]
    projections, rest = parameter_counts(hf)
    per_parameter = 1.0 if fp8 else projection_bytes(hf.get("quantization_config") or {}, size)
    weights = (int(projections * per_parameter) + rest * size) // tp_size
    return MemoryNeed(weights, kv_cache_bytes(hf, kv_slots, size) // tp_size, weights if with_peer else 0)


def projection_bytes(quantization: dict[str, Any], size: int) -> float:
    """Bytes per parameter of the projections a checkpoint's ``quantization_config`` stores (``size``: 16-bit)."""
    method = quantization.get("quant_method")
    if method == "fp8":
        return 1.0
    if method in ("gptq", "awq"):
        bits, group = quantization.get("bits", 4), quantization.get("group_size", 128)
        zeros = method == "awq" and quantization.get("zero_point", True) or method == "gptq" and \
            not quantization.get("sym", True)
    elif method == "compressed-tensors":
        weights = next(iter((quantization.get("config_groups") or {}).values()), {}).get("weights") or {}
        if weights.get("type") == "float":
            return 1.0
        bits, group, zeros = weights.get("num_bits", 8), weights.get("group_size"), not weights.get("symmetric", True)
    else:
        return float(size)
    per_group = size * (2 if zeros else 1) / group if group and group > 0 else 0.0
    return bits / 8 + per_group


def available_bytes(device: torch.device) -> int:
    """Free GPU memory on a CUDA device; the host's available memory (``MemAvailable``) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def read_hf_config(model_dir: str) -> dict[str, Any] | None:
    """``model_dir``'s ``config.json``, or None where there is none to read (a hub id, say)."""
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def check_fits(need: MemoryNeed, device: torch.device, what: str, smaller: str) -> None:
    """Raise :class:`DoesNotFit` when ``need`` exceeds the memory free on ``device``; ``smaller`` says what runs."""
    free = available_bytes(device)
    if need.total <= free:
        return
    parts = f"{need.weights / GIB:.1f} GiB of weights, {need.kv_cache / GIB:.1f} GiB of KV cache"
    if need.peer_copy:
        parts += f", {need.peer_copy / GIB:.1f} GiB for HF transformers' copy"
    where = "free on the GPU" if device.type == "cuda" else "available on this machine"
    raise DoesNotFit(f"{what} needs about {need.total / GIB:.1f} GiB ({parts}) but {free / GIB:.1f} GiB is {where}; "
                     f"{smaller}")
