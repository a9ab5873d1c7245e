"""The lint checks: the registry of codes, and one function per area over a loaded policy.

Every check is data (code, name, severity, summary), like ruff's registry;
`kvpolicy lint --list-checks` prints them. Codes by area: KVL0xx the file cannot
be loaded, KVL1xx rules, KVL2xx thresholds, KVL3xx pins and constraints,
KVL4xx deployments.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import asdict, dataclass
from typing import Any

from kvpolicy.errors import KvPolicyError, did_you_mean
from kvpolicy.inputs.policy_loader import BUILTIN, LoadedPolicy
from kvpolicy.inputs.policy_sources import Sources
from kvpolicy.inputs.policy_schema import DECISION_FIELDS
from kvpolicy.policy.analysis import conjunction, domains, fact_kind, implies, unsatisfiable
from kvpolicy.rules.engine import fact_paths, threshold_refs


@dataclass(frozen=True)
class Check:
    """One lint check: a permanent code, a kebab-case name, a severity and what it finds."""

    code: str
    name: str
    severity: str
    summary: str


CHECKS = [
    Check("KVL001", "invalid-yaml", "error", "The file is not valid YAML."),
    Check("KVL002", "schema-error", "error", "A value has the wrong type or is out of the schema's bounds."),
    Check("KVL003", "unknown-key", "error", "A key the schema does not know (usually a typo)."),
    Check("KVL004", "bad-extends", "error", "`extends:` names a missing file or closes a loop."),
    Check("KVL005", "unknown-reference", "error",
          "A rule, pin or `disable:` names an unknown fact (in a condition or a `warn`/`advise` template), "
          "threshold, dtype or rule."),
    Check("KVL006", "unreadable-file", "error", "The file cannot be read."),
    Check("KVL101", "unreachable-rule", "error", "A rule or pin whose condition can never hold."),
    Check("KVL102", "shadowed-rule", "warning", "Whenever the rule matches, an earlier rule has already decided its field."),
    Check("KVL103", "conflicting-rules", "warning", "Two rules with the same condition set a field to different values."),
    Check("KVL104", "rule-without-evidence", "warning", "A rule that cites no evidence."),
    Check("KVL105", "unknown-evidence", "error", "A rule or threshold cites an evidence id the policy does not define."),
    Check("KVL106", "rule-without-effect", "warning", "A rule that sets no field, warns nothing and advises nothing."),
    Check("KVL107", "forbidden-value", "error", "A rule, pin or default sets a value a constraint forbids."),
    Check("KVL108", "decision-read-too-early", "error",
          "A condition reads `decision.X` before X is decided (it always sees no value)."),
    Check("KVL109", "unservable-rule", "warning",
          "A rule sets a KV dtype or backend vLLM 0.33 refuses for some model/GPU it matches (the engine skips it there)."),
    Check("KVL201", "threshold-out-of-range", "error", "A threshold's value lies outside its `min`/`max`."),
    Check("KVL202", "unused-threshold", "warning", "A threshold no rule, pin or estimate reads."),
    Check("KVL203", "threshold-bounds-changed", "warning", "An extending file moves an inherited threshold's `min`/`max`."),
    Check("KVL204", "threshold-overruled-by-measurements", "info",
          "`break_even_tokens` is changed, but models with measured ITL lines on those GPUs use their measured "
          "break-even instead."),
    Check("KVL301", "overridden-pin", "warning", "A later pin always replaces this pin's field."),
    Check("KVL302", "constraint-matches-nothing", "warning", "A `forbid` pattern that matches no known value."),
    Check("KVL303", "unservable-pin", "error",
          "A pin produces a dtype/backend/scales combination vLLM 0.33 refuses (check --strict and apply --strict refuse it)."),
    Check("KVL401", "bad-deployment", "error", "A deployment names an unknown model or GPU, or an invalid context."),
    Check("KVL402", "deployment-floor-too-low", "error", "A deployment's accuracy floor is below `min_accuracy_floor`."),
]
BY_CODE = {c.code: c for c in CHECKS}
LOAD_CODES = {"yaml": "KVL001", "schema": "KVL002", "unknown-key": "KVL003", "extends": "KVL004",
              "reference": "KVL005", "io": "KVL006"}
CODE_THRESHOLDS = {"break_even_tokens", "fp8_slope_overhead", "accuracy_floor", "model_min_top1_agreement",
                   "model_max_kl_mean", "model_max_kl_p99", "model_max_ppl_increase"}
"""Thresholds kvpolicy's estimates and defaults read (besides those rules name)."""
DECISION_FACT_FIELD = {"decision.kv_cache_dtype": "kv_cache_dtype", "decision.kv_format": "kv_cache_dtype",
                       "decision.vllm_backend": "kv_cache_dtype",
                       "decision.skip_layers": "skip_layers",
                       "decision.two_level_accumulation": "two_level_accumulation",
                       "decision.scale_source": "scale_source", "decision.attention_backend": "attention_backend"}


