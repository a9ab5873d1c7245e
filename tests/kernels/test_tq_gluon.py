"""The Gluon TurboQuant kernel (kernels/tq_gluon.py) on planar caches, against the float64 reference, on a
Hopper GPU. Gluon does not run under the Triton interpreter: on the CPU only the routing is checked.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from test_tq_decode import TOL_SAME_CACHE, _rel, _run

from kvpolicy.kernels.turboquant import TQ_FORMATS, WARP_ORDER_FORMATS

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
GLUON_FORMATS = list(TQ_FORMATS)
WARPGROUP_FORMATS = [f for f in TQ_FORMATS if f not in WARP_ORDER_FORMATS]
"""The warpgroup kernel's formats: the others' pages are in the per-warp kernel's order."""
hopper_only = pytest.mark.skipif(not HOPPER, reason="the Gluon kernel is written for sm_90")


def run_planar(fmt, device, kernel="gluon", **kw):
    """`_run` on a planar copy of the reference-packed cache, with the Gluon kernel by default, against the
    reference over the centroids the kernel multiplies (int8 for centroid keys; the Triton kernel's are
    the exact ones in fp16)."""
    return _run(fmt, device, planar=True, kernel=kernel, int8_keys=kernel != "triton", **kw)


SHAPES = [(128, 32), (64, 64), (128, 8)]
"""(head_dim, query heads) with 8 KV heads: GQA 4, 8 and 1."""
CASES = [(None, False, 1), (None, True, 3), (48, True, 1), (200, False, 2), (None, False, None)]
"""(sliding window, sinks, splits; None: the default split count)."""


def _check_config(cfg, fmt: str, device: str, monkeypatch: pytest.MonkeyPatch, d: int, hq: int, window, sinks: bool,
                  splits) -> None:
    """Decode with `cfg` as the default config against the float64 reference: one-token and partly filled
    sequences; the output is poisoned with NaN and stale slots hold NaN norms and scales."""
    from kvpolicy.kernels import tq_gluon

    monkeypatch.setattr(tq_gluon, "default_config", lambda fmt, head_dim: cfg)
    out, ref, _ = run_planar(fmt, device, bsz=4, hq=hq, hkv=8, d=d, seq=(1, 37, 300, 1025), splits=splits,
                             window=window, sinks=sinks)
    assert not out.isnan().any(), "unwritten output or a read of an unattended (NaN) slot"
    assert _rel(out, ref) <= TOL_SAME_CACHE


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARPGROUP_FORMATS)
@pytest.mark.parametrize("d, hq", SHAPES)
@pytest.mark.parametrize("window, sinks, splits", CASES)
@pytest.mark.parametrize("tile", [64, 128])
def test_gluon_matches_reference(fmt: str, d: int, hq: int, window, sinks: bool, splits, tile: int, device: str,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """GQA 1-8, one-token and partly filled sequences, windows, sinks, forced and default splits, both tiles;
    the output is poisoned with NaN and stale slots hold NaN norms and scales."""
    from kvpolicy.kernels import tq_gluon

    _check_config(tq_gluon.TQGluonConfig(block_n=tile), fmt, device, monkeypatch, d, hq, window, sinks, splits)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARPGROUP_FORMATS)
