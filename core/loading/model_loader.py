"""Build the model named by a ModelConfig and fill its weights: safetensors (a folder or a hub id), GGUF, or dummy.

The model class comes from the ``models`` registry by ``config.architectures[0]``.
It is built directly on the target device in the target dtype, then weights are
streamed in tensor by tensor (``model.load_weights``) so peak memory stays near
the model's own size. Layers quantized at load take memory only while they load
(core/loading/lazy_weights.py): the peak is the quantized model's size plus a layer.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from treadle.core.embedding.checkpoint import (
    EmbeddingSettings,
    causal_lm_architecture,
    is_bare_model_architecture,
    read_checkpoint_embedding,
    resolve_embedding,
)
from treadle.core.execution.model_protocol import ModelTraits, accepts_quant_config
from treadle.core.loading.lazy_weights import (
    LoadTracker,
    finish_module,
    lazy_modules,
    materialize,
    unloaded_parameters,
)
from treadle.core.registry import PluginError

if TYPE_CHECKING:
    from treadle.core.config import ModelConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DUMMY_WEIGHT_RANGE = 1e-3  # uniform(-r, r): small enough that activations stay finite at 8B shapes


class ModelLoadError(RuntimeError):
    """The model folder, its config or its weights could not be used; the message says which and why."""


def load_model(
    model_config: "ModelConfig",
    registry: Any,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> tuple[nn.Module, Any, str]:
    """Build and load the model; returns ``(model in eval mode, HF config, model folder)``.

    ``device``/``dtype`` default to ``model_config.device``/``.dtype`` and may be
    ``"auto"`` (see :func:`resolve_device`, :func:`resolve_dtype`).
    """
    model_dir = resolve_model_path(model_config)
    hf_config = read_hf_config(model_dir)
    lift_text_config(hf_config)
    model_cls = model_class(hf_config, registry, model_dir)
    target_device = resolve_device(device if device is not None else model_config.device)
    target_dtype = resolve_dtype(dtype if dtype is not None else model_config.dtype, hf_config, target_device)

    quant_config = _quantization(model_config, hf_config, model_cls, target_device, registry)
    with _building_on(target_device, target_dtype):
        model = model_cls(hf_config) if quant_config is None else model_cls(hf_config, quant_config=quant_config)
    _cast_parameters(model, target_dtype)
    if embedding_settings(model_config, model_dir, hf_config).task == "embed":
        _serve_embeddings(model, model_dir)
    if model_config.load_format == "dummy":
        fill_dummy_weights(model, model_config.seed)
    else:
        from treadle.core.distributed.parallel import get_tp_size

        files = safetensors_files(model_dir)
        # Under tensor parallelism each rank reads only its slices of the file.
        weights = iter_safetensors(files, lazy=get_tp_size() > 1)
        # A quantization method may rewrite tensors before the model sees them (int4 MoE experts, dequantized).
        rewrite = getattr(quant_config, "checkpoint_stream", None)
        model.load_weights(weights if rewrite is None else rewrite(weights))
    _finish_weights(model)
    model.requires_grad_(False)
    return model.eval(), hf_config, model_dir


def lift_text_config(hf_config: Any) -> None:
    """A multimodal config keeps its language model's shape under ``text_config``: copy each field the top level
    lacks to it, so the runtime reads ``num_hidden_layers`` and the rest as from a text model's config."""
    text = getattr(hf_config, "text_config", None)
    if text is None or getattr(hf_config, "num_hidden_layers", None) is not None:
        return
    for key, value in text.to_dict().items():
        if getattr(hf_config, key, None) is None:
            setattr(hf_config, key, value)


def embedding_settings(model_config: "ModelConfig", model_dir: str, hf_config: Any) -> EmbeddingSettings:
    """``model.task`` and the embedding settings, each ``auto`` resolved from the checkpoint."""
    return resolve_embedding(model_config, read_checkpoint_embedding(model_dir, hf_config))


def _serve_embeddings(model: nn.Module, model_dir: str) -> None:
    traits = ModelTraits.of(model)
    if not traits.embeds:
        raise ModelLoadError(f"model.task is embed but {type(model).__name__} (from {model_dir}) has no "
                             "forward_hidden/compute_hidden_states to return hidden states; serve it with "
                             "model.task: generate")
    if traits.drop_lm_head is not None:
        traits.drop_lm_head()


