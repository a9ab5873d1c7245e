"""One decode step of every attention layer: store the new token's K/V, then attend over the cache.

`DecodeStep` owns the caches of one variant for a batch and a longest context.
`fill(context)` writes random K/V for the first `context` positions of every
sequence (sliding layers only their ring), `prepare(context)` points the step at
that context, and `run()` is the step itself: what `bench` times and what a
model's decode would do per token, minus the matmuls outside attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvpolicy.inputs.arch import ModelArch
from kvpolicy.runtime import ops
from kvpolicy.runtime.caches import (
    BLOCK_SIZE,
    LayerCache,
    LayerPlan,
    allocate,
    pages_per_sequence,
    plan_layers,
    slots_for,
)
from kvpolicy.runtime.variants import Variant

FILL_CHUNK_TOKENS = 8192
"""Positions written per store call while filling (bounds the scratch K/V)."""


def pick_backend(device: str) -> tuple[torch.device, str]:
    """`auto` -> CUDA with the Triton kernels when available, else CPU with the torch references."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        from kvpolicy.errors import InputError

        raise InputError("--device cuda: torch sees no CUDA GPU here. Use --device cpu (torch references, "
                         "small shapes) or run on a GPU machine.")
    return dev, ("triton" if dev.type == "cuda" else "reference")


@dataclass
class _Prepared:
    block_tables: list[Any]
    seq_lens: Any
    slots: list[Any]


class DecodeStep:
    """The caches and inputs of one variant, and the per-layer kernel calls of one decode step."""

    def __init__(self, arch: ModelArch, variant: Variant, batch: int, max_context: int,
                 device: torch.device, backend: str, seed: int = 0):
        self.arch, self.variant, self.batch = arch, variant, batch
        self.device, self.backend = device, backend
        self.max_context = max_context
        self.plans: list[LayerPlan] = plan_layers(arch, variant)
        # One more position than the longest context: the step's own new token.
        self.caches = allocate(self.plans, batch, max_context + 1, device, seed=seed, layout=variant.cache_layout)
        self.dtype = torch.bfloat16 if backend == "triton" else torch.float32
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.queries = {p.index: self._randn(batch, p.num_q_heads, p.head_dim)
                        for p in self.plans if p.attends}
        self.new_kv = {p.index: (self._randn(batch, p.num_kv_heads, p.head_dim),
                                 self._randn(batch, p.num_kv_heads, p.head_dim))
                       for p in self.plans if p.has_cache}
        self._prepared: _Prepared | None = None

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float32).to(self.device, self.dtype)

    @property
    def kv_bytes(self) -> int:
        """Bytes of every cache this step allocated."""
        return sum(c.nbytes for c in self.caches if c is not None)

    def layer_paths(self) -> dict[str, list[int]]:
        """Layer indices per path: triton, gluon (FP8 and TurboQuant on Hopper), reference, no-cache (linear)."""
        out: dict[str, list[int]] = {}
        for p in self.plans:
            path = ops.layer_path(p, self.backend, self.device, self.variant.two_level) if p.attends else "none (linear)"
            out.setdefault(path, []).append(p.index)
        return out

    def fill(self, context: int) -> None:
        """Write random K/V for positions [0, context) of every sequence (sliding layers: the last ring's worth)."""
        caches = [c for c in self.caches if c is not None]
        if self.variant.kind == "fp8" and self.variant.scale_source != "uncalibrated":
            self._set_scales(caches)
        shapes = {(c.plan.num_kv_heads, c.plan.head_dim) for c in caches}
        lows = {c.plan.index: self._first_kept(c.plan, context) for c in caches}
        start = min(lows.values(), default=context)
        for lo in range(start, context, FILL_CHUNK_TOKENS):
            hi = min(lo + FILL_CHUNK_TOKENS, context)
            data = {s: (self._randn(self.batch * (hi - lo), *s), self._randn(self.batch * (hi - lo), *s))
                    for s in shapes}
            for c in caches:
                a = max(lo, lows[c.plan.index])
                if a >= hi:
                    continue
                key, value = data[(c.plan.num_kv_heads, c.plan.head_dim)]
                n = hi - a
                key = key.view(self.batch, hi - lo, *key.shape[1:])[:, a - lo:].reshape(-1, *key.shape[1:])
                value = value.view(self.batch, hi - lo, *value.shape[1:])[:, a - lo:].reshape(-1, *value.shape[1:])
                positions = torch.arange(a, hi, device=self.device)
                slots = slots_for(positions, c.block_tables).reshape(self.batch * n)
                ops.store(c, key.contiguous(), value.contiguous(), slots, self.backend)

    def _first_kept(self, plan: LayerPlan, context: int) -> int:
        """First position a sliding layer's ring still holds at this context (0 for full layers).

        The last ring-size positions cover every slot of the ring once, so a shorter
        context prepared later never reads a slot that was not written.
        """
        if plan.window is None:
            return 0
        return max(0, context - pages_per_sequence(plan, self.max_context + 1) * BLOCK_SIZE)

    def _set_scales(self, caches: list[LayerCache]) -> None:
        from kvpolicy.kernels.paged_store import compute_kv_scales

        per_head = self.variant.scale_source != "checkpoint_per_tensor"
        for c in caches:
            if c.plan.fmt is None or c.plan.fmt.kind != "fp8":
                continue
            k, v = self.new_kv[c.plan.index]
            c.k_scale, c.v_scale = compute_kv_scales(k, v, per_head)

    def prepare(self, context: int) -> None:
        """Point the step at `context` tokens already cached: the new token goes to position `context`."""
        if not 0 < context <= self.max_context:
            raise ValueError(f"context {context} outside 1..{self.max_context}")
        pages = math.ceil((context + 1) / BLOCK_SIZE)
        position = torch.tensor([context], device=self.device)
        tables, slots = [], []
        for c in self.caches:
            if c is None:
                tables.append(None)
                slots.append(None)
                continue
            tables.append(c.block_tables[:, :pages])
            slots.append(slots_for(position, c.block_tables).reshape(self.batch))
        seq_lens = torch.full((self.batch,), context + 1, dtype=torch.int32, device=self.device)
        self._prepared = _Prepared(tables, seq_lens, slots)

    def run(self) -> torch.Tensor | None:
        """One decode step over every layer; returns the last attending layer's output."""
        prep = self._prepared
        if prep is None:
            raise RuntimeError("call prepare(context) before run()")
        out = None
        for plan in self.plans:
            if not plan.attends:
                continue
            src = plan.index if plan.source is None else plan.source
            cache = self.caches[src]
            assert cache is not None
            if plan.source is None:
                key, value = self.new_kv[plan.index]
                ops.store(cache, key, value, prep.slots[src], self.backend)
            out = ops.decode(cache, plan, self.queries[plan.index], prep.block_tables[src], prep.seq_lens,
                             self.backend, self.variant.two_level)
        return out
