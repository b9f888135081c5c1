"""Shared test setup.

- Without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1, set before any
  triton import so every @triton.jit sees it): that is how CPU CI checks them.
- Tests marked ``gpu`` are skipped without CUDA.
- The probe's per-op choices are cached per process; tests that change overrides reset them.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):  # noqa: ANN001 - pytest hook
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_probe(monkeypatch):
    """Probe with no overrides and no cached choices; restored afterwards."""
    from qwen35 import probe

    for key in list(os.environ):
        if key == "QWEN35_BACKEND" or key.startswith("QWEN35_BACKEND_"):
            monkeypatch.delenv(key)
    probe.reset()
    yield probe
    probe.reset()
