"""The KV formats the kernels read and write: bits, slot and page layouts, per-format constants.

Pure Python (no torch, triton or numpy at import), so that `kvpolicy.formats` and the tests can share it.
TurboQuant slot sizes are vLLM's (`TurboQuantConfig.slot_size_aligned` in
vllm/model_executor/layers/quantization/turboquant/config.py; a test checks them against
`kvpolicy.formats`); the byte order inside a slot and a planar page is ours.

Slot layout (one token of one KV head; the Triton TurboQuant kernel reads it):

    [key codes | value codes | key norm fp16 (centroid keys only) | v scale fp16 | v zero fp16 | pad]

4-bit codes: byte j holds coordinate j (low nibble) and j + D/2 (high nibble). 3-bit codes are two
planes: D/4 bytes of 2-bit fields (byte j, bits 2s..2s+1 = low bits of coordinate s*D/4 + j) and D/8 bytes
of 1-bit fields (byte j, bit t = bit 2 of coordinate t*D/8 + j). Planar pages (the Hopper kernels read
them) hold the same bytes per token, one page of one KV head per row, each part of the slot in a plane of
the page's `PAGE` tokens that starts on a 16-byte boundary: key code planes, value code planes, one plane
of fp16 per field (`code_planes`, `field_planes`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

F16_MAX = 65504.0
"""Largest finite float16 (TurboQuant's stored norm, scale and zero point are fp16)."""
FP8_E4M3_MAX = 448.0
"""Largest finite e4m3 value: FP8 caches and queries saturate there."""

PAGE = 16
"""vLLM's default block size: the page the Gluon kernels read, and what makes every planar plane 16-byte aligned."""

PAGED_DTYPES = {"auto": "bfloat16", "bfloat16": "bfloat16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
"""The BF16/FP8 `--kv-cache-dtype` values the paged kernels take, and the torch dtype name of their elements."""

TQ_FORMATS: tuple[str, ...] = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
"""The four TurboQuant `--kv-cache-dtype` values."""

TQ_BITS = {"turboquant_k8v4": (8, 4), "turboquant_4bit_nc": (4, 4), "turboquant_k3v4_nc": (3, 4),
           "turboquant_3bit_nc": (3, 3)}
"""(key bits, value bits) of each TurboQuant format: 8 means FP8 e4m3 keys, 3 or 4 Lloyd-Max centroid codes."""

WARP_ORDER_FORMATS = ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
"""The centroid-key formats: their planar pages hold each plane in the per-warp Hopper kernel's thread order
(`turboquant.warp_plane_order`); k8v4's planes keep token order."""

SUPPORTED_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
"""Head dims of the TurboQuant formats: powers of two (Hadamard) with D/8 >= 8 lanes for the 3-bit plane."""


@dataclass(frozen=True)
class TQLayout:
    """Byte layout of one TurboQuant slot (one token of one KV head)."""

    name: str
    """The `--kv-cache-dtype` value."""
    head_dim: int
    """D."""
    key_bits: int
    """8 for FP8 keys, else 3 or 4 (Lloyd-Max code bits)."""
    value_bits: int
    """3 or 4 (uniform code bits)."""
    slot_bytes: int
    """Bytes per token per KV head, vLLM's size."""
    key_off: int
    """Offset of the key codes."""
    key_bytes: int
    """Bytes of key codes (D for FP8, D*bits/8 otherwise)."""
    val_off: int
    """Offset of the value codes."""
    val_bytes: int
    """Bytes of value codes."""
    knorm_off: int
    """Offset of the fp16 key norm (-1 for FP8 keys, which have none)."""
    vscale_off: int
    """Offset of the fp16 value scale."""
    vzero_off: int
    """Offset of the fp16 value zero point (the vector minimum)."""

    @property
    def key_fp8(self) -> bool:
        """Keys are FP8 e4m3 (k8v4) rather than centroid codes."""
        return self.key_bits == 8


def tq_slot_bytes(fmt: str, head_dim: int) -> int:
    """vLLM's bytes per token and KV head: keys ceil(D*b/8) + an fp16 norm (FP8 keys: D bytes), values
    ceil(D*b/8) + fp16 scale and zero, the slot rounded up to even."""
    kb, vb = TQ_BITS[fmt]
    key = head_dim if kb == 8 else math.ceil(head_dim * kb / 8) + 2
    total = key + math.ceil(head_dim * vb / 8) + 4
    return total + total % 2


@functools.cache
def tq_layout(fmt: str, head_dim: int) -> TQLayout:
    """Slot layout of `fmt` at `head_dim`; raises ValueError for unknown formats or head dims."""
    if fmt not in TQ_FORMATS:
        raise ValueError(f"unknown TurboQuant format {fmt!r}; expected one of {', '.join(TQ_FORMATS)}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{fmt}: head_dim {head_dim} is not supported; expected one of {SUPPORTED_HEAD_DIMS}")
    kb, vb = TQ_BITS[fmt]
    key_bytes = head_dim if kb == 8 else head_dim * kb // 8
    val_bytes = head_dim * vb // 8
    tail = key_bytes + val_bytes
    knorm_off = -1 if kb == 8 else tail
    vscale_off = tail if kb == 8 else tail + 2
    return TQLayout(fmt, head_dim, kb, vb, tq_slot_bytes(fmt, head_dim), 0, key_bytes, key_bytes, val_bytes,
                    knorm_off, vscale_off, vscale_off + 2)


def code_planes(fmt: str, head_dim: int) -> tuple[tuple[int, int], ...]:
    """(slot offset, bytes per token) of each code plane of a planar page, in page order: the key's, then the
    value's. 3-bit codes split into their 2-bit plane (D/4 bytes) and 1-bit plane (D/8 bytes), so that
    each starts on a 16-byte boundary of the page and a row of either is whole 32-bit words."""
    lay = tq_layout(fmt, head_dim)
    planes = []
    for off, bits, nbytes in ((lay.key_off, lay.key_bits, lay.key_bytes), (lay.val_off, lay.value_bits, lay.val_bytes)):
        if bits == 3:
            planes += [(off, head_dim // 4), (off + head_dim // 4, head_dim // 8)]
        else:
            planes.append((off, nbytes))
    return tuple(planes)


def field_planes(fmt: str, head_dim: int) -> tuple[int, ...]:
    """Slot offsets of the fp16 fields, in the order of their planes: (key norm,) value scale, value zero."""
    lay = tq_layout(fmt, head_dim)
    return ((lay.knorm_off,) if not lay.key_fp8 else ()) + (lay.vscale_off, lay.vzero_off)


def plane_kinds(fmt: str, head_dim: int) -> list[str]:
    """`turboquant.warp_plane_order`'s kind of each code plane, in `code_planes` order."""
    lay = tq_layout(fmt, head_dim)
    return (["key", "key1"] if lay.key_bits == 3 else ["key"]) + (["value", "value1"] if lay.value_bits == 3
                                                                   else ["value"])


@functools.cache
def planar_constexprs(fmt: str, head_dim: int) -> dict[str, int]:
    """The byte geometry of a planar page as the Gluon kernels compile it in: SLOT (bytes per token), KEY_BITS,
    V_BITS, KBM / VBM (bytes per token of the first key / value code plane), KB / VB (of all key / value
    codes) and NF (fp16 field planes)."""
    lay = tq_layout(fmt, head_dim)
    planes = code_planes(fmt, head_dim)  # the key's, then the value's
    return dict(SLOT=lay.slot_bytes, KEY_BITS=lay.key_bits, V_BITS=lay.value_bits, KBM=planes[0][1],
                KB=lay.key_bytes, VBM=planes[-2 if lay.value_bits == 3 else -1][1], VB=lay.val_bytes,
                NF=len(field_planes(fmt, head_dim)))


PTH_FORMATS: tuple[str, ...] = ("fp8_per_token_head", "int8_per_token_head", "int4_per_token_head")
"""The per-token-head `--kv-cache-dtype` values: scales computed per (token, KV head) at write time."""

PTH_MODE = {"fp8_per_token_head": 1, "int8_per_token_head": 2, "int4_per_token_head": 3}
"""The decode kernel's `PTH` constexpr of each format (0: a BF16/FP8 cache)."""

PTH_QMAX = {"fp8_per_token_head": FP8_E4M3_MAX, "int8_per_token_head": 127.0, "int4_per_token_head": 15.0}
"""The code range the scale maps a (token, head)'s range onto: amax / qmax (8-bit, symmetric), (max - min) / 15
(4-bit, asymmetric with a zero point), as vLLM's store kernels compute it."""

PTH_SCALE_FLOOR = 1e-6
"""vLLM's floor on every per-token-head scale (an all-zero head stores scale 1e-6)."""

PTH_HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
"""Head dims the per-token-head kernels take: powers of two (the int4 rotation is a Hadamard of the whole head)
with at least 32 packed int4 bytes (the int8 MMA's K)."""


@dataclass(frozen=True)
class PTHLayout:
    """One (token, KV head) row of a per-token-head cache, vLLM's `[K | K scale | V | V scale]`
    (`TritonAttentionImpl._ensure_scale_caches`, v1/attention/backends/triton_attn.py): data bytes, then one fp32."""

    name: str
    """The `--kv-cache-dtype` value."""
    head_dim: int
    """D."""
    data_bytes: int
    """Bytes of K (and of V) codes: D, or D/2 for int4 (two codes a byte, coordinate 2i in the low nibble)."""

    @property
    def row_bytes(self) -> int:
        """Bytes per token and KV head, scales included (`TritonAttentionBackend.customize_spec`)."""
        return 2 * (self.data_bytes + 4)

    @property
    def k_scale_off(self) -> int:
        """Byte offset of the fp32 key scale."""
        return self.data_bytes

    @property
    def v_off(self) -> int:
        """Byte offset of the value codes."""
        return self.data_bytes + 4

    @property
    def v_scale_off(self) -> int:
        """Byte offset of the fp32 value scale."""
        return 2 * self.data_bytes + 4


def pth_layout(fmt: str, head_dim: int) -> PTHLayout:
    """Row layout of a per-token-head format; ValueError for unknown formats or head dims."""
    if fmt not in PTH_MODE:
        raise ValueError(f"unknown per-token-head format {fmt!r}; expected one of {', '.join(PTH_FORMATS)}")
    if head_dim not in PTH_HEAD_DIMS:
        raise ValueError(f"{fmt}: head_dim {head_dim} is not supported; expected one of {PTH_HEAD_DIMS}")
    return PTHLayout(fmt, head_dim, head_dim // 2 if fmt == "int4_per_token_head" else head_dim)
