"""Kernel tests: real GPU when there is one, else the Triton interpreter on small shapes.

TRITON_INTERPRET must be set before triton decorates any kernel, so it is set
here, before the kernel modules are imported by the tests.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="kernel tests need torch (pip install -e .[kernels])")
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Before triton is imported: triton wraps its own tl.* helpers for the
    # interpreter only when the variable is set at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="kernel tests need triton (pip install -e .[kernels])")


@pytest.fixture(scope="session")
def device() -> str:
    """Where the kernels run: `cuda` on a GPU machine, `cpu` under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
