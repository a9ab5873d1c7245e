"""KV memory: vLLM's bytes-per-token formula, the per-layer layout of a dtype, and the budget it must fit.

`layer_kv_bytes_per_token` is the one copy of vLLM's formula (vLLM v1
`kv_cache_interface`): recommend, the runtime's cache allocator and the tests use it.
Memory follows vLLM's accounting: the KV budget per rank is
`memory x gpu_memory_utilization - weights / tp - runtime reserve`, every layer
stores `layer_kv_bytes_per_token` per token it holds, and sliding layers hold at
most `window - 1 + max_num_batched_tokens` tokens per request.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvpolicy.facts.formats import FORMATS, FP8_DS_MLA_BYTES, KvFormat
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.inputs.workload import Workload


def layer_kv_bytes_per_token(arch: ModelArch, layer: int, fmt: KvFormat, tp: int = 1) -> int:
    """Bytes one token adds to one layer's cache on one tensor-parallel rank."""
    kind = arch.layer_types[layer]
    if kind in ("linear", "shared"):
        return 0
    if kind == "mla":
        assert arch.kv_lora_rank is not None and arch.qk_rope_head_dim is not None
        if fmt.name == "fp8_ds_mla":
            return FP8_DS_MLA_BYTES
        # The latent is not split across ranks: every rank caches all of it.
        return fmt.mla_bytes(arch.kv_lora_rank + arch.qk_rope_head_dim)
    k, v = arch.head_dims(layer)
    return arch.kv_heads_per_rank(tp) * fmt.slot_bytes(k, v)


def tokens_held(arch: ModelArch, layer: int, context_tokens: int, max_num_batched_tokens: int = 8192) -> int:
    """Tokens one request keeps in one layer's cache at a context length (vLLM's sliding bound)."""
    if arch.layer_types[layer] == "sliding":
        assert arch.sliding_window is not None
        return min(arch.sliding_window - 1 + max_num_batched_tokens, context_tokens)
    return context_tokens


GIB = 1 << 30
RUNTIME_RESERVE_GIB = 2.5
"""Activations, CUDA graphs and allocator slack vLLM keeps outside the KV cache (modelled; vLLM profiles it)."""
TURBOQUANT_BOUNDARY_LAYERS = 2
"""vLLM keeps the first and last two layers of dense models in BF16 under TurboQuant."""


@dataclass(frozen=True)
class Layout:
    """A KV format per layer for one deployment, with its byte counts precomputed."""

    arch: ModelArch
    formats: tuple[KvFormat, ...]
    tp: int = 1
    by_kind: tuple[tuple[str, int], ...] = ()
    """Bytes per token per rank summed over the layers of each kind."""

    @classmethod
    def of(cls, arch: ModelArch, dtype: str, skip_layers: list[str] | tuple[str, ...] = (), tp: int = 1) -> Layout:
        """Per-layer formats for a dtype, honouring skip layers (and TurboQuant's boundary layers)."""
        return _layout(_ArchKey(arch), dtype, tuple(skip_layers), tp)

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes per token per rank, summed over the layers of each kind that hold KV."""
        return dict(self.by_kind)

    def bytes_per_token(self) -> int:
        """Bytes per token per rank over all KV-holding layers."""
        return sum(b for _, b in self.by_kind)

    def request_bytes(self, context_tokens: int) -> int:
        """Bytes one request at a context length holds per rank (sliding layers capped)."""
        total = 0
        for kind, b in self.by_kind:
            if kind == "sliding":
                # Every sliding layer holds the same number of tokens (one window bound).
                first = self.arch.layer_types.index("sliding")
                total += b * tokens_held(self.arch, first, context_tokens)
            else:
                total += b * context_tokens
        return total

    def growing_bytes(self) -> int:
        """Bytes read per extra token of context at long context (sliding layers stop growing)."""
        return sum(b for kind, b in self.by_kind if kind in ("full", "mla")) or self.bytes_per_token()


class _ArchKey:
    """A ModelArch compared and hashed by its content, so that equal architectures share cached layouts."""

    __slots__ = ("arch", "content")

    def __init__(self, arch: ModelArch) -> None:
        self.arch = arch
        self.content = arch.content_key

    def __hash__(self) -> int:
        return hash(self.content)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ArchKey) and self.content == other.content


# Bounded: layouts for a few thousand (architecture, dtype, skips, tp) combinations, evicted least recently used.
@functools.lru_cache(maxsize=2048)
def _layout(key: _ArchKey, dtype: str, skip_layers: tuple[str, ...], tp: int) -> Layout:
    arch = key.arch
    chosen = FORMATS[dtype]
    bf16 = FORMATS["auto"]
    skip_idx = {int(s) for s in skip_layers if str(s).isdigit()}
    skip_sliding = "sliding_window" in skip_layers
    n = arch.num_layers
    formats = []
    for i, kind in enumerate(arch.layer_types):
        keep = i in skip_idx or (skip_sliding and kind == "sliding")
        if chosen.kind == "turboquant" and (i < TURBOQUANT_BOUNDARY_LAYERS or i >= n - TURBOQUANT_BOUNDARY_LAYERS):
            keep = True
        if chosen.kind == "turboquant" and kind == "mla":
            keep = True
        formats.append(bf16 if keep else chosen)
    by_kind: dict[str, int] = {}
    for i, kind in enumerate(arch.layer_types):
        b = layer_kv_bytes_per_token(arch, i, formats[i], tp)
        if b:
            by_kind[kind] = by_kind.get(kind, 0) + b
    return Layout(arch, tuple(formats), tp, tuple(by_kind.items()))


def kv_budget_bytes(arch: ModelArch, gpu: GpuSpec, workload: Workload) -> float:
    """Bytes of KV cache one rank can hold (negative when the weights do not fit)."""
    usable = gpu.memory_gib * GIB * workload.gpu_memory_utilization
    return usable - arch.weight_bytes / workload.tp - RUNTIME_RESERVE_GIB * GIB


def max_concurrency(layout: Layout, budget: float, workload: Workload) -> int:
    """Requests at the workload's context that fit in the budget."""
    per_request = layout.request_bytes(workload.context_tokens)
    if budget <= 0 or per_request <= 0:
        return 0
    return int(budget // per_request)
