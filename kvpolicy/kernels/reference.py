"""Torch references for the kernels, computed in float64.

Each reference takes the same arguments as its kernel. Arguments that only steer
how a kernel computes (`two_level`, `fp8_query`, `num_splits`) are accepted and
ignored: the reference is the exact answer the kernel approximates.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpolicy.kernels.formats import FP8_E4M3_MAX, PTH_QMAX, PTH_SCALE_FLOOR, pth_layout


def _scale_per_head(scale: torch.Tensor | None, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """Scale as float64 [num_kv_heads] (1.0 where none is given)."""
    if scale is None:
        return torch.ones(num_kv_heads, dtype=torch.float64, device=device)
    return scale.to(device=device, dtype=torch.float64).expand(num_kv_heads)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """e4m3fn codes of `x / scale` [.., num_kv_heads, head_dim]: one fp32 rounding of the quotient, then RNE with saturation.

    The quotient is formed in float64 and rounded once to fp32, which equals the
    correctly rounded fp32 division (float64 carries more than twice fp32's bits).
    """
    x64 = x.to(torch.float32).to(torch.float64)
    if scale is not None:
        x64 = x64 / _scale_per_head(scale, x.shape[-2], x.device)[:, None]
    q = x64.to(torch.float32)
    q = torch.where(torch.isnan(q), q, q.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX))
    return q.to(torch.float8_e4m3fn)


def ref_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Reference for `store_kv`: write the tokens into the caches in place, skipping negative slots."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    for src, cache, scale in ((key[keep], key_cache, k_scale), (value[keep], value_cache, v_scale)):
        if cache.dtype == torch.float8_e4m3fn:
            cache[blocks, offsets] = quantize_fp8(src, scale)
        else:
            cache[blocks, offsets] = src.to(cache.dtype)


def dequantize_tokens(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: torch.Tensor | None
) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence as float64 [seq_len, num_kv_heads, head_dim], times `scale`."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    tokens = cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]
    out = tokens.to(torch.float32).to(torch.float64)
    return out * _scale_per_head(scale, cache.shape[2], cache.device)[:, None]


def ref_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    two_level: bool = True,
    fp8_query: bool = False,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: object | None = None,
) -> torch.Tensor:
    """Reference for `decode_attention`: float64 [batch, num_q_heads, head_dim].

    softmax(sm_scale * q.k over the attended positions, plus the sink logit in the
    denominator) . v, with K/V dequantised as stored * scale. An empty sequence
    yields zeros.
    """
    return _attend(query, seq_lens, key_cache.shape[2], sm_scale, sliding_window, sinks,
                   lambda b, n: (dequantize_tokens(key_cache, block_tables[b], n, k_scale),
                                 dequantize_tokens(value_cache, block_tables[b], n, v_scale)))


def _attend(query: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int, sm_scale: float | None,
            sliding_window: int | None, sinks: torch.Tensor | None,
            tokens: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Exact attention of each sequence's query over its float64 K/V [n, num_kv_heads, head_dim] from
    `tokens(b, seq_len)` (the last `sliding_window` of them; sinks in the denominator; empty: zeros)."""
    batch, num_q_heads, head_dim = query.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    result = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64, device=query.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k, v = tokens(b, seq_len)
        start = max(seq_len - sliding_window, 0) if sliding_window is not None else 0
        k, v = k[start:], v[start:]
        # Query heads of one KV head are consecutive: head h reads KV head h // group.
        q = query[b].to(torch.float64).view(num_kv_heads, group, head_dim)
        logits = torch.einsum("kgd,nkd->kgn", q, k).reshape(num_q_heads, -1) * scale
        if sinks is not None:
            logits = torch.cat([logits, sinks.to(torch.float64)[:, None]], dim=1)
        probs = torch.softmax(logits, dim=1)[:, : k.shape[0]].view(num_kv_heads, group, -1)
        result[b] = torch.einsum("kgn,nkd->kgd", probs, v).reshape(num_q_heads, head_dim)
    return result


# --------------------------------------------------------------------------- per-token-head caches


def _div32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 a / b correctly rounded (formed in float64, rounded once)."""
    return (a.double() / b.double()).float()


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """fp32 round half away from zero as vLLM writes it: x +- 0.5 in fp32, truncated."""
    return torch.where(x >= 0, x + 0.5, x - 0.5).trunc()


def quantize_pth(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [.., data bytes], scale fp32 [..]) of x [.., D] (int4: x already rotated), as the store
    kernel writes them: the fp32 arithmetic of vLLM's store kernels, emulated step by step."""
    x = x.float()
    qmax = torch.tensor(PTH_QMAX[fmt], dtype=torch.float32)
    floor = torch.tensor(PTH_SCALE_FLOOR, dtype=torch.float32)
    if fmt == "int4_per_token_head":
        lo, hi = x[..., 0::2], x[..., 1::2]
        mn, mx = x.amin(-1), x.amax(-1)
        scale = torch.maximum(_div32(mx - mn, qmax), floor)
        zp = _round_away(_div32(-mn, scale)).clamp(0, 15)
        q_lo = _round_away(_div32(lo, scale[..., None]) + zp[..., None]).clamp(0, 15).to(torch.int32)
        q_hi = _round_away(_div32(hi, scale[..., None]) + zp[..., None]).clamp(0, 15).to(torch.int32)
        codes = (q_lo | (q_hi << 4)).to(torch.uint8)
        bits = (scale.view(torch.int32) & -16) | zp.to(torch.int32)
        return codes, bits.view(torch.float32)
    scale = torch.maximum(_div32(x.abs().amax(-1), qmax), floor)
    q = _div32(x, scale[..., None])
    if fmt == "fp8_per_token_head":
        codes = q.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = _round_away(q).clamp(-128, 127).to(torch.int8).view(torch.uint8)
    return codes, scale


def dequantize_pth(codes: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64 values [.., D] of codes and their scale, in the stored (for int4: rotated) space."""
    if fmt == "int4_per_token_head":
        bits = scale.contiguous().view(torch.int32)
        zp = (bits & 15).double()
        s = (bits & -16).view(torch.float32).double()
        c = codes.to(torch.int64)
        vals = torch.stack([c & 15, c >> 4], dim=-1).flatten(-2).double()
        return (vals - zp[..., None]) * s[..., None]
    if fmt == "fp8_per_token_head":
        vals = codes.contiguous().view(torch.float8_e4m3fn).double()
    else:
        vals = codes.contiguous().view(torch.int8).double()
    return vals * scale.double()[..., None]


def _pth_fields(cache: torch.Tensor, fmt: str, head_dim: int) -> tuple[slice, int, slice, int]:
    lay = pth_layout(fmt, head_dim)
    return (slice(0, lay.data_bytes), lay.k_scale_off, slice(lay.v_off, lay.v_off + lay.data_bytes),
            lay.v_scale_off)


def ref_store_kv_pth(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                     fmt: str) -> None:
    """Reference for `store_kv_pth`: quantize each (token, head) of key/value (int4 after `rotate_kv`) and write
    codes and scales into the cache rows, skipping negative slots."""
    from kvpolicy.kernels.paged_store import rotate_kv

    head_dim = key.shape[-1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // cache.shape[1], slots % cache.shape[1]
    kf, ks, vf, vs = _pth_fields(cache, fmt, head_dim)
    for src, field, soff in ((key[keep], kf, ks), (value[keep], vf, vs)):
        if fmt == "int4_per_token_head":
            src = rotate_kv(src)
        codes, scale = quantize_pth(src, fmt)
        rows = cache[blocks, offsets]  # [n, heads, row] (a copy)
        rows[..., field] = codes
        rows[..., soff:soff + 4] = scale.contiguous().view(torch.uint8).view(*scale.shape, 4)
        cache[blocks, offsets] = rows


def dequantize_pth_tokens(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, fmt: str,
                          head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a sequence's first `seq_len` tokens, float64 [seq_len, num_kv_heads, head_dim], in the model's
    space (int4: rotated back)."""
    block_size = cache.shape[1]
    rows = cache[block_table[: -(-seq_len // block_size)].long()].flatten(0, 1)[:seq_len]
    kf, ks, vf, vs = _pth_fields(cache, fmt, head_dim)
    out = []
    for field, soff in ((kf, ks), (vf, vs)):
        scale = rows[..., soff:soff + 4].contiguous().view(torch.float32)[..., 0]
        x = dequantize_pth(rows[..., field], scale, fmt)
        if fmt == "int4_per_token_head":
            from kvpolicy.kernels.paged_store import rht_matrix

            x = x @ rht_matrix(head_dim, x.device, torch.float64).T / head_dim
        out.append(x)
    return out[0], out[1]


def ref_decode_attention_pth(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    fmt: str,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    **_: object,
) -> torch.Tensor:
    """Reference for `decode_attention_pth`: float64 [batch, num_q_heads, head_dim], exact attention over the
    dequantized cache (sinks in the denominator; an empty sequence yields zeros)."""
    head_dim = query.shape[2]
    return _attend(query, seq_lens, cache.shape[2], sm_scale, sliding_window, sinks,
                   lambda b, n: dequantize_pth_tokens(cache, block_tables[b], n, fmt, head_dim))
