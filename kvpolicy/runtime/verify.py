"""`kvpolicy verify`: attention-level accuracy of the candidate formats against BF16, and the verdict.

The needle test (`needle.py`) runs at every context on the model's full-attention
(or MLA) layer geometry. Recovery per context is hits(format) / hits(BF16); the
documents' rule then gives the verdict: at or above the accuracy floor (95% by
default) the format passes; below it an FP8 format should be calibrated (its
per-head-scale twin is measured alongside, to say whether that suffices) or BF16
kept. With a local Hugging Face model folder and transformers installed, the
model-level check (`hfcheck.py`) adds next-token agreement and KL divergence.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from dataclasses import replace

import torch
from pydantic import Field

from kvpolicy import new_dict, new_list
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.rules.decision import Decision
from kvpolicy.runtime.caches import LayerPlan
from kvpolicy.runtime.confidence import default_trials, fmt_interval, side, trials_to_decide, wilson
from kvpolicy.runtime.needle import (
    MARGIN_NATS,
    NEEDLE_LIFT,
    geometry_label,
    geometry_plans,
    make_case,
    plan_for,
    score,
)
from kvpolicy.runtime.results import Environment, _Model, environment
from kvpolicy.runtime.variants import Variant

Verdict = str
"""`pass`, `calibrate`, `keep_bf16`, `undecided` or `not_applicable`."""


class HitPoint(_Model):
    """One format at one context of a hit-or-miss test, and the share of BF16's hits it keeps."""

    variant: str
    """Variant name."""
    context_tokens: int
    """Tokens in each sequence or prompt."""
    hits: int
    """Trials this format hit."""
    trials: int
    """Trials run."""
    recovery: float | None = None
    """Fraction of BF16's hits this format also hits (kept / bf16_hits)."""
    recovery_low: float | None = None
    """Lower end of the 95% Wilson interval of `recovery`."""
    recovery_high: float | None = None
    """Upper end of the 95% Wilson interval of `recovery`."""
    kept: int | None = None
    """Trials hit by both BF16 and this format."""
    bf16_hits: int | None = None
    """Trials BF16 hit (the denominator of `recovery`)."""


class NeedlePoint(HitPoint):
    """One format at one context on one layer geometry: a hit is a trial where the needle's recovered weight
    exceeds 1/2; trials are sequences x query heads."""

    geometry: str = ""
    """Layer geometry tested (`layer 1 (full, 8q/2kv x 64)`)."""
    p_abs_error: float
    """Mean |recovered needle weight - exact|."""
    out_rel_error: float
    """Relative error of the attention output vs the float64 answer."""


class VariantVerdict(_Model):
    """What the documents' rule says about one candidate."""

    variant: str
    """Variant name."""
    min_recovery: float | None
    """Lowest recovery over the contexts and geometries (the needle test)."""
    worst_context_tokens: int | None
    """Where it was lowest."""
    verdict: Verdict
    """pass / calibrate / keep_bf16 / undecided / not_applicable."""
    reason: str
    """The rule in words, with the numbers."""
    recovery_low: float | None = None
    """95% interval of the deciding recovery (or top-1 agreement when the model decided): low end."""
    recovery_high: float | None = None
    """Its high end."""
    trials_to_decide: int | None = None
    """When undecided: trials (needle) or tokens (model) at which the observed rate would be decided."""
    basis: str = "needle"
    """What decided: `needle` (synthetic attention test) or `model` (the model's own next-token figures)."""
    needle_verdict: Verdict | None = None
    """The needle test's verdict, kept beside a model-level one."""


class ModelCheck(_Model):
    """Next-token agreement and KL divergence of one format vs the BF16 cache, over a text."""

    variant: str
    """Variant name."""
    tokens: int
    """Positions compared."""
    agreement: float
    """Fraction of positions whose argmax next token equals BF16's."""
    kl_mean: float
    """Mean KL(BF16 || format) of the next-token distributions, in nats."""
    kl_max: float
    """Largest per-position KL."""
    agreement_low: float | None = None
    """Lower end of the 95% Wilson interval of `agreement`."""
    agreement_high: float | None = None
    """Upper end of that interval."""
    kl_p99: float | None = None
    """99th percentile of the per-position KL."""
    ppl_delta: float | None = None
    """Perplexity of the text under this format over BF16's, minus 1 (0.013 = +1.3%)."""
    reference_agreement: float | None = None
    """On a GPU: the same figure through the float64 references instead of the kernels (the kernels' own error
    shows as the difference)."""
    reference_kl_mean: float | None = None
    """On a GPU: mean KL through the float64 references."""
    kernel_kl_ratio: float | None = None
    """`kl_mean` over `reference_kl_mean`: what the kernels add to the format's own loss (at most
    KERNEL_KL_RATIO_MAX expected)."""


