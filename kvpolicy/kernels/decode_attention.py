"""Paged decode attention (flash-decoding) over BF16 and FP8 (e4m3) KV caches: the portable Triton kernel, and
`decode_attention`, the entry point that also routes FP8 calls to the Hopper Gluon kernel (`decode_gluon`).

One program handles one (KV head, split, sequence): the query heads of that KV head (its GQA group) are
packed into the rows of one tile, so each K/V tile is read from HBM once per group; S = Q.K^T with the
padded group as M (16 rows, mma.sync). FP8 K is upcast to fp16 for Q.K^T, or the query is quantised to
e4m3 per program (`fp8_query`); P is rounded to e4m3 (scaled by `P_SCALE` first), as FA3 does, and P.V runs
in fp16 on those exact values against V converted in registers (without two-level accumulation, e4m3 P
times e4m3 V on the tensor cores, FA3's one-level form). Scales fold into the math: k_scale (and the
query's scale) into the logit scale, v_scale into the output. Figures: bench/RESULTS.md; designs that
won and lost: bench/KERNELS.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvpolicy.kernels.formats import FP8_E4M3_MAX, PTH_MODE, pth_layout
from kvpolicy.kernels.guards import check_paged_ranges, check_scales
from kvpolicy.kernels.launch import (
    LOG2E,
    interpreting,
    merge_splits,
    resident_programs,
    span,
    split_count,
    split_partials,
)
from kvpolicy.kernels.paged_store import (
    check_pth_cache,
    check_scale,
    fp8_e4m3_bits,
    rht_matrix,
    round_away,
)
from kvpolicy.kernels.turboquant import (
    i8_program,
    nibbles_program,
    render_ptx,
    v4_program,
)

P_SCALE = tl.constexpr(256.0)
"""Softmax probabilities (<= 1) are multiplied by this before the e4m3 cast, so
small ones land in e4m3's normal range (>= 2**-6) rather than its coarse subnormals."""
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
_I8_ASM = tl.constexpr(render_ptx(i8_program()))
_NIBBLES_ASM = tl.constexpr(render_ptx(nibbles_program()))
_V4_ASM = tl.constexpr(render_ptx(v4_program()))


@dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the Triton kernel; `default_config` picks one."""

    block_n: int
    """KV positions per tile."""
    num_stages: int
    """Software-pipelining depth of the KV loop."""
    defer_sum: bool = False
    """Keep the softmax denominator as per-position partial sums and reduce it once after the loop, instead of
    a cross-warp sum per tile (more registers)."""


NUM_WARPS = 4
# Registers per thread and shared memory per program of the default configs (sm_90 compile): what the split
# count's wave size is computed from.
_PROGRAM_SIZE = {(True, 64): (123, 55296), (True, 128): (123, 55296), (False, 64): (140, 71680),
                 (False, 128): (130, 73984)}


def default_config(head_dim: int, kv_fp8: bool, device: torch.device) -> DecodeConfig:
    """The tiling for a head_dim and cache format: what measured fastest on an H200; few, large tiles under the
    interpreter (it runs programs one after another in numpy)."""
    if device.type != "cuda" or interpreting():
        return DecodeConfig(block_n=128, num_stages=1)
    # Triton gives each K/V load one buffer, so a program has one tile in flight: block_n x head_dim holds
    # 16K elements at every head_dim (the size that reached the memory floor at head_dim 128).
    block_n = max(32, min(256, 16384 // head_dim))
    if kv_fp8:
        # latency-bound: half the tile, three stages, the denominator summed once after the loop
        return DecodeConfig(block_n=max(32, block_n // 2), num_stages=3, defer_sum=True)
    if head_dim <= 64:
        return DecodeConfig(block_n=block_n // 2, num_stages=3, defer_sum=True)
    return DecodeConfig(block_n=block_n, num_stages=2)


def programs_per_sm(head_dim: int, kv_fp8: bool, device: torch.device) -> int:
    """Programs of the default config resident per SM (on an H200: 4 for FP8, 3 for BF16); 1 off the GPU."""
    if device.type != "cuda" or interpreting():
        return 1
    regs, smem = _PROGRAM_SIZE[(kv_fp8, 64 if head_dim <= 64 else 128)]
    return resident_programs(regs, smem, NUM_WARPS, device)


@triton.jit
def _load_pages(bt_row, offs_n, seq_len, PAGE_SIZE: tl.constexpr):
    """Physical page of each position `offs_n` (0 past the sequence)."""
    # (unsigned: a shift, not a signed division)
    return tl.load(bt_row + offs_n.to(tl.uint32) // PAGE_SIZE, mask=offs_n < seq_len, other=0).to(tl.int64)


@triton.jit
def _load_tile(k_base, v_base, page, offs_n, seq_len, start, offs_d,
               stride_kb, stride_kt, stride_vb, stride_vt, PAGE_SIZE: tl.constexpr):
    """K and V rows [BLOCK_N, HEAD_DIM] of positions `offs_n` in pages `page`; masked rows read nothing."""
    valid = (offs_n < seq_len) & (offs_n >= start)
    in_page = offs_n.to(tl.uint32) % PAGE_SIZE
    k = tl.load(k_base + (page * stride_kb + in_page * stride_kt)[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
    v = tl.load(v_base + (page * stride_vb + in_page * stride_vt)[:, None] + offs_d[None, :], mask=valid[:, None], other=0)
    return k, v, valid


@triton.jit
def _e4m3_to_f16(x):
    """e4m3 bytes (uint8) to fp16, in registers: opaque to Triton, so the tile reaches the MMA as fp16."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        # Not pure: Triton would otherwise move the layout conversion above it
        # and gather e4m3 bytes again.
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _attend_tile(k, v, valid, q_op, qk_scale, m_i, l_i, acc,
                 KV_FP8: tl.constexpr, FP8_QUERY: tl.constexpr, TWO_LEVEL: tl.constexpr, INTERPRET: tl.constexpr,
                 DEFER_SUM: tl.constexpr, FP8_PV: tl.constexpr):
    """One online-softmax step over a K/V tile: returns the updated (running max, denominator, accumulator).

    `FP8_PV` (FP8 caches without two-level accumulation): P.V as FA3 computes it on Hopper, e4m3 P and V straight
    into the tensor cores, the accumulator ([HEAD_DIM, BLOCK_H], so that head_dim is the MMA's M and the product
    is an fp8 wgmma) carried inside the MMA from tile to tile."""
    # V is the transposed operand of P.V: left to itself, Triton keeps the e4m3 tile in shared memory and
    # gathers it byte by byte (LDS.U8) into the MMA layout. Converted to fp16 in registers by opaque inline
    # asm instead, it is staged in shared memory as fp16 and read with ldmatrix.trans. K is K-major, and
    # Triton reads its e4m3 bytes with ldmatrix already.
    if KV_FP8:
        if INTERPRET:
            k = k.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            v = v.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            k = k.to(tl.float8e4nv, bitcast=True)
            if not FP8_QUERY:
                k = k.to(tl.float16)
            if FP8_PV:
                v = v.to(tl.float8e4nv, bitcast=True)
            else:
                v = _e4m3_to_f16(v)
    elif INTERPRET:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    s = tl.dot(q_op, tl.trans(k))  # [BLOCK_H, BLOCK_N]
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A tile can be wholly masked (window start, sequence end) before any
    # position was seen: keep exp2 away from (-inf) - (-inf).
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    if FP8_PV:
        acc = acc * alpha[None, :]
    else:
        acc = acc * alpha[:, None]

    if KV_FP8:
        if INTERPRET:
            # The interpreter's fp32 -> fp8 cast truncates; round exactly as the GPU does.
            p_op = fp8_e4m3_bits(p * P_SCALE).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif FP8_PV:
            p_op = (p * P_SCALE).to(tl.float8e4nv)
        else:
            # The fp16-converted V takes an fp16 P; its values are still e4m3's.
            p_op = (p * P_SCALE).to(tl.float8e4nv).to(tl.float16)
        # The denominator sums the rounded weights the MMA multiplies (in
        # P_SCALE units), so e4m3's rounding, and its flush of the tiny weights
        # of a long tail, cancels between numerator and denominator instead of
        # shrinking the output.
        p_w = p_op.to(tl.float32)
    else:
        if INTERPRET:
            p_op = p  # fp32 dot: keeps the CPU check tight; the GPU rounds P to bf16
        else:
            p_op = p.to(v.dtype)
        p_w = p
    if DEFER_SUM:
        # l_i is [BLOCK_H, BLOCK_N] here: per-position partial sums, reduced once
        # after the loop, so no tile waits on a cross-warp sum.
        l_i = l_i * alpha[:, None] + p_w
    else:
        l_i = l_i * alpha + tl.sum(p_w, 1)
    # fp16/bf16 operands accumulate in fp32 inside the MMA, so for them the two forms compute the same sums;
    # e4m3 operands (FP8_PV) do not: Hopper's fp8 wgmma keeps fewer accumulator bits than fp32 (bench/KERNELS.md)
    if FP8_PV:
        acc = tl.dot(tl.trans(v), tl.trans(p_op), acc)
    elif TWO_LEVEL:
        acc += tl.dot(p_op, v)
    else:
        acc = tl.dot(p_op, v, acc)
    return m_new, l_i, acc