@dataclass
class Finding:
    """One lint finding."""

    code: str
    message: str
    file: str
    line: int | None = None
    col: int | None = None
    severity: str = ""

    def __post_init__(self) -> None:
        if not self.severity:
            self.severity = BY_CODE[self.code].severity

    @property
    def name(self) -> str:
        """The check's kebab-case name."""
        return BY_CODE[self.code].name

    def to_json(self) -> dict[str, Any]:
        """Plain data for `--format json`."""
        return {**asdict(self), "name": self.name}


class Linter:
    """What every check reads (the policy, its sources, each rule's conjunction) and where findings go."""

    def __init__(self, loaded: LoadedPolicy) -> None:
        self.loaded = loaded
        self.policy = loaded.policy
        self.src = Sources.of(loaded)
        self.user = {n for n in loaded.chain if not n.startswith(BUILTIN)}
        self.findings: list[Finding] = []
        self.rules = [r for r in self.policy.rules if r.enabled and r.status != "deprecated"]
        self.conj = {r.id: conjunction(r.when, self.policy) for r in self.rules}
        self.pin_conj = [conjunction(p.when, self.policy) for p in self.policy.pins]
        self.unreachable: set[str] = set()

    def emit(self, code: str, message: str, *wheres: tuple[str, int | None, int | None]) -> None:
        """Report at the first location in a user file; drop findings that live only in built-in policies."""
        for where in wheres:
            if where[0] in self.user:
                self.findings.append(Finding(code, message, *where))
                return

    def forbidden(self, field: str, value: Any) -> str | None:
        """The constraint pattern that forbids `field: value`, if any."""
        values = value if isinstance(value, list) else [value]
        for pattern in self.policy.constraints.forbid.get(field, []):
            if any(fnmatch.fnmatchcase(str(v), pattern) for v in values):
                return pattern
        return None


def _fmt(v: Any) -> str:
    return ", ".join(map(str, v)) if isinstance(v, list) else str(v)


def _why_empty(region: Any, conj: Any) -> str:
    dom = domains().get(region.fact)
    if dom is not None:
        asked = [v for leaf, value in conj.leaves if leaf.fact == region.fact and leaf.op in ("eq", "in")
                 for v in (value if isinstance(value, list) else [value]) if v not in dom]
        if asked:
            hint = did_you_mean(str(asked[0]), [str(d) for d in dom]) if isinstance(asked[0], str) else ""
            shown = ", ".join(sorted(map(str, dom)))
            return f"`{region.fact}` is never {asked[0]!r} (its values: {shown}).{hint}"
    if fact_kind(region.fact) != "number" and (region.lo != -math.inf or region.hi != math.inf):
        return f"`{region.fact}` is not a number, so lt/le/gt/ge never hold."
    kind = fact_kind(region.fact)
    for leaf, value in conj.leaves:
        values = value if isinstance(value, list) else [value]
        if leaf.fact != region.fact or leaf.op not in ("eq", "in") or not values:
            continue
        numeric = [isinstance(v, (int, float)) and not isinstance(v, bool) for v in values if v is not None]
        if kind == "number" and not any(numeric):
            return f"`{region.fact}` is a number; it never equals {values[0]!r}."
        if kind == "text" and all(numeric):
            return f"`{region.fact}` is text; it never equals the number {values[0]!r} (quote it)."
    return f"the comparisons on `{region.fact}` contradict each other."


