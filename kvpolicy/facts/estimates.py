"""Capacity, latency and accuracy estimates, each labelled measured or modelled.

Capacity follows vLLM's allocator (`kv_memory.py`): bytes per token per layer kind,
bytes per request (recurrent state included), and the "GPU KV cache size" and
"Maximum concurrency" vLLM logs for a KV budget; the budget is modelled and shown.
Latency is the studies' single-request line ITL = slope x context + intercept.
Where the policy's evidence has a fit for this model on this GPU, the figure is
measured; otherwise the slope ratio is modelled from the bytes read per token of
context, and the break-even comes from the policy's per-generation threshold.
Accuracy is the lowest recovery of the evidence at the context; where the policy holds
model-level figures recorded for this model (`kvpolicy verify --record`), the estimate
is their top-1 agreement with BF16, judged by the policy's `model_*` thresholds.
Beside it, the kernel slope ratio (`kernel_figures.py`) is what kvpolicy's own
Triton decode kernels measured (attention only) against cuDNN BF16.
`Figures` computes each of these once per deployment: the facts state them for
the rules, and the estimates of the decided variant reuse them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from kvpolicy.facts.kernel_figures import KernelFigure, kernel_figure
from kvpolicy.facts.kv_memory import GIB, RUNTIME_RESERVE_GIB, Capacity, KvPlan, Layout, kv_budget_bytes, plan
from kvpolicy.formats import FORMATS
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.inputs.policy_schema import ItlFit, ModelFigure, Policy, resolve_threshold
from kvpolicy.inputs.workload import Workload

Provenance = Literal["measured", "extrapolated", "modelled"]


class _Model(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid")


class Estimate(_Model):
    """One number with its provenance."""

    value: float | None
    """The number (None when it cannot be estimated)."""
    unit: str
    """Unit, e.g. `tokens`, `bytes`, `ratio`, `ms/token`."""
    provenance: Provenance
    """measured (from a study or the user's bench), extrapolated (a measured figure applied beyond the contexts
    it was measured at) or modelled (formula)."""
    basis: str
    """Source of a measured figure, or the formula and inputs of a modelled one."""


class Estimates(_Model):
    """Predicted effects of the decision."""

    kv_bytes_per_token: dict[str, int]
    """Bytes per token per rank by layer kind (full, sliding, chunked, mla, indexer; summed over the layers of
    that kind), in the chosen format as vLLM's specs size them."""
    kv_bytes_per_token_bf16: dict[str, int]
    """The same in BF16, for comparison."""
    kv_bytes_per_request: Estimate
    """Bytes vLLM reserves per request at the context (whole blocks of every KV cache group, recurrent state
    included), per rank."""
    kv_capacity_tokens: Estimate
    """vLLM's logged "GPU KV cache size": int(max concurrency x context), in the chosen format."""
    kv_capacity_tokens_bf16: Estimate
    """The same in BF16."""
    capacity_vs_bf16: Estimate
    """Requests at the context that fit, relative to BF16."""
    max_concurrency: Estimate
    """vLLM's logged "Maximum concurrency" at the context in the chosen format (blocks / blocks per request)."""
    itl_slope_ratio: Estimate
    """Decode ITL slope (ms/token of context) relative to BF16."""
    kernel_slope_ratio: Estimate
    """Decode-attention slope of kvpolicy's own Triton kernel for the chosen format, relative to cuDNN BF16
    attention on the same GPU (measured, attention only; vLLM's own kernels are what `itl_slope_ratio` describes)."""
    break_even_tokens: Estimate
    """Context above which the chosen format decodes faster than BF16."""
    accuracy_recovery: Estimate
    """Expected accuracy relative to BF16 (1.0 = no loss); unit `top-1 agreement` where a model-level check of
    this model was recorded (`kvpolicy verify --record`), with its verdict against the `model_*` thresholds."""


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


