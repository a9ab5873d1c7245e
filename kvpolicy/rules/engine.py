"""The rules engine: facts + policy -> decision + trace.

Precedence, in one sentence: fields are decided in a fixed order (dtype, skip
layers, two-level accumulation, scale source, backend); for each field the first
enabled rule, in file order, whose condition holds and which sets that field
decides it, unless a constraint forbids the value; then pins for that field
override it; later fields see the decided values as `decision.*` facts.
"""

from __future__ import annotations

import fnmatch
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpolicy import noun
from kvpolicy.errors import PolicyError
from kvpolicy.facts import backends
from kvpolicy.formats import FORMATS
from kvpolicy.inputs.policy_schema import (
    DECISION_FIELDS,
    AllOf,
    AnyOf,
    Compare,
    Condition,
    FactRef,
    Policy,
    Rule,
    ThresholdRef,
    resolve_threshold,
)
from kvpolicy.rules.decision import Decision

_SYMBOL = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "in": "in",
           "not_in": "not in", "glob": "matches", "exists": "exists"}
_PLACEHOLDER = re.compile(r"\{([a-z_]+(?:\.[a-z0-9_]+)+)(?:\|([^{}|]+)(?:\|([^{}|]+))?)?\}")
"""`{fact.path}`, or `{fact.path|noun}` / `{fact.path|noun|plural}`: the value and the noun, singular for 1."""


@dataclass
class Outcome:
    """Engine result: the decision, the trace, and what the deciding rules say."""

    decision: Decision
    trace: dict[str, Any]
    """Plain data in the shape of `Trace` (validate with Trace.model_validate when needed)."""
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


Check = Callable[[dict[str, Any]], tuple[bool, str]]


def _ordered(fn: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    def cmp(left: Any, right: Any) -> bool:
        if left is None or right is None:
            return False
        try:
            return fn(left, right)
        except TypeError:
            return False

    return cmp


def _as_list(right: Any) -> list[Any]:
    # `{fact: path}` operands may resolve to a scalar or None at run time.
    if right is None:
        return []
    return list(right) if isinstance(right, (list, tuple, set)) else [right]


def _glob(left: Any, right: Any) -> bool:
    pats = right if isinstance(right, list) else [right]
    return left is not None and any(fnmatch.fnmatchcase(str(left), str(p)) for p in pats)


_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": _ordered(operator.lt),
    "le": _ordered(operator.le),
    "gt": _ordered(operator.gt),
    "ge": _ordered(operator.ge),
    "in": lambda left, right: left in _as_list(right),
    "not_in": lambda left, right: left not in _as_list(right),
    "glob": _glob,
    "exists": lambda left, right: (left is not None) == (right is not False),
}


def compile_condition(cond: Condition | None, policy: Policy) -> Check:
    """Turn a condition into a function of the facts returning (holds, human-readable reason).

    Conditions are data; this only wires the closed set of operators together.
    """
    if cond is None:
        return lambda facts: (True, "always")
    if isinstance(cond, Compare):
        fact, op, sym, cmp = cond.fact, cond.op, _SYMBOL[cond.op], _OPS[cond.op]
        value = cond.value
        if op == "exists":
            def check_exists(facts: dict[str, Any]) -> tuple[bool, str]:
                left = facts.get(fact)
                return cmp(left, value), f"{fact} {'is set' if left is not None else 'is absent'}"
            return check_exists
        if isinstance(value, ThresholdRef):
            name = value.threshold
            label = f"threshold {name}"
            resolve: Callable[[dict[str, Any]], Any] = lambda facts: resolve_threshold(policy, name, facts)
        elif isinstance(value, FactRef):
            other = label = value.fact
            resolve = lambda facts: facts.get(other)
        else:
            const, head, tail = value, f"{fact} (", f") {sym} {value!r}"

            def check_const(facts: dict[str, Any]) -> tuple[bool, str]:
                # The common case: the constant's text is built once, not on every evaluation.
                left = facts.get(fact)
                ok = cmp(left, const)
                return ok, head + repr(left) + (tail if ok else tail + " is false")
            return check_const

        def check(facts: dict[str, Any]) -> tuple[bool, str]:
            left, right = facts.get(fact), resolve(facts)
            ok = cmp(left, right)
            return ok, f"{fact} ({left!r}) {sym} {label} ({right!r})" + ("" if ok else " is false")
        return check
    if isinstance(cond, AllOf):
        subs = [compile_condition(c, policy) for c in cond.all]

        def check_all(facts: dict[str, Any]) -> tuple[bool, str]:
            reasons = []
            for sub in subs:
                ok, why = sub(facts)
                if not ok:
                    return False, why
                reasons.append(why)
            return True, " and ".join(reasons)
        return check_all
    if isinstance(cond, AnyOf):
        subs = [compile_condition(c, policy) for c in cond.any]

        def check_any(facts: dict[str, Any]) -> tuple[bool, str]:
            reasons = []
            for sub in subs:
                ok, why = sub(facts)
                if ok:
                    return True, why
                reasons.append(why)
            return False, "none of: " + "; ".join(reasons)
        return check_any
    inner = compile_condition(cond.not_, policy)

    def check_not(facts: dict[str, Any]) -> tuple[bool, str]:
        ok, why = inner(facts)
        return (not ok), f"not ({why})"
    return check_not


