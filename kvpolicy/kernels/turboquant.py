"""TurboQuant-style KV formats: Lloyd-Max codebooks, the shared Hadamard rotation, kernel tables, PTX unpackers.

The four formats are vLLM's (`turboquant_k8v4`, `turboquant_4bit_nc`,
`turboquant_k3v4_nc`, `turboquant_3bit_nc`) with vLLM's slot sizes. Keys of the
centroid formats are rotated by one shared orthonormal randomised Hadamard
transform, normalised, and each coordinate is replaced by the index of its
Lloyd-Max centroid for N(0, 1/D); k8v4 keys are plain FP8 e4m3 of the raw key
(as in vLLM). Values are per-vector asymmetric uniform with fp16 scale and zero.

The slot and planar page layouts are `formats.py`'s.

Key codes are sign-magnitude, not the sorted centroid index: for b bits the
code is (negative << (b-1)) | r and means (-1)^negative * m[r], where m are the
2^(b-1) positive centroids in increasing order (the Lloyd-Max codebook of a
symmetric density is odd). The decoder then needs a table of 4 or 8 fp16
magnitudes, which fits in 2-4 registers and is read with byte permutes (PRMT)
plus an XOR of the sign bit.

Norm correction ("nc") is folded at store time: the stored fp16 norm is
||k|| / ||c[idx]||, so the decode kernel computes ||k|| * <q_rot, c[idx]/||c[idx]||>
with one multiply per token instead of re-normalising every key.

This module is plain data and numpy/torch set-up code; the kernels import it.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from kvpolicy.kernels.formats import (
    PAGE,
    WARP_ORDER_FORMATS,
    code_planes,
    field_planes,
    plane_kinds,
    tq_layout,
)

ROTATION_SEED = 0x7151
"""Seed of the Hadamard sign pattern: fixed so that a cache written today decodes tomorrow."""

LAZY_MAX_MARGIN = 4.0
"""The Hopper kernels' lazy softmax max: the reference max moves only when a score passes it by this much (log2
units), so P <= 2^4 and P x value scale stays finite in fp16 for value scales below 4094."""


# --- Lloyd-Max codebooks -----------------------------------------------------


def _gaussian_pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


@functools.lru_cache(maxsize=None)
def _unit_lloyd_max(bits: int, num_points: int = 400_001, half_width: float = 12.0) -> tuple[float, ...]:
    """Lloyd-Max centroids for N(0, 1), by Lloyd's iteration on a quadrature of the density.

    Cell masses and first moments come from cumulative trapezoid integrals of
    the pdf on a fine grid (interpolated at the boundaries), so the code needs
    only the density, not closed forms; tests check the result against the
    closed-form optimality conditions and Max's (1960) table.
    """
    x = np.linspace(-half_width, half_width, num_points)
    pdf = _gaussian_pdf(x)
    dx = x[1] - x[0]
    mass = np.concatenate([[0.0], np.cumsum((pdf[1:] + pdf[:-1]) * 0.5 * dx)])
    xpdf = x * pdf
    moment = np.concatenate([[0.0], np.cumsum((xpdf[1:] + xpdf[:-1]) * 0.5 * dx)])
    levels = 2**bits
    # Start from equal-mass cells' midpoints: close to optimal, so few iterations.
    c = np.interp((np.arange(levels) + 0.5) / levels * mass[-1], mass, x)
    for _ in range(20_000):
        b = 0.5 * (c[1:] + c[:-1])
        edges = np.concatenate([[x[0]], b, [x[-1]]])
        m = np.interp(edges, x, mass)
        g = np.interp(edges, x, moment)
        new = (g[1:] - g[:-1]) / (m[1:] - m[:-1])
        new = 0.5 * (new - new[::-1])  # the density is symmetric: keep the codebook exactly odd
        if np.max(np.abs(new - c)) < 1e-13:
            c = new
            break
        c = new
    return tuple(float(v) for v in c)


def lloyd_max_codebook(bits: int, head_dim: int) -> torch.Tensor:
    """Sorted Lloyd-Max centroids (float64, 2**bits of them) for one coordinate ~ N(0, 1/head_dim)."""
    if bits not in (1, 2, 3, 4):
        raise ValueError(f"codebook bits must be 1..4, got {bits}")
    return torch.tensor(_unit_lloyd_max(bits), dtype=torch.float64) / math.sqrt(head_dim)


def sign_magnitude_codes(index: torch.Tensor, bits: int) -> torch.Tensor:
    """Sorted centroid index (0 .. 2^b - 1) -> sign-magnitude code ((neg << (b-1)) | r)."""
    half = 2 ** (bits - 1)
    return torch.where(index >= half, index - half, (half - 1 - index) | half)


def sorted_index(code: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `sign_magnitude_codes`."""
    half = 2 ** (bits - 1)
    r = code & (half - 1)
    return torch.where(code & half != 0, half - 1 - r, half + r)