KERNEL_KL_RATIO_MAX = 1.5
"""The kernels' mean KL may be at most this multiple of the float64 references' for the same format."""


class RetrievalPoint(HitPoint):
    """Model-level retrieval in real text at one context: a trial is a prompt with a fact planted at some depth
    and asked at the end, a hit one whose every answer token is the model's top-1 next token (teacher forced);
    `recovery` is None for BF16 itself, or when BF16 hit none."""


class ModelThresholds(_Model):
    """What a format must meet at model level (the policy's `model_*` thresholds)."""

    min_top1_agreement: float
    """Lowest top-1 agreement with BF16 (its 95% interval must lie above it to pass)."""
    max_kl_mean: float
    """Highest mean KL(BF16 || format), nats."""
    max_kl_p99: float
    """Highest 99th-percentile KL, nats."""
    max_ppl_increase: float
    """Highest relative perplexity increase over BF16."""


class VerifyResult(_Model):
    """Everything `kvpolicy verify` measured."""

    schema_version: int = 1
    """Version of this document's schema."""
    kind: str = "verify"
    """Document kind."""
    model: str
    """Model id."""
    gpu: str
    """GPU catalog id of the decision."""
    environment: Environment
    """Where it ran."""
    policy: str = ""
    """Policy label of the decision."""
    decision: Decision
    """The decision verified (at the longest context)."""
    accuracy_floor: float = 0.95
    """Recovery below this fails (the workload's floor)."""
    geometry: dict[str, int | str] = Field(default_factory=new_dict)
    """First layer tested (the full-attention one): index, kind, query heads, KV heads, head dim."""
    geometries: list[dict[str, int | str]] = Field(default_factory=new_list)
    """Every distinct layer geometry tested (full, sliding, per-layer-type heads), with its label."""
    trials_per_context: int = 0
    """Needle trials per context and geometry the run aimed at (sequences x query heads)."""
    method: str = ""
    """The needle test in one sentence."""
    contexts: list[int] = Field(default_factory=new_list)
    """Contexts measured."""
    batch: int = 1
    """Sequences per context (on the first geometry)."""
    points: list[NeedlePoint] = Field(default_factory=new_list)
    """Per variant, geometry and context."""
    verdicts: list[VariantVerdict] = Field(default_factory=new_list)
    """Per candidate variant."""
    model_check: list[ModelCheck] = Field(default_factory=new_list)
    """Model-level check, when it ran."""
    model_check_note: str = ""
    """Why the model-level check did or did not run."""
    model_thresholds: ModelThresholds | None = None
    """What the model-level figures were judged against (when they decided)."""
    retrieval: list[RetrievalPoint] = Field(default_factory=new_list)
    """Model-level retrieval in real text, per variant and context, when it ran."""
    retrieval_note: str = ""
    """How the retrieval prompts were built, or why it did not run."""
    warnings: list[str] = Field(default_factory=new_list)
    """What the reader must know."""


def with_calibrated_twins(variants: list[Variant]) -> list[Variant]:
    """Add the per-head-scale twin of every uncalibrated FP8 candidate (the rule's first remedy).

    One-level accumulation variants are diagnostics (what two-level accumulation buys), not candidates.
    """
    out = list(variants)
    for v in variants:
        if v.kind == "fp8" and v.scale_source == "uncalibrated" and v.two_level:
            twin = replace(v, scale_source="checkpoint_per_head")
            if twin not in out:
                out.insert(out.index(v) + 1, twin)
    return out


def needle_batch(plan: LayerPlan, trials: int) -> int:
    """Sequences that give at least `trials` trials on this geometry (one trial per sequence and query head)."""
    return max(1, math.ceil(trials / plan.num_q_heads))


