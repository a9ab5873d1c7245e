"""Hopper FP8 paged decode in Gluon: TMA page copies and fp8 wgmma with tokens as M.

Why a second kernel: the Triton kernel (`decode_attention.py`) is bound by a per-tile dependency chain
that Triton does not let us reshape; Gluon exposes the pieces:
- a producer warp (`gl.warp_specialize`) copies each 16-token page of K and V with one TMA copy into a
  ring of stages (full/empty mbarrier per stage), running up to a ring ahead of the consumer, with the
  next tile's page ids loaded while the copies fly: the compute warps never compute an address or wait
  on the table;
- S^T = K.Q^T is an fp8 wgmma with the tile's tokens as M and the GQA group as N (8 or 16): K goes from
  shared memory to the tensor cores untouched; the query is quantised to e4m3 once per program (as vLLM's
  FA3 FP8 path does);
- V is converted e4m3 -> fp16 once per tile into shared memory, and O^T = V^T.P^T is an fp16 wgmma (an
  fp8 wgmma needs V K-major, i.e. transposed);
- the denominator is kept per position and summed after the loop.
Figures: bench/RESULTS.md; designs: bench/KERNELS.md.

Scope: FP8 (e4m3) caches with 16-token pages in vLLM's NHD layout or the HND layout, head_dim 64 or 128,
GQA groups up to 16, sm_90 only; `decode_attention.decode_attention` routes here with `fp8_query=True` and
`kernel="gluon"` or `"auto"`. Gluon does not run under the interpreter: tested on the GPU only
(tests/kernels/test_decode_gluon.py), against the same float64 reference.
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kvpolicy.kernels.formats import FP8_E4M3_MAX
from kvpolicy.kernels.formats import PAGE as FORMAT_PAGE
from kvpolicy.kernels.launch import LOG2E, merge_splits, resident_programs, span, split_count, split_partials, split_tiles

PAGE = FORMAT_PAGE
"""Page size this kernel handles (vLLM's default block size)."""
HEAD_DIMS = (64, 128)
"""Head dims it takes."""
MAX_GROUP = 16
"""Largest GQA group (query heads per KV head) it packs into one tile (N of the score MMA)."""
BLOCK_N = 128
"""Tokens per tile (8 pages per TMA batch): the M of the score MMA."""
MAXNREG = 128
"""Registers per thread at launch, over the program's 8 warps (the consumer warpgroup, and the producer warp
padded to a warpgroup); setmaxnreg then moves the producer's share to the consumer."""
_FP8_MAX = gl.constexpr(FP8_E4M3_MAX)


def stages(head_dim: int) -> int:
    """K/V tiles in flight per program (the ring of TMA stages): 2 at head_dim 128, where shared memory allows
    two programs per SM, 3 at head_dim 64."""
    return 3 if head_dim <= 64 else 2


@gluon.jit
def _page_ids(bt_row, first_page, seq_len, pred, PAGE: gl.constexpr):
    """Physical ids of 4 consecutive pages of a sequence (page 0 past its end or when not `pred`:
    copied, then masked)."""
    p0 = gl.load(bt_row + first_page, mask=pred & (first_page * PAGE < seq_len), other=0)
    p1 = gl.load(bt_row + first_page + 1, mask=pred & ((first_page + 1) * PAGE < seq_len), other=0)
    p2 = gl.load(bt_row + first_page + 2, mask=pred & ((first_page + 2) * PAGE < seq_len), other=0)
    p3 = gl.load(bt_row + first_page + 3, mask=pred & ((first_page + 3) * PAGE < seq_len), other=0)
    return p0, p1, p2, p3


@gluon.jit
def _issue_pages(k_desc, v_desc, kb, vb, bar, row, p0, p1, p2, p3, head_row, head_col,
                 PAGE_ROWS: gl.constexpr, PAGE: gl.constexpr):
    """TMA 4 pages of K and V into rows row..row+63 of a stage."""
    r0 = p0 * PAGE_ROWS + head_row
    r1 = p1 * PAGE_ROWS + head_row
    r2 = p2 * PAGE_ROWS + head_row
    r3 = p3 * PAGE_ROWS + head_row
    tma.async_copy_global_to_shared(k_desc, [r0, head_col], bar, kb.slice(row, PAGE))
    tma.async_copy_global_to_shared(k_desc, [r1, head_col], bar, kb.slice(row + PAGE, PAGE))
    tma.async_copy_global_to_shared(k_desc, [r2, head_col], bar, kb.slice(row + 2 * PAGE, PAGE))
    tma.async_copy_global_to_shared(k_desc, [r3, head_col], bar, kb.slice(row + 3 * PAGE, PAGE))
    tma.async_copy_global_to_shared(v_desc, [r0, head_col], bar, vb.slice(row, PAGE))
    tma.async_copy_global_to_shared(v_desc, [r1, head_col], bar, vb.slice(row + PAGE, PAGE))
    tma.async_copy_global_to_shared(v_desc, [r2, head_col], bar, vb.slice(row + 2 * PAGE, PAGE))
    tma.async_copy_global_to_shared(v_desc, [r3, head_col], bar, vb.slice(row + 3 * PAGE, PAGE))


@gluon.jit
def _producer(k_desc, v_desc, k_bufs, v_bufs, full, empty, bt_row, seq_len, tile_lo, n_tiles, head_row, head_col,
              PAGE_ROWS: gl.constexpr, STAGES: gl.constexpr, BN: gl.constexpr, HEAD_DIM: gl.constexpr):
    """One warp: each tile's page ids one tile ahead, then its TMA copies (one per 16-token page of K
    and of V) once the consumer has freed the tile's stage."""
    PG: gl.constexpr = 16
    PAGES: gl.constexpr = BN // PG
    gl.static_assert(PAGES == 8, "two TMA batches of 4 pages per tile")
    a0, a1, a2, a3 = _page_ids(bt_row, tile_lo * PAGES, seq_len, n_tiles > 0, PG)
    b0, b1, b2, b3 = _page_ids(bt_row, tile_lo * PAGES + 4, seq_len, n_tiles > 0, PG)
    for i in range(n_tiles):
        stage = i % STAGES
        # A fresh mbarrier passes a wait on the phase before its first: the first STAGES tiles go straight out.
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        bar = full.index(stage)
        mbarrier.expect(bar, 2 * BN * HEAD_DIM)
        kb = k_bufs.index(stage)
        vb = v_bufs.index(stage)
        _issue_pages(k_desc, v_desc, kb, vb, bar, 0, a0, a1, a2, a3, head_row, head_col, PAGE_ROWS, PG)
        _issue_pages(k_desc, v_desc, kb, vb, bar, 64, b0, b1, b2, b3, head_row, head_col, PAGE_ROWS, PG)
        nxt = (tile_lo + i + 1) * PAGES
        a0, a1, a2, a3 = _page_ids(bt_row, nxt, seq_len, i + 1 < n_tiles, PG)
        b0, b1, b2, b3 = _page_ids(bt_row, nxt + 4, seq_len, i + 1 < n_tiles, PG)


@gluon.jit
def _attend_tile(i, q_smem, k_bufs, v_bufs, v16_smem, p_smem, full, empty, qk_scale, seq_len, start, tile_lo,
                 m_i, l_part, acc, NH: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 TWO_LEVEL: gl.constexpr, EDGE: gl.constexpr, BN: gl.constexpr):
    """Tile i of the program's range: scores, online softmax, P.V; returns the updated (m_i, l_part, acc).
    EDGE: the tile reaches outside [start, seq_len) (the compiled copy for the few edge tiles keeps the
    masks out of the loop's common path)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 32])
    # 16 bytes per thread along head_dim when reading the e4m3 V tile for its conversion
    cvt_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (HEAD_DIM // 16), HEAD_DIM // 16], [4, 1], [1, 0])

    stage = i % STAGES
    tile_start = (tile_lo + i) * BN
    mbarrier.wait(full.index(stage), (i // STAGES) & 1)
    kb = k_bufs.index(stage)
    s = warpgroup_mma(kb, q_smem.permute((1, 0)), gl.zeros([BN, NH], gl.float32, layout=s_layout), use_acc=False,
                      is_async=True)
    # Every warp is past the previous tile's P.V (its wait): V16 may be rewritten. V's conversion
    # overlaps the score MMA.
    gl.thread_barrier()
    v16 = v_bufs.index(stage).load(cvt_layout).to(gl.float16)
    if EDGE:
        # Pages hold other data (or NaN) outside [start, seq_len), and a zero weight times NaN is NaN
        # in the MMA, so those rows of V are zeroed, not just weighted 0.
        pos_v = tile_start + gl.arange(0, BN, layout=gl.SliceLayout(1, cvt_layout))
        v16 = gl.where(((pos_v < seq_len) & (pos_v >= start))[:, None], v16, 0.0)
    v16_smem.store(v16)
    s, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s, kb, q_smem))

    s = s * qk_scale
    if EDGE:
        pos = tile_start + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
        s = gl.where(((pos < seq_len) & (pos >= start))[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 0))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - m_use[None, :])
    l_part = l_part * alpha[None, :] + p
    p_smem.store(gl.permute(p.to(gl.float16), (1, 0)))
    fence_async_shared()
    gl.thread_barrier()
    # K and V of this stage are consumed (K by the finished score MMA, V into V16): release it.
    mbarrier.arrive(empty.index(stage))

    return m_new, l_part, p_v(v16_smem, p_smem, acc, alpha, NH, HEAD_DIM, TWO_LEVEL)


@gluon.jit
def p_v(v16_smem, p_smem, acc, alpha, NH: gl.constexpr, HEAD_DIM: gl.constexpr, TWO_LEVEL: gl.constexpr):
    """acc [HEAD_DIM, NH] rescaled by alpha plus this tile's O^T = V^T.P^T (fp16 wgmma): summed in fp32 registers
    (two-level) or carried in the MMA's accumulator."""
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 16])
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, o_layout))
    if TWO_LEVEL:
        pv = warpgroup_mma(v16_smem.permute((1, 0)), p_smem.permute((1, 0)),
                           gl.zeros([HEAD_DIM, NH], gl.float32, layout=o_layout), use_acc=False, is_async=True)
        pv, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(pv, v16_smem, p_smem))
        acc = acc * alpha_o[None, :] + pv
    else:
        acc = warpgroup_mma(v16_smem.permute((1, 0)), p_smem.permute((1, 0)), acc * alpha_o[None, :], is_async=True)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v16_smem, p_smem))
    return acc


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, v16_smem, p_smem, full, empty, qk_scale, seq_len, start, tile_lo, n_tiles,
              NH: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, TWO_LEVEL: gl.constexpr,
              BN: gl.constexpr):
    """The default partition (one warpgroup): every tile of the program's range; returns the running
    max, the per-position denominators and O^T."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 16])
    m_i = gl.full([NH], float("-inf"), gl.float32, layout=gl.SliceLayout(0, s_layout))
    l_part = gl.zeros([BN, NH], gl.float32, layout=s_layout)
    acc = gl.zeros([HEAD_DIM, NH], gl.float32, layout=o_layout)
    for i in range(n_tiles):
        tile_start = (tile_lo + i) * BN
        if (tile_start < start) | (tile_start + BN > seq_len):
            m_i, l_part, acc = _attend_tile(i, q_smem, k_bufs, v_bufs, v16_smem, p_smem, full, empty, qk_scale,
                                            seq_len, start, tile_lo, m_i, l_part, acc, NH, HEAD_DIM, STAGES,
                                            TWO_LEVEL, True, BN)
        else:
            m_i, l_part, acc = _attend_tile(i, q_smem, k_bufs, v_bufs, v16_smem, p_smem, full, empty, qk_scale,
                                            seq_len, start, tile_lo, m_i, l_part, acc, NH, HEAD_DIM, STAGES,
                                            TWO_LEVEL, False, BN)
    return m_i, l_part, acc


@gluon.jit
def _decode_gluon_kernel(
    q_ptr, k_desc, v_desc, block_tables_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    sm_scale, window, num_splits,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
    GROUP: gl.constexpr,
    NH: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    PAGE_ROWS: gl.constexpr,
    HEAD_ROWS: gl.constexpr,
    HEAD_COLS: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_K_SCALE: gl.constexpr,
    HAS_V_SCALE: gl.constexpr,
    K_SCALE_STRIDE: gl.constexpr,
    V_SCALE_STRIDE: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    IS_SPLIT: gl.constexpr,
    TWO_LEVEL: gl.constexpr,
    BN: gl.constexpr,
):
    kv_head = gl.program_id(0)
    split = gl.program_id(1)
    seq = gl.program_id(2)
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 16])
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])

    kv_smem_layout: gl.constexpr = k_desc.layout
    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, HEAD_DIM], kv_smem_layout)
    v_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, HEAD_DIM], kv_smem_layout)
    v16_smem = gl.allocate_shared_memory(gl.float16, [BN, HEAD_DIM],
                                         gl.NVMMASharedLayout.get_default_for([BN, HEAD_DIM], gl.float16))
    p_smem = gl.allocate_shared_memory(gl.float16, [NH, BN], gl.NVMMASharedLayout.get_default_for([NH, BN], gl.float16))
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [NH, HEAD_DIM],
                                       gl.NVMMASharedLayout.get_default_for([NH, HEAD_DIM], gl.float8e4nv))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    seq_len, start, tile_lo, tile_hi = split_tiles(seq_lens_ptr, seq, window, split, num_splits, BN, HAS_WINDOW)
    n_tiles = gl.maximum(tile_hi - tile_lo, 0)

    # The GQA group's query, quantised to e4m3 with one scale per program.
    offs_qh = gl.arange(0, NH, layout=gl.SliceLayout(1, q_layout))
    offs_qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(q_ptr + seq * stride_qb + (kv_head * GROUP + offs_qh)[:, None] * stride_qh + offs_qd[None, :],
                mask=(offs_qh < GROUP)[:, None], other=0.0).to(gl.float32)
    q_scale = gl.maximum(gl.max(gl.max(gl.abs(q), 1), 0) / _FP8_MAX, 1e-30)
    q_smem.store((q / q_scale).to(gl.float8e4nv))
    qk_scale = sm_scale * LOG2E * q_scale
    if HAS_K_SCALE:
        qk_scale = qk_scale * gl.load(k_scale_ptr + kv_head * K_SCALE_STRIDE)
    fence_async_shared()
    gl.thread_barrier()

    bt_row = block_tables_ptr + seq * stride_bt
    m_i, l_part, acc = gl.warp_specialize(
        [(_consumer, (q_smem, k_bufs, v_bufs, v16_smem, p_smem, full, empty, qk_scale, seq_len, start, tile_lo,
                      n_tiles, NH, HEAD_DIM, STAGES, TWO_LEVEL, BN)),
         (_producer, (k_desc, v_desc, k_bufs, v_bufs, full, empty, bt_row, seq_len, tile_lo, n_tiles,
                      kv_head * HEAD_ROWS, kv_head * HEAD_COLS, PAGE_ROWS, STAGES, BN, HEAD_DIM))],
        [1], [40])

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(full.index(i))
        mbarrier.invalidate(empty.index(i))

    l_i = gl.convert_layout(gl.sum(l_part, 0), gl.SliceLayout(0, o_layout))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(0, o_layout))
    out_scale = 1.0
    if HAS_V_SCALE:
        out_scale = gl.load(v_scale_ptr + kv_head * V_SCALE_STRIDE)
    offs_h = gl.arange(0, NH, layout=gl.SliceLayout(0, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, o_layout))
    h_mask = offs_h < GROUP
    q_head = kv_head * GROUP + offs_h
    if IS_SPLIT:
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        lse = m_o + gl.log2(l_i)  # -inf for an empty split: the merge gives it weight 0
        gl.store(part_lse_ptr + seq * stride_pb + q_head * stride_ph + split * stride_ps, lse, mask=h_mask)
        part = part_out_ptr + seq * stride_pb * HEAD_DIM + split * stride_ps * HEAD_DIM
        o = acc * (out_scale / l_safe)[None, :]
        gl.store(part + (q_head * stride_ph * HEAD_DIM)[None, :] + offs_d[:, None], o, mask=h_mask[None, :])
    else:
        if HAS_SINKS:
            # The sink logit joins the denominator only.
            sink = gl.load(sinks_ptr + q_head, mask=h_mask, other=0.0) * LOG2E
            m_fin = gl.maximum(m_o, sink)
            corr = gl.exp2(m_o - m_fin)
            l_i = l_i * corr + gl.exp2(sink - m_fin)
            acc = acc * corr[None, :]
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        o = acc * (out_scale / l_safe)[None, :]
        gl.store(out_ptr + seq * stride_ob + (q_head * stride_oh)[None, :] + offs_d[:, None],
                 o.to(out_ptr.dtype.element_ty), mask=h_mask[None, :])


def _addressing(cache: torch.Tensor) -> tuple[int, int, int] | None:
    """(rows per page, rows per head, columns per head) that place a (page, head) box in the 2-D view of
    an FP8 paged cache; None when the cache is neither vLLM's contiguous NHD [blocks, 16, heads, D] nor
    the HND view of [blocks, heads, 16, D]."""
    _, page, heads, d = cache.shape
    if page != PAGE or d not in HEAD_DIMS or cache.dtype != torch.float8_e4m3fn or cache.data_ptr() % 16:
        return None
    if cache.stride() == (page * heads * d, heads * d, d, 1):  # NHD: a row is a token, a head is a column block
        return PAGE, 0, d
    if cache.stride() == (heads * page * d, d, page * d, 1):  # HND: a row is (block, head, token)
        return heads * PAGE, PAGE, 0
    return None


@functools.cache
def _page_layout(head_dim: int) -> gl.NVMMASharedLayout:
    """The shared-memory layout of one page of one head (built once: every call's descriptors take it)."""
    return gl.NVMMASharedLayout.get_default_for([PAGE, head_dim], gl.float8e4nv)


def cache_descriptor(cache: torch.Tensor) -> tuple[TensorDescriptor, int, int, int] | None:
    """A 2-D TMA descriptor over an FP8 paged cache with one page of one head per box, and the
    `_addressing` of a (page, head) in it; None where `_addressing` is."""
    where = _addressing(cache)
    if where is None:
        return None
    nb, page, heads, d = cache.shape
    rows, cols = (nb * page, heads * d) if where[2] else (nb * heads * page, d)
    layout = _page_layout(d)
    return (TensorDescriptor(cache, [rows, cols], [cols, 1], [PAGE, d], layout), *where)


def refusal(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> str:
    """Why `decode_gluon` does not handle these tensors ("" when it does; the caller may fall back to Triton, and
    the device is `launch.gluon_runs_on`'s to check)."""
    if query.shape[1] // key_cache.shape[2] > MAX_GROUP:
        return f"GQA groups above {MAX_GROUP} query heads per KV head"
    if key_cache.stride() != value_cache.stride() or _addressing(key_cache) is None:
        return f"it needs {PAGE}-token pages, head_dim {' or '.join(map(str, HEAD_DIMS))}, and a contiguous NHD cache or the HND view"
    return ""


def smem_bytes(head_dim: int, group: int = 8) -> int:
    """Shared memory of one program: the e4m3 K and V stages, the fp16 V tile, P, the query, the mbarriers and
    1 KB for the compiler's scratch (within 0.9 KB of the sm_90 compile's figure)."""
    nh = max(8, triton.next_power_of_2(group))
    n = stages(head_dim)
    return n * 2 * BLOCK_N * head_dim + BLOCK_N * head_dim * 2 + nh * BLOCK_N * 2 + nh * head_dim + 2 * n * 8 + 1024


def programs_per_sm(head_dim: int, device: torch.device) -> int:
    """Programs resident per SM (registers and shared memory): 2 on an H200 at both head dims. A program holds
    256 threads x MAXNREG registers: the producer's one warp is launched as a whole warpgroup (setmaxnreg works
    per warpgroup)."""
    return resident_programs(MAXNREG, smem_bytes(head_dim), 8, device)


def decode_gluon(query, key_cache, value_cache, block_tables, seq_lens, *, k_scale, v_scale, k_stride, v_stride,
                 sm_scale: float, sliding_window: int | None, sinks, two_level: bool, num_splits: int | None,
                 out: torch.Tensor) -> torch.Tensor:
    """Run the Gluon kernel (and the merge when split); inputs already validated by `decode_attention`. One wave
    of splits (`launch.split_count` without extra waves): more waves measured slower here."""
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    splits = num_splits or split_count(batch, num_kv_heads, span(block_tables, PAGE, sliding_window, BLOCK_N),
                                       BLOCK_N, programs_per_sm(head_dim, query.device), query.device, waves=())
    group = num_q_heads // num_kv_heads
    k_desc, page_rows, head_rows, head_cols = cache_descriptor(key_cache)
    v_desc, *_ = cache_descriptor(value_cache)
    is_split = splits > 1
    part_out, part_lse = split_partials(out, splits)
    dummy = seq_lens
    _decode_gluon_kernel[(num_kv_heads, splits, batch)](
        query, k_desc, v_desc, block_tables, seq_lens,
        k_scale if k_scale is not None else dummy, v_scale if v_scale is not None else dummy,
        sinks if sinks is not None else dummy, out, part_out, part_lse,
        float(sm_scale), int(sliding_window or 0), splits,
        query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        num_q_heads * splits, splits, 1,
        GROUP=group, NH=max(8, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE_ROWS=page_rows, HEAD_ROWS=head_rows, HEAD_COLS=head_cols, STAGES=stages(head_dim),
        HAS_K_SCALE=k_scale is not None, HAS_V_SCALE=v_scale is not None,
        K_SCALE_STRIDE=k_stride, V_SCALE_STRIDE=v_stride,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None and not is_split,
        IS_SPLIT=is_split, TWO_LEVEL=two_level, BN=BLOCK_N,
        num_warps=4, maxnreg=MAXNREG,
    )
    if is_split:
        merge_splits(part_out, part_lse, sinks, out, splits)
    return out
