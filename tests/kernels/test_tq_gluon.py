"""The Gluon TurboQuant kernel (kernels/tq_gluon.py) against the float64 reference, on a Hopper GPU.

Gluon does not run under the Triton interpreter: on the CPU only the routing is checked
(`kernel="auto"` falls back to the Triton kernel, `kernel="gluon"` says why it cannot run).
"""

from __future__ import annotations

import pytest
import torch
from kvpolicy.kernels.tq_decode import decode_attention_tq
from test_tq_decode import TOL_SAME_CACHE, _rel, _run

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
GLUON_FORMATS = ["turboquant_k8v4", "turboquant_4bit_nc"]
hopper_only = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is written for sm_90")


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", GLUON_FORMATS)
@pytest.mark.parametrize("d, hq", [(128, 32), (64, 64), (128, 8)])
@pytest.mark.parametrize("window, sinks, splits", [(None, False, 1), (None, True, 3), (48, True, 1),
                                                   (200, False, 2), (None, False, None)])
@pytest.mark.parametrize("tile", [64, 128])
def test_gluon_matches_reference(fmt: str, d: int, hq: int, window, sinks: bool, splits, tile: int, device: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """GQA 1-8, one-token and partly filled sequences, windows, sinks, forced and default splits, both tiles;
    the output is poisoned with NaN and stale slots hold NaN norms and scales."""
    from kvpolicy.kernels import tq_gluon

    monkeypatch.setattr(tq_gluon, "default_config",
                        lambda head_dim: tq_gluon.TQGluonConfig(block_n=tile))
    out, ref, _ = _run(fmt, device, bsz=4, hq=hq, hkv=8, d=d, seq=(1, 37, 300, 1025), splits=splits,
                       window=window, sinks=sinks, kernel="gluon")
    assert not out.isnan().any(), "unwritten output or a read of an unattended (NaN) slot"
    assert _rel(out, ref) <= TOL_SAME_CACHE


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", GLUON_FORMATS)
def test_gluon_agrees_with_triton_kernel(fmt: str, device: str) -> None:
    """Same cache, same fp16 query: the two kernels differ only in summation order."""
    case = dict(bsz=2, hq=32, hkv=8, d=128, seq=(4099, 9001), outliers=True)
    torch.manual_seed(0)
    out_g, ref, raw = _run(fmt, device, kernel="gluon", **case)
    torch.manual_seed(0)
    out_t, _, _ = _run(fmt, device, **case)
    assert _rel(out_g, ref) <= TOL_SAME_CACHE
    assert _rel(out_g, out_t) <= TOL_SAME_CACHE
    # against unquantized attention both carry the format's own error; Gluon may not add to it
    assert _rel(out_g, raw) <= 1.1 * _rel(out_t, raw) + 1e-3


def test_gluon_routing_says_why(device: str) -> None:
    """Where the Gluon kernel cannot run (here: no sm_90 GPU, or a 3-bit format), "gluon" raises with the reason
    and "auto" decodes with Triton."""
    kw = dict(bsz=1, hq=8, hkv=2, d=64, seq=(40,))
    with pytest.raises(ValueError, match="kernel='gluon' cannot decode this call"):
        _run("turboquant_4bit_nc", device, kernel="gluon", **kw)
    with pytest.raises(ValueError, match="decodes turboquant_k8v4 and turboquant_4bit_nc only"):
        _run("turboquant_3bit_nc", device, kernel="gluon", **{**kw, "hkv": 8})
    out, ref, _ = _run("turboquant_4bit_nc", device, kernel="auto", **kw)
    assert _rel(out, ref) <= TOL_SAME_CACHE
    with pytest.raises(ValueError, match="kernel must be"):
        _run("turboquant_4bit_nc", device, kernel="cuda", **kw)
