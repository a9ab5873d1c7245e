"""Reductions for kernels that must also run under the Triton interpreter.

tl.reduce with Triton's own combine functions: the interpreter maps exactly these to
numpy. tl.sum, tl.max, tl.zeros, tl.cdiv... are jit functions decorated when triton is
imported, and the interpreter rejects them when TRITON_INTERPRET is set only after that
import (tests/conftest.py sets it first; a user's own script may not).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rsum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def rmax(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def rmin(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)
