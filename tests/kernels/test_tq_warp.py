"""The index algebra of `kernels/tq_warp.py` on the CPU. Gluon does not
run under the interpreter, so the value operand's construction is replayed here with the same tensor
operations (join = stack on a new last axis) on the emulated PTX program, and compared with the codes it
must hold; the kernel itself is tested on the GPU (test_tq_gluon.py -k per_warp)."""

from __future__ import annotations

import itertools

import pytest
import torch
from kvpolicy.kernels.tq_reference import _pack_codes, emulate_ptx
from kvpolicy.kernels.tq_warp import (
    block_layout,
    call_weights,
    layouts,
    dim_of_row,
    pages_per_warp,
    rotation_operand,
    split_weights,
    v3_word_program,
    v_word_program,
    value_axes,
    value_unit,
    weighted_tiles,
)
from kvpolicy.kernels.turboquant import warp_plane_order


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


def _plane_words(tile_bytes: torch.Tensor, kind: str) -> torch.Tensor:
    """A tile's bytes of one plane per token [n, nbytes] -> each page's plane as the cache holds it
    (`turboquant.warp_plane_order`), as words [n / 16 pages, 4 nbytes]."""
    n, nb = tile_bytes.shape
    order = warp_plane_order(kind, nb).reshape(-1)
    pages = torch.empty(n // 16, 16 * nb, dtype=torch.uint8)
    pages[:, order] = tile_bytes.reshape(n // 16, 16 * nb)
    return _words(pages)


def _load_blocks(plane: torch.Tensor, ppw: int, nv: int, block) -> torch.Tensor:
    """`_load_w`'s vector loads: [4, ppw, 8, 4, nv] = word block(i, c) nv + v of page ppw w + pg, where i is the
    lane group (`block_layout`)."""
    w, pg, i, c, v = torch.meshgrid(*(torch.arange(k) for k in (4, ppw, 8, 4, nv)), indexing="ij")
    return plane[w * ppw + pg, block(i, c) * nv + v]


def _value_words(x: torch.Tensor, bn: int) -> torch.Tensor:
    """`tq_warp._value_words`."""
    nv = x.shape[4]
    return x.reshape(4, bn // 64, 8, 4, 2, nv // 2).permute(0, 1, 4, 3, 2, 5).reshape(bn // 2, 8, nv // 2)


def test_v_word_program_splits_a_pair_word_into_subnormal_pairs() -> None:
    """Output 2 tt + u holds nibble u of byte tt of token a (the word's low half) and of token b (its high
    half), times 16^u: exact fp16 subnormals (their bits are the code times 16^u, below 1024)."""
    p = torch.randint(0, 2**32, (256,), dtype=torch.int64)
    regs = emulate_ptx(v_word_program(), {"$4": p})
    for tt in range(2):
        for u in range(2):
            out = regs[f"${tt * 2 + u}"]
            for half in range(2):
                nib = (p >> (16 * half + 8 * tt + 4 * u)) & 15
                assert torch.equal((out >> (16 * half)) & 0xFFFF, nib << (4 * u))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ppw", [1, 2, 4])
def test_values_operand_holds_each_tokens_codes_in_row_order(d: int, ppw: int) -> None:
    """From the pages' bytes to V_w^T, as `_load_w` and `_values_operand` do it: element [w, m, k] of V_w^T is
    the warp's token k (tile token 16 ppw w + k) code of dim `dim_of_row(d)[m]`, times 16^u (u = (m // 8) % 2,
    the high nibbles)."""
    assert torch.equal(dim_of_row(d).sort().values, torch.arange(d))
    n = 64 * ppw
    codes = torch.randint(0, 16, (n, d))
    plane = _plane_words(_pack_codes(codes, 4), "value")
    vc = _value_words(_load_blocks(plane, ppw, d // 16, lambda g, c: g * 4 + c), n).reshape(n // 2, d // 8, 2)
    regs = emulate_ptx(v_word_program(), {"$4": vc})

    h = [_halves(regs[f"${i}"]) for i in range(4)]
    y = _join(_join(h[0], h[1]), _join(h[2], h[3])).permute(0, 1, 3, 4, 5, 2)
    shape, order = value_axes(d, 4, ppw)
    y = y.reshape(shape).permute(order).reshape(4, d, 16 * ppw)
    m = torch.arange(d)
    want = codes.reshape(4, 16 * ppw, d)[:, :, dim_of_row(d)].permute(0, 2, 1) << (4 * ((m // 8) % 2))[None, :, None]
    assert torch.equal(y, want)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ppw", [1, 2, 4])
def test_values_operand3_holds_each_tokens_codes_in_row_order(d: int, ppw: int) -> None:
    """From the pages' 2-bit and 1-bit planes to V_w^T, as `_load_w` and `_values_operand3` do it: element
    [w, m, k] is the warp's token k code of dim `dim_of_row(d, 3)[m]` times 4^s, and `value_unit` undoes that
    factor."""
    rows = dim_of_row(d, 3)
    assert torch.equal(rows.sort().values, torch.arange(d))
    n = 64 * ppw
    codes = torch.randint(0, 8, (n, d))
    packed = _pack_codes(codes, 3)
    plane2, plane1 = _plane_words(packed[:, : d // 4], "value"), _plane_words(packed[:, d // 4:], "value1")
    v2 = _value_words(_load_blocks(plane2, ppw, d // 32, lambda g, c: g * 4 + c), n)
    v1 = _value_words(_load_blocks(plane1, ppw, d // 32, lambda g, c: (g % 4) * 4 + c), n)
    e = (torch.arange(8) // 4)[None, :, None].expand_as(v1)  # thread g's bit parity in the shared word
    regs = emulate_ptx(v3_word_program(), {"$8": v2, "$9": v1, "$10": 2 - e, "$11": 6 + e})

    h = [_halves(regs[f"${i}"]) for i in range(8)]
    y = _join8(h).permute(0, 1, 3, 4, 5, 6, 2)
    shape, order = value_axes(d, 3, ppw)
    y = y.reshape(shape).permute(order).reshape(4, d, 16 * ppw)
    want = codes.reshape(4, 16 * ppw, d)[:, :, rows].permute(0, 2, 1)
    scale = (value_unit(d, 3) * 2.0**24).round().to(torch.int64)  # 4^s per row
    assert torch.equal(y, want * scale[None, :, None])


@pytest.mark.parametrize("key_bits", [4, 3])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ppw", [1, 2, 4])
def test_key_words_come_back_in_the_tile_order(key_bits: int, d: int, ppw: int) -> None:
    """`_load_w`'s key loads and `_key_words`: word w of token t is word w of the token's row of the first key
    plane (what `_keys_operand` reads), and for 3-bit keys the matching 1-bit word is that row's word
    w mod D/32 shifted right by w // (D/32) (what `turboquant.k3_int8_program` takes as sign words)."""
    n = 64 * ppw
    nb = d // 2 if key_bits == 4 else d // 4
    cw = nb // 16
    tile = torch.randint(0, 256, (n, nb + (d // 8 if key_bits == 3 else 0)), dtype=torch.uint8)

    def key_words(x: torch.Tensor) -> torch.Tensor:  # `tq_warp._key_words`
        return x.reshape(4, ppw, 8, 4, 2, cw).permute(0, 1, 4, 2, 3, 5).reshape(n, 4 * cw)

    kc = key_words(_load_blocks(_plane_words(tile[:, :nb], "key"), ppw, 2 * cw, lambda r, c: r * 4 + c))
    assert torch.equal(kc, _words(tile[:, :nb]))
    if key_bits == 3:
        shift = (torch.arange(4) // 2)[None, None, None, :, None]
        ks = _load_blocks(_plane_words(tile[:, nb:], "key1"), ppw, 2 * cw, lambda r, c: (c % 2) * 8 + r) >> shift
        w1 = d // 32
        want = _words(tile[:, nb:])[:, torch.arange(4 * cw) % w1] >> (torch.arange(4 * cw) // w1)
        assert torch.equal(key_words(ks), want)


def _owners(layout) -> torch.Tensor:
    """Each element's (warp, lane, register) of a distributed linear layout -> [warps, lanes, regs, rank]
    coordinates: the XOR of the bases of the index's set bits (registers the low bits, then lanes, warps)."""
    bases = layout.reg_bases + layout.lane_bases + layout.warp_bases
    idx = torch.arange(1 << len(bases))[:, None]
    coords = torch.zeros(len(idx), len(layout.shape), dtype=torch.int64)
    for bit, base in enumerate(bases):
        coords ^= (idx >> bit & 1) * torch.tensor(base)
    return coords.reshape(1 << len(layout.warp_bases), 1 << len(layout.lane_bases), 1 << len(layout.reg_bases), -1)


@pytest.mark.parametrize("words", [1, 2, 4, 8])
@pytest.mark.parametrize("block_n", [64, 128, 256])
def test_block_layout_gives_each_thread_one_vector_per_page(words: int, block_n: int) -> None:
    """`block_layout` [w, pg, i, c, v]: thread 4 i + c of warp w holds words v of block (i, c) of each of its
    pages, the block's words innermost in its registers (so one vector load each: the compiler only vectorizes
    contiguous registers), then the page. A swapped base still computes the right answer but loads word by
    word, which only the GPU bench would see."""
    ppw = pages_per_warp(block_n)
    own = _owners(block_layout(ppw, words))  # [warps, lanes, regs, 5]
    w, lane, reg = torch.meshgrid(*(torch.arange(k) for k in own.shape[:3]), indexing="ij")
    assert torch.equal(own[..., 0], w)
    assert torch.equal(own[..., 2], lane // 4) and torch.equal(own[..., 3], lane % 4)
    assert torch.equal(own[..., 4], reg % words) and torch.equal(own[..., 1], reg // words)


def test_layouts_refuse_one_page_per_warp() -> None:
    """The sums MMA pairs a warp's pages (a page's two halves are its two row blocks, two pages its 16 columns),
    so a 64-token tile (one page per warp) is refused, with the tiles that work."""
    with pytest.raises(ValueError, match="block_n 128 or 256"):
        layouts(32, 64, 4, 64)
    assert layouts(32, 64, 4, 256)["BN"] == 256


@pytest.mark.parametrize("fmt", ["turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"])
@pytest.mark.parametrize("d", [64, 128])
def test_rotation_operand_gives_the_rotated_query_in_the_score_order(fmt: str, d: int) -> None:
    """`_rotated_query` computes q @ rotation_operand^T: that must be the rotation kernel's product
    (q @ Pi^T sqrt(D)) with its coordinates in the score MMA's K order (`int8_operand_order`), which the
    kernel's query bytes and the key operand share; the rotation's entries stay exactly +-1 in fp16."""
    from kvpolicy.kernels.turboquant import hadamard_rotation
    from kvpolicy.kernels.turboquant import int8_operand_order as query_order

    op = rotation_operand(fmt, d, "cpu")
    assert op.dtype == torch.float16 and op.is_contiguous() and set(op.unique().tolist()) == {-1.0, 1.0}
    q = torch.randn(8, d, dtype=torch.float64)
    want = (q @ hadamard_rotation(d).T * d**0.5)[:, query_order(fmt, d)]
    torch.testing.assert_close(q @ op.double().T, want, rtol=0, atol=1e-9)



@pytest.mark.parametrize("n, splits, groups, num_sms", [
    (512, 32, 8, 132), (4096, 4, 64, 132), (17, 32, 8, 132), (5, 40, 4, 20), (1000, 7, 3, 10), (64, 4, 64, 300)])
@pytest.mark.parametrize("weight", [1.0625, 1.25, 2.0])
def test_weighted_tiles_cut_each_group_whole_and_favour_the_first_wave(n: int, splits: int, groups: int,
                                                                       num_sms: int, weight: float) -> None:
    """The first-wave weight's split ranges (`weighted_tiles`, the host copy of the kernel's `_weighted_tiles`): in
    every group they tile [first, first + n) in order without gap or overlap; a split whose linear block id
    (group + groups x split) is below the SM count gets its weight's share, the others theirs, each within one
    tile; where every split is in the first wave the cut is even."""
    w1, w2 = split_weights(weight)
    first = 3
    for g in range(groups):
        ranges = [weighted_tiles(first, first + n, s, splits, g, groups, num_sms, w1, w2) for s in range(splits)]
        assert ranges[0][0] == first and ranges[-1][1] == first + n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        weights = [w1 if g + groups * s < num_sms else w2 for s in range(splits)]
        for (lo, hi), w in zip(ranges, weights):
            assert abs((hi - lo) - n * w / sum(weights)) < 1 + 1e-9
        if all(w == w1 for w in weights):
            assert max(hi - lo for lo, hi in ranges) - min(hi - lo for lo, hi in ranges) <= 1


def test_split_weights_are_sixteenths_and_one_means_the_plain_grid() -> None:
    assert split_weights(1.0) == (0, 0)
    assert split_weights(1.25) == (20, 16)
    with pytest.raises(ValueError, match="first-wave weight"):
        split_weights(0.0)


@pytest.mark.parametrize("fmt, head_dim, span, splits, want", [
    ("turboquant_3bit_nc", 64, 131072, 4, (18, 16)),  # gpt-oss layer, batch 8: 128 tiles per split
    ("turboquant_3bit_nc", 64, 65536, 4, (18, 16)),  # 64 tiles per split, the least that takes the weight
    ("turboquant_3bit_nc", 64, 131072, 32, (0, 0)),  # batch 1: 16 tiles per split
    ("turboquant_3bit_nc", 128, 131072, 32, (0, 0)),  # Llama layer, batch 1: 32
    ("turboquant_3bit_nc", 128, 65536, 4, (18, 16)),
    ("turboquant_4bit_nc", 64, 131072, 4, (0, 0)),  # no weight measured faster
    ("turboquant_k3v4_nc", 128, 131072, 4, (0, 0)),
])
def test_default_first_wave_weight_only_where_it_measured_faster(fmt: str, head_dim: int, span: int, splits: int,
                                                                  want: tuple[int, int]) -> None:
    """The defaults give 3bit_nc's first-wave splits 18/16 of the tiles at batch 8 (64k and 128k: 3.6-4% faster)
    and leave calls of few tiles per split (batch 1) and the other formats on the plain grid."""
    assert call_weights(fmt, head_dim, span, splits) == want
