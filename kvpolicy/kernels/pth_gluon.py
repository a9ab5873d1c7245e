"""Hopper per-token-head decode in Gluon: a copying warpgroup stages vLLM's rows, a compute warpgroup runs wgmma.

Why a second kernel: the Triton one (`decode_attention.py`, PTH paths) loads vLLM's rows `[K | K scale | V |
V scale]` into the registers of the warps that also compute, in 8- and 4-byte pieces (V sits 4 bytes past a
scale). TMA cannot stage these rows as the FP8 kernel (`decode_gluon.py`) does: a TMA box must start on a
16-byte boundary, and odd KV heads start 8 bytes off one, V 4 or 12. So, with `gl.warp_specialize`:
- a producer warpgroup copies each tile's rows with cp.async (K in 8-byte pieces, V and the scales in 4-byte
  ones) straight into shared memory, page ids one tile ahead, each thread's copies arriving on the stage's
  mbarrier when they land: the compute warps never issue a load or wait on an address;
- scores are S^T = K.Q^T with the tile's tokens as M: int8 K meets an int8 query in an int8 wgmma (exact
  integer sums); int4 codes are unpacked once per tile into an int8 tile in coordinate order and meet it the
  same way; e4m3 K is the fp16 A operand from registers against an fp16 query (or, with `fp8_query`, meets an
  e4m3 query in an fp8 wgmma as FA3 does);
- each token's K scale multiplies its score row, its V scale its softmax weight: O^T = V^T.(P x vs)^T is an
  fp16 wgmma over V converted to exact fp16 once per tile (register programs for int8 and int4);
- int4's zero points are row terms: zp x sum(q) leaves the scores, and sum(P x vs x zp) the output, kept per
  position as the softmax denominator is and summed after the loop.
The int4 query is rotated before the kernel and the output back after it (`decode_attention_pth`).
Figures: bench/RESULTS.md; designs: bench/KERNELS.md.

Scope: vLLM's NHD rows (uint8 [blocks, 16, heads, row]), head_dim 64 or 128, GQA groups up to 16, sm_90 only.
Gluon does not run under the interpreter: tested on the GPU only (tests/kernels/test_pth_gluon.py), against the
same float64 reference as the Triton kernel.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kvpolicy.kernels.decode_gluon import _page_ids, p_v
from kvpolicy.kernels.formats import FP8_E4M3_MAX, PAGE, PTH_MODE, pth_layout
from kvpolicy.kernels.launch import (
    LOG2E,
    merge_splits,
    resident_programs,
    span,
    split_count,
    split_partials,
    split_tiles,
    store_result,
)
from kvpolicy.kernels.turboquant import (
    i8_program,
    nibbles_program,
    render_ptx,
    v4_program,
)

HEAD_DIMS = (64, 128)
"""Head dims it takes."""
MAX_GROUP = 16
"""Largest GQA group (query heads per KV head): the N of the score MMA."""
MAXNREG = 128
"""Registers per thread at launch over the program's 8 warps (the consumer and the producer warpgroup);
setmaxnreg moves what the producer does not use to the consumer."""
PRODUCER_WARPS = 4
"""Warps of the copying partition (one warpgroup: setmaxnreg works per warpgroup, so fewer would not save
registers)."""
PRODUCER_REGS = gl.constexpr(56)
"""Registers per producer thread: its offsets within a page, a tile's page ids and one page's pointers."""
P_SCALE = gl.constexpr(256.0)
"""P x vs is stored as fp16 times this (as the Triton kernel does), so tiny value scales stay normal fp16."""
_FP8_MAX = gl.constexpr(FP8_E4M3_MAX)
_I8_ASM = gl.constexpr(render_ptx(i8_program()))
_NIBBLES_ASM = gl.constexpr(render_ptx(nibbles_program()))
_V4_ASM = gl.constexpr(render_ptx(v4_program()))


TILING = {("fp8_per_token_head", 128): (64, 3), ("fp8_per_token_head", 64): (64, 4),
          ("int8_per_token_head", 128): (64, 3), ("int8_per_token_head", 64): (64, 4),
          ("int4_per_token_head", 128): (64, 3), ("int4_per_token_head", 64): (128, 2)}
"""(tokens per tile, the M of the score MMA: 64 or 128; tiles in flight per program) of each format and head_dim,
the fastest in an H100 A/B: 64-token tiles with a ring of 3-4 for the 8-bit formats and int4 at 128 (the
128-token tiles' 2 stages are the most that leave two programs per SM there); int4 at 64, whose rows hold 32
bytes of codes, keeps 128-token tiles (fewer, larger copies per tile) with 2 stages. Each was at least as fast as
the Triton kernel there, so `kernel="auto"` takes this one wherever it applies."""


def tiling(fmt: str, head_dim: int) -> tuple[int, int]:
    """`TILING`'s entry for a format at a head_dim."""
    return TILING[(fmt, head_dim)]


@gluon.jit
def _copy_page(cache_ptr, kb, vb, row: gl.constexpr, page, k_off, v_off, PAGE_STRIDE: gl.constexpr,
               PAGE: gl.constexpr):
    """cp.async one page's K and V codes of the program's head into rows row..row+15 of a stage."""
    base = cache_ptr + page.to(gl.int64) * PAGE_STRIDE
    async_copy.async_copy_global_to_shared(kb.slice(row, PAGE), base + k_off)
    async_copy.async_copy_global_to_shared(vb.slice(row, PAGE), base + v_off)


@gluon.jit
def _producer(cache_ptr, k_bufs, v_bufs, ks_bufs, vs_bufs, full, empty, bt_row, seq_len, tile_lo, n_tiles,
              STAGES: gl.constexpr, BN: gl.constexpr, DATA_BYTES: gl.constexpr, ROW_BYTES: gl.constexpr,
              PAGE_STRIDE: gl.constexpr, TOK_STRIDE: gl.constexpr, PW: gl.constexpr, K_VEC: gl.constexpr):
    """One warpgroup: each tile's rows by cp.async into a freed stage (K codes in K_VEC-byte pieces, V codes and
    the scales in 4-byte ones: vLLM's offsets allow no wider), the page ids one tile ahead; each thread's copies
    arrive on the stage's barrier when they land."""
    PG: gl.constexpr = 16
    PAGES: gl.constexpr = BN // PG
    gl.static_assert((PAGES == 8) | (PAGES == 4), "one or two batches of 4 pages per tile")
    K_COLS: gl.constexpr = DATA_BYTES // K_VEC
    V_COLS: gl.constexpr = DATA_BYTES // 4
    k_layout: gl.constexpr = gl.BlockedLayout([1, K_VEC], [32 // K_COLS, K_COLS], [PW, 1], [1, 0])
    v_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // V_COLS, V_COLS], [PW, 1], [1, 0])
    s_layout: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [PW // (8 // PAGES), 8 // PAGES], [1, 0])  # [page, row]
    head_off = gl.program_id(0) * ROW_BYTES
    # Offsets within a page, the same for every page.
    tk = gl.arange(0, PG, layout=gl.SliceLayout(1, k_layout))
    k_off = head_off + tk[:, None] * TOK_STRIDE + gl.arange(0, DATA_BYTES, layout=gl.SliceLayout(0, k_layout))[None, :]
    tv = gl.arange(0, PG, layout=gl.SliceLayout(1, v_layout))
    v_off = (head_off + DATA_BYTES + 4) + tv[:, None] * TOK_STRIDE + \
        gl.arange(0, DATA_BYTES, layout=gl.SliceLayout(0, v_layout))[None, :]
    sp = gl.arange(0, PAGES, layout=gl.SliceLayout(1, s_layout))
    s_off = (head_off + DATA_BYTES) + gl.arange(0, PG, layout=gl.SliceLayout(0, s_layout)) * TOK_STRIDE

    first = tile_lo * PAGES
    pv = gl.load(bt_row + first + sp, mask=((first + sp) * PG < seq_len) & (n_tiles > 0), other=0)
    a0, a1, a2, a3 = _page_ids(bt_row, first, seq_len, n_tiles > 0, PG)
    b0, b1, b2, b3 = _page_ids(bt_row, first + 4, seq_len, (n_tiles > 0) & (PAGES == 8), PG)
    for i in range(n_tiles):
        stage = i % STAGES
        # A fresh mbarrier passes a wait on the phase before its first: the first STAGES tiles go straight out.
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        kb = k_bufs.index(stage)
        vb = v_bufs.index(stage)
        _copy_page(cache_ptr, kb, vb, 0, a0, k_off, v_off, PAGE_STRIDE, PG)
        _copy_page(cache_ptr, kb, vb, 16, a1, k_off, v_off, PAGE_STRIDE, PG)
        _copy_page(cache_ptr, kb, vb, 32, a2, k_off, v_off, PAGE_STRIDE, PG)
        _copy_page(cache_ptr, kb, vb, 48, a3, k_off, v_off, PAGE_STRIDE, PG)
        if PAGES == 8:
            _copy_page(cache_ptr, kb, vb, 64, b0, k_off, v_off, PAGE_STRIDE, PG)
            _copy_page(cache_ptr, kb, vb, 80, b1, k_off, v_off, PAGE_STRIDE, PG)
            _copy_page(cache_ptr, kb, vb, 96, b2, k_off, v_off, PAGE_STRIDE, PG)
            _copy_page(cache_ptr, kb, vb, 112, b3, k_off, v_off, PAGE_STRIDE, PG)
        ks_ptr = cache_ptr + (pv.to(gl.int64) * PAGE_STRIDE)[:, None] + s_off[None, :]
        async_copy.async_copy_global_to_shared(ks_bufs.index(stage), ks_ptr.to(gl.pointer_type(gl.int32)))
        async_copy.async_copy_global_to_shared(vs_bufs.index(stage),
                                               (ks_ptr + (DATA_BYTES + 4)).to(gl.pointer_type(gl.int32)))
        async_copy.mbarrier_arrive(full.index(stage), increment_count=False)
        nxt = (tile_lo + i + 1) * PAGES
        more = i + 1 < n_tiles
        pv = gl.load(bt_row + nxt + sp, mask=((nxt + sp) * PG < seq_len) & more, other=0)
        a0, a1, a2, a3 = _page_ids(bt_row, nxt, seq_len, more, PG)
        b0, b1, b2, b3 = _page_ids(bt_row, nxt + 4, seq_len, more & (PAGES == 8), PG)


@gluon.jit
def _pairs(lo, hi, BN: gl.constexpr, DB: gl.constexpr):
    """Codes of the even and the odd coordinates [BN, DB] -> [BN, 2 DB] in coordinate order (a register relabel)."""
    return gl.reshape(gl.join(lo, hi), [BN, 2 * DB])


@gluon.jit
def _attend_tile(i, q_smem, k_bufs, v_bufs, ks_bufs, vs_bufs, k8_smem, v16_smem, p_smem, full, empty, qk_scale,
                 q_sum, seq_len, start, tile_lo, m_i, l_part, z_part, acc, PTH: gl.constexpr, NH: gl.constexpr,
                 HEAD_DIM: gl.constexpr, DATA_BYTES: gl.constexpr, STAGES: gl.constexpr, TWO_LEVEL: gl.constexpr,
                 EDGE: gl.constexpr, BN: gl.constexpr, KI: gl.constexpr):
    """Tile i of the program's range: scores, online softmax, P.V; returns (m_i, l_part, z_part, acc). EDGE: the
    tile reaches outside [start, seq_len) (a compiled copy for the few edge tiles)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, KI])
    rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    # 16 bytes per thread along the row when reading a staged code tile
    cvt_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (DATA_BYTES // 16), DATA_BYTES // 16], [4, 1], [1, 0])

    stage = i % STAGES
    tile_start = (tile_lo + i) * BN
    mbarrier.wait(full.index(stage), (i // STAGES) & 1)
    # the copies wrote through the generic proxy; the MMAs read through the async one
    fence_async_shared()
    # Every warp is past the previous tile's MMAs (their waits): K8, V16 and P may be rewritten.
    gl.thread_barrier()
    kb = k_bufs.index(stage)
    if PTH == 3:
        k_lo, k_hi = gl.inline_asm_elementwise(_NIBBLES_ASM, "=r,=r,r", [kb.load(cvt_layout)],
                                               dtype=(gl.int8, gl.int8), is_pure=True, pack=4)
        k8_smem.store(_pairs(k_lo, k_hi, BN, DATA_BYTES))
        fence_async_shared()
        gl.thread_barrier()
        k_op = k8_smem
    elif (PTH == 1) & (KI == 16):
        # e4m3 keys as the fp16 A operand, from registers: exact, and the query keeps fp16
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        k_op = kb.load(a_layout).to(gl.float16)
    else:
        k_op = kb
    if PTH == 1:
        s = warpgroup_mma(k_op, q_smem.permute((1, 0)), gl.zeros([BN, NH], gl.float32, layout=s_layout),
                          use_acc=False, is_async=True)
    else:
        s = warpgroup_mma(k_op, q_smem.permute((1, 0)), gl.zeros([BN, NH], gl.int32, layout=s_layout),
                          use_acc=False, is_async=True)
    # V's conversion to exact fp16 overlaps the score MMA.
    v = v_bufs.index(stage).load(cvt_layout)
    if PTH == 3:
        v_lo, v_hi = gl.inline_asm_elementwise(_V4_ASM, "=r,=r,=r,=r,r", [v], dtype=(gl.float16, gl.float16),
                                               is_pure=True, pack=4)
        v16 = _pairs(v_lo, v_hi * 0.0625, BN, DATA_BYTES)  # the high nibbles come as 16 x code
    elif PTH == 2:
        v16 = gl.inline_asm_elementwise(_I8_ASM, "=r,=r,r", [v], dtype=gl.float16, is_pure=True, pack=4)
    else:
        v16 = v.to(gl.float16)
    if (PTH == 1) & EDGE:
        # Pages hold other data (or NaN) outside [start, seq_len), and a zero weight times NaN is NaN in the MMA,
        # so those rows of V are zeroed, not just weighted 0 (int8/int4 codes are always finite).
        pos_v = tile_start + gl.arange(0, BN, layout=gl.SliceLayout(1, v16.type.layout))
        v16 = gl.where(((pos_v < seq_len) & (pos_v >= start))[:, None], v16, 0.0)
    v16_smem.store(v16)
    ks_bits = ks_bufs.index(stage).reshape([BN]).load(rows)
    vs_bits = vs_bufs.index(stage).reshape([BN]).load(rows)
    s, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s, k_op, q_smem))

    if PTH == 3:
        # the scale's low 4 bits hold the zero point
        s = (s - (ks_bits & 15)[:, None] * q_sum[None, :]).to(gl.float32)
        ks = (ks_bits & -16).to(gl.float32, bitcast=True)
        vs = (vs_bits & -16).to(gl.float32, bitcast=True)
    else:
        s = s.to(gl.float32)
        ks = ks_bits.to(gl.float32, bitcast=True)
        vs = vs_bits.to(gl.float32, bitcast=True)
    s = s * (ks * qk_scale)[:, None]
    if EDGE:
        pos = tile_start + gl.arange(0, BN, layout=rows)
        valid = (pos < seq_len) & (pos >= start)
        s = gl.where(valid[:, None], s, float("-inf"))
        vs = gl.where(valid, vs, 0.0)  # a NaN scale outside the range would poison P x vs
    m_new = gl.maximum(m_i, gl.max(s, 0))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[None, :])
    l_part = l_part * alpha[None, :] + p
    pv = (p * (vs * P_SCALE)[:, None]).to(gl.float16)
    if PTH == 3:
        # the rounded weights the MMA multiplies, so that the zero point cancels exactly
        z_part = z_part * alpha[None, :] + pv.to(gl.float32) * (vs_bits & 15).to(gl.float32)[:, None]
    p_smem.store(gl.permute(pv, (1, 0)))
    fence_async_shared()
    gl.thread_barrier()
    # K and V of this stage are consumed (K by the finished score MMA or into K8, V into V16): release it.
    mbarrier.arrive(empty.index(stage))

    return m_new, l_part, z_part, p_v(v16_smem, p_smem, acc, alpha, NH, HEAD_DIM, TWO_LEVEL)


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, ks_bufs, vs_bufs, k8_smem, v16_smem, p_smem, full, empty, qk_scale, q_sum,
              seq_len, start, tile_lo, n_tiles, PTH: gl.constexpr, NH: gl.constexpr, HEAD_DIM: gl.constexpr,
              DATA_BYTES: gl.constexpr, STAGES: gl.constexpr, TWO_LEVEL: gl.constexpr, BN: gl.constexpr,
              KI: gl.constexpr):
    """The default partition (one warpgroup): every tile of the program's range; returns the running max, the
    per-position denominators and zero-point sums, and O^T."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, KI])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 16])
    m_i = gl.full([NH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_layout))
    l_part = gl.zeros([BN, NH], gl.float32, layout=s_layout)
    z_part = gl.zeros([BN, NH], gl.float32, layout=s_layout)
    acc = gl.zeros([HEAD_DIM, NH], gl.float32, layout=o_layout)
    for i in range(n_tiles):
        tile_start = (tile_lo + i) * BN
        if (tile_start < start) | (tile_start + BN > seq_len):
            m_i, l_part, z_part, acc = _attend_tile(
                i, q_smem, k_bufs, v_bufs, ks_bufs, vs_bufs, k8_smem, v16_smem, p_smem, full, empty, qk_scale, q_sum,
                seq_len, start, tile_lo, m_i, l_part, z_part, acc, PTH, NH, HEAD_DIM, DATA_BYTES, STAGES, TWO_LEVEL,
                True, BN, KI)
        else:
            m_i, l_part, z_part, acc = _attend_tile(
                i, q_smem, k_bufs, v_bufs, ks_bufs, vs_bufs, k8_smem, v16_smem, p_smem, full, empty, qk_scale, q_sum,
                seq_len, start, tile_lo, m_i, l_part, z_part, acc, PTH, NH, HEAD_DIM, DATA_BYTES, STAGES, TWO_LEVEL,
                False, BN, KI)
    return m_i, l_part, z_part, acc


@gluon.jit
def _pth_gluon_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    sm_scale, window, num_splits,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    PTH: gl.constexpr,
    NUM_KV: gl.constexpr,
    GROUP: gl.constexpr,
    NH: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    DATA_BYTES: gl.constexpr,
    ROW_BYTES: gl.constexpr,
    TOK_STRIDE: gl.constexpr,
    PAGE_STRIDE: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    IS_SPLIT: gl.constexpr,
    TWO_LEVEL: gl.constexpr,
    BN: gl.constexpr,
    PW: gl.constexpr,
    KI: gl.constexpr,
):
    kv_head = gl.program_id(0)
    split = gl.program_id(1)
    seq = gl.program_id(2)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, KI])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 16])
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
    code_ty: gl.constexpr = cache_ptr.dtype.element_ty
    op_ty: gl.constexpr = gl.int8 if PTH != 1 else (gl.float16 if KI == 16 else gl.float8e4nv)
    code_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, DATA_BYTES], code_ty)
    scale_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])

    k_bufs = gl.allocate_shared_memory(code_ty, [STAGES, BN, DATA_BYTES], code_smem)
    v_bufs = gl.allocate_shared_memory(code_ty, [STAGES, BN, DATA_BYTES], code_smem)
    ks_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BN // 16, 16], scale_smem)  # [stage, page, row]
    vs_bufs = gl.allocate_shared_memory(gl.int32, [STAGES, BN // 16, 16], scale_smem)
    if PTH == 3:
        k8_smem = gl.allocate_shared_memory(gl.int8, [BN, HEAD_DIM],
                                            gl.NVMMASharedLayout.get_default_for([BN, HEAD_DIM], gl.int8))
    else:
        k8_smem = k_bufs  # unused: 8-bit codes are the MMA's operand as staged
    v16_smem = gl.allocate_shared_memory(gl.float16, [BN, HEAD_DIM],
                                         gl.NVMMASharedLayout.get_default_for([BN, HEAD_DIM], gl.float16))
    p_smem = gl.allocate_shared_memory(gl.float16, [NH, BN], gl.NVMMASharedLayout.get_default_for([NH, BN], gl.float16))
    q_smem = gl.allocate_shared_memory(op_ty, [NH, HEAD_DIM],
                                       gl.NVMMASharedLayout.get_default_for([NH, HEAD_DIM], op_ty))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=32 * PW)  # every producer thread's copies arrive
        mbarrier.init(empty.index(i), count=1)

    seq_len, start, tile_lo, tile_hi = split_tiles(seq_lens_ptr, seq, window, split, num_splits, BN, HAS_WINDOW)
    n_tiles = gl.maximum(tile_hi - tile_lo, 0)

    # The GQA group's query with one dynamic scale per program: e4m3 for fp8 codes, int8 (rounded half away
    # from zero) for int8/int4 codes; int4 also needs each head's sum of query codes for the zero points.
    offs_qh = gl.arange(0, NH, layout=gl.SliceLayout(1, q_layout))
    offs_qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(q_ptr + seq * stride_qb + (kv_head * GROUP + offs_qh)[:, None] * stride_qh + offs_qd[None, :],
                mask=(offs_qh < GROUP)[:, None], other=0.0).to(gl.float32)
    if (PTH == 1) & (KI == 16):
        q_scale = 1.0
        q_smem.store(gl.minimum(gl.maximum(q, -65504.0), 65504.0).to(gl.float16))  # fp16 saturates there
        q_sum = gl.zeros([NH], gl.int32, layout=gl.SliceLayout(0, s_layout))
    elif PTH == 1:
        q_scale = gl.maximum(gl.max(gl.max(gl.abs(q), 1), 0) / _FP8_MAX, 1e-30)
        q_smem.store((q / q_scale).to(gl.float8e4nv))
        q_sum = gl.zeros([NH], gl.int32, layout=gl.SliceLayout(0, s_layout))
    else:
        q_scale = gl.maximum(gl.max(gl.max(gl.abs(q), 1), 0) / 127.0, 1e-30)
        x = q / q_scale
        q_codes = gl.where(x >= 0, gl.floor(x + 0.5), -gl.floor(0.5 - x)).to(gl.int32)
        q_smem.store(q_codes.to(gl.int8))
        q_sum = gl.convert_layout(gl.sum(q_codes, 1), gl.SliceLayout(0, s_layout))
    qk_scale = sm_scale * LOG2E * q_scale
    fence_async_shared()
    gl.thread_barrier()

    bt_row = block_tables_ptr + seq * stride_bt
    m_i, l_part, z_part, acc = gl.warp_specialize(
        [(_consumer, (q_smem, k_bufs, v_bufs, ks_bufs, vs_bufs, k8_smem, v16_smem, p_smem, full, empty, qk_scale,
                      q_sum, seq_len, start, tile_lo, n_tiles, PTH, NH, HEAD_DIM, DATA_BYTES, STAGES, TWO_LEVEL, BN,
                      KI)),
         (_producer, (cache_ptr, k_bufs, v_bufs, ks_bufs, vs_bufs, full, empty, bt_row, seq_len, tile_lo, n_tiles,
                      STAGES, BN, DATA_BYTES, ROW_BYTES, PAGE_STRIDE, TOK_STRIDE, PW, 8 if DATA_BYTES >= 64 else 4))],
        [PW], [PRODUCER_REGS])

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(i))
        mbarrier.invalidate(empty.index(i))

    l_i = gl.convert_layout(gl.sum(l_part, 0), gl.SliceLayout(0, o_layout))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(0, o_layout))
    if PTH == 3:
        acc = acc - gl.convert_layout(gl.sum(z_part, 0), gl.SliceLayout(0, o_layout))[None, :]
    offs_h = gl.arange(0, NH, layout=gl.SliceLayout(0, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, o_layout))
    # P x vs carried P_SCALE; the denominator did not
    store_result(acc * (1.0 / P_SCALE), m_o, l_i, kv_head * GROUP + offs_h, offs_h < GROUP, offs_d, seq, split,
                 num_splits, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr, stride_ob, stride_oh, NUM_KV, GROUP,
                 HEAD_DIM, HAS_SINKS, IS_SPLIT)


