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

from collections.abc import Callable
from dataclasses import replace

import torch
from pydantic import Field

from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.rules.decision import Decision
from kvpolicy.runtime.needle import (
    MARGIN_NATS,
    NEEDLE_LIFT,
    geometry_plan,
    make_case,
    plan_for,
    score,
)
from kvpolicy.runtime.results import Environment, _Model, environment
from kvpolicy.runtime.variants import Variant

Verdict = str
"""`pass`, `calibrate`, `keep_bf16` or `not_applicable`."""


class NeedlePoint(_Model):
    """One format at one context."""

    variant: str
    """Variant name."""
    context_tokens: int
    """Tokens in each sequence."""
    hits: int
    """Trials where the needle's recovered weight exceeds 1/2."""
    trials: int
    """Trials (sequences x query heads)."""
    recovery: float | None = None
    """hits / BF16's hits at this context."""
    p_abs_error: float
    """Mean |recovered needle weight - exact|."""
    out_rel_error: float
    """Relative error of the attention output vs the float64 answer."""


class VariantVerdict(_Model):
    """What the documents' rule says about one candidate."""

    variant: str
    """Variant name."""
    min_recovery: float | None
    """Lowest recovery over the contexts."""
    worst_context_tokens: int | None
    """Where it was lowest."""
    verdict: Verdict
    """pass / calibrate / keep_bf16 / not_applicable."""
    reason: str
    """The rule in words, with the numbers."""


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
    geometry: dict[str, int | str] = Field(default_factory=dict)
    """Layer tested: index, kind, query heads, KV heads, head dim."""
    method: str = ""
    """The needle test in one sentence."""
    contexts: list[int] = Field(default_factory=list)
    """Contexts measured."""
    batch: int = 1
    """Sequences per context."""
    points: list[NeedlePoint] = Field(default_factory=list)
    """Per variant and context."""
    verdicts: list[VariantVerdict] = Field(default_factory=list)
    """Per candidate variant."""
    model_check: list[ModelCheck] = Field(default_factory=list)
    """Model-level check, when it ran."""
    model_check_note: str = ""
    """Why the model-level check did or did not run."""
    warnings: list[str] = Field(default_factory=list)
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


def run_verify(arch: ModelArch, gpu: GpuSpec, decision: Decision, variants: list[Variant], contexts: list[int],
               batch: int, device: torch.device, backend: str, accuracy_floor: float = 0.95,
               policy_label: str = "", on_point: Callable[[str], None] | None = None,
               seed: int = 0) -> VerifyResult:
    """Needle test of every variant at every context (BF16 first), then the verdicts."""
    base = geometry_plan(arch)
    dtype = torch.bfloat16 if backend == "triton" else torch.float32
    result = VerifyResult(
        model=arch.id, gpu=gpu.id, environment=environment(device, backend), policy=policy_label,
        decision=decision, accuracy_floor=accuracy_floor, contexts=sorted(set(contexts)), batch=batch,
        geometry={"layer": base.index, "kind": base.kind, "num_q_heads": base.num_q_heads,
                  "num_kv_heads": base.num_kv_heads, "head_dim": base.head_dim},
        method=(f"one needle per sequence and KV head, margin U{MARGIN_NATS} nats over the log-sum-exp of "
                f"the distractors (keys with outlier channels), value lifted by {NEEDLE_LIFT:g} in one channel; "
                "hit when the needle's weight read back from the output exceeds 1/2; recovery = hits / BF16 hits"),
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
    for context in result.contexts:
        case = make_case(base, batch, context, device, dtype, seed=seed + context)
        bf16_hits = None
        for v in variants:
            plan = plans[v.name]
            if plan is None:
                continue
            s = score(plan, v, case, device, backend)
            if v.kind == "bf16":
                bf16_hits = s.hits
            recovery = None if bf16_hits is None else (s.hits / bf16_hits if bf16_hits else 0.0)
            result.points.append(NeedlePoint(variant=v.name, context_tokens=context, hits=s.hits, trials=s.trials,
                                             recovery=None if recovery is None else round(recovery, 4),
                                             p_abs_error=round(s.p_abs_error, 5),
                                             out_rel_error=round(s.out_rel_error, 6)))
            if on_point:
                on_point(f"{v.name} {context} tokens: {s.hits}/{s.trials} hits")
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result.verdicts = verdicts(result, variants, plans)
    return result


def verdicts(result: VerifyResult, variants: list[Variant], plans: dict) -> list[VariantVerdict]:
    """The documents' rule per candidate: pass at the floor, else calibrate (FP8) or keep BF16."""
    floor = result.accuracy_floor
    out: list[VariantVerdict] = []
    by_name = {v.name: v for v in variants}
    mins: dict[str, tuple[float, int]] = {}
    for v in variants[1:]:
        pts = [p for p in result.points if p.variant == v.name and p.recovery is not None]
        if pts:
            worst = min(pts, key=lambda p: (p.recovery, -p.context_tokens))
            mins[v.name] = (worst.recovery or 0.0, worst.context_tokens)
    for v in variants[1:]:
        if plans.get(v.name) is None or v.name not in mins:
            out.append(VariantVerdict(variant=v.name, min_recovery=None, worst_context_tokens=None,
                                      verdict="not_applicable", reason="the format does not apply to this layer"))
            continue
        rec, ctx = mins[v.name]
        if rec >= floor:
            out.append(VariantVerdict(variant=v.name, min_recovery=rec, worst_context_tokens=ctx, verdict="pass",
                                      reason=f"lowest recovery {rec:.1%} (at {ctx:,} tokens) >= floor {floor:.0%}"))
            continue
        twin = next((t for t in by_name.values() if t.kind == "fp8" and t.kv_cache_dtype == v.kv_cache_dtype
                     and t.two_level == v.two_level and t.scale_source == "checkpoint_per_head"), None)
        if v.kind == "fp8" and v.scale_source == "uncalibrated" and twin is not None and twin.name in mins \
                and mins[twin.name][0] >= floor:
            out.append(VariantVerdict(
                variant=v.name, min_recovery=rec, worst_context_tokens=ctx, verdict="calibrate",
                reason=f"uncalibrated recovery {rec:.1%} at {ctx:,} tokens < floor {floor:.0%}; per-head scales "
                       f"recover {mins[twin.name][0]:.1%}: calibrate (llm-compressor, per-attention-head scales)"))
        else:
            out.append(VariantVerdict(
                variant=v.name, min_recovery=rec, worst_context_tokens=ctx, verdict="keep_bf16",
                reason=f"recovery {rec:.1%} at {ctx:,} tokens < floor {floor:.0%}"
                       + ("; calibrated scales do not reach it either" if v.kind == "fp8" else "")
                       + ": keep BF16 (or a format that passes)"))
    return out
