"""decode_attention against the float64 reference.

Error is ||out - ref|| / ||ref|| over the whole output. Caches are filled by the
torch reference store (independent of the store kernel) after being poisoned
with NaN, and block tables point unused entries at NaN blocks, so any read of a
position the sequence does not attend turns the output into NaN.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvpolicy.kernels import launch
from kvpolicy.kernels.decode_attention import DecodeConfig, decode_attention
from kvpolicy.kernels.paged_store import allocate_cache, compute_kv_scales
from kvpolicy.kernels.reference import ref_decode_attention, ref_store_kv

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Tolerances, relative Frobenius error:
# - BF16 cache on the interpreter: dots run in fp32 on exact bf16 inputs, so only
#   fp32 rounding of exp2 and the sums remains (measured 1e-7 to 2.5e-7).
# - BF16 cache on a GPU: P is rounded to bf16 (2**-9 relative) for the P.V MMA.
# - FP8 cache: P is rounded to e4m3 (2**-4 relative per weight) for the P.V MMA;
#   with V = 1 + noise that averages down (measured 1.5e-3 to 2.5e-3 here).
# - FP8 query: the query is rounded to e4m3 too, which moves every logit
#   (measured 5e-3 to 1e-2 here).
TOL_BF16 = 1e-5 if INTERPRET else 1e-2
TOL_FP8 = 1e-2
TOL_FP8_QUERY = 3e-2



def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def make_case(
    device: str,
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_name: str = "bfloat16",
    block_size: int = 16,
    per_head: bool | None = None,
    value_offset: float = 0.0,
    layout: str = "NHD",
) -> dict:
    """A paged cache holding random K/V for each sequence, with scattered blocks and spare NaN blocks."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 2
    num_blocks = sum(blocks_per_seq) + 3
    kc, vc = allocate_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype_name, device, layout)
    for c in (kc, vc):
        if c.dtype == torch.float8_e4m3fn:
            c.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
        else:
            c.fill_(float("nan"))
    perm = torch.randperm(num_blocks)
    poison = perm[-1].item()  # never written: NaN throughout
    block_tables = torch.full((len(seq_lens), max_blocks), poison, dtype=torch.int32)
    total = sum(seq_lens)
    key = torch.randn(total, num_kv_heads, head_dim) * torch.linspace(0.5, 2.0, num_kv_heads)[:, None]
    value = torch.randn(total, num_kv_heads, head_dim) * 0.5 + value_offset
    slots, used, tok = [], 0, 0
    for b, n in enumerate(seq_lens):
        mine = perm[used : used + blocks_per_seq[b]]
        used += blocks_per_seq[b]
        block_tables[b, : len(mine)] = mine.int()
        pos = torch.arange(n)
        slots.append(mine[pos // block_size] * block_size + pos % block_size)
        tok += n
    key, value = key.to(device).bfloat16(), value.to(device).bfloat16()
    k_scale = v_scale = None
    if per_head is not None:
        k_scale, v_scale = compute_kv_scales(key, value, per_head)
    ref_store_kv(key, value, kc, vc, torch.cat(slots).to(device), k_scale, v_scale)
    query = (torch.randn(len(seq_lens), num_q_heads, head_dim) * 1.5).to(device).bfloat16()
    return dict(
        query=query,
        key_cache=kc,
        value_cache=vc,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        k_scale=k_scale,
        v_scale=v_scale,
    )


def run_and_check(case: dict, tol: float, **kwargs) -> float:
    inputs = dict(case)
    out = torch.full(inputs["query"].shape, float("nan"), dtype=torch.float32, device=inputs["query"].device)
    got = decode_attention(**inputs, out=out, **kwargs)
    assert got is out
    ref = ref_decode_attention(**inputs, **kwargs)
    assert not out.isnan().any(), "unwritten output or a read of an unattended (NaN) position"
    err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"
    return err


SEQ_LENS = [1, 37, 300]  # one token; partly filled last block; several tiles
SINKS = object()  # marker: draw sinks for the case


# The softmax denominator kept per position and summed after the loop (the GPU default for FP8 and for BF16
# at head_dim 64), on 64-token tiles.
DEFERRED = DecodeConfig(block_n=64, num_stages=2, defer_sum=True)
CONFIGS = {"default": None, "deferred": DEFERRED}


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("window, sinks, num_splits", [(None, None, 1), (48, SINKS, 3), (None, SINKS, None), (200, None, 2)])
def test_bf16_matches_reference(device: str, head_dim: int, config: str, window, sinks, num_splits) -> None:
    case = make_case(device, SEQ_LENS, num_q_heads=8, num_kv_heads=2, head_dim=head_dim)
    if sinks is SINKS:
        sinks = torch.randn(8, device=device) * 2
    run_and_check(case, TOL_BF16, sliding_window=window, sinks=sinks, num_splits=num_splits, config=CONFIGS[config])


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("config", ["default", "deferred"])
def test_fp8_matches_reference(device: str, head_dim: int, per_head: bool, config: str) -> None:
    case = make_case(device, SEQ_LENS, 16, 2, head_dim, "fp8", per_head=per_head, value_offset=1.0)
    sinks = torch.randn(16, device=device)
    config = CONFIGS[config]
    run_and_check(case, TOL_FP8, sinks=sinks, num_splits=2, config=config)
    run_and_check(case, TOL_FP8, sliding_window=40, num_splits=1, config=config)


@pytest.mark.parametrize("two_level", [True, False])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_fp8_query_and_two_level(device: str, two_level: bool, config: str) -> None:
    case = make_case(device, [53, 261], 8, 1, 128, "fp8", per_head=True, value_offset=1.0)
    config = CONFIGS[config]
    run_and_check(case, TOL_FP8, two_level=two_level, num_splits=1, config=config)
    run_and_check(case, TOL_FP8_QUERY, two_level=two_level, fp8_query=True, num_splits=2, config=config)


def test_two_level_toggle_is_the_same_function(device: str) -> None:
    """Off and on differ only in how the MMA accumulates; short contexts agree closely."""
    case = make_case(device, [300], 4, 1, 64, "fp8", per_head=False, value_offset=1.0)
    on = decode_attention(**case, two_level=True, num_splits=1)
    off = decode_attention(**case, two_level=False, num_splits=1)
    # Both round P to e4m3 identically; only accumulation order/precision differs (off: the fp8 MMA's
    # accumulator, a few hundred positions are not yet enough to lose much).
    assert rel_err(off.float(), on.double()) < (1e-6 if INTERPRET else 3e-2)


def test_splits_agree(device: str) -> None:
    """The log-sum-exp merge reproduces the unsplit result, sinks included."""
    case = make_case(device, [700, 5, 129], 4, 2, 64)
    sinks = torch.randn(4, device=device)
    whole = decode_attention(**case, sinks=sinks, num_splits=1, out=torch.empty(3, 4, 64, device=device))
    for splits in (2, 5, 16):  # 16 leaves empty splits for the short sequences
        part = decode_attention(**case, sinks=sinks, num_splits=splits, out=torch.empty(3, 4, 64, device=device))
        assert rel_err(part, whole.double()) < (1e-5 if INTERPRET else 5e-3)  # fp32 merge vs fp32 single pass


def test_empty_sequence_refused_and_gqa_groups(device: str) -> None:
    """An empty sequence is refused (seq_lens must be in 1..capacity); MHA (group 1) and a wide group (16)
    both map heads right."""
    with pytest.raises(ValueError, match="seq_lens must be in 1"):
        decode_attention(**make_case(device, [0, 19], 3, 3, 64))
    for q_heads, kv_heads in ((3, 3), (32, 2)):
        case = make_case(device, [1, 19], q_heads, kv_heads, 64)
        err = run_and_check(case, TOL_BF16, sinks=torch.zeros(q_heads, device=device), num_splits=2)
        assert err <= TOL_BF16


def test_query_dtypes_and_outputs(device: str) -> None:
    case = make_case(device, [77], 4, 1, 64)
    q32 = case["query"].float()
    out = decode_attention(**{**case, "query": q32})
    assert out.dtype == torch.float32
    out16 = decode_attention(**case)
    assert out16.dtype == torch.bfloat16
    ref = ref_decode_attention(**case)
    assert rel_err(out16, ref) < 1e-2  # bf16 output rounding (2**-9), truncated under the interpreter


def test_rejects_bad_inputs(device: str) -> None:
    case = make_case(device, [20], 4, 2, 64)
    with pytest.raises(ValueError, match="fp8_query"):
        decode_attention(**case, fp8_query=True)
    with pytest.raises(ValueError, match="block_tables"):
        decode_attention(**{**case, "block_tables": case["block_tables"].long()})
    with pytest.raises(ValueError, match="num_q_heads"):
        decode_attention(**{**case, "query": case["query"][:, :3].contiguous()})
    with pytest.raises(ValueError, match="sinks"):
        decode_attention(**case, sinks=torch.zeros(3, device=device))
    with pytest.raises(ValueError, match="k_scale"):
        decode_attention(**{**case, "k_scale": torch.ones(5, device=device)})
    with pytest.raises(ValueError, match="sliding_window"):
        decode_attention(**case, sliding_window=0)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "fp8"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window, sinks, num_splits", [(None, SINKS, 3), (48, None, 1)])
def test_hnd_layout_reads_the_same_cache(device: str, dtype_name: str, head_dim: int, window, sinks, num_splits) -> None:
    """A head-major (HND) cache gives the reference's answer, and exactly the NHD cache's answer for the same bytes."""
    torch.manual_seed(7)
    fp8 = dtype_name == "fp8"
    case = make_case(device, SEQ_LENS, 8, 2, head_dim, dtype_name, layout="HND", per_head=True if fp8 else None,
                     value_offset=1.0 if fp8 else 0.0)
    assert case["key_cache"].stride(1) == head_dim and case["key_cache"].stride(2) == 16 * head_dim
    kwargs = dict(sliding_window=window, num_splits=num_splits)
    if sinks is SINKS:
        kwargs["sinks"] = torch.randn(8, device=device)
    run_and_check(case, TOL_FP8 if fp8 else TOL_BF16, **kwargs)
    nhd = dict(case, key_cache=case["key_cache"].contiguous(), value_cache=case["value_cache"].contiguous())
    assert nhd["key_cache"].stride(2) == head_dim
    assert torch.equal(decode_attention(**case, **kwargs), decode_attention(**nhd, **kwargs))


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bfloat16", "fp8"])
@pytest.mark.parametrize("geometry", ["llama", "gpt-oss"])
def test_gpu_realistic_shapes(device: str, fmt: str, geometry: str) -> None:
    """Llama-3.1-8B and gpt-oss-20b layer shapes, mixed lengths up to 9k, default splits."""
    q_heads, kv_heads, head_dim = (32, 8, 128) if geometry == "llama" else (64, 8, 64)
    case = make_case(device, [1, 1000, 4099, 9001], q_heads, kv_heads, head_dim, fmt,
                     per_head=True if fmt == "fp8" else None, value_offset=1.0 if fmt == "fp8" else 0.0)
    sinks = torch.randn(q_heads, device=device) if geometry == "gpt-oss" else None
    tol = TOL_FP8 if fmt == "fp8" else TOL_BF16
    run_and_check(case, tol, sinks=sinks)
    run_and_check(case, tol, sinks=sinks, sliding_window=128)
    if fmt == "fp8":
        run_and_check(case, TOL_FP8_QUERY, sinks=sinks, fp8_query=True)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["default"])
def test_gpu_two_level_bounds_long_context_error(device: str, config: str) -> None:
    """Positive-weighted P.V over 128k positions in one split: two-level keeps the error flat."""
    errs = {}
    for n in (4096, 131072):
        case = make_case(device, [n], 8, 1, 128, "fp8", per_head=True, value_offset=1.0)
        ref = ref_decode_attention(**case)
        for two_level in (True, False):
            out = decode_attention(**case, two_level=two_level, num_splits=1, config=CONFIGS[config],
                                   out=torch.empty(1, 8, 128, device=device))
            errs[n, two_level] = rel_err(out, ref)
    print(f"two-level errors ({config}):", {k: f"{v:.2e}" for k, v in errs.items()})
    assert errs[131072, True] <= 2 * errs[4096, True]
    assert errs[131072, True] < 1e-2
    if torch.cuda.get_device_capability() == (9, 0):
        # one level is FA3's form: e4m3 P.V carried in Hopper's fp8 wgmma loses the long sum
        assert errs[131072, False] > 10 * errs[131072, True] and errs[131072, False] > 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bfloat16", "fp8"])
def test_gpu_chained_calls_see_each_others_writes(device: str, fmt: str) -> None:
    """Each call's query is the previous call's output (written by its merge kernel), eagerly and in a CUDA graph:
    the replay must be bit-identical to the eager calls, and no output left unwritten (NaN-filled)."""
    case = make_case(device, [3000, 9001], 32, 8, 128, fmt, per_head=True if fmt == "fp8" else None,
                     value_offset=1.0 if fmt == "fp8" else 0.0)
    case["query"] = case["query"] * 0.05

    def chain(outs: list[torch.Tensor]) -> torch.Tensor:
        q = case["query"]
        for out in outs:
            q = decode_attention(**dict(case, query=q), out=out)
        return q

    def fresh() -> list[torch.Tensor]:
        return [torch.full_like(case["query"], float("nan")) for _ in range(8)]

    eager = chain(fresh())
    outs = fresh()
    chain(outs)  # compile and warm up outside the capture
    for o in outs:
        o.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        last = chain(outs)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert not eager.isnan().any() and not last.isnan().any()
    assert torch.equal(last, eager)


def test_split_count_fills_whole_waves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split heuristic, on a 132-SM GPU: one full wave of resident programs, long splits when there is work
    to spare, one-tile splits only when the GPU would otherwise idle, more waves only for very long contexts."""
    import kvpolicy.kernels.launch as launch

    monkeypatch.setattr(launch, "_num_sms", lambda index: 132)
    gpu = torch.device("cuda", 0)

    def splits(batch: int, context: int, tile: int = 64, per_sm: float = 4.0) -> int:
        """The FP8 default: 64-token tiles, 4 programs per SM."""
        return launch.split_count(batch, 8, context, tile, per_sm, gpu)

    # batch 8 x 8 KV heads: 8 splits = 512 programs, one wave of 4 x 132 = 528 (not 33 splits = 4 waves)
    assert [splits(8, n) for n in (2048, 4096, 8192, 32768)] == [8, 8, 8, 8]
    for n in (1024, 4096, 32768):
        assert 8 * 8 * splits(8, n) <= 4 * 132
    # batch 1: 64 splits (512 programs) at long contexts; splits of >= 4 tiles once that still fills every SM
    assert splits(1, 32768) == 64
    assert splits(1, 8192) == 32  # 4 tiles of 64 tokens each, 256 programs
    assert splits(1, 1024) == 16  # 16 one-tile splits: 128 programs, about one per SM
    # long contexts: 2 or 4 whole waves of >= 64-tile splits (1024 programs = 97% of 2 x 528; 2048 = 3.9 waves)
    assert splits(8, 65536) == 16
    assert splits(8, 131072) == 32
    assert splits(8, 131072, 128, 3.0) == 4  # BF16: 8 or 16 would be 1.3 or 2.6 waves of 396: a part-empty last wave
    # the 128 cap holds
    assert launch.split_count(1, 1, 1 << 20, 64, 4.0, gpu) <= 128
    # more sequences than a wave holds: no splitting
    assert splits(128, 32768) == 1
    # without extra waves (the Gluon kernel: 2 programs per SM, 128-token tiles) one wave at every length:
    # the split counts its H200 sweep found best (4 at batch 8, 32 at batch 1)
    assert [launch.split_count(8, 8, n, 128, 2.0, gpu, waves=()) for n in (16384, 131072)] == [4, 4]
    assert [launch.split_count(1, 8, n, 128, 2.0, gpu, waves=()) for n in (16384, 131072)] == [32, 32]
    # a second wave only once each split keeps 64 tiles
    assert [launch.split_count(8, 8, n, 64, 4.0, gpu, waves=(2,)) for n in (32768, 65536, 131072)] == [8, 16, 16]
    # the TurboQuant kernels' pow2_fill 0.85: at 5 programs per SM (k8v4, head_dim 64) a power of two would fill
    # 512 of 660 slots, so the wave takes the largest count that fits (10 at batch 8, 82 at batch 1); at 2 per
    # SM, 256 of 264 is full enough and stays (4 and 32); short contexts keep the tile floor (batch 1, 4k: 32
    # two-tile splits); without pow2_fill nothing changes
    def tq(batch: int, context: int, tile: int, per_sm: float) -> int:
        return launch.split_count(batch, 8, context, tile, per_sm, gpu, waves=(), pow2_fill=0.85)

    assert [tq(8, 131072, 64, 5.0), tq(1, 131072, 64, 5.0), tq(1, 4096, 64, 5.0)] == [10, 82, 32]
    assert [tq(8, 131072, 256, 2.0), tq(1, 131072, 256, 2.0)] == [4, 32]
    assert [launch.split_count(b, 8, 131072, 64, 5.0, gpu, waves=()) for b in (8, 1)] == [8, 64]


@pytest.fixture
def fresh_residency():
    """Residency is cached per device: patched device properties must not leak into later tests."""
    launch._resident.cache_clear()
    yield
    launch._resident.cache_clear()


def test_resident_programs_follow_the_gpu(monkeypatch: pytest.MonkeyPatch, fresh_residency: None) -> None:
    """The split heuristic's wave size: 4 FP8 / 3 BF16 programs per SM on Hopper (228 KB of shared memory
    per SM, as the H200 sweeps found), fewer where shared memory is smaller (A100 164 KB, L40S 100 KB)."""
    from types import SimpleNamespace

    import kvpolicy.kernels.decode_attention as da

    monkeypatch.setattr(da, "interpreting", lambda: False)
    gpu = torch.device("cuda", 0)

    def wave(smem_per_sm: int, head_dim: int, fp8: bool) -> float:
        props = SimpleNamespace(shared_memory_per_multiprocessor=smem_per_sm, max_threads_per_multi_processor=2048)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
        launch._resident.cache_clear()  # residency is cached per device: ask the patched properties
        return da.programs_per_sm(head_dim, fp8, gpu)

    hopper, ampere, ada = 233472, 167936, 102400
    assert [wave(hopper, 128, True), wave(hopper, 64, True), wave(hopper, 128, False), wave(hopper, 64, False)] == [4, 4, 3, 3]
    assert wave(ampere, 128, False) == 2
    assert wave(ada, 128, True) == 1 and wave(ada, 128, False) == 1


def test_gluon_residency_counts_the_padded_producer_warpgroup(monkeypatch: pytest.MonkeyPatch,
                                                               fresh_residency: None) -> None:
    """The Gluon kernel launches 8 warps (its one producer warp padded to a warpgroup): at 128 registers two
    programs fit an SM's 64K registers, whatever shared memory allows."""
    from types import SimpleNamespace

    decode_gluon = pytest.importorskip("kvpolicy.kernels.decode_gluon", reason="this Triton has no Gluon API")
    props = SimpleNamespace(shared_memory_per_multiprocessor=233472, max_threads_per_multi_processor=2048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    gpu = torch.device("cuda", 0)
    for head_dim in (64, 128):
        assert decode_gluon.programs_per_sm(head_dim, gpu) == 2