def slope_ratio(policy: Policy, found: tuple[str, dict[str, ItlFit]] | None, layout: Layout, bf16: Layout,
                dtype: str, skip_layers: list[str], facts: dict[str, Any]) -> Estimate:
    """ITL slope of a variant relative to BF16's (`found`: the deployment's `find_itl`)."""
    key = variant_key(dtype, skip_layers)
    if key == "bf16":
        return Estimate(value=1.0, unit="ratio", provenance="modelled", basis="BF16 is the baseline")
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
    byte_ratio = layout.growing_bytes() / bf16.growing_bytes()
    overhead = resolve_threshold(policy, "fp8_slope_overhead", facts) or 1.0
    r = min(1.0, byte_ratio * overhead)
    return Estimate(value=round(r, 3), unit="ratio", provenance="modelled",
                    basis=f"bytes read per token of context {byte_ratio:.3f}x BF16 (full/MLA layers) "
                          f"x kernel overhead {overhead:g} (threshold `fp8_slope_overhead`)")


def break_even(policy: Policy, gpu: GpuSpec, found: tuple[str, dict[str, ItlFit]] | None, dtype: str,
               skip_layers: list[str], facts: dict[str, Any]) -> Estimate:
    """Context above which the variant decodes faster than BF16 (`found`: the deployment's `find_itl`)."""
    key = variant_key(dtype, skip_layers)
    if key == "bf16":
        return Estimate(value=None, unit="tokens", provenance="modelled", basis="BF16 is the baseline")
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


def recovery(policy: Policy, dtype: str, context_tokens: int, arch: ModelArch | None = None,
             gpu: GpuSpec | None = None) -> Estimate:
    """Expected accuracy recovery vs BF16 at a context length (lowest figure of the evidence).

    Figures measured on this model and GPU (`kvpolicy verify --record`) come first; figures measured on another
    deployment are ignored; the studies' unscoped figures apply otherwise.
    """
    fmt = FORMATS[dtype]
    if fmt.kind == "bf16":
        return Estimate(value=1.0, unit="ratio", provenance="modelled", basis="BF16 is the baseline")
    names = {dtype, "fp8"} if dtype in ("fp8", "fp8_e4m3") else {dtype}
    models = {n.lower() for n in (arch.id, *arch.aliases, arch.hf_id or "")} if arch is not None else set()
    rows = [r for r in _recoveries(policy) if r[3] in names and r[0] >= context_tokens]
    here = [r for r in rows if r[4] is not None and r[4].lower() in models and gpu is not None and r[5] == gpu.id]
    pool = here or [r for r in rows if r[4] is None]
    if not pool:
        return Estimate(value=None, unit="ratio", provenance="modelled",
                        basis=f"no published accuracy figure for {dtype} at {context_tokens} tokens; "
                              "measure with `kvpolicy verify`")
    max_ctx, value, ev_id, *_, measured_to = min(pool, key=lambda r: (r[0], r[1]))
    if measured_to is not None and context_tokens > measured_to:
        return Estimate(value=value, unit="ratio", provenance="extrapolated",
                        basis=f"evidence `{ev_id}` (uncalibrated scales) measured up to {measured_to:,} tokens, "
                              f"extrapolated to {context_tokens:,}; measure with `kvpolicy verify`")
    what = (f"measured on this model and GPU (needle recovery up to {max_ctx:,} tokens)" if here
            else f"uncalibrated scales; lowest figure up to {max_ctx} tokens")
    return Estimate(value=value, unit="ratio", provenance="measured", basis=f"evidence `{ev_id}` ({what})")


def _recoveries(policy: Policy) -> list[tuple[int, float, str, str, str | None, str | None, int | None]]:
    """(max context, value, evidence id, dtype, model, gpu, measured up to) of every recovery figure, built once
    per policy object."""
    rows = policy.derived.get(__name__)
    if rows is None:
        rows = policy.derived[__name__] = [(r.max_context_tokens, r.value, ev.id, r.dtype, r.model, r.gpu,
                                            r.measured_up_to_tokens)
                                           for ev in policy.evidence for r in ev.recovery]
    return rows