def run_verify(arch: ModelArch, gpu: GpuSpec, decision: Decision, variants: list[Variant], contexts: list[int],
               batch: int | None, device: torch.device, backend: str, accuracy_floor: float = 0.95,
               policy_label: str = "", on_point: Callable[[str], None] | None = None,
               seed: int = 0, trials: int | None = None) -> VerifyResult:
    """Needle test of every variant at every context on every layer geometry (BF16 first), then the verdicts.

    `batch` fixes the sequences per context; otherwise `trials` (default: enough to decide a format 3
    points from the floor) sets them per geometry.
    """
    geoms = geometry_plans(arch)
    base = geoms[0]
    dtype = torch.bfloat16 if backend == "triton" else torch.float32
    if batch is None:
        trials = trials or default_trials(accuracy_floor)
    result = VerifyResult(
        model=arch.id, gpu=gpu.id, environment=environment(device, backend), policy=policy_label,
        decision=decision, accuracy_floor=accuracy_floor, contexts=sorted(set(contexts)),
        batch=batch or needle_batch(base, trials or 1), trials_per_context=trials or batch * base.num_q_heads,
        geometry={"layer": base.index, "kind": base.kind, "num_q_heads": base.num_q_heads,
                  "num_kv_heads": base.num_kv_heads, "head_dim": base.head_dim},
        geometries=[{"label": geometry_label(g), "layer": g.index, "kind": g.kind, "num_q_heads": g.num_q_heads,
                     "num_kv_heads": g.num_kv_heads, "head_dim": g.head_dim, "window": g.window or 0}
                    for g in geoms],
        method=(f"one needle per sequence and KV head, margin U{MARGIN_NATS} nats over the log-sum-exp of "
                f"the distractors (keys with outlier channels), value lifted by {NEEDLE_LIFT:g} in one channel; "
                "hit when the needle's weight read back from the output exceeds 1/2; recovery = the fraction of "
                "BF16's hits the format also hits, with its 95% Wilson interval; every distinct layer geometry, "
                "sliding layers at contexts up to their window"),
    )
    plans = {v.name: plan_for(arch, base, v) for v in variants}
    one_level = [v.name for v in variants if not v.two_level and v.kind == "fp8"]
    if one_level and backend != "triton":
        result.warnings.append(f"{', '.join(one_level)}: the CPU references compute the exact sum, so one-level "
                               "accumulation matches two-level here; its loss shows only with the kernels on a "
                               "GPU (e4m3 P.V carried in Hopper's fp8 MMA, decoded unsplit).")
    for v in variants:
        if plans[v.name] is None:
            result.warnings.append(f"{v.name}: not applicable to {base.kind} layers (kept BF16 by the format).")
    for geo in geoms:
        label = geometry_label(geo)
        n_seq = batch or needle_batch(geo, trials or 1)
        ctxs = sorted({min(c, geo.window) if geo.window else c for c in result.contexts})
        for context in ctxs:
            case = make_case(geo, n_seq, context, device, dtype, seed=seed + context + 7919 * geo.index)
            bf16_mask = None
            for v in variants:
                plan = plan_for(arch, geo, v)
                if plan is None or plans[v.name] is None:
                    continue
                run_as = v
                if plan.fmt is not None and plan.fmt.kind == "bf16" and v.kind != "bf16":
                    run_as = Variant("auto", cache_layout=v.cache_layout)  # the variant keeps this layer BF16
                s = score(plan, run_as, case, device, backend)
                if v.kind == "bf16":
                    bf16_mask = s.hit_mask
                point = NeedlePoint(variant=v.name, context_tokens=context, hits=s.hits, trials=s.trials,
                                    geometry=label, p_abs_error=round(s.p_abs_error, 5),
                                    out_rel_error=round(s.out_rel_error, 6))
                if bf16_mask is not None and s.hit_mask is not None:
                    n = int(bf16_mask.sum())
                    k = int((bf16_mask & s.hit_mask).sum())
                    lo, hi = wilson(k, n)
                    point.kept, point.bf16_hits = k, n
                    point.recovery = round(k / n, 4) if n else 0.0
                    point.recovery_low, point.recovery_high = round(lo, 4), round(hi, 4)
                result.points.append(point)
                if on_point:
                    on_point(f"{v.name} {label} {context} tokens: {s.hits}/{s.trials} hits")
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result.verdicts = verdicts(result, variants, plans)
    return result


def _worst(points: list[NeedlePoint], floor: float) -> NeedlePoint:
    """The point that decides: one decidedly below the floor first, then undecided ones, by lowest recovery."""
    def rank(p: NeedlePoint) -> tuple[int, float, int]:
        s = side(p.kept or 0, p.bf16_hits or 0, floor)
        return ({"below": 0, "undecided": 1, "above": 2}[s], p.recovery or 0.0, -p.context_tokens)

    return min(points, key=rank)