@triton.jit
def _int8_query(q, q_rows, h_mask, PTH: tl.constexpr, DATA_BYTES: tl.constexpr, INTERPRET: tl.constexpr):
    """The query as int8 for the int8 MMA of the int8/int4 per-token-head caches, one dynamic scale per program:
    (codes, int4: the odd coordinates' codes (the high nibbles'), int4: the codes' row sums, the scale). int4
    pairs coordinate 2i with low nibbles and 2i+1 with high ones."""
    q_scale = tl.maximum(tl.max(tl.max(tl.abs(q), 1), 0) / 127.0, 1e-30)
    if PTH == 3:
        offs_c = tl.arange(0, DATA_BYTES)
        lo = tl.load(q_rows[:, None] + 2 * offs_c[None, :], mask=h_mask[:, None], other=0.0).to(tl.float32)
        hi = tl.load(q_rows[:, None] + 2 * offs_c[None, :] + 1, mask=h_mask[:, None], other=0.0).to(tl.float32)
    else:
        lo = q
        hi = q
    q_lo = round_away(tl.math.div_rn(lo, q_scale)).to(tl.int32)
    q_hi = round_away(tl.math.div_rn(hi, q_scale)).to(tl.int32)
    q_sum = tl.sum(q_lo, 1) + tl.sum(q_hi, 1)
    if INTERPRET:
        # integer-valued fp32: the interpreter's products and sums of these stay exact
        return q_lo.to(tl.float32), q_hi.to(tl.float32), q_sum, q_scale
    return q_lo.to(tl.int8), q_hi.to(tl.int8), q_sum, q_scale


