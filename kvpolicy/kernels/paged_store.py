"""Paged KV-cache store: write new K/V tokens into a BF16 or FP8 (e4m3) cache.

Cache layout (shared with the decode kernel and the TurboQuant kernels):
`[num_blocks, block_size, num_kv_heads, head_dim]`; a token's slot is
`block * block_size + offset`, and a negative slot means "skip this token".
FP8 caches are `torch.float8_e4m3fn`; the kernels see them as uint8 and
bitcast, which works the same on a GPU and under `TRITON_INTERPRET=1`.

The fp32 -> e4m3 and fp32 -> bf16 roundings are done with integer arithmetic
(`fp8_e4m3_bits`, `_bf16_bits`) rather than a cast: the Triton interpreter
truncates both casts (no carry into the exponent, no saturation), so a cast would
store different bytes on the CPU than on the GPU. The integer form is
round-to-nearest-even with saturation on both, bit-exact with torch.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvpolicy.kernels.formats import FP8_E4M3_MAX, PAGED_DTYPES, PTH_MODE, PTH_SCALE_FLOOR, pth_layout
from kvpolicy.kernels.guards import check_scales, check_slots

_CACHE_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, dtype) for name, dtype in PAGED_DTYPES.items()}
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def fp8_e4m3_bits(x):
    """e4m3fn code (int32 in 0..255) of fp32 `x`: round to nearest even, saturate finite values to +-448."""
    a = tl.minimum(tl.abs(x), _FP8_MAX)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range (a >= 2**-6): keep 3 mantissa bits with round-half-even; a
    # mantissa carry runs into the exponent field on its own.
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    # Subnormal range: the code is round(a * 2**9); adding 2**23 makes the fp32
    # adder do that rounding (half-even), and the integer sits in the low bits.
    magic = a * 512.0 + 8388608.0
    subnormal = magic.to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(bits >= 0x3C800000, normal, subnormal)
    code = tl.where(x != x, 0x7F, code)
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << 7)


@triton.jit
def _bf16_bits(x):
    """bf16 bit pattern (int32 in 0..65535) of fp32 `x`, round to nearest even."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    # NaN stays a (quiet) NaN instead of rounding into infinity.
    rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.int32)


@triton.jit
def _paged_store_kernel(
    # tensors
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    k_scale_ptr, v_scale_ptr,
    # strides (last dimension contiguous)
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    # sizes
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    # what is stored
    FP8: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    K_SCALE_STRIDE: tl.constexpr,
    V_SCALE_STRIDE: tl.constexpr,
    SAME_DTYPE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < num_kv_heads)[:, None]
    src_k = key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = key_cache_ptr + block * stride_kcb + offset * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
    dst_v = value_cache_ptr + block * stride_vcb + offset * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
    k = tl.load(src_k, mask=mask, other=0.0)
    v = tl.load(src_v, mask=mask, other=0.0)
    if FP8:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        if HAS_SCALE:
            k_scale = tl.load(k_scale_ptr + offs_h * K_SCALE_STRIDE, mask=offs_h < num_kv_heads, other=1.0)
            v_scale = tl.load(v_scale_ptr + offs_h * V_SCALE_STRIDE, mask=offs_h < num_kv_heads, other=1.0)
            # Correctly rounded division, so the stored byte is a function of
            # (x, scale) alone and matches the reference bit for bit.
            k = tl.math.div_rn(k, k_scale[:, None])
            v = tl.math.div_rn(v, v_scale[:, None])
        tl.store(dst_k, fp8_e4m3_bits(k).to(tl.uint8), mask=mask)
        tl.store(dst_v, fp8_e4m3_bits(v).to(tl.uint8), mask=mask)
    elif SAME_DTYPE:
        tl.store(dst_k, k, mask=mask)
        tl.store(dst_v, v, mask=mask)
    else:
        tl.store(dst_k, _bf16_bits(k.to(tl.float32)).to(tl.uint16), mask=mask)
        tl.store(dst_v, _bf16_bits(v.to(tl.float32)).to(tl.uint16), mask=mask)


