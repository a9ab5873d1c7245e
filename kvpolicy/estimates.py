"""Capacity, latency and accuracy estimates, each labelled measured or modelled.

Memory follows vLLM's accounting: the KV budget per rank is
`memory x gpu_memory_utilization - weights / tp - runtime reserve`, every layer
stores `layer_kv_bytes_per_token` per token it holds, and sliding layers hold at
most `window - 1 + max_num_batched_tokens` tokens per request.

Latency is the studies' single-request line ITL = slope x context + intercept.
Where the policy's evidence has a fit for this model on this GPU, the figure is
measured; otherwise the slope ratio is modelled from the bytes read per token of
context, and the break-even comes from the policy's per-generation threshold.
Beside it, the kernel slope ratio (`kernel_figures.py`) is what kvpolicy's own
Triton decode kernels measured (attention only) against cuDNN BF16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpolicy.decision import Decision, Estimate, Estimates
from kvpolicy.formats import FORMATS, KvFormat
from kvpolicy.inputs.arch import ModelArch, layer_kv_bytes_per_token, tokens_held
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.inputs.policy_schema import ItlFit, Policy, resolve_threshold
from kvpolicy.inputs.workload import Workload
from kvpolicy.kernel_figures import kernel_slope

GIB = 1 << 30
RUNTIME_RESERVE_GIB = 2.5
"""Activations, CUDA graphs and allocator slack vLLM keeps outside the KV cache (modelled; vLLM profiles it)."""
TURBOQUANT_BOUNDARY_LAYERS = 2
"""vLLM keeps the first and last two layers of dense models in BF16 under TurboQuant."""
LONG_CONTEXT_TOKENS = 131072


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
        key = (id(arch), dtype, tuple(skip_layers), tp)
        hit = _LAYOUTS.get(key)
        if hit is not None and hit.arch is arch:
            return hit
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
        layout = cls(arch, tuple(formats), tp, tuple(by_kind.items()))
        # Layouts are pure functions of their key; the arch reference keeps id() unique.
        _LAYOUTS[key] = layout
        return layout

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


_LAYOUTS: dict[tuple[int, str, tuple[str, ...], int], Layout] = {}


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


def variant_key(dtype: str, skip_layers: list[str] | tuple[str, ...]) -> str:
    """Name of a KV variant in ITL evidence: bf16, fp8, fp8_skip_sliding, turboquant_*."""
    fmt = FORMATS[dtype]
    if fmt.kind == "bf16":
        return "bf16"
    if fmt.kind == "fp8":
        return "fp8_skip_sliding" if "sliding_window" in skip_layers else "fp8"
    return dtype


def find_itl(policy: Policy, arch: ModelArch, gpu: GpuSpec) -> tuple[str, dict[str, ItlFit]] | None:
    """The evidence id and ITL fits measured for this model on this GPU, if any.

    The last match wins: an extending policy's evidence (e.g. `kvpolicy bench --record`
    on the user's GPU) comes after the built-in studies' in the merged list.
    """
    names = {n.lower() for n in (arch.id, *arch.aliases, arch.hf_id or "")}
    for ev in reversed(policy.evidence):
        if ev.itl and ev.itl.gpu == gpu.id and ev.itl.model.lower() in names:
            return ev.id, ev.itl.variants
    return None


def slope_ratio(policy: Policy, arch: ModelArch, gpu: GpuSpec, layout: Layout, dtype: str,
                skip_layers: list[str], tp: int, facts: dict[str, Any]) -> Estimate:
    """ITL slope of a variant relative to BF16's."""
    key = variant_key(dtype, skip_layers)
    if key == "bf16":
        return Estimate(value=1.0, unit="ratio", provenance="modelled", basis="BF16 is the baseline")
    found = find_itl(policy, arch, gpu)
    if found and key in found[1] and "bf16" in found[1]:
        ev_id, fits = found
        r = fits[key].slope_ms_per_token / fits["bf16"].slope_ms_per_token
        return Estimate(value=round(r, 3), unit="ratio", provenance="measured",
                        basis=f"evidence `{ev_id}`: slope {fits[key].slope_ms_per_token:.3g} vs BF16 "
                              f"{fits['bf16'].slope_ms_per_token:.3g} ms/token")
    if FORMATS[dtype].kind == "turboquant":
        return Estimate(value=None, unit="ratio", provenance="modelled",
                        basis="vLLM's TurboQuant decode dequantizes to BF16 before attention: measured 10-68% "
                              "added latency, no slope published (evidence `turboquant-latency`)")
    bf16 = Layout.of(arch, "auto", (), tp)
    byte_ratio = layout.growing_bytes() / bf16.growing_bytes()
    overhead = resolve_threshold(policy, "fp8_slope_overhead", facts) or 1.0
    r = min(1.0, byte_ratio * overhead)
    return Estimate(value=round(r, 3), unit="ratio", provenance="modelled",
                    basis=f"bytes read per token of context {byte_ratio:.3f}x BF16 (full/MLA layers) "
                          f"x kernel overhead {overhead:g} (threshold `fp8_slope_overhead`)")