MODEL_THRESHOLDS = ("model_min_top1_agreement", "model_max_kl_mean", "model_max_kl_p99", "model_max_ppl_increase")
"""The policy thresholds model-level figures are judged by (`kvpolicy verify` and `recommend` alike)."""
ModelVerdict = Literal["pass", "below", "undecided"]


def judge_model_figures(agreement_low: float, agreement_high: float, kl_mean: float, kl_p99: float | None,
                        ppl_delta: float | None, limits: dict[str, float]) -> tuple[ModelVerdict, list[str]]:
    """`pass` / `below` / `undecided` for one format's model-level figures against the `model_*` thresholds
    (`limits`, by threshold name), and the figures that fail: any figure past its threshold fails; otherwise the
    agreement's 95% interval decides (wholly at or above the minimum: pass; straddling it: undecided)."""
    fails = []
    if kl_mean > limits["model_max_kl_mean"]:
        fails.append(f"mean KL {kl_mean:.3g} > {limits['model_max_kl_mean']:g}")
    if kl_p99 is not None and kl_p99 > limits["model_max_kl_p99"]:
        fails.append(f"p99 KL {kl_p99:.3g} > {limits['model_max_kl_p99']:g}")
    if ppl_delta is not None and ppl_delta > limits["model_max_ppl_increase"]:
        fails.append(f"perplexity {ppl_delta:+.1%} > +{limits['model_max_ppl_increase']:.0%}")
    least = limits["model_min_top1_agreement"]
    if agreement_high < least:
        fails.append(f"top-1 agreement < {least:.0%}")
    if fails:
        return "below", fails
    return ("pass" if agreement_low >= least else "undecided"), []


def model_limits(policy: Policy) -> dict[str, float] | None:
    """The policy's `model_*` thresholds by name (None when it lacks one: a policy not extending the built-in)."""
    limits = {name: resolve_threshold(policy, name, {}) for name in MODEL_THRESHOLDS}
    return None if any(v is None for v in limits.values()) else limits  # type: ignore[return-value]


class ModelCheckFigure(_Model):
    """A recorded model-level figure of this model for one format, with its verdict."""

    evidence: str
    """Evidence id."""
    figure: ModelFigure
    """The recorded figures."""
    verdict: ModelVerdict | None
    """Judged by the policy's `model_*` thresholds (None when the policy has none)."""
    fails: list[str]
    """The figures that fail their thresholds."""

    def phrase(self) -> str:
        """The figures and verdict in words, for estimates and rule messages."""
        f = self.figure
        scales = "" if f.scale_source == "uncalibrated" else f" with {f.scale_source.replace('_', ' ')} scales"
        where = (f"through kvpolicy's kernels on {f.gpu}" if f.gpu else
                 "float64 reference path on the CPU: the format's rounding, no GPU's arithmetic")
        figures = (f"{f.dtype}{scales}: top-1 agreement {f.agreement:.1%} (95% CI {f.agreement_low:.1%}-"
                   f"{f.agreement_high:.1%}) with the BF16 cache, mean KL {f.kl_mean:.3g}"
                   + (f", p99 KL {f.kl_p99:.3g}" if f.kl_p99 is not None else "")
                   + (f", perplexity {f.ppl_delta:+.1%}" if f.ppl_delta is not None else "")
                   + f" over {f.tokens:,} tokens ({where})")
        verdict = {"pass": "within the policy's model thresholds",
                   "undecided": "the agreement interval straddles `model_min_top1_agreement`: more tokens decide it",
                   "below": "fails the policy's model thresholds (" + "; ".join(self.fails) + ")",
                   None: "no `model_*` thresholds in the policy to judge it"}[self.verdict]
        return f"evidence `{self.evidence}`, {figures}: {verdict}"


