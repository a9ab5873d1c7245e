"""Torch references for the kernels, computed in float64.

Each reference takes the same arguments as its kernel. Arguments that only steer
how a kernel computes (`two_level`, `fp8_query`, `num_splits`) are accepted and
ignored: the reference is the exact answer the kernel approximates.
"""

from __future__ import annotations

import torch

from kvpolicy.kernels.formats import FP8_E4M3_MAX


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
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if sm_scale is None else sm_scale
    result = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64, device=query.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k = dequantize_tokens(key_cache, block_tables[b], seq_len, k_scale)
        v = dequantize_tokens(value_cache, block_tables[b], seq_len, v_scale)
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
