"""Hopper TurboQuant decode for the centroid-key formats (4bit_nc, k3v4_nc, 3bit_nc) in Gluon, each warp independent:
no barrier per tile.

Why: a warpgroup kernel waits, on every tile, at two warpgroup barriers and at the fence that lets its wgmma read
P from shared memory. Here each of the 4 warps owns two or four whole pages of every 128- or 256-token tile and
runs its own online softmax:
- S_w = Q K_w^T with mma.sync (int8, m16n8k32): Q [16, D] is the A operand (rows 0-7 the query's hi bytes, 8-15
  its lo bytes: a two-byte query), K_w^T the B operand straight from the unpacked key registers (centroids as
  signed bytes, `turboquant.int8_centroids`; `int8_operand_order` relabels the key rows' bytes as its K
  indices);
- P_w in the accumulator layout (head g in thread g, tokens 16 pg + {2c, 2c + 1, 8 + 2c, 9 + 2c}) *is* the B
  operand of O_w^T = V_w^T P_w^T (fp16, m16n8k16), and V_w^T is the A operand from registers: each thread loads
  its tokens' value bytes, already paired by the page, and turns them into fp16 subnormal pairs by shifts and
  masks (`v_word_program`, `v3_word_program`), so the values never go through shared memory;
- the pages hold each plane in this kernel's thread order (`turboquant.warp_plane_order`): each thread reads its
  key rows, value rows and fields of a page as one 16-, 8- or 4-byte vector per plane (`block_layout`);
- P x value scale is one f16x2 multiply per two tokens, and each head's softmax sum and sum of P x zero point
  come from one more mma.sync per two pages (`_sums_operands`);
- the lazy max: the reference max moves only when a score passes it by `LAZY_MAX_MARGIN`, and a warp whose
  heads all kept their max skips the rescale of its O^T (a vote and a branch inside one asm block,
  `rescale_ptx`: Gluon has no per-warp branch);
- two tiles per loop iteration in two register sets; the block table two tiles ahead; the query rotated in the
  prologue (`_rotated_query`); where the cache is under 8 GiB the page offsets are int32 (`OFF32`);
- the warps' (max, sums, O^T) merge once at the end, and the last split of each (sequence, KV head) to finish
  merges the splits' partials itself (`_merge_if_last`): a decode step is one launch.
Figures: bench/RESULTS.md; designs that won and lost: bench/KERNELS.md.

Scope: `FORMATS`, head_dim 64 or 128, GQA groups up to 8, 16-token planar pages, sm_90 (mma.sync runs on sm_80+;
the callers route sm_90 only). Tested on the GPU against the float64 reference (tests/kernels/test_tq_gluon.py);
the layouts' index algebra also on the CPU (tests/kernels/test_tq_warp.py).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kvpolicy.kernels.formats import PAGE, WARP_ORDER_FORMATS, planar_constexprs, tq_layout
from kvpolicy.kernels.launch import (
    LOG2E,
    merge_splits,
    resident_programs,
    sm_count,
    span,
    split_count,
    split_partials,
    split_tiles,
    store_result,
)
from kvpolicy.kernels.turboquant import LAZY_MAX_MARGIN as _MARGIN
from kvpolicy.kernels.turboquant import (
    SELECT,
    SUBNORMAL_UNIT,
    int8_centroids,
    int8_offset,
    int8_operand_order,
    int8_table_word,
    k3_int8_program,
    k4_int8_program,
    render_ptx,
    rotation_t_signs,
)

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1], instr_shape=[1, 16, 8]))
QA = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=4))
KB8 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=4))
VA = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
PB = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))
_UNSUB = gl.constexpr(1.0 / SUBNORMAL_UNIT)
LAZY_MAX_MARGIN = gl.constexpr(_MARGIN)
# Centroid keys become signed bytes (4 per register, the int8 score MMA's operand), from whole 32-bit words.
_K4_I8_ASM = gl.constexpr(render_ptx(k4_int8_program()))
_K3_I8_ASM = gl.constexpr(render_ptx(k3_int8_program()))
Q_LO = gl.constexpr(254.0)
"""The query's second byte holds the first byte's rounding residual (at most 1/2) times this."""
Q_LO_INT = gl.constexpr(254)


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
    """An fp16 field plane's words [warp, page, c, r8]: thread c of each lane group
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


