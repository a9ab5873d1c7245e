"""Serving under load: decode step time, prefill time, and TTFT / TPOT / throughput for a traffic.

The inputs are the deployment's figures (`estimates.Figures`: the vLLM allocator plan,
the ITL fits of the evidence, the slope ratios) and two models of time on the GPU:

- decode step = max(weights term, GEMM compute) + slope x KV tokens read by the batch
  (+ the sliding-window reads per request), from the evidence's single-request line
  ITL = slope x context + intercept where it was measured on this GPU at TP 1, else
  from bytes over bandwidth; TurboQuant adds vLLM's measured latency overhead;
- prefill = FLOPs of the active weights and of causal attention over the GPU's dense
  BF16 rate at a stated efficiency; chunked prefill carries the running decodes in
  each chunk's step (interference both ways).

Load: admission is limited by the KV capacity (requests that fit at isl + osl, the
no-preemption figure); a closed loop (concurrency) queues the clients beyond it; an
open loop (rate) runs at the concurrency Little's law gives and is saturated when
arrivals exceed the service rate at full capacity; a burst is served in waves of
what fits. Every modelled constant is below, with why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvpolicy import noun
from kvpolicy.facts.estimates import Estimate, Figures, slope_ratio, variant_key
from kvpolicy.formats import FORMATS
from kvpolicy.inputs.policy_schema import resolve_threshold

BANDWIDTH_EFFICIENCY = 0.8
"""Fraction of peak HBM bandwidth decode reads reach (Llama-3.1-8B on H100: 16.1 GB of weights in the
measured 6.44 ms intercept is 0.75 of 3.35 TB/s)."""
PREFILL_EFFICIENCY = 0.5
"""Model FLOPs utilisation of prefill and of batched decode GEMMs (dense BF16 peak)."""
LAYER_OVERHEAD_MS = 0.02
"""Per decoder layer and step: kernel launches and norms that neither bytes nor FLOPs account for."""
ALLREDUCE_MS = 0.008
"""Per all-reduce (two per layer) under tensor parallelism: NVLink latency of a small message."""
TWO_LEVEL_PREFILL = 1.12e-06 / 6.93e-07
"""Attention prefill cost of FP8 with two-level accumulation at head_dim >= 256 on Hopper, relative to BF16
(the quadratic TTFT coefficients of evidence `fp8-prefill-head-dim-256-h100`)."""
TQ_OVERHEAD = ((1, 0.10), (64, 0.68))
"""vLLM TurboQuant latency overhead vs BF16 at batch 1 and 64 (evidence `turboquant-latency`, Llama-3.3-70B:
10-68%, growing with batch); interpolated in log(batch), held beyond."""


@dataclass(frozen=True)
class StepModel:
    """Decode step time of one replica for a batch of requests at a mean context."""

    intercept_ms: float
    """Step time of one request at no context (weights read, launches, all-reduces)."""
    compute_ms_per_token: float
    """GEMM time per batched token at the modelled utilisation (the compute roof of the weights term)."""
    slope_ms_per_token: float
    """ms per token of growing context (full, MLA layers) read in one step."""
    per_request_ms: float
    """ms per request for the context that stops growing (sliding windows), read in every step."""
    tq_overhead: bool
    """vLLM TurboQuant's dequantization overhead applies."""
    slope: Estimate
    intercept: Estimate

    def step_s(self, batch: float, context: float, windowed: float) -> float:
        """Seconds of one decode step for `batch` requests of `context` tokens (`windowed`: within the window)."""
        n = max(batch, 1.0)
        ms = max(self.intercept_ms, self.compute_ms_per_token * n) + self.slope_ms_per_token * n * context \
            + self.per_request_ms * n * windowed
        if self.tq_overhead:
            ms *= 1.0 + tq_overhead(n)
        return ms / 1e3


def tq_overhead(batch: float) -> float:
    """TurboQuant's added latency at a batch (log-linear between the measured ends)."""
    (b0, o0), (b1, o1) = TQ_OVERHEAD
    x = min(max(math.log(max(batch, 1.0)), math.log(b0)), math.log(b1))
    return o0 + (o1 - o0) * (x - math.log(b0)) / (math.log(b1) - math.log(b0))


def _active_weight_bytes(figures: Figures) -> tuple[float, str]:
    arch = figures.arch
    w = arch.weight_bytes
    if arch.active_params_b and arch.params_b and arch.active_params_b < arch.params_b * 0.95:
        frac = arch.active_params_b / arch.params_b
        return w * frac, (f"{w / 1e9:.1f} GB x active {arch.active_params_b:g}B / {arch.params_b:g}B parameters "
                          "(experts touched per step beyond top-k not modelled)")
    return w, f"{w / 1e9:.1f} GB of weights"