def rules(lt: Linter) -> None:
    """KVL101 unreachable, KVL104/105 evidence, KVL106 no effect, KVL107 forbidden values, KVL108 read too early."""
    evidence = {e.id for e in lt.policy.evidence}
    for r in lt.rules:
        at = lt.src.rule(r.id)
        file_loc = lt.src.item("rules", "id", r.id)
        patch = r.then.fields()
        region = unsatisfiable(lt.conj[r.id])
        if region is not None:
            lt.unreachable.add(r.id)
            lt.emit("KVL101", f"rule {r.id} can never fire: {_why_empty(region, lt.conj[r.id])}",
                    lt.src.rule(r.id, "when"), at)
        if not patch and not r.advise and not r.warn:
            lt.emit("KVL106", f"rule {r.id} sets no field, warns nothing and advises nothing; add `then:`, "
                    "`warn:` or `advise:`, or remove it.", at)
        if not r.evidence:
            lt.emit("KVL104", f"rule {r.id} cites no evidence; add the measurement it stands on under `evidence:` "
                    "(convention: every rule cites its source).", at)
        for i, ev in enumerate(r.evidence):
            if ev not in evidence:
                where = lt.src.at(file_loc[0], file_loc[1] + ("evidence", i)) if file_loc else at
                lt.emit("KVL105", f"rule {r.id} cites unknown evidence `{ev}`.{did_you_mean(ev, evidence)} "
                        "Define it under `evidence:`.", where)
        for field, value in patch.items():
            pattern = lt.forbidden(field, value)
            if pattern is not None:
                lt.emit("KVL107", f"rule {r.id} sets {field}={_fmt(value)}, which constraint `{pattern}` forbids: "
                        "it can never decide that field. Change the rule or the constraint.",
                        lt.src.rule(r.id, "then"), at)
        if patch:
            _read_too_early(lt, f"rule {r.id}", r.when, patch, file_loc, at)


def _read_too_early(lt: Linter, owner: str, cond: Any, patch: dict[str, Any],
                    file_loc: tuple[str, tuple[Any, ...]] | None, at: tuple[str, int | None, int | None]) -> None:
    first = min(DECISION_FIELDS.index(f) for f in patch)
    for path in fact_paths(cond):
        field = DECISION_FACT_FIELD.get(path)
        if field is not None and DECISION_FIELDS.index(field) >= first:
            where = lt.src.find(file_loc[0], file_loc[1], "fact", path) if file_loc else at
            lt.emit("KVL108", f"{owner} reads `{path}` but decides {DECISION_FIELDS[first]}, which comes at or "
                    f"before {field} (order: {', '.join(DECISION_FIELDS)}): it always sees no value. Test an "
                    "earlier field, or move the test into a separate rule for a later field.", where, at)


def shadowing(lt: Linter) -> None:
    """KVL102 shadowed and KVL103 conflicting rules, per decision field."""
    reported: dict[tuple[str, str], list[str]] = {}
    conflicts: dict[tuple[str, str], list[str]] = {}
    for field in DECISION_FIELDS:
        deciders = [(r, r.then.fields()[field]) for r in lt.rules
                    if field in r.then.fields() and r.id not in lt.unreachable]
        deciders = [(r, v) for r, v in deciders if lt.forbidden(field, v) is None]
        for j, (b, bv) in enumerate(deciders):
            for a, av in deciders[:j]:
                if not implies(lt.conj[b.id], lt.conj[a.id]):
                    continue
                same = implies(lt.conj[a.id], lt.conj[b.id])
                target = conflicts if same and av != bv else reported
                target.setdefault((b.id, a.id), []).append(field)
                break
    order_at = lt.src.key("order")
    inherited: dict[str, list[str]] = {}
    for (b, a), fields in reported.items():
        if lt.src.rule(b)[0] not in lt.user and lt.src.rule(a)[0] in lt.user:
            # A new rule that hides inherited ones: one finding at the new rule.
            inherited.setdefault(a, []).append(f"{b} ({', '.join(fields)})")
            continue
        lt.emit("KVL102", f"rule {b} never decides {', '.join(fields)}: whenever it matches, rule {a} (earlier) "
                f"already has. Narrow rule {a}'s condition, move {b} before it (`order:`), or remove {b}.",
                lt.src.rule(b), order_at)
    for a, hidden in inherited.items():
        lt.emit("KVL102", f"rule {a} hides inherited rules that can then never decide: {', '.join(hidden)}. "
                f"Narrow rule {a}'s condition, or `disable:` the inherited rules if that is intended.", lt.src.rule(a))
    for (b, a), fields in conflicts.items():
        lt.emit("KVL103", f"rules {a} and {b} have the same condition but set {', '.join(fields)} differently; "
                f"{a} always wins. Make the conditions differ, or remove one.", lt.src.rule(b), lt.src.rule(a),
                order_at)