@functools.cache
def layouts(key_bytes: int, head_dim: int, value_bits: int, block_n: int) -> dict:
    """The kernel's tile constexprs: BN (the kernel derives the pages per warp from it), the score, field and
    load layouts (3-bit values are 8 words per token, one per thread g, at any head_dim: `_load_w`), the value
    operand's relabelling and the sums MMA's operand layouts (two or four pages per warp)."""
    ppw = pages_per_warp(block_n)
    if ppw < 2:
        raise ValueError(f"the sums MMA pairs each warp's pages: block_n 128 or 256, not {block_n}")
    v_shape, v_order = value_axes(head_dim, value_bits, ppw)
    return dict(BN=block_n, XL=score_layout(ppw), FL=field_layout(ppw), K_LAYOUT=block_layout(ppw, key_bytes // 8),
                V_LAYOUT=block_layout(ppw, head_dim // (16 if value_bits == 4 else 32)), V_SHAPE=v_shape,
                V_ORDER=v_order, FW=field_block_layout(ppw), XP=pair_layout(ppw), SB=sums_b_layout(ppw))


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
def _word_bytes(x, BN: gl.constexpr, W: gl.constexpr):
    """int32 words [BN, W] -> their bytes [BN, 4W] (int8, byte 0 first): truncations that LLVM folds back
    into the words when the bytes are packed for the PTX program."""
    b0 = x.to(gl.int8)
    b1 = (x >> 8).to(gl.int8)
    b2 = (x >> 16).to(gl.int8)
    b3 = (x >> 24).to(gl.int8)
    return gl.reshape(gl.join(gl.join(b0, b2), gl.join(b1, b3)), [BN, 4 * W])


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
def _load_w(cache32_ptr, pw, kvh, NUM_KV: gl.constexpr, HEAD_DIM: gl.constexpr, SLOT: gl.constexpr,
            KEY_BITS: gl.constexpr, V_BITS: gl.constexpr, KBM: gl.constexpr, KB: gl.constexpr, VBM: gl.constexpr,
            VB: gl.constexpr, NF: gl.constexpr, BN: gl.constexpr, K_LAYOUT: gl.constexpr, V_LAYOUT: gl.constexpr,
            FW: gl.constexpr, XP: gl.constexpr, OFF32: gl.constexpr):
    """A tile's bytes, each warp its pages `pw` (`_pages_w`): key code words [BN, KBM/4] (3-bit keys also the
    matching 1-bit words: word w mod D/32 of the row shifted right by w // (D/32), else 0), value words
    [BN/2, 8, Q] of two tokens each (`_value_words`; 3-bit values also the 1-bit words as loaded, else 0), and
    the fp16 fields as words of two tokens [4, BN/8] as loaded, in `pair_layout`'s columns: carried through
    the loop as words, they need no repacking for the f16x2 instructions."""
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
    # thread c: the words of tokens 2c, 2c + 1 and 8 + 2c, 9 + 2c, together
    wb = gl.convert_layout(base, sliced(FW, (0, 1), 4))[:, :, None, None]
    fq = gl.arange(0, 4, layout=sliced(FW, (2,), 4))[None, None, :, None]
    fr = gl.arange(0, 2, layout=sliced(FW, (3,), 4))[None, None, None, :]
    fw = (cache32_ptr + (4 * (KB + VB) + fq * 2 + fr)) + wb
    wl: gl.constexpr = gl.SliceLayout(1, XP)
    knorm = gl.convert_layout(_field_words(gl.load(fw), BN), wl)
    vscale = gl.convert_layout(_field_words(gl.load(fw + 8 * (NF - 2)), BN), wl)
    vzero = gl.convert_layout(_field_words(gl.load(fw + 8 * (NF - 1)), BN), wl)
    return kc, ks, vc, vh, knorm, vscale, vzero


@gluon.jit
def _sums_operands(pw, zw, BN: gl.constexpr, SB: gl.constexpr):
    """The mma.sync operands of C = A B whose column 0 is each head's softmax sum and
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
def _tile(kc, ks, vc, vh, knorm, vscale, vzero, tile, seq_len, start, table, q3, qf, qc, m_i, l_part, acc,
          HEAD_DIM: gl.constexpr, KEY_BITS: gl.constexpr, V_BITS: gl.constexpr, KBM: gl.constexpr,
          EDGE: gl.constexpr, BN: gl.constexpr, XL: gl.constexpr, V_SHAPE: gl.constexpr, V_ORDER: gl.constexpr,
          XP: gl.constexpr, SB: gl.constexpr):
    """One tile, each warp its BN/4 tokens: S_w, online softmax against the lazy max, O_w^T += V_w^T P_w^T.
    EDGE: the tile reaches outside [start, seq_len) (a second compiled copy keeps the masks off the common
    path). The tile's bytes come from `_load_w`, issued one tile ahead; the fields are words of two tokens,
    l_part the sums' accumulator [4, 16, 8] (`_sums_operands`)."""
    tl: gl.constexpr = gl.SliceLayout(1, XL)
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
    if qc is not None:
        x = x + qc[None, :, None]
    # y = score / qf, qf > 0 the head's: the scores' max is qf x y's, and qf joins the exponent's FFMA (one
    # multiply per score less than scaling each score)
    x = x * knorm[:, None, :]
    if EDGE:
        x = gl.where(ok[:, None, :], x, float("-inf"))

    # online softmax per warp and head (the max over a warp's tokens stays in the warp); the reference max
    # moves only when a score passes it by LAZY_MAX_MARGIN
    t_max = gl.max(x, 2) * qf[None, :]
    m_new = gl.where(t_max > m_i + LAZY_MAX_MARGIN, t_max, m_i)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)  # exactly 1 where the max stayed (ex2 of 0): the rescale below is skipped
    p = gl.exp2(x * qf[None, :, None] - m_use[:, :, None])
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
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, MMA))[:, None, :]
    # O^T is HEAD_DIM / 4 registers per thread; the common tile keeps its max and skips their FMULs
    if HEAD_DIM == 128:
        acc = gl.inline_asm_elementwise(_RESCALE_ASM_128, _RESCALE_CONSTRAINTS_128, [acc, alpha_o],
                                        dtype=gl.float32, is_pure=True, pack=32)
    else:
        acc = gl.inline_asm_elementwise(_RESCALE_ASM_64, _RESCALE_CONSTRAINTS_64, [acc, alpha_o],
                                        dtype=gl.float32, is_pure=True, pack=16)
    if V_BITS == 4:
        acc = mma_v2(_values_operand(vc, BN, HEAD_DIM, V_SHAPE, V_ORDER), pb, acc)
    else:
        acc = mma_v2(_values_operand3(vc, vh, BN, HEAD_DIM, V_SHAPE, V_ORDER), pb, acc)
    return m_new, l_part, acc


