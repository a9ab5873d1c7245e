"""The per-token-head Gluon kernel (kvpolicy/kernels/pth_gluon.py) against the float64 reference, on a Hopper GPU.

Gluon does not run under the Triton interpreter, so the numeric tests need the GPU; everywhere, the routing is
checked: `kernel="auto"` falls back to the Triton kernel and `kernel="gluon"` says why not. Caches start poisoned
(NaN scales and codes outside the stored rows), so a read of an unattended position shows up as NaN.
"""

from __future__ import annotations

import pytest
import torch
from test_per_token_head import TOL, make_case, rel_err

from kvpolicy.kernels.decode_attention import DecodeConfig, decode_attention_pth
from kvpolicy.kernels.formats import PTH_FORMATS
from kvpolicy.kernels.reference import ref_decode_attention_pth

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
# int8/int4 meet the same int8 query as in the Triton kernel, fp8 the same fp16 query or (fp8_query) the same e4m3
# one, whose bound is the Triton kernel's fp8_query bound.
TOL_E4M3_QUERY = 3e-2


def _args(case: dict) -> tuple:
    return case["query"], case["cache"], case["tables"], case["seq_lens"]


def run_gluon(case: dict, fmt: str, fp8_query: bool = False, **kwargs) -> float:
    out = torch.full(case["query"].shape, float("nan"), dtype=torch.float32, device=case["query"].device)
    got = decode_attention_pth(*_args(case), fmt, out=out, kernel="gluon", fp8_query=fp8_query, **kwargs)
    assert got is out
    assert not out.isnan().any(), "unwritten output or a read of an unattended (NaN) position"
    for option in ("num_splits", "two_level", "config"):
        kwargs.pop(option, None)
    err = rel_err(out, ref_decode_attention_pth(*_args(case), fmt, **kwargs))
    tol = TOL_E4M3_QUERY if fp8_query else TOL[fmt]
    assert err <= tol, f"{fmt}: relative error {err:.2e} > {tol:.0e}"
    return err


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is written for sm_90")
@pytest.mark.parametrize("fmt", PTH_FORMATS)
@pytest.mark.parametrize("head_dim, q_heads", [(128, 32), (64, 64), (128, 8), (64, 16)])
@pytest.mark.parametrize("window, sinks, num_splits", [(None, False, 1), (None, True, 3), (48, True, 1),
                                                       (200, False, 2), (None, False, None)])
def test_gluon_matches_reference(fmt: str, head_dim: int, q_heads: int, window, sinks, num_splits) -> None:
    """GQA 1-8, one-token and partly filled sequences, windows, sinks, forced and default splits."""
    torch.manual_seed(hash((fmt, head_dim, q_heads)) % 1000)
    case = make_case("cuda", fmt, [1, 37, 300, 1025], q_heads, 8, head_dim)
    s = torch.randn(q_heads, device="cuda") if sinks else None
    run_gluon(case, fmt, sinks=s, sliding_window=window, num_splits=num_splits)
    if fmt == "fp8_per_token_head":
        run_gluon(case, fmt, fp8_query=True, sinks=s, sliding_window=window, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is written for sm_90")
@pytest.mark.parametrize("fmt", PTH_FORMATS)
def test_gluon_agrees_with_triton(fmt: str) -> None:
    """Same query quantisation, same cache: the kernels differ only in summation order (and fp8's query)."""
    case = make_case("cuda", fmt, [4099, 9001], 32, 8, 128)
    ref = ref_decode_attention_pth(*_args(case), fmt)
    for fp8_query in (False, True) if fmt == "fp8_per_token_head" else (False,):
        a = decode_attention_pth(*_args(case), fmt, fp8_query=fp8_query, kernel="gluon")
        b = decode_attention_pth(*_args(case), fmt, fp8_query=fp8_query, kernel="triton")
        assert rel_err(a.float(), ref) <= max(rel_err(b.float(), ref) * 1.5, 1e-3)
        assert rel_err(a.float(), b.double()) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is written for sm_90")
@pytest.mark.parametrize("fmt", PTH_FORMATS)
def test_gluon_long_context_and_cuda_graph(fmt: str) -> None:
    """64k positions in one split stay within the bound, and the call replays in a CUDA graph (int4's rotations
    included) with the eager call's output."""
    case = make_case("cuda", fmt, [65536], 8, 1, 128)
    run_gluon(case, fmt, num_splits=1)
    case = make_case("cuda", fmt, [3000, 17, 1025, 4096], 32, 8, 128)
    kw = {"kernel": "gluon"}
    eager = decode_attention_pth(*_args(case), fmt, **kw)
    out = torch.empty_like(eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention_pth(*_args(case), fmt, out=out, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention_pth(*_args(case), fmt, out=out, **kw)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("fmt", PTH_FORMATS)
def test_auto_falls_back_and_gluon_explains(device: str, fmt: str) -> None:
    """Where Gluon does not apply (no sm_90 GPU, the HND layout), "auto" runs Triton and "gluon" says why."""
    case = make_case(device, fmt, [37], 8, 2, 64, "HND")
    ref = ref_decode_attention_pth(*_args(case), fmt)
    out = decode_attention_pth(*_args(case), fmt, kernel="auto")
    assert rel_err(out.float(), ref) < TOL[fmt] * 4
    with pytest.raises(ValueError, match="kernel='gluon' does not apply here: .*(sm_90|NHD|interpreter|GPU)"):
        decode_attention_pth(*_args(case), fmt, kernel="gluon")
    with pytest.raises(ValueError, match="kernel must be"):
        decode_attention_pth(*_args(case), fmt, kernel="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is written for sm_90")
@pytest.mark.parametrize("fmt", PTH_FORMATS)
@pytest.mark.parametrize("head_dim, q_heads", [(128, 32), (64, 64)])
def test_gluon_64_token_tiles(fmt: str, head_dim: int, q_heads: int) -> None:
    """The 64-token tiling (one MMA row block) with a deeper ring, through the same edge, window and split paths."""
    case = make_case("cuda", fmt, [1, 37, 300, 1025], q_heads, 8, head_dim)
    for window, splits in ((None, 1), (48, None), (200, 3)):
        run_gluon(case, fmt, sinks=torch.randn(q_heads, device="cuda"), sliding_window=window, num_splits=splits,
                  config=DecodeConfig(block_n=64, num_stages=4, defer_sum=False))
