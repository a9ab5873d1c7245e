"""Hopper TurboQuant decode with each warp independent: no barrier per tile. The default kernel for the formats
with centroid keys (`tq_gluon.default_config`), through `tq_gluon.decode_tq_gluon`.

Why (bench/NOTES_TQ.md, tenth session): the warpgroup kernel (`tq_gluon.py`) waits, on every tile, at two
warpgroup barriers and at the fence that lets its wgmma read P from shared memory; that fence also waits for
the next tile's loads, issued at the start of the tile. Here each of the 4 warps owns one, two or four whole
pages (`pages_per_warp`: 16-64 tokens) of every 64-, 128- or 256-token tile and runs its own online softmax:
- S_w = Q K_w^T with mma.sync (int8, m16n8k32): Q [16, D] is the A operand (rows 0-7 the query's hi bytes,
  8-15 its lo bytes, `tq_gluon`'s two-byte query), K_w^T the B operand straight from the unpacked key
  registers (the same thread-to-coordinate map as the wgmma A operand, so `int8_operand_order` holds for
  4- and 3-bit keys);
- P_w in the accumulator layout (head g in thread g, tokens 16 pg + {2c, 2c + 1, 8 + 2c, 9 + 2c}) *is* the
  B operand of O_w^T = V_w^T P_w^T (fp16, m16n8k16), and V_w^T is the A operand from registers: each thread
  loads its tokens' value bytes, already paired by the page (below), and turns them into fp16 subnormal
  pairs by shifts and masks (`v_word_program`, `v3_word_program`), so the values never go through shared
  memory;
- the warps' (max, sums, O^T) are merged once, at the end; with splits, the last split of each (sequence, KV
  head) merges the splits' partials itself (`TQGluonConfig.fused_merge`) instead of a merge kernel after it.
Two pages per warp (twelfth session) double each warp's loads in flight and the MMAs per softmax step: 10-16%
faster at 128k on both layers, though at head_dim 128 they take 201-208 registers (2 programs per SM); four
pages at head_dim 64 another 6-9% (253-255 registers). The pages of these formats hold each plane in this
kernel's thread order (`turboquant.warp_plane_order`, eighteenth session): each thread reads its key rows, its
value rows and its fields of a page as one 16-, 8- or 4-byte vector per plane (`block_layout`; 3bit_nc at
head_dim 64: 16 loads per 128-token tile instead of 38), and its value words arrive with two tokens' bytes
interleaved (no PRMT). The pages'
softmax sums can be added in-thread first (`TQGluonConfig.sum_pages`): together another 7% on the gpt-oss
layer's 4bit_nc (thirteenth session), and room for four pages of 3bit_nc (fourteenth). With
`TQGluonConfig.mma_sums` (sixteenth) the sums come from one more mma.sync per two pages instead (the
thread's own P words as A, ones and the zero points as B: `_sums_operands`) and P x value scale is one
f16x2 multiply per two tokens: 4bit_nc's loop 9% fewer instructions, 2.6% faster on the gpt-oss layer.
The price: O^T [D, 8] per warp (32 fp32 registers per thread at D 128 instead of 8). Its rescale is skipped
when none of the warp's heads moved its max: with the lazy max (`TQGluonConfig.lazy_max`, the reference max
moves only when a score passes it by `LAZY_MAX_MARGIN`) that is nearly every tile; Gluon has no per-warp
branch, so the skip is a vote and a branch inside one asm block (`rescale_ptx`).
Each program rotates its group's query in its prologue (`_rotated_query`, `TQGluonConfig.rotate_query`;
seventeenth session) instead of a kernel of its own running before it: one launch less per decode step.
Nineteenth session: where the cache is under 8 GiB the page offsets are int32 (`OFF32`), so each load's
address is one IMAD.WIDE onto a per-thread pointer fixed for the loop; 3-bit keys have an integer int8 table
(`turboquant.int8_offset`), so their scores need no `+ qc`; qf multiplies in the exponent's FFMA (3bit_nc at
head_dim 64: 574 -> 504 instructions per tile, 152.3 -> 148.7 us on the gpt-oss layer at batch 8, 128k).

Scope: turboquant_4bit_nc, turboquant_k3v4_nc and turboquant_3bit_nc (`FORMATS`), head_dim 64 or 128, GQA
groups up to 8, 16-token planar pages, sm_90 (mma.sync runs on sm_80+, the callers route sm_90 only).
Inputs as `tq_gluon.decode_tq_gluon`.
Tested on the GPU against the float64 reference (tests/kernels/test_tq_gluon.py); the value operand's index
algebra also on the CPU (tests/kernels/test_tq_warp.py).
"""

from __future__ import annotations

import functools

import torch
import triton
from kvpolicy.kernels.decode_attention import sm_count
from kvpolicy.kernels.decode_gluon import split_tiles
from kvpolicy.kernels.tq_gluon import (
    _K3_I8_ASM,
    _K4_I8_ASM,
    LAZY_MAX_MARGIN,
    MAX_FUSED_SPLITS,
    Q_LO,
    Q_LO_INT,
    _kernel_table,
    _merge_if_last,
    _stamp,
    _stamp_scalar,
    _stamp_sm,
    _store_result,
    _word_bytes,
    arrival_counters,
    kernel_constexprs,
    query_order,
)
from kvpolicy.kernels.turboquant import (
    SELECT,
    SUBNORMAL_UNIT,
    WARP_ORDER_FORMATS,
    render_ptx,
    rotation_t_signs,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))
QA = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=4))
KB8 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=4))
VA = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
PB = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))
_UNSUB = gl.constexpr(1.0 / SUBNORMAL_UNIT)
PAGE = 16
"""Tokens per page: each warp owns `pages_per_warp(block_n)` whole pages of every tile."""


def pages_per_warp(block_n: int) -> int:
    """Pages each of the 4 warps takes per tile: 1, 2 or 4 for 64-, 128- or 256-token tiles (more independent
    loads and MMAs per online-softmax step, more registers)."""
    if block_n not in (64, 128, 256):
        raise ValueError(f"the per-warp kernel takes 64-, 128- or 256-token tiles, not {block_n}")
    return block_n // (4 * PAGE)


