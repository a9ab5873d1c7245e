"""Fused TurboQuant decode attention against float64 references.

Caches are packed by the torch reference (`tq_reference.store_kv_ref`) so that
these tests do not depend on the store kernel. On a CPU the interpreter runs
the pure-Triton unpack path; GPU tests run the PTX register-LUT path.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvpolicy.kernels.tq_decode import decode_attention_tq
from kvpolicy.kernels.tq_reference import (
    attention_ref,
    decode_attention_tq_ref,
    store_kv_ref,
)
from kvpolicy.kernels.tq_store import store_kv_tq
from kvpolicy.kernels.formats import TQ_FORMATS
from kvpolicy.kernels.turboquant import allocate_tq_cache, planar_from_slots


def _paged(fmt, key, value, seq_lens, block_size, device, use_kernel=False, max_blocks=None):
    """Pack per-sequence K/V (lists of [L, H, D]) into a shuffled paged cache; tables padded with garbage."""
    bsz = len(key)
    hkv, d = key[0].shape[1:]
    blocks = [-(-int(n) // block_size) for n in seq_lens]
    max_blocks = max_blocks or max(blocks) + 1
    num_blocks = sum(blocks) + 2
    cache = allocate_tq_cache(num_blocks, block_size, hkv, d, fmt, "cpu" if not use_kernel else device)
    cache.fill_(0xFF)  # stale slots decode to NaN scales/norms: the kernel must mask them
    perm = torch.randperm(num_blocks)
    tables = torch.full((bsz, max_blocks), 10**6, dtype=torch.int32)  # out-of-range past each sequence's pages
    used = 0
    for b in range(bsz):
        tables[b, : blocks[b]] = perm[used : used + blocks[b]].int()
        used += blocks[b]
        pos = torch.arange(int(seq_lens[b]))
        slots = tables[b, pos // block_size].long() * block_size + pos % block_size
        if use_kernel:
            store_kv_tq(key[b].to(device), value[b].to(device), cache, slots.to(device), fmt)
        else:
            store_kv_ref(key[b], value[b], cache, slots, fmt)
    return cache.to(device), tables.to(device)


def _run(fmt, device, *, bsz=2, hq=8, hkv=2, d=128, seq=(100, 37), block_size=16, splits=None, window=None,
         sinks=False, outliers=False, planar=False, key_growth=None, rising_head=None, int8_keys=False,
         **decode_kw):
    """Decode random K/V packed by the reference (into planar pages if `planar`): (out, reference over the
    same cache, unquantized float64 attention). `key_growth`: key t scaled by 1 + t / key_growth, so the
    scores' running max keeps rising along the sequence. `rising_head`: keys drift along coordinate 0 (to
    40 at the sequence's end) and the query heads of that index within each GQA group point along it (the
    others against it), so only those heads' max keeps rising. `int8_keys`: the reference takes the int8
    centroids of the Gluon kernel's score MMA."""
    key = [torch.randn(n, hkv, d) for n in seq]
    if key_growth:
        key = [k * (1 + torch.arange(len(k))[:, None, None] / key_growth) for k in key]
    if rising_head is not None:
        for k in key:
            k[:, :, 0] += torch.arange(len(k))[:, None] * (40.0 / len(k))
    value = [torch.randn(n, hkv, d) * 0.7 + 0.2 for n in seq]
    if outliers:
        for k in key:
            k[:, :, [2, 50]] *= 15.0
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    cache, tables = _paged(fmt, key, value, seq_lens, block_size, device)
    if planar:
        cache = planar_from_slots(cache, fmt, d)
    query = torch.randn(bsz, hq, d)
    if rising_head is not None:
        rising = torch.arange(hq) % (hq // hkv) == rising_head
        query[:, :, 0] = torch.where(rising, 4.0, -4.0)
    sink = torch.randn(hq) if sinks else None
    out = torch.full((bsz, hq, d), float("nan"), device=device)  # poisoned: every element must be written
    decode_attention_tq(query.to(device), cache, tables, seq_lens.to(device), fmt, sliding_window=window,
                        sinks=None if sink is None else sink.to(device), num_splits=splits, out=out, **decode_kw)
    ref = decode_attention_tq_ref(query, cache.cpu(), tables.cpu(), seq_lens, fmt, sliding_window=window, sinks=sink,
                                  int8_keys=int8_keys)
    raw = torch.stack([attention_ref(query[b], key[b], value[b], 1 / math.sqrt(d), window, sink) for b in range(bsz)])
    return out.cpu().double(), ref, raw


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# The kernel rounds q*sm_scale*log2(e) and the rotated query to fp16 (2^-11 each) and
# p*scale to fp16 before the P.V product (2^-11); outputs carry ~1e-3 relative error
# against float64 over the same quantized cache. 5e-3 leaves room for unlucky draws.
TOL_SAME_CACHE = 5e-3


@pytest.mark.parametrize("fmt", TQ_FORMATS)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_reference(fmt: str, splits: int, device: str) -> None:
    out, ref, _ = _run(fmt, device, splits=splits)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < TOL_SAME_CACHE


@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_3bit_nc", "turboquant_k8v4"])
def test_decode_head_dim_64_gqa_8_sinks(fmt: str, device: str) -> None:
    """gpt-oss-like layer: head_dim 64, 8 query heads per KV head, attention sinks, pages of 32."""
    out, ref, _ = _run(fmt, device, hq=16, hkv=2, d=64, seq=(70, 129), block_size=32, splits=2, sinks=True)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < TOL_SAME_CACHE


@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_k3v4_nc"])
def test_decode_sliding_window_and_short_sequences(fmt: str, device: str) -> None:
    """Window start inside a page and a tile; a one-token sequence; more splits than tiles (empty splits)."""
    out, ref, _ = _run(fmt, device, seq=(90, 1), window=37, splits=4)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < TOL_SAME_CACHE


@pytest.mark.parametrize("fmt, block_size", [("turboquant_4bit_nc", 128), ("turboquant_k8v4", 256)])
def test_decode_tile_smaller_than_page(fmt: str, block_size: int, device: str) -> None:
    """Pages larger than the default tile (64 tokens for 4bit_nc, 128 with the register prefetch for k8v4):
    tiles inside one page, MHA (group of 1)."""
    out, ref, _ = _run(fmt, device, hq=2, hkv=2, seq=(300, 64), block_size=block_size, splits=2)
    assert _rel(out, ref) < TOL_SAME_CACHE


# Error of the whole format (quantization included) against float64 attention over the raw
# K/V. Measured on these shapes (3 seeds, interpreter): Gaussian keys k8v4 0.04, 4bit 0.05,
# k3v4 0.07-0.08, 3bit 0.10-0.11; keys with two x15 outlier channels (logits ~2x larger, so
# the same relative key error moves the softmax more) 0.08-0.09, 0.13-0.16, 0.21-0.31,
# 0.25-0.34. Bounds carry ~1.5x margin: a kernel that drops the norm, the zero point or the
# rotation lands far above them (errors near 1).
TOL_FORMAT = {
    ("turboquant_k8v4", False): 0.06, ("turboquant_4bit_nc", False): 0.08,
    ("turboquant_k3v4_nc", False): 0.12, ("turboquant_3bit_nc", False): 0.16,
    ("turboquant_k8v4", True): 0.14, ("turboquant_4bit_nc", True): 0.24,
    ("turboquant_k3v4_nc", True): 0.45, ("turboquant_3bit_nc", True): 0.50,
}


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("fmt", TQ_FORMATS)
def test_decode_error_against_unquantized_attention(fmt: str, outliers: bool, device: str) -> None:
    out, _, raw = _run(fmt, device, outliers=outliers, seq=(200, 150), splits=2)
    err = _rel(out, raw)
    assert err < TOL_FORMAT[(fmt, outliers)], f"{fmt} outliers={outliers}: {err:.3f}"


def needle_case(context: int, batch: int, hkv: int, group: int, d: int, margin: float, device, seed: int = 0):
    """The synthetic needle of bench_decode.needle: one planted key per (sequence, KV head), logit `margin`
    over N(0, 1) distractors; values 1 + 0.3 noise, the needle's 1 + 0.5 * code, code in +-1."""
    gen = torch.Generator(device).manual_seed(seed)
    kw = dict(generator=gen, device=device)
    direction = torch.nn.functional.normalize(torch.randn(batch, hkv, d, **kw), dim=-1)
    key = torch.randn(batch, context, hkv, d, **kw)
    value = 1 + 0.3 * torch.randn(batch, context, hkv, d, **kw)
    code = torch.randint(0, 2, (batch, hkv, d), **kw).float() * 2 - 1
    where = torch.randint(0, context, (batch, hkv), **kw)
    bi, hi = torch.meshgrid(torch.arange(batch, device=device), torch.arange(hkv, device=device), indexing="ij")
    key[bi, where, hi] = direction * margin
    value[bi, where, hi] = 1 + 0.5 * code
    query = (direction * math.sqrt(d)).repeat_interleave(group, dim=1)
    return query, key, value, code.repeat_interleave(group, dim=1)


def needle_retrieved(out: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(fraction of query heads with >= 90% of the code's signs right, mean bit accuracy)."""
    bits = ((out.float() - 1).sign() == want).float().mean(dim=-1)
    return (bits >= 0.9).float().mean().item(), bits.mean().item()


@pytest.mark.parametrize("fmt", TQ_FORMATS)
def test_needle_small_context(fmt: str, device: str) -> None:
    """512 tokens on the CPU (the 4k-128k runs are GPU tests and bench rows): every head retrieves."""
    context, batch, hkv, group, d = 512, 2, 2, 4, 128
    # margin over ln(512) + 3 so that the needle dominates as it does at 128k with margin 13.5
    query, key, value, want = needle_case(context, batch, hkv, group, d, math.log(context) + 3.0, "cpu")
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    cache, tables = _paged(fmt, list(key), list(value), seq_lens, 16, device)
    out = decode_attention_tq(query.to(device), cache, tables, seq_lens.to(device), fmt)
    retrieved, bits = needle_retrieved(out.cpu(), want)
    assert retrieved == 1.0, f"{fmt}: {retrieved:.2f} of heads retrieved ({bits:.3f} of bits)"


def test_decode_rejects_bad_inputs(device: str) -> None:
    fmt = "turboquant_4bit_nc"
    cache = allocate_tq_cache(4, 16, 2, 64, fmt, device)
    q = torch.randn(1, 4, 64, device=device)
    bt = torch.zeros(1, 4, dtype=torch.int32, device=device)
    sl = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention_tq(torch.randn(1, 3, 64, device=device), cache, bt, sl, fmt)
    with pytest.raises(ValueError, match="cache"):
        decode_attention_tq(q, cache[..., :-2], bt, sl, fmt)
    with pytest.raises(ValueError, match="sinks"):
        decode_attention_tq(q, cache, bt, sl, fmt, sinks=torch.zeros(3, device=device))


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", TQ_FORMATS)
def test_gpu_asm_path_matches_reference(fmt: str) -> None:
    """PTX unpackers on a real GPU, bf16 query, larger shapes, with and without a window and sinks."""
    for kw in (dict(sinks=True, window=1500), dict(sinks=False, window=None)):
        out, ref, _ = _run(fmt, "cuda", bsz=3, hq=32, hkv=8, seq=(1000, 333, 2049), splits=5, **kw)
        assert _rel(out, ref) < TOL_SAME_CACHE, f"{fmt} {kw}: {_rel(out, ref):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", TQ_FORMATS)
def test_gpu_store_then_decode_bf16(fmt: str) -> None:
    """The production path: bf16 K/V stored by the kernel, bf16 query, default split heuristic."""
    torch.manual_seed(1)
    seq = (3000, 17, 700)
    key = [torch.randn(n, 8, 128).bfloat16() for n in seq]
    value = [torch.randn(n, 8, 128).bfloat16() for n in seq]
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    cache, tables = _paged(fmt, key, value, seq_lens, 16, "cuda", use_kernel=True)
    q = torch.randn(3, 32, 128).bfloat16()
    out = decode_attention_tq(q.cuda(), cache, tables, seq_lens.cuda(), fmt)
    assert out.dtype == torch.bfloat16
    ref = decode_attention_tq_ref(q, cache.cpu(), tables.cpu(), seq_lens, fmt)
    # bf16 output rounding (2^-9) on top of the fp16 path
    assert _rel(out.cpu().double(), ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("context", [4096, 16384, 65536, 131072])
@pytest.mark.parametrize("fmt", TQ_FORMATS)
def test_gpu_needle_long_context(fmt: str, context: int) -> None:
    """bench_decode's needle (margin 13.5, Llama layer, batch 4) at 4k-128k: every head retrieves."""
    retrieved, bits = gpu_needle(fmt, context, allocate_tq_cache)
    print(f"needle {fmt} {context}: retrieved {retrieved:.2f} bits {bits:.3f}")
    assert retrieved >= 0.95, f"{fmt} at {context}: {retrieved:.2f} of heads ({bits:.3f} of bits)"


def gpu_needle(fmt: str, context: int, allocate, **decode_kw) -> tuple[float, float]:
    """The needle on the GPU through the store kernel into a cache from `allocate` (slots or planar pages)
    and `decode_attention_tq`: (fraction of heads retrieved, bit accuracy)."""
    batch, hkv, group, d = 4, 8, 4, 128
    query, key, value, want = needle_case(context, batch, hkv, group, d, 13.5, "cuda", seed=context)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    blocks = context // 16
    tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks).int()
    pos = torch.arange(context, device="cuda")
    slots = (tables.long()[:, pos // 16] * 16 + pos % 16).reshape(-1)
    cache = allocate(batch * blocks, 16, hkv, d, fmt, "cuda")
    store_kv_tq(key.reshape(-1, hkv, d).bfloat16(), value.reshape(-1, hkv, d).bfloat16(), cache, slots, fmt)
    out = decode_attention_tq(query.bfloat16(), cache, tables, seq_lens, fmt, **decode_kw)
    return needle_retrieved(out, want)


@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"])
@pytest.mark.parametrize("case", ["gaussian", "rising", "outliers"])
def test_int8_centroids_cost_nothing_against_unquantized(fmt: str, case: str) -> None:
    """The Gluon kernel multiplies int8 centroids (within 0.006 / sqrt(D) of the Lloyd-Max ones, as precise as
    BF16 centroids). Against unquantized float64 attention that adds at most 1% to the format's own error,
    on Gaussian keys, keys growing 17-fold (large logits) and keys with two 15x outlier channels."""
    torch.manual_seed(1)
    hq, hkv, d, seq = 32, 8, 128, (1025, 700)
    key = [torch.randn(n, hkv, d) for n in seq]
    if case == "rising":
        key = [k * (1 + torch.arange(len(k))[:, None, None] / 64.0) for k in key]
    if case == "outliers":
        for k in key:
            k[:, :, [2, 50]] *= 15.0
    value = [torch.randn(n, hkv, d) * 0.7 + 0.2 for n in seq]
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    cache, tables = _paged(fmt, key, value, seq_lens, 16, "cpu")
    query = torch.randn(2, hq, d)
    exact = decode_attention_tq_ref(query, cache, tables, seq_lens, fmt)
    int8 = decode_attention_tq_ref(query, cache, tables, seq_lens, fmt, int8_keys=True)
    raw = torch.stack([attention_ref(query[b], key[b], value[b], 1 / math.sqrt(d)) for b in range(2)])
    assert 0 < _rel(int8, exact) < 0.02
    assert _rel(int8, raw) <= 1.01 * _rel(exact, raw) + 1e-3