def model_check(policy: Policy, arch: ModelArch, gpu: GpuSpec, dtype: str,
                scale_source: str = "uncalibrated") -> ModelCheckFigure | None:
    """The model-level figure recorded for this model and format, judged: one measured through the kernels on this
    GPU first, then one from the CPU reference path; the last recorded of each wins (an extending policy's
    evidence comes after the built-in one's)."""
    names = {dtype, "fp8"} if dtype in ("fp8", "fp8_e4m3") else {dtype}
    models = {n.lower() for n in (arch.id, *arch.aliases, arch.hf_id or "")}
    found: dict[str | None, tuple[str, ModelFigure]] = {}
    for ev in policy.evidence:
        for f in ev.model_check:
            if f.dtype in names and f.scale_source == scale_source and f.model.lower() in models \
                    and f.gpu in (None, gpu.id):
                found[f.gpu] = (ev.id, f)
    hit = found.get(gpu.id) or found.get(None)
    if hit is None:
        return None
    limits = model_limits(policy)
    f = hit[1]
    verdict, fails = (judge_model_figures(f.agreement_low, f.agreement_high, f.kl_mean, f.kl_p99, f.ppl_delta,
                                          limits) if limits is not None else (None, []))
    return ModelCheckFigure(evidence=hit[0], figure=f, verdict=verdict, fails=fails)


def model_accuracy(check: ModelCheckFigure, long: Estimate, context_tokens: int) -> Estimate:
    """The accuracy estimate from a recorded model-level figure; the evidence's figure at the workload's context
    (which the rules also read) is named beside it."""
    beside = ""
    if long.value is not None and long.value < 1.0:
        beside = (f"; at {context_tokens:,} tokens the recovery figure the rules also read is {long.value:g} "
                  f"({long.basis})")
    return Estimate(value=check.figure.agreement, unit="top-1 agreement", provenance="measured",
                    basis=f"measured on this model, {check.phrase()}{beside}")


def kernel_slope(fig: KernelFigure) -> Estimate:
    """Decode-attention slope of kvpolicy's own kernel for a dtype, relative to cuDNN BF16 (measured)."""
    return Estimate(value=fig.ratio, unit="ratio", provenance="measured" if fig.ratio is not None else "modelled",
                    basis=fig.basis)


_SHARED_FIGURES = 1024
"""Deployments whose Figures a policy keeps for reuse (`Figures.shared`)."""