@gluon.jit
def _step(kc, ks, vc, vh, knorm, vscale, vzero, tile, seq_len, start, table, q3, qf, qc, m_i, l_part, acc,
          HEAD_DIM: gl.constexpr, KEY_BITS: gl.constexpr, V_BITS: gl.constexpr, KBM: gl.constexpr,
          BN: gl.constexpr, XL: gl.constexpr, V_SHAPE: gl.constexpr, V_ORDER: gl.constexpr, XP: gl.constexpr,
          SB: gl.constexpr):
    """`_tile`, the masked copy only for a tile that reaches outside [start, seq_len)."""
    if (tile * BN < start) | (tile * BN + BN > seq_len):
        m_i, l_part, acc = _tile(kc, ks, vc, vh, knorm, vscale, vzero, tile, seq_len, start, table, q3, qf, qc,
                                 m_i, l_part, acc, HEAD_DIM, KEY_BITS, V_BITS, KBM, True, BN, XL, V_SHAPE, V_ORDER,
                                 XP, SB)
    else:
        m_i, l_part, acc = _tile(kc, ks, vc, vh, knorm, vscale, vzero, tile, seq_len, start, table, q3, qf, qc,
                                 m_i, l_part, acc, HEAD_DIM, KEY_BITS, V_BITS, KBM, False, BN, XL, V_SHAPE, V_ORDER,
                                 XP, SB)
    return m_i, l_part, acc


