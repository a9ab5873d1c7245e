"""The kernels' format registry (`kvpolicy.kernels.formats`) agrees with kvpolicy's and imports nothing heavy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpolicy.formats import FORMATS as KVPOLICY_FORMATS
from kvpolicy.kernels.formats import (
    PAGED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    TQ_BITS,
    TQ_FORMATS,
    WARP_ORDER_FORMATS,
    planar_constexprs,
    tq_layout,
)


def test_bits_and_names_agree_with_kvpolicy_formats() -> None:
    """Every format the kernels take is a `--kv-cache-dtype` kvpolicy knows, with the same bits."""
    assert set(TQ_FORMATS) == {n for n, f in KVPOLICY_FORMATS.items() if f.kind == "turboquant"}
    for fmt in TQ_FORMATS:
        assert TQ_BITS[fmt] == (KVPOLICY_FORMATS[fmt].key_bits, KVPOLICY_FORMATS[fmt].value_bits)
    for name, dtype in PAGED_DTYPES.items():
        f = KVPOLICY_FORMATS[name]
        assert (f.kind, f.key_bits) == (("bf16", 16) if dtype == "bfloat16" else ("fp8", 8))
    assert set(WARP_ORDER_FORMATS) == {f for f in TQ_FORMATS if TQ_BITS[f][0] != 8}


@pytest.mark.parametrize("fmt", TQ_FORMATS)
@pytest.mark.parametrize("d", SUPPORTED_HEAD_DIMS)
def test_planar_geometry_covers_the_slot(fmt: str, d: int) -> None:
    """The compile-time page geometry of the Gluon kernels: code planes of whole 32-bit words per token, and
    codes plus fp16 fields within the slot."""
    cx = planar_constexprs(fmt, d)
    assert cx["SLOT"] == tq_layout(fmt, d).slot_bytes
    assert cx["KBM"] % 4 == 0 and cx["VBM"] % 4 == 0
    assert cx["KB"] + cx["VB"] + 2 * cx["NF"] <= cx["SLOT"]


def test_the_registry_imports_no_torch_triton_or_numpy() -> None:
    """Pure Python, so that kvpolicy's start-up path (which must not load torch) can import it."""
    code = ("import sys, kvpolicy.kernels.formats; "
            "print(sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