def score_layout(ppw: int) -> gl.DistributedLinearLayout:
    """Scores and P [warp, head, token of the warp's 16 ppw]: head g in lane group g, tokens 16 pg + {2c, 2c + 1,
    8 + 2c, 9 + 2c} in thread c of it (the mma.sync accumulator's rows g (hi) and 8 + g (lo) combined)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 8]] + [[0, 0, 16 << k] for k in range(ppw.bit_length() - 1)],
        lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 8, PAGE * ppw])


SUM_LAYOUT = gl.constexpr(score_layout(1))
"""The softmax sums' layout with `TQGluonConfig.sum_pages`: one page's scores (the tile's pages added in-thread)."""


def field_layout(ppw: int) -> gl.DistributedLinearLayout:
    """The fp16 fields [warp, page, token] (`score_layout`'s token axis split as [page, row], heads dropped)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 8]] + [[0, 1 << k, 0] for k in range(ppw.bit_length() - 1)],
        lane_bases=[[0, 0, 2], [0, 0, 4], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, ppw, PAGE])


def pair_layout(ppw: int) -> gl.DistributedLinearLayout:
    """`score_layout` with each two tokens 2k, 2k + 1 (one register pair there) as one word [warp, head, word]."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 4]] + [[0, 0, 8 << k] for k in range(ppw.bit_length() - 1)],
        lane_bases=[[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 8, PAGE * ppw // 2])


def sums_b_layout(ppw: int) -> gl.DistributedLinearLayout:
    """The words of the sums MMA's B operand [warp, page pair, page bit, word c, column] (`_sums_operands`):
    thread (g, c) holds column g of tokens 2c, 2c + 1 of each page, the mma.sync B operand's register order
    (k + 8: the page bit, k + 16: the page pair)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1, 0, 0]] + [[0, 1 << k, 0, 0, 0] for k in range((ppw // 2).bit_length() - 1)],
        lane_bases=[[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 4]],
        warp_bases=[[1, 0, 0, 0, 0], [2, 0, 0, 0, 0]], block_bases=[], shape=[4, ppw // 2, 2, 4, 8])


_PACK_ASM = gl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;")
"""Two fp32 -> one word of fp16 (the first in the low half)."""
_HMUL2_ASM = gl.constexpr("mul.rn.f16x2 $0, $1, $2;")
_SUMS_B_ASM = gl.constexpr("{\n.reg .b32 t;\nlop3.b32 t, $1, $3, $5, 0xEA;\nlop3.b32 $0, $2, $4, t, 0xEA;\n}")
"""(lo & $3) | (hi & $4) | $5: a B word of the sums MMA from the two zero-point words and the thread's masks."""


def v_word_program() -> list:
    """A value word $4 of two tokens as the page holds it (`turboquant.warp_plane_order`: byte pair q of token
    a, then the same pair of token b; byte j holds dims j (low nibble) and D/2 + j (high)) -> 4 words of fp16
    subnormal pairs (token a low half, token b high half), 16^u x code x 2^-24: output 2 tt + u is nibble u of
    byte tt of the pair. A shift and 4 ANDs (the page's order saves the PRMT that paired rows loaded apart)."""
    prog = [("shr", "s", "$4", 8)]
    for tt, src in ((0, "$4"), (1, "s")):
        for u, mask in ((0, 0x000F000F), (1, 0x00F000F0)):
            prog.append(("and", f"${tt * 2 + u}", src, mask))
    return prog


_V_WORD_ASM = gl.constexpr(render_ptx(v_word_program()))


def v3_word_program() -> list:
    """3-bit values of two tokens: $8 = a 2-bit plane word as the page holds it (byte pair q of token a, then
    of token b; byte i, bits 2s and 2s + 1: the low bits of quarter s), $9 = the 1-bit plane word of the same
    codes as loaded (bit 2s + e of byte i is the high bit of the same code, e = g // 4: threads g and g + 4
    share the word), $10 = 2 - e, $11 = 6 + e (the shifts that take those bits to 2s + 2) -> 8 words of fp16
    subnormal pairs (token a low half, token b high half), 4^s x code x 2^-24: output 4 tt + s is quarter s of
    byte tt of the pair. Three shifts put each quarter's high bit at 2s + 2, just above its low bits; then per
    byte two selects, each the low bits of two quarters that do not touch (0 and 2, or 1 and 3) with the high
    bits around them, and one mask per output (three ops per two outputs: one select per output, as
    `turboquant.v3_subnormal_program`, took four)."""
    low02 = 0x33333333  # bits 2s, 2s + 1 of quarters 0 and 2 of every byte
    prog = [("shr", "p1", "$8", 8),
            ("shl", "h0", "$9", "$10"),  # byte 0's high bits from 2s (+ the thread's parity) to 2s + 2
            ("shr", "h1", "$9", "$11")]  # byte 1's: bit 8 + 2s to 2s + 2 (a left shift would lose bit 30)
    for tt, (lo, hi) in ((0, ("$8", "h0")), (1, ("p1", "h1"))):
        prog += [("lop3", "y02", lo, hi, low02, SELECT),  # quarters 0, 2: bits 0-2 and 4-6
                 ("lop3", "y13", hi, lo, low02, SELECT)]  # quarters 1, 3: bits 2-4 and 6-8
        for s_ in range(4):
            prog.append(("and", f"${tt * 4 + s_}", "y13" if s_ % 2 else "y02", (0x7 << (2 * s_)) * 0x00010001))
    return prog


_V3_WORD_ASM = gl.constexpr(render_ptx(v3_word_program()))


def rescale_ptx(n: int) -> str:
    """PTX for n accumulator elements $n.. times their factors $2n..: skipped, by a warp-uniform branch, when
    every factor in the warp is 1. `$2n` and `$2n + 1` are the thread's two heads (columns 2c, 2c + 1: the
    mma.sync accumulator's first two registers), so the vote covers the warp's 8 heads. Gluon has no per-warp
    `if`; a branch inside one asm block is one (labels are local to the braces)."""
    one = "0f3F800000"
    lines = ["{", ".reg .pred p;", f"setp.neu.f32 p, ${2 * n}, {one};", f"setp.neu.or.f32 p, ${2 * n + 1}, {one}, p;",
             "vote.sync.any.pred p, p, 0xffffffff;"]
    lines += [f"mov.b32 ${i}, ${n + i};" for i in range(n)]
    lines += ["@!p bra.uni SKIP;"] + [f"mul.f32 ${i}, ${n + i}, ${2 * n + i};" for i in range(n)]
    return "\n".join(lines + ["SKIP:", "}"])


_RESCALE_ASM_128 = gl.constexpr(rescale_ptx(32))
_RESCALE_ASM_64 = gl.constexpr(rescale_ptx(16))
_RESCALE_CONSTRAINTS_128 = gl.constexpr(",".join(["=f"] * 32 + ["f"] * 64))
_RESCALE_CONSTRAINTS_64 = gl.constexpr(",".join(["=f"] * 16 + ["f"] * 32))


def block_layout(ppw: int, words: int) -> gl.DistributedLinearLayout:
    """A plane's words as each thread loads them [warp, page, g, c, words]: thread 4 g + c of warp w its block
    of `words` contiguous words (`turboquant.warp_plane_order`: the block of lane group g (keys: rows g and
    g + 8; values: byte group g) and thread c) of each of its warp's pages, one 16-, 8- or 4-byte vector."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1 << k] for k in range(words.bit_length() - 1)]
        + [[0, 1 << k, 0, 0, 0] for k in range(ppw.bit_length() - 1)],
        lane_bases=[[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 0, 4, 0, 0]],
        warp_bases=[[1, 0, 0, 0, 0], [2, 0, 0, 0, 0]], block_bases=[], shape=[4, ppw, 8, 4, words])


def field_block_layout(ppw: int) -> gl.DistributedLinearLayout:
    """An fp16 field plane's words [warp, page, c, r8] (`TQGluonConfig.mma_sums`): thread c of each lane group
    the words of tokens 2c, 2c + 1 and 8 + 2c, 9 + 2c, together in the page (`turboquant.warp_plane_order`)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1]] + [[0, 1 << k, 0, 0] for k in range(ppw.bit_length() - 1)],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
        warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[4, ppw, 4, 2])


@gluon.constexpr_function
def sliced(layout, keep, rank):
    """`layout` with every axis but those in `keep` sliced away (for aranges and broadcasts along them)."""
    for d in reversed(range(rank)):
        if d not in keep:
            layout = gl.SliceLayout(d, layout)
    return layout