def evaluate(cond: Condition | None, facts: dict[str, Any], policy: Policy) -> tuple[bool, str]:
    """Evaluate a condition once; returns (holds, human-readable reason)."""
    return compile_condition(cond, policy)(facts)


def _forbidden(policy: Policy, field_name: str, value: Any) -> str | None:
    if not policy.constraints.forbid:
        return None
    for pattern in policy.constraints.forbid.get(field_name, []):
        values = value if isinstance(value, list) else [value]
        if any(fnmatch.fnmatchcase(str(v), pattern) for v in values):
            return pattern
    return None


def _shape(facts: dict[str, Any]) -> backends.AttentionShape | None:
    """The model's attention as the backends see it; None for raw test facts without a model."""
    if facts.get("model.attention") is None or (facts.get("model.head_sizes") is None
                                                and facts.get("model.head_dim") is None):
        return None
    return backends.AttentionShape.from_facts(facts)


def _unservable(field_name: str, value: Any, facts: dict[str, Any]) -> str | None:
    """Why vLLM 0.33 would refuse a rule's value for this model and GPU (the support matrix), else None."""
    shape = _shape(facts)
    if shape is None or facts.get("gpu.vendor", "nvidia") != "nvidia":
        return None
    sm = facts.get("gpu.sm")
    if field_name == "kv_cache_dtype":
        return backends.dtype_refusal(str(value), sm, shape)
    if field_name == "attention_backend" and value is not None:
        dtype = facts.get("decision.kv_cache_dtype") or "auto"
        if backends.dtype_refusal(dtype, sm, shape):
            return None  # the dtype itself is the problem (a pin); the compatibility check reports it
        why = backends.refusals(str(value), dtype, sm, shape,
                                per_head_scales=facts.get("decision.scale_source") == "checkpoint_per_head"
                                and facts.get("decision.kv_format") == "fp8")
        return "; ".join(why) or None
    return None


def _decision_fact(field_name: str, value: Any, facts: dict[str, Any]) -> dict[str, Any]:
    if field_name == "kv_cache_dtype":
        # `auto` stores what the checkpoint's quantization config makes it (e.g. fp8 with its scales).
        stored = (facts.get("model.checkpoint_kv_dtype") if value == "auto" else None) or value
        fmt = FORMATS.get(stored) or FORMATS.get(value)
        shape = _shape(facts)
        auto = backends.auto_backend(stored, facts.get("gpu.sm"), shape) if shape and fmt else None
        return {"decision.kv_cache_dtype": value, "decision.kv_format": fmt.kind if fmt else None,
                "decision.vllm_backend": auto}
    if field_name == "skip_layers":
        return {"decision.skip_layers": ",".join(value)}
    return {f"decision.{field_name}": value}


def placeholder_paths(template: str) -> list[str]:
    """The fact paths a `warn`/`advise` template names (`fill` renders an unknown one as "None")."""
    return [m.group(1) for m in _PLACEHOLDER.finditer(template)]


def fill(template: str, facts: dict[str, Any]) -> str:
    """Replace `{fact.path}` placeholders with fact values (nothing else is interpreted).

    `{fact.path|request}` gives "1 request" / "3 requests"; `{fact.path|query|queries}` names the plural.
    """
    def sub(m: re.Match[str]) -> str:
        v = facts.get(m.group(1))
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        text = f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) and v >= 10000 else str(v)
        if m.group(2) is None:
            return text
        return f"{text} {noun(v, m.group(2), m.group(3))}"

    return _PLACEHOLDER.sub(sub, template)


@dataclass
class _Compiled:
    """Per-policy data that decide() would otherwise recompute on every call."""

    rules: list[Rule]
    by_field: dict[str, list[tuple[Rule, Any]]]
    checks: dict[str, Check]
    pins: list[tuple[Any, dict[str, Any], Check]]
    defaults: dict[str, Any]


def _compile(policy: Policy) -> _Compiled:
    hit = policy.derived.get(__name__)
    if hit is not None:
        return hit
    rules = [r for r in policy.rules if r.enabled and r.status != "deprecated"]
    defaults = {name: f.get_default(call_default_factory=True) for name, f in Decision.model_fields.items()}
    defaults.update(policy.defaults.fields())
    compiled = _Compiled(
        rules=rules,
        by_field={f: [(r, r.then.fields()[f]) for r in rules if f in r.then.fields()] for f in DECISION_FIELDS},
        checks={r.id: compile_condition(r.when, policy) for r in rules},
        pins=[(p, p.set.fields(), compile_condition(p.when, policy)) for p in policy.pins],
        defaults=defaults,
    )
    policy.derived[__name__] = compiled
    return compiled