def pins_and_constraints(lt: Linter) -> None:
    """KVL101/107/108 for pins, KVL301 overridden pins, KVL107 forbidden defaults, KVL302 dead patterns."""
    pins = lt.policy.pins
    for i, pin in enumerate(pins):
        at = lt.src.pin(pin.name)
        file_loc = lt.src.item("pins", "name", pin.name)
        region = unsatisfiable(lt.pin_conj[i])
        if region is not None:
            lt.emit("KVL101", f"pin `{pin.name}` never applies: {_why_empty(region, lt.pin_conj[i])}",
                    lt.src.pin(pin.name, "when"), at)
        fields = pin.set.fields()
        for field, value in fields.items():
            pattern = lt.forbidden(field, value)
            if pattern is not None:
                lt.emit("KVL107", f"pin `{pin.name}` sets {field}={_fmt(value)}, which constraint `{pattern}` "
                        "forbids; evaluation stops with an error whenever the pin applies.",
                        lt.src.pin(pin.name, "set"), at)
        if fields:
            _read_too_early(lt, f"pin `{pin.name}`", pin.when, fields, file_loc, at)
        for j in range(i + 1, len(pins)):
            later = pins[j]
            shared = [f for f in fields if f in later.set.fields()]
            if shared and implies(lt.pin_conj[i], lt.pin_conj[j]):
                lt.emit("KVL301", f"pin `{pin.name}` never takes effect for {', '.join(shared)}: pin `{later.name}` "
                        "(later; the last matching pin wins) applies whenever it does.", at, lt.src.pin(later.name))
    for field, value in lt.policy.defaults.fields().items():
        pattern = lt.forbidden(field, value)
        if pattern is not None:
            lt.emit("KVL107", f"defaults.{field}={_fmt(value)} is forbidden by constraint `{pattern}`: evaluation "
                    "stops with an error whenever no rule decides the field. Change the default.",
                    lt.src.key("defaults", field), lt.src.key("constraints", "forbid", field))
    dom = domains()
    known = {"kv_cache_dtype": dom["decision.kv_cache_dtype"],
             "two_level_accumulation": dom["decision.two_level_accumulation"],
             "scale_source": dom["decision.scale_source"]}
    for field, patterns in lt.policy.constraints.forbid.items():
        values = known.get(field)
        if values is None:
            continue
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(v, pattern) for v in values):
                lt.emit("KVL302", f"constraints.forbid.{field}: `{pattern}` matches no {field}, so it forbids "
                        f"nothing.{did_you_mean(pattern, values)} Values: {', '.join(sorted(values))}.",
                        lt.src.key("constraints", "forbid", field))


