"""The Hopper TurboQuant kernels (kvpolicy/kernels/tq_gluon.py for FP8 keys, tq_warp.py for centroid keys) on
planar caches, against the float64 reference, on a Hopper GPU. Gluon does not run under the Triton interpreter:
on the CPU only the routing and the host-side tables are checked.
"""

from __future__ import annotations

import pytest
import torch
from test_tq_decode import TOL_SAME_CACHE, _rel, _run

from kvpolicy.kernels.formats import TQ_FORMATS, WARP_ORDER_FORMATS

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


def _check(fmt: str, device: str, d: int, hq: int, window, sinks: bool, splits) -> None:
    """Decode with the defaults against the float64 reference: one-token and partly filled sequences (1025
    tokens: an odd number of tiles, the two-tile loop's last iteration computes one); the output is poisoned
    with NaN and stale slots hold NaN norms and scales."""
    out, ref, _ = run_planar(fmt, device, bsz=4, hq=hq, hkv=8, d=d, seq=(1, 37, 300, 1025), splits=splits,
                             window=window, sinks=sinks)
    assert not out.isnan().any(), "unwritten output or a read of an unattended (NaN) slot"
    assert _rel(out, ref) <= TOL_SAME_CACHE


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARPGROUP_FORMATS)
@pytest.mark.parametrize("d, hq", SHAPES)
@pytest.mark.parametrize("window, sinks, splits", CASES)
def test_gluon_matches_reference(fmt: str, d: int, hq: int, window, sinks: bool, splits, device: str) -> None:
    """The warpgroup kernel (k8v4): GQA 1-8, one-token and partly filled sequences, windows, sinks, forced and
    default splits, both head dims (128- and 64-token tiles)."""
    _check(fmt, device, d, hq, window, sinks, splits)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARPGROUP_FORMATS)
@pytest.mark.parametrize("d", [64, 128])
def test_gluon_lazy_max_redoes_tiles_where_scores_rise(fmt: str, d: int, device: str) -> None:
    """Keys growing 17-fold along 1025 tokens push the running max past the lazy reference (by more than
    `LAZY_MAX_MARGIN`) tile after tile: each such tile is redone with the exact max, and the output matches
    the float64 reference, with splits and without."""
    for splits in (1, 3):
        out, ref, _ = run_planar(fmt, device, bsz=2, hq=32, hkv=8, d=d, seq=(1025, 700), splits=splits,
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
    """Where the Gluon kernels cannot run, "gluon" raises with the reason; a slot cache falls back to Triton with
    "auto"; a planar cache has no Triton fallback and says so."""
    kw = dict(bsz=1, hq=8, hkv=2, d=64, seq=(40,))
    with pytest.raises(ValueError, match="cannot decode this call: GQA groups above 8"):
        run_planar("turboquant_4bit_nc", device, kernel="gluon", **{**kw, "hq": 32})
    with pytest.raises(ValueError, match="cannot decode this call: GQA groups above 8"):
        run_planar("turboquant_k8v4", device, kernel="gluon", **{**kw, "hq": 32})
    with pytest.raises(ValueError, match="head_dim 256: it takes 64 or 128"):
        run_planar("turboquant_3bit_nc", device, kernel="gluon", **{**kw, "d": 256})
    if not HOPPER:
        with pytest.raises(ValueError, match="cannot decode this call"):
            run_planar("turboquant_4bit_nc", device, kernel="auto", **kw)
    with pytest.raises(ValueError, match="planar cache is read by the Gluon kernels only"):
        run_planar("turboquant_4bit_nc", device, kernel="triton", **kw)
    out, ref, _ = _run("turboquant_4bit_nc", device, kernel="auto", **kw)
    assert _rel(out, ref) <= TOL_SAME_CACHE
    with pytest.raises(ValueError, match="kernel must be"):
        _run("turboquant_4bit_nc", device, kernel="cuda", **kw)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARP_ORDER_FORMATS)