@triton.jit
def _attend_tile_pth(k, v, ks, vs, valid, q_op, q_hi_op, q_sum, qk_scale, m_i, l_i, acc, acc_hi, z_sum,
                     PTH: tl.constexpr, FP8_QUERY: tl.constexpr, TWO_LEVEL: tl.constexpr, INTERPRET: tl.constexpr,
                     DEFER_SUM: tl.constexpr):
    """`_attend_tile` for a per-token-head cache: codes `k`, `v` [BLOCK_N, data bytes] and each token's fp32 scales
    `ks`, `vs`. The key scale multiplies the token's score column, the value scale its softmax weight (P x vs, times
    P_SCALE, is the fp16 operand of P.V); int4 subtracts the zero points as row sums (zp x sum(q) from the scores,
    sum(P x vs x zp) from the output, accumulated in `z_sum`), its high nibbles' P.V in `acc_hi` (x 16)."""
    if PTH == 3:
        kb = ks.to(tl.int32, bitcast=True)
        ks = (kb & -16).to(tl.float32, bitcast=True)
        vb = vs.to(tl.int32, bitcast=True)
        vs = (vb & -16).to(tl.float32, bitcast=True)
        if INTERPRET:
            s = tl.dot(q_op, tl.trans((k & 15).to(tl.float32))) + tl.dot(q_hi_op, tl.trans((k >> 4).to(tl.float32)))
            s = s - q_sum.to(tl.float32)[:, None] * (kb & 15).to(tl.float32)[None, :]
        else:
            k_lo, k_hi = tl.inline_asm_elementwise(_NIBBLES_ASM, "=r,=r,r", [k], dtype=(tl.int8, tl.int8),
                                                   is_pure=True, pack=4)
            s_i = tl.dot(q_op, tl.trans(k_lo), out_dtype=tl.int32)
            s_i = tl.dot(q_hi_op, tl.trans(k_hi), s_i, out_dtype=tl.int32)
            s = (s_i - q_sum[:, None] * (kb & 15)[None, :]).to(tl.float32)
    elif PTH == 2:
        if INTERPRET:
            s = tl.dot(q_op, tl.trans(k.to(tl.int8, bitcast=True).to(tl.float32)))
        else:
            s = tl.dot(q_op, tl.trans(k.to(tl.int8, bitcast=True)), out_dtype=tl.int32).to(tl.float32)
    else:
        if INTERPRET:
            k = k.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            k = k.to(tl.float8e4nv, bitcast=True)
            if not FP8_QUERY:
                k = k.to(tl.float16)
        s = tl.dot(q_op, tl.trans(k))
    s = tl.where(valid[None, :], s * (ks * qk_scale)[None, :], float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    acc = acc * alpha[:, None]
    if DEFER_SUM:
        l_i = l_i * alpha[:, None] + p
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
    p_op = (p * (vs * P_SCALE)[None, :]).to(tl.float16)
    if INTERPRET:
        p_op = p_op.to(tl.float32)
    if PTH == 3:
        if INTERPRET:
            v_lo = (v & 15).to(tl.float32)
            v_hi = (v & 0xF0).to(tl.float32)
        else:
            v_lo, v_hi = tl.inline_asm_elementwise(_V4_ASM, "=r,=r,=r,=r,r", [v], dtype=(tl.float16, tl.float16),
                                                   is_pure=True, pack=4)
        acc_hi = acc_hi * alpha[:, None]
        # the rounded weights the MMA multiplies, so that the zero point cancels exactly
        z_sum = z_sum * alpha + tl.sum(p_op.to(tl.float32) * (vb & 15).to(tl.float32)[None, :], 1)
        if TWO_LEVEL:
            acc += tl.dot(p_op, v_lo)
            acc_hi += tl.dot(p_op, v_hi)
        else:
            acc = tl.dot(p_op, v_lo, acc)
            acc_hi = tl.dot(p_op, v_hi, acc_hi)
    else:
        if PTH == 2:
            if INTERPRET:
                v = v.to(tl.int8, bitcast=True).to(tl.float32)
            else:
                v = tl.inline_asm_elementwise(_I8_ASM, "=r,=r,r", [v], dtype=tl.float16, is_pure=True, pack=4)
        else:
            if INTERPRET:
                v = v.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                v = _e4m3_to_f16(v)
        if TWO_LEVEL:
            acc += tl.dot(p_op, v)
        else:
            acc = tl.dot(p_op, v, acc)
    return m_new, l_i, acc, acc_hi, z_sum


@triton.jit
def _decode_attention_kernel(
    # tensors
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    # scalars
    sm_scale, window, num_splits,
    # strides (last dimension contiguous everywhere); the cache's are compiled
    # in, so every row address is a page base plus a constant
    stride_qb, stride_qh,
    stride_kb: tl.constexpr, stride_kt: tl.constexpr, stride_kh: tl.constexpr,
    stride_vb: tl.constexpr, stride_vt: tl.constexpr, stride_vh: tl.constexpr,
    stride_bt,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    # shapes
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    # features
    KV_FP8: tl.constexpr,
    FP8_QUERY: tl.constexpr,
    HAS_K_SCALE: tl.constexpr,
    HAS_V_SCALE: tl.constexpr,
    K_SCALE_STRIDE: tl.constexpr,
    V_SCALE_STRIDE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    # how
    TWO_LEVEL: tl.constexpr,
    DEFER_SUM: tl.constexpr,
    INTERPRET: tl.constexpr,
    FP8_PV: tl.constexpr = False,
    # per-token-head caches (0: BF16/FP8; 1 fp8, 2 int8, 3 int4): one uint8 row per (token, KV head), K codes at
    # 0, V codes at V_OFF, the fp32 scales at byte KS_OFF / VS_OFF (4-byte aligned, read through the row's address)
    PTH: tl.constexpr = 0,
    DATA_BYTES: tl.constexpr = 0,
    V_OFF: tl.constexpr = 0,
    KS_OFF: tl.constexpr = 0,
    VS_OFF: tl.constexpr = 0,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    # `launch.split_tiles`'s cut, written out: as an inlined call its debug labels split ptxas's basic blocks
    seq_len = tl.load(seq_lens_ptr + seq)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    first_tile = start // BLOCK_N
    end_tile = (seq_len + BLOCK_N - 1) // BLOCK_N
    tiles_per_split = (end_tile - first_tile + num_splits - 1) // num_splits
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, end_tile)

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP
    q_head = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, HEAD_DIM)

    q = tl.load(q_ptr + seq * stride_qb + q_head[:, None] * stride_qh + offs_d[None, :], mask=h_mask[:, None], other=0.0)
    q = q.to(tl.float32)
    qk_scale = sm_scale * LOG2E
    if HAS_K_SCALE:
        qk_scale *= tl.load(k_scale_ptr + kv_head * K_SCALE_STRIDE)
    q_hi_op = q
    q_sum = 0
    if PTH >= 2:
        q_op, q_hi_op, q_sum, q_scale = _int8_query(q, q_ptr + seq * stride_qb + q_head * stride_qh, h_mask, PTH,
                                                    DATA_BYTES, INTERPRET)
        qk_scale *= q_scale
    elif FP8_QUERY:
        # One dynamic scale per program (its GQA group), computed here so the
        # query needs no separate quantisation pass.
        q_scale = tl.maximum(tl.max(tl.max(tl.abs(q), 1), 0) / _FP8_MAX, 1e-30)
        q_op = fp8_e4m3_bits(tl.math.div_rn(q, q_scale)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        qk_scale *= q_scale
    elif KV_FP8:
        # e4m3 K converts to fp16 in one instruction (to bf16 in two), and fp16
        # holds every e4m3 value; the query saturates at fp16's range.
        q_op = tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(tl.float16)
    else:
        q_op = q.to(tl.bfloat16)
    if INTERPRET:
        if PTH < 2:
            # The interpreter's bf16 tl.dot is wrong; fp8/bf16 values are exact in fp32.
            q_op = q_op.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    if DEFER_SUM:
        l_i = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
    else:
        l_i = tl.zeros([BLOCK_H], tl.float32)
    if FP8_PV:
        acc = tl.zeros([HEAD_DIM, BLOCK_H], tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)

    bt_row = block_tables_ptr + seq * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    # The block-table entries of the next tile are loaded one iteration ahead:
    # K/V addresses then never wait on a load issued in the same iteration, so
    # the page look-up's round trip leaves the loop's critical path.
    offs_n = tile_lo * BLOCK_N + tl.arange(0, BLOCK_N)
    pages = _load_pages(bt_row, offs_n, seq_len, PAGE_SIZE)
    if PTH != 0:
        offs_c = tl.arange(0, DATA_BYTES)
        acc = tl.zeros([BLOCK_H, DATA_BYTES], tl.float32)  # int4: the low nibbles' half
        acc_hi = tl.zeros([BLOCK_H, DATA_BYTES], tl.float32)
        z_sum = tl.zeros([BLOCK_H], tl.float32)
        for tile in range(tile_lo, tile_hi):
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            valid = (offs_n < seq_len) & (offs_n >= start)
            in_page = offs_n.to(tl.uint32) % PAGE_SIZE
            row = pages * stride_kb + in_page * stride_kt
            k = tl.load(k_base + row[:, None] + offs_c[None, :], mask=valid[:, None], other=0)
            v = tl.load(k_base + V_OFF + row[:, None] + offs_c[None, :], mask=valid[:, None], other=0)
            ks = tl.load((k_base + KS_OFF + row).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
            vs = tl.load((k_base + VS_OFF + row).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
            pages = _load_pages(bt_row, offs_n + BLOCK_N, seq_len, PAGE_SIZE)
            m_i, l_i, acc, acc_hi, z_sum = _attend_tile_pth(k, v, ks, vs, valid, q_op, q_hi_op, q_sum, qk_scale, m_i,
                                                            l_i, acc, acc_hi, z_sum, PTH, FP8_QUERY, TWO_LEVEL,
                                                            INTERPRET, DEFER_SUM)
        if PTH == 3:
            # coordinate 2i from the low nibbles, 2i + 1 from the high ones (x 16)
            acc = tl.reshape(tl.join(acc - z_sum[:, None], acc_hi * (1.0 / 16.0) - z_sum[:, None]),
                             [BLOCK_H, HEAD_DIM])
    else:
        for tile in range(tile_lo, tile_hi):
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            k, v, valid = _load_tile(k_base, v_base, pages, offs_n, seq_len, start, offs_d,
                                     stride_kb, stride_kt, stride_vb, stride_vt, PAGE_SIZE)
            pages = _load_pages(bt_row, offs_n + BLOCK_N, seq_len, PAGE_SIZE)
            m_i, l_i, acc = _attend_tile(k, v, valid, q_op, qk_scale, m_i, l_i, acc,
                                         KV_FP8, FP8_QUERY, TWO_LEVEL, INTERPRET, DEFER_SUM, FP8_PV)

    if FP8_PV:
        acc = tl.trans(acc)
    if DEFER_SUM:
        l_i = tl.sum(l_i, 1)
    out_scale = 1.0
    if PTH != 0:
        out_scale = 1.0 / P_SCALE  # P x vs carried P_SCALE; the denominator did not
    elif KV_FP8:
        out_scale = 1.0 / P_SCALE
        l_i = l_i * (1.0 / P_SCALE)
    if HAS_V_SCALE:
        out_scale = out_scale * tl.load(v_scale_ptr + kv_head * V_SCALE_STRIDE)

    if IS_SPLIT:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = m_i + tl.log2(l_i)  # -inf for an empty split; the merge gives it weight 0
        tl.store(part_lse_ptr + seq * stride_pb + q_head * stride_ph + split * stride_ps, lse, mask=h_mask)
        part = part_out_ptr + seq * stride_pb * HEAD_DIM + split * stride_ps * HEAD_DIM
        o = acc * (out_scale / l_safe)[:, None]
        tl.store(part + q_head[:, None] * stride_ph * HEAD_DIM + offs_d[None, :], o, mask=h_mask[:, None])
    else:
        if HAS_SINKS:
            # The sink logit joins the denominator only.
            sink = tl.load(sinks_ptr + q_head, mask=h_mask, other=0.0) * LOG2E
            m_fin = tl.maximum(m_i, sink)
            corr = tl.exp2(m_i - m_fin)
            l_i = l_i * corr + tl.exp2(sink - m_fin)
            acc = acc * corr[:, None]
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        dst = out_ptr + seq * stride_ob
        o = acc * (out_scale / l_safe)[:, None]
        tl.store(dst + q_head[:, None] * stride_oh + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None])


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    if query.dim() != 3 or query.stride(-1) != 1:
        raise ValueError(f"query: expected [batch, num_q_heads, head_dim] with a contiguous last dim, got {tuple(query.shape)}")
    if query.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"query: dtype {query.dtype}; expected bfloat16, float16 or float32")
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dim() != 4 or c.stride(-1) != 1:
            raise ValueError(f"{name}: expected [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(c.shape)}")
        if c.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(f"{name}: dtype {c.dtype} is not supported; expected bfloat16 or float8_e4m3fn")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same shape and dtype")
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"cache head_dim {key_cache.shape[3]} != query head_dim {head_dim}")
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected int32 [{batch}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables: the last dim must be contiguous")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens: expected int32 [{batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != query.device:
            raise ValueError(f"{name}: on {t.device}, query is on {query.device}")


def _check_options(query: torch.Tensor, sinks: torch.Tensor | None, sliding_window: int | None,
                   sm_scale: float | None, num_splits: int | None, out: torch.Tensor | None) -> torch.Tensor:
    """ValueError for a bad option shared by the decode entry points; returns `out`, or a new tensor like `query`."""
    batch, num_q_heads, _ = query.shape
    device = query.device
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (num_q_heads,) or sinks.device != device):
        raise ValueError(f"sinks: expected float32 [{num_q_heads}] on {device}, got {sinks.dtype} {tuple(sinks.shape)}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive number of positions, got {sliding_window}")
    if sm_scale is not None and not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be finite and positive, got {sm_scale}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if out is None:
        return torch.empty_like(query)
    if out.shape != query.shape or out.dtype not in (query.dtype, torch.float32) or out.stride(-1) != 1 or out.device != device:
        raise ValueError(f"out: expected {tuple(query.shape)} of {query.dtype} or float32 on {device}, got {out.dtype} {tuple(out.shape)}")
    return out