def thresholds(lt: Linter) -> None:
    """KVL201 out of range, KVL202 unused, KVL203 bounds moved, KVL105 unknown evidence."""
    policy = lt.policy
    used = set(CODE_THRESHOLDS)
    for r in policy.rules:
        used.update(threshold_refs(r.when))
    for p in policy.pins:
        used.update(threshold_refs(p.when))
    evidence = {e.id for e in policy.evidence}
    for name, t in policy.thresholds.items():
        at = lt.src.key("thresholds", name)
        if t.min is not None and t.max is not None and t.min > t.max:
            lt.emit("KVL201", f"threshold `{name}`: min {t.min:g} is above max {t.max:g}; swap them.",
                    lt.src.key("thresholds", name, "min"), at)
        checks = [((), t.value, ("value",)), ((), t.default, ("default",))]
        checks += [((k,), v, ("values", k)) for k, v in t.values.items()]
        for _, value, loc in checks:
            if value is None:
                continue
            low = t.min is not None and (value < t.min or math.isnan(value))
            high = t.max is not None and (value > t.max or math.isnan(value))
            if low or high:
                bounds = f"[{'-inf' if t.min is None else f'{t.min:g}'}, {'inf' if t.max is None else f'{t.max:g}'}]"
                lt.emit("KVL201", f"threshold `{name}`.{'.'.join(loc)} = {value:g} is outside its range {bounds}. "
                        "Use a value in range (the bounds come from the evidence behind it).",
                        lt.src.key("thresholds", name, *loc), at)
        if name not in used:
            lt.emit("KVL202", f"threshold `{name}` is not read by any rule, pin or estimate.{did_you_mean(name, used)} "
                    "Reference it with `{threshold: " + name + "}` or remove it.", at)
        for ev in t.evidence:
            if ev not in evidence:
                lt.emit("KVL105", f"threshold `{name}` cites unknown evidence `{ev}`.{did_you_mean(ev, evidence)}",
                        lt.src.key("thresholds", name, "evidence"), at)
    # Bounds moved by an extending file (they guard the inherited evidence).
    if len(lt.loaded.chain) > 1:
        child = lt.loaded.raw.get(lt.loaded.chain[0])
        for name, patch in ((child or {}).get("thresholds") or {}).items():
            if isinstance(patch, dict) and ({"min", "max"} & set(patch)):
                lt.emit("KVL203", f"threshold `{name}`: this file changes `min`/`max` of an inherited threshold; "
                        "lint checks values against them, so widen them only with new evidence.",
                        lt.src.at(lt.loaded.chain[0], ("thresholds", name)))


def measured_break_even(lt: Linter) -> None:
    """KVL204: a user's `break_even_tokens` moves nothing for (model, GPU) pairs with measured ITL lines."""
    from kvpolicy.facts.estimates import break_even
    from kvpolicy.inputs.catalog import resolve_gpu

    top = lt.loaded.chain[0]
    patch = ((lt.loaded.raw.get(top) or {}).get("thresholds") or {}).get("break_even_tokens")
    threshold = lt.policy.thresholds.get("break_even_tokens")
    if top not in lt.user or not isinstance(patch, dict) or threshold is None:
        return
    if threshold.by not in (None, "gpu.generation"):
        return
    changed = None if threshold.by is None or "value" in patch else set(patch.get("values") or {})
    if "default" in patch:
        changed = None
    overruled: dict[str, str] = {}
    for ev in lt.policy.evidence:
        if not ev.itl:
            continue
        try:
            gpu = resolve_gpu(ev.itl.gpu)
        except KvPolicyError:
            continue
        if changed is not None and gpu.generation not in changed:
            continue
        found = (ev.id, ev.itl.variants)
        keys = [k for k in ("fp8", "fp8_skip_sliding") if k in ev.itl.variants] or ["fp8"]
        facts = {"gpu.generation": gpu.generation}
        skips = {"fp8": [], "fp8_skip_sliding": ["sliding_window"]}
        if all(break_even(lt.policy, gpu, found, "fp8", skips[k], facts).provenance == "measured" for k in keys):
            overruled[f"{ev.itl.model} on {gpu.id}"] = ev.id  # later evidence wins, as in find_itl
    if overruled:
        pairs = ", ".join(f"{pair} (`{ev}`)" for pair, ev in overruled.items())
        lt.emit("KVL204", f"threshold `break_even_tokens`: this change moves nothing for {pairs}: their measured ITL "
                "lines give the break-even. It applies to the other models on those GPUs; to move these, record "
                "your own lines (`kvpolicy bench --record FILE`).", lt.src.key("thresholds", "break_even_tokens"),
                lt.src.at(top, ("thresholds", "break_even_tokens")))