def sign_magnitude_codebook(bits: int, head_dim: int) -> torch.Tensor:
    """Centroid (float64, N(0, 1/head_dim) units) of every sign-magnitude code 0 .. 2^b - 1."""
    cb = lloyd_max_codebook(bits, head_dim)
    return cb[sorted_index(torch.arange(2**bits), bits)]


def codebook_boundaries(codebook: torch.Tensor) -> torch.Tensor:
    """Decision thresholds of a nearest-centroid quantizer: midpoints of adjacent centroids."""
    return 0.5 * (codebook[1:] + codebook[:-1])


def gaussian_mse(codebook: torch.Tensor, sigma: float, num_points: int = 200_001) -> float:
    """E[(X - Q(X))^2] for X ~ N(0, sigma^2) under nearest-centroid quantization (trapezoid quadrature)."""
    x = torch.linspace(-12 * sigma, 12 * sigma, num_points, dtype=torch.float64)
    pdf = torch.exp(-0.5 * (x / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
    idx = torch.searchsorted(codebook_boundaries(codebook).contiguous(), x)
    err = (x - codebook[idx]) ** 2 * pdf
    return float(torch.trapezoid(err, x))


# --- Hadamard rotation ---------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _signed_hadamard_np(head_dim: int) -> np.ndarray:
    """H_D diag(sigma) with entries +-1 (unnormalised), sigma a fixed random sign vector."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head_dim, got {head_dim}")
    h = np.array([[1.0]])
    while h.shape[0] < head_dim:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(ROTATION_SEED + head_dim).choice([-1.0, 1.0], size=head_dim)
    return h * signs[None, :]


def hadamard_rotation(head_dim: int, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu") -> torch.Tensor:
    """The shared orthonormal rotation Pi = H diag(sigma) / sqrt(D); a key k is stored as Pi k."""
    pi = torch.from_numpy(_signed_hadamard_np(head_dim) / math.sqrt(head_dim))
    return pi.to(dtype=dtype, device=device)


def rotation_t_signs(head_dim: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Pi^T * sqrt(D) in fp16: entries exactly +-1, so the in-kernel rotation `x @ this` is exact up to fp32 sums."""
    return torch.from_numpy(_signed_hadamard_np(head_dim).T.copy()).to(dtype=torch.float16, device=device)


@functools.lru_cache(maxsize=None)
def _kernel_tables_cpu(fmt: str, head_dim: int) -> dict[str, torch.Tensor]:
    lay = tq_layout(fmt, head_dim)
    kbits = 4 if lay.key_fp8 else lay.key_bits  # FP8 keys need no codebook; pass a valid dummy
    cb = lloyd_max_codebook(kbits, head_dim)
    return {
        # decode: unit-variance centroids (values ~0.1..2.7) keep fp16 precision; 1/sqrt(D) goes into
        # q's scale. Indexed by sign-magnitude code (the interpreter path's table lookup).
        "codebook_sm_unit_f16": (sign_magnitude_codebook(kbits, head_dim) * math.sqrt(head_dim)).to(torch.float16),
        # store: exact-in-fp32 rotation and thresholds in N(0, 1/D) units
        "codebook_f32": cb.to(torch.float32),
        "boundaries_f32": codebook_boundaries(cb).to(torch.float32),
        "rot_t_f32": hadamard_rotation(head_dim).T.contiguous().to(torch.float32),
        "rot_t_sign_f16": rotation_t_signs(head_dim),
        # store into planar pages: each (token of a page, slot byte)'s place in the page
        "planar_dest_i32": planar_destinations(fmt, head_dim).to(torch.int32).reshape(-1),
    }


def kernel_tables(fmt: str, head_dim: int, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Codebook, thresholds and rotation tensors the kernels read, on `device` (cached per device)."""
    return _kernel_tables_on(fmt, head_dim, str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _kernel_tables_on(fmt: str, head_dim: int, device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in _kernel_tables_cpu(fmt, head_dim).items()}


def allocate_tq_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, fmt: str,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """A paged cache for one layer: uint8 [num_blocks, block_size, num_kv_heads, slot_bytes] (uninitialised)."""
    lay = tq_layout(fmt, head_dim)
    return torch.empty((num_blocks, block_size, num_kv_heads, lay.slot_bytes), dtype=torch.uint8, device=device)


# --- planar pages ------------------------------------------------------------------------
#
# A second cache layout with the same bytes per token as vLLM's slots: uint8
# [num_blocks, num_kv_heads, block_size * slot_bytes], one page of one KV head per
# row, every part of the slot in a plane of the page's tokens:
#
#     [key code planes | value code planes | one plane of block_size fp16 per field
#      (key norm, value scale, value zero) | pad]
#
# 4-bit and FP8 codes are one plane (block_size rows of key_bytes); 3-bit codes are two,
# the 2-bit fields' rows and then the 1-bit fields' rows (`code_planes`). A head's page,
# and every plane in it, then starts on a 16-byte boundary (block_size 16), which TMA
# copies and 16-byte vector loads need; a slot of the NHD layout starts at
# head x slot_bytes, a multiple of 2 only. The Gluon kernels (`tq_gluon.py`, `tq_warp.py`)
# read this layout, `tq_store.store_kv_tq` writes both.

def warp_plane_order(kind: str, nbytes: int) -> torch.Tensor:
    """[PAGE, nbytes]: where in its plane each byte of each token's part goes, for the per-warp kernel
    (`tq_warp._load_w`), which then reads each thread's bytes of a page as one or two 16-, 8- or 4-byte
    vectors instead of one word per row (and gets the value bytes of two tokens already interleaved).
    Tokens t = 8 r8 + r = 8 r8 + 2 c + r1 (c the thread in its lane group, r the lane group):
    - "key" (4-bit codes or the 2-bit plane, words of `cw` = nbytes / 16 per quarter row): thread (r, c)'s
      quarter c of rows r and r + 8, together, at block 4 r + c (its lane);
    - "key1" (the 1-bit plane of 3-bit keys, the words of the 2-bit plane's quarters c and c + 2 of a row):
      half c mod 2 of rows r and r + 8, together;
    - "value" (4-bit codes or the 2-bit plane: group g = the thread's nbytes / 8 bytes; "value1", the 1-bit
      plane: group u of nbytes / 4 bytes, shared by threads u and u + 4) and "field" (one fp16, one group):
      the group's bytes of rows 2c, 2c + 1, 8 + 2c, 9 + 2c, together, as words that each hold byte pair q
      of token 2c + 8 r8 and then the same pair of token 2c + 8 r8 + 1."""
    t = torch.arange(PAGE)[:, None]
    b = torch.arange(nbytes)[None, :]
    r, r8, c, r1 = t % 8, t // 8, (t % 8) // 2, t % 2
    if kind in ("key", "key1"):
        cw = nbytes // (16 if kind == "key" else 8)
        w = b // 4
        # "key": block r * 4 + c (the lane), as the value plane's g * 4 + c, so that where both blocks have
        # the same size one address per page serves both; "key1": block c mod 2 of row r (shared by c, c + 2)
        block = r * 4 + w // cw if kind == "key" else w // cw * 8 + r
        return 4 * ((block * 2 + r8) * cw + w % cw) + b % 4
    group = {"value": nbytes // 8, "value1": nbytes // 4, "field": 2}[kind]
    g, q, y = b // group, (b % group) // 2, b % 2
    return (((((g * 4 + c) * 2 + r8) * (group // 2) + q) * 2 + r1) * 2) + y


@functools.lru_cache(maxsize=None)
def _planar_source(fmt: str, head_dim: int, block_size: int) -> torch.Tensor:
    """For every byte of a planar page, its source in the page's slots laid out token-major
    (token * slot_bytes + byte): the permutation between the two layouts. Within each plane the tokens' rows
    follow one another, or, for `WARP_ORDER_FORMATS`, `warp_plane_order`."""
    lay = tq_layout(fmt, head_dim)
    tok = torch.arange(block_size)
    fields = field_planes(fmt, head_dim)
    planes = list(code_planes(fmt, head_dim)) + [(off, 2) for off in fields]
    kinds = plane_kinds(fmt, head_dim) + ["field"] * len(fields)
    parts = []
    for (off, n), kind in zip(planes, kinds):
        src = (tok[:, None] * lay.slot_bytes + off + torch.arange(n)[None, :])
        if fmt in WARP_ORDER_FORMATS and block_size == PAGE:
            part = torch.empty(block_size * n, dtype=torch.long)
            part[warp_plane_order(kind, n).reshape(-1)] = src.reshape(-1)
            src = part
        parts.append(src.reshape(-1))
    used = lay.vscale_off + 4
    if lay.slot_bytes > used:
        parts.append((tok[:, None] * lay.slot_bytes + used + torch.arange(lay.slot_bytes - used)[None, :]).reshape(-1))
    src = torch.cat(parts)
    assert sorted(src.tolist()) == list(range(block_size * lay.slot_bytes))
    return src


def planar_destinations(fmt: str, head_dim: int, block_size: int = PAGE) -> torch.Tensor:
    """[block_size, slot_bytes]: where in its planar page each byte of each token's slot goes (the inverse of
    the planar permutation), for writing single tokens without converting whole pages."""
    slot = tq_layout(fmt, head_dim).slot_bytes
    return torch.argsort(_planar_source(fmt, head_dim, block_size)).view(block_size, slot)


def planar_from_slots(cache: torch.Tensor, fmt: str, head_dim: int) -> torch.Tensor:
    """The planar layout of an NHD slot cache [blocks, block_size, kv_heads, slot_bytes] (a new tensor)."""
    nb, bs, h, slot = cache.shape
    pages = cache.permute(0, 2, 1, 3).reshape(nb, h, bs * slot)
    return pages[..., _planar_source(fmt, head_dim, bs).to(cache.device)].contiguous()


def slots_from_planar(cache: torch.Tensor, fmt: str, head_dim: int, block_size: int = PAGE) -> torch.Tensor:
    """The NHD slot layout [blocks, block_size, kv_heads, slot_bytes] of a planar cache (a new tensor)."""
    nb, h, _ = cache.shape
    slot = tq_layout(fmt, head_dim).slot_bytes
    pages = torch.empty_like(cache)
    pages[..., _planar_source(fmt, head_dim, block_size).to(cache.device)] = cache
    return pages.view(nb, h, block_size, slot).permute(0, 2, 1, 3).contiguous()


def allocate_tq_planar_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, fmt: str,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """A planar paged cache for one layer: uint8 [num_blocks, num_kv_heads, block_size * slot_bytes]."""
    lay = tq_layout(fmt, head_dim)
    return torch.empty((num_blocks, num_kv_heads, block_size * lay.slot_bytes), dtype=torch.uint8, device=device)


def capacity_ratio(fmt: str, head_dim: int) -> float:
    """Tokens that fit per byte relative to BF16 K+V: 4*D / slot_bytes."""
    return 4 * head_dim / tq_layout(fmt, head_dim).slot_bytes


def turboquant_mse_bound(bits: int) -> float:
    """The TurboQuant paper's MSE bound for unit vectors: (sqrt(3) pi / 2) 4^-b."""
    return math.sqrt(3) * math.pi / 2 * 4.0**-bits


# --- register look-up programs (PTX) ------------------------------------------------
#
# The decode kernel unpacks codes with short PTX programs run by
# `tl.inline_asm_elementwise(pack=4)`: one instance gets 4 packed bytes per
# input in one 32-bit register and returns fp16 pairs. They are kept here as
# data, (op, dst, src...) with ops and/shl/shr/prmt/lop3/mad/mov on .b32 and hsub2
# (sub.f16x2), so that
# `render_ptx` emits them and `tq_reference.emulate_ptx` checks them bit for bit
# on the CPU. Outputs follow Triton's packing: output k uses registers
# $2k, $2k+1 (elements 0,1 and 2,3; element 0 in the low half).

PtxOp = tuple

MAGIC_1024 = 0x64006400
"""Two fp16 1024.0: OR-ing a small integer n into the low mantissa bits gives 1024 + n exactly."""


def _f16_bits(x: float) -> int:
    return int(torch.tensor([x], dtype=torch.float16).view(torch.int16).item()) & 0xFFFF


def _magnitude_words(bits: int) -> list[int]:
    """fp16 bit patterns of the positive unit-variance centroids m[0..2^(b-1)-1]."""
    return [_f16_bits(v) for v in _unit_lloyd_max(bits)[2 ** (bits - 1):]]


def k4_program() -> list[PtxOp]:
    """4-bit sign-magnitude key codes: in $4 = 4 bytes (low/high nibbles); out lo ($0,$1) and hi ($2,$3) fp16 centroids."""
    m = _magnitude_words(4)
    lo = [w & 0xFF for w in m]
    hi = [w >> 8 for w in m]
    la = lo[0] | lo[1] << 8 | lo[2] << 16 | lo[3] << 24
    lb = lo[4] | lo[5] << 8 | lo[6] << 16 | lo[7] << 24
    ha = hi[0] | hi[1] << 8 | hi[2] << 16 | hi[3] << 24
    hb = hi[4] | hi[5] << 8 | hi[6] << 16 | hi[7] << 24
    sign = 0x80008000
    xor_masked = 0x78  # lop3: a ^ (b & c)
    return [
        ("and", "s0", "$4", 0x7777),  # magnitude selectors of nibbles [l0, h0, l1, h1]
        ("shr", "s1", "$4", 16),
        ("and", "s1", "s1", 0x7777),  # [l2, h2, l3, h3]
        ("prmt", "p0", la, lb, "s0"),  # low bytes of m[r]
        ("prmt", "q0", ha, hb, "s0"),  # high bytes
        ("prmt", "p1", la, lb, "s1"),
        ("prmt", "q1", ha, hb, "s1"),
        ("prmt", "$0", "p0", "q0", 0x6240),  # fp16 pair [m(l0), m(l1)]
        ("prmt", "$2", "p0", "q0", 0x7351),  # [m(h0), m(h1)]
        ("prmt", "$1", "p1", "q1", 0x6240),
        ("prmt", "$3", "p1", "q1", 0x7351),
        ("prmt", "y", "$4", 0, 0x1404),  # byte0 -> bits 8..15, byte1 -> 24..31: high-nibble sign bits at 15, 31
        ("prmt", "z", "$4", 0, 0x3424),
        ("lop3", "$2", "$2", "y", sign, xor_masked),
        ("lop3", "$3", "$3", "z", sign, xor_masked),
        ("shl", "y", "y", 4),  # low-nibble sign bits (3, 11 of a byte pair) to 15, 31
        ("shl", "z", "z", 4),
        ("lop3", "$0", "$0", "y", sign, xor_masked),
        ("lop3", "$1", "$1", "z", sign, xor_masked),
    ]


def k3_program() -> list[PtxOp]:
    """3-bit sign-magnitude keys: in $8 = 2-bit plane bytes (r of quarter s at bits 2s..2s+1),
    $9 = sign bytes (quarter s at bit 2s); out quarter s as fp16 centroids in ($2s, $2s+1)."""
    m = _magnitude_words(3)
    ma = m[0] | m[1] << 16
    mb = m[2] | m[3] << 16
    prog: list[PtxOp] = [
        ("prmt", "y", "$9", 0, 0x1404),  # sign bytes 0, 1 -> bits 8.., 24..
        ("prmt", "z", "$9", 0, 0x3424),  # sign bytes 2, 3
    ]
    for s in range(4):
        prog += [
            ("shr", "r", "$8", 2 * s),
            ("and", "r", "r", 0x03030303),
            # byte k becomes the PRMT selector pair (2r, 2r+1): the fp16 m[r] in {mb, ma}
            ("mad", "r", "r", 0x22, 0x10101010),
            ("prmt", f"${2 * s}", ma, mb, "r"),
            ("shr", "r", "r", 16),
            ("prmt", f"${2 * s + 1}", ma, mb, "r"),
            ("shl", "t", "y", 7 - 2 * s),
            ("lop3", f"${2 * s}", f"${2 * s}", "t", 0x80008000, 0x78),
            ("shl", "t", "z", 7 - 2 * s),
            ("lop3", f"${2 * s + 1}", f"${2 * s + 1}", "t", 0x80008000, 0x78),
        ]
    return prog


def v4_program() -> list[PtxOp]:
    """4-bit value codes: in $4 = 4 bytes; out ($0,$1) = low nibble, ($2,$3) = 16 * high nibble, exact fp16.

    The 1024 offset is subtracted in fp16 (exact) rather than after the product: carried through
    the tensor-core accumulator it would amplify the accumulator's rounding about 1024/7.5-fold."""
    or_masked = 0xEA  # lop3: (a & b) | c
    return [
        ("mov", "m", MAGIC_1024),
        ("prmt", "a", "$4", 0, 0x4140),  # bytes 0, 1 into the two 16-bit lanes
        ("prmt", "b", "$4", 0, 0x4342),
        ("lop3", "$0", "a", 0x000F000F, "m", or_masked),
        ("lop3", "$1", "b", 0x000F000F, "m", or_masked),
        ("lop3", "$2", "a", 0x00F000F0, "m", or_masked),  # the high nibble stays in place: 16 * code
        ("lop3", "$3", "b", 0x00F000F0, "m", or_masked),
        ("hsub2", "$0", "$0", "m"),
        ("hsub2", "$1", "$1", "m"),
        ("hsub2", "$2", "$2", "m"),
        ("hsub2", "$3", "$3", "m"),
    ]


def i8_program() -> list[PtxOp]:
    """int8 codes (the per-token-head formats): in $2 = 4 signed bytes; out ($0, $1) the same four values as exact
    fp16. The sign bit flipped makes each byte x + 128; under exponent 2^10 that is 1024 + x + 128, and 1152 is
    subtracted in fp16 (exact): 5 ops per word where a conversion instruction per value runs at quarter rate."""
    xor = 0x3C  # lop3: a ^ b
    return [
        ("mov", "m", 0x64806480),  # two fp16 1152.0
        ("lop3", "t", "$2", 0x80808080, 0, xor),
        ("prmt", "$0", "t", 0x64646464, 0x5140),  # [0x64 byte1 0x64 byte0]
        ("prmt", "$1", "t", 0x64646464, 0x5342),
        ("hsub2", "$0", "$0", "m"),
        ("hsub2", "$1", "$1", "m"),
    ]


def nibbles_program() -> list[PtxOp]:
    """int4_per_token_head key bytes: in $2 = 4 bytes; out $0 = their low nibbles, $1 = their high nibbles, each
    as 4 bytes (0..15) for an int8 MMA."""
    return [
        ("and", "$0", "$2", 0x0F0F0F0F),
        ("shr", "t", "$2", 4),
        ("and", "$1", "t", 0x0F0F0F0F),
    ]


def v3_program() -> list[PtxOp]:
    """3-bit value codes: in $8 = 2-bit plane bytes, $9 = high-bit bytes (quarter s at bit 2s);
    out quarter s = 4^s * code in ($2s, $2s+1), exact fp16: the code's bits stay where they are."""
    prog: list[PtxOp] = [
        ("mov", "m", MAGIC_1024),
        ("prmt", "a", "$8", 0, 0x4140),
        ("prmt", "b", "$8", 0, 0x4342),
        ("prmt", "c", "$9", 0, 0x4140),
        ("prmt", "d", "$9", 0, 0x4342),
        ("shl", "c", "c", 2),  # high bit of quarter s: 2s -> 2s + 2, just above its two low bits
        ("shl", "d", "d", 2),
    ]
    for s in range(4):
        low = (0x3 << (2 * s)) * 0x00010001
        high = (0x4 << (2 * s)) * 0x00010001
        prog += [
            ("lop3", "t", "c", high, "m", 0xEA),
            ("lop3", f"${2 * s}", "a", low, "t", 0xEA),
            ("lop3", "t", "d", high, "m", 0xEA),
            ("lop3", f"${2 * s + 1}", "b", low, "t", 0xEA),
            ("hsub2", f"${2 * s}", f"${2 * s}", "m"),
            ("hsub2", f"${2 * s + 1}", f"${2 * s + 1}", "m"),
        ]
    return prog


SUBNORMAL_UNIT = 2.0**-24
"""The fp16 value of mantissa bit 0 under a zero exponent: a code n < 1024 in a half's low 10 bits reads n x 2^-24."""

SELECT = 0xE4
"""lop3 table of (a & c) | (b & ~c): a's bits where the mask c is set, b's elsewhere."""


def v4_subnormal_program() -> list[PtxOp]:
    """4-bit value codes as exact fp16 subnormals, 5 ops per word (v4_program: 11): in $4 = 4 bytes; out
    $0 = low nibbles of bytes (0, 2), $1 = of bytes (1, 3), $2 / $3 = 16 x the high nibbles, each half
    code x 2^-24 (`SUBNORMAL_UNIT`): the bits stay where they are and the exponent field stays 0, so no
    offset is added or subtracted. Bytes come in the order (0, 2, 1, 3); a kernel that stores them
    so permutes its head-dim coordinates to match (`tq_gluon`)."""
    return [
        ("shr", "t", "$4", 8),
        ("and", "$0", "$4", 0x000F000F),
        ("and", "$1", "t", 0x000F000F),
        ("and", "$2", "$4", 0x00F000F0),
        ("and", "$3", "t", 0x00F000F0),
    ]


def v3_subnormal_program() -> list[PtxOp]:
    """3-bit value codes as exact fp16 subnormals, 19 ops per 16 codes (v3_program: 31): in $8 = 2-bit plane
    bytes, $9 = high-bit bytes (quarter s at bit 2s); out $2s = quarter s of bytes (0, 2), $2s+1 = of
    bytes (1, 3), each half 4^s x code x 2^-24: the two low bits stay at 2s, 2s+1 and the high bit is
    moved to 2s+2 (one shift per word), so a quarter is one select and one mask per pair of bytes."""
    prog: list[PtxOp] = [
        ("shl", "c", "$9", 2),  # high bits of bytes 0, 2 to 2s + 2
        ("shr", "a", "$8", 8),  # bytes 1, 3 into the two halves
        ("shr", "d", "$9", 6),  # their high bits to 2s + 2 (bit 30 of $9 would leave a left shift)
    ]
    for s in range(4):
        low = (0x3 << (2 * s)) * 0x00010001
        keep = (0x7 << (2 * s)) * 0x00010001
        prog += [
            ("lop3", "t", "$8", "c", low, SELECT),
            ("and", f"${2 * s}", "t", keep),
            ("lop3", "t", "a", "d", low, SELECT),
            ("and", f"${2 * s + 1}", "t", keep),
        ]
    return prog


def subnormal_byte_order(index):
    """Where value code byte order (0, 2, 1, 3) puts position `index` of a row (works on ints and tensors):
    positions 4w + (0, 1, 2, 3) hold bytes 4w + (0, 2, 1, 3), i.e. bits 0 and 1 swapped; its own inverse."""
    return (index & ~3) | ((index & 1) << 1) | ((index >> 1) & 1)


# --- int8 centroid keys (the per-warp Gluon kernel's score MMA) -------------------------------------------
#
# The per-warp kernel (`tq_warp.py`) multiplies centroid keys as int8 against an int8 query (two bytes per
# coordinate, hi and lo), so a look-up yields 4 codes per 32-bit register instead of 2 and the score MMA is an
# int8 mma.sync.
# For 4-bit keys byte b stands for (b + 1/2) / S: then ~b = -b - 1 stands for exactly -(b + 1/2) / S, so the
# sign of a sign-magnitude code is one XOR, and the 1/2 becomes one per-head constant (1/2 x the sum of the
# query). The 3-bit table is read whole by PRMT (sign included), so it holds -b and needs no offset
# (`int8_offset`).


def int8_offset(bits: int) -> float:
    """What the int8 score path adds to a table byte: 1/2 for 4-bit keys, whose sign is an XOR of the magnitude
    byte (~b = -b - 1 stands for -(b + 1/2) only with the half), 0 for 3-bit keys, whose PRMT table holds
    each negative byte as it is (-b). A kernel adds offset x sum(query) to each score: 3-bit keys need no add."""
    return 0.5 if bits == 4 else 0.0


@functools.lru_cache(maxsize=None)
def int8_centroids(bits: int) -> tuple[tuple[int, ...], float]:
    """(bytes b_r, S): unit-variance magnitudes m_r ~ (b_r + `int8_offset`) / S, with S chosen (b_r <= 127) to
    make the largest error over the 2^(b-1) magnitudes smallest: 0.0057 for 4 bits, 0.0015 for 3 (unit sigma;
    the 4-bit codebook's own RMS error is 0.097). A half-integer grid for 3 bits would give 0.0014."""
    off = int8_offset(bits)
    m = np.array(_unit_lloyd_max(bits)[2 ** (bits - 1):])
    scales = np.linspace(8.0, (127.0 + off) / m[-1], 200_001)
    x = scales[:, None] * m[None, :] - off
    err = (np.abs(x - np.round(x)) / scales[:, None]).max(axis=1)
    s = float(scales[int(np.argmin(err))])
    return tuple(int(v) for v in np.round(s * m - off)), s


def int8_centroid_codebook(bits: int) -> torch.Tensor:
    """float64 [2^b]: the unit-variance value of each sign-magnitude code in the int8 score path (the
    counterpart of `sign_magnitude_codebook(bits, 1)`): +-(b_r + `int8_offset`) / S."""
    b, s = int8_centroids(bits)
    code = torch.arange(2**bits)
    half = 2 ** (bits - 1)
    mags = (torch.tensor(b, dtype=torch.float64)[code % half] + int8_offset(bits)) / s
    return torch.where(code >= half, -mags, mags)


def _int8_table(bits: int) -> tuple[int, int]:
    """The 8 signed table bytes as two PRMT words: codes 0-7 of the 3-bit table (4 magnitudes, then their
    negatives), or the 8 magnitudes of the 4-bit table (signs by XOR)."""
    b, _ = int8_centroids(bits)
    table = list(b) if bits == 4 else list(b) + [-v & 0xFF for v in b]
    return (table[0] | table[1] << 8 | table[2] << 16 | table[3] << 24,
            table[4] | table[5] << 8 | table[6] << 16 | table[7] << 24)


def int8_table_word(bits: int) -> int:
    """The first word of `_int8_table` (table bytes 0-3, all below 128: a non-negative int32), which the int8
    programs take as an input register ($3 of `k4_int8_program`, $6 of `k3_int8_program`) rather than as
    an immediate: ptxas would otherwise rematerialise it before every PRMT."""
    return _int8_table(bits)[0]


XOR = 0x3C
"""lop3 table of a ^ b."""
OR_MASKED = 0xEA
"""lop3 table of (a & b) | c."""


def k4_int8_program() -> list[PtxOp]:
    """4-bit sign-magnitude keys to signed bytes, 10 ops per word of 8 codes: in $2 = 4 code bytes, $3 =
    `int8_table_word(4)`; out $0 = the bytes of nibbles 0-3 (byte 0 low, byte 0 high, byte 1 low, byte 1
    high), $1 = of nibbles 4-7. The magnitude is one PRMT (its selector nibbles are the codes with the sign
    masked); the sign is a byte mask from PRMT's sign-replicate mode on the code bytes (bit 7 of w << 4 is
    nibble 0's sign bit) and one XOR."""
    _, tb = _int8_table(4)
    return [
        ("shl", "t", "$2", 4),
        ("and", "s", "$2", 0x7777),
        ("prmt", "$0", "$3", tb, "s"),
        ("prmt", "m", "t", "$2", 0xD9C8),  # sign of nibble i -> 0xFF in byte i
        ("lop3", "$0", "$0", "m", 0, XOR),
        ("shr", "s", "$2", 16),
        ("and", "s", "s", 0x7777),
        ("prmt", "$1", "$3", tb, "s"),
        ("prmt", "m", "t", "$2", 0xFBEA),
        ("lop3", "$1", "$1", "m", 0, XOR),
    ]


def k3_int8_program() -> list[PtxOp]:
    """3-bit sign-magnitude keys to signed bytes, 13 ops per 16 codes: in $4 = 2-bit plane bytes (quarter s
    at bits 2s, 2s+1), $5 = their sign bytes (quarter s at bit 2s, as for `k3_program`), $6 =
    `int8_table_word(3)`. Out $0 / $1: quarters 0 and 2 of bytes 0-1 / 2-3 (byte 0 q0, byte 0 q2, byte 1
    q0, byte 1 q2), $2 / $3: quarters 1 and 3. Each selector nibble is a whole 3-bit code (the sign moved to
    bit 2), read from the 8-byte signed table by one PRMT."""
    _, tb = _int8_table(3)
    return [
        ("shl", "t", "$5", 2),
        ("and", "t", "t", 0x44444444),
        ("lop3", "x", "$4", 0x33333333, "t", OR_MASKED),  # nibbles: quarters 0, 2 with their signs
        ("shr", "y", "$4", 2),
        ("and", "t", "$5", 0x44444444),
        ("lop3", "y", "y", 0x33333333, "t", OR_MASKED),  # quarters 1, 3
        ("prmt", "$0", "$6", tb, "x"),
        ("shr", "x", "x", 16),
        ("prmt", "$1", "$6", tb, "x"),
        ("prmt", "$2", "$6", tb, "y"),
        ("shr", "y", "y", 16),
        ("prmt", "$3", "$6", tb, "y"),
    ]


def int8_operand_order(fmt: str, head_dim: int) -> torch.Tensor:
    """The head coordinate at each K index of the Gluon kernel's int8 score MMA, for centroid keys.

    Thread c of a quad holds bytes [c w, (c + 1) w) of its key rows' first code plane (w = plane bytes / 4),
    i.e. words m = 0 .. w/4 - 1; the int8 program turns word m into G = 2 (4-bit) or 4 (3-bit) registers g of
    four codes i. The int8 A operand wants K indices 32 k + 16 h + 4 c + i in register (k, h) of thread c,
    so register g of word m is given K = 16 (m G + g) + 4 c + i (a register relabelling, no data movement),
    and the query is stored in this order."""
    lay = tq_layout(fmt, head_dim)
    if lay.key_bits not in (3, 4):
        raise ValueError(f"{fmt}: int8 keys are for centroid formats")
    g_n = 2 if lay.key_bits == 4 else 4
    plane = head_dim // 2 if lay.key_bits == 4 else head_dim // 4
    w = plane // 4
    k = torch.arange(head_dim)
    r, c, i = k // 16, (k // 4) % 4, k % 4
    m, g = r // g_n, r % g_n
    if lay.key_bits == 4:
        byte = c * w + 4 * m + (4 * g + i) // 2
        return byte + (i % 2) * (head_dim // 2)
    quarter = 2 * (i % 2) + g // 2
    byte = c * w + 4 * m + 2 * (g % 2) + i // 2
    return quarter * (head_dim // 4) + byte


_PTX_NAMES = {"and": "and.b32", "shl": "shl.b32", "shr": "shr.b32", "prmt": "prmt.b32", "lop3": "lop3.b32",
              "mad": "mad.lo.u32", "mov": "mov.b32", "hsub2": "sub.f16x2"}


def render_ptx(prog: list[PtxOp]) -> str:
    """PTX text of a register program, temporaries declared in a local scope."""
    temps = sorted({op[1] for op in prog if not str(op[1]).startswith("$")})
    lines = ["{"]
    if temps:
        lines.append(".reg .b32 " + ", ".join(temps) + ";")
    for op in prog:
        args = [a if isinstance(a, str) else hex(a) for a in op[1:]]
        lines.append(f"{_PTX_NAMES[op[0]]} {', '.join(args)};")
    lines.append("}")
    return "\n".join(lines)
