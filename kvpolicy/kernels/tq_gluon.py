"""Hopper TurboQuant decode in Gluon, on planar pages: the route, its configuration, and the warpgroup kernel
for FP8 keys (k8v4).

`decode_tq_gluon` decodes all four formats: the formats with centroid keys (4bit_nc, k3v4_nc, 3bit_nc) run
the per-warp kernel (`tq_warp.py`, whose pages are in its own thread order), k8v4 the warpgroup kernel here.
This module also holds what both kernels share: `TQGluonConfig` and `default_config`, the query's order and
two-byte form (`query_order`, `Q_LO`), the int8 key programs and the result store.

Why a kernel apart from the Triton one (`tq_decode.py`): that kernel is issue-bound (bench/NOTES_TQ.md): per
(token, KV head) slot it spends 45-53 warp-instructions, a quarter of them on byte shuffles that bring
2-byte-aligned slot bytes into `tl.dot`'s operand layout, a quarter on the softmax of 16 padded MMA rows.
The warpgroup kernel, with explicit layouts:
- reads planar pages (`turboquant.allocate_tq_planar_cache`: the same bytes per token as vLLM's slots, each
  KV head's page in planes that start on 16-byte boundaries), so every key and value load is a load of whole
  32-bit words;
- turns FP8 keys into fp16 halves, the register A operand of an fp16 wgmma with the tile's tokens as M; each
  thread's quarter of a key row is relabelled as the operand's K indices (`operand_order`) and the query is
  stored in that order, so the product is unchanged and the keys never leave registers;
- turns value codes into exact fp16 subnormals (code x 2^-24, 5 ops per word of 8 codes) in shared memory;
  the per-token scale folds into P and the zero point into a per-column sum; O^T = codes^T.(P*scale)^T is
  an fp16 wgmma summed per tile in fp32 registers (two-level);
- runs the softmax on [tile, 8] (the GQA group padded to 8, not 16) over 128 threads, against a lazy
  reference max: a tile needs no cross-warp max unless a score passes the reference by 2^4;
- loads tile i+1 while tile i is computed.
It also took the centroid-key formats (their keys as int8 wgmma operands against a two-byte query) until
their pages moved to the per-warp kernel's order (NOTES_TQ.md, eighth and eighteenth sessions).

Measured on an H200: bench/NOTES_TQ.md, bench/RESULTS.md.

Scope: the four TurboQuant formats (the warpgroup kernel: k8v4), head_dim 64 or 128, GQA groups up to 8,
16-token planar pages, sm_90. `decode_attention_tq` routes planar caches here; the runtime allocates them on
Hopper (`LayerPlan.kernel_path`). Gluon does not run under the interpreter: these kernels are tested on the
GPU only (tests/kernels/test_tq_gluon.py), against the float64 reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from kvpolicy.kernels.decode_gluon import split_tiles
from kvpolicy.kernels.turboquant import (
    PLANAR_PAGE,
    SUBNORMAL_UNIT,
    WARP_ORDER_FORMATS,
    code_planes,
    field_planes,
    int8_centroids,
    int8_offset,
    int8_operand_order,
    int8_table_word,
    k3_int8_program,
    k4_int8_program,
    render_ptx,
    tq_layout,
    v4_subnormal_program,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

PAGE = PLANAR_PAGE
"""Page size (vLLM's default block size); the kernel's 16s are this."""
HEAD_DIMS = (64, 128)
"""Head dims it takes."""
MAX_GROUP = 8
"""Largest GQA group: the N of the score MMA is 8."""
FORMATS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
"""Formats it decodes: all four (FP8, 4-bit or 3-bit keys; 4- or 3-bit values)."""

# Unpack programs on whole 32-bit words (4 code bytes). Centroid keys become signed bytes (4 per register, the
# int8 score MMA's operand); values and FP8 keys become fp16 halves: no byte shuffles around them.
_K4_I8_ASM = gl.constexpr(render_ptx(k4_int8_program()))
_K3_I8_ASM = gl.constexpr(render_ptx(k3_int8_program()))
# values as exact fp16 subnormals (code x 2^-24, bytes in the order 0, 2, 1, 3): low nibbles, then 16 x high
_V4_ASM = gl.constexpr(render_ptx(v4_subnormal_program()))
_UNSUB = gl.constexpr(1.0 / SUBNORMAL_UNIT)
_FP8_ASM = gl.constexpr("""{
.reg .b16 a, b;
.reg .b32 x, y;
mov.b32 {a, b}, $4;
cvt.rn.f16x2.e4m3x2 x, a;
cvt.rn.f16x2.e4m3x2 y, b;
mov.b32 {$0, $1}, x;
mov.b32 {$2, $3}, y;
}""")

# One warpgroup (4 warps). S^T [BN, 8] and O^T [D, 8] are wgmma accumulators with the tile's tokens (or the
# head dim) as M; keys are the A operand of the score wgmma, straight from registers.
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16]))
A_LAYOUT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=S_LAYOUT.value, k_width=2))
Q_LO = gl.constexpr(254.0)
"""The query's second byte holds the first byte's rounding residual (at most 1/2) times this."""
Q_LO_INT = gl.constexpr(254)
V32_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
"""The value tile's fp16 halves as 32-bit words (pairs of columns): the same bytes (rows of 128 or 256 bytes,
128-byte swizzle either way), written by whole words."""
ROW_S = gl.constexpr(gl.SliceLayout(1, S_LAYOUT.value))
LAZY_MAX_MARGIN = gl.constexpr(4.0)
"""How far (log2 units) a score may pass the reference max before the tile is redone with the exact max:
P <= 2^4, so P x value scale stays finite in fp16 for value scales below 4094."""
FLAGS_LAYOUT = gl.constexpr(gl.BlockedLayout([4], [32], [4], [0]))  # every thread holds the 4 warps' flags


def key_layout(block_n: int, key_bytes: int) -> gl.DistributedLinearLayout:
    """Register layout of a tile's code words of one plane [block_n, key_bytes / 4] (int32) in memory order:
    each thread holds a contiguous quarter of a row (one or two 16-byte loads) for the rows the wgmma A
    operand gives it (r, r + 8 of its warp's 16, and + 64 for 128-token tiles), which are also the score
    rows. `_to_operand` relabels the unpacked keys as that operand; the value words take the same layout, so
    one page look-up serves keys, values and fields."""
    cw = key_bytes // 16  # words per thread per row
    reg = [[0, 1 << k] for k in range(cw.bit_length() - 1)] + [[8, 0]] + ([[64, 0]] if block_n == 128 else [])
    lanes = [[0, cw], [0, 2 * cw], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lanes, warp_bases=[[16, 0], [32, 0]], block_bases=[],
                                      shape=[block_n, key_bytes // 4])


def operand_order(key_bytes: int) -> torch.Tensor:
    """The coordinate (byte of the key row) at each K index of the score wgmma: thread c of a quad holds
    bytes [c * w, (c + 1) * w) of a row (w = key_bytes / 4), and the operand wants K indices
    16i + {2c, 2c + 1, 2c + 8, 2c + 9}; so K index 16i + 8a + 2c + b holds byte c * w + 4i + 2a + b.
    The query is stored in this order too, so the product is unchanged."""
    k = torch.arange(key_bytes)
    i, a, c, b = k >> 4, (k >> 3) & 1, (k >> 1) & 3, k & 1
    return c * (key_bytes // 4) + 4 * i + 2 * a + b


@gluon.jit
def _bytes_order(h0, h1, h2, h3, BN: gl.constexpr, W: gl.constexpr):
    """Four [BN, W] tensors, the values for positions 0-3 of each word (its bytes 0-3; for subnormal values
    bytes 0, 2, 1, 3) -> one [BN, 4W] tensor in that order. `join` adds its new axis last, so the outer
    join picks the lowest bit of the position."""
    return gl.reshape(gl.join(gl.join(h0, h2), gl.join(h1, h3)), [BN, 4 * W])


@gluon.jit
def _to_operand(x, BN: gl.constexpr, KB: gl.constexpr):
    """Relabel a [BN, KB] tile (byte order, from `key_layout` words) as K indices of the A operand
    (`operand_order`): a register permutation, no data movement."""
    y = gl.reshape(x, [BN, 4, KB // 16, 2, 2])
    y = gl.permute(y, (0, 2, 3, 1, 4))
    return gl.convert_layout(gl.reshape(y, [BN, KB]), A_LAYOUT)


@gluon.jit
def _word_bytes(x, BN: gl.constexpr, W: gl.constexpr):
    """int32 words [BN, W] -> their bytes [BN, 4W] (int8, byte 0 first): truncations that LLVM folds back
    into the words when the bytes are packed for the PTX program."""
    b0 = x.to(gl.int8)
    b1 = (x >> 8).to(gl.int8)
    b2 = (x >> 16).to(gl.int8)
    b3 = (x >> 24).to(gl.int8)
    return gl.reshape(gl.join(gl.join(b0, b2), gl.join(b1, b3)), [BN, 4 * W])


@gluon.jit
def _pages(bt_row, tile, seq_len, L: gl.constexpr, BN: gl.constexpr):
    """The block-table entry of each token of tile `tile` (rows of layout L); page 0 past the sequence (masked
    later; the table may hold anything there). Loaded `TQGluonConfig.pages_ahead` tiles ahead: every load of
    a tile's bytes waits for these."""
    t = tile * BN + gl.arange(0, BN, layout=L)
    return gl.load(bt_row + (t >> 4), mask=t < seq_len, other=0)  # t >= 0: shifts, not signed division


@gluon.jit
def _load_tile(cache32_ptr, cache16_ptr, page, tile, kvh, BN: gl.constexpr, SLOT: gl.constexpr,
               NUM_KV: gl.constexpr, KBM: gl.constexpr, KB: gl.constexpr, VBM: gl.constexpr, VB: gl.constexpr,
               NF: gl.constexpr, K_LAYOUT: gl.constexpr, V_LAYOUT: gl.constexpr):
    """The packed bytes of one tile from planar pages, each in the register layout its consumer wants: key
    words for the wgmma A operand (16-byte loads), value code words for the fp16 store, the fp16 fields in the
    score rows' layout. Words, not bytes: a byte tensor carried to the next iteration is split into single
    bytes. KBM, VBM: bytes per token of the key and value code plane; KB, VB: the same (`kernel_constexprs`).
    `page`: the tile's `_pages`. Offsets are taken in the unit of each load (words, halves): no division of
    int64."""
    # page bases in 32-bit words (a page is 16 SLOT bytes, SLOT even) and in halves for the fp16 fields
    pk = page.to(gl.int64) * NUM_KV + kvh
    rk = (tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, K_LAYOUT))) & 15  # the token's row in its page
    kc = gl.load(cache32_ptr + (pk * (4 * SLOT) + rk * (KBM // 4))[:, None]
                 + gl.arange(0, KBM // 4, layout=gl.SliceLayout(0, K_LAYOUT))[None, :])
    pv = gl.convert_layout(pk, gl.SliceLayout(1, V_LAYOUT))  # the same rows in the same threads
    rv = gl.convert_layout(rk, gl.SliceLayout(1, V_LAYOUT))
    vc = gl.load(cache32_ptr + (pv * (4 * SLOT) + 4 * KB + rv * (VBM // 4))[:, None]
                 + gl.arange(0, VBM // 4, layout=gl.SliceLayout(0, V_LAYOUT))[None, :])
    # the score rows are the key rows in the same threads (lane / 4, 8 x register, 16 x warp): no second look-up
    pf = gl.convert_layout(pk, ROW_S)
    rf = gl.convert_layout(rk, ROW_S)
    f = cache16_ptr + pf * (8 * SLOT) + 8 * (KB + VB) + rf  # plane k of the fields: + 16 k
    vscale = gl.load(f + 16 * (NF - 2)).to(gl.float16, bitcast=True).to(gl.float32)
    vzero = gl.load(f + 16 * (NF - 1)).to(gl.float16, bitcast=True).to(gl.float32)
    return kc, vc, vscale, vzero


@gluon.jit
def _attend(kc, vc, vscale, vzero, q_smem, v16_smem, p_smem, flag_smem, m_i, l_part, z_part, acc, tile_start,
            seq_len, start, HEAD_DIM: gl.constexpr, BN: gl.constexpr, KBM: gl.constexpr, LAZY: gl.constexpr,
            EDGE: gl.constexpr):
    """One tile: keys unpacked in registers into the score wgmma, value codes to fp16 in shared memory,
    online softmax with the value scale folded into P, P.V. Returns the updated state. EDGE: the tile
    reaches outside [start, seq_len) (a second compiled copy keeps the masks off the common path). LAZY:
    `TQGluonConfig.lazy_max`."""
    W: gl.constexpr = KBM // 4
    h0, h1, h2, h3 = gl.inline_asm_elementwise(_FP8_ASM, "=h,=h,=h,=h,r", [kc], dtype=(gl.float16,) * 4,
                                               is_pure=True, pack=1)
    k16 = _to_operand(_bytes_order(h0, h1, h2, h3, BN, W), BN, KBM)
    s = warpgroup_mma(k16, q_smem.index(0).permute((1, 0)), gl.zeros([BN, 8], gl.float32, layout=S_LAYOUT),
                      use_acc=False, is_async=True)

    # While it runs: value codes to exact fp16 subnormals (code x 16^k or 4^k x 2^-24: the bits stay where they
    # are), each group of 4 head-dim positions holding bytes (0, 2, 1, 3): the epilogue undoes both. The
    # programs' 32-bit outputs (two halves each) are stored as they are, through a 32-bit view of the tile:
    # as fp16 halves, ptxas gathered each 16-byte store's registers with 4 moves (32 per tile).
    # Every warp is past the previous tile's P.V (its wait), so the tile may be rewritten.
    gl.thread_barrier()
    v32_smem = v16_smem._reinterpret(gl.int32, [BN, HEAD_DIM // 2], V32_SMEM)
    # word m of the row -> the halves of columns 4m .. 4m + 3 (low nibbles) and D/2 + 4m .. (16 x high)
    w0, w1, w2, w3 = gl.inline_asm_elementwise(_V4_ASM, "=r,=r,=r,=r,r", [vc], dtype=(gl.int32,) * 4,
                                               is_pure=True, pack=1)
    lo = gl.reshape(gl.join(w0, w1), [BN, HEAD_DIM // 4])
    hi = gl.reshape(gl.join(w2, w3), [BN, HEAD_DIM // 4])
    # one store: two stores into slices of the tile make the compiler put a barrier between them
    v32_smem.store(gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), [BN, HEAD_DIM // 2]))

    s, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s, k16, q_smem))
    if EDGE:
        # Stale slots may hold NaN norms and scales: masked scores, zero scale and zero point.
        pos = tile_start + gl.arange(0, BN, layout=ROW_S)
        ok = (pos < seq_len) & (pos >= start)
        s = gl.where(ok[:, None], s, float("-inf"))
        vscale = gl.where(ok, vscale, 0.0)
        vzero = gl.where(ok, vzero, 0.0)

    # ---- online softmax over the tile's tokens (rows); denominators and zero-point sums per position ----
    if LAZY:
        # P against the reference max m_i; each warp flags a score past it by the margin, and the flags are
        # read after the barrier P needs anyway. Rare (every program's first tile): redo with the exact max.
        m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
        p = gl.exp2(s - m_use[None, :])
        p_smem.store(gl.permute((p * vscale[:, None]).to(gl.float16), (1, 0)))
        passed = gl.where(s > (m_i + LAZY_MAX_MARGIN)[None, :], 1, 0)
        # rows 64 b + 16 w + i of warp w (the wgmma's M blocks): its flag without leaving the warp
        passed = gl.max(gl.max(gl.reshape(passed, [BN // 64, 4, 128]), 2), 0)
        flags = flag_smem.index((tile_start // BN) % 2)  # two buffers: a fast warp never overwrites unread flags
        flags.store(passed)
        fence_async_shared()
        gl.thread_barrier()
        if gl.max(flags.load(FLAGS_LAYOUT), 0) > 0:
            m_new = gl.maximum(m_i, gl.max(s, 0))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_use)
            l_part = l_part * alpha[None, :]
            z_part = z_part * alpha[None, :]
            acc = acc * alpha[None, :]
            m_i = m_new
            p = gl.exp2(s - m_use[None, :])
            p_smem.store(gl.permute((p * vscale[:, None]).to(gl.float16), (1, 0)))
            fence_async_shared()
            gl.thread_barrier()
        pv = warpgroup_mma(v16_smem.permute((1, 0)), p_smem.permute((1, 0)),
                           gl.zeros([HEAD_DIM, 8], gl.float32, layout=S_LAYOUT), use_acc=False, is_async=True)
        l_part = l_part + p
        z_part = z_part + p * vzero[:, None]
        pv, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(pv, v16_smem, p_smem))
        acc = acc + pv
        m_new = m_i
    else:
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        l_part = l_part * alpha[None, :] + p
        z_part = z_part * alpha[None, :] + p * vzero[:, None]
        p_smem.store(gl.permute((p * vscale[:, None]).to(gl.float16), (1, 0)))
        fence_async_shared()
        gl.thread_barrier()
        # ---- O^T += codes^T . (P * scale)^T, summed per tile in fp32 registers (two-level) ----
        pv = warpgroup_mma(v16_smem.permute((1, 0)), p_smem.permute((1, 0)),
                           gl.zeros([HEAD_DIM, 8], gl.float32, layout=S_LAYOUT), use_acc=False, is_async=True)
        pv, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(pv, v16_smem, p_smem))
        acc = acc * alpha[None, :] + pv
    return m_new, l_part, z_part, acc


@gluon.jit
def _store_result(o, m, l, q_head, h_mask, offs_d, seq, split, num_splits, sinks_ptr, out_ptr, part_out_ptr,
                  part_lse_ptr, stride_ob, stride_oh, NUM_KV: gl.constexpr, GROUP: gl.constexpr,
                  HEAD_DIM: gl.constexpr, HAS_SINKS: gl.constexpr, IS_SPLIT: gl.constexpr):
    """Write a program's result (this kernel's and `tq_warp`'s): o [D, 8 heads] unnormalised (row i is dim
    offs_d[i]), m and l each head's max (log2 units) and softmax sum. Split: the partial output and its
    log-sum-exp for the merge; else the normalised output, with the sink's logit in the denominator."""
    if IS_SPLIT:
        l_safe = gl.where(l == 0.0, 1.0, l)
        lse = m + gl.log2(l)  # -inf for an empty split: the merge gives it weight 0
        row = seq * (NUM_KV * GROUP) + q_head
        gl.store(part_lse_ptr + row * num_splits + split, lse, mask=h_mask)
        gl.store(part_out_ptr + ((row * num_splits + split) * HEAD_DIM)[None, :] + offs_d[:, None],
                 o / l_safe[None, :], mask=h_mask[None, :])
    else:
        if HAS_SINKS:
            # The sink logit joins the denominator only.
            sink = gl.load(sinks_ptr + q_head, mask=h_mask, other=0.0) * 1.4426950408889634
            m_fin = gl.maximum(m, sink)
            corr = gl.exp2(m - m_fin)
            l = l * corr + gl.exp2(sink - m_fin)
            o = o * corr[None, :]
        l_safe = gl.where(l == 0.0, 1.0, l)
        gl.store(out_ptr + seq * stride_ob + (q_head * stride_oh)[None, :] + offs_d[:, None],
                 (o / l_safe[None, :]).to(out_ptr.dtype.element_ty), mask=h_mask[None, :])


# Probe only (`STAMPS`, bench/probe_tq_stamps.py): the global nanosecond timer, read once its input is in the
# register (the `and` makes the read wait for it; the 0 or 1 ns it adds is below the timer's resolution).
_STAMP_ASM = gl.constexpr("{\n.reg .u64 t;\n.reg .b32 d;\nmov.u64 t, %globaltimer;\nand.b32 d, $1, 1;\n"
                          "cvt.u64.u32 $0, d;\nadd.u64 $0, $0, t;\n}")
STAMPS = ("entry", "seq_len", "first_tile", "query", "loop_end", "counted", "merged", "smid", "q_loaded",
          "rot_loaded", "rotated", "q_operand")
"""The slots of a program's row of `STAMPS_ROW` int64 (`tq_warp._tq_warp_kernel` with a `stamps` tensor; ns of
%globaltimer, "smid" the SM's id): at entry; when seq_len had arrived; when the first tile's fields had arrived
(read after the query's prologue, so that waiting for them does not delay it: the later of the two); when the
query's scale was ready; after the loop and the 4 warps' merge; after the split's count (`_merge_if_last`'s atomic)
and after the split merge (its last program only; both 0 without `TQGluonConfig.fused_merge`); when the query had
loaded and, with `TQGluonConfig.rotate_query`, when the rotation operand had loaded and when their product was
ready; when the score MMA's query operand was ready. Each read waits for its tensor in every thread of the program
(a CTA-wide max first: one barrier per stamp), so the stamped kernel is slower than the plain one
(bench/NOTES_TQ.md, twenty-third session)."""
STAMPS_ROW = 16


_LANES = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
"""One value per thread of a 4-warp program: the stamps' scalars."""


@gluon.jit
def _stamp(x, ptr, k: gl.constexpr):
    """Write at ptr[k] the timer once every element of x (int32 or fp32) is in its thread's registers."""
    lane = gl.arange(0, 128, layout=_LANES)
    ready = gl.max(x.to(gl.int32, bitcast=True), axis=None)  # every thread waits for all of x
    t = gl.inline_asm_elementwise(_STAMP_ASM, "=l,r", [lane * 0 + ready], dtype=gl.int64, is_pure=False, pack=1)
    gl.store(ptr + k + lane * 0, t, mask=lane == 0)


@gluon.jit
def _stamp_scalar(v, ptr, k: gl.constexpr):
    """`_stamp` of the int32 scalar v (every thread's copy)."""
    _stamp(gl.arange(0, 128, layout=_LANES) * 0 + v, ptr, k)


@gluon.jit
def _stamp_sm(ptr, k: gl.constexpr):
    """Write at ptr[k] the id of the SM the program runs on."""
    lane = gl.arange(0, 128, layout=_LANES)
    smid = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [lane], dtype=gl.int32, is_pure=True, pack=1)
    gl.store(ptr + k + lane * 0, smid.to(gl.int64), mask=lane == 0)


@gluon.jit
def _merge_if_last(cnt_ptr, part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, seq, kvh, num_splits, stride_ob,
                   stride_oh, NUM_KV: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                   S_BLOCK: gl.constexpr, S_CHUNK: gl.constexpr, HAS_SINKS: gl.constexpr, stamp_ptr=None,
                   STAMPS: gl.constexpr = False):
    """The split merge in the decode kernel (`TQGluonConfig.fused_merge`), after `_store_result` wrote this
    program's partials: each split of a (sequence, KV head) counts itself in `cnt_ptr` (`arrival_counters`), and
    the last to arrive merges the GQA group's `num_splits` (<= S_BLOCK) partials, S_CHUNK splits at a time with
    a running max, into the output, the sink's logit in the denominator (as `decode_attention`'s merge kernel),
    then zeroes the counter for the next launch. The merge's own launch goes, and its loads come from L2."""
    # Release: every warp's partial stores, then the count (thread 0's acq_rel atomic, after a barrier that
    # orders the other warps' stores before it). Acquire: the last program's reads of the others' partials.
    gl.thread_barrier()
    cnt = cnt_ptr + seq * NUM_KV + kvh
    arrived = gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if STAMPS:
        _stamp_scalar(arrived, stamp_ptr, 5)
    if arrived == num_splits - 1:
        # [splits, heads, D]: each thread 4 consecutive dims (16-byte loads) of one head, every split of a chunk
        L: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 32 // (HEAD_DIM // 4), HEAD_DIM // 4], [1, 4, 1],
                                           [2, 1, 0])
        SH: gl.constexpr = gl.SliceLayout(2, L)
        HD: gl.constexpr = gl.SliceLayout(0, L)
        offs_h = gl.arange(0, 8, layout=gl.SliceLayout(0, SH))
        offs_s = gl.arange(0, S_CHUNK, layout=gl.SliceLayout(1, SH))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, HD))
        offs_d3 = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, gl.SliceLayout(1, L)))[None, None, :]
        h_mask = offs_h < GROUP
        row = seq * (NUM_KV * GROUP) + kvh * GROUP + offs_h
        if HAS_SINKS:  # the sink starts the running max and sum: exp2(sink - sink) = 1
            m_run = gl.load(sinks_ptr + kvh * GROUP + offs_h, mask=h_mask, other=0.0).to(gl.float32) * 1.4426950408889634
            denom = gl.full([8], 1.0, gl.float32, gl.SliceLayout(0, SH))
        else:
            m_run = gl.full([8], float("-inf"), gl.float32, gl.SliceLayout(0, SH))
            denom = gl.zeros([8], gl.float32, gl.SliceLayout(0, SH))
        o = gl.zeros([8, HEAD_DIM], gl.float32, HD)
        # unrolled: no chunk's loads wait for an earlier chunk's sums (at up to `MAX_FUSED_SPLITS` splits there
        # is one chunk). .cg: from L2, never a line this SM's L1 kept from an earlier read of a neighbouring
        # group's partials.
        for c in gl.static_range(0, S_BLOCK, S_CHUNK):
            split = c + offs_s
            mask = (split < num_splits)[:, None] & h_mask[None, :]
            lse = gl.load(part_lse_ptr + row[None, :] * num_splits + split[:, None], mask=mask,
                          other=float("-inf"), cache_modifier=".cg")
            parts = gl.load(part_out_ptr + ((row[None, :] * num_splits + split[:, None]) * HEAD_DIM)[:, :, None]
                            + offs_d3, mask=mask[:, :, None], other=0.0, cache_modifier=".cg")
            m_new = gl.maximum(m_run, gl.max(lse, 0))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # nothing yet: every weight 0
            scale = gl.exp2(m_run - m_use)
            w = gl.exp2(lse - m_use[None, :])
            denom = denom * scale + gl.sum(w, 0)
            o = o * gl.convert_layout(scale, gl.SliceLayout(1, HD))[:, None] + gl.sum(parts * w[:, :, None], 0)
            m_run = m_new
        d = gl.convert_layout(gl.where(denom == 0.0, 1.0, denom), gl.SliceLayout(1, HD))
        q_head = kvh * GROUP + gl.arange(0, 8, layout=gl.SliceLayout(1, HD))
        gl.store(out_ptr + seq * stride_ob + (q_head * stride_oh)[:, None] + offs_d[None, :],
                 (o / d[:, None]).to(out_ptr.dtype.element_ty), mask=(q_head < (kvh + 1) * GROUP)[:, None])
        gl.store(cnt, 0)
        if STAMPS:
            _stamp(o, stamp_ptr, 6)


@gluon.jit
def _tq_gluon_kernel(
    q_ptr, order_ptr, cache32_ptr, cache16_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr, out_ptr, part_out_ptr,
    part_lse_ptr, q_scale, window, num_splits,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    GROUP: gl.constexpr, NUM_KV: gl.constexpr, HEAD_DIM: gl.constexpr, SLOT: gl.constexpr, BN: gl.constexpr,
    KBM: gl.constexpr, KB: gl.constexpr, VBM: gl.constexpr, VB: gl.constexpr, NF: gl.constexpr,
    K_LAYOUT: gl.constexpr, V_LAYOUT: gl.constexpr, LAZY: gl.constexpr, PAGES_AHEAD: gl.constexpr,
    HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr, IS_SPLIT: gl.constexpr,
):
    kvh = gl.program_id(0)
    split = gl.program_id(1)
    seq = gl.program_id(2)
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])

    v16_smem = gl.allocate_shared_memory(gl.float16, [BN, HEAD_DIM],
                                         gl.NVMMASharedLayout.get_default_for([BN, HEAD_DIM], gl.float16))
    p_smem = gl.allocate_shared_memory(gl.float16, [8, BN], gl.NVMMASharedLayout.get_default_for([8, BN], gl.float16))
    q_smem = gl.allocate_shared_memory(gl.float16, [1, 8, HEAD_DIM],
                                       gl.NVMMASharedLayout.get_default_for([8, HEAD_DIM], gl.float16))
    flag_smem = gl.allocate_shared_memory(gl.int32, [2, 4], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))

    seq_len, start, tile_lo, tile_hi = split_tiles(seq_lens_ptr, seq, window, split, num_splits, BN, HAS_WINDOW)

    # The GQA group's query, its coordinates in the score MMA's K order (`operand_order`).
    offs_qh = gl.arange(0, 8, layout=gl.SliceLayout(1, q_layout))
    order = gl.load(order_ptr + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout)))
    q = gl.load(q_ptr + seq * stride_qb + (kvh * GROUP + offs_qh)[:, None] * stride_qh + order[None, :],
                mask=(offs_qh < GROUP)[:, None], other=0.0).to(gl.float32) * q_scale
    col: gl.constexpr = gl.SliceLayout(0, S_LAYOUT)
    q_smem.index(0).store(q.to(gl.float16))
    fence_async_shared()
    gl.thread_barrier()

    m_i = gl.full([8], float("-inf"), gl.float32, layout=gl.SliceLayout(0, S_LAYOUT))
    l_part = gl.zeros([BN, 8], gl.float32, layout=S_LAYOUT)
    z_part = gl.zeros([BN, 8], gl.float32, layout=S_LAYOUT)
    acc = gl.zeros([HEAD_DIM, 8], gl.float32, layout=S_LAYOUT)

    # Software pipeline: the bytes of tile i+1 load while tile i is computed, their block-table entries
    # PAGES_AHEAD tiles ahead (one tile ahead, every tile waited for its entries before issuing its loads).
    bt_row = block_tables_ptr + seq * stride_bt
    PL: gl.constexpr = gl.SliceLayout(1, K_LAYOUT)
    page = _pages(bt_row, tile_lo, seq_len, PL, BN)
    kc, vc, vscale, vzero = _load_tile(cache32_ptr, cache16_ptr, page, tile_lo, kvh, BN, SLOT, NUM_KV, KBM, KB, VBM,
                                       VB, NF, K_LAYOUT, V_LAYOUT)
    page = _pages(bt_row, tile_lo + 1, seq_len, PL, BN)
    for tile in range(tile_lo, tile_hi):
        if PAGES_AHEAD == 1:
            page = _pages(bt_row, tile + 1, seq_len, PL, BN)
        nkc, nvc, nvscale, nvzero = _load_tile(cache32_ptr, cache16_ptr, page, tile + 1, kvh, BN, SLOT, NUM_KV, KBM,
                                               KB, VBM, VB, NF, K_LAYOUT, V_LAYOUT)
        if PAGES_AHEAD == 2:
            page = _pages(bt_row, tile + 2, seq_len, PL, BN)
        tile_start = tile * BN
        if (tile_start < start) | (tile_start + BN > seq_len):
            m_i, l_part, z_part, acc = _attend(kc, vc, vscale, vzero, q_smem, v16_smem, p_smem, flag_smem, m_i, l_part,
                                               z_part, acc, tile_start, seq_len, start, HEAD_DIM, BN, KBM, LAZY, True)
        else:
            m_i, l_part, z_part, acc = _attend(kc, vc, vscale, vzero, q_smem, v16_smem, p_smem, flag_smem, m_i, l_part,
                                               z_part, acc, tile_start, seq_len, start, HEAD_DIM, BN, KBM, LAZY, False)
        kc, vc, vscale, vzero = nkc, nvc, nvscale, nvzero

    l_i = gl.sum(l_part, 0)
    z_i = gl.sum(z_part, 0)
    offs_h = gl.arange(0, 8, layout=col)
    rows = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, S_LAYOUT))
    offs_d = (rows & ~3) | ((rows & 1) << 1) | ((rows >> 1) & 1)  # turboquant.subnormal_byte_order
    h_mask = offs_h < GROUP
    q_head = kvh * GROUP + offs_h
    # Value half k holds 16^k x 2^-24 x the codes; out = codes . (P * scale) + sum(P * zero)
    acc = acc * (_UNSUB * gl.exp2((rows // (HEAD_DIM // 2)).to(gl.float32) * -4.0))[:, None] + z_i[None, :]
    _store_result(acc, m_i, l_i, q_head, h_mask, offs_d, seq, split, num_splits, sinks_ptr, out_ptr, part_out_ptr,
                  part_lse_ptr, stride_ob, stride_oh, NUM_KV, GROUP, HEAD_DIM, HAS_SINKS, IS_SPLIT)


@dataclass(frozen=True)
class TQGluonConfig:
    """Launch configuration of the Gluon TurboQuant kernel; `default_config` picks one."""

    block_n: int = 128
    """Tokens per tile (64 or 128): the M of the score MMA."""
    maxnreg: int | None = None
    """Register cap per thread (None: the compiler's choice)."""
    per_warp: bool = False
    """Run `tq_warp.decode_tq_warp` instead (`tq_warp.FORMATS`): each warp its own pages of every tile with
    mma.sync, no barrier per tile; one page (16 tokens) per warp with 64-token tiles, two with 128, four
    with 256."""
    pages_ahead: int = 2
    """How many tiles ahead the block-table entries load (1 or 2). Each tile's loads need its entries; at 1 the
    warp stalled on them before issuing the loads (Nsight Compute, NOTES_TQ.md tenth session)."""
    lazy_max: bool = True
    """Keep the softmax reference max until a score passes it by `LAZY_MAX_MARGIN` (log2 units). Warpgroup
    kernel: the common tile then needs no cross-warp max and no rescaling, only each warp's "passed" flag,
    read after the barrier P needs anyway. Per-warp kernel: a warp whose heads all kept their max skips the
    rescale of its O^T (`tq_warp.rescale_ptx`). False: the exact running max of every tile."""
    sum_pages: bool = False
    """Per-warp kernel with two or four pages per warp: add the tile's pages up in each thread before the
    softmax sums take them, so that those sums keep one page's shape (fewer registers and rescales; ptxas
    then schedules some formats better, others worse: `default_config`)."""
    unroll: bool = False
    """Per-warp kernel: two tiles per loop iteration, their bytes in two register sets that take turns, so that
    no loaded word is copied at the loop's end (`tq_warp._tq_warp_kernel`)."""
    mma_sums: bool = False
    """Per-warp kernel: P in fp16 once; P x value scale two tokens per instruction on the fp16 scales as loaded,
    and each head's softmax sum and sum of P x zero point by one mma.sync per page (`tq_warp._sums_operands`)
    instead of an add and an FMA per score and a conversion per field."""
    rotate_query: bool = False
    """Per-warp kernel: rotate the query in the prologue (`tq_warp._rotated_query`, one mma.sync product per
    program) instead of in a kernel of its own before it (`tq_decode._tq_rotate_query_kernel`): one launch less
    per decode step."""
    fused_merge: bool = False
    """Per-warp kernel, split calls of up to `MAX_FUSED_SPLITS` splits: the last split of each (sequence, KV
    head) to finish merges the partials itself (`_merge_if_last`) instead of a merge kernel after the grid:
    one launch less per decode step."""
    first_wave_weight: float = 1.0
    """Per-warp kernel: the splits that start first on their SM take this many times the tiles of the others
    (`tq_warp._weighted_tiles`, on a split-major grid). The warp schedulers favour the older program's warps, so
    with 2 programs per SM the second one ends last (bench/NOTES_TQ.md, twenty-third session); 1: equal splits."""
    first_wave_min_tiles: int = 64
    """`first_wave_weight` applies only to calls whose splits average at least this many tiles over the block
    table's span: with fewer (16-32 at batch 1, 128k) the weight moves a tile or two per split, and it measured
    up to 1.4 us slower there (session 32, `bench/results_tq_stamps/waves.log`)."""


MAX_FUSED_SPLITS = 32
"""Most splits `TQGluonConfig.fused_merge` merges in the kernel, in one block of loads: the per-warp defaults'
count at batch 1 with 8 KV heads. Up to 32 the sm_90 compile keeps the registers of 4 splits (`tq_warp.REGISTERS`);
from 33 every per-warp format takes 255 and head_dim 64 spills 8 bytes (`bench/sass_mix.py ... --fused-splits
33`). Calls with more splits take the merge kernel."""
_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """int32 zeros, at least `n`: one counter per (sequence, KV head) of a fused-merge launch
    (`_merge_if_last`), one buffer per device. The last split of each group zeroes its counter, so the buffer
    is zero again whenever a launch ends; launches that share it must not overlap, which holds for one decode
    stream per device (graph replays included), not for fused launches on two streams at once. None while a
    CUDA graph is being captured and the buffer is missing or too small (memory allocated in a capture belongs
    to the graph's pool): that call takes the merge kernel, so warm up eagerly before capturing."""
    device = torch.device(device)
    buf = _ARRIVALS.get(device)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            return None
        buf = _ARRIVALS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def default_config(fmt: str, head_dim: int) -> TQGluonConfig:
    """The fastest configuration of bench/probe_tq_gluon.py on an H200 at batch 8, 128k (NOTES_TQ.md, seventh,
    tenth, eleventh and twelfth sessions):
    - Centroid keys (4bit_nc, k3v4_nc, 3bit_nc): the per-warp kernel (`tq_warp`) with two pages per warp
      (128-token tiles; four at head_dim 64 with 4-bit values, below), the lazy max, the block table two
      tiles ahead. Against one page per warp (the previous default, us; `bench/results_tq_warp_ppw/`): Llama layer 4bit_nc 305.1 against 339.9, k3v4_nc
      280.9 against 333.3, 3bit_nc 324.0 against 374.2 (uncapped: 217-243 registers, 2 programs per SM;
      under a cap of 128 it spills: 701 us); gpt-oss layer 4bit_nc 206.0 against 218.8 (capped at 128
      registers: 4 programs per SM, no spills; uncapped 211.1), k3v4_nc 206.1 against 217.3, and 3bit_nc
      225.9 against 243.3 for the warpgroup kernel. Batch 1: Llama 51.5 / 48.2 / 52.3 against 58.5 / 56.1 /
      59.9, gpt-oss within 1 us except k3v4_nc (36.4 against 38.5) and 3bit_nc (38.3 against 40.9).
    - At head_dim 64 every format took four pages per warp (4bit_nc still does; below) (256-token tiles; 253-255 registers, no
      spills, 2 programs per SM): gpt-oss layer 4bit_nc 190.3 us against 206.6 (two pages, capped at 128) and
      k3v4_nc 193.3 against 205.9 at batch 8, 35.0 against 38.4 and 34.9 against 36.6 at batch 1
      (`bench/results_tq_warp_ppw/probe_ppw4_*.json`). 3bit_nc fits four pages since its loads form one
      address per page (`tq_warp._load_w`; it spilled 104 bytes before): 216.2 us against 222.9 for two
      pages at batch 8, 38.5 against 38.1 at batch 1 (fourteenth session, `bench/results_tq_warp_addr/`).
    - The tile's pages summed in-thread before the softmax sums (`sum_pages`; thirteenth session,
      `bench/results_tq_warp_fold/probe_sum_*.json`, batch 8, 128k, us, off / on): gpt-oss layer 4bit_nc
      180.8 / 179.3, k3v4_nc 202.0 / 188.4; Llama layer 4bit_nc 300.7 / 297.8, k3v4_nc 278.3 / 280.1, 3bit_nc
      327.1 / 322.9. (3bit_nc at head_dim 64 with two pages was the exception then, 228.5 / 245.9; it now
      takes four pages.)
    - One wave of splits: with 2 programs per SM two waves were slower (Llama 4bit_nc 305.1 against 311.0
      us, gpt-oss 4bit_nc with four pages 190.3 against 193.3). Two pages capped at 128 registers (4 per SM)
      were the one case where two waves won (206.0 against 212.3).
    - The per-warp lazy max skips the O^T rescale (`tq_warp.rescale_ptx`): k3v4_nc at 128-token tiles 280.9
      against 286.0 us (exact max) on the Llama layer, 206.1 against 214.1 on gpt-oss.
    - Two tiles per loop iteration (`unroll`) for the formats with 4-bit values (fifteenth session,
      `bench/results_tq_warp_unroll/`, 128k, us, one / two per iteration): gpt-oss layer batch 8 4bit_nc
      180.7 / 176.7, k3v4_nc 185.1 / 180.8; Llama layer 302.9 / 295.8 and 282.5 / 275.2; batch 1 Llama
      51.9 / 49.4 and 47.4 / 46.9, gpt-oss 32.5 / 33.1 and 33.7 / 35.0. 3bit_nc keeps one (gpt-oss 208.5 /
      215.2 at batch 8, Llama 290.5 / 287.6, batch 1 36.6 / 38.7 and 47.1 / 48.9).
    - The sums by mma.sync and P x scale in f16x2 (`mma_sums`; sixteenth session, `bench/results_tq_warp_sums/`,
      128k, us, the defaults before / with it): 4bit_nc on both layers (gpt-oss batch 8 175.5 / 171.0, batch 1
      33.6 / 31.7; Llama 294.6 / 291.6, 49.3 / 49.6), k3v4_nc and 3bit_nc at head_dim 128 (Llama k3v4_nc
      269.8 / 266.1; 3bit_nc, which then also takes two tiles per iteration, 290.5 / 274.8, batch 1 48.0 /
      47.4). At head_dim 64 those two measured slower with it (gpt-oss k3v4_nc 180.0 / 187.2, 3bit_nc 210.7 /
      224.3), though it takes 55-62 instructions per tile off both (ptxas schedules them worse).
    - The query rotated in the per-warp kernel's prologue (`rotate_query`, twenty-fifth session,
      `bench/results_tq_warp_rotate/probe_early.log`, us, the kernel before it / with it): one launch less per
      step, 0.9-2.9 us at batch 1 (gpt-oss 4bit_nc 4k 9.1 / 7.7, 128k 32.8 / 30.6; Llama 4bit_nc 4k 13.3 /
      12.4, 3bit_nc 128k 46.4 / 44.3; the exception Llama k3v4_nc 128k 46.6 / 47.4) and at batch 8 up to 3.4 us
      at 4k (Llama 4bit_nc 22.6 / 19.2), 128k within 1.6% either way (gpt-oss 4bit_nc 173.8 / 169.4, 3bit_nc
      208.9 / 209.7).
    - k3v4_nc and 3bit_nc at head_dim 64 took two pages per warp (128-token tiles) with the sums by mma.sync,
      one tile per iteration and at most 128 registers (no spills: 4 programs per SM against 2; twenty-fifth
      session, until the pages in thread order below, `bench/results_tq_warp_rotate/probe_twopage.log`, gpt-oss layer, 128k, us, four pages (the
      default before) / these): batch 8 k3v4_nc 176.8 / 170.1, 3bit_nc 208.9 / 199.0; batch 1 30.9 / 31.2 and
      34.9 / 35.8. 4bit_nc keeps four pages (169.6 against 179.5 for the same two-page form, 196.5 uncapped).
    - Pages in this kernel's thread order (`turboquant.warp_plane_order`; eighteenth session,
      `bench/results_tq_warp_order/probe_warporder.log`, 128k, us, the kernels before / after): gpt-oss layer
      batch 8 4bit_nc 166.2 / 157.1, k3v4_nc 169.8 / 155.6 and 3bit_nc 194.1 / 169.7 (two pages capped at 128),
      batch 1 29.0 / 28.4, 31.3 / 28.9, 34.9 / 31.8; Llama layer batch 8 290.1 / 290.4, 266.0 / 261.2, 278.5 /
      259.2. With fewer registers four pages per warp won back k3v4_nc and 3bit_nc at head_dim 64: k3v4_nc
      (unrolled) 146.6 us at batch 8, 27.9 at batch 1; 3bit_nc (one tile per iteration) 162.4 and 29.4; 3bit_nc
      two pages capped and unrolled 178.1. 3bit_nc's four pages then take two tiles per iteration as well
      (`... OUT unroll3` on aaaa0a2, `bench/results_tq_warp_order/probe_unroll3.log`, one / two): batch 8
      160.5 / 156.4 us at 128k, 12.8 / 12.6 at 4k; batch 1 27.9 / 27.0 and 7.2 / 7.7.
    - FP8 keys at head_dim 128 (k8v4): 128-token tiles in the warpgroup kernel (Llama layer 498 us against 568
      for 64); at head_dim 64, 64-token tiles, which leave 4-5 programs per SM (3bit_nc 545 against 605 for
      128). The block table loads two tiles ahead (k8v4 422 against 448 us and 247 against 264).
    - The split merge in the per-warp kernel (`fused_merge`, twenty-ninth session, `bench/results_tq_fused/`, us,
      plain call / fused / plain again): gpt-oss layer batch 1 128k 4bit_nc 29.38 / 28.30 / 29.18, k3v4_nc
      27.94 / 26.93 / 27.34, 3bit_nc 28.02 / 27.06 / 27.48, 4k 3bit_nc 7.51 / 6.88 / 7.48; batch 8 128k
      within 1.2 us; Llama layer batch 1 128k 4bit_nc 49.15 / 47.16 / 47.70, batch 8 4k 19.49 / 18.20 / 19.61.
    - 3bit_nc's first-wave splits take 18/16 of the tiles where splits average 64 tiles or more (batch 8 at 64k
      and 128k; `FIRST_WAVE_WEIGHT`, session 32): 3.6-4.1% faster there."""
    from kvpolicy.kernels import tq_warp

    if fmt in tq_warp.FORMATS:
        return TQGluonConfig(block_n=256 if head_dim == 64 else 128, per_warp=True, sum_pages=True, unroll=True,
                             mma_sums=True, rotate_query=True, fused_merge=True,
                             first_wave_weight=FIRST_WAVE_WEIGHT.get(fmt, 1.0))
    if head_dim >= 128 and tq_layout(fmt, head_dim).key_fp8:
        return TQGluonConfig(block_n=128)
    return TQGluonConfig(block_n=64, maxnreg=128 if head_dim >= 128 else None)


FIRST_WAVE_WEIGHT = {"turboquant_3bit_nc": 1.125}
"""`TQGluonConfig.first_wave_weight` by format. 3bit_nc at batch 8, 64k and 128k (session 32, bench/NOTES_TQ.md
twenty-fourth section, `bench/results_tq_stamps/waves2.log`, us, default / 1.125 / 1.25 / default): gpt-oss layer 78.49 / 75.64 / 77.45 /
80.31 and 151.18 / 145.56 / 142.32 / 149.59; Llama layer 129.34 / 124.77 / 127.38 / 131.53 and 248.42 / 238.23 /
242.25 / 247.92. k3v4_nc took longer with either weight (gpt-oss 128k 143.43 / 144.00 / 147.20 / 145.45, Llama
255.76 / 260.99 / 266.06 / 255.88), and 4bit_nc within its spread or longer (`waves.log`: gpt-oss 128k 154.34 /
153.42 at 1.125 / 157.94 at 1.25 / 154.96)."""


REGISTERS = {"turboquant_k8v4": {(128, 128): 235, (128, 64): 152, (64, 64): 95, (64, 128): 161}}
"""Registers per thread of the warpgroup kernel's sm_90 compile (Triton 3.6, no cap, lazy max; `bench/sass_mix.py
--tq-gluon FORMAT --head-dim D --block-n N`) by format (k8v4, the one it decodes) and (head_dim, block_n);
`TQGluonConfig.maxnreg` overrides them (the per-warp formats: `tq_warp.REGISTERS`)."""


def smem_bytes(head_dim: int, cfg: TQGluonConfig) -> int:
    """Shared memory of one program: the fp16 value-code tile, P, the query tiles and 1 KB of the
    compiler's scratch (the cross-warp max)."""
    return cfg.block_n * head_dim * 2 + 8 * cfg.block_n * 2 + 8 * head_dim * 2 + 1024


def programs_per_sm(fmt: str, head_dim: int, device: torch.device, cfg: TQGluonConfig) -> int:
    """Programs resident per SM: one warpgroup with the compile's registers (`REGISTERS`, or the cap) and the
    shared memory: 2 at head_dim 128 with 128-token tiles, 4-5 at head_dim 64 with 64-token tiles."""
    from kvpolicy.kernels.decode_attention import resident_programs

    if cfg.per_warp:
        from kvpolicy.kernels import tq_warp

        regs = cfg.maxnreg or tq_warp.REGISTERS.get(fmt, {}).get((head_dim, cfg.block_n), 255)
        return resident_programs(regs, tq_warp.smem_bytes(head_dim), 4, device)
    regs = cfg.maxnreg or REGISTERS.get(fmt, {}).get((head_dim, cfg.block_n), 255)
    return resident_programs(regs, smem_bytes(head_dim, cfg), 4, device)


def default_splits(fmt: str, batch: int, num_kv_heads: int, span: int, head_dim: int, device: torch.device,
                   cfg: TQGluonConfig) -> int:
    """Splits per sequence for `cfg` over a span of `span` tokens (`decode_attention.split_count`, one wave): a
    power of two unless that leaves more than 15% of the wave's slots empty. At 2 programs per SM (the
    per-warp defaults, k8v4 at head_dim 128) 32 splits fill 256 of 264 slots at batch 1; 33 would fill all,
    and took 33.1 us against 31.6 (4bit_nc, gpt-oss layer, 128k; twenty-fifth session). At 5 per SM (k8v4 at
    head_dim 64) a power of two fills 78%: 10 splits at batch 8 and 80-81 at batch 1, against 8 and 64, took
    235.3 against 248.1 us and 38.6-38.7 against 39.7 us on the gpt-oss layer at 128k
    (`bench/results_tq_k8v4/probe_k8v4_fill.log`)."""
    from kvpolicy.kernels.decode_attention import split_count

    return split_count(batch, num_kv_heads, span, cfg.block_n, programs_per_sm(fmt, head_dim, device, cfg), device,
                       waves=(), pow2_fill=0.85)


def refusal(fmt: str, head_dim: int, group: int, page: int = PAGE) -> str:
    """Why this kernel does not take layers of this shape ("" when it does): the rules for a layer plan
    (`LayerPlan.kernel_path`) and for a call (`supported`)."""
    if fmt not in FORMATS:
        return f"it decodes {' and '.join(FORMATS)} only"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim}: it takes {' or '.join(map(str, HEAD_DIMS))}"
    if group > MAX_GROUP:
        return f"GQA groups above {MAX_GROUP} query heads per KV head"
    if page != PAGE:
        return f"it reads {PAGE}-token pages, not {page}"
    return ""


def supported(query: torch.Tensor, cache: torch.Tensor, fmt: str) -> tuple[bool, str]:
    """Whether this kernel decodes these tensors, and if not, why (the device is
    `decode_attention.gluon_runs_on`'s to check)."""
    d = query.shape[2]
    planar = cache.dim() == 3  # [blocks, kv_heads, page bytes]; a slot cache is refused below
    why = refusal(fmt, d, query.shape[1] // cache.shape[1] if planar else 1)
    if not why and (not planar or cache.shape[2] != PAGE * tq_layout(fmt, d).slot_bytes
                    or not cache.is_contiguous()):
        why = (f"it reads planar caches of {PAGE}-token pages (turboquant.allocate_tq_planar_cache), "
               f"not {tuple(cache.shape)}")
    return not why, why


def query_order(fmt: str, head_dim: int) -> torch.Tensor:
    """The head coordinate of the query at each K index of the score MMA: `operand_order` for FP8 keys (fp16
    wgmma), `turboquant.int8_operand_order` for centroid keys (the per-warp kernel's int8 mma.sync)."""
    if tq_layout(fmt, head_dim).key_fp8:
        return operand_order(head_dim)
    return int8_operand_order(fmt, head_dim)


@functools.cache
def _kernel_table(fmt: str, head_dim: int, device: str) -> torch.Tensor:
    """int32 [head_dim + 1]: `query_order`, then the first word of the centroid keys' PRMT table
    (`turboquant.int8_table_word`; 0 for FP8 keys), which the kernel loads."""
    lay = tq_layout(fmt, head_dim)
    word = 0 if lay.key_fp8 else int8_table_word(lay.key_bits)
    return torch.cat([query_order(fmt, head_dim), torch.tensor([word])]).to(torch.int32).to(device)


def kernel_constexprs(fmt: str, head_dim: int, num_q_heads: int, num_kv_heads: int,
                      cfg: TQGluonConfig) -> dict:
    """The compile-time arguments of `_tq_gluon_kernel` that follow from the format, the shapes and `cfg`;
    a launch adds the per-call ones (window, sinks, split). The code planes' widths come from
    `turboquant.code_planes`, the page layout's own definition."""
    lay = tq_layout(fmt, head_dim)
    planes = code_planes(fmt, head_dim)  # the key's, then the value's
    kbm, vbm = planes[0][1], planes[-2 if lay.value_bits == 3 else -1][1]
    return dict(GROUP=num_q_heads // num_kv_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, SLOT=lay.slot_bytes,
                BN=cfg.block_n, KEY_BITS=lay.key_bits, V_BITS=lay.value_bits, KBM=kbm, KB=lay.key_bytes, VBM=vbm,
                VB=lay.val_bytes, NF=len(field_planes(fmt, head_dim)), K_LAYOUT=key_layout(cfg.block_n, kbm),
                V_LAYOUT=key_layout(cfg.block_n, vbm), LAZY=cfg.lazy_max, PAGES_AHEAD=cfg.pages_ahead,
                I8_SCALE=1.0 if lay.key_fp8 else int8_centroids(lay.key_bits)[1],
                I8_OFFSET=0.0 if lay.key_fp8 else int8_offset(lay.key_bits))


def decode_tq_gluon(query: torch.Tensor, q16: torch.Tensor, q_scale: float, cache: torch.Tensor, fmt: str,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, *, sliding_window: int | None,
                    sinks: torch.Tensor | None, splits: int, out: torch.Tensor,
                    config: TQGluonConfig | None = None) -> torch.Tensor:
    """Run the kernel (and the shared merge when split). `q16`: the query the score MMA reads (the
    rotated fp16 query for centroid keys, `query` itself for FP8 keys), times `q_scale` in the kernel.
    Inputs already validated by `decode_attention_tq` and `supported`."""
    from kvpolicy.kernels.decode_attention import launch_merge, split_partials

    batch, num_q_heads, head_dim = query.shape
    cfg = config or default_config(fmt, head_dim)
    if cfg.per_warp:
        from kvpolicy.kernels.tq_warp import decode_tq_warp

        return decode_tq_warp(query, q16, q_scale, cache, fmt, block_tables, seq_lens, sliding_window=sliding_window,
                              sinks=sinks, splits=splits, out=out, cfg=cfg)
    if fmt in WARP_ORDER_FORMATS:
        raise ValueError(f"{fmt}: its planar pages are in the per-warp kernel's order "
                         "(turboquant.warp_plane_order); run it with TQGluonConfig(per_warp=True)")
    if cfg.block_n not in (64, 128):
        raise ValueError(f"TQGluonConfig: block_n must be 64 or 128, got {cfg}")
    num_kv_heads = cache.shape[1]
    cx = kernel_constexprs(fmt, head_dim, num_q_heads, num_kv_heads, cfg)
    cx = {k: v for k, v in cx.items() if k in _tq_gluon_kernel.arg_names}  # the rest are `tq_warp`'s
    part_out, part_lse = split_partials(out, splits)
    _tq_gluon_kernel[(num_kv_heads, splits, batch)](
        q16, _kernel_table(fmt, head_dim, str(cache.device)), cache.view(torch.int32), cache.view(torch.int16),
        block_tables, seq_lens, sinks if sinks is not None else seq_lens, out, part_out, part_lse, float(q_scale),
        int(sliding_window or 0), splits, q16.stride(0), q16.stride(1), block_tables.stride(0), out.stride(0),
        out.stride(1), **cx, HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None and splits == 1,
        IS_SPLIT=splits > 1, num_warps=4, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    if splits > 1:
        launch_merge(part_out, part_lse, sinks, out, splits, pdl=False)
    return out
