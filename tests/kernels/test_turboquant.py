"""TurboQuant format tables: Lloyd-Max codebooks, rotation, slot layouts, MSE bound, PTX unpack programs.

Pure torch (no kernels): fast on any machine.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvpolicy.formats import get_format
from kvpolicy.kernels.tq_reference import (
    _pack_codes,
    _unpack_codes,
    decode_attention_tq_ref,
    dequantize_keys_ref,
    emulate_ptx,
    quantize_keys_ref,
    store_kv_ref,
)
from kvpolicy.kernels.formats import (
    SUPPORTED_HEAD_DIMS,
    TQ_FORMATS,
    WARP_ORDER_FORMATS,
    code_planes,
    field_planes,
    plane_kinds,
    tq_layout,
)
from kvpolicy.kernels.turboquant import (
    SUBNORMAL_UNIT,
    allocate_tq_cache,
    codebook_boundaries,
    gaussian_mse,
    hadamard_rotation,
    int8_centroid_codebook,
    int8_centroids,
    int8_offset,
    int8_operand_order,
    int8_table_word,
    k3_int8_program,
    k3_program,
    k4_int8_program,
    k4_program,
    lloyd_max_codebook,
    planar_from_slots,
    render_ptx,
    rotation_t_signs,
    sign_magnitude_codebook,
    sign_magnitude_codes,
    slots_from_planar,
    sorted_index,
    warp_plane_order,
    turboquant_mse_bound,
    subnormal_byte_order,
    v3_program,
    v3_subnormal_program,
    v4_program,
    v4_subnormal_program,
)

# Max (1960), "Quantizing for minimum distortion", Table I: optimum N(0,1) quantizer
# outputs (positive half) and mean squared error, printed to 4 significant digits.
MAX_1960 = {
    1: ([0.7980], 0.3634),
    2: ([0.4528, 1.510], 0.1175),
    3: ([0.2451, 0.7560, 1.344, 2.152], 0.03454),
    4: ([0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733], 0.009497),
}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_matches_max_1960(bits: int) -> None:
    cb = lloyd_max_codebook(bits, 1)
    want, mse = MAX_1960[bits]
    # the table has 4 significant digits: 1e-3 absolute on values below 3
    assert torch.allclose(cb[2 ** (bits - 1):], torch.tensor(want, dtype=torch.float64), atol=1e-3, rtol=0)
    assert torch.allclose(cb, -cb.flip(0), atol=0, rtol=0), "codebook of a symmetric density must be odd"
    # the 4-digit table's MSE is rounded; our quadrature of the same quantizer agrees to 5e-4 relative
    assert gaussian_mse(cb, 1.0) == pytest.approx(mse, rel=5e-4)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_satisfies_lloyd_max_conditions(bits: int) -> None:
    """Each centroid is the conditional mean of its cell (closed form), thresholds are midpoints."""
    cb = lloyd_max_codebook(bits, 1)
    edges = torch.cat([torch.tensor([-math.inf]), codebook_boundaries(cb), torch.tensor([math.inf])])
    pdf = torch.exp(-0.5 * edges.clamp(-40, 40) ** 2) / math.sqrt(2 * math.pi)
    mass = torch.special.ndtr(edges[1:]) - torch.special.ndtr(edges[:-1])
    cond_mean = (pdf[:-1] - pdf[1:]) / mass
    # our codebook comes from Lloyd iterations on a trapezoid quadrature (grid step 6e-5):
    # its fixed point is within 1e-7 of the exact one
    assert torch.allclose(cb, cond_mean, atol=1e-7, rtol=0)


@pytest.mark.parametrize("bits", [3, 4])
def test_codebook_is_a_local_minimum_of_mse(bits: int) -> None:
    cb = lloyd_max_codebook(bits, 1)
    best = gaussian_mse(cb, 1.0, num_points=50_001)
    for i in range(len(cb)):
        for eps in (-2e-3, 2e-3):
            moved = cb.clone()
            moved[i] += eps
            # second-order growth ~ p_i * eps^2 >= 1e-8 (smallest cell mass ~2e-3); the quadrature
            # error of the same grid cancels in the difference to well below that
            assert gaussian_mse(moved, 1.0, num_points=50_001) > best + 1e-9


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_codebook_is_for_n_0_1_over_d(head_dim: int) -> None:
    unit = lloyd_max_codebook(4, 1)
    assert torch.allclose(lloyd_max_codebook(4, head_dim), unit / math.sqrt(head_dim), rtol=1e-15, atol=0)
    sigma = 1 / math.sqrt(head_dim)
    assert gaussian_mse(lloyd_max_codebook(4, head_dim), sigma) == pytest.approx(gaussian_mse(unit, 1.0) / head_dim, rel=1e-6)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_hadamard_rotation_is_orthonormal(head_dim: int) -> None:
    pi = hadamard_rotation(head_dim)
    assert torch.allclose(pi @ pi.T, torch.eye(head_dim, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.all(pi.abs() == 1 / math.sqrt(head_dim))
    signs = rotation_t_signs(head_dim).double()
    assert torch.equal(signs, pi.T * math.sqrt(head_dim))
    assert not torch.equal(pi, pi.abs() * pi[0:1].sign()), "the random sign diagonal is missing"


def test_slot_bytes_match_vllm_sizes() -> None:
    expected_d128 = {"turboquant_k8v4": 196, "turboquant_4bit_nc": 134, "turboquant_k3v4_nc": 118, "turboquant_3bit_nc": 102}
    for fmt in TQ_FORMATS:
        assert tq_layout(fmt, 128).slot_bytes == expected_d128[fmt]
        for d in SUPPORTED_HEAD_DIMS:
            lay = tq_layout(fmt, d)
            assert lay.slot_bytes == get_format(fmt).slot_bytes(d)
            fields = [(lay.key_off, lay.key_bytes), (lay.val_off, lay.val_bytes), (lay.vscale_off, 2), (lay.vzero_off, 2)]
            if not lay.key_fp8:
                fields.append((lay.knorm_off, 2))
            used = sorted(fields)
            for (a, na), (b, _) in zip(used, used[1:]):
                assert a + na <= b, f"{fmt} D={d}: fields overlap"
            assert used[-1][0] + used[-1][1] <= lay.slot_bytes
            assert all(off % 2 == 0 for off, n in fields if n == 2), "fp16 fields must be 2-byte aligned"
    with pytest.raises(ValueError):
        tq_layout("turboquant_4bit_nc", 96)
    with pytest.raises(ValueError):
        tq_layout("fp8", 128)


@pytest.mark.parametrize("bits", [3, 4])
def test_sign_magnitude_codes_round_trip(bits: int) -> None:
    idx = torch.arange(2**bits)
    sm = sign_magnitude_codes(idx, bits)
    assert sorted(sm.tolist()) == list(range(2**bits))
    assert torch.equal(sorted_index(sm, bits), idx)
    cb = lloyd_max_codebook(bits, 128)
    assert torch.equal(sign_magnitude_codebook(bits, 128)[sm], cb)
    half = 2 ** (bits - 1)
    assert torch.all((sm >= half) == (cb < 0)), "the top code bit is the sign"


@pytest.mark.parametrize("bits", [3, 4])
def test_pack_unpack_round_trip(bits: int) -> None:
    codes = torch.randint(0, 2**bits, (5, 3, 128))
    packed = _pack_codes(codes, bits)
    assert packed.shape[-1] == 128 * bits // 8 and packed.dtype == torch.uint8
    assert torch.equal(_unpack_codes(packed, bits, 128), codes)


def _unit_vectors(n: int, d: int, outliers: bool) -> torch.Tensor:
    x = torch.randn(n, d, dtype=torch.float64)
    if outliers:
        # real keys: a few channels carry most of the energy
        x[:, [3, 17, 64, 100]] *= 20.0
    return x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("bits", [3, 4])
def test_quantization_mse_within_turboquant_bound(bits: int, outliers: bool) -> None:
    """E||u - u_hat||^2 for unit vectors, with and without norm correction, is under (sqrt(3) pi / 2) 4^-b."""
    d, n = 128, 4096
    u = _unit_vectors(n, d, outliers)
    codes, stored = quantize_keys_ref(u, bits)
    nc = dequantize_keys_ref(codes, stored.to(torch.float16).double(), bits)  # what the cache holds (nc folded)
    plain = dequantize_keys_ref(codes, torch.ones(n, dtype=torch.float64), bits)  # centroids, no correction
    bound = turboquant_mse_bound(bits)
    lloyd = gaussian_mse(lloyd_max_codebook(bits, 1), 1.0)  # per-coordinate MSE of N(0,1) x d / d
    for name, rec in (("nc", nc), ("plain", plain)):
        mse = ((u - rec) ** 2).sum(dim=-1).mean().item()
        # sampling error of the mean over 4096 vectors is ~1%; the bound has >= 10% margin (4-bit nc: 0.0092 vs 0.0106)
        assert mse <= bound, f"{bits}-bit {name} outliers={outliers}: MSE {mse:.5f} > bound {bound:.5f}"
        if not outliers:
            # and it is the Lloyd-Max distortion, not just any small number: within 15% of d * (1/d) * mse_N(0,1)
            assert mse == pytest.approx(lloyd, rel=0.15), f"{name}: {mse:.5f} vs Lloyd-Max {lloyd:.5f}"


def _f16_lanes(word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lo = word & 0xFFFF
    hi = (word >> 16) & 0xFFFF
    to_f16 = lambda x: torch.where(x >= 32768, x - 65536, x).to(torch.int16).view(torch.float16)  # noqa: E731
    return to_f16(lo), to_f16(hi)


def _outputs(regs: dict, num_outputs: int) -> list[torch.Tensor]:
    """Per output tensor: fp16 [n, 4] elements in Triton's pack=4 order ($2k: elements 0,1; $2k+1: 2,3)."""
    outs = []
    for k in range(num_outputs):
        e0, e1 = _f16_lanes(regs[f"${2 * k}"])
        e2, e3 = _f16_lanes(regs[f"${2 * k + 1}"])
        outs.append(torch.stack([e0, e1, e2, e3], dim=-1))
    return outs