def value_axes(head_dim: int, value_bits: int, ppw: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, order) that relabel the value program's joined outputs [token pairs, words, (program axes)] as
    V_w^T's [warp, row, column] axes (`_values_operand`, `_values_operand3`; replayed by test_tq_warp.py).
    Pair axes (w, pg, r8, c): tokens 16 pg + 8 r8 + 2 c + hh of warp w; column = 16 pg + 8 r8 + 2 c + hh."""
    if value_bits == 4:  # (w, pg, r8, c, g, e, hh, u, tt, q) -> (w, e, q, tt, u, g, pg, r8, c, hh)
        return (4, ppw, 2, 4, 8, head_dim // 64, 2, 2, 2, 2), (0, 5, 9, 8, 7, 4, 1, 2, 3, 6)
    if head_dim == 128:  # (w, pg, r8, c, g, hh, s0, s1, tt, q) -> (w, s1, s0, q, tt, g, pg, r8, c, hh)
        return (4, ppw, 2, 4, 8, 2, 2, 2, 2, 2), (0, 7, 6, 9, 8, 4, 1, 2, 3, 5)
    # (w, pg, r8, c, g, hh, s0, s1, tt) -> (w, s1, s0, tt, g, pg, r8, c, hh)
    return (4, ppw, 2, 4, 8, 2, 2, 2, 2), (0, 7, 6, 8, 4, 1, 2, 3, 5)


def layouts(key_bytes: int, head_dim: int, value_bits: int, block_n: int = 64, sum_pages: bool = False,
            mma_sums: bool = False) -> dict:
    """The kernel's tile constexprs: BN (the kernel derives the pages per warp from it), the score, field and
    load layouts (3-bit values are 8 words per token, one per thread g, at any head_dim: `_load_w`), the value
    operand's relabelling, and SUM_PAGES: `TQGluonConfig.sum_pages` where there is more than one page per warp
    (the softmax sums then take `SUM_LAYOUT`, else the score layout)."""
    ppw = pages_per_warp(block_n)
    v_shape, v_order = value_axes(head_dim, value_bits, ppw)
    return dict(BN=block_n, XL=score_layout(ppw), FL=field_layout(ppw), K_LAYOUT=block_layout(ppw, key_bytes // 8),
                V_LAYOUT=block_layout(ppw, head_dim // (16 if value_bits == 4 else 32)), V_SHAPE=v_shape,
                V_ORDER=v_order, SUM_PAGES=sum_pages and ppw > 1 and not mma_sums, MMA_SUMS=mma_sums,
                FW=field_block_layout(ppw),
                XP=pair_layout(ppw), SB=sums_b_layout(ppw) if ppw > 1 else None)


def dim_of_row(head_dim: int, value_bits: int = 4) -> torch.Tensor:
    """The head dim at each row of O^T: row 16 t + 8 u + g holds, for 4-bit values, dim u D/2 + g D/16 + t
    (thread g's bytes [g D/16, (g + 1) D/16), low nibbles then high); for 3-bit values, with t = s Q + q
    (Q = D/64), dim s D/4 + g D/32 + 2 q + u: quarter s of byte 2 q + u of thread g's D/32 bytes of the
    2-bit plane."""
    m = torch.arange(head_dim)
    t, u, g = m // 16, (m // 8) % 2, m % 8
    if value_bits == 3:
        q = head_dim // 64
        return (t // q) * (head_dim // 4) + g * (head_dim // 32) + 2 * (t % q) + u
    return u * (head_dim // 2) + g * (head_dim // 16) + t


def value_unit(head_dim: int, value_bits: int = 4) -> torch.Tensor:
    """What a code of each row of O^T was multiplied by to be an fp16 subnormal: 16^u (4-bit) or 4^s (3-bit)
    x 2^-24; the epilogue divides it out."""
    m = torch.arange(head_dim)
    if value_bits == 3:
        return 4.0 ** ((m // 16) // (head_dim // 64)) * SUBNORMAL_UNIT
    return 16.0 ** ((m // 8) % 2) * SUBNORMAL_UNIT


@gluon.jit
def _keys_operand(kc, ks, table, BN: gl.constexpr, KBM: gl.constexpr, HEAD_DIM: gl.constexpr,
                  KEY_BITS: gl.constexpr):
    """Key code words [BN, KBM/4] (`_key_words`; 3-bit keys: the 2-bit plane's words, and in `ks` the
    matching 1-bit words) -> the int8 B operand K_w^T [4, D, BN/4]: output g of word m of thread c at
    K = 16 (m G + g) + 4 c + i (`turboquant.int8_operand_order`, G = 2 or 4 outputs per code byte)."""
    W: gl.constexpr = KBM // 4
    if KEY_BITS == 4:
        o0, o1 = gl.inline_asm_elementwise(_K4_I8_ASM, "=r,=r,r,r", [_word_bytes(kc, BN, W), table],
                                           dtype=(gl.int8, gl.int8), is_pure=True, pack=4)
        t = gl.join(o0, o1)
        G: gl.constexpr = 2
    else:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(_K3_I8_ASM, "=r,=r,=r,=r,r,r,r",
                                                   [_word_bytes(kc, BN, W), _word_bytes(ks, BN, W), table],
                                                   dtype=(gl.int8,) * 4, is_pure=True, pack=4)
        t = gl.reshape(gl.join(gl.join(o0, o2), gl.join(o1, o3)), [BN, KBM, 4])
        G: gl.constexpr = 4
    M: gl.constexpr = KBM // 16
    y = gl.permute(gl.reshape(t, [BN, 4, M, 4, G]), (0, 2, 4, 1, 3))
    return gl.convert_layout(gl.permute(gl.reshape(y, [4, BN // 4, HEAD_DIM]), (0, 2, 1)), KB8)


@gluon.jit
def _halves(w):
    """int32 words -> [..., 2] fp16: low half, high half."""
    lo = (w & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True)
    hi = (w >> 16).to(gl.int16).to(gl.float16, bitcast=True)
    return gl.join(lo, hi)


@gluon.jit
def _values_operand(vc, BN: gl.constexpr, HEAD_DIM: gl.constexpr, V_SHAPE: gl.constexpr, V_ORDER: gl.constexpr):
    """Value words [BN/2, 8, D/32] (`_load_w`: token pair, thread g, byte pair) -> the fp16 A operand V_w^T
    [4, D, BN/4] of exact subnormals (16^u x code x 2^-24), row 16 t + 8 u + g = dim `dim_of_row`, column = the
    warp's token 16 pg + 8 r8 + 2 c + hh (`value_axes`)."""
    vc = gl.reshape(vc, [BN // 2, HEAD_DIM // 8, 2])  # thread g's word e = byte pairs 2e, 2e + 1
    o = gl.inline_asm_elementwise(_V_WORD_ASM, "=r,=r,=r,=r,r", [vc], dtype=(gl.int32,) * 4, is_pure=True, pack=1)
    # output 2 tt + u; its halves (token a, token b) as the innermost axis hh. `join` adds its axis last, so
    # the nesting gives the axes (q, hh, u, tt) after the pair and word axes; the byte pair q goes last.
    y = gl.join(gl.join(_halves(o[0]), _halves(o[1])), gl.join(_halves(o[2]), _halves(o[3])))
    y = gl.permute(gl.reshape(gl.permute(y, (0, 1, 3, 4, 5, 2)), V_SHAPE.value), V_ORDER.value)
    return gl.convert_layout(gl.reshape(y, [4, HEAD_DIM, BN // 4]), VA)


@gluon.jit
def _values_operand3(v2, v1, BN: gl.constexpr, HEAD_DIM: gl.constexpr, V_SHAPE: gl.constexpr,
                     V_ORDER: gl.constexpr):
    """3-bit value words [BN/2, 8, D/64] (`_load_w`: token pair, thread g, byte pair; the 2-bit plane's and the
    1-bit plane's as loaded) -> the fp16 A operand V_w^T [4, D, BN/4] of exact subnormals (4^s x code x 2^-24),
    row 16 t + 8 u + g = dim `dim_of_row(D, 3)`, column = the warp's token 16 pg + 8 r8 + 2 c + hh (`value_axes`)."""
    # thread g's parity e = g // 4 in the shifts of the program instead of a shift of each loaded word
    e = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, v1.type.layout)))[None, :, None] // 4
    zero = gl.zeros_like(v1)
    o = gl.inline_asm_elementwise(_V3_WORD_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [v2, v1, zero + (2 - e), zero + (6 + e)],
                                  dtype=(gl.int32,) * 8, is_pure=True, pack=1)
    # output 4 tt + s: the nested joins give the axes (q, hh, s0, s1, tt) after the pair and g axes; q goes last
    y = gl.join(gl.join(gl.join(_halves(o[0]), _halves(o[1])), gl.join(_halves(o[2]), _halves(o[3]))),
                gl.join(gl.join(_halves(o[4]), _halves(o[5])), gl.join(_halves(o[6]), _halves(o[7]))))
    y = gl.permute(gl.reshape(gl.permute(y, (0, 1, 3, 4, 5, 6, 2)), V_SHAPE.value), V_ORDER.value)
    return gl.convert_layout(gl.reshape(y, [4, HEAD_DIM, BN // 4]), VA)


@gluon.jit
def _pages_w(bt_row, tile, seq_len, PPW: gl.constexpr, FL: gl.constexpr):
    """Warp w's pages of tile `tile` [4, PPW]: entries PPW (tile 4 + w) + pg of the block table (page 0 past the
    sequence, masked later). Loaded ahead: every load of a tile's bytes waits for them."""
    pl: gl.constexpr = gl.SliceLayout(2, FL)
    e = ((tile * 4 + gl.arange(0, 4, layout=gl.SliceLayout(1, pl))) * PPW)[:, None] \
        + gl.arange(0, PPW, layout=gl.SliceLayout(0, pl))[None, :]
    return gl.load(bt_row + e, mask=e * 16 < seq_len, other=0)


@gluon.jit
def _block_axes(base, L: gl.constexpr):
    """The page bases [4, PPW] and the lane group, thread and word indices of `block_layout` L, each broadcast to
    its rank-5 shape: a block's words are at base + (its block index) x L.shape[4] + word."""
    b = gl.convert_layout(base, sliced(L, (0, 1), 5))[:, :, None, None, None]
    i = gl.arange(0, 8, layout=sliced(L, (2,), 5))[None, None, :, None, None]
    c = gl.arange(0, 4, layout=sliced(L, (3,), 5))[None, None, None, :, None]
    v = gl.arange(0, L.shape[4], layout=sliced(L, (4,), 5))[None, None, None, None, :]
    return b, i, c, v


@gluon.jit
def _key_words(x, BN: gl.constexpr, CW: gl.constexpr):
    """A key plane's blocks [4, PPW, r, c, 2 CW] -> words [BN, 4 CW] (token 16 (PPW w + pg) + 8 r8 + r, word
    CW c + k), the order `_keys_operand` reads."""
    y = gl.permute(gl.reshape(x, [4, BN // 64, 8, 4, 2, CW]), (0, 1, 4, 2, 3, 5))
    return gl.reshape(y, [BN, 4 * CW])


@gluon.jit
def _value_words(x, BN: gl.constexpr):
    """A value plane's blocks [4, PPW, g, c, NV] (NV = 2 Q words: r8, then byte pair q) -> [BN/2, 8, Q] (token
    pair 8 (PPW w + pg) + 4 r8 + c, thread group g, byte pair), the order `_values_operand` reads."""
    NV: gl.constexpr = x.shape[4]
    y = gl.permute(gl.reshape(x, [4, BN // 64, 8, 4, 2, NV // 2]), (0, 1, 4, 3, 2, 5))
    return gl.reshape(y, [BN // 2, 8, NV // 2])


@gluon.jit
def _field_words(x, BN: gl.constexpr):
    """A field plane's blocks [4, PPW, c, r8] -> words [4, BN/8] (word 8 pg + 4 r8 + c of warp w)."""
    return gl.reshape(gl.permute(x, (0, 1, 3, 2)), [4, BN // 8])


@gluon.jit
def _load_w(cache32_ptr, cache16_ptr, pw, kvh, NUM_KV: gl.constexpr, HEAD_DIM: gl.constexpr, SLOT: gl.constexpr,
            KEY_BITS: gl.constexpr, V_BITS: gl.constexpr, KBM: gl.constexpr, KB: gl.constexpr, VBM: gl.constexpr,
            VB: gl.constexpr, NF: gl.constexpr, BN: gl.constexpr, PPW: gl.constexpr, XL: gl.constexpr,
            FL: gl.constexpr, K_LAYOUT: gl.constexpr, V_LAYOUT: gl.constexpr, MMA_SUMS: gl.constexpr,
            FW: gl.constexpr, XP: gl.constexpr, OFF32: gl.constexpr):
    """A tile's bytes, each warp its pages `pw` (`_pages_w`): key code words [BN, KBM/4] (3-bit keys also the
    matching 1-bit words: word w mod D/32 of the row shifted right by w // (D/32), else 0), value words
    [BN/2, 8, Q] of two tokens each (`_value_words`; 3-bit values also the 1-bit words as loaded, else 0), the
    fp16 fields [4, BN/4] in fp32 in the score columns' layout (MMA_SUMS: the words of two tokens [4, BN/8] as loaded, in `pair_layout`'s
    columns: carried through the loop as words, they need no repacking for the f16x2 instructions)."""
    # Each page's first 32-bit word [4, PPW]. OFF32 (caches under 8 GiB): in int32, so that each load's address is
    # one IMAD.WIDE from a per-thread pointer fixed for the whole loop, instead of a 64-bit add per page and lane.
    # Hence the loads below add it last: (cache + the thread's offset in a page) + page word, the first sum
    # loop-invariant.
    if OFF32:
        base = (pw * NUM_KV + kvh) * (4 * SLOT)
    else:
        base = (pw.to(gl.int64) * NUM_KV + kvh) * (4 * SLOT)
    # Each plane holds every thread's words of a page as one block (`turboquant.warp_plane_order`): one vector
    # load per thread, page and plane, reshaped here to the words' old [token, word] order.
    # keys: thread (r, c)'s quarter c of rows r and r + 8, CW words each, at its lane's block (as the values')
    CW: gl.constexpr = KBM // 16
    kb, kr, kq, kv = _block_axes(base, K_LAYOUT)
    kc = _key_words(gl.load((cache32_ptr + ((kr * 4 + kq) * (2 * CW) + kv)) + kb), BN, CW)
    ks = 0
    if KEY_BITS == 3:
        # the 1-bit plane: block c mod 2 of rows r and r + 8 (the same CW words per row), shifted by c // 2 so
        # that bit 2s of each byte is the sign of quarter s of the matching 2-bit byte (`k3_int8_program`'s $5)
        ks = gl.load((cache32_ptr + (4 * KBM + ((kq % 2) * 8 + kr) * (2 * CW) + kv)) + kb) >> (kq // 2)
        ks = _key_words(ks, BN, CW)
    # values: thread (g, c)'s bytes of rows 2c, 2c + 1, 8 + 2c, 9 + 2c, as words of a byte pair of two tokens
    NV: gl.constexpr = V_LAYOUT.shape[4]
    vb, vg, vq, vv = _block_axes(base, V_LAYOUT)
    vc = _value_words(gl.load((cache32_ptr + (4 * KB + (vg * 4 + vq) * NV + vv)) + vb), BN)
    vh = 0
    if V_BITS == 3:
        # the 1-bit plane: threads g and g + 4 share the block of g mod 4 (`v3_word_program` shifts by g // 4)
        vh = _value_words(gl.load((cache32_ptr + (4 * KB + 4 * VBM + ((vg % 4) * 4 + vq) * NV + vv)) + vb), BN)

    # fields of the tokens in the score's columns (planes of 16 halves per page)
    if MMA_SUMS:
        # thread c: the words of tokens 2c, 2c + 1 and 8 + 2c, 9 + 2c, together
        wb = gl.convert_layout(base, sliced(FW, (0, 1), 4))[:, :, None, None]
        fq = gl.arange(0, 4, layout=sliced(FW, (2,), 4))[None, None, :, None]
        fr = gl.arange(0, 2, layout=sliced(FW, (3,), 4))[None, None, None, :]
        fw = (cache32_ptr + (4 * (KB + VB) + fq * 2 + fr)) + wb
        wl: gl.constexpr = gl.SliceLayout(1, XP)
        knorm = gl.convert_layout(_field_words(gl.load(fw), BN), wl)
        vscale = gl.convert_layout(_field_words(gl.load(fw + 8 * (NF - 2)), BN), wl)
        vzero = gl.convert_layout(_field_words(gl.load(fw + 8 * (NF - 1)), BN), wl)
    else:
        tk = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, FL)))
        at = ((tk % 8) // 2 * 2 + tk // 8) * 2 + tk % 2  # token tk's half in the plane
        f = cache16_ptr + (2 * base + 8 * (KB + VB))[:, :, None] + at[None, None, :]
        knorm = _field(f, BN, XL)
        vscale = _field(f + 16 * (NF - 2), BN, XL)
        vzero = _field(f + 16 * (NF - 1), BN, XL)
    return kc, ks, vc, vh, knorm, vscale, vzero


@gluon.jit
def _field(f, BN: gl.constexpr, XL: gl.constexpr):
    """One fp16 field of the warps' pages (pointers [4, PPW, 16]) -> fp32 [4, BN/4] in the score columns' layout."""
    x = gl.convert_layout(gl.reshape(gl.load(f), [4, BN // 4]), gl.SliceLayout(1, XL))
    return x.to(gl.float16, bitcast=True).to(gl.float32)


@gluon.jit
def _sums_operands(pw, zw, BN: gl.constexpr, SB: gl.constexpr):
    """`TQGluonConfig.mma_sums`: the mma.sync operands of C = A B whose column 0 is each head's softmax sum and
    columns 1 and 2 its sums of P x zero point (tokens 0-7 and 8-15 of each page). A [4, 16, BN/8]: row
    8 h8 + h, column 8 pg + j = P of head h at token 16 pg + 8 h8 + j (each thread's own P words `pw`, rows
    8-15 the second half of each page, so no row is zero); B [4, BN/8, 8]: column 0 all 1, column 1 (2) the
    zero point of the token of row k in rows 0-7 (8-15), the rest 0, each word one pair of `lop3` from the
    zero-point words `zw` [4, BN/8] as loaded. (K = BN/8: each page's two halves are two rows.)"""
    PP: gl.constexpr = BN // 128  # page pairs per warp
    # P words [4, 8, BN/8] -> [w, h, pp, pb, h8, c] -> A [w, 8 h8 + h, 16 pp + 8 pb + 2 c + j1]
    p6 = gl.reshape(pw, [4, 8, PP, 2, 2, 4])
    a = gl.reshape(_halves(gl.permute(p6, (0, 4, 1, 2, 3, 5))), [4, 16, BN // 8])
    # zero-point words [4, BN/8] -> [w, pp, pb, c, h8] -> the low and high halves of each page
    z5 = gl.permute(gl.reshape(zw, [4, PP, 2, 2, 4]), (0, 1, 2, 4, 3))
    zlo, zhi = gl.split(z5)
    cl: gl.constexpr = sliced(SB, (4,), 5)
    col = gl.arange(0, 8, layout=cl)[None, None, None, None, :]
    m1 = gl.where(col == 1, -1, 0)
    m2 = gl.where(col == 2, -1, 0)
    one = gl.where(col == 0, 0x3C003C00, 0)
    zl: gl.constexpr = gl.SliceLayout(4, SB)
    b = gl.inline_asm_elementwise(_SUMS_B_ASM, "=r,r,r,r,r,r",
                                  [gl.convert_layout(zlo, zl)[:, :, :, :, None],
                                   gl.convert_layout(zhi, zl)[:, :, :, :, None], m1, m2, one],
                                  dtype=gl.int32, is_pure=True, pack=1)
    # [w, pp, pb, c, col] words -> [w, pp, pb, c, j1, col] halves -> B [w, 16 pp + 8 pb + 2 c + j1, col]
    b = gl.reshape(gl.permute(_halves(b), (0, 1, 2, 3, 5, 4)), [4, BN // 8, 8])
    return gl.convert_layout(a, VA), gl.convert_layout(b, PB)


@gluon.jit
def _tile(kc, ks, vc, vh, knorm, vscale, vzero, tile, seq_len, start, table, q3, qf, qc, m_i, l_part, z_part, acc,
          HEAD_DIM: gl.constexpr, KEY_BITS: gl.constexpr, V_BITS: gl.constexpr, KBM: gl.constexpr,
          LAZY: gl.constexpr, EDGE: gl.constexpr, BN: gl.constexpr, XL: gl.constexpr, V_SHAPE: gl.constexpr,
          V_ORDER: gl.constexpr, SUM_PAGES: gl.constexpr, MMA_SUMS: gl.constexpr, XP: gl.constexpr,
          SB: gl.constexpr):
    """One tile, each warp its BN/4 tokens: S_w, online softmax (exact or lazy max), O_w^T += V_w^T P_w^T.
    EDGE: the tile reaches outside [start, seq_len) (a second compiled copy keeps the masks off the common
    path). The tile's bytes come from `_load_w`, issued one tile ahead. MMA_SUMS: the fields are words of
    two tokens, l_part the sums' accumulator [4, 16, 8] (`_sums_operands`; z_part unused)."""
    tl: gl.constexpr = gl.SliceLayout(1, XL)
    if MMA_SUMS:
        wl: gl.constexpr = gl.SliceLayout(1, XP)
        if EDGE:
            # each half of a word masked on its own token
            wpos = (tile * BN + gl.arange(0, 4, layout=gl.SliceLayout(1, wl))[:, None] * (BN // 4)
                    + 2 * gl.arange(0, BN // 8, layout=gl.SliceLayout(0, wl))[None, :])
            keep = (gl.where((wpos < seq_len) & (wpos >= start), 0xFFFF, 0)
                    | gl.where((wpos + 1 < seq_len) & (wpos + 1 >= start), -65536, 0))
            vscale = vscale & keep
            vzero = vzero & keep
        knorm = gl.convert_layout(gl.reshape(_halves(knorm).to(gl.float32), [4, BN // 4]), tl)
    s = mma_v2(q3, _keys_operand(kc, ks, table, BN, KBM, HEAD_DIM, KEY_BITS), gl.zeros([4, 16, BN // 4], gl.int32, MMA))
    # rows h (hi bytes) and 8 + h (lo bytes) are in the same thread
    hi, lo = gl.split(gl.permute(gl.reshape(s, [4, 2, 8, BN // 4]), (0, 2, 3, 1)))
    x = gl.convert_layout((hi * Q_LO_INT + lo).to(gl.float32), XL)  # [4, 8 heads, BN/4 tokens]
    if EDGE:
        # Stale slots may hold NaN norms and scales: masked scores, zero scale and zero point.
        pos = (tile * BN + gl.arange(0, 4, layout=gl.SliceLayout(1, tl))[:, None] * (BN // 4)
               + gl.arange(0, BN // 4, layout=gl.SliceLayout(0, tl))[None, :])
        ok = (pos < seq_len) & (pos >= start)
        knorm = gl.where(ok, knorm, 0.0)
        if not MMA_SUMS:
            vscale = gl.where(ok, vscale, 0.0)
            vzero = gl.where(ok, vzero, 0.0)
    if qc is not None:
        x = x + qc[None, :, None]
    # y = score / qf, qf > 0 the head's: the scores' max is qf x y's, and qf joins the exponent's FFMA (one
    # multiply per score less than scaling each score)
    x = x * knorm[:, None, :]
    if EDGE:
        x = gl.where(ok[:, None, :], x, float("-inf"))

    # online softmax per warp and head (the max over a warp's tokens stays in the warp)
    t_max = gl.max(x, 2) * qf[None, :]
    if LAZY:
        # the reference max moves only when a score passes it by LAZY_MAX_MARGIN (P <= 2^4, as `tq_gluon`)
        m_new = gl.where(t_max > m_i + LAZY_MAX_MARGIN, t_max, m_i)
    else:
        m_new = gl.maximum(m_i, t_max)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)  # exactly 1 where the max stayed (ex2 of 0): the rescale below is skipped
    p = gl.exp2(x * qf[None, :, None] - m_use[:, :, None])
    if MMA_SUMS:
        # P as fp16 words of two tokens once: P x scale two tokens per instruction on the scale words as loaded,
        # and the sums by mma.sync (one per two pages) instead of an add and an FMA per score
        pe, po = gl.split(gl.reshape(p, [4, 8, BN // 8, 2]))
        pw = gl.inline_asm_elementwise(_PACK_ASM, "=r,r,r", [gl.convert_layout(pe, XP), gl.convert_layout(po, XP)],
                                       dtype=gl.int32, is_pure=True, pack=1)
        pbw = gl.inline_asm_elementwise(_HMUL2_ASM, "=r,r,r", [pw, vscale[:, None, :]], dtype=gl.int32,
                                        is_pure=True, pack=1)
        pb = gl.convert_layout(gl.permute(gl.reshape(_halves(pbw), [4, 8, BN // 4]), (0, 2, 1)), PB)
        sa, sb = _sums_operands(pw, vzero, BN, SB)
        a16 = gl.reshape(gl.permute(gl.join(alpha, alpha), (0, 2, 1)), [4, 16])  # row 8 h8 + h: head h
        l_part = mma_v2(sa, sb, l_part * gl.convert_layout(a16, gl.SliceLayout(2, MMA))[:, :, None])
    elif SUM_PAGES:
        # the tile's pages added in-thread first (register bits of the score layout): sums of one page's shape
        a1 = gl.convert_layout(alpha, gl.SliceLayout(2, SUM_LAYOUT))[:, :, None]
        l_part = l_part * a1 + gl.convert_layout(gl.sum(gl.reshape(p, [4, 8, BN // 64, 16]), 2), SUM_LAYOUT)
        z_part = z_part * a1 + gl.convert_layout(gl.sum(gl.reshape(p * vzero[:, None, :], [4, 8, BN // 64, 16]), 2),
                                                 SUM_LAYOUT)
    else:
        l_part = l_part * alpha[:, :, None] + p
        z_part = z_part * alpha[:, :, None] + p * vzero[:, None, :]
    if not MMA_SUMS:
        pb = gl.convert_layout(gl.permute((p * vscale[:, None, :]).to(gl.float16), (0, 2, 1)), PB)
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, MMA))[:, None, :]
    if LAZY:
        # O^T is HEAD_DIM / 4 registers per thread; the common tile keeps its max and skips their FMULs
        if HEAD_DIM == 128:
            acc = gl.inline_asm_elementwise(_RESCALE_ASM_128, _RESCALE_CONSTRAINTS_128, [acc, alpha_o],
                                            dtype=gl.float32, is_pure=True, pack=32)
        else:
            acc = gl.inline_asm_elementwise(_RESCALE_ASM_64, _RESCALE_CONSTRAINTS_64, [acc, alpha_o],
                                            dtype=gl.float32, is_pure=True, pack=16)
    else:
        acc = acc * alpha_o
    if V_BITS == 4:
        acc = mma_v2(_values_operand(vc, BN, HEAD_DIM, V_SHAPE, V_ORDER), pb, acc)
    else:
        acc = mma_v2(_values_operand3(vc, vh, BN, HEAD_DIM, V_SHAPE, V_ORDER), pb, acc)
    return m_new, l_part, z_part, acc


@gluon.jit
def _step(kc, ks, vc, vh, knorm, vscale, vzero, tile, seq_len, start, table, q3, qf, qc, m_i, l_part, z_part, acc,
          HEAD_DIM: gl.constexpr, KEY_BITS: gl.constexpr, V_BITS: gl.constexpr, KBM: gl.constexpr,
          LAZY: gl.constexpr, BN: gl.constexpr, XL: gl.constexpr, V_SHAPE: gl.constexpr, V_ORDER: gl.constexpr,
          SUM_PAGES: gl.constexpr, MMA_SUMS: gl.constexpr, XP: gl.constexpr, SB: gl.constexpr):
    """`_tile`, the masked copy only for a tile that reaches outside [start, seq_len)."""
    if (tile * BN < start) | (tile * BN + BN > seq_len):
        m_i, l_part, z_part, acc = _tile(kc, ks, vc, vh, knorm, vscale, vzero, tile, seq_len, start, table, q3, qf,
                                         qc, m_i, l_part, z_part, acc, HEAD_DIM, KEY_BITS, V_BITS, KBM, LAZY, True,
                                         BN, XL, V_SHAPE, V_ORDER, SUM_PAGES, MMA_SUMS, XP, SB)
    else:
        m_i, l_part, z_part, acc = _tile(kc, ks, vc, vh, knorm, vscale, vzero, tile, seq_len, start, table, q3, qf,
                                         qc, m_i, l_part, z_part, acc, HEAD_DIM, KEY_BITS, V_BITS, KBM, LAZY, False,
                                         BN, XL, V_SHAPE, V_ORDER, SUM_PAGES, MMA_SUMS, XP, SB)
    return m_i, l_part, z_part, acc


@gluon.jit
def _rotated_query(q_ptr, rot_ptr, seq, kvh, q_scale, stride_qb, stride_qh, GROUP: gl.constexpr,
                   HEAD_DIM: gl.constexpr, q_layout: gl.constexpr, stamp_ptr, STAMPS: gl.constexpr):
    """(q x q_scale in fp16) @ Pi^T sqrt(D) / D in the score MMA's K order, for the GQA group's heads
    [8, D] in `q_layout` (`TQGluonConfig.rotate_query`): `tq_decode._tq_rotate_query_kernel`'s product by
    mma.sync in the prologue, without its fp16 rounding of the result. `rot_ptr` is `rotation_operand`: the
    order is folded into its rows and each row is contiguous along the product's K, so with k_width 8 (both
    operands relabel K alike) each thread loads its operands in 16-byte vectors."""
    rl: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 4], instr_shape=[16, 8])
    al: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=rl, k_width=8)
    bl: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=rl, k_width=8)
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, al))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, al))
    a = gl.load(q_ptr + seq * stride_qb + (kvh * GROUP + rows)[:, None] * stride_qh + cols[None, :],
                mask=(rows < GROUP)[:, None], other=0.0)
    a = (a.to(gl.float32) * q_scale).to(gl.float16)
    kk = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, bl))
    jj = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, bl))
    b = gl.load(rot_ptr + jj[None, :] * HEAD_DIM + kk[:, None])
    if STAMPS:
        _stamp(a.to(gl.float32), stamp_ptr, 8)
        _stamp(b.to(gl.float32), stamp_ptr, 9)
    x = mma_v2(a, b, gl.zeros([16, HEAD_DIM], gl.float32, rl)) * (1.0 / HEAD_DIM)
    if STAMPS:
        _stamp(x, stamp_ptr, 10)
    # rows 0-7 (the heads; 8-15 are the M padding): the row's bit 3 is a register bit of the accumulator
    x, _ = gl.split(gl.permute(gl.reshape(x, [2, 8, HEAD_DIM]), (1, 2, 0)))
    return gl.convert_layout(x, q_layout)


@gluon.jit
def _weighted_tiles(first_tile, end_tile, split, num_splits, group, num_groups, num_sms, W1: gl.constexpr,
                    W2: gl.constexpr):
    """[tile_lo, tile_hi) of `split` when the group's tiles [first_tile, end_tile) are cut by weight: W1 for the
    splits that start first on their SM (linear block id group + num_groups x split below `num_sms`: a prefix
    of each group's splits in the split-major grid), W2 for the others (`split_weights`)."""
    k = gl.minimum(gl.maximum((num_sms - group + num_groups - 1) // num_groups, 0), num_splits)
    total = W1 * k + W2 * (num_splits - k)
    lo = W1 * gl.minimum(split, k) + W2 * gl.maximum(split - k, 0)
    hi = W1 * gl.minimum(split + 1, k) + W2 * gl.maximum(split + 1 - k, 0)
    n = end_tile - first_tile
    return first_tile + (n * lo) // total, first_tile + (n * hi) // total


@gluon.jit
def _tq_warp_kernel(
    q_ptr, order_ptr, rot_ptr, cache32_ptr, cache16_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr, out_ptr,
    part_out_ptr, part_lse_ptr, cnt_ptr, stamp_ptr, q_scale, window, num_splits, num_sms,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    GROUP: gl.constexpr, NUM_KV: gl.constexpr, HEAD_DIM: gl.constexpr, SLOT: gl.constexpr,
    KEY_BITS: gl.constexpr, V_BITS: gl.constexpr, KBM: gl.constexpr, KB: gl.constexpr, VBM: gl.constexpr,
    VB: gl.constexpr, NF: gl.constexpr, I8_SCALE: gl.constexpr, I8_OFFSET: gl.constexpr,
    BN: gl.constexpr, XL: gl.constexpr, FL: gl.constexpr, K_LAYOUT: gl.constexpr,
    V_LAYOUT: gl.constexpr, V_SHAPE: gl.constexpr, V_ORDER: gl.constexpr, SUM_PAGES: gl.constexpr,
    MMA_SUMS: gl.constexpr, FW: gl.constexpr, XP: gl.constexpr, SB: gl.constexpr,
    UNROLL: gl.constexpr, PAGES_AHEAD: gl.constexpr, LAZY: gl.constexpr, HAS_WINDOW: gl.constexpr,
    HAS_SINKS: gl.constexpr, IS_SPLIT: gl.constexpr, ROTATE: gl.constexpr, OFF32: gl.constexpr,
    FUSED: gl.constexpr, S_BLOCK: gl.constexpr, S_CHUNK: gl.constexpr, STAMPS: gl.constexpr,
    WAVE_W1: gl.constexpr, WAVE_W2: gl.constexpr,
):
    if WAVE_W1 > 0:
        # split-major grid (sequence x KV head, split): the first `num_sms` programs, one to each SM, are the low
        # splits of every group (`split_weights`)
        group = gl.program_id(0)
        kvh = group % NUM_KV
        seq = group // NUM_KV
        split = gl.program_id(1)
    else:
        kvh = gl.program_id(0)
        split = gl.program_id(1)
        seq = gl.program_id(2)
    if STAMPS:  # probe only: `tq_gluon.STAMPS`; row = the linear block id
        stamp_ptr += (gl.program_id(0) + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1)
                                                               * gl.program_id(2))) * 16  # `tq_gluon.STAMPS_ROW`
        _stamp_scalar(0, stamp_ptr, 0)
        _stamp_sm(stamp_ptr, 7)
    seq_len, start, tile_lo, tile_hi = split_tiles(seq_lens_ptr, seq, window, split, num_splits, BN, HAS_WINDOW)
    if WAVE_W1 > 0:
        tile_lo, tile_hi = _weighted_tiles(start // BN, (seq_len + BN - 1) // BN, split, num_splits, group,
                                           gl.num_programs(0), num_sms, WAVE_W1, WAVE_W2)
    if STAMPS:
        _stamp_scalar(seq_len, stamp_ptr, 1)
    ROWL: gl.constexpr = gl.SliceLayout(2, XL)
    PPW: gl.constexpr = BN // 64  # `pages_per_warp`

    # Software pipeline: the bytes of tile i + 1 load while tile i is computed, their pages PAGES_AHEAD tiles
    # ahead (at 1 the loads waited for their block-table entries). Two tiles of bytes ahead were slower
    # (NOTES_TQ.md, tenth session). The first tile's loads go out before the query's prologue, whose
    # layout conversions wait at barriers: their latency then overlaps it.
    bt_row = block_tables_ptr + seq * stride_bt
    kc, ks, vc, vh, knorm, vscale, vzero = _load_w(cache32_ptr, cache16_ptr, _pages_w(bt_row, tile_lo, seq_len, PPW, FL),
                                                   kvh, NUM_KV, HEAD_DIM, SLOT, KEY_BITS, V_BITS, KBM, KB, VBM, VB,
                                                   NF, BN, PPW, XL, FL, K_LAYOUT, V_LAYOUT, MMA_SUMS, FW, XP, OFF32)
    # the PRMT table word in a vector register for the whole loop (a scalar would be copied before each PRMT)
    table = _word_bytes(gl.load(order_ptr + HEAD_DIM + gl.zeros_like(kc)), BN, KBM // 4)
    pw = _pages_w(bt_row, tile_lo + 1, seq_len, PPW, FL)

    # The query as two signed bytes per coordinate, in the score MMA's K order (as `tq_gluon`), then the
    # mma.sync A operand [4, 16, D] (every warp the whole query; once per program).
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
    if ROTATE:
        q = _rotated_query(q_ptr, rot_ptr, seq, kvh, q_scale, stride_qb, stride_qh, GROUP, HEAD_DIM, q_layout,
                           stamp_ptr, STAMPS)
    else:
        offs_qh = gl.arange(0, 8, layout=gl.SliceLayout(1, q_layout))
        order = gl.load(order_ptr + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout)))
        q = gl.load(q_ptr + seq * stride_qb + (kvh * GROUP + offs_qh)[:, None] * stride_qh + order[None, :],
                    mask=(offs_qh < GROUP)[:, None], other=0.0).to(gl.float32) * q_scale
        if STAMPS:
            _stamp(q, stamp_ptr, 8)
    amax = gl.max(gl.abs(q), 1)
    step = gl.where(amax > 0.0, amax / 127.0, 1.0)
    x = q / step[:, None]
    hi = gl.floor(x + 0.5)
    lo = gl.floor((x - hi) * Q_LO + 0.5)
    q16 = gl.reshape(gl.permute(gl.join(hi.to(gl.int8), lo.to(gl.int8)), (2, 0, 1)), [16, HEAD_DIM])
    b3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1, 1], [2, 1, 0])
    q3 = gl.expand_dims(gl.convert_layout(q16, gl.SliceLayout(0, b3)), 0) + gl.zeros([4, 16, HEAD_DIM], gl.int8, b3)
    q3 = gl.convert_layout(q3, QA)
    # the score of head h: (Q_LO hi.b + lo.b + qc) qf knorm (`tq_gluon`), qc = the int8 table's offset x the
    # query's sum (`turboquant.int8_offset`); None where the offset is 0 (3-bit keys): no add per score
    qf = gl.convert_layout(step * (1.0 / (Q_LO * I8_SCALE)), gl.SliceLayout(0, ROWL))
    if I8_OFFSET != 0.0:
        qc = gl.convert_layout(I8_OFFSET * gl.sum(hi * Q_LO + lo, 1), gl.SliceLayout(0, ROWL))
    else:
        qc = None
    if STAMPS:  # after the prologue, so that waiting for the first tile's bytes does not delay it
        _stamp(q3.to(gl.int32), stamp_ptr, 11)
        _stamp(qf, stamp_ptr, 3)
        _stamp(knorm, stamp_ptr, 2)

    m_i = gl.full([4, 8], float("-inf"), gl.float32, layout=ROWL)
    # per-thread softmax sums (and of P x zero point)
    if MMA_SUMS:
        l_part = gl.zeros([4, 16, 8], gl.float32, layout=MMA)  # `_sums_operands`' C
        z_part = gl.zeros([4, 8], gl.float32, layout=ROWL)  # unused
    elif SUM_PAGES:
        l_part = gl.zeros([4, 8, 16], gl.float32, layout=SUM_LAYOUT)
        z_part = gl.zeros_like(l_part)
    else:
        l_part = gl.zeros([4, 8, BN // 4], gl.float32, layout=XL)
        z_part = gl.zeros_like(l_part)
    acc = gl.zeros([4, HEAD_DIM, 8], gl.float32, layout=MMA)
    if UNROLL:
        # Two tiles per iteration, their bytes in two register sets that take turns: the set of tile i + 2 loads
        # after tile i is computed, into the same registers, so no set is copied at the loop's end (one pass per
        # tile took a move per loaded word there).
        for tile in range(tile_lo, tile_hi, 2):
            if PAGES_AHEAD == 1:
                pw = _pages_w(bt_row, tile + 1, seq_len, PPW, FL)
            bkc, bks, bvc, bvh, bknorm, bvscale, bvzero = _load_w(cache32_ptr, cache16_ptr, pw, kvh, NUM_KV,
                                                                  HEAD_DIM, SLOT, KEY_BITS, V_BITS, KBM, KB, VBM, VB,
                                                                  NF, BN, PPW, XL, FL, K_LAYOUT, V_LAYOUT,
                                                                  MMA_SUMS, FW, XP, OFF32)
            if PAGES_AHEAD == 2:
                pw = _pages_w(bt_row, tile + 2, seq_len, PPW, FL)
            m_i, l_part, z_part, acc = _step(kc, ks, vc, vh, knorm, vscale, vzero, tile, seq_len, start, table, q3,
                                             qf, qc, m_i, l_part, z_part, acc, HEAD_DIM, KEY_BITS, V_BITS, KBM, LAZY,
                                             BN, XL, V_SHAPE, V_ORDER, SUM_PAGES, MMA_SUMS, XP, SB)
            if PAGES_AHEAD == 1:
                pw = _pages_w(bt_row, tile + 2, seq_len, PPW, FL)
            kc, ks, vc, vh, knorm, vscale, vzero = _load_w(cache32_ptr, cache16_ptr, pw, kvh, NUM_KV, HEAD_DIM,
                                                           SLOT, KEY_BITS, V_BITS, KBM, KB, VBM, VB, NF, BN, PPW,
                                                           XL, FL, K_LAYOUT, V_LAYOUT, MMA_SUMS, FW, XP, OFF32)
            if PAGES_AHEAD == 2:
                pw = _pages_w(bt_row, tile + 3, seq_len, PPW, FL)
            if tile + 1 < tile_hi:
                m_i, l_part, z_part, acc = _step(bkc, bks, bvc, bvh, bknorm, bvscale, bvzero, tile + 1, seq_len,
                                                 start, table, q3, qf, qc, m_i, l_part, z_part, acc, HEAD_DIM,
                                                 KEY_BITS, V_BITS, KBM, LAZY, BN, XL, V_SHAPE, V_ORDER, SUM_PAGES,
                                                 MMA_SUMS, XP, SB)
    else:
        for tile in range(tile_lo, tile_hi):
            if PAGES_AHEAD == 1:
                pw = _pages_w(bt_row, tile + 1, seq_len, PPW, FL)
            nkc, nks, nvc, nvh, nknorm, nvscale, nvzero = _load_w(cache32_ptr, cache16_ptr, pw, kvh, NUM_KV,
                                                                  HEAD_DIM, SLOT, KEY_BITS, V_BITS, KBM, KB, VBM, VB,
                                                                  NF, BN, PPW, XL, FL, K_LAYOUT, V_LAYOUT,
                                                                  MMA_SUMS, FW, XP, OFF32)
            if PAGES_AHEAD == 2:
                pw = _pages_w(bt_row, tile + 2, seq_len, PPW, FL)
            m_i, l_part, z_part, acc = _step(kc, ks, vc, vh, knorm, vscale, vzero, tile, seq_len, start, table, q3,
                                             qf, qc, m_i, l_part, z_part, acc, HEAD_DIM, KEY_BITS, V_BITS, KBM, LAZY,
                                             BN, XL, V_SHAPE, V_ORDER, SUM_PAGES, MMA_SUMS, XP, SB)
            kc, ks, vc, vh, knorm, vscale, vzero = nkc, nks, nvc, nvh, nknorm, nvscale, nvzero

    # merge the 4 warps: each its own max, sums and O^T
    m_f = gl.max(m_i, 0)  # [8]
    m_use = gl.where(m_f == float("-inf"), 0.0, m_f)
    w_scale = gl.exp2(m_i - m_use[None, :])  # [4, 8]; 0 for a warp that saw nothing
    w_scale = gl.where(m_i == float("-inf"), 0.0, w_scale)
    if MMA_SUMS:
        # C [w, 8 h8 + h, col]: the softmax sum is column 0 of both row halves, P x zero column 1 + h8
        c4 = gl.reshape(l_part, [4, 2, 8, 8])
        h8 = gl.arange(0, 2, layout=sliced(c4.type.layout, (1,), 4))[None, :, None, None]
        col = gl.arange(0, 8, layout=sliced(c4.type.layout, (3,), 4))[None, None, None, :]
        l_w = gl.convert_layout(gl.sum(gl.sum(gl.where(col == 0, c4, 0.0), 3), 1), ROWL)
        z_w = gl.convert_layout(gl.sum(gl.sum(gl.where(col == 1 + h8, c4, 0.0), 3), 1), ROWL)
    else:
        l_w = gl.convert_layout(gl.sum(l_part, 2), ROWL)
        z_w = gl.convert_layout(gl.sum(z_part, 2), ROWL)
    l_i = gl.sum(l_w * w_scale, 0)
    z_i = gl.sum(z_w * w_scale, 0)
    ws = gl.convert_layout(w_scale, gl.SliceLayout(1, MMA))
    o = gl.sum(acc * ws[:, None, :], 0)  # [D, 8]
    out_l: gl.constexpr = gl.SliceLayout(0, MMA)
    rows = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, out_l))
    t = rows // 16
    u = (rows // 8) % 2
    g = rows % 8
    if V_BITS == 4:
        offs_d = u * (HEAD_DIM // 2) + g * (HEAD_DIM // 16) + t  # `dim_of_row`
        unit = _UNSUB * gl.exp2(u.to(gl.float32) * -4.0)  # 1 / `value_unit`
    else:
        Q: gl.constexpr = HEAD_DIM // 64
        offs_d = (t // Q) * (HEAD_DIM // 4) + g * (HEAD_DIM // 32) + 2 * (t % Q) + u  # `dim_of_row(D, 3)`
        unit = _UNSUB * gl.exp2((t // Q).to(gl.float32) * -2.0)  # 1 / `value_unit(D, 3)`
    offs_h = gl.arange(0, 8, layout=gl.SliceLayout(0, out_l))
    h_mask = offs_h < GROUP
    q_head = kvh * GROUP + offs_h
    m_o = gl.convert_layout(m_f, gl.SliceLayout(0, out_l))
    l_o = gl.convert_layout(l_i, gl.SliceLayout(0, out_l))
    z_o = gl.convert_layout(z_i, gl.SliceLayout(0, out_l))
    o = o * unit[:, None] + z_o[None, :]
    if STAMPS:
        _stamp(o, stamp_ptr, 4)
    _store_result(o, m_o, l_o, q_head, h_mask, offs_d, seq, split, num_splits, sinks_ptr, out_ptr, part_out_ptr,
                  part_lse_ptr, stride_ob, stride_oh, NUM_KV, GROUP, HEAD_DIM, HAS_SINKS, IS_SPLIT)
    if FUSED:
        _merge_if_last(cnt_ptr, part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, seq, kvh, num_splits, stride_ob,
                       stride_oh, NUM_KV, GROUP, HEAD_DIM, S_BLOCK, S_CHUNK, HAS_SINKS, stamp_ptr, STAMPS)


FORMATS = WARP_ORDER_FORMATS
"""Formats it decodes: centroid keys (4- or 3-bit) with 4- or 3-bit values, their planar pages in this
kernel's order (`turboquant.warp_plane_order`)."""
REGISTERS = {"turboquant_4bit_nc": {(64, 64): 96, (64, 128): 151, (64, 256): 232, (128, 64): 146, (128, 128): 199},
             "turboquant_k3v4_nc": {(64, 64): 110, (64, 128): 149, (64, 256): 221, (128, 64): 147, (128, 128): 200},
             "turboquant_3bit_nc": {(64, 64): 116, (64, 128): 150, (64, 256): 221, (128, 64): 149,
                                    (128, 128): 216}}
"""Registers per thread of the sm_90 compile by format and (head_dim, tile tokens) (Triton 3.6, no cap, pages
two tiles ahead, the lazy max, `TQGluonConfig.sum_pages` on and, for the default tiles (256 at head_dim 64, 128 at
128), `TQGluonConfig.unroll`, `mma_sums`, `rotate_query` and `fused_merge` where `tq_gluon.default_config` sets them;
`bench/sass_mix.py --tq-gluon FORMAT --head-dim D --block-n BN --per-warp --sum-pages [--unroll] [--mma-sums] [--rotate]
[--fused-splits 32]`: the same count for 4 splits);
`TQGluonConfig.maxnreg` overrides."""


@functools.cache
def rotation_operand(fmt: str, head_dim: int, device: str) -> torch.Tensor:
    """fp16 [D, D], row j = column `query_order`[j] of Pi^T sqrt(D) (`turboquant.rotation_t_signs`, entries
    +-1): the B operand of `_rotated_query`, whose product then comes out in the score MMA's K order."""
    rot = rotation_t_signs(head_dim)[:, query_order(fmt, head_dim)]
    return rot.t().contiguous().to(device)


def smem_bytes(head_dim: int) -> int:
    """Shared memory of one program (the compiler's scratch for layout conversions; same compile)."""
    return 128 * head_dim


def merge_blocks(splits: int, head_dim: int) -> dict:
    """`_merge_if_last`'s S_BLOCK (the split count rounded up to a power of two, at least 4) and S_CHUNK (the
    splits it loads at once: all of them up to `MAX_FUSED_SPLITS`)."""
    s_block = max(4, triton.next_power_of_2(splits))
    return {"S_BLOCK": s_block, "S_CHUNK": min(s_block, 4096 // head_dim)}


WAVE_UNIT = 16
"""`split_weights`' denominator: first-wave weights in steps of 1/16."""


def split_weights(first_wave_weight: float) -> tuple[int, int]:
    """(W1, W2) of `_weighted_tiles` for `TQGluonConfig.first_wave_weight` r: r in sixteenths against 16; (0, 0)
    for r = 1 (equal splits, the (KV head, split, sequence) grid)."""
    if not 0.5 <= first_wave_weight <= 4.0:
        raise ValueError(f"TQGluonConfig.first_wave_weight must be in [0.5, 4], got {first_wave_weight}")
    w1 = round(first_wave_weight * WAVE_UNIT)
    return (0, 0) if w1 == WAVE_UNIT else (w1, WAVE_UNIT)


def call_weights(cfg, span: int, splits: int) -> tuple[int, int]:
    """(W1, W2) of one call: `split_weights` of `cfg.first_wave_weight` where its splits average at least
    `cfg.first_wave_min_tiles` tiles over `span` tokens (the block table's, no host sync), else (0, 0)."""
    weights = split_weights(cfg.first_wave_weight)  # checks the weight whatever the call
    return (0, 0) if span < cfg.first_wave_min_tiles * cfg.block_n * splits else weights


def weighted_tiles(first_tile: int, end_tile: int, split: int, num_splits: int, group: int, num_groups: int,
                   num_sms: int, w1: int, w2: int) -> tuple[int, int]:
    """`_weighted_tiles` on the host (its tests)."""
    k = min(max((num_sms - group + num_groups - 1) // num_groups, 0), num_splits)
    total = w1 * k + w2 * (num_splits - k)
    lo = w1 * min(split, k) + w2 * max(split - k, 0)
    hi = w1 * min(split + 1, k) + w2 * max(split + 1 - k, 0)
    n = end_tile - first_tile
    return first_tile + n * lo // total, first_tile + n * hi // total


def decode_tq_warp(query: torch.Tensor, q16: torch.Tensor, q_scale: float, cache: torch.Tensor, fmt: str,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, *, sliding_window: int | None,
                   sinks: torch.Tensor | None, splits: int, out: torch.Tensor, cfg,
                   stamps: torch.Tensor | None = None) -> torch.Tensor:
    """Run the kernel (and, when split without `cfg.fused_merge` or past `MAX_FUSED_SPLITS` splits, the shared
    merge kernel); arguments as `tq_gluon.decode_tq_gluon`, `cfg` its
    `TQGluonConfig` (block_n, maxnreg, pages_ahead, lazy_max, sum_pages, unroll, mma_sums, rotate_query: then
    `q16` is the query itself and `q_scale` the softmax scale x log2(e), and the kernel rotates it). `stamps`
    (probe only, bench/probe_tq_stamps.py): int64 [programs, `tq_gluon.STAMPS_ROW`], zeroed; each program's
    `tq_gluon.STAMPS` at the row of its linear block id (grid (kv heads, splits, batch), or with
    `first_wave_weight` (batch x kv heads, splits))."""
    from kvpolicy.kernels.decode_attention import _span, launch_merge, split_partials
    from kvpolicy.kernels.tq_gluon import TQGluonConfig

    if fmt not in FORMATS:
        raise ValueError(f"the per-warp kernel decodes {' and '.join(FORMATS)} only, not {fmt}")
    if cfg.mma_sums and pages_per_warp(cfg.block_n) < 2:
        raise ValueError(f"TQGluonConfig.mma_sums takes two or four pages per warp (block_n 128 or 256), got {cfg}")
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = cache.shape[1]
    cx = kernel_constexprs(fmt, head_dim, num_q_heads, num_kv_heads, TQGluonConfig(block_n=64))
    cx = {k: cx[k] for k in ("GROUP", "NUM_KV", "HEAD_DIM", "SLOT", "KEY_BITS", "V_BITS", "KBM", "KB", "VBM", "VB",
                             "NF", "I8_SCALE", "I8_OFFSET")}
    part_out, part_lse = split_partials(out, splits)
    table = _kernel_table(fmt, head_dim, str(cache.device))
    rot = rotation_operand(fmt, head_dim, str(cache.device)) if cfg.rotate_query else table
    counters = None
    if cfg.fused_merge and 1 < splits <= MAX_FUSED_SPLITS:
        counters = arrival_counters(cache.device, batch * num_kv_heads)
    w1, w2 = call_weights(cfg, _span(block_tables, PAGE, sliding_window, cfg.block_n), splits)
    grid = (batch * num_kv_heads, splits) if w1 else (num_kv_heads, splits, batch)
    _tq_warp_kernel[grid](
        q16, table, rot, cache.view(torch.int32), cache.view(torch.int16), block_tables, seq_lens,
        sinks if sinks is not None else seq_lens, out, part_out, part_lse,
        counters if counters is not None else seq_lens, stamps if stamps is not None else seq_lens, float(q_scale),
        int(sliding_window or 0), splits, sm_count(cache.device) if w1 else 0, q16.stride(0), q16.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), **cx,
        **layouts(cx["KBM"], head_dim, cx["V_BITS"], cfg.block_n, cfg.sum_pages, cfg.mma_sums),
        UNROLL=cfg.unroll, PAGES_AHEAD=cfg.pages_ahead, LAZY=cfg.lazy_max, HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=sinks is not None and (splits == 1 or counters is not None), IS_SPLIT=splits > 1,
        ROTATE=cfg.rotate_query, OFF32=cache.nbytes // 4 < 2**31, FUSED=counters is not None,
        STAMPS=stamps is not None, WAVE_W1=w1, WAVE_W2=w2,
        **merge_blocks(splits if counters is not None else 1, head_dim), num_warps=4,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    if splits > 1 and counters is None:
        launch_merge(part_out, part_lse, sinks, out, splits, pdl=False)
    return out
