"""Shared test configuration.

Without a GPU, Triton kernels run through the interpreter. TRITON_INTERPRET
must be set before anything imports triton (triton wraps its own tl.* helpers
for the interpreter only when it is set at import time), so it is set here, in
the first conftest pytest loads.
"""

from __future__ import annotations

import os

import pytest

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:
    HAS_CUDA = False

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` where CUDA is not available."""
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
