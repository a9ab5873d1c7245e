"""Decode attention straight from a packed TurboQuant cache (dequantization fused, split-KV, GQA-packed).

One program takes the query heads of one KV head (padded to BLOCK_M >= 16 rows
so the products run on tensor cores), one sequence, and one split of its
context. Per tile of BLOCK_N tokens it loads only the packed bytes:

- keys: the query was rotated once (Pi q, folded with sm_scale*log2(e)), so a
  centroid key never needs the inverse rotation. Codes unpack in registers
  into fp16 centroids by a 16-entry table (L1-resident) and go straight into
  `tl.dot`; the per-token norm multiplies the score column. FP8 keys convert
  to fp16 in registers.
- values: never dequantized. sum_j p_j (code_j * scale_j + zero_j) =
  dot(p * scale, codes) + sum_j p_j zero_j, so the scale folds into P (one
  multiply per score) and the zero point into a per-row scalar.

Nothing dequantized is ever written to memory. With NUM_SPLITS > 1 each
program writes a normalised partial output and its base-2 log-sum-exp, and
`_tq_merge_kernel` combines them (and the sinks).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvpolicy.kernels.turboquant import kernel_tables, tq_layout

LOG2E = 1.4426950408889634


@triton.jit
def _unpack_q3(p2, p1, hsh, S: tl.constexpr):
    """Codes of quarter S from the 2-bit plane tile and the (column-duplicated) 1-bit plane tile."""
    return ((p2 >> (2 * S)) & 3) | (((p1 >> (hsh + 2 * S)) & 1) << 2)


@triton.jit
def _codes_f16(x, V_MAGIC: tl.constexpr):
    """Small non-negative integer codes as exact fp16."""
    if V_MAGIC:
        # 0x6400 is 1024.0: OR-ing a code into its mantissa gives 1024 + code,
        # two integer-pipe ops instead of a quarter-rate int->float convert
        return (x.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return x.to(tl.float16)


@triton.jit
def _tq_decode_kernel(
    # tensors
    q_ptr, cache_u8_ptr, cache_f16_ptr, block_tables_ptr, seq_lens_ptr,
    rot_ptr, cb_ptr, sinks_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    # scalars
    q_scale, rot_scale, window,
    # strides (query/out in elements, cache in bytes)
    stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
    # geometry and layout
    NUM_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SLOT: tl.constexpr,
    PAGE: tl.constexpr, STRIDE_BLK: tl.constexpr, STRIDE_TOK: tl.constexpr, KEY_BITS: tl.constexpr, V_BITS: tl.constexpr,
    V_OFF: tl.constexpr, KNORM_OFF: tl.constexpr, VSCALE_OFF: tl.constexpr, VZERO_OFF: tl.constexpr,
    # tiling and options
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, V_MAGIC: tl.constexpr, LOOKUP: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // NUM_KV
    kvh = pid_bh % NUM_KV

    seq_len = tl.load(seq_lens_ptr + b)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    # splits and tiles are aligned to BLOCK_N (which divides PAGE) so that a tile never straddles pages
    first = (start // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + pid_s * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < GROUP
    qh = kvh * GROUP + offs_m
    cols = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + cols[None, :], mask=m_mask[:, None], other=0.0)
    # sm_scale*log2(e) before the fp16 cast keeps q well inside fp16 range and precision
    q16 = (q.to(tl.float32) * q_scale).to(tl.float16)

    # key chunking: 4-bit codes give two halves of the vector, 3-bit codes four quarters
    KC: tl.constexpr = HEAD_DIM if KEY_BITS == 8 else (HEAD_DIM // 2 if KEY_BITS == 4 else HEAD_DIM // 4)
    VC: tl.constexpr = HEAD_DIM // 2 if V_BITS == 4 else HEAD_DIM // 4
    E: tl.constexpr = HEAD_DIM // 8
    cols_k = tl.arange(0, KC)
    cols_v = tl.arange(0, VC)
    if KEY_BITS == 8:
        q0 = q16
        q1 = q16
        q2 = q16
        q3 = q16
    else:
        # rotate once: Pi q = (q @ S) / sqrt(D) with S = +-1; rot_scale = 1/D also undoes the
        # unit-variance codebook's sqrt(D)
        r0 = tl.load(rot_ptr + cols[:, None] * HEAD_DIM + (0 * KC + cols_k)[None, :])
        r1 = tl.load(rot_ptr + cols[:, None] * HEAD_DIM + (1 * KC + cols_k)[None, :])
        q0 = (tl.dot(q16, r0) * rot_scale).to(tl.float16)
        q1 = (tl.dot(q16, r1) * rot_scale).to(tl.float16)
        q2 = q0
        q3 = q1
        if KEY_BITS == 3:
            r2 = tl.load(rot_ptr + cols[:, None] * HEAD_DIM + (2 * KC + cols_k)[None, :])
            r3 = tl.load(rot_ptr + cols[:, None] * HEAD_DIM + (3 * KC + cols_k)[None, :])
            q2 = (tl.dot(q16, r2) * rot_scale).to(tl.float16)
            q3 = (tl.dot(q16, r3) * rot_scale).to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    z_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # sum_j p_j * zero_j
    acc0 = tl.zeros([BLOCK_M, VC], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, VC], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, VC], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_M, VC], dtype=tl.float32)
    hsh_k = cols_k // E  # 3-bit: which half of a quarter -> which bit of the 1-bit plane byte
    hsh_v = cols_v // E

    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = (offs_n < hi) & (offs_n >= start)
        # one page per tile: a scalar 64-bit base plus compile-time row offsets, so every load
        # is `LDG [base + imm]` instead of a 64-bit address computation per row
        page = tl.load(block_tables_ptr + b * stride_btb + n0 // PAGE)
        base = page.to(tl.int64) * STRIDE_BLK + (n0 % PAGE) * STRIDE_TOK + kvh * SLOT
        row = base + tl.arange(0, BLOCK_N) * STRIDE_TOK
        row_p = cache_u8_ptr + row[:, None]
        ld_mask = n_mask[:, None]

        # ---- scores (base 2) ----
        if KEY_BITS == 8:
            kb = tl.load(row_p + cols_k[None, :], mask=ld_mask, other=0)
            k = kb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            s = tl.dot(q0, tl.trans(k))
        elif KEY_BITS == 4:
            kb = tl.load(row_p + cols_k[None, :], mask=ld_mask, other=0)
            i0 = (kb & 15).to(tl.int32)
            i1 = (kb >> 4).to(tl.int32)
            if LOOKUP:
                k0 = tl.load(cb_ptr + i0)
                k1 = tl.load(cb_ptr + i1)
            else:  # diagnostic timing only: codes as values (wrong scores)
                k0 = i0.to(tl.float16)
                k1 = i1.to(tl.float16)
            s = tl.dot(q0, tl.trans(k0))
            s = tl.dot(q1, tl.trans(k1), s)
        else:
            p2 = tl.load(row_p + cols_k[None, :], mask=ld_mask, other=0)
            p1 = tl.load(row_p + KC + (cols_k % E)[None, :], mask=ld_mask, other=0)
            i0 = _unpack_q3(p2, p1, hsh_k[None, :], 0).to(tl.int32)
            i1 = _unpack_q3(p2, p1, hsh_k[None, :], 1).to(tl.int32)
            i2 = _unpack_q3(p2, p1, hsh_k[None, :], 2).to(tl.int32)
            i3 = _unpack_q3(p2, p1, hsh_k[None, :], 3).to(tl.int32)
            if LOOKUP:
                k0 = tl.load(cb_ptr + i0)
                k1 = tl.load(cb_ptr + i1)
                k2 = tl.load(cb_ptr + i2)
                k3 = tl.load(cb_ptr + i3)
            else:
                k0 = i0.to(tl.float16)
                k1 = i1.to(tl.float16)
                k2 = i2.to(tl.float16)
                k3 = i3.to(tl.float16)
            s = tl.dot(q0, tl.trans(k0))
            s = tl.dot(q1, tl.trans(k1), s)
            s = tl.dot(q2, tl.trans(k2), s)
            s = tl.dot(q3, tl.trans(k3), s)
        if KEY_BITS != 8:
            knorm = tl.load(cache_f16_ptr + (row >> 1) + KNORM_OFF // 2, mask=n_mask, other=0.0)
            s = s * knorm.to(tl.float32)[None, :]
        s = tl.where(n_mask[None, :], s, float("-inf"))

        # ---- online softmax ----
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vscale = tl.load(cache_f16_ptr + (row >> 1) + VSCALE_OFF // 2, mask=n_mask, other=0.0).to(tl.float32)
        vzero = tl.load(cache_f16_ptr + (row >> 1) + VZERO_OFF // 2, mask=n_mask, other=0.0).to(tl.float32)
        z_i = z_i * alpha + tl.sum(p * vzero[None, :], axis=1)
        pv = (p * vscale[None, :]).to(tl.float16)
        m_i = m_new

        # ---- P @ codes (values never dequantized) ----
        if V_BITS == 4:
            vb = tl.load(row_p + V_OFF + cols_v[None, :], mask=ld_mask, other=0)
            acc0 = tl.dot(pv, _codes_f16(vb & 15, V_MAGIC), acc0 * alpha[:, None])
            acc1 = tl.dot(pv, _codes_f16(vb >> 4, V_MAGIC), acc1 * alpha[:, None])
        else:
            vp2 = tl.load(row_p + V_OFF + cols_v[None, :], mask=ld_mask, other=0)
            vp1 = tl.load(row_p + V_OFF + VC + (cols_v % E)[None, :], mask=ld_mask, other=0)
            acc0 = tl.dot(pv, _codes_f16(_unpack_q3(vp2, vp1, hsh_v[None, :], 0), V_MAGIC), acc0 * alpha[:, None])
            acc1 = tl.dot(pv, _codes_f16(_unpack_q3(vp2, vp1, hsh_v[None, :], 1), V_MAGIC), acc1 * alpha[:, None])
            acc2 = tl.dot(pv, _codes_f16(_unpack_q3(vp2, vp1, hsh_v[None, :], 2), V_MAGIC), acc2 * alpha[:, None])
            acc3 = tl.dot(pv, _codes_f16(_unpack_q3(vp2, vp1, hsh_v[None, :], 3), V_MAGIC), acc3 * alpha[:, None])

    if NUM_SPLITS == 1:
        den = l_i
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + qh, mask=m_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            den = den + tl.exp2(sink - m_i)
        inv = 1.0 / den
        o_base = out_ptr + b * stride_ob + qh[:, None] * stride_oh
        o_ty = out_ptr.dtype.element_ty
    else:
        empty = l_i == 0.0  # this split got no tokens
        inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        row_bh = b * (NUM_KV * GROUP) + qh
        tl.store(part_lse_ptr + row_bh * NUM_SPLITS + pid_s, lse, mask=m_mask)
        o_base = part_o_ptr + (row_bh[:, None] * NUM_SPLITS + pid_s) * HEAD_DIM
        o_ty = tl.float32
    zc = z_i[:, None]
    w = inv[:, None]
    tl.store(o_base + (0 * VC + cols_v)[None, :], ((acc0 + zc) * w).to(o_ty), mask=m_mask[:, None])
    tl.store(o_base + (1 * VC + cols_v)[None, :], ((acc1 + zc) * w).to(o_ty), mask=m_mask[:, None])
    if V_BITS == 3:
        tl.store(o_base + (2 * VC + cols_v)[None, :], ((acc2 + zc) * w).to(o_ty), mask=m_mask[:, None])
        tl.store(o_base + (3 * VC + cols_v)[None, :], ((acc3 + zc) * w).to(o_ty), mask=m_mask[:, None])


@triton.jit
def _tq_merge_kernel(
    part_o_ptr, part_lse_ptr, sinks_ptr, out_ptr,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // NUM_HEADS
    h = pid % NUM_HEADS
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < NUM_SPLITS
    lse = tl.load(part_lse_ptr + pid * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)
    cols = tl.arange(0, HEAD_DIM)
    o = tl.load(part_o_ptr + (pid * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + cols[None, :],
                mask=s_mask[:, None], other=0.0)
    num = tl.sum(w[:, None] * o, axis=0)
    den = tl.sum(w, axis=0)
    if HAS_SINKS:
        den += tl.exp2(sink - m)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + cols, (num / den).to(out_ptr.dtype.element_ty))


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device) -> int:
    """Splits so that about four programs per SM are in flight, each with at least two tiles of work."""
    if device.type != "cuda":
        return 1 if max_context <= 4 * block_n else 2
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(4 * num_sms, batch * num_kv_heads)
    return max(1, min(want, triton.cdiv(max_context, 2 * block_n), 64))


def decode_attention_tq(
    query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, fmt: str,
    *, sm_scale: float | None = None, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
    num_splits: int | None = None, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
    v_magic: bool = True, lookup: bool = True,
) -> torch.Tensor:
    """Decode attention of `query` [B, Hq, D] over a packed TurboQuant cache; returns [B, Hq, D] in query's dtype.

    `cache` uint8 [num_blocks, block_size, num_kv_heads, slot_bytes]; `block_tables`
    int32 [B, max_blocks]; `seq_lens` int32 [B] (each >= 1). Query head h reads KV
    head h // (Hq // num_kv_heads). `sliding_window` W attends positions >= seq_len - W;
    `sinks` fp32 [Hq] join the softmax denominator only. `lookup=False` is a
    timing diagnostic (codes used as centroids: wrong output).
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [batch, q_heads, head_dim]; got {tuple(query.shape)}")
    bsz, hq, d = query.shape
    lay = tq_layout(fmt, d)
    if cache.dtype != torch.uint8 or cache.dim() != 4 or cache.shape[3] != lay.slot_bytes:
        raise ValueError(f"{fmt}: cache must be uint8 [blocks, block_size, kv_heads, {lay.slot_bytes}]; got "
                         f"{cache.dtype} {tuple(cache.shape)}")
    hkv = cache.shape[2]
    if hq % hkv:
        raise ValueError(f"q_heads {hq} is not a multiple of kv_heads {hkv}")
    if not cache.is_contiguous():
        raise ValueError("cache must be contiguous (its strides are compiled into the kernel)")
    if block_tables.dim() != 2 or block_tables.shape[0] != bsz or seq_lens.shape != (bsz,):
        raise ValueError(f"block_tables [B, max_blocks] and seq_lens [B] must match batch {bsz}")
    if query.stride(-1) != 1:
        raise ValueError("query needs a contiguous last dimension")
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks must be [{hq}]; got {tuple(sinks.shape)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    group = hq // hkv
    page = cache.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(bsz, hkv, block_tables.shape[1] * page, block_n, query.device)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    tabs = kernel_tables(fmt, d, cache.device)
    out = torch.empty_like(query)
    if num_splits > 1:
        part_o = torch.empty((bsz * hq, num_splits, d), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((bsz * hq, num_splits), dtype=torch.float32, device=query.device)
    else:
        part_o = part_lse = out  # unused
    sinks_arg = sinks if sinks is not None else out
    _tq_decode_kernel[(bsz * hkv, num_splits)](
        query, cache, cache.view(torch.float16), block_tables, seq_lens,
        tabs["rot_t_sign_f16"], tabs["codebook_unit_f16"], sinks_arg, out, part_o, part_lse,
        scale * LOG2E, 1.0 / d, sliding_window or 0,
        query.stride(0), query.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_KV=hkv, GROUP=group, HEAD_DIM=d, SLOT=lay.slot_bytes, PAGE=page,
        STRIDE_BLK=cache.stride(0), STRIDE_TOK=cache.stride(1),
        KEY_BITS=lay.key_bits, V_BITS=lay.value_bits, V_OFF=lay.val_off, KNORM_OFF=max(lay.knorm_off, 0),
        VSCALE_OFF=lay.vscale_off, VZERO_OFF=lay.vzero_off,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None, V_MAGIC=v_magic, LOOKUP=lookup,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _tq_merge_kernel[(bsz * hq,)](
            part_o, part_lse, sinks_arg, out, out.stride(0), out.stride(1),
            NUM_HEADS=hq, HEAD_DIM=d, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            HAS_SINKS=sinks is not None, num_warps=4,
        )
    return out
