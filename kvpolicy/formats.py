"""Every `--kv-cache-dtype` of vLLM 0.33 and the bytes it stores per token: the one format registry.

A stage-free leaf (pure Python, imports nothing of kvpolicy): the facts, the rules,
the runtime and the kernels all read their bits and bytes here. Each format names the
vLLM 0.33 function that decides its bytes (paths relative to the `vllm/` package).
vLLM's spec only knows `(head_size + head_size_v) x element size`
(`AttentionSpec.state_content_size_bytes`, `v1/kv_cache_interface.py`); every packed
format gets its bytes from its backend's `customize_spec`, mirrored by `slot_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

FormatFamily = Literal[
    "bf16", "fp8", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head",
    "nvfp4", "turboquant", "mla_ds", "octave", "ultraquant",
]
"""bf16: the model dtype (16-bit); fp8: 8-bit float with per-tensor scales outside the cache;
*_per_token_head: scales computed at write time, stored inline (TRITON_ATTN);
nvfp4: E2M1 + E4M3 scales per 16 values (FlashInfer); turboquant: 3-4 bit packed K|V slots;
mla_ds: DeepSeek sparse-MLA blobs; octave: ROCm 3/4-bit; ultraquant: ROCm FP4 + E8M0 per 32."""
FormatKind = FormatFamily
"""The family's older name (`KvFormat.kind`)."""

_FP32 = 4
"""Bytes of one fp32 inline scale (per-token-head formats)."""