def check_scale(scale: torch.Tensor | None, name: str, num_kv_heads: int, device: torch.device) -> int:
    """Validate a [1] or [num_kv_heads] fp32 scale; return its head stride (0 or 1)."""
    if scale is None:
        return 0
    if scale.dtype != torch.float32 or scale.dim() != 1 or scale.shape[0] not in (1, num_kv_heads):
        raise ValueError(
            f"{name}: expected float32 of shape [1] or [{num_kv_heads}], got {scale.dtype} {tuple(scale.shape)}"
        )
    if scale.device != device:
        raise ValueError(f"{name}: on {scale.device}, the cache is on {device}")
    if not scale.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    return 1 if scale.shape[0] == num_kv_heads and num_kv_heads > 1 else 0


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write `key`/`value` [num_tokens, num_kv_heads, head_dim] into the paged caches in place.

    BF16 caches take the values as they are (rounded to nearest even if the input is
    wider). FP8 caches store `round(x / scale)` in e4m3, saturated to +-448, with
    `k_scale`/`v_scale` fp32 of shape [1] (per tensor) or [num_kv_heads] (per head);
    no scale means 1.0. Tokens whose `slot_mapping` entry is negative are skipped.
    """
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected [num_tokens, num_kv_heads, head_dim] with a contiguous last dim, got {tuple(t.shape)}")
    if key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dim() != 4 or c.stride(-1) != 1:
            raise ValueError(f"{name}: expected [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(c.shape)}")
        if c.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(f"{name}: dtype {c.dtype} is not supported; use allocate_cache() (bfloat16 or fp8 e4m3)")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same shape and dtype")
    num_tokens, num_kv_heads, head_dim = key.shape
    if key_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache heads x head_dim {tuple(key_cache.shape[2:])} do not match the tokens' {(num_kv_heads, head_dim)}"
        )
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping: expected int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    device = key_cache.device
    for name, t in (("key", key), ("value", value), ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, key_cache is on {device}")
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError("k_scale/v_scale apply to FP8 caches only; a bfloat16 cache stores values unscaled")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale, or neither")
    k_stride = check_scale(k_scale, "k_scale", num_kv_heads, device)
    v_stride = check_scale(v_scale, "v_scale", num_kv_heads, device)
    check_scales(k_scale=k_scale, v_scale=v_scale)
    if num_tokens == 0:
        return
    check_slots(slot_mapping, key_cache.shape[0] * key_cache.shape[1])
    kc = key_cache.view(torch.uint8) if fp8 else key_cache
    vc = value_cache.view(torch.uint8) if fp8 else value_cache
    same_dtype = key.dtype == key_cache.dtype and value.dtype == key_cache.dtype
    if not fp8 and not same_dtype:
        # Written as raw bf16 bits (see module docstring).
        kc, vc = key_cache.view(torch.uint16), value_cache.view(torch.uint16)
    _paged_store_kernel[(num_tokens,)](
        key, value, kc, vc, slot_mapping,
        k_scale if k_scale is not None else key, v_scale if v_scale is not None else value,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        PAGE_SIZE=key_cache.shape[1],
        FP8=fp8,
        HAS_SCALE=k_scale is not None,
        K_SCALE_STRIDE=k_stride,
        V_SCALE_STRIDE=v_stride,
        SAME_DTYPE=same_dtype,
        num_warps=4,
    )


def compute_kv_scales(key: torch.Tensor, value: torch.Tensor, per_head: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 scales (amax / 448) from sample `key`/`value` [num_tokens, num_kv_heads, head_dim].

    Returns fp32 `(k_scale, v_scale)` of shape [num_kv_heads] when `per_head`, else [1].
    An all-zero head gets scale 1.0; non-finite samples raise ValueError.
    """
    if key.dim() != 3 or value.dim() != 3 or key.shape[1] != value.shape[1]:
        raise ValueError(f"expected key/value [num_tokens, num_kv_heads, head_dim], got {tuple(key.shape)} and {tuple(value.shape)}")

    def scale(x: torch.Tensor) -> torch.Tensor:
        x = x.float().abs()
        amax = x.amax(dim=(0, 2)) if per_head else x.amax().reshape(1)
        if not torch.isfinite(amax).all():
            raise ValueError("sample K/V contain inf or NaN: cannot derive FP8 scales from them")
        s = amax / FP8_E4M3_MAX
        return torch.where(s > 0, s, torch.ones_like(s)).contiguous()

    return scale(key), scale(value)