@pytest.mark.parametrize("d, hq", SHAPES + [(64, 8)])
@pytest.mark.parametrize("window, sinks, splits", CASES + [(None, True, 32), (200, False, 40)])
def test_per_warp_kernel_matches_reference(fmt: str, d: int, hq: int, window, sinks: bool, splits,
                                           device: str) -> None:
    """`tq_warp`'s per-warp mma.sync kernel against the float64 reference over the int8 centroids: two pages per
    warp at head_dim 128, four at 64, the query rotated in the prologue (groups of 8, 4 and 1 in the M = 16
    product); split calls merged in the kernel, sinks in the denominator. 32 splits of 1025 tokens leave most
    splits empty (log-sum-exp -inf); 40 is past `MAX_FUSED_SPLITS` (the merge kernel)."""
    from kvpolicy.kernels import tq_warp

    _check(fmt, device, d, hq, window, sinks, splits)
    assert all(not c.any() for c in tq_warp._ARRIVALS.values()), "a counter left non-zero for the next launch"


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_3bit_nc"])
def test_per_warp_fused_merge_replays_in_a_cuda_graph(fmt: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The counters a fused merge leaves zeroed serve the next launch: eager calls, then a CUDA graph of two
    calls replayed three times, all bit-identical (the same partials merged in the same order). A first call
    inside a capture finds no counters and takes the merge kernel: the same output up to rounding."""
    from kvpolicy.kernels import tq_warp
    from kvpolicy.kernels.tq_decode import decode_attention_tq
    from kvpolicy.kernels.turboquant import planar_from_slots
    from test_tq_decode import _paged

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
    assert all(not c.any() for c in tq_warp._ARRIVALS.values())

    monkeypatch.setattr(tq_warp, "_ARRIVALS", {})
    cold = torch.empty_like(query)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(cold)
    graph.replay()
    torch.cuda.synchronize()
    assert not tq_warp._ARRIVALS, "counters allocated inside a capture"
    assert _rel(cold.double(), eager.double()) <= 1e-5


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARP_ORDER_FORMATS)
@pytest.mark.parametrize("d, hq", SHAPES)
@pytest.mark.parametrize("window, sinks, splits", CASES + [(None, False, 40)])
@pytest.mark.parametrize("weight", [1.125, 2.0])
def test_per_warp_first_wave_weights_match_reference(fmt: str, d: int, hq: int, window, sinks: bool, splits,
                                                     weight: float, device: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The split-major grid and splits cut by a first-wave weight (3bit_nc's 18/16 and a larger one), applied
    to every call and format here, with an SM count of 20 (so that most groups have splits of both waves),
    windows, sinks and 40 splits of 1025 tokens (empty splits)."""
    from kvpolicy.kernels import tq_warp

    monkeypatch.setattr(tq_warp, "sm_count", lambda device: 20)
    monkeypatch.setattr(tq_warp, "FIRST_WAVE_WEIGHT", {fmt: weight})
    monkeypatch.setattr(tq_warp, "FIRST_WAVE_MIN_TILES", 0)
    _check(fmt, device, d, hq, window, sinks, splits)


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("fmt", WARP_ORDER_FORMATS)
@pytest.mark.parametrize("d, hq", [(64, 64), (128, 32)])
def test_per_warp_reads_pages_past_8_gib(fmt: str, d: int, hq: int, device: str) -> None:
    """A cache of 8 GiB or more takes 64-bit page offsets (`tq_warp._load_w`'s OFF32 off): the same pages moved
    to the end of a 9 GiB cache, past word 2^31, decode as they did in a small one."""
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
@pytest.mark.parametrize("fmt, d", [("turboquant_4bit_nc", 128), ("turboquant_4bit_nc", 64), ("turboquant_3bit_nc", 128),
                                    ("turboquant_3bit_nc", 64), ("turboquant_k3v4_nc", 64)])
@pytest.mark.parametrize("head", [0, 1, 6])
def test_per_warp_lazy_max_rescales_a_lone_rising_head(fmt: str, d: int, head: int, device: str) -> None:
    """GQA 8, and only head `head` of each group sees its scores rise along the sequence (the others fall): a
    warp skips its O^T rescale only when no head's reference max moved (`tq_warp.rescale_ptx`'s vote over each
    thread's two heads), so that head's output still matches the float64 reference, with splits and without,
    whichever accumulator column it sits in (the sums' accumulator row of the head is rescaled too)."""
    for splits in (1, 3):
        out, ref, _ = run_planar(fmt, device, bsz=2, hq=64, hkv=8, d=d, seq=(1025, 700), splits=splits,
                                 rising_head=head)
        assert not out.isnan().any()
        assert _rel(out, ref) <= TOL_SAME_CACHE, f"splits {splits}"


@pytest.mark.parametrize("d", [64, 128])
def test_warpgroup_order_table_is_the_fp16_operand_order(d: int) -> None:
    """What the warpgroup kernel loads from its order pointer: the query's coordinate at each K index of the
    score MMA, a permutation of the head dims."""
    tq_gluon = pytest.importorskip("kvpolicy.kernels.tq_gluon", reason="this Triton has no Gluon API")
    table = tq_gluon._order_table(d, "cpu")
    assert table.dtype == torch.int32 and table.shape == (d,)
    assert torch.equal(table.long(), tq_gluon.operand_order(d)) and sorted(table.tolist()) == list(range(d))


@pytest.mark.parametrize("fmt", WARP_ORDER_FORMATS)
def test_per_warp_table_word_is_the_prmt_tables_first_word(fmt: str) -> None:
    """The word the per-warp kernel loads into a register for the int8 programs: the PRMT table's first four
    bytes. A wrong word would decode every key to wrong centroids, which only the GPU tests would otherwise see."""
    tq_warp = pytest.importorskip("kvpolicy.kernels.tq_warp", reason="this Triton has no Gluon API")
    from kvpolicy.kernels.formats import tq_layout
    from kvpolicy.kernels.turboquant import int8_centroids, int8_table_word

    bits = tq_layout(fmt, 64).key_bits
    word = tq_warp._table_word(fmt, "cpu")
    b = int8_centroids(bits)[0]
    assert word.dtype == torch.int32 and word.shape == (1,)
    assert int(word) == int8_table_word(bits) == b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24


@pytest.mark.gpu
@hopper_only
@pytest.mark.parametrize("context", [4096, 16384, 65536, 131072])
@pytest.mark.parametrize("fmt", GLUON_FORMATS)
def test_gluon_needle_long_context(fmt: str, context: int) -> None:
    """bench_decode's needle (margin 13.5, Llama layer, batch 4) at 4k-128k through the store kernel writing
    planar pages and the Gluon kernels reading them: every head retrieves."""
    from kvpolicy.kernels.turboquant import allocate_tq_planar_cache
    from test_tq_decode import gpu_needle

    retrieved, bits = gpu_needle(fmt, context, allocate_tq_planar_cache, kernel="gluon")
    print(f"needle {fmt} gluon {context}: retrieved {retrieved:.2f} bits {bits:.3f}")
    assert retrieved >= 0.95, f"{fmt} at {context}: {retrieved:.2f} of heads ({bits:.3f} of bits)"


@pytest.mark.parametrize("fmt", GLUON_FORMATS)
@pytest.mark.parametrize("d", [64, 128])
def test_each_format_goes_to_the_kernel_written_for_its_keys(fmt: str, d: int) -> None:
    """Centroid keys go to the per-warp kernel, FP8 keys (k8v4) to the warpgroup one (each reads the other's
    pages wrongly): a route to the wrong one would fail on the GPU alone. Each takes these shapes, and the
    resident-program count that sizes its splits comes from its own register table."""
    pytest.importorskip("kvpolicy.kernels.tq_warp", reason="this Triton has no Gluon API")
    from kvpolicy.kernels import tq_decode, tq_gluon, tq_warp

    module = tq_decode._gluon_module(fmt)
    assert module is (tq_warp if fmt in WARP_ORDER_FORMATS else tq_gluon)
    assert fmt in module.FORMATS and tq_decode.gluon_refusal(fmt, d, 8, 16) == ""
    other = tq_gluon if module is tq_warp else tq_warp
    assert other.refusal(fmt, d, 8, 16).startswith("it decodes")
    if module is tq_warp:
        assert tq_warp.block_n(d) in (128, 256) and tq_warp.REGISTERS[fmt][d] <= 255
    else:
        assert (d, tq_gluon.block_n(d)) in tq_gluon.REGISTERS