def step_model(figures: Figures, dtype: str, skip_layers: list[str], facts: dict[str, Any]) -> StepModel:
    """The decode step of one variant: measured ITL line where the evidence has one (TP 1), else bytes/bandwidth."""
    arch, gpu, tp = figures.arch, figures.gpu, figures.workload.tp
    layout, bf16 = figures.layout(dtype, skip_layers), figures.layout("auto")
    bw = gpu.bandwidth_tbs * 1e12 * BANDWIDTH_EFFICIENCY  # bytes/s
    by_kind = layout.bytes_by_kind()
    window_bytes = by_kind.get("sliding", 0) + by_kind.get("chunked", 0)
    per_request_ms = window_bytes / bw * 1e3
    active_params = (arch.active_params_b or arch.params_b or 0.0) * 1e9
    flops = (gpu.bf16_dense_tflops or 0.0) * 1e12 * PREFILL_EFFICIENCY * tp
    compute_ms = 2 * active_params / flops * 1e3 if flops else 0.0
    key = variant_key(dtype, skip_layers)
    fits = figures.itl[1] if figures.itl and tp == 1 else {}
    ev = figures.itl[0] if figures.itl else ""
    base = fits.get("bf16")
    if base is not None:
        slope_bf16 = base.slope_ms_per_token
        slope_basis = f"evidence `{ev}`: BF16 ITL slope {slope_bf16:.3g} ms/token (single request, TP 1)"
        slope_prov = "measured"
    else:
        slope_bf16 = bf16.growing_bytes() / bw * 1e3
        slope_basis = (f"{bf16.growing_bytes():,} BF16 bytes per token of context per rank (full/MLA layers) / "
                       f"({gpu.bandwidth_tbs:g} TB/s x {BANDWIDTH_EFFICIENCY:g})")
        slope_prov = "modelled"
    tq = FORMATS[dtype].kind == "turboquant"
    if tq:
        slope = slope_bf16
        slope_basis += ("; TurboQuant dequantizes to BF16 before attention: BF16's step x (1 + overhead "
                        f"{TQ_OVERHEAD[0][1]:.0%} at batch {TQ_OVERHEAD[0][0]} to {TQ_OVERHEAD[1][1]:.0%} at "
                        f"{TQ_OVERHEAD[1][0]}, evidence `turboquant-latency`)")
        slope_prov = "modelled"
    else:
        ratio = slope_ratio(figures.policy, figures.itl if fits else None, layout, bf16, dtype, skip_layers, facts)
        slope = slope_bf16 * (ratio.value if ratio.value is not None else 1.0)
        if key != "bf16":
            slope_basis += f" x slope ratio {ratio.value:g} ({ratio.provenance}: {ratio.basis})"
            slope_prov = "measured" if slope_prov == "measured" and ratio.provenance == "measured" else "modelled"
    fit = fits.get(key) or base
    if fit is not None and fit.intercept_ms is not None:
        intercept = fit.intercept_ms
        icpt = Estimate(value=intercept, unit="ms", provenance="measured",
                        basis=f"evidence `{ev}`: ITL intercept of {key if key in fits and fits[key].intercept_ms is not None else 'bf16'}")
    elif base is not None and base.intercept_ms is not None:
        intercept = base.intercept_ms
        icpt = Estimate(value=intercept, unit="ms", provenance="measured",
                        basis=f"evidence `{ev}`: BF16 ITL intercept (the variant's own is not published)")
    else:
        wbytes, wbasis = _active_weight_bytes(figures)
        reduce_ms = 2 * arch.num_layers * ALLREDUCE_MS if tp > 1 else 0.0
        intercept = wbytes / tp / bw * 1e3 + arch.num_layers * LAYER_OVERHEAD_MS + reduce_ms
        icpt = Estimate(value=round(intercept, 3), unit="ms", provenance="modelled",
                        basis=f"weights read per step {wbasis} / tp {tp} / ({gpu.bandwidth_tbs:g} TB/s x "
                              f"{BANDWIDTH_EFFICIENCY:g}) + {arch.num_layers} layers x {LAYER_OVERHEAD_MS:g} ms"
                              + (f" + {2 * arch.num_layers} all-reduces x {ALLREDUCE_MS:g} ms" if tp > 1 else ""))
    return StepModel(intercept_ms=intercept, compute_ms_per_token=compute_ms, slope_ms_per_token=slope,
                     per_request_ms=per_request_ms, tq_overhead=tq,
                     slope=Estimate(value=slope, unit="ms/token", provenance=slope_prov,  # type: ignore[arg-type]
                                    basis=slope_basis),
                     intercept=icpt)