@dataclass(frozen=True)
class KvFormat:
    """Storage of one `--kv-cache-dtype` for one token of one KV head (or one MLA latent)."""

    name: str
    """The `--kv-cache-dtype` value, as vLLM spells it."""
    family: FormatFamily
    """How the bytes are laid out (see FormatFamily)."""
    key_bits: int
    """Bits per key coordinate (16 for the model dtype; fp8 8; packed formats their code width)."""
    value_bits: int
    """Bits per value coordinate."""
    fp8_variant: str | None = None
    """e4m3 or e5m2 for the 8-bit float formats."""
    storage: str = "uint8"
    """Element type of the cache tensor (`STR_DTYPE_TO_TORCH_DTYPE`, `utils/torch_utils.py`);
    `model` for auto (the model dtype)."""
    mla_fixed_bytes: int | None = None
    """Bytes per token of the DeepSeek sparse-MLA blobs (their size is not derivable from head_size)."""
    platforms: tuple[str, ...] = ("cuda", "rocm")
    """Where vLLM 0.33 has a backend that stores it."""
    source: str = ""
    """The vLLM 0.33 function that decides the bytes."""

    @property
    def kind(self) -> FormatFamily:
        """The family (older name)."""
        return self.family

    @property
    def quantized(self) -> bool:
        """False for the 16-bit model-dtype formats."""
        return self.family != "bf16"

    @property
    def per_token_head(self) -> bool:
        """Scales computed per (token, head) at write time (checkpoint scales are ignored)."""
        return self.family.endswith("_per_token_head")

    def slot_bytes(self, head_size: int, head_size_v: int | None = None, *, rotary_dim: int | None = None) -> int:
        """Bytes one token of one KV head occupies (K and V together, scales included), as vLLM allocates them."""
        d = head_size
        dv = head_size if head_size_v is None else head_size_v
        fam = self.family
        if fam == "bf16":
            return (d + dv) * 2
        if fam == "fp8":
            return d + dv
        if fam in ("fp8_per_token_head", "int8_per_token_head"):
            # TritonAttentionBackend.customize_spec: data + one fp32 scale per K side and per V side.
            return (d + dv) + 2 * _FP32
        if fam == "int4_per_token_head":
            return (d // 2 + dv // 2) + 2 * _FP32
        if fam == "nvfp4":
            # FlashInferBackend.customize_spec: K and V as two head slots of nvfp4_kv_cache_full_dim bytes.
            if d != dv:
                raise ValueError(f"{self.name}: vLLM asserts equal K/V head sizes (got {d} and {dv})")
            return 2 * (d // 2 + d // 16)
        if fam == "turboquant":
            # TurboQuantConfig sizes key and value with head_size only (customize_spec passes spec.head_size).
            key = d if self.key_bits == 8 else math.ceil(d * self.key_bits / 8) + 2
            value = math.ceil(d * self.value_bits / 8) + 4
            slot = key + value
            return slot + slot % 2
        if fam == "ultraquant":
            # ultraquant/format.py slot_size: FP4 codes + one E8M0 byte per 32 values, for K and for V.
            if d % 32 or d % 2:
                raise ValueError(f"{self.name}: head_size {d} must be a multiple of 32")
            return 2 * (d // 2 + d // 32)
        if fam == "octave":
            return _octave_slot_bytes(self.name, d, rotary_dim if rotary_dim is not None else d)
        raise ValueError(f"{self.name} stores MLA latents only (sparse-MLA models)")

    def mla_bytes(self, kv_lora_rank: int, rope_dim: int) -> int:
        """Bytes of one MLA latent (kv_lora_rank + qk_rope_head_dim) per token, as vLLM's MLA spec sizes it."""
        if self.mla_fixed_bytes is not None:
            return self.mla_fixed_bytes
        latent = kv_lora_rank + rope_dim
        if self.family == "bf16":
            return latent * 2
        if self.per_token_head:
            # MLACommonBackend.customize_spec: one latent plus an fp32 scale pair.
            data = latent // 2 if self.family == "int4_per_token_head" else latent
            return data + 2 * _FP32
        # Every other quantized dtype: one byte per latent element (uint8/fp8 storage).
        return latent


def _octave_slot_bytes(name: str, d: int, rope: int) -> int:
    """`OctaveFormat.slot_bytes` (`v1/attention/ops/rocm_octave.py`): RoPE dims 4-bit, the rest 3-bit, fp16 scales."""
    v_bits, compact = {"octave_k3v4": (4, False), "octave_k3v3": (3, False), "octave_k3v3_compact": (3, True)}[name]
    if d % 64 or rope % 64:
        raise ValueError(f"{name}: head_size and rotary dim must be multiples of 64 (got {d}, {rope})")
    wide = 0 if compact else rope
    off_v = wide * 4 // 8 + (d - wide) * 3 // 8
    off_scales = off_v + d * v_bits // 8
    num_scales = (1 if compact else d // 64) + 1
    align = 4 if compact else 8
    raw = off_scales + 2 * num_scales
    return (raw + align - 1) // align * align


_TRITON = "v1/attention/backends/triton_attn.py TritonAttentionBackend.customize_spec"
_TQ = ("v1/attention/backends/turboquant_attn.py TurboQuantAttentionBackend.customize_spec -> "
       "model_executor/layers/quantization/turboquant/config.py TurboQuantConfig.slot_size_aligned")
_SPEC = "v1/kv_cache_interface.py AttentionSpec.state_content_size_bytes"
_OCTAVE = ("v1/attention/backends/rocm_octave_attn.py RocmOctaveAttentionBackend.customize_spec -> "
           "v1/attention/ops/rocm_octave.py OctaveFormat.slot_bytes")
_DS_MLA = "model_executor/layers/attention/mla_attention.py MLAAttention.get_kv_cache_spec (state_content_bytes)"

FORMATS: dict[str, KvFormat] = {
    f.name: f
    for f in (
        KvFormat("auto", "bf16", 16, 16, storage="model", source=_SPEC),
        KvFormat("bfloat16", "bf16", 16, 16, storage="bfloat16", source=_SPEC),
        KvFormat("float16", "bf16", 16, 16, storage="float16", source=_SPEC),
        KvFormat("fp8", "fp8", 8, 8, "e4m3", source=_SPEC),
        KvFormat("fp8_e4m3", "fp8", 8, 8, "e4m3", source=_SPEC),
        KvFormat("fp8_e5m2", "fp8", 8, 8, "e5m2", source=_SPEC),
        KvFormat("fp8_inc", "fp8", 8, 8, "e4m3", storage="float8_e4m3fn", platforms=("hpu",), source=_SPEC),
        KvFormat("fp8_per_token_head", "fp8_per_token_head", 8, 8, "e4m3", source=_TRITON),
        KvFormat("int8_per_token_head", "int8_per_token_head", 8, 8, storage="int8", source=_TRITON),
        KvFormat("int4_per_token_head", "int4_per_token_head", 4, 4, source=_TRITON),
        KvFormat("nvfp4", "nvfp4", 4, 4, platforms=("cuda",),
                 source="v1/attention/backends/flashinfer.py FlashInferBackend.customize_spec, "
                        "utils/torch_utils.py nvfp4_kv_cache_full_dim"),
        KvFormat("nvfp4_4over6", "nvfp4", 4, 4, platforms=("cuda",),
                 source="v1/attention/backends/flashinfer.py FlashInferBackend.customize_spec, "
                        "utils/torch_utils.py nvfp4_kv_cache_full_dim"),
        KvFormat("turboquant_k8v4", "turboquant", 8, 4, source=_TQ),
        KvFormat("turboquant_4bit_nc", "turboquant", 4, 4, source=_TQ),
        KvFormat("turboquant_k3v4_nc", "turboquant", 3, 4, source=_TQ),
        KvFormat("turboquant_3bit_nc", "turboquant", 3, 3, source=_TQ),
        KvFormat("fp8_ds_mla", "mla_ds", 8, 8, "e4m3", mla_fixed_bytes=656, platforms=("cuda",), source=_DS_MLA),
        KvFormat("nvfp4_ds_mla", "mla_ds", 4, 4, mla_fixed_bytes=352, platforms=("cuda",), source=_DS_MLA),
        KvFormat("octave_k3v4", "octave", 3, 4, platforms=("rocm",), source=_OCTAVE),
        KvFormat("octave_k3v3", "octave", 3, 3, platforms=("rocm",), source=_OCTAVE),
        KvFormat("octave_k3v3_compact", "octave", 3, 3, platforms=("rocm",), source=_OCTAVE),
        KvFormat("ultraquant_4bit", "ultraquant", 4, 4, platforms=("rocm",),
                 source="v1/attention/backends/ultraquant_attn.py UltraQuantAttentionBackend.customize_spec -> "
                        "v1/attention/ops/ultraquant/format.py slot_size"),
    )
}
"""Every `--kv-cache-dtype` vLLM 0.33 accepts (`CacheDType`, `config/cache.py`), in its order of families."""

KV_DTYPES = tuple(FORMATS)
"""Every `--kv-cache-dtype` value kvpolicy knows."""

FP8_DS_MLA_BYTES = FORMATS["fp8_ds_mla"].mla_fixed_bytes
"""vLLM's `fp8_ds_mla` bytes per token (512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE)."""


def get_format(name: str) -> KvFormat:
    """Look up a format by its vLLM name; raises KeyError for unknown names."""
    return FORMATS[name]