CACHE_LAYOUTS = ("NHD", "HND")
"""Physical orders of a paged cache, as vLLM names them (`VLLM_KV_CACHE_LAYOUT`): NHD stores a page as
[block_size, num_kv_heads, head_dim] (FlashAttention's), HND as [num_kv_heads, block_size, head_dim] (FlashInfer's)."""


def allocate_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype_name: str, device: torch.device | str,
    layout: str = "NHD",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate uninitialised (key_cache, value_cache) [num_blocks, block_size, num_kv_heads, head_dim].

    `dtype_name` is a vLLM `--kv-cache-dtype`: "auto" or "bfloat16" (bf16), "fp8" or "fp8_e4m3" (e4m3fn).
    `layout` "HND" keeps the logical shape and stores each page head-major (a permuted view, as vLLM's
    stride order does): one KV head's page is then block_size x head_dim contiguous bytes instead of
    block_size rows of head_dim bytes, which the decode kernels read faster at small head_dim
    (bench/KERNELS.md). Every kernel here takes either.
    """
    if dtype_name not in _CACHE_DTYPES:
        raise ValueError(f"kv-cache dtype {dtype_name!r} is not supported by these kernels; use one of {sorted(_CACHE_DTYPES)}")
    if layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache layout {layout!r} is not one of {CACHE_LAYOUTS}")
    dtype = _CACHE_DTYPES[dtype_name]
    if layout == "HND":
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        k, v = (torch.empty(shape, dtype=dtype, device=device).permute(0, 2, 1, 3) for _ in range(2))
        return k, v
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)


# --------------------------------------------------------------------------- per-token-head caches
#
# vLLM 0.33's fp8/int8/int4_per_token_head (TRITON_ATTN): one uint8 tensor, each (token, KV head) row
# `[K codes | K scale fp32 | V codes | V scale fp32]` (`formats.PTHLayout`), scales computed as the token is
# written (triton_reshape_and_cache_flash.py `_reshape_cache_per_token_head`; int4: int4_per_token_head.py
# `_reshape_cache_int4_kernel`, after a randomized Hadamard rotation of K and V, its zero point in the low 4
# mantissa bits of the scale). Quotients are correctly rounded divisions (vLLM multiplies by a reciprocal):
# the stored codes are then a function of the input alone, bit-exact with `reference.quantize_pth`.


@functools.cache
def _rht_cpu(head_dim: int) -> torch.Tensor:
    # vLLM's `_get_rht_signs(d, 0)`: a CPU generator seeded 0x9E3779B9, Bernoulli(0.5) signs
    gen = torch.Generator(device="cpu").manual_seed(0x9E3779B9)
    signs = 2.0 * torch.bernoulli(torch.full((head_dim,), 0.5), generator=gen) - 1.0
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return signs.to(torch.float64)[:, None] * h


@functools.cache
def _rht_on(head_dim: int, device: torch.device, dtype: torch.dtype, inverse: bool) -> torch.Tensor:
    r = _rht_cpu(head_dim)
    return (r.T / head_dim if inverse else r).to(device=device, dtype=dtype).contiguous()


def _device_key(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def rht_matrix(head_dim: int, device: torch.device | str, dtype: torch.dtype = torch.float32,
               inverse: bool = False) -> torch.Tensor:
    """R [D, D] of int4_per_token_head's rotation, for row vectors: `x @ R` is vLLM's `single_rht(x)` (H diag(s) x,
    H the unnormalised Sylvester Hadamard); with `inverse`, R.T / D (`y @ R.T / D` undoes it).

    One shared tensor per (D, device, dtype), read-only: the copy from the host is a sync that a CUDA graph cannot
    capture, so it happens once, not in every decode call."""
    if head_dim & (head_dim - 1):
        raise ValueError(f"the rotation takes a power-of-two head_dim, got {head_dim}")
    return _rht_on(head_dim, _device_key(device), dtype, inverse)


def rotate_kv(x: torch.Tensor) -> torch.Tensor:
    """int4_per_token_head's write-side rotation of K or V [.., D], rounded back to x's dtype as vLLM does."""
    return (x.float() @ rht_matrix(x.shape[-1], x.device)).to(x.dtype)


def allocate_pth_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, fmt: str,
                       device: torch.device | str, layout: str = "NHD") -> torch.Tensor:
    """An uninitialised per-token-head cache, uint8 [num_blocks, block_size, num_kv_heads, row bytes]; `layout`
    "HND" stores each page head-major (a permuted view, as `allocate_cache`)."""
    if layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache layout {layout!r} is not one of {CACHE_LAYOUTS}")
    row = pth_layout(fmt, head_dim).row_bytes
    if layout == "HND":
        return torch.empty(num_blocks, num_kv_heads, block_size, row, dtype=torch.uint8, device=device).permute(0, 2, 1, 3)
    return torch.empty(num_blocks, block_size, num_kv_heads, row, dtype=torch.uint8, device=device)


def pth_scales(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as float32 [num_blocks, block_size, num_kv_heads, row / 4]: where the kernels read the
    inline scales (element `k_scale_off / 4` and `v_scale_off / 4` of a row)."""
    return cache.view(torch.float32)


