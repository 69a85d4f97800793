"""Shared fixtures: tiny random models built by the tests, the embedded SmolLM2, leak checks."""

from __future__ import annotations

import os
import sys

import pytest

# Shared test data modules (e.g. structured_schemas) import by name under --import-mode=importlib.
sys.path.insert(0, os.path.dirname(__file__))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class PackageUnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return next((package for package in PACKAGE_UNITS if path.startswith(package)), path)

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