@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("tile", [64, 128])
def test_gluon_lazy_max_redoes_tiles_where_scores_rise(fmt: str, lazy: bool, tile: int, device: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys growing 17-fold along 1025 tokens push the running max past the lazy reference (by more than
    `LAZY_MAX_MARGIN`) tile after tile: each such tile is redone with the exact max, and the output matches
    the float64 reference as the exact-max kernel's does, with splits and without."""
    from kvpolicy.kernels import tq_gluon

    monkeypatch.setattr(tq_gluon, "default_config",
                        lambda fmt, head_dim: tq_gluon.TQGluonConfig(block_n=tile, lazy_max=lazy))
    for splits in (1, 3):
        out, ref, _ = run_planar(fmt, device, bsz=2, hq=32, hkv=8, d=128, seq=(1025, 700), splits=splits,
                                 key_growth=64.0)
        assert not out.isnan().any()
        assert _rel(out, ref) <= TOL_SAME_CACHE, f"splits {splits}"


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", GLUON_FORMATS)
def test_gluon_agrees_with_triton_kernel(fmt: str, device: str) -> None:
    """Same cache contents (planar for Gluon, slots for Triton), same fp16 query: the two differ in summation
    order and, for centroid keys, in the centroids they multiply (int8 against fp16: the two references'
    difference), and Gluon adds nothing to the format's own error against unquantized attention."""
    case = dict(bsz=2, hq=32, hkv=8, d=128, seq=(4099, 9001))
    torch.manual_seed(0)
    out_g, ref, raw = run_planar(fmt, device, outliers=True, **case)
    torch.manual_seed(0)
    out_t, ref_t, _ = _run(fmt, device, outliers=True, **case)
    assert _rel(out_g, ref) <= TOL_SAME_CACHE
    assert _rel(out_g, out_t) <= TOL_SAME_CACHE + _rel(ref, ref_t)
    assert _rel(out_g, raw) <= 1.1 * _rel(out_t, raw) + 1e-3


def test_gluon_routing_says_why(device: str) -> None:
    """Where the Gluon kernel cannot run, "gluon" raises with the reason; a slot cache falls back to Triton with
    "auto"; a planar cache has no Triton fallback and says so."""
    kw = dict(bsz=1, hq=8, hkv=2, d=64, seq=(40,))
    with pytest.raises(ValueError, match="cannot decode this call: GQA groups above 8"):
        run_planar("turboquant_4bit_nc", device, kernel="gluon", **{**kw, "hq": 32})
    with pytest.raises(ValueError, match="head_dim 256: it takes 64 or 128"):
        run_planar("turboquant_3bit_nc", device, kernel="gluon", **{**kw, "d": 256})
    if not HOPPER:
        with pytest.raises(ValueError, match="cannot decode this call"):
            run_planar("turboquant_4bit_nc", device, kernel="auto", **kw)
    with pytest.raises(ValueError, match="planar cache is read by the Gluon kernel only"):
        run_planar("turboquant_4bit_nc", device, kernel="triton", **kw)
    out, ref, _ = _run("turboquant_4bit_nc", device, kernel="auto", **kw)
    assert _rel(out, ref) <= TOL_SAME_CACHE
    with pytest.raises(ValueError, match="kernel must be"):
        _run("turboquant_4bit_nc", device, kernel="cuda", **kw)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARP_ORDER_FORMATS)
@pytest.mark.parametrize("d, hq", SHAPES)
@pytest.mark.parametrize("window, sinks, splits", CASES)
@pytest.mark.parametrize("block_n, maxnreg, ahead, sum_pages", [(64, None, 2, False), (64, 128, 2, False),
                                                                (64, None, 1, False), (128, None, 2, False),
                                                                (128, None, 2, True), (128, 128, 1, True)])
def test_per_warp_kernel_matches_reference(fmt: str, d: int, hq: int, window, sinks: bool, splits, block_n: int,
                                           maxnreg, ahead: int, sum_pages: bool, device: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`tq_warp`'s per-warp mma.sync kernel against the float64 reference over the int8 centroids, the shapes
    of the warpgroup kernel's test: one or two pages per warp, with and without a register cap, pages loaded
    one or two tiles ahead, the two pages' softmax sums kept apart or added in-thread (`sum_pages`)."""
    from kvpolicy.kernels import tq_gluon

    cfg = tq_gluon.TQGluonConfig(block_n=block_n, per_warp=True, maxnreg=maxnreg, pages_ahead=ahead,
                                 sum_pages=sum_pages)
    _check_config(cfg, fmt, device, monkeypatch, d, hq, window, sinks, splits)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARP_ORDER_FORMATS)