@gluon.jit
def _rotated_query(q_ptr, rot_ptr, seq, kvh, q_scale, stride_qb, stride_qh, GROUP: gl.constexpr,
                   HEAD_DIM: gl.constexpr, q_layout: gl.constexpr):
    """(q x q_scale in fp16) @ Pi^T sqrt(D) / D in the score MMA's K order, for the GQA group's heads [8, D] in
    `q_layout`, by mma.sync in the prologue (no launch of its own, no fp16 rounding of the result). `rot_ptr`
    is `rotation_operand`: the order is folded into its rows and each row is contiguous along the product's K,
    so with k_width 8 (both operands relabel K alike) each thread loads its operands in 16-byte vectors."""
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
    x = mma_v2(a, b, gl.zeros([16, HEAD_DIM], gl.float32, rl)) * (1.0 / HEAD_DIM)
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
def _merge_if_last(cnt_ptr, part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, seq, kvh, num_splits, stride_ob,
                   stride_oh, NUM_KV: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
                   S_BLOCK: gl.constexpr, S_CHUNK: gl.constexpr, HAS_SINKS: gl.constexpr):
    """The split merge in the decode kernel, after `launch.store_result` wrote this
    program's partials: each split of a (sequence, KV head) counts itself in `cnt_ptr` (`arrival_counters`), and
    the last to arrive merges the GQA group's `num_splits` (<= S_BLOCK) partials, S_CHUNK splits at a time with
    a running max, into the output, the sink's logit in the denominator (as `decode_attention`'s merge kernel),
    then zeroes the counter for the next launch. The merge's own launch goes, and its loads come from L2."""
    # Release: every warp's partial stores, then the count (thread 0's acq_rel atomic, after a barrier that
    # orders the other warps' stores before it). Acquire: the last program's reads of the others' partials.
    gl.thread_barrier()
    cnt = cnt_ptr + seq * NUM_KV + kvh
    arrived = gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
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
            m_run = gl.load(sinks_ptr + kvh * GROUP + offs_h, mask=h_mask, other=0.0).to(gl.float32) * LOG2E
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