def _gluon_refusal(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, fp8_query: bool,
                   config: DecodeConfig | None) -> str:
    """Why the Gluon kernel cannot take this call ("" when it can)."""
    if config is not None:
        return "an explicit DecodeConfig is for the Triton kernel"
    from kvpolicy.kernels.launch import gluon_runs_on

    ok, why = gluon_runs_on(query.device)
    if not ok:
        return why
    if not fp8_query or key_cache.dtype != torch.float8_e4m3fn:
        return "it handles FP8 caches with fp8_query=True only"
    from kvpolicy.kernels import decode_gluon

    return decode_gluon.refusal(query, key_cache, value_cache)


def _pth_gluon_refusal(query: torch.Tensor, cache: torch.Tensor, config: DecodeConfig | None, kernel: str) -> str:
    """Why the per-token-head Gluon kernel cannot take this call ("" when it can)."""
    if config is not None and kernel == "auto":
        return "an explicit DecodeConfig with kernel='auto' is for the Triton kernel"
    from kvpolicy.kernels.launch import gluon_runs_on

    ok, why = gluon_runs_on(query.device)
    if not ok:
        return why
    from kvpolicy.kernels import pth_gluon

    return pth_gluon.refusal(query, cache)


def decode_attention(
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
    config: DecodeConfig | None = None,
    kernel: str = "triton",
) -> torch.Tensor:
    """Attention of one new token per sequence over a paged KV cache; returns [batch, num_q_heads, head_dim].

    `query` [batch, num_q_heads, head_dim]; query head h reads KV head
    h // (num_q_heads // num_kv_heads). Sequence b attends to its first
    `seq_lens[b]` positions, found through `block_tables[b]` (only the last
    `sliding_window` of them when given). `sinks` (fp32 [num_q_heads]) are logits
    that join the softmax denominator only. K/V dequantise as stored * scale.
    `two_level` adds each tile's P.V into an fp32 accumulator (True) or carries
    the accumulation inside the MMA (False): BF16 caches accumulate in fp32 either way; with an
    FP8 cache the Triton kernel then multiplies e4m3 P by e4m3 V on the tensor cores as FA3
    does (on Hopper an fp8 wgmma, whose accumulator keeps fewer bits than fp32), and the
    Gluon kernel carries its fp16 wgmma. `fp8_query` quantises the query
    to e4m3 (FP8 caches only). `num_splits` overrides the split-KV heuristic (`launch.split_count`),
    which uses the block table's capacity, not `seq_lens`, so the call needs no host
    sync and can be captured in a CUDA graph. `out` (query dtype or float32) is
    written in place and returned; otherwise a tensor of the query dtype is.
    `config` overrides the Triton kernel's tiling (`default_config`).
    `kernel`: "triton" (this module, every case), "gluon" (`decode_gluon`, the Hopper
    TMA/wgmma kernel: FP8 cache with `fp8_query`, 16-token pages, head_dim 64/128; an error
    where it does not apply) or "auto" (gluon where it applies, else triton).
    """
    _check_inputs(query, key_cache, value_cache, block_tables, seq_lens)
    batch, num_q_heads, head_dim = query.shape
    _, page_size, num_kv_heads, _ = key_cache.shape
    device = query.device
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    if fp8_query and not kv_fp8:
        raise ValueError("fp8_query needs an FP8 cache; the bfloat16 path multiplies in bf16")
    k_stride = check_scale(k_scale, "k_scale", num_kv_heads, device)
    v_stride = check_scale(v_scale, "v_scale", num_kv_heads, device)
    out = _check_options(query, sinks, sliding_window, sm_scale, num_splits, out)
    check_scales(k_scale=k_scale, v_scale=v_scale)
    if batch == 0:
        return out
    check_paged_ranges(block_tables, seq_lens, key_cache.shape[0], page_size, sliding_window)
    if kernel not in ("triton", "gluon", "auto"):
        raise ValueError(f"kernel must be 'triton', 'gluon' or 'auto', got {kernel!r}")
    scale = float(head_dim**-0.5 if sm_scale is None else sm_scale)
    if kernel != "triton":
        why = _gluon_refusal(query, key_cache, value_cache, fp8_query, config)
        if not why:
            from kvpolicy.kernels import decode_gluon

            return decode_gluon.decode_gluon(query, key_cache, value_cache, block_tables, seq_lens, k_scale=k_scale,
                                             v_scale=v_scale, k_stride=k_stride, v_stride=v_stride, sm_scale=scale,
                                             sliding_window=sliding_window, sinks=sinks, two_level=two_level,
                                             num_splits=num_splits, out=out)
        if kernel == "gluon":
            raise ValueError(f"kernel='gluon' does not apply here: {why}")

    cfg = config or default_config(head_dim, kv_fp8, device)
    splits = num_splits or split_count(batch, num_kv_heads, span(block_tables, page_size, sliding_window, cfg.block_n),
                                       cfg.block_n, programs_per_sm(head_dim, kv_fp8, device), device)
    kc = key_cache.view(torch.uint8) if kv_fp8 else key_cache
    vc = value_cache.view(torch.uint8) if kv_fp8 else value_cache
    _launch(query, kc, vc, block_tables, seq_lens, k_scale, v_scale, sinks, out, scale, sliding_window, splits, cfg,
            page_size, kv_fp8=kv_fp8, fp8_query=fp8_query, two_level=two_level, k_stride=k_stride,
            v_stride=v_stride, FP8_PV=kv_fp8 and not two_level)
    return out