@pytest.mark.parametrize("window, sinks, splits", CASES)
@pytest.mark.parametrize("sum_pages", [False, True])
def test_per_warp_four_pages_matches_reference(fmt: str, window, sinks: bool, splits, sum_pages: bool, device: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Four pages per warp (256-token tiles) at head_dim 64, 4bit_nc's default there, with the pages' softmax sums
    apart or added in-thread (3bit_nc without them spills 8 bytes in the sm_90 compile; it must still be right)."""
    from kvpolicy.kernels import tq_gluon

    cfg = tq_gluon.TQGluonConfig(block_n=256, per_warp=True, sum_pages=sum_pages)
    _check_config(cfg, fmt, device, monkeypatch, 64, 64, window, sinks, splits)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARP_ORDER_FORMATS)
@pytest.mark.parametrize("window, sinks, splits", CASES)
@pytest.mark.parametrize("d, hq, block_n, ahead, unroll, mma_sums", [
    (64, 64, 256, 2, True, False), (128, 32, 128, 2, True, False), (128, 8, 64, 1, True, False),
    (64, 64, 256, 2, True, True), (64, 64, 256, 2, False, True), (128, 32, 128, 2, True, True),
    (128, 8, 128, 1, False, True)])
def test_per_warp_unrolled_and_mma_sums_match_reference(fmt: str, window, sinks: bool, splits, d: int, hq: int,
                                                        block_n: int, ahead: int, unroll: bool, mma_sums: bool,
                                                        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tiles per loop iteration (`TQGluonConfig.unroll`): the register sets take turns, and where a split has
    an odd number of tiles (1025 tokens are 5 tiles of 256, 9 of 128) its last iteration computes one tile
    only; the block table one or two tiles ahead. The softmax sums and the sums of P x zero point by mma.sync,
    P x scale in f16x2 on the fields as loaded (`TQGluonConfig.mma_sums`), with one or two tiles per
    iteration: partial tiles mask each half of a field word on its own token (stale slots hold NaN scales and
    zero points), GQA 8, 4 and 1."""
    from kvpolicy.kernels import tq_gluon

    cfg = tq_gluon.TQGluonConfig(block_n=block_n, per_warp=True, pages_ahead=ahead, sum_pages=block_n > 64,
                                 unroll=unroll, mma_sums=mma_sums)
    _check_config(cfg, fmt, device, monkeypatch, d, hq, window, sinks, splits)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARP_ORDER_FORMATS)
@pytest.mark.parametrize("window, sinks, splits", CASES)
@pytest.mark.parametrize("d, hq", [(64, 64), (128, 32), (128, 8), (64, 8)])
def test_per_warp_rotating_the_query_in_the_kernel_matches_reference(fmt: str, window, sinks: bool, splits, d: int,
                                                                     hq: int, device: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`TQGluonConfig.rotate_query`: the kernel rotates the raw bf16 query in its prologue (the GQA group's
    rows of the M = 16 product, the rest masked: groups of 8, 4 and 1) instead of reading the rotated one; the
    format's default configuration otherwise (which sets it too: this keeps the test on it if that changes)."""
    from kvpolicy.kernels import tq_gluon

    cfg = dataclasses.replace(tq_gluon.default_config(fmt, d), rotate_query=True)
    _check_config(cfg, fmt, device, monkeypatch, d, hq, window, sinks, splits)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARP_ORDER_FORMATS)