class Figures:
    """The figures of one deployment, each computed once: `build_facts` states them as facts and
    `estimate` reuses them for the decided variant (concurrency, break-even, recovery, kernel figure)."""

    def __init__(self, policy: Policy, arch: ModelArch, gpu: GpuSpec, workload: Workload) -> None:
        self.policy, self.arch, self.gpu, self.workload = policy, arch, gpu, workload
        self.budget = kv_budget_bytes(arch, gpu, workload)
        self.bf16 = "auto" if arch.auto_kv_dtype == "auto" else arch.model_dtype
        """The dtype of the BF16 baseline: `auto`, unless the checkpoint makes auto a quantized cache."""
        """Bytes of KV cache one rank holds (negative when the weights do not fit)."""
        self.itl = find_itl(policy, arch, gpu)
        """The ITL fits measured for this model on this GPU, with their evidence id (None when there are none)."""
        self._memo: dict[tuple[Any, ...], Any] = {}

    @classmethod
    def shared(cls, policy: Policy, arch: ModelArch, gpu: GpuSpec, workload: Workload) -> Figures:
        """The Figures of these inputs, reused across calls: they read only the workload's context, TP and memory
        utilisation (priority, concurrency and floor change no figure), so `recommend` for the same model, GPU and
        context under another priority or concurrency reuses every figure. Kept per policy object, a bounded few."""
        cache = policy.derived.setdefault(f"{__name__}.Figures", {})
        key = (id(arch), id(gpu), workload.context_tokens, workload.tp, workload.gpu_memory_utilization)
        hit = cache.get(key)
        # The entry holds arch and gpu, so their ids cannot be reused by other objects while it lives.
        if hit is not None and hit.arch is arch and hit.gpu is gpu:
            return hit
        fig = cls(policy, arch, gpu, workload)
        if len(cache) >= _SHARED_FIGURES:
            try:
                del cache[next(iter(cache))]  # the oldest entry
            except (KeyError, RuntimeError, StopIteration):  # another thread got there first
                pass
        cache[key] = fig
        return fig

    def _once(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def layout(self, dtype: str, skip_layers: list[str] | tuple[str, ...] = ()) -> Layout:
        """Per-layer formats and bytes of a variant."""
        return self._once(("layout", dtype, tuple(skip_layers)),
                          lambda: Layout.of(self.arch, dtype, skip_layers, self.workload.tp, self.gpu))

    def plan(self, dtype: str, skip_layers: list[str] | tuple[str, ...] = ()) -> KvPlan:
        """vLLM's groups and blocks for a variant at the workload's context."""
        return self._once(("plan", dtype, tuple(skip_layers)),
                          lambda: plan(self.arch, self.layout(dtype, skip_layers), self.workload.context_tokens,
                                       self.gpu))

    def max_concurrency(self, dtype: str, skip_layers: list[str] | tuple[str, ...] = ()) -> int:
        """Whole requests at the workload's context that fit with a variant."""
        return self._once(("concurrency", dtype, tuple(skip_layers)),
                          lambda: self.plan(dtype, skip_layers).capacity(self.budget).requests_that_fit)

    def budget_basis(self) -> str:
        """How the KV budget per rank is modelled, with its inputs."""
        arch, gpu, wl = self.arch, self.gpu, self.workload
        return (f"modelled budget {gpu.memory_gib:g} GiB x {wl.gpu_memory_utilization:g} - weights "
                f"{arch.weight_bytes / 1e9:.1f} GB / tp {wl.tp} - reserve {RUNTIME_RESERVE_GIB:g} GiB = "
                f"{self.budget / GIB:.1f} GiB per rank (weights: {arch.weight_basis}; the reserve stands for what "
                "vLLM profiles at start-up: activations, CUDA graphs)")

    def break_even(self, dtype: str, skip_layers: list[str] | tuple[str, ...], facts: dict[str, Any]) -> Estimate:
        """Break-even context of a variant against BF16."""
        # A modelled break-even reads a threshold that may be keyed by a fact: its value is part of the key.
        threshold = resolve_threshold(self.policy, "break_even_tokens", facts)
        return self._once(("break_even", variant_key(dtype, skip_layers), threshold),
                          lambda: break_even(self.policy, self.gpu, self.itl, dtype, list(skip_layers), facts))

    def recovery(self, dtype: str) -> Estimate:
        """Expected accuracy recovery of a dtype at the workload's context."""
        return self._once(("recovery", dtype), lambda: recovery(self.policy, dtype, self.workload.context_tokens,
                                                          self.arch, self.gpu))

    def model_check(self, dtype: str, scale_source: str = "uncalibrated") -> ModelCheckFigure | None:
        """The model-level figure recorded for this model and format, judged by the policy's thresholds."""
        return self._once(("model_check", dtype, scale_source),
                          lambda: model_check(self.policy, self.arch, self.gpu, dtype, scale_source))

    def accuracy(self, dtype: str, scale_source: str = "uncalibrated") -> Estimate:
        """The accuracy estimate of a variant: the recorded model-level figure of this model when there is one,
        else the recovery figure at the workload's context."""
        check = self.model_check(dtype, scale_source)
        long = self.recovery(dtype)
        return model_accuracy(check, long, self.workload.context_tokens) if check is not None else long

    def kernel_figure(self, dtype: str) -> KernelFigure:
        """kvpolicy's measured decode-attention slope for a dtype."""
        return self._once(("kernel", dtype), lambda: kernel_figure(self.policy, self.arch, self.gpu, dtype))


def estimate(figures: Figures, kv_cache_dtype: str, skip_layers: list[str], facts: dict[str, Any]) -> Estimates:
    """All estimates for a decided KV dtype and its skip layers, from the deployment's figures."""
    workload = figures.workload
    layout = figures.layout(kv_cache_dtype, skip_layers)
    bf16 = figures.layout(figures.bf16)
    kv_plan, plan_bf16 = figures.plan(kv_cache_dtype, skip_layers), figures.plan(figures.bf16)
    cap, cap_bf16 = kv_plan.capacity(figures.budget), plan_bf16.capacity(figures.budget)
    budget_basis = figures.budget_basis()
    per_req, per_req_bf16 = kv_plan.request_bytes, plan_bf16.request_bytes
    ctx = workload.context_tokens
    state = kv_plan.state_request_bytes
    state_text = f", {state:,} of them recurrent state" if state else ""
    # What vLLM changes about the request (TurboQuant's boundary layers, sparse-MLA canonicalisation).
    state_text += "".join(f"; {note}" for note in layout.notes)
    return Estimates(
        kv_bytes_per_token=layout.bytes_by_kind(),
        kv_bytes_per_token_bf16=bf16.bytes_by_kind(),
        kv_bytes_per_request=Estimate(
            value=per_req, unit="bytes", provenance="modelled",
            basis=f"vLLM's allocator at {ctx:,} tokens: {kv_plan.blocks_per_request:,} blocks x "
                  f"{kv_plan.bytes_per_block:,} bytes ({kv_plan.describe()}){state_text}"),
        kv_capacity_tokens=Estimate(value=cap.tokens, unit="tokens", provenance="modelled",
                                    basis=_capacity_basis(kv_plan, cap, budget_basis)),
        kv_capacity_tokens_bf16=Estimate(value=cap_bf16.tokens, unit="tokens", provenance="modelled",
                                         basis=_capacity_basis(plan_bf16, cap_bf16, budget_basis)),
        capacity_vs_bf16=Estimate(value=round(per_req_bf16 / per_req, 3) if per_req else None, unit="ratio",
                                  provenance="modelled",
                                  basis=f"bytes per request at {ctx:,} tokens: {per_req_bf16:,} BF16 / {per_req:,}"),
        max_concurrency=Estimate(
            value=round(cap.max_concurrency, 2), unit="requests", provenance="modelled",
            basis=f"vLLM logs \"Maximum concurrency for {ctx:,} tokens per request: {cap.max_concurrency:.2f}x\": "
                  f"{cap.num_blocks:,} blocks / {kv_plan.blocks_per_request:,} per request = {per_req:,} bytes per "
                  f"request ({kv_plan.describe()}{state_text}); BF16 {cap_bf16.max_concurrency:.2f}x; "
                  "the budget of KV capacity"),
        itl_slope_ratio=slope_ratio(figures.policy, figures.itl, layout, bf16, kv_cache_dtype, skip_layers, facts),
        kernel_slope_ratio=kernel_slope(figures.kernel_figure(kv_cache_dtype)),
        break_even_tokens=figures.break_even(kv_cache_dtype, skip_layers, facts),
        accuracy_recovery=figures.accuracy(kv_cache_dtype, facts.get("decision.scale_source") or "uncalibrated"),
    )


def _capacity_basis(kv_plan: KvPlan, cap: Capacity, budget_basis: str) -> str:
    return (f"vLLM's \"GPU KV cache size\" = int({cap.max_concurrency:.2f} x {kv_plan.max_model_len:,}) with "
            f"{cap.num_blocks:,} blocks of {kv_plan.bytes_per_block:,} bytes; {budget_basis}")