_CODE_DTYPES = {1: torch.float8_e4m3fn, 2: torch.int8, 3: torch.uint8}
"""How the kernel reads the codes of each PTH mode (fp8, int8, int4)."""


def shape_refusal(head_dim: int, group: int, page: int) -> str:
    """Why the kernel does not take a layer of this shape ("" when it does): what the runtime asks before it
    allocates a cache."""
    if group > MAX_GROUP:
        return f"GQA groups above {MAX_GROUP} query heads per KV head"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (it takes {' or '.join(map(str, HEAD_DIMS))})"
    if page != PAGE:
        return f"it needs {PAGE}-token pages"
    return ""


def refusal(query: torch.Tensor, cache: torch.Tensor) -> str:
    """Why `decode_pth_gluon` does not handle these tensors ("" when it does; the device is
    `launch.gluon_runs_on`'s to check)."""
    _, page, heads, row = cache.shape
    why = shape_refusal(query.shape[2], query.shape[1] // heads, page)
    if why:
        return why
    if cache.stride() != (page * heads * row, heads * row, row, 1):
        return f"it needs vLLM's contiguous NHD rows in {PAGE}-token pages"
    if cache.data_ptr() % 16:
        return "its copies need a 16-byte aligned cache"
    return ""


def smem_bytes(fmt: str, head_dim: int, block_n: int, n_stages: int, group: int = 8) -> int:
    """Shared memory of one program: the code and scale stages, int4's K8 tile, the fp16 V tile, P, the query,
    the mbarriers and 1 KB of the compiler's scratch."""
    nh = max(8, triton.next_power_of_2(group))
    db = pth_layout(fmt, head_dim).data_bytes
    k8 = block_n * head_dim if fmt == "int4_per_token_head" else 0
    stage = block_n * (2 * db + 8)
    return n_stages * stage + k8 + block_n * head_dim * 2 + nh * block_n * 2 + nh * head_dim + 2 * n_stages * 8 + 1024


def programs_per_sm(fmt: str, head_dim: int, block_n: int, n_stages: int, device: torch.device) -> int:
    """Programs resident per SM (256 threads x MAXNREG registers, and shared memory)."""
    return resident_programs(MAXNREG, smem_bytes(fmt, head_dim, block_n, n_stages), 8, device)


def decode_pth_gluon(query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     fmt: str, *, sm_scale: float, sliding_window: int | None, sinks: torch.Tensor | None,
                     two_level: bool, num_splits: int | None, out: torch.Tensor, fp8_query: bool = False,
                     tile: tuple[int, int] | None = None) -> torch.Tensor:
    """Run the kernel (and the merge when split) on validated inputs; the int4 query already rotated and
    `sm_scale` already divided by head_dim (`decode_attention_pth` does both). `tile`: (tokens per tile, stages),
    `tiling`'s by default. `fp8_query`: fp8 codes meet an e4m3 query in an fp8 MMA (as FA3's FP8 path does);
    otherwise an fp16 query in an fp16 MMA, the keys converted exactly. One wave of splits."""
    batch, num_q_heads, head_dim = query.shape
    _, page, heads, row = cache.shape
    mode = PTH_MODE[fmt]
    db = pth_layout(fmt, head_dim).data_bytes
    block_n, n_stages = tile or tiling(fmt, head_dim)
    if block_n not in (64, 128) or not 1 <= n_stages <= 8:
        raise ValueError(f"tile ({block_n}, {n_stages}): tokens per tile must be 64 or 128, stages 1-8")
    splits = num_splits or split_count(batch, heads, span(block_tables, PAGE, sliding_window, block_n), block_n,
                                       programs_per_sm(fmt, head_dim, block_n, n_stages, query.device), query.device,
                                       waves=())
    group = num_q_heads // heads
    is_split = splits > 1
    part_out, part_lse = split_partials(out, splits)
    _pth_gluon_kernel[(heads, splits, batch)](
        query, cache.view(_CODE_DTYPES[mode]), block_tables, seq_lens, sinks if sinks is not None else seq_lens, out,
        part_out, part_lse, float(sm_scale), int(sliding_window or 0), splits,
        query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        PTH=mode, NUM_KV=heads, GROUP=group, NH=max(8, triton.next_power_of_2(group)), HEAD_DIM=head_dim, DATA_BYTES=db,
        ROW_BYTES=row, TOK_STRIDE=heads * row, PAGE_STRIDE=page * heads * row, STAGES=n_stages,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None and not is_split, IS_SPLIT=is_split,
        TWO_LEVEL=two_level, BN=block_n,
        PW=PRODUCER_WARPS, KI=16 if mode == 1 and not fp8_query else 32, num_warps=4, maxnreg=MAXNREG,
    )
    if is_split:
        merge_splits(part_out, part_lse, sinks, out, splits)
    return out
