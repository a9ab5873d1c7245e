"""Per-layer paged KV caches for one model architecture and one KV variant.

`plan_layers` maps the variant onto the model's layers through the facts'
`Layout` (skip layers BF16, TurboQuant's BF16 boundary layers), so the runtime
and `recommend` agree on which layer holds which format. `allocate` builds the
caches; the bytes each cache takes per token must equal `layer_kv_bytes_per_token`
(the one copy of the KV-bytes formula), or allocation fails.

- full layers: a paged cache sized for the whole context;
- sliding layers: a ring of pages bounded to the window (logical page j lives in
  physical page j mod ring), so memory stops growing past the window;
- MLA layers: the latent (kv_lora_rank + rope) as one KV head, K = the latent and
  V = the same tensor, of which the first kv_lora_rank output dims are kept
  (absorbed-MLA decode);
- linear layers: no cache; shared layers: no cache, they read their source's.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from kvpolicy.errors import InputError
from kvpolicy.facts.kv_memory import Layout, layer_kv_bytes_per_token
from kvpolicy.formats import KvFormat
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.runtime.variants import Variant

BLOCK_SIZE = 16
"""Tokens per page (vLLM's default block size)."""
KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)
"""Head dims the BF16/FP8 Triton decode kernel takes."""
TQ_HEAD_DIMS = (64, 128, 256)
"""Head dims the TurboQuant kernels take."""
PTH_HEAD_DIMS = (64, 128, 256)
"""Head dims the per-token-head kernels take (`kvpolicy.kernels.formats.PTH_HEAD_DIMS`)."""



