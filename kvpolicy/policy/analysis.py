"""Static reasoning about conditions, for lint: can a condition hold, does one imply another.

Conditions are reduced to a conjunction of comparisons (`all:` flattened); `any:`,
`not:`, `glob` and operands that depend on other facts stay opaque and are only
compared for equality. For each fact the comparisons narrow a `Region` of values
it can take (a set for yes/no and enumerated facts, bounds for numbers). The
analysis is conservative: "unsatisfiable" and "implies" are only reported when
they are certain, so lint findings are never guesses.
"""

from __future__ import annotations

import functools
import math
import typing
from dataclasses import dataclass, field, replace
from typing import Any

from kvpolicy.inputs.policy_schema import (
    AllOf,
    AnyOf,
    Compare,
    Condition,
    Policy,
    ThresholdRef,
)

BOOL_FACTS = {"model.is_hybrid", "model.has_attention_sinks", "gpu.fp8_compute", "memory.weights_fit",
              "memory.fits_bf16", "memory.fits_fp8", "memory.fits_turboquant_4bit_nc",
              "model.sparse_mla", "model.has_kv_scales", "memory.fits_nvfp4", "memory.fits_int4_per_token_head",
              "memory.fits_fp8_ds_mla", "memory.fits_nvfp4_ds_mla"}
TEXT_FACTS = {"model.id", "model.family", "decision.skip_layers", "decision.attention_backend",
              "kernels.turboquant_4bit_nc", "model.head_sizes", "decision.vllm_backend",
              "accuracy.fp8_model_figures"}
MODEL_CHECK_FACTS = ("accuracy.fp8_model_check", "accuracy.fp8_per_head_model_check",
                     "accuracy.turboquant_4bit_nc_model_check")
"""Verdicts of recorded model-level figures: pass, below or undecided (absent when none is recorded)."""
ALWAYS_SET = BOOL_FACTS | {"model.attention", "gpu.generation", "gpu.vendor", "gpu.id", "workload.priority",
                           "model.id", "model.family", "workload.context_tokens", "workload.concurrency",
                           "workload.tp", "kernels.turboquant_4bit_nc"}


@functools.cache
def domains() -> dict[str, frozenset[Any]]:
    """The closed set of values of each enumerated fact (from the catalogs and the decision types)."""
    from kvpolicy.facts.estimates import ModelVerdict
    from kvpolicy.formats import FORMATS
    from kvpolicy.inputs.arch import AttentionKind
    from kvpolicy.inputs.catalog import load_gpus
    from kvpolicy.inputs.policy_schema import ScaleSource, TwoLevel
    from kvpolicy.inputs.workload import Priority

    gpus = load_gpus().values()
    out = {
        "model.attention": frozenset(typing.get_args(AttentionKind)),
        "gpu.generation": frozenset(g.generation for g in gpus),
        "gpu.vendor": frozenset(g.vendor for g in gpus),
        "gpu.id": frozenset(g.id for g in gpus),
        "workload.priority": frozenset(typing.get_args(Priority)),
        "decision.kv_cache_dtype": frozenset(FORMATS),
        "decision.kv_format": frozenset(f.kind for f in FORMATS.values()),
        "decision.two_level_accumulation": frozenset(typing.get_args(TwoLevel)),
        "decision.scale_source": frozenset(typing.get_args(ScaleSource)),
    }
    out.update({f: frozenset({True, False}) for f in BOOL_FACTS})
    out.update({f: frozenset(typing.get_args(ModelVerdict)) for f in MODEL_CHECK_FACTS})
    return out


def fact_kind(path: str) -> str:
    """bool, enum, text or number."""
    if path in BOOL_FACTS:
        return "bool"
    if path in domains():
        return "enum"
    return "text" if path in TEXT_FACTS else "number"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Region:
    """The values one fact can take under a conjunction of comparisons."""

    fact: str
    allowed: frozenset[Any] | None = None
    excluded: frozenset[Any] = frozenset()
    lo: float = -math.inf
    lo_open: bool = False
    hi: float = math.inf
    hi_open: bool = False
    none: bool | None = None
    """True: must be absent; False: must be set; None: either."""

    @classmethod
    def start(cls, fact: str) -> Region:
        """No constraint yet, except the fact's own domain."""
        return cls(fact, allowed=domains().get(fact), none=False if fact in ALWAYS_SET else None)

    def values(self) -> list[Any] | None:
        """The surviving values when the region is a finite set, else None."""
        if self.allowed is None:
            return None
        kind = fact_kind(self.fact)
        out = []
        for v in self.allowed:
            if v in self.excluded or v is None:
                continue
            if kind == "number" and not _is_number(v):
                continue
            if kind == "text" and not isinstance(v, str):
                continue
            if _is_number(v) and not self._in_bounds(v):
                continue
            if not _is_number(v) and self._bounded():
                continue
            out.append(v)
        return out

    def _bounded(self) -> bool:
        return self.lo != -math.inf or self.hi != math.inf

    def _in_bounds(self, v: float) -> bool:
        above = v > self.lo or (v == self.lo and not self.lo_open)
        below = v < self.hi or (v == self.hi and not self.hi_open)
        return above and below

    def is_empty(self) -> bool:
        """True when no value satisfies every comparison."""
        if self.none is True:
            return self.allowed is not None and None not in self.allowed or self._bounded()
        vals = self.values()
        if vals is not None:
            return not vals and not (self.none is None and self.allowed is not None and None in self.allowed)
        if self._bounded():
            if fact_kind(self.fact) != "number":
                return True
            return self.lo > self.hi or (self.lo == self.hi and (self.lo_open or self.hi_open))
        return False