def _launch(query: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
            sinks: torch.Tensor | None, out: torch.Tensor, scale: float, sliding_window: int | None, splits: int,
            cfg: DecodeConfig, page_size: int, *, kv_fp8: bool, fp8_query: bool, two_level: bool, k_stride: int = 0,
            v_stride: int = 0, **path: int | bool) -> None:
    """One launch of the paged kernel and the merge of its splits: shared by the BF16/FP8 and per-token-head
    entry points, which differ only in their caches and the `path` constexprs (FP8_PV, the PTH fields)."""
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = kc.shape[2]
    group = num_q_heads // num_kv_heads
    is_split = splits > 1
    part_out, part_lse = split_partials(out, splits)
    dummy = seq_lens
    _decode_attention_kernel[(num_kv_heads, splits, batch)](
        query, kc, vc, block_tables, seq_lens,
        k_scale if k_scale is not None else dummy,
        v_scale if v_scale is not None else dummy, sinks if sinks is not None else dummy, out, part_out, part_lse,
        scale, int(sliding_window or 0), splits,
        query.stride(0), query.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_q_heads * splits, splits, 1,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=cfg.block_n,
        PAGE_SIZE=page_size,
        KV_FP8=kv_fp8,
        FP8_QUERY=fp8_query,
        HAS_K_SCALE=k_scale is not None,
        HAS_V_SCALE=v_scale is not None,
        K_SCALE_STRIDE=k_stride,
        V_SCALE_STRIDE=v_stride,
        HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None and not is_split,
        IS_SPLIT=is_split,
        TWO_LEVEL=two_level,
        DEFER_SUM=cfg.defer_sum,
        INTERPRET=interpreting(),
        **path,
        num_warps=NUM_WARPS,
        num_stages=cfg.num_stages,
    )
    if is_split:
        merge_splits(part_out, part_lse, sinks, out, splits)


