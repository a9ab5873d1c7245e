"""KV-cache formats as vLLM spells them, and the bytes each stores per token.

This is the one place that knows how many bytes a KV format takes; the capacity
estimates, the runtime's cache allocator and the tests all call `slot_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

FormatKind = Literal["bf16", "fp8", "turboquant"]


@dataclass(frozen=True)
class KvFormat:
    """Storage of one KV format for one token of one KV head."""

    name: str
    """The `--kv-cache-dtype` value."""
    kind: FormatKind
    """Family: bf16 (16-bit), fp8 (8-bit float) or turboquant (3-4 bit packed)."""
    key_bits: int
    """Bits per key coordinate (8 for FP8 keys, 3 or 4 for centroid indices)."""
    value_bits: int
    """Bits per value coordinate."""
    fp8_variant: str | None = None
    """e4m3 or e5m2 for FP8 formats."""

    def slot_bytes(self, head_dim: int, v_head_dim: int | None = None) -> int:
        """Bytes one token of one KV head occupies (K and V together), as vLLM allocates them."""
        dv = v_head_dim if v_head_dim is not None else head_dim
        if self.kind != "turboquant":
            return (head_dim + dv) * (self.key_bits // 8)
        # vLLM: keys ceil(D*b/8) + fp16 norm (FP8 keys: D bytes), values
        # ceil(D*b/8) + fp16 scale + fp16 zero, the slot rounded up to even.
        key = head_dim if self.key_bits == 8 else math.ceil(head_dim * self.key_bits / 8) + 2
        value = math.ceil(dv * self.value_bits / 8) + 4
        total = key + value
        return total + (total % 2)

    def mla_bytes(self, latent_dim: int) -> int:
        """Bytes of one MLA latent (kv_lora_rank + qk_rope_head_dim) per token."""
        if self.kind == "turboquant":
            raise ValueError(f"{self.name} does not support MLA")
        return latent_dim * (self.key_bits // 8)


FORMATS: dict[str, KvFormat] = {
    f.name: f
    for f in (
        KvFormat("auto", "bf16", 16, 16),
        KvFormat("bfloat16", "bf16", 16, 16),
        KvFormat("float16", "bf16", 16, 16),
        KvFormat("fp8", "fp8", 8, 8, "e4m3"),
        KvFormat("fp8_e4m3", "fp8", 8, 8, "e4m3"),
        KvFormat("fp8_e5m2", "fp8", 8, 8, "e5m2"),
        KvFormat("turboquant_k8v4", "turboquant", 8, 4),
        KvFormat("turboquant_4bit_nc", "turboquant", 4, 4),
        KvFormat("turboquant_k3v4_nc", "turboquant", 3, 4),
        KvFormat("turboquant_3bit_nc", "turboquant", 3, 3),
    )
}

KV_DTYPES = tuple(FORMATS)
"""Every `--kv-cache-dtype` value kvpolicy can decide."""

FP8_DS_MLA_BYTES = 656
"""vLLM's `fp8_ds_mla` bytes per token (DeepSeek-style MLA latent with scales)."""


def get_format(name: str) -> KvFormat:
    """Look up a format by its vLLM name; raises KeyError for unknown names."""
    return FORMATS[name]