def narrow(region: Region, leaf: Compare, value: Any) -> Region:
    """The region after one comparison with a literal `value`."""
    op = leaf.op
    if op == "eq":
        return replace(region, allowed=_meet(region.allowed, {value}), none=None if value is None else False)
    if op == "ne":
        return replace(region, excluded=region.excluded | {value}, none=False if value is None else region.none)
    if op == "in":
        vals = set(value or [])
        return replace(region, allowed=_meet(region.allowed, vals), none=None if None in vals else False)
    if op == "not_in":
        return replace(region, excluded=region.excluded | set(value or []))
    if op == "exists":
        return replace(region, none=value is False)
    if op in ("lt", "le", "gt", "ge") and _is_number(value):
        r = replace(region, none=False)
        if op in ("lt", "le"):
            if value < r.hi or (value == r.hi and op == "lt"):
                r = replace(r, hi=value, hi_open=op == "lt")
        elif value > r.lo or (value == r.lo and op == "gt"):
            r = replace(r, lo=value, lo_open=op == "gt")
        return r
    return replace(region, none=False)


def _meet(a: frozenset[Any] | None, b: set[Any]) -> frozenset[Any]:
    return frozenset(b) if a is None else frozenset(x for x in a if x in b)


@dataclass
class Conjunction:
    """A condition as comparisons that must all hold, plus parts too complex to analyse."""

    leaves: list[tuple[Compare, Any]] = field(default_factory=list)
    """(comparison, literal value) pairs."""
    opaque: list[Condition] = field(default_factory=list)
    """Sub-conditions compared only for equality."""

    def regions(self) -> dict[str, Region]:
        """The region of every fact the leaves test."""
        out: dict[str, Region] = {}
        for leaf, value in self.leaves:
            out[leaf.fact] = narrow(out.get(leaf.fact) or Region.start(leaf.fact), leaf, value)
        return out


def conjunction(cond: Condition | None, policy: Policy) -> Conjunction:
    """Flatten `all:` and resolve unkeyed thresholds; everything else becomes opaque."""
    out = Conjunction()

    def walk(c: Condition | None) -> None:
        if c is None:
            return
        if isinstance(c, AllOf):
            for sub in c.all:
                walk(sub)
        elif isinstance(c, AnyOf) and len(c.any) == 1:
            walk(c.any[0])
        elif isinstance(c, Compare) and c.op != "glob":
            value = c.value
            if isinstance(value, ThresholdRef):
                t = policy.thresholds.get(value.threshold)
                if t is None or t.by is not None or t.value is None:
                    out.opaque.append(c)
                    return
                value = t.value
            elif isinstance(value, dict) or hasattr(value, "fact"):
                out.opaque.append(c)
                return
            out.leaves.append((c, value))
        else:
            out.opaque.append(c)

    walk(cond)
    return out


def unsatisfiable(conj: Conjunction) -> Region | None:
    """A fact whose comparisons contradict each other (or its domain), or None when none is found."""
    for region in conj.regions().values():
        if region.is_empty():
            return region
    return None


def _dump(c: Any) -> Any:
    return c.model_dump(mode="json", by_alias=True)


def implies(b: Conjunction, a: Conjunction) -> bool:
    """True when `b` holding guarantees `a` holds (certain; False means "not shown")."""
    opaque_b = [_dump(c) for c in b.opaque]
    if any(_dump(c) not in opaque_b for c in a.opaque):
        return False
    leaves_b = [(_dump(c), v) for c, v in b.leaves]
    regions = b.regions()
    for leaf, value in a.leaves:
        if (_dump(leaf), value) in leaves_b:
            continue
        region = regions.get(leaf.fact) or Region.start(leaf.fact)
        if not _region_implies(region, leaf, value):
            return False
    return True


def _region_implies(r: Region, leaf: Compare, value: Any) -> bool:
    op = leaf.op
    if op == "exists":
        return r.none is (value is False)
    vals = r.values()
    if op in ("ne", "not_in"):
        bad = {value} if op == "ne" else set(value or [])
        if None in bad and r.none is not False:
            return False
        if vals is not None:
            return not (set(vals) & bad)
        return bad <= (r.excluded | {None})
    if r.none is not False:
        return False
    if op in ("eq", "in"):
        good = {value} if op == "eq" else set(value or [])
        return vals is not None and set(vals) <= good
    if not _is_number(value):
        return False
    if vals is not None:
        return all(_is_number(v) and _holds(op, v, value) for v in vals)
    if op in ("lt", "le"):
        return r.hi < value or (r.hi == value and (op == "le" or r.hi_open))
    return r.lo > value or (r.lo == value and (op == "ge" or r.lo_open))


def _holds(op: str, left: float, right: float) -> bool:
    return {"lt": left < right, "le": left <= right, "gt": left > right, "ge": left >= right}[op]
