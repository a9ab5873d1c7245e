"""The index algebra of `kernels/tq_warp.py` on the CPU. Gluon does not
run under the interpreter, so the value operand's construction is replayed here with the same tensor
operations (join = stack on a new last axis) on the emulated PTX program, and compared with the codes it
must hold; the kernel itself is tested on the GPU (test_tq_gluon.py -k per_warp)."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.kernels.tq_reference import _pack_codes, emulate_ptx
from kvpolicy.kernels.tq_warp import dim_of_row, v_pair_program


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
def test_values_operand_holds_each_tokens_codes_in_row_order(d: int) -> None:
    """`_values_operand`'s steps on a tile of packed value codes: element [w, m, k] of V_w^T is token 16 w + k's
    code of dim `dim_of_row(d)[m]`, times 16^u (u = (m // 8) % 2, the high nibbles)."""
    assert torch.equal(dim_of_row(d).sort().values, torch.arange(d))
    codes = torch.randint(0, 16, (64, d))
    vc = _words(_pack_codes(codes, 4))  # [64, d/8]: the cache's value plane rows
    a, b = vc[0::2], vc[1::2]  # reshape [32, 2, d/8], permute, split: tokens 2p and 2p + 1
    regs = emulate_ptx(v_pair_program(), {"$8": a, "$9": b})

    def halves(o):  # `_halves`
        return torch.stack([o & 0xFFFF, o >> 16], dim=-1)

    h = [halves(regs[f"${i}"]) for i in range(8)]
    j = lambda x, y: torch.stack([x, y], dim=-1)  # noqa: E731  gl.join
    y = j(j(j(h[0], h[1]), j(h[2], h[3])), j(j(h[4], h[5]), j(h[6], h[7])))
    y = y.reshape(4, 2, 4, 8, d // 64, 2, 2, 2, 2).permute(0, 4, 8, 7, 6, 3, 1, 2, 5).reshape(4, d, 16)
    m = torch.arange(d)
    want = codes.reshape(4, 16, d)[:, :, dim_of_row(d)].permute(0, 2, 1) << (4 * ((m // 8) % 2))[None, :, None]
    assert torch.equal(y, want)