@dataclass(frozen=True)
class LayerPlan:
    """What one decoder layer holds and runs."""

    index: int
    """Layer index."""
    kind: str
    """full, sliding, mla, linear or shared."""
    fmt: KvFormat | None
    """Format of its own cache (None: no cache)."""
    num_q_heads: int
    """Query heads attending to this cache."""
    num_kv_heads: int
    """KV heads in the cache (1 for an MLA latent)."""
    head_dim: int
    """Key (and value) dim in the cache; the latent width for MLA."""
    out_dim: int
    """Output dims kept per query head (kv_lora_rank for MLA, else head_dim)."""
    window: int | None = None
    """Sliding window in tokens (sliding layers)."""
    source: int | None = None
    """Layer whose cache a shared layer reads."""
    has_sinks: bool = False
    """Learned attention sinks (gpt-oss)."""
    sm_scale: float = 1.0
    """Softmax scale: 1/sqrt(query-key dim); for MLA the un-absorbed qk dim."""
    bytes_per_token: int = 0
    """KV bytes one token adds to this layer (`layer_kv_bytes_per_token`)."""

    @property
    def has_cache(self) -> bool:
        """True when the layer stores KV of its own."""
        return self.fmt is not None

    @property
    def attends(self) -> bool:
        """True when the layer runs decode attention (all but linear layers)."""
        return self.kind != "linear"

    def kernel_path(self, backend: str, gluon: bool = False) -> str:
        """`triton`; `gluon` for the FP8, TurboQuant and per-token-head layers the Hopper Gluon kernels take, when
        `gluon` (the GPU is an sm_90 one: `gluon_available`); `reference` where the kernels do not take this
        layer (or on the CPU)."""
        if backend != "triton":
            return "reference"
        if self.fmt is not None and self.fmt.per_token_head:
            if self.head_dim not in PTH_HEAD_DIMS or self.kind == "mla":
                return "reference"
            if gluon:
                # Hopper: the per-token-head Gluon kernel (at least as fast as the Triton one wherever it applies)
                from kvpolicy.kernels.pth_gluon import shape_refusal

                if not shape_refusal(self.head_dim, self.num_q_heads // self.num_kv_heads, BLOCK_SIZE):
                    return "gluon"
            return "triton"
        if self.fmt is not None and self.fmt.kind == "turboquant":
            if gluon:
                # Hopper: TurboQuant layers read a planar cache with the Gluon kernel (what it takes is its own to say)
                from kvpolicy.kernels.tq_decode import gluon_refusal

                if not gluon_refusal(self.fmt.name, self.head_dim, self.num_q_heads // self.num_kv_heads, BLOCK_SIZE):
                    return "gluon"
            return "triton"
        if self.head_dim not in KERNEL_HEAD_DIMS:
            return "reference"
        if gluon and self.fmt is not None and self.fmt.kind == "fp8":
            # what the Gluon kernel takes is its own to say (`gluon` means it imports here)
            from kvpolicy.kernels import decode_gluon as dg

            if self.head_dim in dg.HEAD_DIMS and self.num_q_heads // self.num_kv_heads <= dg.MAX_GROUP and BLOCK_SIZE == dg.PAGE:
                return "gluon"
        return "triton"


def _gluon_on(device: Any) -> bool:
    if device.type != "cuda":
        return False  # before importing the kernels: the CPU runtime needs no Triton
    from kvpolicy.kernels.launch import gluon_runs_on

    return gluon_runs_on(device)[0]


def gluon_available(device: Any) -> bool:
    """Whether FP8 and TurboQuant layers decode with the Gluon kernels here: an sm_90 GPU, a Triton with its Gluon API
    (`launch.gluon_runs_on`), and `KVPOLICY_GLUON` not set to 0."""
    return os.environ.get("KVPOLICY_GLUON", "1") != "0" and _gluon_on(device)


def _shared_sources(arch: ModelArch) -> dict[int, int]:
    """Source layer of each shared layer: the last cache-holding layer of the same kind in the repeating pattern."""
    types = arch.layer_types
    first = next((i for i, t in enumerate(types) if t == "shared"), None)
    if first is None:
        return {}
    if first == 0:
        raise InputError(f"{arch.id}: every layer is `shared`; no layer holds a KV cache to share.")
    head = types[:first]
    # The smallest period of the layers before the first shared one gives each shared layer its kind.
    period = next(p for p in range(1, first + 1) if all(head[j] == head[j + p] for j in range(first - p)))
    out = {}
    for i in range(first, len(types)):
        kind = head[i % period]
        out[i] = max(j for j in range(first) if head[j] == kind)
    return out


def plan_layers(arch: ModelArch, variant: Variant) -> list[LayerPlan]:
    """Per-layer plan of a variant on an architecture (formats from the facts' `Layout`)."""
    layout = Layout.of(arch, variant.kv_cache_dtype, list(variant.skip_layers))
    sources = _shared_sources(arch)
    plans: list[LayerPlan] = []
    for i, kind in enumerate(arch.layer_types):
        fmt = layout.formats[i]
        common: dict[str, Any] = {"index": i, "kind": kind, "num_q_heads": arch.num_attention_heads,
                                  "has_sinks": arch.has_attention_sinks,
                                  "sm_scale": arch.head_dims(i)[0] ** -0.5 if kind != "linear" else 1.0}
        if kind == "linear":
            plans.append(LayerPlan(fmt=None, num_kv_heads=0, head_dim=0, out_dim=0, **common))
        elif kind == "mla":
            assert arch.kv_lora_rank is not None and arch.qk_rope_head_dim is not None
            latent = arch.kv_lora_rank + arch.qk_rope_head_dim
            plans.append(LayerPlan(fmt=fmt, num_kv_heads=1, head_dim=latent, out_dim=arch.kv_lora_rank,
                                   bytes_per_token=layer_kv_bytes_per_token(arch, i, fmt), **common))
        elif kind == "shared":
            src = plans[sources[i]]
            common["sm_scale"] = src.sm_scale
            plans.append(LayerPlan(fmt=None, num_kv_heads=src.num_kv_heads, head_dim=src.head_dim,
                                   out_dim=src.out_dim, window=src.window, source=src.index, **common))
        else:
            k, v = arch.head_dims(i)
            if k != v:
                raise InputError(f"{arch.id}: layer {i} has key dim {k} and value dim {v}; the runtime's "
                                 "paged caches hold K and V of one head dim.")
            if fmt.kind == "turboquant" and k not in TQ_HEAD_DIMS:
                raise InputError(f"{arch.id}: layer {i} has head_dim {k}; the TurboQuant kernels take "
                                 f"{', '.join(map(str, TQ_HEAD_DIMS))}. Compare fp8 or bf16 instead.")
            if fmt.per_token_head and k not in PTH_HEAD_DIMS:
                raise InputError(f"{arch.id}: layer {i} has head_dim {k}; the per-token-head kernels take "
                                 f"{', '.join(map(str, PTH_HEAD_DIMS))}. Compare fp8 or bf16 instead.")
            plans.append(LayerPlan(fmt=fmt, num_kv_heads=arch.num_kv_heads, head_dim=k, out_dim=k,
                                   window=arch.sliding_window if kind == "sliding" else None,
                                   bytes_per_token=layer_kv_bytes_per_token(arch, i, fmt), **common))
    return plans


def pages_per_sequence(plan: LayerPlan, max_context: int, block_size: int = BLOCK_SIZE) -> int:
    """Physical pages one sequence holds in this layer: the whole context, or a ring bounded to the window."""
    full = math.ceil(max_context / block_size)
    if plan.window is None:
        return full
    return min(full, math.ceil(plan.window / block_size) + 1)


@dataclass
class LayerCache:
    """The tensors of one layer's cache."""

    plan: LayerPlan
    """What the layer holds."""
    key_cache: Any = None
    """[num_blocks, block_size, num_kv_heads, head_dim] (BF16/FP8); the packed uint8 cache for TurboQuant and
    the per-token-head formats (rows of codes and inline scales)."""
    value_cache: Any = None
    """Value cache (the same tensor as key_cache for MLA latents; None for TurboQuant)."""
    k_scale: Any = None
    """FP8 key scale, fp32 [1] or [num_kv_heads] (None: 1.0)."""
    v_scale: Any = None
    """FP8 value scale."""
    block_tables: Any = None
    """int32 [batch, logical pages]: logical page -> physical page."""
    sinks: Any = None
    """fp32 [num_q_heads] sink logits (gpt-oss)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Backend scratch (per-context block-table slices)."""

    @property
    def nbytes(self) -> int:
        """Bytes the cache tensors take."""
        tensors = {id(t): t for t in (self.key_cache, self.value_cache) if t is not None}
        return sum(t.numel() * t.element_size() for t in tensors.values())


def cache_dtype_name(fmt: KvFormat) -> str:
    """The allocate_cache dtype name of a BF16/FP8 format."""
    return "fp8" if fmt.kind == "fp8" else "auto"


def allocate(plans: list[LayerPlan], batch: int, max_context: int, device: Any,
             block_size: int = BLOCK_SIZE, seed: int = 0, layout: str = "NHD") -> list[LayerCache | None]:
    """Allocate every layer's cache for `batch` sequences of up to `max_context` tokens (None for no-cache layers).

    `layout` ("NHD" or "HND") orders the pages of BF16/FP8 caches of full and sliding layers; MLA
    latents (one KV head) have one order; TurboQuant caches are planar pages where the Gluon kernel
    decodes them (`LayerPlan.kernel_path`), slots elsewhere.

    Block tables map sequence b's logical page j to physical page
    b * pages + (j mod pages), which is the identity for full layers and a ring
    for sliding ones.
    """
    import torch

    from kvpolicy.kernels.paged_store import allocate_cache

    logical = math.ceil(max_context / block_size)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    caches: list[LayerCache | None] = []
    for plan in plans:
        if not plan.has_cache:
            caches.append(None)
            continue
        assert plan.fmt is not None
        pages = pages_per_sequence(plan, max_context, block_size)
        num_blocks = batch * pages
        c = LayerCache(plan=plan)
        if plan.fmt.kind == "turboquant":
            from kvpolicy.kernels.turboquant import (
                allocate_tq_cache,
                allocate_tq_planar_cache,
            )

            # the Gluon kernel reads planar pages (the same bytes per token as the slots the Triton kernel reads)
            planar = plan.kernel_path("triton", gluon_available(torch.device(device))) == "gluon"
            c.key_cache = (allocate_tq_planar_cache if planar else allocate_tq_cache)(
                num_blocks, block_size, plan.num_kv_heads, plan.head_dim, plan.fmt.name, device)
        elif plan.fmt.per_token_head:
            from kvpolicy.kernels.paged_store import allocate_pth_cache

            if plan.kind == "mla":
                raise InputError(f"layer {plan.index}: the runtime's per-token-head kernels store K/V heads, not "
                                 "MLA latents; compare fp8 or bf16 on this model.")
            c.key_cache = allocate_pth_cache(num_blocks, block_size, plan.num_kv_heads, plan.head_dim, plan.fmt.name,
                                             device, layout)
        elif plan.kind == "mla":
            # One latent serves as K and V: the second tensor allocate_cache returns is dropped.
            c.key_cache, _ = allocate_cache(num_blocks, block_size, 1, plan.head_dim,
                                            cache_dtype_name(plan.fmt), device)
            c.value_cache = c.key_cache
        else:
            c.key_cache, c.value_cache = allocate_cache(num_blocks, block_size, plan.num_kv_heads, plan.head_dim,
                                                        cache_dtype_name(plan.fmt), device, layout)
        per_token = c.nbytes // (num_blocks * block_size)
        if per_token != plan.bytes_per_token:
            raise RuntimeError(f"layer {plan.index}: the {plan.fmt.name} cache takes {per_token} bytes per token, "
                               f"the KV-bytes formula says {plan.bytes_per_token}: the kernels' layout and "
                               "kvpolicy.formats disagree.")
        rows = torch.arange(batch, dtype=torch.int32)[:, None] * pages
        cols = torch.arange(logical, dtype=torch.int32)[None, :] % pages
        c.block_tables = (rows + cols).contiguous().to(device)
        if plan.has_sinks:
            c.sinks = torch.randn(plan.num_q_heads, generator=gen, dtype=torch.float32).to(device)
        caches.append(c)
    return caches


def slots_for(positions: Any, block_tables: Any, block_size: int = BLOCK_SIZE) -> Any:
    """int64 slots [batch, n] of token positions [n] in every sequence, through the block tables."""
    import torch

    pages = block_tables[:, positions // block_size].to(torch.int64)
    return pages * block_size + (positions % block_size)[None, :]