def break_even(policy: Policy, arch: ModelArch, gpu: GpuSpec, dtype: str, skip_layers: list[str],
               facts: dict[str, Any]) -> Estimate:
    """Context above which the variant decodes faster than BF16."""
    key = variant_key(dtype, skip_layers)
    if key == "bf16":
        return Estimate(value=None, unit="tokens", provenance="modelled", basis="BF16 is the baseline")
    found = find_itl(policy, arch, gpu)
    if found and key in found[1]:
        ev_id, fits = found
        fit = fits[key]
        if fit.break_even_tokens is not None:
            return Estimate(value=fit.break_even_tokens, unit="tokens", provenance="measured",
                            basis=f"evidence `{ev_id}`")
        base = fits.get("bf16")
        if base and base.slope_ms_per_token <= fit.slope_ms_per_token:
            # Measured: the variant's line never falls below BF16's.
            return Estimate(value=None, unit="tokens", provenance="measured",
                            basis=f"never: evidence `{ev_id}` measured slope {fit.slope_ms_per_token:.3g} "
                                  f"not below BF16's {base.slope_ms_per_token:.3g} ms/token")
        if base and base.intercept_ms is not None and fit.intercept_ms is not None:
            be = (fit.intercept_ms - base.intercept_ms) / (base.slope_ms_per_token - fit.slope_ms_per_token)
            return Estimate(value=round(max(be, 0.0)), unit="tokens", provenance="measured",
                            basis=f"evidence `{ev_id}`: intercepts {base.intercept_ms:g} / {fit.intercept_ms:g} ms")
    if FORMATS[dtype].kind == "turboquant":
        return Estimate(value=None, unit="tokens", provenance="modelled",
                        basis="never in vLLM's TurboQuant (slower than BF16 at every measured context)")
    be = resolve_threshold(policy, "break_even_tokens", facts)
    return Estimate(value=be, unit="tokens", provenance="modelled",
                    basis=f"threshold `break_even_tokens` for {gpu.generation} GPUs (dense-model figure of the studies)")


def recovery(policy: Policy, dtype: str, context_tokens: int) -> Estimate:
    """Expected accuracy recovery vs BF16 at a context length (lowest figure of the evidence)."""
    fmt = FORMATS[dtype]
    if fmt.kind == "bf16":
        return Estimate(value=1.0, unit="ratio", provenance="modelled", basis="BF16 is the baseline")
    best: tuple[int, float, str] | None = None
    names = {dtype, "fp8"} if dtype in ("fp8", "fp8_e4m3") else {dtype}
    for max_ctx, value, ev_id, rec_dtype in _recoveries(policy):
        if rec_dtype in names and max_ctx >= context_tokens:
            cand = (max_ctx, value, ev_id)
            if best is None or cand[:2] < best[:2]:
                best = cand
    if best is None:
        return Estimate(value=None, unit="ratio", provenance="modelled",
                        basis=f"no published accuracy figure for {dtype} at {context_tokens} tokens; "
                              "measure with `kvpolicy verify`")
    return Estimate(value=best[1], unit="ratio", provenance="measured",
                    basis=f"evidence `{best[2]}` (uncalibrated scales; lowest figure up to {best[0]} tokens)")