@gluon.jit
def _tq_warp_kernel(
    q_ptr, table_ptr, rot_ptr, cache32_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr, out_ptr, part_out_ptr,
    part_lse_ptr, cnt_ptr, q_scale, window, num_splits, num_sms,
    stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
    # format and shapes
    GROUP: gl.constexpr, NUM_KV: gl.constexpr, HEAD_DIM: gl.constexpr, SLOT: gl.constexpr,
    KEY_BITS: gl.constexpr, V_BITS: gl.constexpr, KBM: gl.constexpr, KB: gl.constexpr, VBM: gl.constexpr,
    VB: gl.constexpr, NF: gl.constexpr, I8_SCALE: gl.constexpr, I8_OFFSET: gl.constexpr,
    # the tile's layouts (`layouts`)
    BN: gl.constexpr, XL: gl.constexpr, FL: gl.constexpr, K_LAYOUT: gl.constexpr, V_LAYOUT: gl.constexpr,
    V_SHAPE: gl.constexpr, V_ORDER: gl.constexpr, FW: gl.constexpr, XP: gl.constexpr, SB: gl.constexpr,
    # the call
    HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr, IS_SPLIT: gl.constexpr, OFF32: gl.constexpr,
    FUSED: gl.constexpr, S_BLOCK: gl.constexpr, S_CHUNK: gl.constexpr, WAVE_W1: gl.constexpr,
    WAVE_W2: gl.constexpr,
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
    seq_len, start, tile_lo, tile_hi = split_tiles(seq_lens_ptr, seq, window, split, num_splits, BN, HAS_WINDOW)
    if WAVE_W1 > 0:
        tile_lo, tile_hi = _weighted_tiles(start // BN, (seq_len + BN - 1) // BN, split, num_splits, group,
                                           gl.num_programs(0), num_sms, WAVE_W1, WAVE_W2)
    ROWL: gl.constexpr = gl.SliceLayout(2, XL)
    PPW: gl.constexpr = BN // 64  # `pages_per_warp`

    # Software pipeline: the bytes of tile i + 1 load while tile i is computed, their pages two tiles ahead
    # (every load of a tile's bytes waits for its block-table entries). The first tile's loads go out before
    # the query's prologue, whose layout conversions wait at barriers: their latency then overlaps it.
    bt_row = block_tables_ptr + seq * stride_bt
    kc, ks, vc, vh, knorm, vscale, vzero = _load_w(cache32_ptr, _pages_w(bt_row, tile_lo, seq_len, PPW, FL), kvh,
                                                   NUM_KV, HEAD_DIM, SLOT, KEY_BITS, V_BITS, KBM, KB, VBM, VB, NF,
                                                   BN, K_LAYOUT, V_LAYOUT, FW, XP, OFF32)
    # the PRMT table word in a vector register for the whole loop (a scalar would be copied before each PRMT)
    table = _word_bytes(gl.load(table_ptr + gl.zeros_like(kc)), BN, KBM // 4)
    pw = _pages_w(bt_row, tile_lo + 1, seq_len, PPW, FL)

    # The rotated query as two signed bytes per coordinate, in the score MMA's K order, then the mma.sync A
    # operand [4, 16, D] (every warp the whole query; once per program).
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
    q = _rotated_query(q_ptr, rot_ptr, seq, kvh, q_scale, stride_qb, stride_qh, GROUP, HEAD_DIM, q_layout)
    amax = gl.max(gl.abs(q), 1)
    step = gl.where(amax > 0.0, amax / 127.0, 1.0)
    x = q / step[:, None]
    hi = gl.floor(x + 0.5)
    lo = gl.floor((x - hi) * Q_LO + 0.5)
    q16 = gl.reshape(gl.permute(gl.join(hi.to(gl.int8), lo.to(gl.int8)), (2, 0, 1)), [16, HEAD_DIM])
    b3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1, 1], [2, 1, 0])
    q3 = gl.expand_dims(gl.convert_layout(q16, gl.SliceLayout(0, b3)), 0) + gl.zeros([4, 16, HEAD_DIM], gl.int8, b3)
    q3 = gl.convert_layout(q3, QA)
    # the score of head h: (Q_LO hi.b + lo.b + qc) qf knorm, qc = the int8 table's offset x the query's sum
    # (`turboquant.int8_offset`); None where the offset is 0 (3-bit keys): no add per score
    qf = gl.convert_layout(step * (1.0 / (Q_LO * I8_SCALE)), gl.SliceLayout(0, ROWL))
    if I8_OFFSET != 0.0:
        qc = gl.convert_layout(I8_OFFSET * gl.sum(hi * Q_LO + lo, 1), gl.SliceLayout(0, ROWL))
    else:
        qc = None

    m_i = gl.full([4, 8], float("-inf"), gl.float32, layout=ROWL)
    l_part = gl.zeros([4, 16, 8], gl.float32, layout=MMA)  # the softmax sums and sums of P x zero (`_sums_operands`)
    acc = gl.zeros([4, HEAD_DIM, 8], gl.float32, layout=MMA)
    # Two tiles per iteration, their bytes in two register sets that take turns: the set of tile i + 2 loads after
    # tile i is computed, into the same registers, so no set is copied at the loop's end.
    for tile in range(tile_lo, tile_hi, 2):
        bkc, bks, bvc, bvh, bknorm, bvscale, bvzero = _load_w(cache32_ptr, pw, kvh, NUM_KV, HEAD_DIM, SLOT, KEY_BITS,
                                                              V_BITS, KBM, KB, VBM, VB, NF, BN, K_LAYOUT, V_LAYOUT,
                                                              FW, XP, OFF32)
        pw = _pages_w(bt_row, tile + 2, seq_len, PPW, FL)
        m_i, l_part, acc = _step(kc, ks, vc, vh, knorm, vscale, vzero, tile, seq_len, start, table, q3, qf, qc, m_i,
                                 l_part, acc, HEAD_DIM, KEY_BITS, V_BITS, KBM, BN, XL, V_SHAPE, V_ORDER, XP, SB)
        kc, ks, vc, vh, knorm, vscale, vzero = _load_w(cache32_ptr, pw, kvh, NUM_KV, HEAD_DIM, SLOT, KEY_BITS, V_BITS,
                                                       KBM, KB, VBM, VB, NF, BN, K_LAYOUT, V_LAYOUT, FW, XP, OFF32)
        pw = _pages_w(bt_row, tile + 3, seq_len, PPW, FL)
        if tile + 1 < tile_hi:
            m_i, l_part, acc = _step(bkc, bks, bvc, bvh, bknorm, bvscale, bvzero, tile + 1, seq_len, start, table, q3,
                                     qf, qc, m_i, l_part, acc, HEAD_DIM, KEY_BITS, V_BITS, KBM, BN, XL, V_SHAPE,
                                     V_ORDER, XP, SB)

    # merge the 4 warps: each its own max, sums and O^T
    m_f = gl.max(m_i, 0)  # [8]
    m_use = gl.where(m_f == float("-inf"), 0.0, m_f)
    w_scale = gl.exp2(m_i - m_use[None, :])  # [4, 8]; 0 for a warp that saw nothing
    w_scale = gl.where(m_i == float("-inf"), 0.0, w_scale)
    # C [w, 8 h8 + h, col]: the softmax sum is column 0 of both row halves, P x zero column 1 + h8
    c4 = gl.reshape(l_part, [4, 2, 8, 8])
    h8 = gl.arange(0, 2, layout=sliced(c4.type.layout, (1,), 4))[None, :, None, None]
    col = gl.arange(0, 8, layout=sliced(c4.type.layout, (3,), 4))[None, None, None, :]
    l_w = gl.convert_layout(gl.sum(gl.sum(gl.where(col == 0, c4, 0.0), 3), 1), ROWL)
    z_w = gl.convert_layout(gl.sum(gl.sum(gl.where(col == 1 + h8, c4, 0.0), 3), 1), ROWL)
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
    store_result(o, m_o, l_o, q_head, h_mask, offs_d, seq, split, num_splits, sinks_ptr, out_ptr, part_out_ptr,
                 part_lse_ptr, stride_ob, stride_oh, NUM_KV, GROUP, HEAD_DIM, HAS_SINKS, IS_SPLIT)
    if FUSED:
        _merge_if_last(cnt_ptr, part_out_ptr, part_lse_ptr, sinks_ptr, out_ptr, seq, kvh, num_splits, stride_ob,
                       stride_oh, NUM_KV, GROUP, HEAD_DIM, S_BLOCK, S_CHUNK, HAS_SINKS)


