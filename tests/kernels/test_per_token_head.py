"""The per-token-head store and decode kernels (fp8/int8/int4_per_token_head) against their references.

The store must write vLLM's row bytes exactly (codes and inline scales, `reference.quantize_pth`); decode must
match float64 attention over what the cache holds. Caches start poisoned (0xFF bytes: NaN scales and fp8 codes),
and block-table entries past a sequence point at a poisoned page, so a read outside the attended positions shows
up as NaN.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvpolicy.kernels.decode_attention import DecodeConfig, decode_attention_pth
from kvpolicy.kernels.formats import PTH_FORMATS, pth_layout
from kvpolicy.kernels.paged_store import allocate_pth_cache, rht_matrix, store_kv_pth
from kvpolicy.kernels.reference import (
    dequantize_pth,
    quantize_pth,
    ref_decode_attention_pth,
    ref_store_kv_pth,
)
from kvpolicy.kernels.tq_reference import emulate_ptx
from kvpolicy.kernels.turboquant import i8_program, nibbles_program

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Relative Frobenius error against float64 over the cache's own values (fp32 output). What remains is the
# kernel's arithmetic: P x vs rounded to fp16 for P.V (2^-11), the int8 query of int8/int4 (1/254 of the
# largest query coordinate per coordinate), e4m3 keys converted exactly.
TOL = {"fp8_per_token_head": 2e-3, "int8_per_token_head": 1e-2, "int4_per_token_head": 1e-2}


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def make_case(device: str, fmt: str, seq_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
              layout: str = "NHD", block_size: int = 16) -> dict:
    """A poisoned cache holding random K/V (stored by the reference), scattered pages, one spare poisoned page."""
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    cache = allocate_pth_cache(num_blocks, block_size, num_kv_heads, head_dim, fmt, device, layout)
    cache.fill_(0xFF)
    perm = torch.randperm(num_blocks)
    poison = perm[-1].item()
    tables = torch.full((len(seq_lens), max(blocks) + 2), poison, dtype=torch.int32)
    slots, used = [], 0
    for b, n in enumerate(seq_lens):
        mine = perm[used:used + blocks[b]]
        used += blocks[b]
        tables[b, :len(mine)] = mine.int()
        pos = torch.arange(n)
        slots.append(mine[pos // block_size] * block_size + pos % block_size)
    total = sum(seq_lens)
    key = (torch.randn(total, num_kv_heads, head_dim) * torch.linspace(0.5, 2.0, num_kv_heads)[:, None]).bfloat16()
    value = (torch.randn(total, num_kv_heads, head_dim) * 0.5 + 0.2).bfloat16()
    ref_store_kv_pth(key.to(device), value.to(device), cache, torch.cat(slots).to(device), fmt)
    query = torch.randn(len(seq_lens), num_q_heads, head_dim).bfloat16().to(device)
    return dict(cache=cache, tables=tables.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                query=query)


@pytest.mark.parametrize("fmt", PTH_FORMATS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_store_writes_vllms_row_bytes(device: str, fmt: str, layout: str) -> None:
    num_kv_heads, head_dim = 3, 64
    cache = allocate_pth_cache(6, 16, num_kv_heads, head_dim, fmt, device, layout)
    cache.fill_(0xAB)
    expected = cache.clone()
    key = torch.randn(50, num_kv_heads, head_dim).bfloat16().to(device)
    value = (torch.randn(50, num_kv_heads, head_dim) * 3).bfloat16().to(device)
    key[3, 1] = 0  # an all-zero head: vLLM's floor scale
    slots = torch.randperm(96)[:50].to(device)
    slots[7] = -1  # skipped
    store_kv_pth(key, value, cache, slots, fmt)
    ref_store_kv_pth(key, value, expected, slots, fmt)
    assert torch.equal(cache, expected)
    untouched = torch.ones(96, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert (cache.flatten(0, 1)[untouched.to(device)] == 0xAB).all()


@pytest.mark.parametrize("fmt", PTH_FORMATS)
def test_quantization_follows_vllms_scale_math(fmt: str) -> None:
    x = torch.randn(200, 2, 64) * torch.logspace(-3, 2, 200)[:, None, None]
    codes, scale = quantize_pth(x, fmt)
    back = dequantize_pth(codes, scale, fmt)
    if fmt == "int4_per_token_head":
        s = (scale.view(torch.int32) & -16).view(torch.float32).double()
        span = (x.amax(-1) - x.amin(-1)).double()
        assert torch.allclose(s, (span / 15).clamp(min=1e-6), rtol=1e-5)
        # asymmetric: every value within one step of its code (the zero point rounds, so up to a step)
        assert ((back - x.double()).abs() <= s[..., None] * 1.0001).all()
    else:
        qmax = 448.0 if fmt == "fp8_per_token_head" else 127.0
        amax = x.abs().amax(-1).double()
        assert torch.allclose(scale.double(), amax / qmax, rtol=1e-6)
        bound = amax[..., None] / 16 if fmt == "fp8_per_token_head" else scale.double()[..., None] / 2 * 1.0001
        assert ((back - x.double()).abs() <= bound).all()
    assert pth_layout(fmt, 64).row_bytes == {"fp8_per_token_head": 136, "int8_per_token_head": 136,
                                             "int4_per_token_head": 72}[fmt]


def test_rotation_is_vllms_scaled_hadamard() -> None:
    r = rht_matrix(64, "cpu", torch.float64)
    assert torch.allclose(r @ r.T, 64 * torch.eye(64, dtype=torch.float64))
    assert set(r.abs().unique().tolist()) == {1.0}
    assert torch.equal(r @ rht_matrix(64, "cpu", torch.float64, inverse=True), torch.eye(64, dtype=torch.float64))
    # one copy per device: a host-to-device copy in every decode call would be a sync no CUDA graph can capture
    assert rht_matrix(128, "cpu") is rht_matrix(128, torch.device("cpu"))


@pytest.mark.parametrize("fmt", PTH_FORMATS)
@pytest.mark.parametrize("head_dim,layout,window,sinks,splits", [
    (64, "NHD", None, False, None), (64, "HND", 40, True, 3), (128, "NHD", None, True, 2), (128, "HND", 50, False, 1)])
def test_decode_matches_reference(device: str, fmt: str, head_dim: int, layout: str, window, sinks, splits) -> None:
    torch.manual_seed(hash((fmt, head_dim, layout)) % 1000)
    case = make_case(device, fmt, [37, 150, 1], 8, 2, head_dim, layout)
    s = torch.randn(8, device=device) if sinks else None
    cfg = DecodeConfig(block_n=32, num_stages=1, defer_sum=head_dim == 64) if INTERPRET else None
    out = torch.full(case["query"].shape, float("nan"), dtype=torch.float32, device=device)
    decode_attention_pth(case["query"], case["cache"], case["tables"], case["seq_lens"], fmt, sliding_window=window,
                         sinks=s, num_splits=splits, out=out, config=cfg)
    ref = ref_decode_attention_pth(case["query"], case["cache"], case["tables"], case["seq_lens"], fmt,
                                   sliding_window=window, sinks=s)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[fmt]


def test_fp8_query_and_bad_inputs(device: str) -> None:
    case = make_case(device, "fp8_per_token_head", [70], 4, 2, 64)
    args = (case["query"], case["cache"], case["tables"], case["seq_lens"])
    ref = ref_decode_attention_pth(*args, "fp8_per_token_head")
    out = decode_attention_pth(*args, "fp8_per_token_head", fp8_query=True, out=torch.empty(1, 4, 64, device=device))
    assert rel_err(out, ref) < 3e-2
    with pytest.raises(ValueError, match="fp8_query"):
        decode_attention_pth(*args, "int8_per_token_head", fp8_query=True)
    with pytest.raises(ValueError, match="int8_per_token_head cache"):
        decode_attention_pth(case["query"], case["cache"][..., :-4], case["tables"], case["seq_lens"],
                             "int8_per_token_head")
    with pytest.raises(ValueError, match="not a per-token-head format"):
        decode_attention_pth(*args, "fp8")


def test_register_programs_are_exact() -> None:
    words = torch.randint(0, 2**32, (4096,), dtype=torch.int64)
    b = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], -1)  # bytes 0..3
    regs = emulate_ptx(i8_program(), {"$2": words})
    halves = torch.stack([regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16], -1)
    vals = torch.where(halves >= 32768, halves - 65536, halves).to(torch.int16).view(torch.float16).float()
    assert torch.equal(vals, torch.where(b >= 128, b - 256, b).float())
    regs = emulate_ptx(nibbles_program(), {"$2": words})
    assert torch.equal(regs["$0"], words & 0x0F0F0F0F)
    assert torch.equal(regs["$1"], (words >> 4) & 0x0F0F0F0F)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", PTH_FORMATS)
@pytest.mark.parametrize("geometry", [(32, 8, 128, False, None), (64, 8, 64, True, 128)])
def test_gpu_realistic_shapes(device: str, fmt: str, geometry) -> None:
    hq, hkv, d, sinks, window = geometry
    case = make_case(device, fmt, [3000, 17, 1025, 4096], hq, hkv, d)
    s = torch.randn(hq, device=device) if sinks else None
    for layout_case in (case, make_case(device, fmt, [3000, 17, 1025, 4096], hq, hkv, d, "HND")):
        args = (layout_case["query"], layout_case["cache"], layout_case["tables"], layout_case["seq_lens"])
        ref = ref_decode_attention_pth(*args, fmt, sliding_window=window, sinks=s)
        out = decode_attention_pth(*args, fmt, sliding_window=window, sinks=s, out=torch.empty(*ref.shape, device=device))
        assert rel_err(out, ref) < TOL[fmt]
        key = torch.randn(300, hkv, d, device=device).bfloat16()
        cache = allocate_pth_cache(32, 16, hkv, d, fmt, device)
        expected = cache.clone()
        slots = torch.randperm(512, device=device)[:300]
        store_kv_pth(key, key, cache, slots, fmt)
        ref_store_kv_pth(key, key, expected, slots, fmt)
        used = cache.flatten(0, 1)[slots]
        assert torch.equal(used, expected.flatten(0, 1)[slots])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", PTH_FORMATS)
def test_gpu_decode_replays_in_a_cuda_graph(device: str, fmt: str) -> None:
    """The runtime and the benchmark capture decode steps: every format's call (int4's rotations included) must
    capture, and its replay must give the eager call's output."""
    case = make_case(device, fmt, [3000, 17, 1025, 4096], 32, 8, 128)
    args = (case["query"], case["cache"], case["tables"], case["seq_lens"], fmt)
    eager = decode_attention_pth(*args)
    out = torch.empty_like(eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention_pth(*args, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention_pth(*args, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
