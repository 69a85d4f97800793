"""Shared fixtures: tiny random models built by the tests, the embedded SmolLM2, leak checks."""

from __future__ import annotations

import os
import sys

import pytest

# Shared test data modules (e.g. structured_schemas) import by name under --import-mode=importlib.
sys.path.insert(0, os.path.dirname(__file__))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tests time the kernel launches at load (GPU tests) or fake the timing: no choices kept from an earlier run.
os.environ.setdefault("TREADLE_KERNEL_CHOICES", "off")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Test packages whose conftest builds package-scoped fixtures (a model, a server): under ``--dist loadfile`` each is
# one unit of work, so one worker runs all its files in a row and builds them once, not once per file it gets.
PACKAGE_UNITS = ("tests/lang/",)

# The slowest units (files, or the packages above), slowest first: under ``--dist loadfile`` they start first, so no
# worker is left running a 100 s file alone at the end while the others idle (xdist's own order is by test count).
# Seconds from a full `make test PYTEST_ARGS=--durations=0 > dur.log` run on 2 workers (call + setup + teardown,
# summed per unit); refresh the list from a new log with:
#   grep -E '^[0-9.]+s (call|setup|teardown)' dur.log | awk '{split($3, a, "::"); f = a[1];
#     if (f ~ /^tests\/lang\//) f = "tests/lang/"; t[f] += $1} END {for (f in t) print t[f], f}' | sort -rn | head -16
SLOWEST_UNITS = (
    "tests/test_docs_examples.py",  # 107 s
    "tests/server/test_shutdown.py",  # 79
    "tests/plugins/test_small_batch_kernels.py",  # 61
    "tests/lang/",  # 60
    "tests/server/test_openai_structured.py",  # 52
    "tests/server/test_tensor_parallel_server.py",  # 48
    "tests/core/test_tensor_parallel.py",  # 44
    "tests/server/test_data_parallel.py",  # 39
    "tests/test_conformance_kit_attention.py",  # 36
    "tests/server/test_http.py",  # 36
    "tests/core/test_verify_step.py",  # 27
    "tests/layers/test_output_deltas.py",  # 24
    "tests/plugins/test_qwen2_5_vl.py",  # 22
    "tests/test_cli.py",  # 21
    "tests/bench/test_offline_throughput.py",  # 20
    "tests/bench/test_decode_attention.py",  # 20
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class PackageUnitScheduling(LoadFileScheduling):
        _slowest_moved_first = False

        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return next((package for package in PACKAGE_UNITS if path.startswith(package)), path)

        def _assign_work_unit(self, node) -> None:
            if not self._slowest_moved_first:  # the queue is full and nothing is out yet
                self._slowest_moved_first = True
                for unit in reversed([unit for unit in SLOWEST_UNITS if unit in self.workqueue]):
                    self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

    return PackageUnitScheduling(config, log)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    from treadle.testing.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_text_dir(tmp_path_factory) -> str:
    """The tiny Llama with a byte-level tokenizer and chat template beside it (text prompts, stop strings)."""
    from treadle.testing.models import make_tiny_llama
    from treadle.testing.tokenizer import make_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama-text")
    make_tiny_llama(path)
    make_tiny_tokenizer(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> str:
    from treadle.testing.models import make_tiny_mistral

    return make_tiny_mistral(tmp_path_factory.mktemp("tiny-mistral"), sliding_window=8)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from treadle.core.loading.default_model import default_model

    return default_model()