def resolve_model_path(model_config: "ModelConfig") -> str:
    """The HF folder to load: the embedded default, a converted GGUF file, the folder given, or a hub
    id's snapshot in the Hugging Face cache (a path that exists locally wins over a hub id)."""
    from treadle.core.loading import default_model as embedded
    from treadle.core.loading import hub

    if model_config.path is None:
        return embedded.default_model()
    path = Path(model_config.path).expanduser()
    if not path.exists():
        hub_id = hub.parse_hub_id(model_config.path)
        if hub_id is None:
            raise ModelLoadError(
                f"model.path '{model_config.path}' does not exist; give an HF model folder, a .gguf file "
                "or a Hugging Face hub id (org/name[@revision])"
            )
        if model_config.load_format == "gguf":
            raise ModelLoadError(f"model.path '{hub_id}' is a hub id; load_format gguf needs a local .gguf file")
        try:
            return hub.download(hub_id)
        except hub.HubError as exc:
            raise ModelLoadError(str(exc)) from None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model.path '{path}' is a file but not a .gguf; give an HF model folder or a .gguf file")
        if model_config.load_format not in ("auto", "gguf", "dummy"):
            raise ModelLoadError(f"model.path '{path}' is a GGUF file but load_format is '{model_config.load_format}'")
        return embedded.convert_gguf(path)
    if model_config.load_format == "gguf":
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(f"load_format gguf needs exactly one .gguf file in {path}, found {len(ggufs)}")
        return embedded.convert_gguf(ggufs[0])
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model folder '{path}' has no config.json; is it a Hugging Face model folder?")
    return str(path)


def read_hf_config(model_dir: str) -> Any:
    """config.json as a transformers config (``AutoConfig``; a plain PretrainedConfig for unknown model types)."""
    from transformers import AutoConfig, PretrainedConfig

    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, KeyError):
        # A model type transformers does not know may still be served by a plugin.
        with open(Path(model_dir) / "config.json") as handle:
            return PretrainedConfig(**json.load(handle))


def _quantization(model_config: "ModelConfig", hf_config: Any, model_cls: Any, device: torch.device,
                  registry: Any) -> Any:
    """The quant_config the model is built with (None: plain weights), from the ``quantization_methods`` plugin
    that model.quantization names or that reads the checkpoint (core/loading/quantization_method.py)."""
    from treadle.core.loading.quantization import QuantizationError
    from treadle.core.loading.quantization_method import QuantizationRequest, resolve_method

    request = QuantizationRequest(device, model_config.quantize_lm_head, model_config.lm_head_exact_top)
    try:
        quant_config = resolve_method(model_config.quantization, hf_config, request, registry)
    except QuantizationError as exc:
        raise ModelLoadError(str(exc)) from None
    if quant_config is not None and not accepts_quant_config(model_cls):
        raise ModelLoadError(
            f"{model_cls.__name__} ({model_cls.__module__}) takes no quant_config, so it cannot load quantized "
            "weights; build it from treadle.layers.linear's layers, or leave model.quantization empty"
        )
    return quant_config


def model_class(hf_config: Any, registry: Any, model_dir: str = "") -> Any:
    """The registered class for ``hf_config.architectures[0]``."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ModelLoadError(f"{model_dir}/config.json names no architectures; cannot pick a model class")
    name = architectures[0]
    try:
        return registry.get("models", name)
    except PluginError:
        if is_bare_model_architecture(name) and causal_lm_architecture(name) in registry.names("models"):
            return registry.get("models", causal_lm_architecture(name))  # an embedding checkpoint's bare model

        raise ModelLoadError(
            f"model architecture '{name}' (from {model_dir}/config.json) is not supported; "
            f"available: {registry.describe('models')}"
        ) from None


def resolve_device(device: torch.device | str) -> torch.device:
    """``"auto"`` → cuda when available, else cpu."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"model.device is '{device}' but no CUDA GPU is available; use cpu or auto")
    return torch.device(device)


def resolve_dtype(dtype: torch.dtype | str, hf_config: Any, device: torch.device | str) -> torch.dtype:
    """``"auto"`` → the checkpoint's dtype on cuda (bfloat16 when it names none), float32 on cpu."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ModelLoadError(f"unknown dtype '{dtype}'; use one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    if torch.device(device).type == "cpu":
        return torch.float32
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    if isinstance(declared, str) and declared.removeprefix("torch.") in _DTYPES:
        return _DTYPES[declared.removeprefix("torch.")]
    return torch.bfloat16


def safetensors_files(model_dir: str) -> list[Path]:
    """The folder's safetensors files: the shards of model.safetensors.index.json, model.safetensors, or all *.safetensors."""
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as handle:
            weight_map = json.load(handle).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        hint = " (*.bin checkpoints are not supported; convert them to safetensors)" if any(folder.glob("*.bin")) else ""
        raise ModelLoadError(f"no *.safetensors weights in {folder}{hint}; or use load_format: dummy")
    return files


