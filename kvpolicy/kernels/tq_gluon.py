"""Hopper TurboQuant decode in Gluon for FP8 keys (turboquant_k8v4) on planar pages: one warpgroup per program.

Why a kernel apart from the Triton one (`tq_decode.py`): that kernel is issue-bound, spending a quarter of
its instructions on byte shuffles that bring 2-byte-aligned slot bytes into `tl.dot`'s operand layout and a
quarter on the softmax of 16 padded MMA rows. This one, with explicit layouts:
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
- loads tile i+1 while tile i is computed, the block table two tiles ahead.
The centroid-key formats run `tq_warp.py`. Figures: bench/RESULTS.md; designs: bench/KERNELS.md.

Scope: turboquant_k8v4, head_dim 64 or 128, GQA groups up to 8, 16-token planar pages, sm_90;
`tq_decode.decode_attention_tq` routes planar caches here. Gluon does not run under the interpreter: tested
on the GPU only (tests/kernels/test_tq_gluon.py), against the float64 reference.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kvpolicy.kernels.formats import PAGE, planar_constexprs
from kvpolicy.kernels.launch import (
    merge_splits,
    resident_programs,
    span,
    split_count,
    split_partials,
    split_tiles,
    store_result,
)
from kvpolicy.kernels.turboquant import LAZY_MAX_MARGIN as _MARGIN
from kvpolicy.kernels.turboquant import SUBNORMAL_UNIT, render_ptx, v4_subnormal_program

HEAD_DIMS = (64, 128)
"""Head dims it takes."""
MAX_GROUP = 8
"""Largest GQA group: the N of the score MMA is 8."""
FORMATS = ("turboquant_k8v4",)
"""Formats it decodes: FP8 keys with 4-bit values."""

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
V32_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
"""The value tile's fp16 halves as 32-bit words (pairs of columns): the same bytes (rows of 128 or 256 bytes,
128-byte swizzle either way), written by whole words."""
ROW_S = gl.constexpr(gl.SliceLayout(1, S_LAYOUT.value))
LAZY_MAX_MARGIN = gl.constexpr(_MARGIN)
"""How far (log2 units) a score may pass the reference max before the tile is redone with the exact max."""
FLAGS_LAYOUT = gl.constexpr(gl.BlockedLayout([4], [32], [4], [0]))  # every thread holds the 4 warps' flags


@functools.cache
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
def _pages(bt_row, tile, seq_len, L: gl.constexpr, BN: gl.constexpr):
    """The block-table entry of each token of tile `tile` (rows of layout L); page 0 past the sequence (masked
    later; the table may hold anything there). Loaded two tiles ahead: every load of a tile's bytes waits for
    these."""
    t = tile * BN + gl.arange(0, BN, layout=L)
    return gl.load(bt_row + (t >> 4), mask=t < seq_len, other=0)  # t >= 0: shifts, not signed division


@gluon.jit
def _load_tile(cache32_ptr, cache16_ptr, page, tile, kvh, BN: gl.constexpr, SLOT: gl.constexpr,
               NUM_KV: gl.constexpr, KBM: gl.constexpr, KB: gl.constexpr, VBM: gl.constexpr, VB: gl.constexpr,
               NF: gl.constexpr, K_LAYOUT: gl.constexpr, V_LAYOUT: gl.constexpr):
    """The packed bytes of one tile from planar pages, each in the register layout its consumer wants: key
    words for the wgmma A operand (16-byte loads), value code words for the fp16 store, the fp16 fields in the
    score rows' layout. Words, not bytes: a byte tensor carried to the next iteration is split into single
    bytes. KBM, VBM: bytes per token of the key and value code plane; KB, VB: the same (`formats.planar_constexprs`).
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
            seq_len, start, HEAD_DIM: gl.constexpr, BN: gl.constexpr, KBM: gl.constexpr, EDGE: gl.constexpr):
    """One tile: keys unpacked in registers into the score wgmma, value codes to fp16 in shared memory,
    online softmax against a lazy reference max with the value scale folded into P, P.V. Returns the updated
    state. EDGE: the tile reaches outside [start, seq_len) (a second compiled copy keeps the masks off the
    common path)."""
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
    # P against the reference max m_i; each warp flags a score past it by the margin, and the flags are read
    # after the barrier P needs anyway. Rare (every program's first tile): redo with the exact max.
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
    return m_new, l_part, z_part, acc


