"""The Gluon decode kernel (kvpolicy/kernels/decode_gluon.py) against the float64 reference, on a Hopper GPU.

Gluon does not run under the Triton interpreter, so these tests need the GPU; on the CPU only the
routing is checked: `kernel="auto"` falls back to the Triton kernel and `kernel="gluon"` says why not.
"""

from __future__ import annotations

import pytest
import torch
from kvpolicy.kernels.decode_attention import decode_attention
from kvpolicy.kernels.reference import ref_decode_attention
from test_decode_attention import SINKS, TOL_FP8_QUERY, make_case, rel_err

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def run_gluon(case: dict, **kwargs) -> float:
    out = torch.full(case["query"].shape, float("nan"), dtype=torch.float32, device=case["query"].device)
    got = decode_attention(**case, out=out, fp8_query=True, kernel="gluon", **kwargs)
    assert got is out
    assert not out.isnan().any(), "unwritten output or a read of an unattended (NaN) position"
    ref = ref_decode_attention(**case, **kwargs)
    err = rel_err(out, ref)
    assert err <= TOL_FP8_QUERY, f"relative error {err:.2e} > {TOL_FP8_QUERY:.0e}"
    return err


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is written for sm_90")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("head_dim, q_heads", [(128, 32), (64, 64), (128, 8), (64, 16)])
@pytest.mark.parametrize("window, sinks, num_splits", [(None, None, 1), (None, SINKS, 3), (48, SINKS, 1),
                                                       (200, None, 2), (None, None, None)])
def test_gluon_matches_reference(device: str, layout: str, head_dim: int, q_heads: int, window, sinks,
                                 num_splits) -> None:
    """GQA 1-8, one-token and partly filled sequences, windows, sinks, forced and default splits."""
    case = make_case(device, [1, 37, 300, 1025], q_heads, 8, head_dim, "fp8", per_head=True, value_offset=1.0,
                     layout=layout)
    sinks_t = torch.randn(q_heads, device=device) if sinks is SINKS else None
    run_gluon(case, sinks=sinks_t, sliding_window=window, num_splits=num_splits)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is written for sm_90")
def test_gluon_agrees_with_triton_fp8_query(device: str) -> None:
    """Same e4m3 query quantisation, same cache: the two kernels differ only by P's rounding (fp16 here,
    e4m3 there) and summation order."""
    case = make_case(device, [4099, 9001], 32, 8, 128, "fp8", per_head=False, value_offset=1.0)
    a = decode_attention(**case, fp8_query=True, kernel="gluon")
    b = decode_attention(**case, fp8_query=True, kernel="triton")
    ref = ref_decode_attention(**case)
    assert rel_err(a.float(), ref) <= rel_err(b.float(), ref) * 1.5
    assert rel_err(a.float(), b.double()) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is written for sm_90")
def test_gluon_two_level_long_context(device: str) -> None:
    """128k positions in one split: with two-level on the error stays flat; off, it grows but stays bounded."""
    errs = {}
    for n in (4096, 131072):
        case = make_case(device, [n], 8, 1, 128, "fp8", per_head=True, value_offset=1.0)
        for two_level in (True, False):
            errs[n, two_level] = run_gluon(case, two_level=two_level, num_splits=1)
    print("gluon two-level errors:", {k: f"{v:.2e}" for k, v in errs.items()})
    assert errs[131072, True] <= 2 * errs[4096, True]
    # Off, the fp16 MMA carries the sum over 2,048 tiles, and Hopper's MMA accumulation is short of fp32:
    # measured on an H200 2.0e-4 at 4k and 7.3e-4 at 128k (on: 2.0e-4 and 3.8e-5). It grows, but
    # stays far below the fp8 wgmma's 0.62 at 128k.
    assert errs[131072, False] < 5e-3
    assert errs[131072, True] < errs[131072, False]


def test_auto_falls_back_and_gluon_explains(device: str) -> None:
    """Where Gluon does not apply (CPU, BF16 cache, no fp8_query), "auto" runs Triton and "gluon" raises."""
    case = make_case(device, [37], 8, 2, 64, "bfloat16")
    ref = ref_decode_attention(**case)
    out = decode_attention(**case, kernel="auto")
    assert rel_err(out.float(), ref) < 1e-2
    with pytest.raises(ValueError, match="kernel='gluon' does not apply"):
        decode_attention(**case, kernel="gluon")
    with pytest.raises(ValueError, match="kernel must be"):
        decode_attention(**case, kernel="cuda")


def test_cache_descriptor_addresses_one_page_of_one_head() -> None:
    """Host side, no GPU: the TMA descriptor and the (rows per page, rows per head, columns per head) that
    place a (page, head) box, for vLLM's NHD cache and the HND view; None for what the kernel cannot read."""
    decode_gluon = pytest.importorskip("kvpolicy.kernels.decode_gluon", reason="this Triton has no Gluon API")
    from kvpolicy.kernels.paged_store import allocate_cache

    for head_dim in (64, 128):
        k, _ = allocate_cache(10, 16, 8, head_dim, "fp8", "cpu", "NHD")
        desc, page_rows, head_rows, head_cols = decode_gluon.cache_descriptor(k)
        # NHD: row = block * 16 + token, a head is a column block of head_dim bytes
        assert (desc.shape, desc.block_shape, page_rows, head_rows, head_cols) == (
            [160, 8 * head_dim], [16, head_dim], 16, 0, head_dim)
        k, _ = allocate_cache(10, 16, 8, head_dim, "fp8", "cpu", "HND")
        desc, page_rows, head_rows, head_cols = decode_gluon.cache_descriptor(k)
        # HND: row = (block * heads + head) * 16 + token
        assert (desc.shape, desc.block_shape, page_rows, head_rows, head_cols) == (
            [1280, head_dim], [16, head_dim], 128, 16, 0)
    # the box of (page 3, head 5) starts where the cache holds page 3, head 5, token 0, in both layouts
    for layout in ("NHD", "HND"):
        k, _ = allocate_cache(10, 16, 8, 128, "fp8", "cpu", layout)
        desc, page_rows, head_rows, head_cols = decode_gluon.cache_descriptor(k)
        row, col = 3 * page_rows + 5 * head_rows, 5 * head_cols
        assert k.data_ptr() + row * desc.strides[0] + col == k[3, 0, 5].data_ptr()
        assert k.data_ptr() + (row + 15) * desc.strides[0] + col == k[3, 15, 5].data_ptr()
    # what it does not take: other page sizes and head dims, BF16, a sliced (non-contiguous) cache
    assert decode_gluon.cache_descriptor(allocate_cache(10, 32, 8, 128, "fp8", "cpu", "NHD")[0]) is None
    assert decode_gluon.cache_descriptor(allocate_cache(10, 16, 8, 256, "fp8", "cpu", "NHD")[0]) is None
    assert decode_gluon.cache_descriptor(allocate_cache(10, 16, 8, 128, "bfloat16", "cpu", "NHD")[0]) is None
    assert decode_gluon.cache_descriptor(allocate_cache(10, 16, 8, 128, "fp8", "cpu", "NHD")[0][:, :, :4]) is None