FORMATS = WARP_ORDER_FORMATS
"""Formats it decodes: centroid keys (4- or 3-bit) with 4- or 3-bit values, their planar pages in this kernel's
order (`turboquant.warp_plane_order`)."""
HEAD_DIMS = (64, 128)
"""Head dims it takes."""
MAX_GROUP = 8
"""Largest GQA group: the N of the score MMA is 8."""


def block_n(head_dim: int) -> int:
    """Tokens per tile: four pages per warp at head_dim 64 (256 tokens), two at head_dim 128 (128 tokens)."""
    return 256 if head_dim <= 64 else 128


REGISTERS = {"turboquant_4bit_nc": {64: 232, 128: 199}, "turboquant_k3v4_nc": {64: 221, 128: 200},
             "turboquant_3bit_nc": {64: 221, 128: 216}}
"""Registers per thread of the sm_90 compile by format and head_dim (the default tiles; the fused merge of up to
`MAX_FUSED_SPLITS` splits included): what the split count's wave size is computed from."""

FIRST_WAVE_WEIGHT = {"turboquant_3bit_nc": 1.125}
"""Tiles of a first-wave split relative to the others, by format (1 where absent). With 2 programs per SM the warp
schedulers favour the older program, so the split that starts second on an SM ends last; 3bit_nc's first-wave
splits take 18/16 of the tiles where that measured faster (bench/KERNELS.md)."""
FIRST_WAVE_MIN_TILES = 64
"""The first-wave weight applies only to calls whose splits average at least this many tiles over the block
table's span (with fewer it moves a tile or two and measured slower)."""
WAVE_UNIT = 16
"""`split_weights`' denominator: first-wave weights in steps of 1/16."""
MAX_FUSED_SPLITS = 32
"""Most splits the kernel merges itself (`_merge_if_last`), in one block of loads: the count at batch 1 with 8
KV heads. Calls with more splits take `launch.merge_splits`."""
_ARRIVALS: dict[torch.device, torch.Tensor] = {}


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