@gluon.jit
def _tq_gluon_kernel(
    q_ptr, order_ptr, cache32_ptr, cache16_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr, out_ptr, part_out_ptr,
    part_lse_ptr, q_scale, window, num_splits,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    GROUP: gl.constexpr, NUM_KV: gl.constexpr, HEAD_DIM: gl.constexpr, SLOT: gl.constexpr, BN: gl.constexpr,
    KBM: gl.constexpr, KB: gl.constexpr, VBM: gl.constexpr, VB: gl.constexpr, NF: gl.constexpr,
    K_LAYOUT: gl.constexpr, V_LAYOUT: gl.constexpr,
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

    # Software pipeline: the bytes of tile i+1 load while tile i is computed, their block-table entries two
    # tiles ahead (every load of a tile's bytes waits for its entries).
    bt_row = block_tables_ptr + seq * stride_bt
    PL: gl.constexpr = gl.SliceLayout(1, K_LAYOUT)
    page = _pages(bt_row, tile_lo, seq_len, PL, BN)
    kc, vc, vscale, vzero = _load_tile(cache32_ptr, cache16_ptr, page, tile_lo, kvh, BN, SLOT, NUM_KV, KBM, KB, VBM,
                                       VB, NF, K_LAYOUT, V_LAYOUT)
    page = _pages(bt_row, tile_lo + 1, seq_len, PL, BN)
    for tile in range(tile_lo, tile_hi):
        nkc, nvc, nvscale, nvzero = _load_tile(cache32_ptr, cache16_ptr, page, tile + 1, kvh, BN, SLOT, NUM_KV, KBM,
                                               KB, VBM, VB, NF, K_LAYOUT, V_LAYOUT)
        page = _pages(bt_row, tile + 2, seq_len, PL, BN)
        tile_start = tile * BN
        if (tile_start < start) | (tile_start + BN > seq_len):
            m_i, l_part, z_part, acc = _attend(kc, vc, vscale, vzero, q_smem, v16_smem, p_smem, flag_smem, m_i, l_part,
                                               z_part, acc, tile_start, seq_len, start, HEAD_DIM, BN, KBM, True)
        else:
            m_i, l_part, z_part, acc = _attend(kc, vc, vscale, vzero, q_smem, v16_smem, p_smem, flag_smem, m_i, l_part,
                                               z_part, acc, tile_start, seq_len, start, HEAD_DIM, BN, KBM, False)
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
    store_result(acc, m_i, l_i, q_head, h_mask, offs_d, seq, split, num_splits, sinks_ptr, out_ptr, part_out_ptr,
                  part_lse_ptr, stride_ob, stride_oh, NUM_KV, GROUP, HEAD_DIM, HAS_SINKS, IS_SPLIT)


def block_n(head_dim: int) -> int:
    """Tokens per tile (the M of the score MMA): 128 at head_dim 128; 64 at head_dim 64, which leaves 4-5
    programs per SM."""
    return 128 if head_dim >= 128 else 64


REGISTERS = {(128, 128): 235, (128, 64): 152, (64, 64): 95, (64, 128): 161}
"""Registers per thread of the sm_90 compile by (head_dim, block_n): what the split count's wave size is
computed from."""


def smem_bytes(head_dim: int) -> int:
    """Shared memory of one program: the fp16 value-code tile, P, the query tile and 1 KB of the compiler's
    scratch (the cross-warp max)."""
    bn = block_n(head_dim)
    return bn * head_dim * 2 + 8 * bn * 2 + 8 * head_dim * 2 + 1024


def programs_per_sm(head_dim: int, device: torch.device) -> int:
    """Programs resident per SM: 2 at head_dim 128, 4-5 at head_dim 64 on an H200."""
    return resident_programs(REGISTERS[(head_dim, block_n(head_dim))], smem_bytes(head_dim), 4, device)


def default_splits(batch: int, num_kv_heads: int, span_tokens: int, head_dim: int, device: torch.device) -> int:
    """Splits per sequence over `span_tokens` (`launch.split_count`, one wave): a power of two unless that leaves
    more than 15% of the wave's slots empty (at 5 programs per SM a power of two fills 78%)."""
    return split_count(batch, num_kv_heads, span_tokens, block_n(head_dim), programs_per_sm(head_dim, device),
                       device, waves=(), pow2_fill=0.85)


def refusal(fmt: str, head_dim: int, group: int, page: int = PAGE) -> str:
    """Why this kernel does not take layers of this shape ("" when it does)."""
    if fmt not in FORMATS:
        return f"it decodes {' and '.join(FORMATS)} only"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim}: it takes {' or '.join(map(str, HEAD_DIMS))}"
    if group > MAX_GROUP:
        return f"GQA groups above {MAX_GROUP} query heads per KV head"
    if page != PAGE:
        return f"it reads {PAGE}-token pages, not {page}"
    return ""


@functools.cache
def _order_table(head_dim: int, device: str) -> torch.Tensor:
    """int32 [head_dim]: `operand_order`, the query's coordinate at each K index of the score MMA."""
    return operand_order(head_dim).to(torch.int32).to(device)


def decode(query: torch.Tensor, cache: torch.Tensor, fmt: str, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           *, q_scale: float, sliding_window: int | None, sinks: torch.Tensor | None, num_splits: int | None,
           out: torch.Tensor) -> torch.Tensor:
    """Run the kernel (and the merge when split) on a planar cache; `q_scale` is the softmax scale x log2(e).
    Inputs already validated by `tq_decode.decode_attention_tq`."""
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = cache.shape[1]
    bn = block_n(head_dim)
    splits = num_splits or default_splits(batch, num_kv_heads, span(block_tables, PAGE, sliding_window, bn),
                                          head_dim, query.device)
    cx = planar_constexprs(fmt, head_dim)
    part_out, part_lse = split_partials(out, splits)
    _tq_gluon_kernel[(num_kv_heads, splits, batch)](
        query, _order_table(head_dim, str(cache.device)), cache.view(torch.int32), cache.view(torch.int16),
        block_tables, seq_lens, sinks if sinks is not None else seq_lens, out, part_out, part_lse, float(q_scale),
        int(sliding_window or 0), splits, query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0),
        out.stride(1), GROUP=num_q_heads // num_kv_heads, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, BN=bn,
        **{k: cx[k] for k in ("SLOT", "KBM", "KB", "VBM", "VB", "NF")},
        K_LAYOUT=key_layout(bn, cx["KBM"]), V_LAYOUT=key_layout(bn, cx["VBM"]),
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None and splits == 1, IS_SPLIT=splits > 1,
        num_warps=4,
    )
    if splits > 1:
        merge_splits(part_out, part_lse, sinks, out, splits)
    return out