def verdicts(result: VerifyResult, variants: list[Variant], plans: dict) -> list[VariantVerdict]:
    """The documents' rule per candidate, on 95% intervals: pass when the worst point's interval lies at or
    above the floor; below it calibrate (FP8, when the per-head twin decidedly passes) or keep BF16; undecided
    when an interval straddles the floor, with the trials that would decide it."""
    floor = result.accuracy_floor
    out: list[VariantVerdict] = []
    by_name = {v.name: v for v in variants}
    worst: dict[str, NeedlePoint] = {}
    for v in variants[1:]:
        pts = [p for p in result.points if p.variant == v.name and p.recovery is not None]
        if pts:
            worst[v.name] = _worst(pts, floor)

    def sided(name: str) -> str:
        p = worst[name]
        return side(p.kept, p.bf16_hits, floor) if p.kept is not None and p.bf16_hits is not None else (
            "above" if (p.recovery or 0.0) >= floor else "below")

    for v in variants[1:]:
        if plans.get(v.name) is None or v.name not in worst:
            out.append(VariantVerdict(variant=v.name, min_recovery=None, worst_context_tokens=None,
                                      verdict="not_applicable", reason="the format does not apply to this layer"))
            continue
        p = worst[v.name]
        rec, ctx = p.recovery or 0.0, p.context_tokens
        where = f"at {ctx:,} tokens" + (f" on {p.geometry}" if p.geometry and len(result.geometries) > 1 else "")
        lo = hi = None
        ci = ""
        if p.kept is not None and p.bf16_hits is not None:
            lo, hi = (round(x, 4) for x in wilson(p.kept, p.bf16_hits))
            ci = f" (95% CI {fmt_interval(lo, hi)}, {p.kept}/{p.bf16_hits})"
        common = dict(variant=v.name, min_recovery=rec, worst_context_tokens=ctx, recovery_low=lo,
                      recovery_high=hi)
        s = sided(v.name)
        if s == "above":
            out.append(VariantVerdict(**common, verdict="pass",
                                      reason=f"lowest recovery {rec:.1%}{ci} {where} >= floor {floor:.0%}"))
            continue
        if s == "undecided":
            need = trials_to_decide(rec, floor)
            out.append(VariantVerdict(
                **common, verdict="undecided", trials_to_decide=need,
                reason=f"recovery {rec:.1%}{ci} {where}: the interval straddles the floor {floor:.0%}; "
                       + (f"about {need:,} trials per context would decide it (--trials {need})" if need
                          else "it sits on the floor, no number of trials decides it")))
            continue
        twin = next((t for t in by_name.values() if t.kind == "fp8" and t.kv_cache_dtype == v.kv_cache_dtype
                     and t.two_level == v.two_level and t.scale_source == "checkpoint_per_head"), None)
        if v.kind == "fp8" and v.scale_source == "uncalibrated" and twin is not None and twin.name in worst \
                and sided(twin.name) == "above":
            out.append(VariantVerdict(
                **common, verdict="calibrate",
                reason=f"uncalibrated recovery {rec:.1%}{ci} {where} < floor {floor:.0%}; per-head scales "
                       f"recover {worst[twin.name].recovery or 0.0:.1%}: calibrate (llm-compressor, per-attention-head "
                       "scales)"))
        else:
            out.append(VariantVerdict(
                **common, verdict="keep_bf16",
                reason=f"recovery {rec:.1%}{ci} {where} < floor {floor:.0%}"
                       + ("; calibrated scales do not reach it either" if v.kind == "fp8" else "")
                       + ": keep BF16 (or a format that passes)"))
    return out


MODEL_THRESHOLDS = {"min_top1_agreement": "model_min_top1_agreement", "max_kl_mean": "model_max_kl_mean",
                    "max_kl_p99": "model_max_kl_p99", "max_ppl_increase": "model_max_ppl_increase"}
"""ModelThresholds field -> the policy threshold that sets it."""