def arrival_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """int32 zeros, at least `n`: one counter per (sequence, KV head) of a fused-merge launch (`_merge_if_last`),
    one buffer per device. The last split of each group zeroes its counter, so the buffer is zero again whenever
    a launch ends; launches that share it must not overlap, which holds for one decode stream per device (graph
    replays included), not for fused launches on two streams at once. None while a CUDA graph is being captured
    and the buffer is missing or too small (memory allocated in a capture belongs to the graph's pool): that call
    takes the merge kernel, so warm up eagerly before capturing."""
    device = torch.device(device)
    buf = _ARRIVALS.get(device)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            return None
        buf = _ARRIVALS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


@functools.cache
def rotation_operand(fmt: str, head_dim: int, device: str) -> torch.Tensor:
    """fp16 [D, D], row j = column `int8_operand_order`[j] of Pi^T sqrt(D) (`turboquant.rotation_t_signs`,
    entries +-1): the B operand of `_rotated_query`, whose product then comes out in the score MMA's K order."""
    rot = rotation_t_signs(head_dim)[:, int8_operand_order(fmt, head_dim)]
    return rot.t().contiguous().to(device)


@functools.cache
def _table_word(fmt: str, device: str) -> torch.Tensor:
    """int32 [1]: the first word of the centroid keys' PRMT table (`turboquant.int8_table_word`), which the kernel
    loads into a register."""
    return torch.tensor([int8_table_word(tq_layout(fmt, 64).key_bits)], dtype=torch.int32).to(device)


@functools.cache
def kernel_constexprs(fmt: str, head_dim: int, group: int, num_kv_heads: int) -> dict:
    """The compile-time arguments that follow from the format and the shapes (a launch adds the per-call ones)."""
    lay = tq_layout(fmt, head_dim)
    return dict(GROUP=group, NUM_KV=num_kv_heads, HEAD_DIM=head_dim, **planar_constexprs(fmt, head_dim),
                I8_SCALE=int8_centroids(lay.key_bits)[1], I8_OFFSET=int8_offset(lay.key_bits))


def smem_bytes(head_dim: int) -> int:
    """Shared memory of one program (the compiler's scratch for layout conversions)."""
    return 128 * head_dim


def programs_per_sm(fmt: str, head_dim: int, device: torch.device) -> int:
    """Programs resident per SM (registers decide): 2 on an H200."""
    return resident_programs(REGISTERS[fmt][head_dim], smem_bytes(head_dim), 4, device)


def default_splits(fmt: str, batch: int, num_kv_heads: int, span_tokens: int, head_dim: int,
                   device: torch.device) -> int:
    """Splits per sequence over `span_tokens` (`launch.split_count`, one wave): a power of two unless that leaves
    more than 15% of the wave's slots empty."""
    return split_count(batch, num_kv_heads, span_tokens, block_n(head_dim), programs_per_sm(fmt, head_dim, device),
                       device, waves=(), pow2_fill=0.85)


