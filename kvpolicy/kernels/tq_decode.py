"""TurboQuant decode attention: the portable Triton kernel (dequantization fused, split-KV, GQA-packed), and
`decode_attention_tq`, the entry point that also routes planar caches to the Hopper Gluon kernels.

One program takes the query heads of one KV head (padded to BLOCK_M >= 16 rows so the products run on
tensor cores), one sequence, and one split of its context. Per tile of BLOCK_N tokens it loads only the
packed bytes, with one 64-bit base per page and compile-time row offsets:

- keys: the query was rotated once (Pi q, folded with sm_scale*log2(e)), so a centroid key never needs the
  inverse rotation. Sign-magnitude codes unpack in registers: a short PTX program (`turboquant.k4_program`,
  `k3_program`) reads the fp16 magnitudes from a 2-4 register table with byte permutes and XORs the sign;
  the fp16 centroids go straight into `tl.dot`, and the per-token norm multiplies the score column. FP8
  keys convert in registers.
- values: never dequantized. sum_j p_j (code_j * scale_j + zero_j) = dot(p * scale, codes) + sum_j p_j
  zero_j, so the scale folds into P (one multiply per score) and the zero point into a per-row scalar; the
  codes become exact fp16 integers by a mantissa trick (`v4_program`, `v3_program`).

Under the Triton interpreter (no PTX) the same values come from pure-Triton code (`ASM=False`). Nothing
dequantized is ever written to memory. This kernel reads the slot layout [blocks, block_size, kv_heads,
slot_bytes]; on Hopper, planar caches go to `tq_gluon` (FP8 keys) or `tq_warp` (centroid keys), which
measured 2-4x faster (bench/RESULTS.md).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvpolicy.kernels.formats import PAGE as PLANAR_PAGE
from kvpolicy.kernels.formats import WARP_ORDER_FORMATS, tq_layout
from kvpolicy.kernels.guards import check_paged_ranges
from kvpolicy.kernels.launch import LOG2E, interpreting, merge_splits, split_count, split_partials
from kvpolicy.kernels.reductions import rmax, rsum
from kvpolicy.kernels.turboquant import k3_program, k4_program, kernel_tables, render_ptx, v3_program, v4_program

_K4_ASM = tl.constexpr(render_ptx(k4_program()))
_K3_ASM = tl.constexpr(render_ptx(k3_program()))
_V4_ASM = tl.constexpr(render_ptx(v4_program()))
_V3_ASM = tl.constexpr(render_ptx(v3_program()))


@triton.jit
def _keys4(kb, cb_ptr, ASM: tl.constexpr):
    """4-bit sign-magnitude key bytes -> (centroids of the low nibbles, of the high nibbles), fp16 unit variance."""
    if ASM:
        return tl.inline_asm_elementwise(_K4_ASM, "=r,=r,=r,=r,r", [kb], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=4)
    return tl.load(cb_ptr + (kb & 15).to(tl.int32)), tl.load(cb_ptr + (kb >> 4).to(tl.int32))


@triton.jit
def _keys3(p2, p1s, cb_ptr, ASM: tl.constexpr):
    """3-bit keys: 2-bit plane bytes and sign bytes (quarter s at bit 2s) -> four quarters of fp16 centroids."""
    if ASM:
        return tl.inline_asm_elementwise(_K3_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [p2, p1s],
                                         dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                         is_pure=True, pack=4)
    c0 = ((p2 & 3) | ((p1s & 1) << 2)).to(tl.int32)
    c1 = (((p2 >> 2) & 3) | (((p1s >> 2) & 1) << 2)).to(tl.int32)
    c2 = (((p2 >> 4) & 3) | (((p1s >> 4) & 1) << 2)).to(tl.int32)
    c3 = (((p2 >> 6) & 3) | (((p1s >> 6) & 1) << 2)).to(tl.int32)
    return tl.load(cb_ptr + c0), tl.load(cb_ptr + c1), tl.load(cb_ptr + c2), tl.load(cb_ptr + c3)


@triton.jit
def _values4(vb, ASM: tl.constexpr):
    """4-bit value bytes -> (low nibble, 16 * high nibble), exact fp16."""
    if ASM:
        return tl.inline_asm_elementwise(_V4_ASM, "=r,=r,=r,=r,r", [vb], dtype=(tl.float16, tl.float16),
                                         is_pure=True, pack=4)
    return (vb & 15).to(tl.float16), (vb & 0xF0).to(tl.float16)


@triton.jit
def _values3(p2, p1s, ASM: tl.constexpr):
    """3-bit value codes -> quarter s as 4^s * code, exact fp16."""
    if ASM:
        return tl.inline_asm_elementwise(_V3_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [p2, p1s],
                                         dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                         is_pure=True, pack=4)
    a = p2.to(tl.int32)
    c = p1s.to(tl.int32) << 2
    v0 = ((a & 0x03) | (c & 0x04)).to(tl.float32)
    v1 = ((a & 0x0C) | (c & 0x10)).to(tl.float32)
    v2 = ((a & 0x30) | (c & 0x40)).to(tl.float32)
    v3 = ((a & 0xC0) | (c & 0x100)).to(tl.float32)
    return v0.to(tl.float16), v1.to(tl.float16), v2.to(tl.float16), v3.to(tl.float16)


@triton.jit
def _tile_pages(bt_row, n0, seq_len, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
                PPT: tl.constexpr):
    """Physical page of each SUB-row chunk of the tile starting at token n0.

    Chunks past the sequence read page 0: table entries there may be anything (the prefetch asks
    for one tile past the end), and the rows are masked out of the scores anyway."""
    c_tok = n0 + tl.arange(0, PPT) * SUB
    return tl.load(bt_row + c_tok // PAGE, mask=c_tok < seq_len, other=0)


@triton.jit
def _load_tile(cache_u8_ptr, cache_f16_ptr, pages, n0, kvh, start, hi,
               SLOT: tl.constexpr, NUM_KV: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
               KEY_BITS: tl.constexpr, V_BITS: tl.constexpr, V_OFF: tl.constexpr, KNORM_OFF: tl.constexpr,
               VSCALE_OFF: tl.constexpr, VZERO_OFF: tl.constexpr,
               BLOCK_N: tl.constexpr, SUB: tl.constexpr, PPT: tl.constexpr):
    """Packed bytes of one tile: (key bytes, key 1-bit plane, value bytes, value 1-bit plane, knorm, vscale, vzero).

    One 64-bit base per page and compile-time row offsets, so every load is `LDG [base + imm]`.
    Code bytes load unmasked (every row lies in a real page; pages past the table read page 0):
    rows outside [start, hi) are dropped by the score mask. The fp16 scale and zero are masked
    because stale ones may be inf or NaN and 0 * NaN is NaN.
    """
    STRIDE_TOK: tl.constexpr = NUM_KV * SLOT
    STRIDE_BLK: tl.constexpr = PAGE * NUM_KV * SLOT
    KC: tl.constexpr = HEAD_DIM if KEY_BITS == 8 else (HEAD_DIM // 2 if KEY_BITS == 4 else HEAD_DIM // 4)
    VC: tl.constexpr = HEAD_DIM // 2 if V_BITS == 4 else HEAD_DIM // 4
    E: tl.constexpr = HEAD_DIM // 8
    sub_rows = tl.arange(0, SUB)
    c_tok = n0 + tl.arange(0, PPT) * SUB
    base = pages.to(tl.int64) * STRIDE_BLK + (c_tok % PAGE) * STRIDE_TOK + kvh * SLOT  # [PPT]
    row = base[:, None] + sub_rows[None, :] * STRIDE_TOK  # [PPT, SUB]
    row3 = cache_u8_ptr + row[:, :, None]
    row16 = tl.reshape(row >> 1, [BLOCK_N])  # fp16 fields: slots and strides are even
    tok = tl.reshape(c_tok[:, None] + sub_rows[None, :], [BLOCK_N])
    n_mask = (tok < hi) & (tok >= start)
    cols_k = tl.arange(0, KC)
    cols_v = tl.arange(0, VC)
    ka = tl.reshape(tl.load(row3 + cols_k[None, None, :]), [BLOCK_N, KC])
    kx = ka
    if KEY_BITS == 3:
        kx = tl.reshape(tl.load(row3 + KC + (cols_k % E)[None, None, :]), [BLOCK_N, KC])
    va = tl.reshape(tl.load(row3 + V_OFF + cols_v[None, None, :]), [BLOCK_N, VC])
    vx = va
    if V_BITS == 3:
        vx = tl.reshape(tl.load(row3 + V_OFF + VC + (cols_v % E)[None, None, :]), [BLOCK_N, VC])
    knorm = tl.full([BLOCK_N], 0, dtype=tl.float16)
    if KEY_BITS != 8:
        knorm = tl.load(cache_f16_ptr + row16 + KNORM_OFF // 2)
    vscale = tl.load(cache_f16_ptr + row16 + VSCALE_OFF // 2, mask=n_mask, other=0.0)
    vzero = tl.load(cache_f16_ptr + row16 + VZERO_OFF // 2, mask=n_mask, other=0.0)
    return ka, kx, va, vx, knorm, vscale, vzero


@triton.jit
def _scaled_query(q_ptr, b, kvh, q_scale, stride_qb, stride_qh,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """The query rows of one (sequence, KV head) GQA group times sm_scale*log2(e), in fp16 (padding rows 0).

    Scaling before the fp16 cast keeps q well inside fp16's range and precision."""
    offs_m = tl.arange(0, BLOCK_M)
    qh = kvh * GROUP + offs_m
    cols = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + cols[None, :], mask=(offs_m < GROUP)[:, None],
                other=0.0)
    return (q.to(tl.float32) * q_scale).to(tl.float16)