def check_pth_cache(cache: torch.Tensor, fmt: str, num_kv_heads: int, head_dim: int) -> None:
    """ValueError unless `cache` is a per-token-head cache of `fmt` for these heads (either layout)."""
    row = pth_layout(fmt, head_dim).row_bytes
    if cache.dtype != torch.uint8 or cache.dim() != 4 or cache.shape[2:] != (num_kv_heads, row) or cache.stride(-1) != 1:
        raise ValueError(f"{fmt} cache: expected uint8 [num_blocks, block_size, {num_kv_heads}, {row}] with a "
                         f"contiguous last dim (allocate_pth_cache), got {cache.dtype} {tuple(cache.shape)}")
    if any(st % 4 for st in cache.stride()[:3]) or cache.storage_offset() % 4:
        raise ValueError(f"{fmt} cache: its rows must start on 4-byte boundaries (the inline fp32 scales)")


PTH_FLOOR = tl.constexpr(PTH_SCALE_FLOOR)


@triton.jit
def round_away(x):
    """Round half away from zero, as an integer-valued fp32 (vLLM's `where(x >= 0, x + 0.5, x - 0.5)` truncated)."""
    x = tl.minimum(tl.maximum(x, -1073741824.0), 1073741824.0)  # in int32's range; every caller clamps after
    return tl.where(x >= 0, x + 0.5, x - 0.5).to(tl.int32).to(tl.float32)


