"""Launch choices timed at load, kept on disk for the next start.

At load each weight shape's candidate kernel launches are timed on the GPU and the fastest kept
(``layers/small_batch.py`` for the 16-bit and FP8 decode matmuls, ``layers/int_kernel_choice.py`` for the integer
ones: hundreds of launches for a W4A16 model, tens of seconds a start). A choice is stored under everything that
decides it — the GPU (name, SMs), torch's, CUDA's and Triton's versions, the source of treadle's kernels (a hash
of ``kernels/*.py``), what was timed (the caller's key: kind, shape, dtypes, rows) and the candidates themselves
(their reprs: a changed list is timed again) — in ``<cache root>/kernel-choices.json`` (``~/.cache/treadle``,
or ``$TREADLE_CACHE_DIR``). ``TREADLE_KERNEL_CHOICES``: another file, or ``off`` to time at every start. A file
that cannot be read or written is ignored (the launches are timed, as without it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

CHOICES_ENV = "TREADLE_KERNEL_CHOICES"


def cached_choice(key: Sequence[Any], candidates: Sequence[Any], device: torch.device) -> tuple[int, float] | None:
    """``(index into candidates, seconds it was timed at)`` stored for this key, candidates and machine; None
    where none is (or the cache is off or unreadable)."""
    path = choices_path()
    if path is None:
        return None
    entry = _read(path).get(_entry_key(key, candidates, device))
    if not isinstance(entry, dict) or not 0 <= entry.get("index", -1) < len(candidates):
        return None
    return int(entry["index"]), float(entry.get("seconds", 0.0))


def store_choice(key: Sequence[Any], candidates: Sequence[Any], device: torch.device, index: int,
                 seconds: float) -> None:
    """Keeps ``candidates[index]`` (timed at ``seconds``) for the next start. Merged into the file as it is now
    (other processes, such as tensor-parallel ranks, write theirs too) and replaced whole, so it is never half
    written."""
    path = choices_path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        choices = _read(path)
        choices[_entry_key(key, candidates, device)] = {"index": index, "seconds": seconds,
                                                        "chosen": repr(candidates[index])}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, delete=False) as file:
            json.dump(choices, file)
        os.replace(file.name, path)
    except OSError as exc:
        logger.info("kernel choices not kept in %s: %s", path, exc)


def choices_path() -> Path | None:
    """The file the choices are kept in; None when ``TREADLE_KERNEL_CHOICES=off``."""
    setting = os.environ.get(CHOICES_ENV, "")
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    if setting:
        return Path(setting).expanduser()
    from treadle.core.loading.default_model import models_cache_dir

    return models_cache_dir().parent / "kernel-choices.json"


def _read(path: Path) -> dict:
    try:
        choices = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: time the launches
        return {}
    return choices if isinstance(choices, dict) else {}


def _entry_key(key: Sequence[Any], candidates: Sequence[Any], device: torch.device) -> str:
    text = json.dumps([_machine(str(device)), [str(part) for part in key], [repr(c) for c in candidates]])
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _machine(device: str) -> str:
    """What makes a timing hold: the GPU, the versions of what compiles and runs the kernels, their source."""
    import triton

    place = torch.device(device)
    if place.type == "cuda":
        properties = torch.cuda.get_device_properties(place)
        gpu = f"{properties.name} {properties.multi_processor_count} SMs"
    else:
        gpu = place.type
    return f"{gpu}|torch {torch.__version__}|cuda {torch.version.cuda}|triton {triton.__version__}|{_kernels_hash()}"


@functools.lru_cache(maxsize=None)
def _kernels_hash() -> str:
    import treadle.kernels

    digest = hashlib.sha256()
    for source in sorted(Path(treadle.kernels.__file__).parent.glob("*.py")):
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]