def _bytes(word: torch.Tensor) -> torch.Tensor:
    return torch.stack([(word >> (8 * e)) & 0xFF for e in range(4)], dim=-1)


N_WORDS = 20_000


def test_k4_program_looks_up_sign_magnitude_centroids() -> None:
    x = torch.randint(0, 2**32, (N_WORDS,), dtype=torch.int64)
    lo, hi = _outputs(emulate_ptx(k4_program(), {"$4": x}), 2)
    cb = (sign_magnitude_codebook(4, 1)).to(torch.float16)
    b = _bytes(x)
    assert torch.equal(lo.view(torch.int16), cb[b & 15].view(torch.int16))
    assert torch.equal(hi.view(torch.int16), cb[b >> 4].view(torch.int16))


def test_k3_program_looks_up_sign_magnitude_centroids() -> None:
    p2 = torch.randint(0, 2**32, (N_WORDS,), dtype=torch.int64)
    signs = torch.randint(0, 2**32, (N_WORDS,), dtype=torch.int64)
    outs = _outputs(emulate_ptx(k3_program(), {"$8": p2, "$9": signs}), 4)
    cb = (sign_magnitude_codebook(3, 1)).to(torch.float16)
    b2, bs = _bytes(p2), _bytes(signs)
    for s in range(4):
        code = ((b2 >> (2 * s)) & 3) | (((bs >> (2 * s)) & 1) << 2)
        assert torch.equal(outs[s].view(torch.int16), cb[code].view(torch.int16)), f"quarter {s}"