@triton.jit
def _pth_side(src, dst, scale_dst, mask, offs_c, MODE: tl.constexpr, QMAX: tl.constexpr):
    """Quantize one side (K or V) of a token's heads: rows `src` [BLOCK_H] of D values -> codes at `dst`, the fp32
    scale (int4: its zero point in the low 4 bits) at `scale_dst`."""
    if MODE == 3:
        lo = tl.load(src[:, None] + 2 * offs_c[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
        hi = tl.load(src[:, None] + 2 * offs_c[None, :] + 1, mask=mask[:, None], other=0.0).to(tl.float32)
        mn = tl.minimum(tl.min(lo, 1), tl.min(hi, 1))
        mx = tl.maximum(tl.max(lo, 1), tl.max(hi, 1))
        scale = tl.maximum(tl.math.div_rn(mx - mn, tl.full(mx.shape, QMAX, tl.float32)), PTH_FLOOR)
        zp = tl.minimum(tl.maximum(round_away(tl.math.div_rn(-mn, scale)), 0.0), 15.0)
        q_lo = tl.minimum(tl.maximum(round_away(tl.math.div_rn(lo, scale[:, None]) + zp[:, None]), 0.0), 15.0)
        q_hi = tl.minimum(tl.maximum(round_away(tl.math.div_rn(hi, scale[:, None]) + zp[:, None]), 0.0), 15.0)
        codes = q_lo.to(tl.int32) | (q_hi.to(tl.int32) << 4)
        bits = (scale.to(tl.int32, bitcast=True) & -16) | zp.to(tl.int32)
        scale = bits.to(tl.float32, bitcast=True)
    else:
        x = tl.load(src[:, None] + offs_c[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 1)
        scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), PTH_FLOOR)
        q = tl.math.div_rn(x, scale[:, None])
        if MODE == 1:
            codes = fp8_e4m3_bits(q)
        else:
            codes = tl.minimum(tl.maximum(round_away(q), -128.0), 127.0).to(tl.int32) & 0xFF
    tl.store(dst[:, None] + offs_c[None, :], codes.to(tl.uint8), mask=mask[:, None])
    tl.store(scale_dst, scale, mask=mask)


@triton.jit
def _store_pth_kernel(
    key_ptr, value_ptr, cache_ptr, scale_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    num_kv_heads,
    DATA_BYTES: tl.constexpr, BLOCK_H: tl.constexpr, PAGE_SIZE: tl.constexpr,
    MODE: tl.constexpr, QMAX: tl.constexpr, V_OFF: tl.constexpr, KS_OFF4: tl.constexpr, VS_OFF4: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    mask = offs_h < num_kv_heads
    offs_c = tl.arange(0, DATA_BYTES)
    row = block * stride_cb + offset * stride_ct + offs_h * stride_ch
    row4 = block * (stride_cb // 4) + offset * (stride_ct // 4) + offs_h * (stride_ch // 4)
    _pth_side(key_ptr + token * stride_kt + offs_h * stride_kh, cache_ptr + row, scale_ptr + row4 + KS_OFF4,
              mask, offs_c, MODE, QMAX)
    _pth_side(value_ptr + token * stride_vt + offs_h * stride_vh, cache_ptr + V_OFF + row, scale_ptr + row4 + VS_OFF4,
              mask, offs_c, MODE, QMAX)


def store_kv_pth(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                 fmt: str) -> None:
    """Write `key`/`value` [num_tokens, num_kv_heads, head_dim] into a per-token-head cache in place, each
    (token, head) with its own scale; int4 rotates K and V first (`rotate_kv`). Negative slots are skipped."""
    from kvpolicy.kernels.formats import PTH_QMAX

    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or t.shape != key.shape:
            raise ValueError(f"{name}: expected [num_tokens, num_kv_heads, head_dim] like key, got {tuple(t.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    check_pth_cache(cache, fmt, num_kv_heads, head_dim)
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping: expected int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if t.device != cache.device:
            raise ValueError(f"{name}: on {t.device}, the cache is on {cache.device}")
    if num_tokens == 0:
        return
    check_slots(slot_mapping, cache.shape[0] * cache.shape[1])
    if fmt == "int4_per_token_head":
        key, value = rotate_kv(key), rotate_kv(value)
    key, value = key.contiguous(), value.contiguous()
    lay = pth_layout(fmt, head_dim)
    _store_pth_kernel[(num_tokens,)](
        key, value, cache, pth_scales(cache), slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cache.stride(0), cache.stride(1), cache.stride(2),
        num_kv_heads,
        DATA_BYTES=lay.data_bytes, BLOCK_H=triton.next_power_of_2(num_kv_heads), PAGE_SIZE=cache.shape[1],
        MODE=PTH_MODE[fmt], QMAX=PTH_QMAX[fmt], V_OFF=lay.v_off, KS_OFF4=lay.k_scale_off // 4,
        VS_OFF4=lay.v_scale_off // 4,
        num_warps=4,
    )