@dataclass(frozen=True)
class PrefillModel:
    """Prefill time of one prompt on one replica."""

    seconds: float
    estimate: Estimate


def prefill_model(figures: Figures, isl: int, two_level: str, facts: dict[str, Any]) -> PrefillModel:
    """FLOPs of the active weights and causal attention over tp x dense BF16 peak x efficiency."""
    arch, gpu, tp = figures.arch, figures.gpu, figures.workload.tp
    if not gpu.bf16_dense_tflops:
        raise ValueError(f"the GPU catalog has no bf16_dense_tflops for {gpu.id}; add it to model prefill")
    active = (arch.active_params_b or arch.params_b or 0.0) * 1e9
    linear = 2.0 * active * isl
    attn = 0.0
    heads = arch.num_attention_heads
    for spec in arch.layers:
        if spec.kind in ("mla",):
            dk, dv = arch.head_dim, arch.v_head_dim or arch.head_dim
        elif spec.kind in ("full", "sliding", "chunked", "shared"):
            dk = spec.head_size or arch.head_dim
            dv = spec.head_size_v or dk
        else:
            continue
        span = spec.window if spec.kind == "sliding" and spec.window else (spec.chunk if spec.kind == "chunked"
                                                                          and spec.chunk else None)
        pairs = isl * min(span, isl) - min(span, isl) ** 2 / 2 if span else isl * isl / 2
        attn += 2.0 * heads * (dk + dv) * pairs
    penalty = 1.0
    head_min = resolve_threshold(figures.policy, "prefill_head_dim_min", facts) or 256
    if two_level == "on" and gpu.generation == "hopper" and arch.max_head_dim >= head_min:
        penalty = TWO_LEVEL_PREFILL
    rate = gpu.bf16_dense_tflops * 1e12 * PREFILL_EFFICIENCY * tp
    seconds = (linear + attn * penalty) / rate
    basis = (f"(2 x {active / 1e9:.2f}B active parameters x {isl:,} tokens + causal attention "
             f"{attn / 1e12:.1f} TFLOP{f' x {penalty:.2f} two-level accumulation at head_dim {arch.max_head_dim}' if penalty != 1 else ''}) "
             f"/ ({tp} x {gpu.bf16_dense_tflops:g} TFLOPS x {PREFILL_EFFICIENCY:g})")
    return PrefillModel(seconds, Estimate(value=round(seconds * 1e3, 1), unit="ms", provenance="modelled",
                                          basis=basis))


# -- the load ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Replica:
    """One vLLM instance (tp GPUs) and the requests it serves."""

    capacity: int
    """Requests at isl + osl its KV cache holds at once."""
    isl: int
    osl: int
    step: StepModel
    prefill_s: float
    max_num_batched_tokens: int
    window: int | None
    """Sliding window (tokens) of the model's windowed layers, None when it has none."""

    @property
    def mean_context(self) -> float:
        """Mean tokens a decoding request holds (prompt plus half its output)."""
        return self.isl + self.osl / 2

    def step_s(self, batch: float) -> float:
        ctx = self.mean_context
        windowed = min(ctx, self.window) if self.window else 0.0
        return self.step.step_s(batch, ctx, windowed)

    @property
    def chunks(self) -> int:
        return math.ceil(self.isl / self.max_num_batched_tokens)

    def operate(self, running: float) -> Operating:
        """Steady state with `running` requests admitted: the throughput fixed point.

        Each request takes prefill p then osl - 1 decode steps; decode runs in the GPU time prefill leaves,
        so TPOT = step / (1 - lambda p); lambda = running / (TTFT_service + (osl - 1) TPOT)."""
        n = max(running, 1e-9)
        s = self.step_s(n)
        p = self.prefill_s
        a = p + self.chunks * s
        b = (self.osl - 1) * s
        if p <= 0:
            lam = n / (a + b)
        else:
            c = a + b + n * p
            lam = (c - math.sqrt(max(c * c - 4 * a * p * n, 0.0))) / (2 * a * p)
        tpot = s / (1 - lam * p) if lam * p < 1 else math.inf
        return Operating(running=n, rate=lam, ttft_service_s=a, tpot_s=tpot)


@dataclass(frozen=True)
class Operating:
    running: float
    rate: float
    """Requests per second completed."""
    ttft_service_s: float
    """Prefill plus the decode steps its chunks carry."""
    tpot_s: float


@dataclass(frozen=True)
class LoadResult:
    """Steady-state (or burst-mean) figures of one replica."""

    ttft_s: float
    tpot_s: float
    requests_per_s: float
    running: float
    """Requests admitted at once (in prefill or decode)."""
    queued: float
    """Requests waiting for KV room (mean)."""
    saturated: bool
    note: str


def closed_loop(r: Replica, clients: int) -> LoadResult:
    """`clients` each send a request when their last one finishes; those beyond the capacity wait."""
    if r.capacity < 1:
        return LoadResult(math.inf, math.inf, 0.0, 0, clients, True, "no request fits in the KV cache")
    n = min(clients, r.capacity)
    op = r.operate(n)
    queued = clients - n
    wait = queued / op.rate if queued else 0.0
    fit = "1 request fits" if r.capacity == 1 else f"{r.capacity} requests fit"
    note = (f"{queued} of {clients} clients wait for KV room ({fit}): "
            f"{wait:.1f} s each" if queued else f"all {clients} admitted ({r.capacity} fit)")
    return LoadResult(wait + op.ttft_service_s, op.tpot_s, op.rate, n, queued, False, note)


def _erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits (M/M/c), by the stable recursion over Erlang B."""
    if offered >= servers:
        return 1.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return b / (1 - (offered / servers) * (1 - b))


def open_loop(r: Replica, rate: float) -> LoadResult:
    """Poisson arrivals at `rate`: the running count from Little's law, KV-full queueing from Erlang C."""
    if r.capacity < 1:
        return LoadResult(math.inf, math.inf, 0.0, 0, math.inf, True, "no request fits in the KV cache")
    full = r.operate(r.capacity)
    if rate >= full.rate:
        return LoadResult(math.inf, full.tpot_s, full.rate, r.capacity, math.inf, True,
                          f"saturated: {rate:.3g} requests/s arrive, {full.rate:.3g}/s is the most "
                          + ("1 admitted request completes" if r.capacity == 1
                             else f"{r.capacity} admitted requests complete")
                          + "; the queue grows without bound")
    lo, hi = 0.0, float(r.capacity)
    for _ in range(60):  # lambda(n) rises with n: bisect for lambda(n) = rate (Little: n = rate x R)
        mid = (lo + hi) / 2
        if r.operate(mid).rate < rate:
            lo = mid
        else:
            hi = mid
    op = r.operate(hi)
    service = op.running / op.rate
    p_wait = _erlang_c(r.capacity, op.running)
    # M/D/c (Allen-Cunneen): deterministic lengths halve the M/M/c wait.
    wait = p_wait * service / (r.capacity - op.running) * 0.5 if p_wait > 0 else 0.0
    note = (f"Little's law: {rate:.3g}/s x {service:.1f} s per request = {op.running:.1f} running of "
            f"{r.capacity} that fit; P(wait for KV room) {p_wait:.2f}")
    return LoadResult(wait + op.ttft_service_s, op.tpot_s, rate, op.running, p_wait * rate * wait, False, note)


def burst(r: Replica, size: int, rate: float | None = None) -> LoadResult:
    """`size` requests at once, served in waves of what fits; with `rate`, such bursts every size/rate s."""
    if r.capacity < 1:
        return LoadResult(math.inf, math.inf, 0.0, 0, size, True, "no request fits in the KV cache")
    t, left, ttft_sum, tpot_sum, waves = 0.0, size, 0.0, 0.0, 0
    while left > 0:
        n = min(left, r.capacity)
        # Prefills run first-come first-served in chunks of max_num_batched_tokens; each chunk's step also
        # carries the requests already decoding (about half the wave on average).
        steps = math.ceil(n * r.isl / r.max_num_batched_tokens)
        prefill_phase = n * r.prefill_s + steps * r.step_s(n / 2)
        decode_phase = (r.osl - 1) * r.step_s(n)
        ttft_sum += n * (t + prefill_phase * (n + 1) / (2 * n))
        tpot_sum += n * (prefill_phase * (n - 1) / (2 * n) + decode_phase) / max(r.osl - 1, 1)
        t += prefill_phase + decode_phase
        left -= n
        waves += 1
    note = (f"{size} {noun(size, 'request')} in {waves} {noun(waves, 'wave')} of up to {r.capacity} "
            f"(KV room); served in {t:.1f} s")
    saturated = False
    if rate is not None and t > size / rate:
        saturated = True
        note += f"; saturated: each burst takes {t:.1f} s, longer than the {size / rate:.1f} s between bursts"
    return LoadResult(ttft_sum / size, tpot_sum / size, size / t, min(size, r.capacity),
                      max(size - r.capacity, 0), saturated, note)
