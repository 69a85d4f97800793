"""Reading one LoRA adapter in the PEFT layout: ``adapter_config.json`` beside ``adapter_model.safetensors``.

An adapter changes some of a decoder's linear projections (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj``, HF names): projection ``W`` of a layer becomes ``W + s * B A`` with ``A``
``[r, in]``, ``B`` ``[out, r]`` and ``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``; PEFT's
``rank_pattern`` and ``alpha_pattern`` may change ``r`` and ``lora_alpha`` per module). What this engine cannot
serve is refused with an error naming the folder and what was wrong: token embeddings and the output head
(``embed_tokens``, ``lm_head``), any other module, DoRA, trained biases, ``modules_to_save``, a rank above
``lora.max_rank``, a module or shape the model does not have, missing files.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_RANK = 256
_REFUSED_MODULES = ("embed_tokens", "lm_head")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<side>A|B)(?:\.[^.]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter folder this engine cannot serve; the message names the folder and what was wrong."""


@dataclass(frozen=True)
class LoRAModule:
    """One projection's change: ``s * B @ A`` with ``a`` ``[r, in]`` and ``b`` ``[out, r]`` (host tensors)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class LoRAAdapter:
    """A loaded adapter: its projections by HF module name (``model.layers.0.self_attn.q_proj``)."""

    name: str
    path: str
    modules: dict[str, LoRAModule] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def read_adapter_rank(path: str | Path) -> int:
    """The largest rank an adapter folder declares (``r`` and ``rank_pattern``), from its config alone."""
    config = _read_config(Path(path))
    ranks = [int(config.get("r") or 0), *(int(r) for r in (config.get("rank_pattern") or {}).values())]
    return max(ranks)


def load_adapter(name: str, path: str | Path, max_rank: int, model_shapes: Mapping[str, tuple[int, int]],
                 dtype: torch.dtype) -> LoRAAdapter:
    """Read and check the adapter at ``path``. ``model_shapes`` maps every HF projection name the model has to
    its full ``(out_features, in_features)``; the tensors are returned in ``dtype`` on the CPU."""
    folder = Path(path)
    config = _read_config(folder)
    _check_config(folder, config, max_rank)
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {folder}: {WEIGHTS_FILE} is missing (a PEFT adapter folder holds "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE}; .bin weights are not read)")
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise LoRAAdapterError(f"LoRA adapter {folder}: cannot read {WEIGHTS_FILE}: {exc}") from None
    pairs = _pair_tensors(folder, tensors)
    adapter = LoRAAdapter(name, str(folder))
    for module, (a, b) in sorted(pairs.items()):
        _check_module(folder, module, a, b, max_rank, model_shapes)
        rank, alpha = _rank_and_alpha(config, module, a.shape[0])
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        adapter.modules[module] = LoRAModule(a.to(dtype).contiguous(), b.to(dtype).contiguous(), float(scale))
    if not adapter.modules:
        raise LoRAAdapterError(f"LoRA adapter {folder}: {WEIGHTS_FILE} holds no lora_A/lora_B weights")
    return adapter


# ------------------------------------------------------------------ checks


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter folder {folder} does not exist")
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {folder}: {CONFIG_FILE} is missing (a PEFT adapter folder holds "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"LoRA adapter {folder}: cannot read {CONFIG_FILE}: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {folder}: {CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(folder: Path, config: dict[str, Any], max_rank: int) -> None:
    where = f"LoRA adapter {folder}"
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type is {config.get('peft_type')!r}; only LORA adapters are served")
    if config.get("use_dora"):
        raise LoRAAdapterError(f"{where}: DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(f"{where}: modules_to_save {config['modules_to_save']} is not supported (only "
                               f"LoRA changes of {', '.join(PROJECTIONS)})")
    if config.get("bias", "none") not in ("none", None):
        raise LoRAAdapterError(f"{where}: bias {config['bias']!r} is not supported (only bias 'none')")
    targets = config.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    for name in names:
        if name in _REFUSED_MODULES:
            raise LoRAAdapterError(f"{where}: target module {name!r} is not supported; adapters may change "
                                   f"{', '.join(PROJECTIONS)}")
    rank = int(config.get("r") or 0)
    ranks = [rank, *(int(r) for r in (config.get("rank_pattern") or {}).values())]
    if min(ranks) < 1:
        raise LoRAAdapterError(f"{where}: rank r={rank} must be at least 1")
    if max(ranks) > min(max_rank, MAX_RANK):
        raise LoRAAdapterError(f"{where}: rank {max(ranks)} is above lora.max_rank {max_rank} (raise lora.max_rank, "
                               f"at most {MAX_RANK})")


def _pair_tensors(folder: Path, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(f"LoRA adapter {folder}: unexpected tensor {key!r} (only lora_A / lora_B "
                                   "weights of linear projections are supported)")
        halves.setdefault(match["module"], {})[match["side"]] = tensor
    pairs = {}
    for module, sides in halves.items():
        if set(sides) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA adapter {folder}: {module} has lora_{''.join(sides)} without its other half")
        pairs[module] = (sides["A"], sides["B"])
    return pairs


def _check_module(folder: Path, module: str, a: torch.Tensor, b: torch.Tensor, max_rank: int,
                  model_shapes: Mapping[str, tuple[int, int]]) -> None:
    where = f"LoRA adapter {folder}"
    projection = module.rpartition(".")[2]
    if projection not in PROJECTIONS:
        raise LoRAAdapterError(f"{where}: target module {projection!r} ({module}) is not supported; adapters may "
                               f"change {', '.join(PROJECTIONS)}")
    if module not in model_shapes:
        present = sorted({name.rpartition(".")[2] for name in model_shapes})
        raise LoRAAdapterError(f"{where}: {module} is not a projection of this model (it has "
                               f"{', '.join(present)} in {_layer_count(model_shapes)} layers)")
    out_features, in_features = model_shapes[module]
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
        raise LoRAAdapterError(f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the "
                               f"model expects ({rank}, {in_features}) and ({out_features}, {rank})")
    if not 1 <= rank <= max_rank:
        raise LoRAAdapterError(f"{where}: {module} has rank {rank}, above lora.max_rank {max_rank}")


def _rank_and_alpha(config: dict[str, Any], module: str, rank: int) -> tuple[int, float]:
    """The module's rank (its tensors') and ``lora_alpha`` (``alpha_pattern`` matched as PEFT matches it: the
    pattern is the end of the module name, at a dot)."""
    alpha = float(config.get("lora_alpha") or config.get("r") or rank)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = float(value)
            break
    return rank, alpha


def _layer_count(model_shapes: Mapping[str, tuple[int, int]]) -> int:
    return len({name.rsplit(".", 2)[0] for name in model_shapes})