@pytest.mark.parametrize("d, hq", SHAPES)
@pytest.mark.parametrize("window, sinks, splits", CASES + [(None, True, 32), (200, False, 40)])
def test_per_warp_fused_merge_matches_reference(fmt: str, d: int, hq: int, window, sinks: bool, splits,
                                                device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`TQGluonConfig.fused_merge`: the last split of each group merges the partials in the kernel, sinks in
    the denominator, GQA 8, 4 and 1. 32 splits of 1025 tokens leave most splits empty (log-sum-exp -inf); 40 is
    past `MAX_FUSED_SPLITS` (the merge kernel)."""
    from kvpolicy.kernels import tq_gluon

    cfg = dataclasses.replace(tq_gluon.default_config(fmt, d), fused_merge=True)
    _check_config(cfg, fmt, device, monkeypatch, d, hq, window, sinks, splits)
    assert all(not c.any() for c in tq_gluon._ARRIVALS.values()), "a counter left non-zero for the next launch"


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
def test_per_warp_fused_merge_replays_in_a_cuda_graph(fmt: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The counters a fused merge leaves zeroed serve the next launch: eager calls, then a CUDA graph of two
    calls replayed three times, all bit-identical (the same partials merged in the same order). A first call
    inside a capture finds no counters and takes the merge kernel: the same output up to rounding."""
    from kvpolicy.kernels import tq_gluon
    from kvpolicy.kernels.tq_decode import decode_attention_tq
    from kvpolicy.kernels.turboquant import planar_from_slots
    from test_tq_decode import _paged

    cfg = dataclasses.replace(tq_gluon.default_config(fmt, 64), fused_merge=True)
    monkeypatch.setattr(tq_gluon, "default_config", lambda fmt, head_dim: cfg)
    seq = (3000, 1025, 17)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    cache, tables = _paged(fmt, [torch.randn(n, 8, 64) for n in seq], [torch.randn(n, 8, 64) for n in seq],
                           seq_lens, 16, device)
    cache = planar_from_slots(cache, fmt, 64).to(device)
    seq_lens = seq_lens.to(device)
    query = torch.randn(3, 64, 64, device=device)
    sinks = torch.randn(64, device=device)

    def step(out):
        return decode_attention_tq(query, cache, tables, seq_lens, fmt, sinks=sinks, out=out, kernel="gluon",
                                   num_splits=5)

    eager = step(torch.empty_like(query)).clone()
    assert torch.equal(step(torch.empty_like(query)), eager)
    outs = [torch.empty_like(query), torch.empty_like(query)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(outs[0])
        step(outs[1])
    for _ in range(3):
        outs[0].fill_(float("nan"))
        outs[1].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[0], eager) and torch.equal(outs[1], eager)
    assert all(not c.any() for c in tq_gluon._ARRIVALS.values())

    monkeypatch.setattr(tq_gluon, "_ARRIVALS", {})
    cold = torch.empty_like(query)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(cold)
    graph.replay()
    torch.cuda.synchronize()
    assert not tq_gluon._ARRIVALS, "counters allocated inside a capture"
    assert _rel(cold.double(), eager.double()) <= 1e-5


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARP_ORDER_FORMATS)
@pytest.mark.parametrize("d, hq", SHAPES)
@pytest.mark.parametrize("window, sinks, splits", CASES + [(None, False, 40)])
@pytest.mark.parametrize("weight", [1.25, 2.0])
def test_per_warp_first_wave_weights_match_reference(fmt: str, d: int, hq: int, window, sinks: bool, splits,
                                                     weight: float, device: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`TQGluonConfig.first_wave_weight`: the split-major grid and splits cut by weight, with an SM count of 20
    (so that most groups have splits of both waves), windows, sinks and 40 splits of 1025 tokens (empty splits)."""
    from kvpolicy.kernels import tq_gluon, tq_warp

    monkeypatch.setattr(tq_warp, "sm_count", lambda device: 20)
    cfg = dataclasses.replace(tq_gluon.default_config(fmt, d), first_wave_weight=weight, first_wave_min_tiles=0)
    _check_config(cfg, fmt, device, monkeypatch, d, hq, window, sinks, splits)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
@pytest.mark.parametrize("d, hq", [(64, 64), (128, 32)])
@pytest.mark.parametrize("rotate, first_wave", [(True, 1.0), (False, 1.0), (True, 1.25)])
def test_per_warp_stamps_are_ordered_and_leave_the_output(fmt: str, d: int, hq: int, rotate: bool, first_wave: float,
                                                          device: str) -> None:
    """bench/probe_tq_stamps.py's timeline (`tq_gluon.STAMPS`): the stamped kernel writes the plain kernel's output
    bit for bit; in every program the points come in the kernel's order (entry, seq_len, query loads, product,
    MMA operand, scale, first tile, loop end, count); exactly one program of each (sequence, KV head) merges,
    after every program of its group ended its loop; the SM ids are the GPU's."""
    from kvpolicy.kernels import tq_gluon
    from kvpolicy.kernels.tq_decode import LOG2E, _rotated_query
    from kvpolicy.kernels.tq_warp import decode_tq_warp
    from kvpolicy.kernels.turboquant import planar_from_slots
    from test_tq_decode import _paged

    seq = (3000, 1025, 17)
    splits, hkv = 5, 8
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    cache, tables = _paged(fmt, [torch.randn(n, hkv, d) for n in seq], [torch.randn(n, hkv, d) for n in seq],
                           seq_lens, 16, device)
    cache, seq_lens = planar_from_slots(cache, fmt, d).to(device), seq_lens.to(device)
    query = torch.randn(len(seq), hq, d, device=device)
    sinks = torch.randn(hq, device=device)
    cfg = dataclasses.replace(tq_gluon.default_config(fmt, d), rotate_query=rotate, fused_merge=True,
                              first_wave_weight=first_wave, first_wave_min_tiles=0)
    scale = d ** -0.5
    q16, q_scale = (query, scale * LOG2E) if rotate else (_rotated_query(query, fmt, hkv, scale), 1.0)
    stamps = torch.zeros(len(seq) * splits * hkv, tq_gluon.STAMPS_ROW, dtype=torch.int64, device=device)

    def call(st):
        return decode_tq_warp(query, q16, q_scale, cache, fmt, tables, seq_lens, sliding_window=None, sinks=sinks,
                              splits=splits, out=torch.empty_like(query), cfg=cfg, stamps=st).clone()

    plain = call(None)
    assert torch.equal(call(stamps), plain)
    at = {n: stamps[:, i].cpu() for i, n in enumerate(tq_gluon.STAMPS)}
    order = ["entry", "seq_len", "q_loaded"] + (["rot_loaded", "rotated"] if rotate else []) + [
        "q_operand", "query", "first_tile", "loop_end", "counted"]
    assert (at["entry"] > 0).all()
    for a, b in itertools.pairwise(order):
        assert (at[a] <= at[b]).all(), f"{a} after {b}"
    groups = {}
    for row in range(stamps.shape[0]):  # the linear block id: grid (hkv, splits, seq), or (seq x hkv, splits)
        groups.setdefault(row % (len(seq) * hkv) if first_wave != 1.0 else (row // (splits * hkv), row % hkv),
                          []).append(row)
    for rows in groups.values():
        merged = [r for r in rows if at["merged"][r] > 0]
        assert len(merged) == 1, "one merge per (sequence, KV head)"
        # every split's loop ended (and stored its partial) before the merging program counted last
        assert at["merged"][merged[0]] >= max(at["loop_end"][r] for r in rows)
        assert at["merged"][merged[0]] >= at["counted"][merged[0]]
    assert (at["smid"] < torch.cuda.get_device_properties(device).multi_processor_count).all()


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARP_ORDER_FORMATS)
@pytest.mark.parametrize("d, hq", [(64, 64), (128, 32)])
def test_per_warp_reads_pages_past_8_gib(fmt: str, d: int, hq: int, device: str) -> None:
    """A cache of 8 GiB or more takes 64-bit page offsets (`tq_warp._load_w`'s OFF32 off): the same pages moved
    to the end of a 9 GiB cache, past word 2^31, decode as they did in a small one (the default config)."""
    from kvpolicy.kernels.tq_decode import decode_attention_tq
    from kvpolicy.kernels.turboquant import planar_from_slots
    from test_tq_decode import _paged

    seq = (300, 1025)
    key = [torch.randn(n, 8, d) for n in seq]
    value = [torch.randn(n, 8, d) for n in seq]
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    cache, tables = _paged(fmt, key, value, seq_lens, 16, device)
    cache = planar_from_slots(cache, fmt, d).to(device)
    extra = (9 << 30) // cache[0].nbytes  # pages before the case's
    big = torch.empty((extra + cache.shape[0], *cache.shape[1:]), dtype=cache.dtype, device=device)
    assert big.nbytes // 4 >= 2**31
    big[extra:] = cache
    query = torch.randn(2, hq, d, device=device)
    outs = []
    for c, t in ((cache, tables), (big, torch.where(tables < cache.shape[0], tables + extra, tables))):
        out = torch.full((2, hq, d), float("nan"), device=device)
        decode_attention_tq(query, c, t.to(device), seq_lens.to(device), fmt, out=out, kernel="gluon")
        outs.append(out)
    del big
    assert not outs[0].isnan().any()
    assert _rel(outs[1].double(), outs[0].double()) <= 1e-6


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARP_ORDER_FORMATS)
@pytest.mark.parametrize("window, sinks, splits", CASES)
@pytest.mark.parametrize("unroll", [False, True])
def test_per_warp_two_pages_under_a_register_cap_match_reference(fmt: str, window, sinks: bool, splits,
                                                                  unroll: bool, device: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pages per warp at head_dim 64 with the sums by mma.sync, the query rotated in the kernel and at most
    128 registers per thread (4 programs per SM, the split count sized for them): the compile may keep values
    in fewer registers or spill (3bit_nc with two tiles per iteration spilled 56 bytes before its pages were in
    thread order), and must stay exact."""
    from kvpolicy.kernels import tq_gluon

    cfg = tq_gluon.TQGluonConfig(block_n=128, per_warp=True, sum_pages=True, unroll=unroll, mma_sums=True,
                                 rotate_query=True, maxnreg=128)
    _check_config(cfg, fmt, device, monkeypatch, 64, 64, window, sinks, splits)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt, d, block_n, sum_pages, mma_sums", [
    ("turboquant_4bit_nc", 128, 64, False, False), ("turboquant_4bit_nc", 64, 64, False, False),
    ("turboquant_3bit_nc", 128, 64, False, False), ("turboquant_4bit_nc", 64, 128, False, False),
    ("turboquant_4bit_nc", 64, 256, True, False), ("turboquant_3bit_nc", 128, 128, True, False),
    ("turboquant_4bit_nc", 64, 256, True, True), ("turboquant_3bit_nc", 128, 128, True, True)])
@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("head", [0, 1, 6])
def test_per_warp_lazy_max_rescales_a_lone_rising_head(fmt: str, d: int, block_n: int, sum_pages: bool,
                                                       mma_sums: bool, lazy: bool, head: int, device: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """GQA 8, and only head `head` of each group sees its scores rise along the sequence (the others fall): a
    warp skips its O^T rescale only when no head's reference max moved (`tq_warp.rescale_ptx`'s vote over each
    thread's two heads), so that head's output still matches the float64 reference, with splits and without,
    whichever accumulator column it sits in (with `mma_sums`, the sums' accumulator row of the head is rescaled
    too)."""
    from kvpolicy.kernels import tq_gluon

    cfg = tq_gluon.TQGluonConfig(block_n=block_n, per_warp=True, lazy_max=lazy, sum_pages=sum_pages,
                                 mma_sums=mma_sums)
    monkeypatch.setattr(tq_gluon, "default_config", lambda fmt, head_dim: cfg)
    for splits in (1, 3):
        out, ref, _ = run_planar(fmt, device, bsz=2, hq=64, hkv=8, d=d, seq=(1025, 700), splits=splits,
                                 rising_head=head)
        assert not out.isnan().any()
        assert _rel(out, ref) <= TOL_SAME_CACHE, f"splits {splits}"


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARPGROUP_FORMATS)
def test_gluon_pages_one_tile_ahead_matches_reference(fmt: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`TQGluonConfig.pages_ahead` 1 (the block table read one tile ahead, as before) in the warpgroup kernel."""
    from kvpolicy.kernels import tq_gluon

    cfg = tq_gluon.TQGluonConfig(block_n=64, pages_ahead=1)
    monkeypatch.setattr(tq_gluon, "default_config", lambda fmt, head_dim: cfg)
    for splits in (1, 3):
        out, ref, _ = run_planar(fmt, device, bsz=4, hq=32, hkv=8, d=128, seq=(1, 37, 300, 1025), splits=splits,
                                 window=200 if splits == 1 else None, sinks=True)
        assert not out.isnan().any()
        assert _rel(out, ref) <= TOL_SAME_CACHE, f"splits {splits}"


@pytest.mark.parametrize("fmt", GLUON_FORMATS)
@pytest.mark.parametrize("d", [64, 128])
def test_kernel_table_holds_the_query_order_then_the_prmt_table_word(fmt: str, d: int) -> None:
    """What the kernel loads from its order pointer: the query's coordinate at each K index of the score MMA,
    then (centroid keys) the PRMT table's first word that the int8 programs take as a register. A wrong word
    would decode every key to wrong centroids, which only the GPU tests would otherwise see."""
    from kvpolicy.kernels import tq_gluon
    from kvpolicy.kernels.turboquant import int8_centroids, int8_table_word, tq_layout

    table = tq_gluon._kernel_table(fmt, d, "cpu")
    assert table.dtype == torch.int32 and table.shape == (d + 1,)
    assert torch.equal(table[:d].long(), tq_gluon.query_order(fmt, d))
    lay = tq_layout(fmt, d)
    if lay.key_fp8:
        assert table[d] == 0
    else:
        b = int8_centroids(lay.key_bits)[0]
        assert int(table[d]) == int8_table_word(lay.key_bits) == b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24


@pytest.mark.parametrize("fmt", WARP_ORDER_FORMATS)
def test_warpgroup_kernel_refuses_pages_in_the_per_warp_order(fmt: str) -> None:
    """A config without `per_warp` for a format whose pages are in the per-warp kernel's order is refused with
    what to do, before anything is launched (the warpgroup kernel would read the bytes as rows)."""
    from kvpolicy.kernels import tq_gluon
    from kvpolicy.kernels.turboquant import allocate_tq_planar_cache

    d = 64
    query = torch.zeros(1, 8, d)
    cache = allocate_tq_planar_cache(2, 16, 1, d, fmt)
    with pytest.raises(ValueError, match="per_warp=True"):
        tq_gluon.decode_tq_gluon(query, query, 1.0, cache, fmt, torch.zeros(1, 2, dtype=torch.int32),
                                 torch.tensor([20], dtype=torch.int32), sliding_window=None, sinks=None, splits=1,
                                 out=torch.empty_like(query), config=tq_gluon.TQGluonConfig(block_n=64))


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("context", [4096, 16384, 65536, 131072])
@pytest.mark.parametrize("fmt", GLUON_FORMATS)
def test_gluon_needle_long_context(fmt: str, context: int) -> None:
    """bench_decode's needle (margin 13.5, Llama layer, batch 4) at 4k-128k through the store kernel writing
    planar pages and the Gluon kernel reading them: every head retrieves."""
    from kvpolicy.kernels.turboquant import allocate_tq_planar_cache
    from test_tq_decode import gpu_needle

    retrieved, bits = gpu_needle(fmt, context, allocate_tq_planar_cache, kernel="gluon")
    print(f"needle {fmt} gluon {context}: retrieved {retrieved:.2f} bits {bits:.3f}")
    assert retrieved >= 0.95, f"{fmt} at {context}: {retrieved:.2f} of heads ({bits:.3f} of bits)"


@pytest.mark.parametrize("fmt", GLUON_FORMATS)
@pytest.mark.parametrize("d", [64, 128])
def test_default_config_sends_only_per_warp_formats_to_the_per_warp_kernel(fmt: str, d: int) -> None:
    """The per-warp kernel decodes centroid keys only (not k8v4): a default that routed another format there
    would fail on the GPU alone. The resident-program count of its configs (which sizes the splits) comes
    from its own register table."""
    from kvpolicy.kernels import tq_gluon, tq_warp

    cfg = tq_gluon.default_config(fmt, d)
    assert cfg.pages_ahead in (1, 2)
    if fmt == "turboquant_k8v4":
        assert not cfg.per_warp
    # the measured choices (NOTES_TQ.md, twelfth session): every format with centroid keys
    assert cfg.per_warp == (fmt in tq_warp.FORMATS)
    if cfg.per_warp:
        assert (d, cfg.block_n) in tq_warp.REGISTERS[fmt]
        regs = cfg.maxnreg or tq_warp.REGISTERS[fmt][d, cfg.block_n]
        assert regs <= 255, "over 255 registers: the compile would spill, not the count the splits assume"
    else:
        assert (d, cfg.block_n) in tq_gluon.REGISTERS[fmt]  # programs_per_sm reads it