def model_thresholds(policy: Any) -> ModelThresholds:
    """The policy's `model_*` thresholds (the built-in policy's where a policy leaves one out)."""
    from kvpolicy.inputs.policy_schema import resolve_threshold

    values = {field: resolve_threshold(policy, name, {}) for field, name in MODEL_THRESHOLDS.items()}
    if any(v is None for v in values.values()):  # a policy that does not extend the built-in one
        from kvpolicy.rules.validate import load_policy

        builtin = load_policy(None).policy
        values = {f: v if v is not None else resolve_threshold(builtin, MODEL_THRESHOLDS[f], {})
                  for f, v in values.items()}
    return ModelThresholds(**values)


def _model_side(c: ModelCheck, t: ModelThresholds) -> tuple[str, list[str]]:
    """`above` / `below` / `undecided` for one format's model-level figures, and the figures that fail: the
    judgement `recommend` applies to recorded figures (`judge_model_figures`), on the same rounded interval."""
    from kvpolicy.facts.estimates import judge_model_figures

    lo, hi = (c.agreement_low, c.agreement_high) if c.agreement_low is not None and c.agreement_high is not None \
        else (round(x, 4) for x in wilson(round(c.agreement * c.tokens), c.tokens))
    limits = {name: getattr(t, field) for field, name in MODEL_THRESHOLDS.items()}
    verdict, fails = judge_model_figures(lo, hi, c.kl_mean, c.kl_p99, c.ppl_delta, limits)
    return {"pass": "above"}.get(verdict, verdict), fails


def model_verdicts(checks: list[ModelCheck], needle: list[VariantVerdict], variants: list[Variant],
                   thresholds: ModelThresholds) -> list[VariantVerdict]:
    """Verdicts from the model's own next-token figures (they decide; the needle verdict is kept beside them).

    Pass when every figure is within its threshold and the agreement's 95% interval lies above its minimum;
    below when any figure fails (an FP8 format whose per-head twin passes: calibrate; else keep BF16);
    undecided when only the agreement interval straddles its minimum, with the tokens that would decide it.
    """
    by_check = {c.variant: c for c in checks}
    by_needle = {v.variant: v for v in needle}
    sides = {name: _model_side(c, thresholds) for name, c in by_check.items()}
    out: list[VariantVerdict] = []
    for v in variants[1:]:
        c = by_check.get(v.name)
        nv = by_needle.get(v.name)
        if c is None:
            if nv is not None:
                out.append(nv)
            continue
        s, fails = sides[v.name]
        ci = fmt_interval(c.agreement_low or 0.0, c.agreement_high or 1.0)
        figures = (f"top-1 agreement {c.agreement:.1%} (95% CI {ci}), mean KL {c.kl_mean:.3g}, "
                   f"p99 KL {c.kl_p99 or 0.0:.3g}"
                   + (f", perplexity {c.ppl_delta:+.1%}" if c.ppl_delta is not None else "")
                   + f" over {c.tokens} tokens")
        common = dict(variant=v.name, min_recovery=nv.min_recovery if nv else None,
                      worst_context_tokens=nv.worst_context_tokens if nv else None, recovery_low=c.agreement_low,
                      recovery_high=c.agreement_high, basis="model", needle_verdict=nv.verdict if nv else None)
        if s == "above":
            out.append(VariantVerdict(**common, verdict="pass", reason=f"{figures}: all within the policy's model "
                                      "thresholds"))
        elif s == "undecided":
            need = trials_to_decide(c.agreement, thresholds.min_top1_agreement)
            out.append(VariantVerdict(
                **common, verdict="undecided", trials_to_decide=need,
                reason=f"{figures}: the agreement interval straddles {thresholds.min_top1_agreement:.0%}; "
                       + (f"about {need:,} tokens would decide it (--tokens {need})" if need else
                          "it sits on the threshold")))
        else:
            twin = next((t for t in variants if t.kind == "fp8" and t.kv_cache_dtype == v.kv_cache_dtype
                         and t.two_level == v.two_level and t.scale_source == "checkpoint_per_head"), None)
            if v.kind == "fp8" and v.scale_source == "uncalibrated" and twin is not None \
                    and sides.get(twin.name, ("", []))[0] == "above":
                out.append(VariantVerdict(**common, verdict="calibrate",
                                          reason=f"{figures}; {'; '.join(fails)}; per-head scales pass: calibrate "
                                                 "(llm-compressor, per-attention-head scales)"))
            else:
                out.append(VariantVerdict(**common, verdict="keep_bf16",
                                          reason=f"{figures}; {'; '.join(fails)}: keep BF16 (or a format that "
                                                 "passes)"))
    return out