# The tiling of each per-token-head format: (tokens per tile, pipeline stages, deferred softmax sum). vLLM's rows put
# V codes at 4 bytes past a 4-byte scale, so the tiles load in 8- and 4-byte pieces (no 16-byte cp.async) and
# latency is hidden by depth: the deeper tiles won at head_dim 128 and for fp8 at 64 in an H100 A/B against the
# FP8 kernel's tiling; int8/int4 at head_dim 64 kept it (the deep tiles were 1.4-1.5x slower per token there).
_PTH_TILING = {("fp8_per_token_head", 128): (64, 3, False), ("fp8_per_token_head", 64): (64, 5, False),
               ("int8_per_token_head", 128): (32, 5, False), ("int8_per_token_head", 64): (128, 3, True),
               ("int4_per_token_head", 128): (64, 7, False), ("int4_per_token_head", 64): (128, 3, True)}

# Registers per thread and shared memory per program of `pth_config` (sm_90 compile, bench/sass_check.py)
_PTH_PROGRAM_SIZE = {("fp8_per_token_head", 128): (108, 56320), ("fp8_per_token_head", 64): (102, 47104),
                     ("int8_per_token_head", 128): (110, 36864), ("int8_per_token_head", 64): (228, 39936),
                     ("int4_per_token_head", 128): (138, 56576), ("int4_per_token_head", 64): (128, 23808)}


def pth_config(head_dim: int, fmt: str, device: torch.device) -> DecodeConfig:
    """The tiling for a per-token-head cache (`_PTH_TILING`); the FP8 kernel's under the interpreter."""
    if device.type != "cuda" or interpreting():
        return default_config(head_dim, True, device)
    block_n, stages, defer = _PTH_TILING[(fmt, 64 if head_dim <= 64 else 128)]
    return DecodeConfig(block_n=block_n, num_stages=stages, defer_sum=defer)