def test_v4_program_gives_codes() -> None:
    x = torch.randint(0, 2**32, (N_WORDS,), dtype=torch.int64)
    lo, hi = _outputs(emulate_ptx(v4_program(), {"$4": x}), 2)
    b = _bytes(x)
    assert torch.equal(lo.double(), (b & 15).double())
    assert torch.equal(hi.double(), 16.0 * (b >> 4).double())


def _halves(word: torch.Tensor) -> torch.Tensor:
    """The two fp16 halves of 32-bit words, as float64 (low half first)."""
    lo = (word & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16)
    hi = ((word >> 16) & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.float16)
    return torch.stack([lo, hi], dim=-1).double()


def test_v4_subnormal_program_gives_codes_times_2_to_the_minus_24() -> None:
    """Each half is exactly code x 2^-24 (16 x code for high nibbles), bytes in the order (0, 2, 1, 3)."""
    x = torch.randint(0, 2**32, (N_WORDS,), dtype=torch.int64)
    regs = emulate_ptx(v4_subnormal_program(), {"$4": x})
    b = _bytes(x)[:, [0, 2, 1, 3]].double()
    lo = torch.cat([_halves(regs["$0"]), _halves(regs["$1"])], dim=-1)
    hi = torch.cat([_halves(regs["$2"]), _halves(regs["$3"])], dim=-1)
    assert torch.equal(lo, torch.remainder(b, 16) * SUBNORMAL_UNIT)
    assert torch.equal(hi, 16 * torch.div(b, 16, rounding_mode="floor") * SUBNORMAL_UNIT)
    assert [subnormal_byte_order(i) for i in range(8)] == [0, 2, 1, 3, 4, 6, 5, 7]