def iter_safetensors(files: list[Path], lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` one tensor at a time, on the CPU, with a progress bar over the files (shards).

    With ``lazy`` the values are safetensors slices (``get_shape()``, ``slice[rows]``) that read
    only the part indexed; they are valid until the next item is requested.
    """
    from safetensors import safe_open
    from tqdm.auto import tqdm

    for file in tqdm(files, desc="Loading safetensors shards", unit="shard"):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():
                yield name, reader.get_slice(name) if lazy else reader.get_tensor(name)


def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter with uniform(-1e-3, 1e-3) noise, reproducibly from ``seed``, in place on its device.

    Under tensor parallelism a sharded parameter draws its whole tp-1 tensor (its
    ``full_shards``) from the same generator stream and keeps its slice through its
    ``weight_loader``, so every tp size computes with the same weights.
    """
    from treadle.core.distributed.parallel import get_tp_size

    sharded = get_tp_size() > 1
    generators: dict[torch.device, torch.Generator] = {}
    # A layer quantized at load is quantized once its parameters are filled (core/loading/lazy_weights.py).
    tracker = LoadTracker((module, {id(p) for p in module.parameters(recurse=False)}) for module in lazy_modules(model))
    with torch.no_grad():
        for _, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            materialize(param)
            _fill_dummy(param, generators, seed, sharded)
            tracker.loaded((id(param),))


def _fill_dummy(param: nn.Parameter, generators: dict[torch.device, torch.Generator], seed: int,
                sharded: bool) -> None:
    generator = generators.get(param.device)
    if generator is None:
        generator = torch.Generator(device=param.device).manual_seed(seed)
        generators[param.device] = generator
    loader = getattr(param, "weight_loader", None)
    if param.dtype not in _DTYPES.values():  # e.g. FP8 weights, which have no uniform_
        noise = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        param.copy_(noise.uniform_(-_DUMMY_WEIGHT_RANGE, _DUMMY_WEIGHT_RANGE, generator=generator))
        return
    # ``dummy_fills_rank``: a tensor whose loader takes checkpoint layouts a full draw cannot stand in for (packed
    # integer weights' scales) is filled in this rank's shape.
    if not sharded or loader is None or getattr(param, "dummy_fills_rank", False):
        param.uniform_(-_DUMMY_WEIGHT_RANGE, _DUMMY_WEIGHT_RANGE, generator=generator)
        return
    _fill_full_then_shard(param, loader, generator)


def _fill_full_then_shard(param: nn.Parameter, loader: Any, generator: torch.Generator) -> None:
    shards = getattr(param, "full_shards", None) or [(None, tuple(param.shape))]
    rows = [shape[0] for _, shape in shards]
    full = torch.empty((sum(rows),) + tuple(shards[0][1][1:]), dtype=param.dtype, device=param.device)
    full.uniform_(-_DUMMY_WEIGHT_RANGE, _DUMMY_WEIGHT_RANGE, generator=generator)
    for (shard_id, _), piece in zip(shards, full.split(rows, dim=0)):
        if shard_id is None:
            loader(param, piece)
        else:
            loader(param, piece, shard_id)


def listed_names(names: list[str], limit: int = 8) -> str:
    """The first ``limit`` of ``names``, comma-separated, and how many more there are (for load errors)."""
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _finish_weights(model: nn.Module) -> None:
    unloaded = unloaded_parameters(model)
    if unloaded:
        raise ModelLoadError(
            f"{type(model).__name__}: nothing was loaded into {listed_names(unloaded)}; a model's load_weights must copy every "
            "tensor through its parameter's weight_loader (treadle.layers.checkpoint.load_checkpoint does)"
        )
    # Quantization methods (layers/linear.py) repack or quantize once every weight is in place (those
    # quantized while loading are done already).
    for module in model.modules():
        finish_module(module)
    # Then the model's own step, if it has one (Llama's links each layer to the next's weight).
    finish = ModelTraits.of(model).weights_loaded
    if finish is not None:
        finish()


_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
    "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
)


@contextmanager
def _building_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Create parameters on the device in the final dtype, without random init.

    No float32 CPU copy of an 8B model is ever made, and the (slow) default
    initializers are skipped because every parameter is overwritten by the
    checkpoint or the dummy fill right after. Buffers computed in ``__init__``
    stay correct (unlike building on the meta device).
    """
    previous_dtype = torch.get_default_dtype()
    originals = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    torch.set_default_dtype(dtype)
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, _keep)
    try:
        with torch.device(device):
            yield
    finally:
        for name, function in originals.items():
            setattr(nn.init, name, function)
        torch.set_default_dtype(previous_dtype)


def _keep(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def _cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    # Only parameters: a model may keep float32 buffers (e.g. rotary tables) on purpose. FP8 weights
    # and their float32 scales are marked ``keep_dtype``.
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype and not getattr(param, "keep_dtype", False):
            param.data = param.data.to(dtype)