def pth_programs_per_sm(head_dim: int, fmt: str, device: torch.device) -> int:
    """Programs of `pth_config` resident per SM (1 off the GPU)."""
    if device.type != "cuda" or interpreting():
        return 1
    regs, smem = _PTH_PROGRAM_SIZE[(fmt, 64 if head_dim <= 64 else 128)]
    return resident_programs(regs, smem, NUM_WARPS, device)


def decode_attention_pth(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    fmt: str,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    two_level: bool = True,
    fp8_query: bool = False,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    kernel: str = "triton",
) -> torch.Tensor:
    """`decode_attention` over a per-token-head cache of `fmt` (`paged_store.allocate_pth_cache`: vLLM's rows of
    codes and inline fp32 scales, NHD or HND), the same kernel and launcher with the format as a constexpr path.

    K/V dequantise as codes x their token's scale (int4: (code - zero point) x scale, in the rotated space; the
    query is rotated before the kernel and the output back after it, as vLLM's int4 path does). The 8-bit
    formats' scores and P.V run as the FP8 kernel's (fp8: e4m3 K as fp16, or an e4m3 query with `fp8_query`);
    int8 and int4 keys meet an int8 query (one dynamic scale per program) in an int8 MMA, and their values become
    exact fp16 in registers. `kernel`: "triton" (this module, every case), "gluon" (`pth_gluon`, the Hopper
    warp-specialised wgmma kernel: vLLM's NHD rows, head_dim 64/128; an error where it does not apply)
    or "auto" (gluon where it applies, else triton). `config` tiles either kernel (the Gluon kernel reads its
    block_n, 64 or 128, and num_stages). Other arguments as `decode_attention`."""
    if fmt not in PTH_MODE:
        raise ValueError(f"{fmt!r} is not a per-token-head format; expected one of {', '.join(PTH_MODE)}")
    if query.dim() != 3 or query.stride(-1) != 1:
        raise ValueError(f"query: expected [batch, num_q_heads, head_dim] with a contiguous last dim, got {tuple(query.shape)}")
    if query.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"query: dtype {query.dtype}; expected bfloat16, float16 or float32")
    batch, num_q_heads, head_dim = query.shape
    if cache.dim() != 4:
        raise ValueError(f"{fmt} cache: expected [num_blocks, block_size, num_kv_heads, row bytes], got {tuple(cache.shape)}")
    num_kv_heads = cache.shape[2]
    check_pth_cache(cache, fmt, num_kv_heads, head_dim)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables: expected int32 [{batch}, max_blocks], last dim contiguous, got {block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens: expected int32 [{batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    device = query.device
    for name, t in (("cache", cache), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, query is on {device}")
    if fp8_query and fmt != "fp8_per_token_head":
        raise ValueError("fp8_query applies to fp8_per_token_head only")
    check_paged_ranges(block_tables, seq_lens, cache.shape[0], cache.shape[1], sliding_window)
    out = _check_options(query, sinks, sliding_window, sm_scale, num_splits, out)
    if kernel not in ("triton", "gluon", "auto"):
        raise ValueError(f"kernel must be 'triton', 'gluon' or 'auto', got {kernel!r}")
    if batch == 0:
        return out
    why = _pth_gluon_refusal(query, cache, config, kernel) if kernel != "triton" else "not asked"
    if kernel == "gluon" and why:
        raise ValueError(f"kernel='gluon' does not apply here: {why}")
    scale = float(head_dim**-0.5 if sm_scale is None else sm_scale)
    int4 = fmt == "int4_per_token_head"
    dst = out
    if int4:
        # H diag(s) is sqrt(D) times orthogonal: scores come out D times larger, the output D times rotated
        query = query.float() @ rht_matrix(head_dim, device)
        scale /= head_dim
        dst = torch.empty(out.shape, dtype=torch.float32, device=device)
    if not why:
        from kvpolicy.kernels.pth_gluon import decode_pth_gluon

        decode_pth_gluon(query, cache, block_tables, seq_lens, fmt, sm_scale=scale, sliding_window=sliding_window,
                         sinks=sinks, two_level=two_level, num_splits=num_splits, out=dst, fp8_query=fp8_query,
                         tile=(config.block_n, config.num_stages) if config is not None else None)
    else:
        lay = pth_layout(fmt, head_dim)
        cfg = config or pth_config(head_dim, fmt, device)
        splits = num_splits or split_count(batch, num_kv_heads,
                                           span(block_tables, cache.shape[1], sliding_window, cfg.block_n),
                                           cfg.block_n, pth_programs_per_sm(head_dim, fmt, device), device,
                                           pow2_fill=0.85)
        _launch(query, cache, cache, block_tables, seq_lens, None, None, sinks, dst, scale, sliding_window, splits,
                cfg, cache.shape[1], kv_fp8=fmt == "fp8_per_token_head", fp8_query=fp8_query, two_level=two_level,
                PTH=PTH_MODE[fmt], DATA_BYTES=lay.data_bytes, V_OFF=lay.v_off, KS_OFF=lay.k_scale_off,
                VS_OFF=lay.v_scale_off)
    if int4:
        out.copy_(dst @ rht_matrix(head_dim, device, inverse=True))
    return out
