"""Store kernel: quantize new tokens' K/V and pack them into a paged TurboQuant cache.

One program codes the keys of BLOCK_T tokens of one KV head, another their values. The keys are rotated by the
shared randomised Hadamard matrix Pi = H diag(sigma) / sqrt(D) as a Walsh-Hadamard transform in registers (fp32
butterflies: the codes match the float64 reference except at ties within rounding; no matrix is read, and a
decode step's single token is one program of one row, where a tensor-core product needs 16). Then it picks the
Lloyd-Max code of every coordinate, folds the norm correction into the stored fp16 norm, codes the values per
vector, and writes whole slots. Layouts are in `formats.py`.
K/V are saturated to the fp16 range first, and the stored norm too, so that finite
input never stores an infinite norm, scale or zero point (one inf poisons every
score or value of the head it lands in).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpolicy.kernels.reductions import rmax, rmin, rsum
from kvpolicy.kernels.formats import F16_MAX, FP8_E4M3_MAX, tq_layout
from kvpolicy.kernels.formats import PAGE as PLANAR_PAGE
from kvpolicy.kernels.guards import check_slots
from kvpolicy.kernels.turboquant import kernel_tables

_F16_MAX = tl.constexpr(F16_MAX)


@triton.jit
def _at(base, dest, cols, valid, PLANAR: tl.constexpr):
    """Byte addresses [BLOCK_T, len(cols)] of slot bytes `cols` of each token: in its page (`dest`: the
    token's row of the destination table) or in its slot."""
    if PLANAR:
        return base[:, None] + tl.load(dest[:, None] + cols[None, :], mask=valid[:, None], other=0)
    return base[:, None] + cols[None, :]


@triton.jit
def _at16(base, dest, off, valid, PLANAR: tl.constexpr):
    """fp16 addresses [BLOCK_T] of the field at slot byte `off` (every layout keeps a field's two bytes together,
    2-byte aligned)."""
    if PLANAR:
        return (base + tl.load(dest + off, mask=valid, other=0)) >> 1
    return (base + off) >> 1


@triton.jit
def _store_kv_tq_kernel(
    # tensors
    key_ptr, value_ptr, cache_u8_ptr, cache_f16_ptr, slot_ptr,
    rot_ptr, bnd_ptr, cb_ptr, dest_ptr, rot_scale,
    # sizes and strides (elements of key/value, bytes of the cache)
    num_tokens, stride_kt, stride_kh, stride_vt, stride_vh, row_bytes,
    # layout
    HEAD_DIM: tl.constexpr, SLOT: tl.constexpr, KEY_BITS: tl.constexpr, V_BITS: tl.constexpr,
    V_OFF: tl.constexpr, KNORM_OFF: tl.constexpr, VSCALE_OFF: tl.constexpr, VZERO_OFF: tl.constexpr,
    FP8_MAX: tl.constexpr,
    # planar pages (turboquant.py): [blocks, kv_heads, PAGE * SLOT]; dest_ptr holds, for each token of a
    # page and each byte of its slot, the byte's place in the page (`turboquant.planar_destinations`)
    PLANAR: tl.constexpr, PAGE: tl.constexpr, NUM_KV: tl.constexpr,
    # tiling
    BLOCK_T: tl.constexpr,
    LOG_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    head = tl.program_id(1)
    part = tl.program_id(2)  # 0: the keys, 1: the values (independent: two programs halve a token's latency)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + offs_t, mask=offs_t < num_tokens, other=-1)
    valid = slot >= 0
    # int64: a cache of a long batch is larger than 2 GiB
    if PLANAR:
        blk = slot.to(tl.int64) // PAGE
        base = (blk * NUM_KV + head) * (PAGE * SLOT)  # the page
        dest = dest_ptr + (slot % PAGE) * SLOT  # where the page holds each byte of this token's slot
    else:
        base = slot.to(tl.int64) * row_bytes + head * SLOT  # the slot
        dest = dest_ptr  # unused
    cols = tl.arange(0, HEAD_DIM)
    k_row = key_ptr + offs_t.to(tl.int64)[:, None] * stride_kt + head * stride_kh
    v_row = value_ptr + offs_t.to(tl.int64)[:, None] * stride_vt + head * stride_vh

    if part == 0:
        _store_keys(k_row, cache_u8_ptr, cache_f16_ptr, rot_ptr, bnd_ptr, cb_ptr, rot_scale, base, dest, valid, cols,
                    HEAD_DIM, KEY_BITS, KNORM_OFF, FP8_MAX, PLANAR, BLOCK_T, LOG_D)
    else:
        _store_values(v_row, cache_u8_ptr, cache_f16_ptr, base, dest, valid, cols, HEAD_DIM, V_BITS, V_OFF,
                      VSCALE_OFF, VZERO_OFF, PLANAR, BLOCK_T)


@triton.jit
def _signed_chunk(k_row, rot_ptr, c: tl.constexpr, cols_c, valid, HEAD_DIM: tl.constexpr, C: tl.constexpr):
    """sigma * k over coordinates c*C .. c*C+C-1 (saturated to fp16's range), and its squared norm per token.
    sigma_j is column 0 of Pi^T sqrt(D) = diag(sigma) H^T (H's first row is all ones)."""
    k = tl.load(k_row + (c * C + cols_c)[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    k = tl.minimum(tl.maximum(k, -_F16_MAX), _F16_MAX)
    sigma = tl.load(rot_ptr + (c * C + cols_c) * HEAD_DIM).to(tl.float32)
    return k * sigma[None, :], rsum(k * k, axis=1)


@triton.jit
def _fwht(x, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """Unnormalised Walsh-Hadamard transform (Sylvester order) of each row of x [ROWS, N]: butterflies of
    distance 1, 2, 4, ... as reshapes, so no matrix is read and any number of rows works."""
    for s in tl.static_range(LOG_N):
        y = tl.permute(tl.reshape(x, [ROWS * (N >> (s + 1)), 2, 1 << s]), (0, 2, 1))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [ROWS, N])
    return x


@triton.jit
def _store_keys(k_row, cache_u8_ptr, cache_f16_ptr, rot_ptr, bnd_ptr, cb_ptr, rot_scale, base, dest, valid, cols,
                HEAD_DIM: tl.constexpr, KEY_BITS: tl.constexpr, KNORM_OFF: tl.constexpr, FP8_MAX: tl.constexpr,
                PLANAR: tl.constexpr, BLOCK_T: tl.constexpr, LOG_D: tl.constexpr):
    if KEY_BITS == 8:
        k = tl.load(k_row + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        k = tl.minimum(tl.maximum(k, -FP8_MAX), FP8_MAX)  # saturate like vLLM's satfinite cast
        kb = k.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(cache_u8_ptr + _at(base, dest, cols, valid, PLANAR), kb, mask=valid[:, None])
    else:
        NCH: tl.constexpr = 2 if KEY_BITS == 4 else 4
        C: tl.constexpr = HEAD_DIM // NCH
        LOG_C: tl.constexpr = LOG_D - 1 if KEY_BITS == 4 else LOG_D - 2
        E: tl.constexpr = HEAD_DIM // 8
        HALF: tl.constexpr = 2 ** (KEY_BITS - 1)
        cols_c = tl.arange(0, C)
        # Pi k = H (sigma * k) / sqrt(D): each chunk's Walsh-Hadamard transform in registers, then the last one or
        # two butterfly stages across chunks give the rotated chunks (fp32 sums, as the reference's up to rounding)
        x0, n0 = _signed_chunk(k_row, rot_ptr, 0, cols_c, valid, HEAD_DIM, C)
        x1, n1 = _signed_chunk(k_row, rot_ptr, 1, cols_c, valid, HEAD_DIM, C)
        a0 = _fwht(x0, BLOCK_T, C, LOG_C)
        a1 = _fwht(x1, BLOCK_T, C, LOG_C)
        if NCH == 2:
            knorm = tl.sqrt(n0 + n1)
            u0 = a0 + a1
            u1 = a0 - a1
            u2 = u0
            u3 = u1
        else:
            x2, n2 = _signed_chunk(k_row, rot_ptr, 2, cols_c, valid, HEAD_DIM, C)
            x3, n3 = _signed_chunk(k_row, rot_ptr, 3, cols_c, valid, HEAD_DIM, C)
            a2 = _fwht(x2, BLOCK_T, C, LOG_C)
            a3 = _fwht(x3, BLOCK_T, C, LOG_C)
            knorm = tl.sqrt(n0 + n1 + n2 + n3)
            u0 = (a0 + a1) + (a2 + a3)
            u1 = (a0 - a1) + (a2 - a3)
            u2 = (a0 + a1) - (a2 + a3)
            u3 = (a0 - a1) - (a2 - a3)
        inv = tl.where(knorm > 0, 1.0 / tl.where(knorm > 0, knorm, 1.0), 0.0)
        csq = tl.full([BLOCK_T], 0, dtype=tl.float32)
        packed = tl.full([BLOCK_T, C], 0, dtype=tl.int32)  # 4-bit codes, or the 2-bit plane
        plane1 = tl.full([BLOCK_T, E], 0, dtype=tl.int32)
        for c in tl.static_range(NCH):
            if c == 0:
                u = u0
            elif c == 1:
                u = u1
            elif c == 2:
                u = u2
            else:
                u = u3
            u = u * (inv * rot_scale)[:, None]
            idx = tl.full([BLOCK_T, C], 0, dtype=tl.int32)
            for lvl in tl.static_range(2**KEY_BITS - 1):
                idx += (u > tl.load(bnd_ptr + lvl)).to(tl.int32)
            cval = tl.load(cb_ptr + idx)
            csq += rsum(cval * cval, axis=1)
            # sign-magnitude code: the decoder's register table holds only the positive half
            idx = tl.where(idx >= HALF, idx - HALF, (HALF - 1 - idx) | HALF)
            if KEY_BITS == 4:
                packed = packed | (idx << (4 * c))
            else:
                packed = packed | ((idx & 3) << (2 * c))
                # quarter c holds coordinates c*D/4 + j; its two halves are bits 2c and 2c+1 of plane byte j mod D/8
                hb = tl.reshape((idx >> 2) & 1, [BLOCK_T, 2, E])
                half = tl.arange(0, 2)
                plane1 = plane1 | rsum(hb << (half[None, :, None] + 2 * c), axis=1)
        tl.store(cache_u8_ptr + _at(base, dest, cols_c, valid, PLANAR), packed.to(tl.uint8), mask=valid[:, None])
        if KEY_BITS == 3:
            cols_e = HEAD_DIM // 4 + tl.arange(0, E)  # the 1-bit plane follows the 2-bit one in the slot
            tl.store(cache_u8_ptr + _at(base, dest, cols_e, valid, PLANAR), plane1.to(tl.uint8),
                     mask=valid[:, None])
        stored = tl.minimum(knorm / tl.sqrt(csq), _F16_MAX)
        tl.store(cache_f16_ptr + _at16(base, dest, KNORM_OFF, valid, PLANAR), stored.to(tl.float16), mask=valid)


@triton.jit
def _store_values(v_row, cache_u8_ptr, cache_f16_ptr, base, dest, valid, cols, HEAD_DIM: tl.constexpr,
                  V_BITS: tl.constexpr, V_OFF: tl.constexpr, VSCALE_OFF: tl.constexpr, VZERO_OFF: tl.constexpr,
                  PLANAR: tl.constexpr, BLOCK_T: tl.constexpr):
    LEVELS: tl.constexpr = 2**V_BITS - 1
    v = tl.load(v_row + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    v = tl.minimum(tl.maximum(v, -_F16_MAX), _F16_MAX)
    vmin = rmin(v, axis=1)
    vmax = rmax(v, axis=1)
    # code against the fp16-rounded scale and zero, the numbers the decoder will read
    scale = ((vmax - vmin) / LEVELS).to(tl.float16).to(tl.float32)
    zero = vmin.to(tl.float16).to(tl.float32)
    safe = tl.where(scale > 0, scale, 1.0)
    VNCH: tl.constexpr = 2 if V_BITS == 4 else 4
    VC: tl.constexpr = HEAD_DIM // VNCH
    VE: tl.constexpr = HEAD_DIM // 8
    cols_v = tl.arange(0, VC)
    vpacked = tl.full([BLOCK_T, VC], 0, dtype=tl.int32)
    vplane1 = tl.full([BLOCK_T, VE], 0, dtype=tl.int32)
    for c in tl.static_range(VNCH):
        vc = tl.load(v_row + (c * VC + cols_v)[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        vc = tl.minimum(tl.maximum(vc, -_F16_MAX), _F16_MAX)
        code = tl.floor((vc - zero[:, None]) / safe[:, None] + 0.5)
        code = tl.minimum(tl.maximum(code, 0.0), LEVELS)
        code = tl.where(scale[:, None] > 0, code, 0.0).to(tl.int32)
        if V_BITS == 4:
            vpacked = vpacked | (code << (4 * c))
        else:
            vpacked = vpacked | ((code & 3) << (2 * c))
            hb = tl.reshape((code >> 2) & 1, [BLOCK_T, 2, VE])
            half = tl.arange(0, 2)
            vplane1 = vplane1 | rsum(hb << (half[None, :, None] + 2 * c), axis=1)
    tl.store(cache_u8_ptr + _at(base, dest, V_OFF + cols_v, valid, PLANAR), vpacked.to(tl.uint8),
             mask=valid[:, None])
    if V_BITS == 3:
        cols_ve = V_OFF + HEAD_DIM // 4 + tl.arange(0, VE)
        tl.store(cache_u8_ptr + _at(base, dest, cols_ve, valid, PLANAR), vplane1.to(tl.uint8),
                 mask=valid[:, None])
    tl.store(cache_f16_ptr + _at16(base, dest, VSCALE_OFF, valid, PLANAR), scale.to(tl.float16), mask=valid)
    tl.store(cache_f16_ptr + _at16(base, dest, VZERO_OFF, valid, PLANAR), zero.to(tl.float16), mask=valid)


def store_kv_tq(
    key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, fmt: str,
    *, block_t: int | None = None, num_warps: int = 4,
) -> None:
    """Quantize K/V [num_tokens, num_kv_heads, head_dim] and write them into `cache` at `slot_mapping`.

    `cache` is uint8 [num_blocks, block_size, num_kv_heads, slot_bytes] (contiguous), or a
    planar cache [num_blocks, num_kv_heads, block_size * slot_bytes] (`turboquant.allocate_tq_planar_cache`,
    block_size 16); `slot_mapping` int64 [num_tokens] holds block * block_size + offset, negative
    entries are skipped. Padding bytes of a slot are left as they were.
    """
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key/value must both be [tokens, kv_heads, head_dim]; got {tuple(key.shape)} and {tuple(value.shape)}")
    t, h, d = key.shape
    lay = tq_layout(fmt, d)
    planar = cache.dim() == 3
    if planar and (cache.dtype != torch.uint8 or cache.shape[1] != h or cache.shape[2] != PLANAR_PAGE * lay.slot_bytes):
        raise ValueError(f"{fmt}: a planar cache must be uint8 [blocks, {h}, {PLANAR_PAGE * lay.slot_bytes}] "
                         f"({PLANAR_PAGE}-token pages); "
                         f"got {cache.dtype} {tuple(cache.shape)}")
    if not planar and (cache.dtype != torch.uint8 or cache.dim() != 4 or cache.shape[2] != h
                       or cache.shape[3] != lay.slot_bytes):
        raise ValueError(
            f"{fmt}: cache must be uint8 [blocks, block_size, {h}, {lay.slot_bytes}]; got {cache.dtype} {tuple(cache.shape)}"
        )
    if not cache.is_contiguous():
        raise ValueError("cache must be contiguous (slot offsets are slot * kv_heads * slot_bytes)")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 [{t}]; got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value need a contiguous last dimension")
    if block_t is None:  # one program per token and head for a decode step's single token
        block_t = min(16, triton.next_power_of_2(max(t, 1)))
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two, got {block_t}")
    if t == 0:
        return
    check_slots(slot_mapping, cache.shape[0] * (PLANAR_PAGE if planar else cache.shape[1]))
    tabs = kernel_tables(fmt, d, cache.device)
    grid = (triton.cdiv(t, block_t), h, 2)
    _store_kv_tq_kernel[grid](
        key, value, cache, cache.view(torch.float16), slot_mapping,
        tabs["rot_t_sign_f16"], tabs["boundaries_f32"], tabs["codebook_f32"], tabs["planar_dest_i32"], d ** -0.5,
        t, key.stride(0), key.stride(1), value.stride(0), value.stride(1), h * lay.slot_bytes,
        HEAD_DIM=d, SLOT=lay.slot_bytes, KEY_BITS=lay.key_bits, V_BITS=lay.value_bits,
        V_OFF=lay.val_off, KNORM_OFF=max(lay.knorm_off, 0), VSCALE_OFF=lay.vscale_off, VZERO_OFF=lay.vzero_off,
        FP8_MAX=FP8_E4M3_MAX, PLANAR=planar, PAGE=PLANAR_PAGE if planar else cache.shape[1], NUM_KV=h,
        BLOCK_T=block_t, LOG_D=d.bit_length() - 1, num_warps=num_warps,
    )