def deployments(lt: Linter) -> None:
    """KVL401 unknown model/GPU or bad context, KVL402 floor below the policy's minimum."""
    from kvpolicy.policy.deployments import deployment_inputs

    floor = lt.policy.constraints.min_accuracy_floor
    for dep in lt.policy.deployments:
        at = lt.src.deployment(dep.name)
        if floor is not None and dep.accuracy_floor is not None and dep.accuracy_floor < floor:
            lt.emit("KVL402", f"deployment `{dep.name}`: accuracy_floor {dep.accuracy_floor:g} is below the "
                    f"policy's min_accuracy_floor {floor:g}; raise it.", lt.src.deployment(dep.name, "accuracy_floor"),
                    at)
            continue
        try:
            deployment_inputs(lt.loaded, dep)
        except KvPolicyError as exc:
            message = str(exc)
            prefix = f"{at[0]}:{at[1]}:{at[2]}: " if at[1] is not None else ""
            lt.emit("KVL401", message.removeprefix(prefix), at)



SERVABILITY_GRID = (
    ("llama-3.1-8b", 1), ("gpt-oss-20b", 1), ("gemma-4-31b-it", 1), ("qwen3-30b-a3b", 1),
    ("deepseek-v3", 8), ("deepseek-v3.2-exp", 8), ("kimi-k2.5", 8),
)
"""Models (with a tensor-parallel size that fits them) the servability check runs each policy over:
GQA with and without sinks/sliding windows, heterogeneous head sizes, dense and sparse MLA."""
SERVABILITY_GPUS = ("a100", "l40s", "h100", "b200")
SERVABILITY_CONTEXTS = ("8k", "128k")


def servability(lt: Linter) -> None:
    """KVL109 rules and KVL303 pins that would produce a combination vLLM 0.33 refuses (support matrix).

    Runs the policy over a fixed grid of models, GPUs and contexts plus the policy's own
    deployments: a rule the engine had to skip for vLLM's sake, or a pin that decided a
    field of a decision the compatibility check refuses, is reported once, with one case.
    """
    from kvpolicy.facts.backends import AttentionShape, auto_backend, problems
    from kvpolicy.facts.build import build_facts
    from kvpolicy.inputs.catalog import resolve_gpu, resolve_model
    from kvpolicy.inputs.workload import make_workload
    from kvpolicy.policy.deployments import deployment_inputs
    from kvpolicy.rules.engine import decide

    cases = []
    for model, tp in SERVABILITY_GRID:
        for gpu in SERVABILITY_GPUS:
            for ctx in SERVABILITY_CONTEXTS:
                try:
                    cases.append((resolve_model(model), resolve_gpu(gpu),
                                  make_workload(lt.loaded, context=ctx, tp=tp)))
                except KvPolicyError:
                    continue
    for dep in lt.policy.deployments:
        try:
            cases.append(deployment_inputs(lt.loaded, dep))
        except KvPolicyError:
            continue  # KVL401 reports it
    seen: set[str] = set()
    for arch, gpu, workload in cases:
        try:
            outcome = decide(lt.policy, build_facts(arch, gpu, workload, lt.policy))
        except KvPolicyError:
            continue
        where = f"{arch.id} on {gpu.id} at {workload.context_tokens:,} tokens"
        for out in outcome.trace["rules"]:
            marker = "is not served by vLLM 0.33 here: "
            if marker in out["reason"] and out["id"] not in seen:
                seen.add(out["id"])
                lt.emit("KVL109", f"rule {out['id']} sets a value vLLM 0.33 refuses for {where} "
                        f"({out['reason'].split('; ', 1)[-1]}); the engine skips it there. Narrow its `when:`.",
                        lt.src.rule(out["id"]))
        d = outcome.decision
        pinned = {v["decided_by"][4:] for v in outcome.trace["fields"].values() if v["decided_by"].startswith("pin:")}
        if not pinned:
            continue
        shape = AttentionShape.of(arch, workload.tp)
        if gpu.vendor != "nvidia" or auto_backend("auto", gpu.sm, shape) is None:
            continue  # vLLM runs this model on no backend of this GPU: not the pin's doing
        why = problems(d.kv_cache_dtype, d.attention_backend, gpu.sm, shape,
                       per_head_scales=d.scale_source == "checkpoint_per_head", vendor=gpu.vendor)
        for name in sorted(pinned - seen):
            if why:
                seen.add(name)
                lt.emit("KVL303", f"pin `{name}` gives a decision vLLM 0.33 refuses for {where}: {why[0]}",
                        lt.src.pin(name, "set"), lt.src.pin(name))