def _outcome(rule: Rule, ok: bool, why: str) -> dict[str, Any]:
    # Plain dicts: decide() runs in hot loops; recommend() validates them into a Trace once.
    return {"id": rule.id, "name": rule.name, "matched": ok, "reason": why, "decided": [],
            "overridden": [], "evidence": rule.evidence}


def _checkpoint_scales(winner: tuple[Any, str], facts: dict[str, Any], outcomes: dict[str, dict[str, Any]],
                       deciders: dict[str, Rule], losers: list[str]) -> tuple[Any, str]:
    """An FP8 cache of a checkpoint that declares KV scales uses them, whatever a rule or pin wanted
    (vLLM loads k_scale/v_scale through the quant config's KV-cache method): the checkpoint decides."""
    scales = facts.get("model.checkpoint_kv_scales")
    if not scales or facts.get("decision.kv_format") != "fp8":
        return winner
    value = f"checkpoint_{scales}"
    if winner[1] != "default" and winner[0] != value:
        losers.append(winner[1])
    beaten = outcomes.get(winner[1])
    if beaten is not None and "scale_source" in beaten["decided"]:
        # Its warnings (calibrate!) and evidence no longer describe the decision.
        beaten["decided"].remove("scale_source")
        beaten["overridden"].append("scale_source")
        if not beaten["decided"]:
            deciders.pop(winner[1], None)
    return value, "checkpoint"


def decide(policy: Policy, facts: dict[str, Any]) -> Outcome:
    """Run the rules over the facts."""
    facts = dict(facts)
    c = _compile(policy)
    outcomes: dict[str, dict[str, Any]] = {}
    chosen: dict[str, Any] = {}
    fields: dict[str, dict[str, Any]] = {}
    deciders: dict[str, Rule] = {}

    for field_name in DECISION_FIELDS:
        winner: tuple[Any, str] | None = None
        losers: list[str] = []
        for rule, value in c.by_field[field_name]:
            out = outcomes.get(rule.id)
            if out is None:
                out = outcomes[rule.id] = _outcome(rule, *c.checks[rule.id](facts))
            if not out["matched"]:
                continue
            pattern = _forbidden(policy, field_name, value)
            if pattern is not None:
                out["reason"] += f"; {field_name}={value} is forbidden by constraint `{pattern}`"
                continue
            refused = _unservable(field_name, value, facts) if winner is None else None
            if refused is not None:
                out["reason"] += f"; {field_name}={value} is not served by vLLM 0.33 here: {refused}"
                continue
            if winner is None:
                winner = (value, rule.id)
                out["decided"].append(field_name)
                deciders.setdefault(rule.id, rule)
            else:
                out["overridden"].append(field_name)
                if value != winner[0]:
                    losers.append(rule.id)
        if winner is None:
            winner = (c.defaults[field_name], "default")
        for pin, pinned, holds in c.pins:
            if field_name in pinned and holds(facts)[0]:
                pattern = _forbidden(policy, field_name, pinned[field_name])
                if pattern is not None:
                    raise PolicyError(f"pin `{pin.name}` sets {field_name}={pinned[field_name]}, which constraint "
                                      f"`{pattern}` forbids. Change the pin or the constraint.")
                if winner[1] != "default":
                    losers.append(winner[1])
                beaten = outcomes.get(winner[1])
                if beaten is not None and field_name in beaten["decided"]:
                    # The pin decides: the rule's warnings and evidence no longer describe the decision.
                    beaten["decided"].remove(field_name)
                    beaten["overridden"].append(field_name)
                    if not beaten["decided"]:
                        deciders.pop(winner[1], None)
                winner = (pinned[field_name], f"pin:{pin.name}")
        if field_name == "scale_source":
            winner = _checkpoint_scales(winner, facts, outcomes, deciders, losers)
        if winner[1] == "default":
            pattern = _forbidden(policy, field_name, winner[0])
            if pattern is not None:
                raise PolicyError(f"no enabled rule chose an allowed {field_name} for these inputs, and the default "
                                  f"{winner[0]!r} is forbidden by constraint `{pattern}`. Add a rule that covers "
                                  f"them, change `defaults.{field_name}`, or relax the constraint.")
        chosen[field_name] = winner[0]
        fields[field_name] = {"value": winner[0], "decided_by": winner[1], "losers": losers}
        facts.update(_decision_fact(field_name, winner[0], facts))

    # Advice rules (no fields) see the whole decision; they are evaluated last.
    advice: list[str] = []
    for rule in c.rules:
        if rule.id not in outcomes:
            out = outcomes[rule.id] = _outcome(rule, *c.checks[rule.id](facts))
            if out["matched"]:
                advice.extend(fill(a, facts) for a in rule.advise)
                deciders.setdefault(rule.id, rule)
    ordered = [outcomes[r.id] for r in c.rules]
    warnings = [fill(w, facts) for r in deciders.values() for w in r.warn]
    evidence_ids = list(dict.fromkeys(e for r in deciders.values() for e in r.evidence))
    decision = Decision(**chosen)
    return Outcome(decision=decision, trace={"rules": ordered, "fields": fields, "facts": facts},
                   warnings=warnings, alternatives=advice, evidence_ids=evidence_ids)