def merge_blocks(splits: int, head_dim: int) -> dict:
    """`_merge_if_last`'s S_BLOCK (the split count rounded up to a power of two, at least 4) and S_CHUNK (the
    splits it loads at once: all of them up to `MAX_FUSED_SPLITS`)."""
    s_block = max(4, triton.next_power_of_2(splits))
    return {"S_BLOCK": s_block, "S_CHUNK": min(s_block, 4096 // head_dim)}


def split_weights(first_wave_weight: float) -> tuple[int, int]:
    """(W1, W2) of `_weighted_tiles` for a first-wave weight r: r in sixteenths against 16; (0, 0) for r = 1
    (equal splits, the (KV head, split, sequence) grid)."""
    if not 0.5 <= first_wave_weight <= 4.0:
        raise ValueError(f"a first-wave weight must be in [0.5, 4], got {first_wave_weight}")
    w1 = round(first_wave_weight * WAVE_UNIT)
    return (0, 0) if w1 == WAVE_UNIT else (w1, WAVE_UNIT)


def call_weights(fmt: str, head_dim: int, span_tokens: int, splits: int) -> tuple[int, int]:
    """(W1, W2) of one call: `split_weights` of the format's `FIRST_WAVE_WEIGHT` where its splits average at least
    `FIRST_WAVE_MIN_TILES` tiles over `span_tokens` (the block table's, no host sync), else (0, 0)."""
    if span_tokens < FIRST_WAVE_MIN_TILES * block_n(head_dim) * splits:
        return (0, 0)
    return split_weights(FIRST_WAVE_WEIGHT.get(fmt, 1.0))


def weighted_tiles(first_tile: int, end_tile: int, split: int, num_splits: int, group: int, num_groups: int,
                   num_sms: int, w1: int, w2: int) -> tuple[int, int]:
    """`_weighted_tiles` on the host (its tests)."""
    k = min(max((num_sms - group + num_groups - 1) // num_groups, 0), num_splits)
    total = w1 * k + w2 * (num_splits - k)
    lo = w1 * min(split, k) + w2 * max(split - k, 0)
    hi = w1 * min(split + 1, k) + w2 * max(split + 1 - k, 0)
    n = end_tile - first_tile
    return first_tile + n * lo // total, first_tile + n * hi // total


def decode(query: torch.Tensor, cache: torch.Tensor, fmt: str, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           *, q_scale: float, sliding_window: int | None, sinks: torch.Tensor | None, num_splits: int | None,
           out: torch.Tensor) -> torch.Tensor:
    """Run the kernel on a planar cache: `query` the raw query (the kernel rotates it), `q_scale` the softmax
    scale x log2(e). Split calls of up to `MAX_FUSED_SPLITS` splits merge in the kernel, others in
    `launch.merge_splits`. Inputs already validated by `tq_decode.decode_attention_tq`."""
    if fmt not in FORMATS:
        raise ValueError(f"the per-warp kernel decodes {' and '.join(FORMATS)} only, not {fmt}")
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = cache.shape[1]
    bn = block_n(head_dim)
    span_tokens = span(block_tables, PAGE, sliding_window, bn)
    splits = num_splits or default_splits(fmt, batch, num_kv_heads, span_tokens, head_dim, query.device)
    cx = kernel_constexprs(fmt, head_dim, num_q_heads // num_kv_heads, num_kv_heads)
    part_out, part_lse = split_partials(out, splits)
    counters = arrival_counters(cache.device, batch * num_kv_heads) if 1 < splits <= MAX_FUSED_SPLITS else None
    w1, w2 = call_weights(fmt, head_dim, span_tokens, splits)
    grid = (batch * num_kv_heads, splits) if w1 else (num_kv_heads, splits, batch)
    _tq_warp_kernel[grid](
        query, _table_word(fmt, str(cache.device)), rotation_operand(fmt, head_dim, str(cache.device)),
        cache.view(torch.int32), block_tables, seq_lens, sinks if sinks is not None else seq_lens, out, part_out,
        part_lse, counters if counters is not None else seq_lens, float(q_scale), int(sliding_window or 0), splits,
        sm_count(cache.device) if w1 else 0, query.stride(0), query.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), **cx, **layouts(cx["KBM"], head_dim, cx["V_BITS"], bn),
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None and (splits == 1 or counters is not None),
        IS_SPLIT=splits > 1, OFF32=cache.nbytes // 4 < 2**31, FUSED=counters is not None, WAVE_W1=w1, WAVE_W2=w2,
        **merge_blocks(splits if counters is not None else 1, head_dim), num_warps=4)
    if splits > 1 and counters is None:
        merge_splits(part_out, part_lse, sinks, out, splits)
    return out
