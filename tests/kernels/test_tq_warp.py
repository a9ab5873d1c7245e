"""The index algebra of `kernels/tq_warp.py` on the CPU. Gluon does not
run under the interpreter, so the value operand's construction is replayed here with the same tensor
operations (join = stack on a new last axis) on the emulated PTX program, and compared with the codes it
must hold; the kernel itself is tested on the GPU (test_tq_gluon.py -k per_warp)."""

from __future__ import annotations

import pytest
import torch
from kvpolicy.kernels.tq_reference import _pack_codes, emulate_ptx
from kvpolicy.kernels.tq_warp import (
    dim_of_row,
    key_layout,
    pages_per_warp,
    rotation_operand,
    v3_pair_program,
    v_pair_program,
    value_axes,
    value_layout,
    value_unit,
)


def _halves(o: torch.Tensor) -> torch.Tensor:
    """`tq_warp._halves` on emulated words: [..., 2] (low half, high half)."""
    return torch.stack([o & 0xFFFF, o >> 16], dim=-1)


def _join(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`gl.join`: a new innermost axis."""
    return torch.stack([x, y], dim=-1)


def _join8(h: list[torch.Tensor]) -> torch.Tensor:
    """The value operands' nested joins of eight program outputs' halves (`_values_operand`)."""
    return _join(_join(_join(h[0], h[1]), _join(h[2], h[3])), _join(_join(h[4], h[5]), _join(h[6], h[7])))


def _words(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4n] -> little-endian int64 words [..., n]."""
    b = packed.to(torch.int64)
    return b[..., 0::4] | b[..., 1::4] << 8 | b[..., 2::4] << 16 | b[..., 3::4] << 24


def test_v_pair_program_pairs_two_tokens_per_register() -> None:
    """Output (q 2 + tt) 2 + u holds nibble u of byte 2 q + tt of token a (low half) and of token b (high
    half), times 16^u: exact fp16 subnormals (their bits are the code times 16^u, below 1024)."""
    a, b = (torch.randint(0, 2**32, (256,), dtype=torch.int64) for _ in range(2))
    regs = emulate_ptx(v_pair_program(), {"$8": a, "$9": b})
    for q in range(2):
        for tt in range(2):
            byte = 2 * q + tt
            for u in range(2):
                out = regs[f"${(q * 2 + tt) * 2 + u}"]
                for half, word in ((0, a), (1, b)):
                    nib = (word >> (8 * byte + 4 * u)) & 15
                    assert torch.equal((out >> (16 * half)) & 0xFFFF, nib << (4 * u))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ppw", [1, 2, 4])
def test_values_operand_holds_each_tokens_codes_in_row_order(d: int, ppw: int) -> None:
    """`_values_operand`'s steps on a tile of packed value codes (4 warps x `ppw` pages): element [w, m, k] of
    V_w^T is the warp's token k (tile token 16 ppw w + k) code of dim `dim_of_row(d)[m]`, times 16^u
    (u = (m // 8) % 2, the high nibbles)."""
    assert torch.equal(dim_of_row(d).sort().values, torch.arange(d))
    n = 64 * ppw
    codes = torch.randint(0, 16, (n, d))
    vc = _words(_pack_codes(codes, 4))  # [n, d/8]: the cache's value plane rows
    a, b = vc[0::2], vc[1::2]  # reshape [n/2, 2, d/8], permute, split: tokens 2p and 2p + 1
    regs = emulate_ptx(v_pair_program(), {"$8": a, "$9": b})

    h = [_halves(regs[f"${i}"]) for i in range(8)]
    shape, order = value_axes(d, 4, ppw)
    y = _join8(h).reshape(shape).permute(order).reshape(4, d, 16 * ppw)
    m = torch.arange(d)
    want = codes.reshape(4, 16 * ppw, d)[:, :, dim_of_row(d)].permute(0, 2, 1) << (4 * ((m // 8) % 2))[None, :, None]
    assert torch.equal(y, want)


def _load_w3(plane2: torch.Tensor, plane1: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_load_w`'s 3-bit value words from the cache rows' words (plane2 [T, d/16], plane1 [T, d/32]): thread g's
    2-bit word and matching 1-bit word, both moved down by its first byte's offset in the word -> [T, 8]."""
    j = torch.arange(8) * (d // 32)
    c, w1 = j // 4, d // 32
    return plane2[:, c] >> (8 * (j % 4)), plane1[:, c % w1] >> (c // w1 + 8 * (j % 4))


@pytest.mark.parametrize("d", [64, 128])
def test_v3_pair_program_places_each_code_at_four_to_the_quarter(d: int) -> None:
    """Output (q 2 + tt) 4 + s holds the 3-bit code of quarter s of byte 2 q + tt of thread g's 2-bit bytes, token
    a in the low half and token b in the high half, times 4^s: an exact fp16 subnormal (below 1024)."""
    codes = torch.randint(0, 8, (2, d))
    packed = _pack_codes(codes, 3)
    plane2, plane1 = _words(packed[:, : d // 4]), _words(packed[:, d // 4 :])
    v2, v1 = _load_w3(plane2, plane1, d)
    pairs = d // 64
    regs = emulate_ptx(v3_pair_program(pairs), {f"${8 * pairs}": v2[0], f"${8 * pairs + 1}": v2[1],
                                                 f"${8 * pairs + 2}": v1[0], f"${8 * pairs + 3}": v1[1]})
    for g in range(8):
        for q in range(pairs):
            for tt in range(2):
                for s in range(4):
                    out = int(regs[f"${(q * 2 + tt) * 4 + s}"][g])
                    dim = s * d // 4 + g * d // 32 + 2 * q + tt
                    assert out & 0xFFFF == int(codes[0, dim]) << (2 * s), (g, q, tt, s)
                    assert out >> 16 == int(codes[1, dim]) << (2 * s), (g, q, tt, s)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ppw", [1, 2, 4])
def test_values_operand3_holds_each_tokens_codes_in_row_order(d: int, ppw: int) -> None:
    """`_values_operand3`'s steps on a tile of 3-bit value codes (4 warps x `ppw` pages): element [w, m, k] of V_w^T
    is the warp's token k code of dim `dim_of_row(d, 3)[m]` times 4^s, and `value_unit` undoes that factor."""
    rows = dim_of_row(d, 3)
    assert torch.equal(rows.sort().values, torch.arange(d))
    n = 64 * ppw
    codes = torch.randint(0, 8, (n, d))
    packed = _pack_codes(codes, 3)
    v2, v1 = _load_w3(_words(packed[:, : d // 4]), _words(packed[:, d // 4 :]), d)
    pairs = d // 64
    regs = emulate_ptx(v3_pair_program(pairs), {f"${8 * pairs}": v2[0::2], f"${8 * pairs + 1}": v2[1::2],
                                                 f"${8 * pairs + 2}": v1[0::2], f"${8 * pairs + 3}": v1[1::2]})

    h = [_halves(regs[f"${i}"]) for i in range(8 * pairs)]
    eight = [_join8(h[i:i + 8]) for i in range(0, 8 * pairs, 8)]
    y = _join(eight[0], eight[1]) if d == 128 else eight[0]
    shape, order = value_axes(d, 3, ppw)
    y = y.reshape(shape).permute(order).reshape(4, d, 16 * ppw)
    want = codes.reshape(4, 16 * ppw, d)[:, :, rows].permute(0, 2, 1)
    scale = (value_unit(d, 3) * 2.0**24).round().to(torch.int64)  # 4^s per row
    assert torch.equal(y, want * scale[None, :, None])


def _owners(layout) -> torch.Tensor:
    """Each element's (warp, lane, register) of a distributed linear layout -> [warps, lanes, regs, rank]
    coordinates: the XOR of the bases of the index's set bits (registers the low bits, then lanes, warps)."""
    bases = layout.reg_bases + layout.lane_bases + layout.warp_bases
    idx = torch.arange(1 << len(bases))[:, None]
    coords = torch.zeros(len(idx), len(layout.shape), dtype=torch.int64)
    for bit, base in enumerate(bases):
        coords ^= (idx >> bit & 1) * torch.tensor(base)
    return coords.reshape(1 << len(layout.warp_bases), 1 << len(layout.lane_bases), 1 << len(layout.reg_bases), -1)


def _flat(coords: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """Row-major index of coordinates [..., rank] in `shape` (what `gl.reshape` to [BN, words] reads)."""
    idx = torch.zeros(coords.shape[:-1], dtype=torch.int64)
    for axis, size in enumerate(shape):
        idx = idx * size + coords[..., axis]
    return idx


def _tile_coords(layout, words: int) -> tuple[torch.Tensor, ...]:
    """(warp, lane, register, token, word) of every element after the kernel's reshape to [BN, words]."""
    own = _owners(layout)
    flat = _flat(own, layout.shape)
    w, ln, r = torch.meshgrid(*(torch.arange(n) for n in own.shape[:3]), indexing="ij")
    return w, ln, r, flat // words, flat % words


@pytest.mark.parametrize("key_bytes", [16, 32, 64])
@pytest.mark.parametrize("block_n", [64, 128, 256])
def test_key_loads_keep_the_tile_order(key_bytes: int, block_n: int) -> None:
    """`key_layout` [w, pg, r8, r, word], reshaped to [BN, words] as `_load_w` does, keeps the tile's token
    order and the ownership `_keys_operand` relabels for free: thread 4 r + q of warp w holds the contiguous
    quarter q of rows r and r + 8 (the mma.sync B operand's column r) of each of its pages, the quarter's words
    innermost in its registers, then row + 8, then the page. A swapped axis or base still computes the right
    answer but adds shuffles that only the GPU bench would see."""
    ppw = pages_per_warp(block_n)
    words = key_bytes // 4
    cw = words // 4
    w, lane, reg, token, col = _tile_coords(key_layout(key_bytes, ppw), words)
    assert torch.equal(token // (16 * ppw), w)
    assert torch.equal(token % 8, lane // 4)
    assert torch.equal(col // cw, lane % 4)
    assert torch.equal(col % cw, reg % cw)
    assert torch.equal((token % 16) // 8, (reg // cw) % 2)
    assert torch.equal((token % (16 * ppw)) // 16, reg // (2 * cw))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("block_n", [64, 128, 256])
def test_value_loads_keep_the_tile_order(d: int, block_n: int) -> None:
    """`value_layout` [w, pg, r8, c, r1, word], reshaped to [BN, words] as `_load_w` does, keeps the tile's
    token order (`_values_operand` pairs tokens 2k, 2k + 1; `value_axes` relabels) and gives thread 4 g + c of
    warp w words [E g, E g + E) of rows 2c, 2c + 1, 8 + 2c, 9 + 2c of each page (E = D/64), the columns of its
    P^T B operand: registers word, then r1, then r8 (so that each row is an immediate offset), then the page."""
    ppw = pages_per_warp(block_n)
    e = d // 64
    w, lane, reg, token, col = _tile_coords(value_layout(d, ppw), d // 8)
    row = token % 16
    assert torch.equal(token // (16 * ppw), w)
    assert torch.equal((row % 8) // 2, lane % 4)
    assert torch.equal(col // e, lane // 4)
    assert torch.equal(col % e, reg % e)
    assert torch.equal(row % 2, (reg // e) % 2)
    assert torch.equal(row // 8, (reg // (2 * e)) % 2)
    assert torch.equal((token % (16 * ppw)) // 16, reg // (4 * e))


def test_mma_sums_refuses_one_page_per_warp() -> None:
    """`TQGluonConfig.mma_sums` pairs a warp's pages (a page's two halves are the sums MMA's two row blocks, two
    pages its 16 columns), so a 64-token tile (one page per warp) is refused with the tiles that work, before
    anything is launched."""
    from kvpolicy.kernels.tq_gluon import TQGluonConfig
    from kvpolicy.kernels.tq_warp import decode_tq_warp

    q = torch.zeros(1, 8, 64)
    cfg = TQGluonConfig(block_n=64, per_warp=True, mma_sums=True)
    with pytest.raises(ValueError, match="block_n 128 or 256"):
        decode_tq_warp(q, q, 1.0, torch.zeros(1, 1, 16, dtype=torch.uint8), "turboquant_4bit_nc",
                       torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), sliding_window=None,
                       sinks=None, splits=1, out=torch.zeros_like(q), cfg=cfg)


@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"])
@pytest.mark.parametrize("d", [64, 128])
def test_rotation_operand_gives_the_rotated_query_in_the_score_order(fmt: str, d: int) -> None:
    """`_rotated_query` computes q @ rotation_operand^T: that must be the rotation kernel's product
    (q @ Pi^T sqrt(D)) with its coordinates in the score MMA's K order (`query_order`), which the kernel's
    query bytes and the key operand share; the rotation's entries stay exactly +-1 in fp16."""
    from kvpolicy.kernels.tq_gluon import query_order
    from kvpolicy.kernels.turboquant import hadamard_rotation

    op = rotation_operand(fmt, d, "cpu")
    assert op.dtype == torch.float16 and op.is_contiguous() and set(op.unique().tolist()) == {-1.0, 1.0}
    q = torch.randn(8, d, dtype=torch.float64)
    want = (q @ hadamard_rotation(d).T * d**0.5)[:, query_order(fmt, d)]
    torch.testing.assert_close(q @ op.double().T, want, rtol=0, atol=1e-9)

