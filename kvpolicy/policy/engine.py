"""The rules engine: facts + policy -> decision + trace.

Precedence, in one sentence: fields are decided in a fixed order (dtype, skip
layers, two-level accumulation, scale source, backend); for each field the first
enabled rule, in file order, whose condition holds and which sets that field
decides it, unless a constraint forbids the value; then pins for that field
override it; later fields see the decided values as `decision.*` facts.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any

from kvpolicy.decision import DECISION_FIELDS, Decision, FieldTrace, RuleOutcome, Trace
from kvpolicy.errors import PolicyError, did_you_mean
from kvpolicy.facts import FACTS
from kvpolicy.formats import FORMATS
from kvpolicy.policy.schema import (
    AllOf,
    AnyOf,
    Compare,
    Condition,
    FactRef,
    Not,
    Policy,
    Rule,
    ThresholdRef,
    resolve_threshold,
)

_SYMBOL = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "in": "in",
           "not_in": "not in", "glob": "matches", "exists": "exists"}
_PLACEHOLDER = re.compile(r"\{([a-z_]+(?:\.[a-z0-9_]+)+)\}")


@dataclass
class Outcome:
    """Engine result: the decision, the trace, and what the deciding rules say."""

    decision: Decision
    trace: Trace
    warnings: list[str] = field(default_factory=list)
    alternatives: list[str] = field(default_factory=list)
    evidence_ids: list[str] = field(default_factory=list)


def fact_paths(cond: Condition | None) -> list[str]:
    """Every fact path a condition reads (for lint and validation)."""
    if cond is None:
        return []
    if isinstance(cond, Compare):
        refs = [cond.fact]
        if isinstance(cond.value, FactRef):
            refs.append(cond.value.fact)
        return refs
    if isinstance(cond, AllOf):
        return [p for c in cond.all for p in fact_paths(c)]
    if isinstance(cond, AnyOf):
        return [p for c in cond.any for p in fact_paths(c)]
    return fact_paths(cond.not_)


def threshold_refs(cond: Condition | None) -> list[str]:
    """Every threshold name a condition reads."""
    if cond is None:
        return []
    if isinstance(cond, Compare):
        return [cond.value.threshold] if isinstance(cond.value, ThresholdRef) else []
    if isinstance(cond, AllOf):
        return [t for c in cond.all for t in threshold_refs(c)]
    if isinstance(cond, AnyOf):
        return [t for c in cond.any for t in threshold_refs(c)]
    return threshold_refs(cond.not_)


def check_references(policy: Policy) -> None:
    """Raise PolicyError for unknown facts, thresholds or dtypes a policy names."""
    problems = []
    conds = [(f"rule {r.id}", r.when) for r in policy.rules] + [(f"pin {p.name}", p.when) for p in policy.pins]
    for where, cond in conds:
        for path in fact_paths(cond):
            if path not in FACTS:
                problems.append(f"{where}: unknown fact `{path}`.{did_you_mean(path, FACTS)}")
        for name in threshold_refs(cond):
            if name not in policy.thresholds:
                problems.append(f"{where}: unknown threshold `{name}`.{did_you_mean(name, policy.thresholds)}")
    patches = [(f"rule {r.id}", r.then) for r in policy.rules] + [(f"pin {p.name}", p.set) for p in policy.pins]
    patches.append(("defaults", policy.defaults))
    for where, patch in patches:
        dtype = patch.kv_cache_dtype
        if dtype is not None and dtype not in FORMATS:
            problems.append(f"{where}: unknown kv_cache_dtype `{dtype}`.{did_you_mean(dtype, FORMATS)}")
    if problems:
        raise PolicyError("\n".join(problems) + "\nRun `kvpolicy facts` for the list of facts.")


def _value(v: Any, facts: dict[str, Any], policy: Policy) -> tuple[Any, str]:
    if isinstance(v, ThresholdRef):
        return resolve_threshold(policy, v.threshold, facts), f"threshold {v.threshold}"
    if isinstance(v, FactRef):
        return facts.get(v.fact), v.fact
    return v, ""


def _compare(op: str, left: Any, right: Any) -> bool:
    if op == "exists":
        return (left is not None) == (right is not False)
    if op == "eq":
        return left == right
    if op == "ne":
        return left != right
    if op == "in":
        return left in (right or [])
    if op == "not_in":
        return left not in (right or [])
    if op == "glob":
        pats = right if isinstance(right, list) else [right]
        return left is not None and any(fnmatch.fnmatchcase(str(left), str(p)) for p in pats)
    if left is None or right is None:
        return False
    try:
        if op == "lt":
            return left < right
        if op == "le":
            return left <= right
        if op == "gt":
            return left > right
        if op == "ge":
            return left >= right
    except TypeError:
        return False
    raise PolicyError(f"unknown operator `{op}`")


def evaluate(cond: Condition | None, facts: dict[str, Any], policy: Policy) -> tuple[bool, str]:
    """Evaluate a condition; returns (holds, human-readable reason)."""
    if cond is None:
        return True, "always"
    if isinstance(cond, Compare):
        left = facts.get(cond.fact)
        right, label = _value(cond.value, facts, policy)
        ok = _compare(cond.op, left, right)
        if cond.op == "exists":
            return ok, f"{cond.fact} {'is set' if left is not None else 'is absent'}"
        rhs = f"{label} ({right!r})" if label else repr(right)
        mark = "" if ok else " is false"
        return ok, f"{cond.fact} ({left!r}) {_SYMBOL[cond.op]} {rhs}{mark}"
    if isinstance(cond, AllOf):
        reasons = []
        for sub in cond.all:
            ok, why = evaluate(sub, facts, policy)
            if not ok:
                return False, why
            reasons.append(why)
        return True, " and ".join(reasons)
    if isinstance(cond, AnyOf):
        reasons = []
        for sub in cond.any:
            ok, why = evaluate(sub, facts, policy)
            if ok:
                return True, why
            reasons.append(why)
        return False, "none of: " + "; ".join(reasons)
    ok, why = evaluate(cond.not_, facts, policy)
    return (not ok), f"not ({why})"


def _forbidden(policy: Policy, field_name: str, value: Any) -> str | None:
    for pattern in policy.constraints.forbid.get(field_name, []):
        values = value if isinstance(value, list) else [value]
        if any(fnmatch.fnmatchcase(str(v), pattern) for v in values):
            return pattern
    return None


def _decision_fact(field_name: str, value: Any) -> dict[str, Any]:
    if field_name == "kv_cache_dtype":
        return {"decision.kv_cache_dtype": value, "decision.kv_format": FORMATS[value].kind}
    if field_name == "skip_layers":
        return {"decision.skip_layers": ",".join(value)}
    return {f"decision.{field_name}": value}


def fill(template: str, facts: dict[str, Any]) -> str:
    """Replace `{fact.path}` placeholders with fact values (nothing else is interpreted)."""
    def sub(m: re.Match[str]) -> str:
        v = facts.get(m.group(1))
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 10000:
            return f"{v:,}"
        return str(v)

    return _PLACEHOLDER.sub(sub, template)


def decide(policy: Policy, facts: dict[str, Any]) -> Outcome:
    """Run the rules over the facts."""
    facts = dict(facts)
    rules = [r for r in policy.rules if r.enabled and r.status != "deprecated"]
    outcomes: dict[str, RuleOutcome] = {}
    matched: dict[str, bool] = {}
    chosen: dict[str, Any] = {}
    fields: dict[str, FieldTrace] = {}
    deciders: list[Rule] = []
    defaults = policy.defaults.fields()

    for field_name in DECISION_FIELDS:
        winner: tuple[Any, str] | None = None
        losers: list[str] = []
        for rule in rules:
            patch = rule.then.fields()
            if field_name not in patch:
                continue
            if rule.id not in outcomes:
                ok, why = evaluate(rule.when, facts, policy)
                matched[rule.id] = ok
                outcomes[rule.id] = RuleOutcome(id=rule.id, name=rule.name, matched=ok, reason=why,
                                                evidence=list(rule.evidence))
            if not matched[rule.id]:
                continue
            out = outcomes[rule.id]
            value = patch[field_name]
            pattern = _forbidden(policy, field_name, value)
            if pattern is not None:
                out.reason += f"; {field_name}={value} is forbidden by constraint `{pattern}`"
                continue
            if winner is None:
                winner = (value, rule.id)
                out.decided.append(field_name)
                if rule not in deciders:
                    deciders.append(rule)
            else:
                out.overridden.append(field_name)
                if value != winner[0]:
                    losers.append(rule.id)
        if winner is None:
            value = defaults.get(field_name, Decision.model_fields[field_name].get_default(call_default_factory=True))
            winner = (value, "default")
        for pin in policy.pins:
            pinned = pin.set.fields()
            if field_name in pinned and evaluate(pin.when, facts, policy)[0]:
                pattern = _forbidden(policy, field_name, pinned[field_name])
                if pattern is not None:
                    raise PolicyError(f"pin `{pin.name}` sets {field_name}={pinned[field_name]}, which constraint "
                                      f"`{pattern}` forbids. Change the pin or the constraint.")
                if winner[1] != "default":
                    losers.append(winner[1])
                winner = (pinned[field_name], f"pin:{pin.name}")
        chosen[field_name] = winner[0]
        fields[field_name] = FieldTrace(value=winner[0], decided_by=winner[1], losers=losers)
        facts.update(_decision_fact(field_name, winner[0]))

    # Advice rules (no fields) see the whole decision; they are evaluated last.
    advice: list[str] = []
    facts["decision.attention_backend"] = chosen["attention_backend"]
    for rule in rules:
        if rule.id not in outcomes:
            ok, why = evaluate(rule.when, facts, policy)
            outcomes[rule.id] = RuleOutcome(id=rule.id, name=rule.name, matched=ok, reason=why,
                                            evidence=list(rule.evidence))
            if ok:
                advice.extend(fill(a, facts) for a in rule.advise)
                deciders.append(rule)
    ordered = [outcomes[r.id] for r in rules]
    warnings = [fill(w, facts) for r in deciders for w in r.warn]
    evidence_ids = list(dict.fromkeys(e for r in deciders for e in r.evidence))
    decision = Decision(**chosen)
    return Outcome(decision=decision, trace=Trace(rules=ordered, fields=fields, facts=facts),
                   warnings=warnings, alternatives=advice, evidence_ids=evidence_ids)