def test_v3_subnormal_program_gives_codes_times_2_to_the_minus_24() -> None:
    """Quarter s of every byte is exactly 4^s x code x 2^-24, bytes in the order (0, 2, 1, 3); all 32 bits of
    both words reach the output (the high bits of byte 3 included)."""
    p2 = torch.randint(0, 2**32, (N_WORDS,), dtype=torch.int64)
    high = torch.randint(0, 2**32, (N_WORDS,), dtype=torch.int64)
    regs = emulate_ptx(v3_subnormal_program(), {"$8": p2, "$9": high})
    b2, bh = _bytes(p2)[:, [0, 2, 1, 3]], _bytes(high)[:, [0, 2, 1, 3]]
    for s in range(4):
        code = ((b2 >> (2 * s)) & 3) | (((bh >> (2 * s)) & 1) << 2)
        got = torch.cat([_halves(regs[f"${2 * s}"]), _halves(regs[f"${2 * s + 1}"])], dim=-1)
        assert torch.equal(got, 4.0**s * code.double() * SUBNORMAL_UNIT), f"quarter {s}"


def test_v3_program_gives_codes() -> None:
    p2 = torch.randint(0, 2**32, (N_WORDS,), dtype=torch.int64)
    high = torch.randint(0, 2**32, (N_WORDS,), dtype=torch.int64)
    outs = _outputs(emulate_ptx(v3_program(), {"$8": p2, "$9": high}), 4)
    b2, bh = _bytes(p2), _bytes(high)
    for s in range(4):
        code = ((b2 >> (2 * s)) & 3) | (((bh >> (2 * s)) & 1) << 2)
        assert torch.equal(outs[s].double(), 4.0**s * code.double()), f"quarter {s}"


def test_render_ptx_declares_temporaries() -> None:
    text = render_ptx(k4_program())
    assert text.startswith("{") and text.rstrip().endswith("}")
    assert ".reg .b32" in text and "prmt.b32" in text and "lop3.b32" in text
    assert text.count(";") == len(k4_program()) + 1


@pytest.mark.parametrize("fmt", TQ_FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_planar_pages_hold_the_slots_bytes_in_aligned_planes(fmt: str, head_dim: int) -> None:
    """A planar cache is a permutation of the slot cache's bytes (same size, round trip exact), each head's
    page starts on a 16-byte boundary, and its code planes (3-bit codes: the 2-bit plane, then the 1-bit
    plane) and fp16 field planes sit where the Gluon kernel reads them, each on a 16-byte boundary."""
    lay = tq_layout(fmt, head_dim)
    slots = torch.randint(0, 256, (3, 16, 4, lay.slot_bytes), dtype=torch.uint8)
    planar = planar_from_slots(slots, fmt, head_dim)
    assert planar.shape == (3, 4, 16 * lay.slot_bytes) and planar.numel() == slots.numel()
    assert torch.equal(slots_from_planar(planar, fmt, head_dim), slots)
    assert (16 * lay.slot_bytes) % 16 == 0
    page = planar[1, 2]  # block 1, head 2
    t = 5
    planes = code_planes(fmt, head_dim)
    split = 2 if lay.key_bits == 3 else 1
    assert sum(n for _, n in planes[:split]) == lay.key_bytes and sum(n for _, n in planes[split:]) == lay.val_bytes
    assert len(planes) == split + (2 if lay.value_bits == 3 else 1)
    warp = fmt in WARP_ORDER_FORMATS
    start = 0
    for (off, n), kind in zip(planes, plane_kinds(fmt, head_dim)):
        assert start % 16 == 0 and n % 4 == 0
        at = start + (warp_plane_order(kind, n)[t] if warp else t * n + torch.arange(n))
        assert torch.equal(page[at], slots[1, t, 2, off:off + n])
        start += 16 * n
    f0 = 16 * (lay.key_bytes + lay.val_bytes)
    assert start == f0
    for k, off in enumerate(field_planes(fmt, head_dim)):
        assert f0 % 16 == 0
        at = f0 + 32 * k + (warp_plane_order("field", 2)[t] if warp else 2 * t + torch.arange(2))
        assert torch.equal(page[at], slots[1, t, 2, off:off + 2])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_warp_plane_order_gives_each_thread_its_rows_as_one_aligned_vector(head_dim: int) -> None:
    """What `tq_warp._load_w` relies on: in a value plane (and a field plane) thread (g, c)'s bytes of rows
    2c, 2c + 1, 8 + 2c, 9 + 2c are one aligned block whose words hold a byte pair of row 2c + 8 r8 and then
    the same pair of row 2c + 8 r8 + 1; in a key plane thread (r, c)'s quarter c of rows r and r + 8 is one
    aligned block, row r first."""
    for kind, n, group in (("value", head_dim // 2, head_dim // 16), ("value", head_dim // 4, head_dim // 32),
                           ("value1", head_dim // 8, head_dim // 32), ("field", 2, 2)):
        pos = warp_plane_order(kind, n)
        for g in range(n // group):
            for c in range(4):
                block = torch.arange(4 * group) + (g * 4 + c) * 4 * group
                rows = [2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c]
                got = torch.stack([pos[r, g * group:(g + 1) * group] for r in rows])  # [4 rows, group bytes]
                want = block.view(2, group // 2, 2, 2).permute(0, 2, 1, 3).reshape(4, group)
                assert torch.equal(got, want), (kind, n, g, c)
    for kind, n, quarter in (("key", head_dim // 2, head_dim // 8), ("key", head_dim // 4, head_dim // 16),
                             ("key1", head_dim // 8, head_dim // 16)):
        pos = warp_plane_order(kind, n)
        for r in range(8):
            for c in range(n // quarter):
                index = r * 4 + c if kind == "key" else c * 8 + r  # the lane, or half c of row r
                block = torch.arange(2 * quarter) + index * 2 * quarter
                got = torch.cat([pos[r, c * quarter:(c + 1) * quarter], pos[r + 8, c * quarter:(c + 1) * quarter]])
                assert torch.equal(got, block), (kind, n, r, c)


def test_reference_decodes_planar_and_slot_caches_alike() -> None:
    """The float64 reference reads a planar cache as the slots it permutes (and stores into one)."""
    fmt, d = "turboquant_4bit_nc", 64
    key, value = torch.randn(40, 2, d), torch.randn(40, 2, d)
    slots = allocate_tq_cache(4, 16, 2, d, fmt).zero_()
    planar = planar_from_slots(slots, fmt, d)
    mapping = torch.arange(40)
    store_kv_ref(key, value, slots, mapping, fmt)
    store_kv_ref(key, value, planar, mapping, fmt)
    assert torch.equal(planar, planar_from_slots(slots, fmt, d))
    query = torch.randn(1, 8, d)
    tables = torch.arange(4, dtype=torch.int32)[None]
    seq = torch.tensor([40], dtype=torch.int32)
    assert torch.equal(decode_attention_tq_ref(query, planar, tables, seq, fmt),
                       decode_attention_tq_ref(query, slots, tables, seq, fmt))


# --- int8 centroid keys (the Gluon kernel's score path) ---------------------------------------------------


@pytest.mark.parametrize("bits", [4, 3])
def test_int8_centroids_are_close_and_exactly_odd(bits: int) -> None:
    """Each magnitude within 0.006 (unit sigma) of the Lloyd-Max one, far below the codebook's own error, and
    the table odd: a negative code's byte (~b for 4 bits, with the half of `int8_offset`; -b for 3 bits) stands
    for exactly minus the positive one."""
    exact = sign_magnitude_codebook(bits, 1)
    approx = int8_centroid_codebook(bits)
    assert (approx - exact).abs().max() < 0.006
    half = 2 ** (bits - 1)
    assert torch.equal(approx[half:], -approx[:half])
    b, _ = int8_centroids(bits)
    assert max(b) <= 127 and min(b) >= 0


def _int8_lanes(word: torch.Tensor) -> torch.Tensor:
    """The four signed bytes of 32-bit words, byte 0 first."""
    b = _bytes(word)
    return torch.where(b >= 128, b - 256, b)


def _int8_value(byte: torch.Tensor, bits: int) -> torch.Tensor:
    return (byte.double() + int8_offset(bits)) / int8_centroids(bits)[1]


def test_k4_int8_program_gives_signed_centroid_bytes() -> None:
    """Output 0 holds nibbles 0-3 of the word (byte 0 low, byte 0 high, byte 1 low, byte 1 high), output 1
    nibbles 4-7; each byte is the int8 value of that sign-magnitude code."""
    x = torch.randint(0, 2**32, (N_WORDS,), dtype=torch.int64)
    regs = emulate_ptx(k4_int8_program(), {"$2": x, "$3": int8_table_word(4)})
    nib = torch.stack([(x >> (4 * n)) & 15 for n in range(8)], dim=-1)
    got = torch.cat([_int8_value(_int8_lanes(regs["$0"]), 4), _int8_value(_int8_lanes(regs["$1"]), 4)], dim=-1)
    assert torch.equal(got, int8_centroid_codebook(4)[nib])


def test_k3_int8_program_gives_signed_centroid_bytes() -> None:
    """Outputs 0/1: quarters 0 and 2 of bytes 0-1 / 2-3 (byte 0 q0, byte 0 q2, ...); outputs 2/3: quarters 1
    and 3. The sign of quarter s of byte j is bit 2s of sign byte j; the odd bits do not matter."""
    p2 = torch.randint(0, 2**32, (N_WORDS,), dtype=torch.int64)
    signs = torch.randint(0, 2**32, (N_WORDS,), dtype=torch.int64)
    regs = emulate_ptx(k3_int8_program(), {"$4": p2, "$5": signs, "$6": int8_table_word(3)})
    b2, bs = _bytes(p2), _bytes(signs)
    cb = int8_centroid_codebook(3)
    for out, (quarters, first) in enumerate([((0, 2), 0), ((0, 2), 2), ((1, 3), 0), ((1, 3), 2)]):
        got = _int8_value(_int8_lanes(regs[f"${out}"]), 3)
        for i in range(4):
            j, s = first + i // 2, quarters[i % 2]
            code = ((b2[:, j] >> (2 * s)) & 3) | (((bs[:, j] >> (2 * s)) & 1) << 2)
            assert torch.equal(got[:, i], cb[code]), f"output {out} byte {i}"


@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_3bit_nc", "turboquant_k3v4_nc"])
@pytest.mark.parametrize("d", [64, 128])
def test_int8_operand_order_is_the_relabelled_unpack(fmt: str, d: int) -> None:
    """Pack one key row's codes as the cache does, run the int8 program on each thread's words, relabel the
    registers as the Gluon kernel does (register g of word m of thread c -> K = 16 (m G + g) + 4 c + i):
    K index k then holds the code of coordinate int8_operand_order[k], a permutation of the head."""
    bits = tq_layout(fmt, d).key_bits
    codes = torch.randint(0, 2**bits, (d,))
    packed = _pack_codes(codes, bits).to(torch.int64)
    plane = d // 2 if bits == 4 else d // 4
    w = plane // 4
    words = lambda b: sum(b[..., e::4] << (8 * e) for e in range(4))  # noqa: E731  bytes -> little-endian words
    order = int8_operand_order(fmt, d)
    assert torch.equal(order.sort().values, torch.arange(d))
    g_n = 2 if bits == 4 else 4
    got = torch.empty(d, dtype=torch.int64)
    for c in range(4):
        p2 = words(packed[c * w:(c + 1) * w])
        if bits == 4:
            regs = emulate_ptx(k4_int8_program(), {"$2": p2, "$3": int8_table_word(4)})
        else:
            e = d // 8
            j = torch.arange(c * w, (c + 1) * w)
            # the kernel's sign words (`tq_warp._load_w`): byte j mod D/8 of the 1-bit plane >> j // (D/8)
            regs = emulate_ptx(k3_int8_program(), {"$4": p2, "$5": words(packed[plane + j % e] >> (j // e)),
                                                     "$6": int8_table_word(3)})
        for m in range(w // 4):
            for g in range(g_n):
                lanes = _int8_lanes(regs[f"${g}"][m])
                for i in range(4):
                    got[16 * (m * g_n + g) + 4 * c + i] = lanes[i]
    cb = int8_centroid_codebook(bits)
    assert torch.equal(_int8_value(got, bits), cb[codes[order]])
