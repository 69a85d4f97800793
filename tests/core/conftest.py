"""Fixtures shared by the core tests."""

from __future__ import annotations

import tempfile

import pytest


@pytest.fixture
def stores(tmp_path, monkeypatch):
    """The folder a one-machine tensor-parallel group's file store goes to (the temp folder, redirected for the
    test)."""
    folder = tmp_path / "stores"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder
