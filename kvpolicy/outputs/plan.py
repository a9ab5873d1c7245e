"""`kvpolicy plan`: the KV format and TP size under the user's traffic and latency targets.

The candidates are the KV formats the rules choose for this model and GPU at some load
(the engine run at concurrencies around each format's capacity), plus BF16, the
baseline; each candidate's other settings (skip layers, accumulation, backend) and its
trace come from `recommend` with the format pinned. For every candidate and TP size
vLLM accepts within the GPU count, the load model (`facts/load.py`) gives TTFT, TPOT
and throughput per GPU; the plan keeps those that meet the SLO and the accuracy floor
and chooses the highest throughput per GPU.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvpolicy import new_list, noun
from kvpolicy.facts.estimates import Estimate, Figures
from kvpolicy.facts.load import (
    BANDWIDTH_EFFICIENCY,
    LAYER_OVERHEAD_MS,
    PREFILL_EFFICIENCY,
    LoadResult,
    Replica,
    burst,
    closed_loop,
    open_loop,
    prefill_model,
    step_model,
)
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.inputs.policy_loader import LoadedPolicy
from kvpolicy.inputs.policy_schema import Compare, DecisionPatch, Pin
from kvpolicy.inputs.traffic import Slo, Traffic
from kvpolicy.inputs.workload import Workload
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.decision import Decision, Recommendation, Trace
from kvpolicy.rules.engine import decide

PIN_NAME = "plan-candidate"
"""The pin that fixes a candidate's KV dtype; the trace shows it as `pin:plan-candidate`."""
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""Clients per replica of the Pareto curves (cut at twice the KV capacity)."""


class _Model(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid")


class CurvePoint(_Model):
    """One closed-loop operating point of a Pareto curve."""

    concurrency: int
    """Clients in all (every replica)."""
    tokens_per_s_per_user: float
    """1 / TPOT."""
    tokens_per_s_per_gpu: float
    """Output tokens per second per GPU."""
    ttft_s: float
    """Mean TTFT (queueing for KV room included)."""
    tpot_ms: float
    """Mean TPOT."""


class Curve(_Model):
    """One option over concurrency (closed loop)."""

    option: str
    """The option id."""
    points: list[CurvePoint]
    """Operating points by rising concurrency, up to twice the KV capacity."""


class Excluded(_Model):
    """A KV dtype the policy's rules can choose but not for this model and GPU."""

    kv_cache_dtype: str
    """The dtype, as vLLM spells it."""
    reason: str
    """What the rules said (the condition that failed), or the constraint that forbids it."""


class PlanOption(_Model):
    """One KV format at one TP size under the traffic."""

    id: str
    """`<dtype>[+skip]@tp<N>`."""
    kv_cache_dtype: str
    """`--kv-cache-dtype`."""
    tp: int
    """Tensor-parallel size of one replica."""
    replicas: int
    """Data-parallel replicas (GPUs // tp); the traffic is split evenly."""
    decision: Decision
    """The engine's decision with this dtype pinned (skip layers, accumulation, scales, backend)."""
    vllm_args: list[str]
    """`vllm serve` flags of one replica."""
    kv_capacity_tokens: Estimate
    """vLLM's "GPU KV cache size" at max_model_len = isl + osl."""
    capacity_requests: Estimate
    """Requests at isl + osl one replica admits at once without preemption."""
    decode_slope: Estimate
    """ms per token of context the batch reads, per step."""
    decode_intercept: Estimate
    """ms per step with no context."""
    prefill: Estimate
    """Prefill of one prompt, ms."""
    ttft: Estimate
    """Mean time to first token, s (None when saturated)."""
    tpot: Estimate
    """Mean time per output token, ms."""
    tokens_per_s_per_gpu: Estimate
    """Output tokens per second per GPU at this traffic."""
    tokens_per_s_per_user: Estimate
    """Output tokens per second one request sees (1 / TPOT)."""
    accuracy_recovery: Estimate
    """Expected accuracy vs BF16 at isl + osl."""
    running: float
    """Requests admitted at once per replica (in prefill or decode)."""
    saturated: bool
    """Arrivals exceed what the replica serves: the queue grows without bound."""
    load_note: str
    """How the load model reached the figures (queueing, Little's law, waves)."""
    meets_slo: bool
    """TTFT and TPOT within the targets, not saturated."""
    meets_accuracy: bool
    """Expected accuracy recovery at or above the floor (unknown counts as below)."""
    failures: list[str] = Field(default_factory=new_list)
    """Why it misses the targets (empty when it meets them)."""
    warnings: list[str] = Field(default_factory=new_list)
    """The rules' warnings for this decision."""
    trace: Trace | None = None
    """The engine's rule-by-rule reasoning (one per KV dtype: the largest TP's)."""


class Choice(_Model):
    """An option the plan names, and why."""

    option: str
    """The option id."""
    why: str
    """The figures that decided it."""


class PlanResult(_Model):
    """Everything `kvpolicy plan` returns."""

    schema_version: Literal[1] = 1
    """Version of this document's schema."""
    model: str
    """Model id as resolved."""
    gpu: str
    """GPU id as resolved."""
    gpus: int
    """GPUs the plan may use."""
    traffic: Traffic
    """The traffic."""
    slo: Slo
    """The latency targets."""
    accuracy_floor: float
    """Lowest acceptable accuracy recovery vs BF16."""
    policy: str
    """Policy name and content hash."""
    engine_choice: str
    """What `recommend` decides at this load (largest valid TP), for reference."""
    options: list[PlanOption]
    """Every candidate KV format at every TP size whose weights fit, largest TP first."""
    excluded: list[Excluded]
    """KV dtypes of the policy's rules that are not candidates here, and why."""
    chosen: Choice | None
    """The option that meets the targets with the most tokens/s per GPU (None when none does)."""
    runner_up: Choice | None
    """The next best option that meets the targets, else the nearest miss."""
    closest: Choice | None = None
    """When nothing meets the targets: the option that misses them by the least."""
    curves: list[Curve]
    """Closed-loop Pareto curves, one per option."""
    assumptions: list[str]
    """What the load model assumes, in words."""


# -- candidates from the engine ----------------------------------------------------------


def _pinned(loaded: LoadedPolicy, dtype: str) -> LoadedPolicy:
    pin = Pin(name=PIN_NAME, when=Compare(fact="model.id", op="exists", value=True),
              set=DecisionPatch(kv_cache_dtype=dtype), reason="kvpolicy plan evaluates this candidate")
    policy = loaded.policy.model_copy(update={"pins": [*loaded.policy.pins, pin]})
    policy.__dict__.pop("derived", None)  # compiled rules of the original must not serve the copy
    return LoadedPolicy(policy=policy, chain=loaded.chain, content_hash=loaded.content_hash, raw=loaded.raw)


def candidates(arch: ModelArch, gpu: GpuSpec, workload: Workload, loaded: LoadedPolicy,
               figures: Figures) -> tuple[list[str], list[Excluded]]:
    """KV dtypes the rules choose for this model and GPU at some concurrency, BF16 first; and the others."""
    from kvpolicy.facts.build import build_facts

    policy = loaded.policy
    probes = {1}
    for dtype in ("auto", "fp8", "turboquant_4bit_nc"):
        probes.add(max(figures.max_concurrency(dtype), 0) + 1)
    picked: list[str] = ["auto"]
    reasons: dict[str, str] = {}
    sets = {r.id: r.then.fields().get("kv_cache_dtype") for r in policy.rules}
    for conc in sorted(probes):
        wl = workload.model_copy(update={"concurrency": conc})
        fig = Figures(policy, arch, gpu, wl)
        facts = build_facts(arch, gpu, wl, policy, figures=fig)
        outcome = decide(policy, facts)
        dtype = outcome.decision.kv_cache_dtype
        if dtype not in picked:
            picked.append(dtype)
        decided_by = outcome.trace["fields"]["kv_cache_dtype"]["decided_by"]
        for rule in outcome.trace["rules"]:
            wanted = sets.get(rule["id"])
            if not wanted or wanted == dtype:
                continue
            if rule["matched"]:
                why = f"{rule['id']} {rule['name']} matched at concurrency {conc}, but {decided_by} decided {dtype}"
            else:
                why = f"{rule['id']} {rule['name']}: {rule['reason']}"
            # A failing condition on the model or GPU says more than one on the load (memory.*), which the
            # probes vary on purpose: keep the first of those.
            old = reasons.get(wanted)
            if old is None or (" memory." in old or ": memory." in old) and ": memory." not in why:
                reasons[wanted] = why
    vocabulary = dict.fromkeys(r.then.fields()["kv_cache_dtype"] for r in policy.rules
                               if r.enabled and r.then.fields().get("kv_cache_dtype"))
    excluded = [Excluded(kv_cache_dtype=d, reason=reasons.get(d, "no rule chose it at any load"))
                for d in vocabulary if d not in picked]
    return picked, excluded


# -- the plan ----------------------------------------------------------------------------


def _per_replica(traffic: Traffic, replicas: int) -> dict[str, Any]:
    return {
        "concurrency": math.ceil(traffic.concurrency / replicas) if traffic.concurrency else None,
        "rate": traffic.rate / replicas if traffic.rate else None,
        "burst": math.ceil(traffic.burst / replicas) if traffic.burst else None,
    }


def _load(replica: Replica, traffic: Traffic, replicas: int) -> LoadResult:
    share = _per_replica(traffic, replicas)
    if share["burst"]:
        return burst(replica, share["burst"], share["rate"])
    if share["concurrency"]:
        return closed_loop(replica, share["concurrency"])
    return open_loop(replica, share["rate"])


def _in_flight(traffic: Traffic, replicas: int) -> int:
    """The concurrency the rules see for one replica."""
    share = _per_replica(traffic, replicas)
    return max(1, share["concurrency"] or share["burst"] or 1)


def plan(arch: ModelArch, gpu: GpuSpec, gpus: int, traffic: Traffic, slo: Slo, loaded: LoadedPolicy, *,
         accuracy_floor: float, gpu_memory_utilization: float = 0.92) -> PlanResult:
    """Evaluate every candidate KV format at every valid TP size under the traffic."""
    tps = arch.valid_tp_sizes(gpus)
    if not tps:
        from kvpolicy.errors import InputError

        raise InputError(f"no tensor-parallel size from 1 to {gpus} fits {arch.id}: {arch.tp_error(gpus)}")
    ctx = traffic.context_tokens
    options: list[PlanOption] = []
    curves: list[Curve] = []
    excluded: dict[str, Excluded] = {}
    engine_choice = ""
    traced: set[str] = set()
    for tp in sorted(tps, reverse=True):
        replicas = gpus // tp
        wl = Workload(context_tokens=ctx, concurrency=_in_flight(traffic, replicas), tp=tp,
                      accuracy_floor=accuracy_floor, gpu_memory_utilization=gpu_memory_utilization,
                      priority="balanced")
        figures = Figures(loaded.policy, arch, gpu, wl)
        if figures.budget <= 0:
            continue
        if not engine_choice:
            engine_choice = f"{recommend(arch, gpu, wl, loaded).decision.kv_cache_dtype}@tp{tp}"
        dtypes, excl = candidates(arch, gpu, wl, loaded, figures)
        for e in excl:
            excluded.setdefault(e.kv_cache_dtype, e)
        for dtype in dtypes:
            from kvpolicy.errors import PolicyError

            try:
                rec = recommend(arch, gpu, wl, _pinned(loaded, dtype))
            except PolicyError as exc:
                excluded.setdefault(dtype, Excluded(kv_cache_dtype=dtype, reason=str(exc)))
                continue
            opt, curve = _option(rec, figures, traffic, slo, tp, replicas, gpus, accuracy_floor,
                                 trace=dtype not in traced)
            traced.add(dtype)
            options.append(opt)
            curves.append(curve)
    if not options:
        from kvpolicy.errors import InputError

        raise InputError(f"the weights of {arch.id} ({arch.weight_bytes / 1e9:.1f} GB) leave no KV room on "
                         f"{gpus} x {gpu.id} at any TP size ({', '.join(map(str, tps))}); use more GPUs.")
    chosen, runner, closest = _choose(options)
    return PlanResult(model=arch.id, gpu=gpu.id, gpus=gpus, traffic=traffic, slo=slo, accuracy_floor=accuracy_floor,
                      policy=loaded.label, engine_choice=engine_choice, options=options,
                      excluded=sorted(excluded.values(), key=lambda e: e.kv_cache_dtype), chosen=chosen,
                      runner_up=runner, closest=closest, curves=curves, assumptions=_assumptions(traffic))


def _option(rec: Recommendation, figures: Figures, traffic: Traffic, slo: Slo, tp: int, replicas: int, gpus: int,
            floor: float, *, trace: bool) -> tuple[PlanOption, Curve]:
    d = rec.decision
    facts = rec.trace.facts
    kv_plan = figures.plan(d.kv_cache_dtype, d.skip_layers)
    cap = kv_plan.capacity(figures.budget)
    step = step_model(figures, d.kv_cache_dtype, d.skip_layers, facts)
    pre = prefill_model(figures, traffic.isl, d.two_level_accumulation, facts)
    replica = Replica(capacity=cap.requests_that_fit, isl=traffic.isl, osl=traffic.osl, step=step,
                      prefill_s=pre.seconds, max_num_batched_tokens=kv_plan.defaults.max_num_batched_tokens,
                      window=figures.arch.sliding_window if figures.arch.count("sliding") else None)
    load = _load(replica, traffic, replicas)
    skip = "+skip" if d.skip_layers else ""
    oid = f"{d.kv_cache_dtype}{skip}@tp{tp}"
    per_gpu = load.requests_per_s * traffic.osl * replicas / gpus
    basis_load = f"{load.note}; step {step.intercept_ms:.2f} ms + {step.slope_ms_per_token:.3g} ms/token x KV tokens"
    finite = not load.saturated and math.isfinite(load.ttft_s)
    ttft = Estimate(value=round(load.ttft_s, 3) if finite else None, unit="s", provenance="modelled",
                    basis=basis_load + f"; prefill {pre.seconds * 1e3:.0f} ms + {replica.chunks} chunk "
                          f"{noun(replica.chunks, 'step')}")
    tpot_ms = load.tpot_s * 1e3 if math.isfinite(load.tpot_s) else None
    tpot = Estimate(value=round(tpot_ms, 2) if tpot_ms is not None else None, unit="ms", provenance="modelled",
                    basis="decode step / (1 - share of GPU time prefill takes) at "
                          f"{load.running:.1f} running requests of mean context {replica.mean_context:,.0f}")
    acc = rec.estimates.accuracy_recovery
    failures: list[str] = []
    if load.saturated:
        failures.append(load.note[load.note.find("saturated"):] if "saturated" in load.note else "saturated")
    if slo.ttft_s is not None and (ttft.value is None or ttft.value > slo.ttft_s):
        failures.append(f"TTFT {_num(ttft.value, 's')} > {slo.ttft_s:g} s")
    if slo.tpot_ms is not None and (tpot.value is None or tpot.value > slo.tpot_ms):
        failures.append(f"TPOT {_num(tpot.value, 'ms')} > {slo.tpot_ms:g} ms")
    meets_acc = acc.value is not None and acc.value >= floor
    if not meets_acc:
        failures.append(f"accuracy {acc.value if acc.value is not None else 'unknown'} below the floor {floor:g}")
    opt = PlanOption(
        id=oid, kv_cache_dtype=d.kv_cache_dtype, tp=tp, replicas=replicas, decision=d, vllm_args=rec.vllm_args,
        kv_capacity_tokens=Estimate(value=cap.tokens, unit="tokens", provenance="modelled",
                                    basis=rec.estimates.kv_capacity_tokens.basis),
        capacity_requests=Estimate(value=cap.requests_that_fit, unit="requests", provenance="modelled",
                                   basis=f"{cap.num_blocks:,} blocks / {kv_plan.blocks_per_request:,} per request of "
                                         f"{traffic.context_tokens:,} tokens ({kv_plan.describe()}), the null "
                                         "block held back"),
        decode_slope=step.slope, decode_intercept=step.intercept, prefill=pre.estimate, ttft=ttft, tpot=tpot,
        tokens_per_s_per_gpu=Estimate(value=round(per_gpu, 1), unit="tokens/s", provenance="modelled",
                                      basis=f"{load.requests_per_s:.3g} requests/s x {traffic.osl:,} output tokens x "
                                            f"{replicas} {noun(replicas, 'replica')} / {gpus} {noun(gpus, 'GPU')}"),
        tokens_per_s_per_user=Estimate(value=round(1e3 / tpot_ms, 1) if tpot_ms else None, unit="tokens/s",
                                       provenance="modelled", basis="1 / TPOT"),
        accuracy_recovery=acc, running=round(load.running, 2), saturated=load.saturated, load_note=load.note,
        meets_slo=not load.saturated and not any(f.startswith(("TTFT", "TPOT")) for f in failures),
        meets_accuracy=meets_acc, failures=failures, warnings=rec.warnings,
        trace=rec.trace if trace else None,
    )
    points = []
    for c in SWEEP:
        if c > max(2 * replica.capacity, 1):
            break
        res = closed_loop(replica, c)
        if not math.isfinite(res.tpot_s):
            continue
        points.append(CurvePoint(concurrency=c * replicas, tokens_per_s_per_user=round(1 / res.tpot_s, 2),
                                 tokens_per_s_per_gpu=round(res.requests_per_s * traffic.osl * replicas / gpus, 2),
                                 ttft_s=round(res.ttft_s, 3), tpot_ms=round(res.tpot_s * 1e3, 3)))
    return opt, Curve(option=oid, points=points)


def _num(v: float | None, unit: str) -> str:
    return "unbounded" if v is None else f"{v:.3g} {unit}"


def _choose(options: list[PlanOption]) -> tuple[Choice | None, Choice | None, Choice | None]:
    ok = [o for o in options if o.meets_slo and o.meets_accuracy]
    ok.sort(key=lambda o: (-(o.tokens_per_s_per_gpu.value or 0), o.ttft.value or math.inf))
    if ok:
        best = ok[0]
        why = (f"meets the SLO and the accuracy floor with the most output tokens/s per GPU "
               f"({best.tokens_per_s_per_gpu.value:,.0f}; TTFT {_num(best.ttft.value, 's')}, TPOT "
               f"{_num(best.tpot.value, 'ms')}, accuracy {best.accuracy_recovery.value:g})")
        runner = None
        if len(ok) > 1:
            r = ok[1]
            runner = Choice(option=r.id, why=f"also meets the targets: {r.tokens_per_s_per_gpu.value:,.0f} tokens/s "
                                             f"per GPU ({_pct(r, best)} the chosen), TTFT {_num(r.ttft.value, 's')}, "
                                             f"TPOT {_num(r.tpot.value, 'ms')}")
        else:
            rest = sorted((o for o in options if o is not best), key=_miss)
            if rest:
                runner = Choice(option=rest[0].id, why="the nearest miss: " + "; ".join(rest[0].failures))
        return Choice(option=best.id, why=why), runner, None
    near = sorted(options, key=_miss)
    return None, None, Choice(option=near[0].id, why="misses by the least: " + "; ".join(near[0].failures))


def _pct(r: PlanOption, best: PlanOption) -> str:
    a, b = r.tokens_per_s_per_gpu.value or 0, best.tokens_per_s_per_gpu.value or 1
    return f"{(a / b - 1) * 100:+.0f}% vs"


def _miss(o: PlanOption) -> float:
    """How far an option is from the targets (0 when it meets them), as the worst ratio over 1."""
    worst = 0.0
    for f in o.failures:
        if f.startswith("TTFT") or f.startswith("TPOT"):
            try:
                got = float(f.split()[1])
                want = float(f.split("> ")[1].split()[0])
                worst = max(worst, got / want - 1)
            except (ValueError, IndexError):
                worst = max(worst, 1e6)
        else:
            worst = max(worst, 1e3)
    return worst


def _assumptions(traffic: Traffic) -> list[str]:
    return [
        f"max_model_len = isl + osl = {traffic.context_tokens:,}; a replica admits the requests whose whole "
        "lifetime fits in its KV blocks (vLLM admits on the prompt and preempts later: real admission is higher "
        "until preemption sets in)",
        "decode step = max(weights term, GEMM roof) + slope x KV tokens the batch reads; measured ITL lines "
        f"(evidence) at TP 1 on the same GPU, else bytes / (bandwidth x {BANDWIDTH_EFFICIENCY:g}) plus "
        f"{LAYER_OVERHEAD_MS:g} ms per layer",
        f"prefill = FLOPs of the active weights and causal attention / (tp x dense BF16 peak x "
        f"{PREFILL_EFFICIENCY:g}); chunked prefill: each chunk's step carries the running decodes, and decode "
        "runs in the GPU time prefill leaves",
        "closed loop (concurrency): clients beyond the capacity queue (Little's law on the queue); open loop "
        "(rate): Little's law for the running count, Erlang C for waits on KV room, saturation when arrivals "
        "exceed the rate at full capacity; burst: waves of what fits",
        "traffic is split evenly over replicas (GPUs // tp); MoE experts touched beyond top-k at larger batches "
        "and preemption are not modelled",
    ]