def _recoveries(policy: Policy) -> list[tuple[int, float, str, str]]:
    """(max context, value, evidence id, dtype) of every recovery figure, cached per policy object."""
    hit = _RECOVERIES.get(id(policy))
    if hit is None or hit[0] is not policy:
        rows = [(r.max_context_tokens, r.value, ev.id, r.dtype) for ev in policy.evidence for r in ev.recovery]
        hit = (policy, rows)
        _RECOVERIES[id(policy)] = hit
    return hit[1]


_RECOVERIES: dict[int, tuple[Policy, list[tuple[int, float, str, str]]]] = {}


def estimate(policy: Policy, arch: ModelArch, gpu: GpuSpec, workload: Workload, decision: Decision,
             facts: dict[str, Any]) -> Estimates:
    """All estimates for a decision."""
    tp = workload.tp
    layout = Layout.of(arch, decision.kv_cache_dtype, decision.skip_layers, tp)
    bf16 = Layout.of(arch, "auto", (), tp)
    budget = kv_budget_bytes(arch, gpu, workload)
    budget_basis = (f"{gpu.memory_gib:g} GiB x {workload.gpu_memory_utilization:g} - weights "
                    f"{arch.weight_bytes / 1e9:.1f} GB / tp {tp} - reserve {RUNTIME_RESERVE_GIB:g} GiB "
                    f"= {budget / GIB:.1f} GiB per rank")

    def capacity(l: Layout) -> int:
        return max(0, int(budget // l.bytes_per_token()))

    cap, cap_bf16 = capacity(layout), capacity(bf16)
    conc, conc_bf16 = max_concurrency(layout, budget, workload), max_concurrency(bf16, budget, workload)
    per_req = layout.request_bytes(workload.context_tokens)
    per_req_bf16 = bf16.request_bytes(workload.context_tokens)
    return Estimates(
        kv_bytes_per_token=layout.bytes_by_kind(),
        kv_bytes_per_token_bf16=bf16.bytes_by_kind(),
        kv_capacity_tokens=Estimate(value=cap, unit="tokens", provenance="modelled",
                                    basis=f"{budget_basis} / {layout.bytes_per_token():,} bytes per token"),
        kv_capacity_tokens_bf16=Estimate(value=cap_bf16, unit="tokens", provenance="modelled",
                                         basis=f"{budget_basis} / {bf16.bytes_per_token():,} bytes per token"),
        capacity_vs_bf16=Estimate(value=round(per_req_bf16 / per_req, 3) if per_req else None, unit="ratio",
                                  provenance="modelled",
                                  basis=f"bytes per request at {workload.context_tokens:,} tokens: "
                                        f"{per_req_bf16:,} BF16 / {per_req:,}"),
        max_concurrency=Estimate(value=conc, unit="requests", provenance="modelled",
                                 basis=f"{budget_basis} / {per_req:,} bytes per request (BF16: {conc_bf16})"),
        itl_slope_ratio=slope_ratio(policy, arch, gpu, layout, decision.kv_cache_dtype, decision.skip_layers,
                                    tp, facts),
        kernel_slope_ratio=kernel_slope(policy, arch, gpu, decision.kv_cache_dtype),
        break_even_tokens=break_even(policy, arch, gpu, decision.kv_cache_dtype, decision.skip_layers, facts),
        accuracy_recovery=recovery(policy, decision.kv_cache_dtype, workload.context_tokens),
    )

