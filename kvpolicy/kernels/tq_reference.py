"""Float64 torch references for the TurboQuant formats: quantize, pack, unpack, attend.

Everything here is plain torch on any device, written for clarity, not speed:
it is what the Triton kernels in `tq_store.py` and `tq_decode.py` are tested
against. Byte layouts are described in `turboquant.py`.
"""

from __future__ import annotations

import math

import torch

from kvpolicy.kernels.formats import F16_MAX, FP8_E4M3_MAX, PAGE, tq_layout
from kvpolicy.kernels.turboquant import (
    codebook_boundaries,
    hadamard_rotation,
    int8_centroid_codebook,
    lloyd_max_codebook,
    planar_destinations,
    sign_magnitude_codes,
    slots_from_planar,
    sorted_index,
)

# --- quantizers -------------------------------------------------------------------


def quantize_keys_ref(key: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate, normalise and code keys [..., D]: (codes int64 [..., D], stored fp16 norm as float64 [...]).

    The stored norm is ||k|| / ||c[codes]|| (norm correction folded in), rounded to fp16; keys and the
    stored norm are saturated to the fp16 range first, as the store kernel does.
    """
    d = key.shape[-1]
    k = key.to(torch.float64).clamp(-F16_MAX, F16_MAX)
    pi = hadamard_rotation(d, device=k.device)
    norm = k.norm(dim=-1)
    u = (k @ pi.T) / torch.where(norm > 0, norm, 1.0)[..., None]
    cb = lloyd_max_codebook(bits, d).to(k.device)
    # count of thresholds strictly below u: ties go to the lower centroid, as in the kernel
    codes = torch.searchsorted(codebook_boundaries(cb).contiguous(), u.contiguous(), right=False)
    cnorm = cb[codes].norm(dim=-1)
    stored = (norm / cnorm).clamp(max=F16_MAX).to(torch.float16).to(torch.float64)
    return codes, stored


def int8_key_codebook(bits: int, head_dim: int) -> torch.Tensor:
    """The centroids the Gluon kernel's int8 score MMA multiplies (`turboquant.int8_centroids`), by sorted
    index like `lloyd_max_codebook`: within 0.006 / sqrt(D) of them, as precise as BF16 centroids."""
    return int8_centroid_codebook(bits)[sign_magnitude_codes(torch.arange(2**bits), bits)] / math.sqrt(head_dim)


def dequantize_keys_ref(codes: torch.Tensor, stored_norm: torch.Tensor, bits: int, rotated: bool = False,
                        int8_keys: bool = False) -> torch.Tensor:
    """Keys (float64) from codes and stored norms; in the rotated space if `rotated`, else the original.
    `int8_keys`: with the int8 kernel's centroids (`int8_key_codebook`) instead of the exact ones."""
    d = codes.shape[-1]
    cb = (int8_key_codebook(bits, d) if int8_keys else lloyd_max_codebook(bits, d)).to(codes.device)
    k_rot = cb[codes] * stored_norm[..., None]
    return k_rot if rotated else k_rot @ hadamard_rotation(d, device=codes.device)


def fp8_e4m3_ref(x: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even e4m3 (torch's cast after clamping), as float64."""
    return x.to(torch.float32).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float64)


def quantize_values_ref(value: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-vector asymmetric uniform codes: (codes int64 [..., D], scale, zero), scale/zero fp16-rounded float64.

    scale = (max - min) / (2^b - 1) and zero = min, both rounded to fp16 before
    coding so that the codes fit the numbers the decoder reads; code =
    floor((v - zero) / scale + 1/2) clamped to [0, 2^b - 1] (0 when scale is 0). Values are
    saturated to the fp16 range first, so scale and zero stay finite.
    """
    v = value.to(torch.float64).clamp(-F16_MAX, F16_MAX)
    levels = 2**bits - 1
    vmin, vmax = v.amin(dim=-1), v.amax(dim=-1)
    scale = ((vmax - vmin) / levels).to(torch.float16).to(torch.float64)
    zero = vmin.to(torch.float16).to(torch.float64)
    safe = torch.where(scale > 0, scale, 1.0)
    codes = torch.floor((v - zero[..., None]) / safe[..., None] + 0.5).clamp(0, levels)
    codes = torch.where(scale[..., None] > 0, codes, 0.0).to(torch.int64)
    return codes, scale, zero


def dequantize_values_ref(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Values (float64) = code * scale + zero."""
    return codes.to(torch.float64) * scale[..., None] + zero[..., None]


# --- byte packing -----------------------------------------------------------------


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes int64 [..., D] -> uint8 [..., D*bits/8] in our layout (see turboquant.py)."""
    d = codes.shape[-1]
    c = codes.to(torch.int64)
    if bits == 4:
        return (c[..., : d // 2] | (c[..., d // 2 :] << 4)).to(torch.uint8)
    if bits == 3:
        q = d // 4
        low = c & 3
        plane2 = sum(low[..., s * q : (s + 1) * q] << (2 * s) for s in range(4))
        e = d // 8
        high = (c >> 2) & 1
        plane1 = sum(high[..., t * e : (t + 1) * e] << t for t in range(8))
        return torch.cat([plane2, plane1], dim=-1).to(torch.uint8)
    raise ValueError(f"code bits must be 3 or 4, got {bits}")


def _unpack_codes(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of `_pack_codes`: uint8 [..., D*bits/8] -> int64 [..., D]."""
    p = packed.to(torch.int64)
    if bits == 4:
        return torch.cat([p & 15, p >> 4], dim=-1)
    q, e = d // 4, d // 8
    plane2, plane1 = p[..., :q], p[..., q : q + e]
    low = torch.cat([(plane2 >> (2 * s)) & 3 for s in range(4)], dim=-1)
    high = torch.cat([(plane1 >> t) & 1 for t in range(8)], dim=-1)
    return low | (high << 2)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _bytes_f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1).to(torch.float64)


def pack_slots_ref(key: torch.Tensor, value: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantize K/V [..., D] and pack slots: uint8 [..., slot_bytes] (padding bytes zero)."""
    d = key.shape[-1]
    lay = tq_layout(fmt, d)
    out = torch.zeros(*key.shape[:-1], lay.slot_bytes, dtype=torch.uint8, device=key.device)
    if lay.key_fp8:
        kq = fp8_e4m3_ref(key).to(torch.float8_e4m3fn)
        out[..., lay.key_off : lay.key_off + lay.key_bytes] = kq.view(torch.uint8)
    else:
        codes, stored = quantize_keys_ref(key, lay.key_bits)
        sm = sign_magnitude_codes(codes, lay.key_bits)
        out[..., lay.key_off : lay.key_off + lay.key_bytes] = _pack_codes(sm, lay.key_bits)
        out[..., lay.knorm_off : lay.knorm_off + 2] = _f16_bytes(stored)
    vcodes, scale, zero = quantize_values_ref(value, lay.value_bits)
    out[..., lay.val_off : lay.val_off + lay.val_bytes] = _pack_codes(vcodes, lay.value_bits)
    out[..., lay.vscale_off : lay.vscale_off + 2] = _f16_bytes(scale)
    out[..., lay.vzero_off : lay.vzero_off + 2] = _f16_bytes(zero)
    return out


def unpack_slots_ref(slots: torch.Tensor, fmt: str, head_dim: int) -> dict[str, torch.Tensor]:
    """Decode slots uint8 [..., slot_bytes] into fields: key codes as sorted centroid indices, fp16 fields as float64."""
    lay = tq_layout(fmt, head_dim)
    kb = slots[..., lay.key_off : lay.key_off + lay.key_bytes]
    out: dict[str, torch.Tensor] = {}
    if lay.key_fp8:
        out["key_fp8"] = kb.contiguous().view(torch.float8_e4m3fn).to(torch.float64)
    else:
        out["key_codes"] = sorted_index(_unpack_codes(kb, lay.key_bits, head_dim), lay.key_bits)
        out["key_norm"] = _bytes_f16(slots[..., lay.knorm_off : lay.knorm_off + 2])
    out["value_codes"] = _unpack_codes(slots[..., lay.val_off : lay.val_off + lay.val_bytes], lay.value_bits, head_dim)
    out["value_scale"] = _bytes_f16(slots[..., lay.vscale_off : lay.vscale_off + 2])
    out["value_zero"] = _bytes_f16(slots[..., lay.vzero_off : lay.vzero_off + 2])
    return out


def dequantize_slots_ref(slots: torch.Tensor, fmt: str, head_dim: int,
                         int8_keys: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (float64, original space) that the slots encode (`int8_keys`: see `dequantize_keys_ref`)."""
    lay = tq_layout(fmt, head_dim)
    f = unpack_slots_ref(slots, fmt, head_dim)
    k = f["key_fp8"] if lay.key_fp8 else dequantize_keys_ref(f["key_codes"], f["key_norm"], lay.key_bits,
                                                              int8_keys=int8_keys)
    v = dequantize_values_ref(f["value_codes"], f["value_scale"], f["value_zero"])
    return k, v


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, fmt: str) -> None:
    """Reference store: pack K/V [T, H, D] into `cache` at `slot_mapping` (negative slots skipped); into a
    planar cache (`turboquant.allocate_tq_planar_cache`, PAGE-token pages) each slot byte goes where
    `planar_destinations` puts it."""
    keep = slot_mapping >= 0
    slots = pack_slots_ref(key[keep], value[keep], fmt)
    if cache.dim() == 3:
        dest = planar_destinations(fmt, key.shape[-1]).to(cache.device)
        where = slot_mapping[keep].long()
        heads = torch.arange(cache.shape[1], device=cache.device)
        cache[(where // PAGE)[:, None, None], heads[None, :, None], dest[where % PAGE][:, None, :]] = slots
        return
    nb, bs, h, sb = cache.shape
    flat = cache.view(nb * bs, h, sb)
    flat[slot_mapping[keep]] = slots


# --- attention ------------------------------------------------------------------------


def gather_cache_ref(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int, b: int) -> torch.Tensor:
    """Slots of sequence `b` in order: uint8 [seq_len, H, slot_bytes]."""
    bs = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_tables[b, pos // bs].long()
    return cache[blocks, pos % bs]


def attention_ref(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sm_scale: float,
    sliding_window: int | None = None, sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 decode attention of one sequence: query [Hq, D], key/value [L, Hkv, D] -> [Hq, D]."""
    hq, d = query.shape
    hkv = key.shape[1]
    q = query.to(torch.float64)
    k = key.to(torch.float64).repeat_interleave(hq // hkv, dim=1)
    v = value.to(torch.float64).repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("hd,lhd->hl", q, k) * sm_scale
    if sliding_window is not None:
        s[:, : max(0, key.shape[0] - sliding_window)] = -math.inf
    if sink is not None:
        s = torch.cat([s, sink.to(torch.float64)[:, None]], dim=1)
        v = torch.cat([v, torch.zeros_like(v[:1])], dim=0)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hl,lhd->hd", p, v)


def decode_attention_tq_ref(
    query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, fmt: str,
    sm_scale: float | None = None, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
    int8_keys: bool = False,
) -> torch.Tensor:
    """Float64 attention over the K/V that a packed TurboQuant cache encodes: [B, Hq, D]. `int8_keys`: centroid
    keys take the Gluon kernel's int8 centroids (`int8_key_codebook`), so that its arithmetic is checked
    apart from that choice of centroids."""
    bsz, hq, d = query.shape
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    if cache.dim() == 3:
        cache = slots_from_planar(cache, fmt, d)
    outs = []
    for b in range(bsz):
        slots = gather_cache_ref(cache, block_tables, int(seq_lens[b]), b)
        k, v = dequantize_slots_ref(slots, fmt, d, int8_keys=int8_keys)
        outs.append(attention_ref(query[b], k, v, scale, sliding_window, sinks))
    return torch.stack(outs)


# --- PTX register programs ------------------------------------------------------------


def _prmt(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """PTX prmt.b32 default mode: byte i of d = byte (c >> 4i) & 7 of {b, a}, or its sign if bit 3 is set."""
    src = (b.to(torch.int64) << 32) | a.to(torch.int64)
    d = torch.zeros_like(src)
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        byte = torch.where(sel & 8 != 0, torch.where(byte & 0x80 != 0, 0xFF, 0), byte)
        d |= byte << (8 * i)
    return d


def _lop3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, lut: int) -> torch.Tensor:
    d = torch.zeros_like(a)
    for bit in range(8):
        if lut >> bit & 1:
            ta = a if bit & 4 else ~a
            tb = b if bit & 2 else ~b
            tc = c if bit & 1 else ~c
            d |= ta & tb & tc
    return d & 0xFFFFFFFF


def _f16_of(lane: torch.Tensor) -> torch.Tensor:
    return torch.where(lane >= 32768, lane - 65536, lane).to(torch.int16).view(torch.float16)


def _hsub2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sub.f16x2 (round to nearest even per 16-bit lane)."""
    out = torch.zeros_like(a)
    for sh in (0, 16):
        d = _f16_of((a >> sh) & 0xFFFF).float() - _f16_of((b >> sh) & 0xFFFF).float()
        out |= (d.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF) << sh
    return out


def emulate_ptx(prog: list, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run a register program (see `turboquant.render_ptx`) on int64 tensors holding 32-bit words (an int
    input: the same word in every lane)."""
    regs = {k: torch.as_tensor(v, dtype=torch.int64) & 0xFFFFFFFF for k, v in inputs.items()}
    like = max(regs.values(), key=lambda t: t.numel())

    def val(x):
        return regs[x] if isinstance(x, str) else torch.full_like(like, x & 0xFFFFFFFF)

    for op, dst, *src in prog:
        a = val(src[0])
        if op == "and":
            r = a & val(src[1])
        elif op == "shl":  # PTX clamps shift amounts above 32 (a register amount may be any value)
            r = (a << val(src[1]).clamp(max=32)) & 0xFFFFFFFF
        elif op == "shr":
            r = a >> val(src[1]).clamp(max=32)
        elif op == "prmt":
            r = _prmt(a, val(src[1]), val(src[2]))
        elif op == "lop3":
            r = _lop3(a, val(src[1]), val(src[2]), src[3])
        elif op == "mad":
            r = (a * val(src[1]) + val(src[2])) & 0xFFFFFFFF
        elif op == "mov":
            r = a
        elif op == "hsub2":
            r = _hsub2(a, val(src[1]))
        else:
            raise ValueError(f"unknown op {op}")
        regs[dst] = r
    return regs
