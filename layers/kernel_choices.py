"""Launch choices timed at load, kept on disk for the next start.

At load each weight shape's candidate kernel launches are timed on the GPU and the fastest kept
(``layers/small_batch.py`` for the 16-bit and FP8 decode matmuls, ``layers/int_kernel_choice.py`` for the integer
ones: hundreds of launches for a W4A16 model). A choice is stored under everything that decides it — the machine
(the GPU's name and SMs; torch's, CUDA's and Triton's versions; a hash of ``kernels/*.py``; the settings that
change how the launches run, :data:`KERNEL_SETTINGS`), what was timed (the caller's key: kind, shape, dtypes,
rows) and the candidates themselves (their reprs: a changed list is timed again) — in
``<cache root>/kernel-choices.json`` (``~/.cache/treadle``, or ``$TREADLE_CACHE_DIR``), grouped by machine, the
``KEPT_MACHINES`` most recently written kept. ``TREADLE_KERNEL_CHOICES``: another file, or ``off`` to time at every
start. A file that cannot be read or written is ignored (the launches are timed, as without it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

CHOICES_ENV = "TREADLE_KERNEL_CHOICES"


# Machines (GPU, versions, kernel source) whose choices a file keeps, the most recently written: a new kernel source
# makes a new machine, and the oldest go.
KEPT_MACHINES = 8


def cached_choice(key: Sequence[Any], candidates: Sequence[Any], device: torch.device) -> tuple[int, float] | None:
    """``(index into candidates, seconds it was timed at)`` stored for this key, candidates and machine; None
    where none is (or the cache is off or unreadable)."""
    path = choices_path()
    if path is None:
        return None
    machine = _read(path)["machines"].get(_machine_key(device))
    choices = machine.get("choices") if isinstance(machine, dict) else None
    entry = choices.get(_entry_key(key, candidates)) if isinstance(choices, dict) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("index"), int) or \
            not 0 <= entry["index"] < len(candidates):
        return None
    return entry["index"], float(entry.get("seconds", 0.0))


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
        machines = {name: machine for name, machine in _read(path, fresh=True)["machines"].items()
                    if isinstance(machine, dict) and isinstance(machine.get("choices"), dict)}
        machine = machines.setdefault(_machine_key(device), {"machine": _machine(str(device)), "choices": {}})
        machine["written"] = time.time()
        machine["choices"][_entry_key(key, candidates)] = {"index": index, "seconds": seconds,
                                                           "chosen": repr(candidates[index])}
        newest = sorted(machines, key=lambda name: float(machines[name].get("written", 0.0)))[-KEPT_MACHINES:]
        content = {"machines": {name: machines[name] for name in newest}}
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, delete=False) as file:
            json.dump(content, file)
        os.replace(file.name, path)
        _files[path] = (path.stat().st_mtime_ns, content)
    except (OSError, TypeError, ValueError) as exc:  # the next start times these launches again
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


# path -> (modification time, parsed content): a load looks up hundreds of choices, the file is parsed once.
_files: dict[Path, tuple[int, dict]] = {}


def _read(path: Path, fresh: bool = False) -> dict:
    try:
        mtime = path.stat().st_mtime_ns
        if not fresh and path in _files and _files[path][0] == mtime:
            return _files[path][1]
        content = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: time the launches
        return {"machines": {}}
    if not isinstance(content, dict) or not isinstance(content.get("machines"), dict):
        return {"machines": {}}
    _files[path] = (mtime, content)
    return content


def _entry_key(key: Sequence[Any], candidates: Sequence[Any]) -> str:
    text = json.dumps([[str(part) for part in key], [repr(c) for c in candidates]])
    return hashlib.sha256(text.encode()).hexdigest()


def _machine_key(device: torch.device) -> str:
    return hashlib.sha256(_machine(str(device)).encode()).hexdigest()[:24]


# Settings that change how the timed launches run (programmatic dependent launch, the next weight's L2 prefetch):
# part of the machine, so an A/B run of one of them times its own choices.
KERNEL_SETTINGS = ("TREADLE_PDL", "TREADLE_L2_PREFETCH_MB")


@functools.lru_cache(maxsize=None)
def _machine(device: str) -> str:
    """What makes a timing hold: the GPU, the versions of what compiles and runs the kernels, their source and the
    settings that change how they run (:data:`KERNEL_SETTINGS`, as set when first asked)."""
    import triton

    place = torch.device(device)
    if place.type == "cuda":
        properties = torch.cuda.get_device_properties(place)
        gpu = f"{properties.name} {properties.multi_processor_count} SMs"
    else:
        gpu = place.type
    settings = ",".join(f"{name}={os.environ.get(name, '')}" for name in KERNEL_SETTINGS)
    return (f"{gpu}|torch {torch.__version__}|cuda {torch.version.cuda}|triton {triton.__version__}|"
            f"{_kernels_hash()}|{settings}")


@functools.lru_cache(maxsize=None)
def _kernels_hash() -> str:
    import treadle.kernels

    digest = hashlib.sha256()
    for source in sorted(Path(treadle.kernels.__file__).parent.glob("*.py")):
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]