@triton.jit
def _tq_rotate_query_kernel(q_ptr, rot_ptr, out_ptr, q_scale, rot_scale, stride_qb, stride_qh,
                            NUM_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """out[b, h] = (q[b, h] * q_scale) @ Pi^T sqrt(D) * rot_scale in fp16, for the GQA group of one (sequence, KV head).

    Run once per decode step, so the split programs of the attention kernel read a rotated query
    instead of each rotating it again (2-4 [D, D/2] tiles from L2 and as many products per program)."""
    pid = tl.program_id(0)
    b = pid // NUM_KV
    kvh = pid % NUM_KV
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < GROUP
    qh = kvh * GROUP + offs_m
    cols = tl.arange(0, HEAD_DIM)
    q16 = _scaled_query(q_ptr, b, kvh, q_scale, stride_qb, stride_qh, GROUP, HEAD_DIM, BLOCK_M)
    rot = tl.load(rot_ptr + cols[:, None] * HEAD_DIM + cols[None, :])
    qr = (tl.dot(q16, rot) * rot_scale).to(tl.float16)
    tl.store(out_ptr + (b * NUM_KV * GROUP + qh)[:, None] * HEAD_DIM + cols[None, :], qr, mask=m_mask[:, None])


@triton.jit
def _tq_decode_kernel(
    # tensors
    q_ptr, qr_ptr, cache_u8_ptr, cache_f16_ptr, block_tables_ptr, seq_lens_ptr,
    cb_ptr, sinks_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    # scalars
    q_scale, window, num_splits,
    # strides (elements)
    stride_qb, stride_qh, stride_btb, stride_ob, stride_oh,
    # geometry and layout (the cache is contiguous: its strides are constants)
    NUM_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SLOT: tl.constexpr,
    PAGE: tl.constexpr, KEY_BITS: tl.constexpr, V_BITS: tl.constexpr,
    V_OFF: tl.constexpr, KNORM_OFF: tl.constexpr, VSCALE_OFF: tl.constexpr, VZERO_OFF: tl.constexpr,
    # tiling and options
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr,
):
    SUB: tl.constexpr = BLOCK_N if BLOCK_N < PAGE else PAGE  # rows of one page inside a tile
    PPT: tl.constexpr = BLOCK_N // SUB  # pages per tile

    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // NUM_KV
    kvh = pid_bh % NUM_KV

    seq_len = tl.load(seq_lens_ptr + b)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    # tiles are aligned to BLOCK_N so that a tile's rows sit in whole sub-pages
    first = (start // BLOCK_N) * BLOCK_N
    per_split = ((seq_len - first + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = first + pid_s * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < GROUP
    qh = kvh * GROUP + offs_m

    # key chunking: 4-bit codes give two halves of the vector, 3-bit codes four quarters
    KC: tl.constexpr = HEAD_DIM if KEY_BITS == 8 else (HEAD_DIM // 2 if KEY_BITS == 4 else HEAD_DIM // 4)
    VC: tl.constexpr = HEAD_DIM // 2 if V_BITS == 4 else HEAD_DIM // 4
    E: tl.constexpr = HEAD_DIM // 8
    cols_k = tl.arange(0, KC)
    cols_v = tl.arange(0, VC)
    if KEY_BITS == 8:
        # FP8 keys are not rotated: the scaled query itself
        q0 = _scaled_query(q_ptr, b, kvh, q_scale, stride_qb, stride_qh, GROUP, HEAD_DIM, BLOCK_M)
        q1 = q0
        q2 = q0
        q3 = q0
    else:
        # rotated once per decode step by _tq_rotate_query_kernel: Pi q = (q @ S) / sqrt(D) with
        # S = +-1, scaled by sm_scale*log2(e) and 1/D (which also undoes the unit-variance codebook's sqrt(D))
        qr = qr_ptr + (b * NUM_KV * GROUP + qh)[:, None] * HEAD_DIM
        q0 = tl.load(qr + (0 * KC + cols_k)[None, :], mask=m_mask[:, None], other=0.0)
        q1 = tl.load(qr + (1 * KC + cols_k)[None, :], mask=m_mask[:, None], other=0.0)
        q2 = q0
        q3 = q1
        if KEY_BITS == 3:
            q2 = tl.load(qr + (2 * KC + cols_k)[None, :], mask=m_mask[:, None], other=0.0)
            q3 = tl.load(qr + (3 * KC + cols_k)[None, :], mask=m_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0, dtype=tl.float32)
    z_i = tl.full([BLOCK_M], 0, dtype=tl.float32)  # sum_j p_j * zero_j
    acc0 = tl.full([BLOCK_M, VC], 0, dtype=tl.float32)
    acc1 = tl.full([BLOCK_M, VC], 0, dtype=tl.float32)
    acc2 = tl.full([BLOCK_M, VC], 0, dtype=tl.float32)
    acc3 = tl.full([BLOCK_M, VC], 0, dtype=tl.float32)
    # 3-bit: column j of a quarter reads 1-bit-plane byte j mod E at bit 2s + j // E
    hsh_k = (cols_k // E).to(tl.uint8)
    hsh_v = (cols_v // E).to(tl.uint8)
    bt_row = block_tables_ptr + b * stride_btb

    # software pipeline: the bytes of tile i+1 are in flight while tile i is computed, and the
    # page ids of tile i+2 (the loads the byte addresses depend on) one step earlier still
    pages = _tile_pages(bt_row, lo, seq_len, PAGE, BLOCK_N, SUB, PPT)
    pages_next = _tile_pages(bt_row, lo + BLOCK_N, seq_len, PAGE, BLOCK_N, SUB, PPT)
    ka, kx, va, vx, knorm, vscale, vzero = _load_tile(
        cache_u8_ptr, cache_f16_ptr, pages, lo, kvh, start, hi, SLOT, NUM_KV, PAGE, HEAD_DIM, KEY_BITS, V_BITS,
        V_OFF, KNORM_OFF, VSCALE_OFF, VZERO_OFF, BLOCK_N, SUB, PPT)

    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = (offs_n < hi) & (offs_n >= start)
        if PREFETCH:
            pages_next2 = _tile_pages(bt_row, n0 + 2 * BLOCK_N, seq_len, PAGE, BLOCK_N, SUB, PPT)
            nka, nkx, nva, nvx, nknorm, nvscale, nvzero = _load_tile(
                cache_u8_ptr, cache_f16_ptr, pages_next, n0 + BLOCK_N, kvh, start, hi, SLOT, NUM_KV, PAGE,
                HEAD_DIM, KEY_BITS, V_BITS, V_OFF, KNORM_OFF, VSCALE_OFF, VZERO_OFF, BLOCK_N, SUB, PPT)

        # ---- scores (base 2) ----
        if KEY_BITS == 8:
            k = ka.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            s = tl.dot(q0, tl.trans(k))
        elif KEY_BITS == 4:
            k0, k1 = _keys4(ka, cb_ptr, ASM)
            s = tl.dot(q0, tl.trans(k0))
            s = tl.dot(q1, tl.trans(k1), s)
        else:
            k0, k1, k2, k3 = _keys3(ka, kx >> hsh_k[None, :], cb_ptr, ASM)
            s = tl.dot(q0, tl.trans(k0))
            s = tl.dot(q1, tl.trans(k1), s)
            s = tl.dot(q2, tl.trans(k2), s)
            s = tl.dot(q3, tl.trans(k3), s)
        if KEY_BITS != 8:
            s = s * knorm.to(tl.float32)[None, :]
        s = tl.where(n_mask[None, :], s, float("-inf"))  # also drops NaN from stale slots

        # ---- online softmax ----
        m_new = tl.maximum(m_i, rmax(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + rsum(p, axis=1)
        z_i = z_i * alpha + rsum(p * vzero.to(tl.float32)[None, :], axis=1)
        pv = (p * vscale.to(tl.float32)[None, :]).to(tl.float16)
        m_i = m_new

        # ---- P @ codes: values are never dequantized, scale and zero were folded above ----
        if V_BITS == 4:
            v0, v1 = _values4(va, ASM)
            acc0 = tl.dot(pv, v0, acc0 * alpha[:, None])
            acc1 = tl.dot(pv, v1, acc1 * alpha[:, None])
        else:
            v0, v1, v2, v3 = _values3(va, vx >> hsh_v[None, :], ASM)
            acc0 = tl.dot(pv, v0, acc0 * alpha[:, None])
            acc1 = tl.dot(pv, v1, acc1 * alpha[:, None])
            acc2 = tl.dot(pv, v2, acc2 * alpha[:, None])
            acc3 = tl.dot(pv, v3, acc3 * alpha[:, None])

        if PREFETCH:
            ka, kx, va, vx, knorm, vscale, vzero = nka, nkx, nva, nvx, nknorm, nvscale, nvzero
            pages_next = pages_next2
        else:
            # loads for the next tile issued after this tile's math: fewer live registers
            ka, kx, va, vx, knorm, vscale, vzero = _load_tile(
                cache_u8_ptr, cache_f16_ptr, pages_next, n0 + BLOCK_N, kvh, start, hi, SLOT, NUM_KV, PAGE,
                HEAD_DIM, KEY_BITS, V_BITS, V_OFF, KNORM_OFF, VSCALE_OFF, VZERO_OFF, BLOCK_N, SUB, PPT)
            pages_next = _tile_pages(bt_row, n0 + 2 * BLOCK_N, seq_len, PAGE, BLOCK_N, SUB, PPT)

    if not SPLIT:
        den = l_i
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + qh, mask=m_mask, other=0.0).to(tl.float32) * LOG2E
            den = den + tl.exp2(sink - m_i)
        inv = 1.0 / den
        o_base = out_ptr + b * stride_ob + qh[:, None] * stride_oh
        o_ty = out_ptr.dtype.element_ty
    else:
        empty = l_i == 0.0  # this split got no tokens
        inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        row_bh = b * (NUM_KV * GROUP) + qh
        tl.store(part_lse_ptr + row_bh * num_splits + pid_s, lse, mask=m_mask)
        o_base = part_o_ptr + (row_bh[:, None] * num_splits + pid_s) * HEAD_DIM
        o_ty = tl.float32
    # out = acc / f + z, with f the power of two at which each chunk's codes sit in their byte
    zc = z_i[:, None]
    w = inv[:, None]
    if V_BITS == 4:
        tl.store(o_base + cols_v[None, :], ((acc0 + zc) * w).to(o_ty), mask=m_mask[:, None])
        tl.store(o_base + (VC + cols_v)[None, :], ((acc1 * 0.0625 + zc) * w).to(o_ty), mask=m_mask[:, None])
    else:
        tl.store(o_base + cols_v[None, :], ((acc0 + zc) * w).to(o_ty), mask=m_mask[:, None])
        tl.store(o_base + (VC + cols_v)[None, :], ((acc1 * 0.25 + zc) * w).to(o_ty), mask=m_mask[:, None])
        tl.store(o_base + (2 * VC + cols_v)[None, :], ((acc2 * 0.0625 + zc) * w).to(o_ty),
                 mask=m_mask[:, None])
        tl.store(o_base + (3 * VC + cols_v)[None, :], ((acc3 * 0.015625 + zc) * w).to(o_ty),
                 mask=m_mask[:, None])


class Tiling(NamedTuple):
    """The launch tiling of `_tq_decode_kernel` for a format and head_dim, and how many of its programs an SM
    holds at once; FP8 keys also load the next tile's bytes while a tile is computed (register prefetch)."""

    block_n: int
    num_warps: int
    maxnreg: int | None
    programs_per_sm: float
    """Resident programs per SM on an H200 (registers decide): `default_num_splits` fills whole waves of them."""


def default_tiling(key_bits: int, head_dim: int) -> Tiling:
    """The tiling for a key width and head_dim: what measured fastest on an H200. 128-token tiles for FP8 keys;
    4-bit keys at head_dim 128 on 64-token tiles capped at 128 registers (4 programs per SM instead of 3), at
    head_dim 64 on 128-token tiles; 3-bit keys on 64-token tiles of 2 warps (more, smaller programs)."""
    if key_bits == 8:
        return Tiling(128, 4, None, 2.0)
    if key_bits == 4:
        return Tiling(64, 4, 128, 4.0) if head_dim >= 128 else Tiling(128, 4, None, 2.0)
    return Tiling(64, 2, None, 4.0)


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int, device: torch.device,
                       programs_per_sm: float = 2.0) -> int:
    """Splits that fill whole waves of `programs_per_sm` resident programs (`launch.split_count`, at most 64)."""
    if device.type != "cuda":
        return 1 if max_context <= 4 * block_n else 2
    return min(64, split_count(batch, num_kv_heads, max_context, block_n, programs_per_sm, device))


def decode_attention_tq(
    query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, fmt: str,
    *, sm_scale: float | None = None, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
    num_splits: int | None = None, out: torch.Tensor | None = None, kernel: str = "triton",
) -> torch.Tensor:
    """Decode attention of `query` [B, Hq, D] over a packed TurboQuant cache; returns [B, Hq, D] in query's dtype.

    `cache` uint8 [num_blocks, block_size, num_kv_heads, slot_bytes] (slots, the Triton kernel's), or planar
    [num_blocks, num_kv_heads, 16 * slot_bytes] (`turboquant.allocate_tq_planar_cache`, the Gluon kernels');
    `block_tables` int32 [B, max_blocks]; `seq_lens` int32 [B] (each >= 1). Query head h reads KV head
    h // (Hq // num_kv_heads). `sliding_window` W attends positions >= seq_len - W; `sinks` fp32 [Hq] join the
    softmax denominator only. `out` (optional) receives the result.
    `kernel`: "triton" (this module's kernel), "gluon" (Hopper, head_dim 64/128: `tq_gluon` for FP8 keys,
    `tq_warp` for centroid keys; raises ValueError saying why where it does not apply) or "auto" (Gluon where
    it applies, else Triton).
    """
    if kernel not in ("triton", "gluon", "auto"):
        raise ValueError(f"kernel must be 'triton', 'gluon' or 'auto', got {kernel!r}")
    if query.dim() != 3:
        raise ValueError(f"query must be [batch, q_heads, head_dim]; got {tuple(query.shape)}")
    bsz, hq, d = query.shape
    lay = tq_layout(fmt, d)
    planar = cache.dim() == 3  # turboquant.allocate_tq_planar_cache: [blocks, kv_heads, PLANAR_PAGE * slot_bytes]
    if cache.dtype != torch.uint8 or not (
            (cache.dim() == 4 and cache.shape[3] == lay.slot_bytes)
            or (planar and cache.shape[2] == PLANAR_PAGE * lay.slot_bytes)):
        raise ValueError(f"{fmt}: cache must be uint8 [blocks, block_size, kv_heads, {lay.slot_bytes}], or planar "
                         f"[blocks, kv_heads, {PLANAR_PAGE * lay.slot_bytes}]; got {cache.dtype} {tuple(cache.shape)}")
    hkv = cache.shape[1] if planar else cache.shape[2]
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
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(query.shape)} with a contiguous last dimension; got {tuple(out.shape)}")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"block_tables and seq_lens must be int32; got {block_tables.dtype} and {seq_lens.dtype}")
    if sm_scale is not None and not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be finite and positive, got {sm_scale}")
    check_paged_ranges(block_tables, seq_lens, cache.shape[0], PLANAR_PAGE if planar else cache.shape[1],
                       sliding_window)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    if kernel != "triton":
        why = _gluon_refusal(query, cache, fmt)
        if not why:
            gluon = _gluon_module(fmt)
            return gluon.decode(query, cache, fmt, block_tables, seq_lens, q_scale=scale * LOG2E.value,
                                sliding_window=sliding_window, sinks=sinks, num_splits=num_splits, out=out)
        if kernel == "gluon" or planar:
            raise ValueError(f"kernel={kernel!r} cannot decode this call: {why}")
    if planar:
        raise ValueError("a planar cache is read by the Gluon kernels only (kernel='gluon' or 'auto', on an sm_90 "
                         "GPU); the Triton kernel reads the slot layout [blocks, block_size, kv_heads, slot_bytes]")
    tiling = default_tiling(lay.key_bits, d)
    group = hq // hkv
    page = cache.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(bsz, hkv, block_tables.shape[1] * page, tiling.block_n, query.device,
                                        tiling.programs_per_sm)
    use_asm = query.is_cuda and not interpreting()
    tabs = kernel_tables(fmt, d, cache.device)
    part_o, part_lse = split_partials(out, num_splits)
    sinks_arg = sinks if sinks is not None else out
    block_m = max(16, triton.next_power_of_2(group))
    q_rot = query if lay.key_fp8 else _rotated_query(query, fmt, hkv, scale)  # FP8 keys are not rotated
    _tq_decode_kernel[(bsz * hkv, num_splits)](
        query, q_rot, cache, cache.view(torch.float16), block_tables, seq_lens,
        tabs["codebook_sm_unit_f16"], sinks_arg, out, part_o, part_lse,
        scale * LOG2E.value, sliding_window or 0, num_splits,
        query.stride(0), query.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        NUM_KV=hkv, GROUP=group, HEAD_DIM=d, SLOT=lay.slot_bytes, PAGE=page,
        KEY_BITS=lay.key_bits, V_BITS=lay.value_bits, V_OFF=lay.val_off, KNORM_OFF=max(lay.knorm_off, 0),
        VSCALE_OFF=lay.vscale_off, VZERO_OFF=lay.vzero_off,
        BLOCK_M=block_m, BLOCK_N=tiling.block_n, SPLIT=num_splits > 1,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None, ASM=use_asm, PREFETCH=lay.key_fp8,
        num_warps=tiling.num_warps, num_stages=2, **({"maxnreg": tiling.maxnreg} if tiling.maxnreg else {}),
    )
    if num_splits > 1:
        merge_splits(part_o, part_lse, sinks, out, num_splits)
    return out


def _gluon_module(fmt: str):
    """The Hopper kernel of `fmt`: the per-warp one for centroid keys, the warpgroup one for FP8 keys."""
    if fmt in WARP_ORDER_FORMATS:
        from kvpolicy.kernels import tq_warp

        return tq_warp
    from kvpolicy.kernels import tq_gluon

    return tq_gluon


def gluon_refusal(fmt: str, head_dim: int, group: int, page: int) -> str:
    """Why no Hopper kernel takes layers of this shape ("" when one does): the rules for a layer plan
    (`LayerPlan.kernel_path`); the device is `launch.gluon_runs_on`'s to check."""
    if fmt not in WARP_ORDER_FORMATS + ("turboquant_k8v4",):
        return f"{fmt} is not a TurboQuant format"
    return _gluon_module(fmt).refusal(fmt, head_dim, group, page)


def _gluon_refusal(query: torch.Tensor, cache: torch.Tensor, fmt: str) -> str:
    """Why the Gluon kernels cannot take this call; "" when one can."""
    from kvpolicy.kernels.launch import gluon_runs_on

    d = query.shape[2]
    planar = cache.dim() == 3  # [blocks, kv_heads, page bytes]; a slot cache is refused below
    why = gluon_refusal(fmt, d, query.shape[1] // cache.shape[1] if planar else 1, PLANAR_PAGE)
    if not why and (not planar or cache.shape[2] != PLANAR_PAGE * tq_layout(fmt, d).slot_bytes
                    or not cache.is_contiguous()):
        why = (f"it reads planar caches of {PLANAR_PAGE}-token pages (turboquant.allocate_tq_planar_cache), "
               f"not {tuple(cache.shape)}")
    if not why:
        why = gluon_runs_on(query.device)[1]
    return why


def _rotated_query(query: torch.Tensor, fmt: str, num_kv_heads: int, scale: float) -> torch.Tensor:
    """Pi q * scale * log2(e) / D in fp16, once per decode step (`_tq_rotate_query_kernel`), for centroid keys."""
    bsz, hq, d = query.shape
    group = hq // num_kv_heads
    q_rot = torch.empty((bsz, hq, d), dtype=torch.float16, device=query.device)
    _tq_rotate_query_kernel[(bsz * num_kv_heads,)](
        query, kernel_tables(fmt, d, query.device)["rot_t_sign_f16"], q_rot, scale * LOG2E.value, 1.0 / d,
        query.stride(0), query.stride(1), NUM_KV=num_kv_heads, GROUP=group, HEAD_DIM=d,
        BLOCK_M=max(16, triton.next_power_of_2(group)), num_warps=4)
    return q_rot
