"""`kvpolicy test`: policy unit tests in YAML, beside the policy (`team.yaml` + `team_test.yaml`).

Like `opa test` and `kyverno test`: each case gives inputs (a model and GPU with
a workload, a deployment of the policy, a named fixture, and/or raw facts), and the
decision fields it expects, optionally the rule that should (or should not)
decide. Outcomes are PASS, FAIL, ERROR or SKIPPED (names starting `todo_`).
Coverage lists the rules and pins no case fired.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpolicy.errors import KvPolicyError, PolicyError, did_you_mean
from kvpolicy.inputs.policy_schema import DECISION_FIELDS
from kvpolicy.policy.testcases import Case, Expect, Fixture, PolicyTestFile, TestInputs

__all__ = ["Case", "Expect", "Fixture", "PolicyTestFile", "TestInputs", "discover", "load_test_file", "run_file"]

SKIP_DIRS = {".git", ".hg", ".venv", "venv", "node_modules", "__pycache__", "build", "dist", ".tox", ".kvpolicy"}


@dataclass
class CaseResult:
    """The outcome of one case."""

    name: str
    status: str
    line: int | None = None
    message: str = ""
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    fired: list[str] = field(default_factory=list)
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)
    duration_ms: float = 0.0


@dataclass
class FileResult:
    """The outcome of one test file."""

    file: str
    policy_file: str = ""
    policy: str = ""
    cases: list[CaseResult] = field(default_factory=list)
    error: str | None = None
    error_line: int | None = None
    error_col: int | None = None
    rules: list[str] = field(default_factory=list)
    """Rules and pins the policy has (for coverage)."""


def is_test_file(path: Path) -> bool:
    """`*_test.yaml` / `*_test.yml`."""
    return path.name.endswith(("_test.yaml", "_test.yml"))


def discover(paths: list[str]) -> list[Path]:
    """Test files named, and those found (recursively) in folders named; `.` when none."""
    from kvpolicy.errors import InputError

    found: list[Path] = []
    for spec in paths or ["."]:
        p = Path(spec)
        if p.is_dir():
            found.extend(sorted(f for f in p.rglob("*_test.y*ml")
                                if is_test_file(f) and not (set(f.relative_to(p).parts[:-1]) & SKIP_DIRS)
                                and not any(part.startswith(".") for part in f.relative_to(p).parts[:-1])))
        elif p.is_file() and not is_test_file(p):
            # A policy named instead of its tests: run the tests beside it.
            sibling = p.with_name(f"{p.stem}_test{p.suffix}")
            if not sibling.is_file():
                raise InputError(f"{spec} is not a test file and has no {sibling.name} beside it. Put its cases "
                                 f"in {sibling.name} (`kvpolicy init` writes an example).")
            found.append(sibling)
        elif p.is_file():
            found.append(p)
        else:
            raise InputError(f"{spec}: no such file or folder. Pass `*_test.yaml` files or folders holding them.")
    return list(dict.fromkeys(found))


def load_test_file(path: Path) -> tuple[PolicyTestFile, Any]:
    """Parse and validate a test file (errors carry file:line:col)."""
    from pydantic import ValidationError

    from kvpolicy.inputs.yamlio import Problem, load_roundtrip, located_error, read_text, validation_problems

    raw = load_roundtrip(read_text(path), str(path))
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise located_error([Problem(str(path), "a test file must be a YAML mapping with `cases:`.", 1, 1)])
    from kvpolicy.inputs.yamlio import to_plain

    try:
        return PolicyTestFile.model_validate(to_plain(raw)), raw
    except ValidationError as exc:
        raise located_error(validation_problems(exc, raw, str(path), PolicyTestFile)) from None


def policy_for(path: Path, tests: PolicyTestFile) -> str:
    """The policy a test file tests."""
    if tests.policy:
        if tests.policy.startswith("builtin:") or Path(tests.policy).is_absolute():
            return tests.policy
        return str(path.parent / tests.policy)
    stem = path.name.rsplit("_test.", 1)[0]
    for ext in (".yaml", ".yml"):
        candidate = path.parent / f"{stem}{ext}"
        if candidate.is_file():
            return str(candidate)
    raise PolicyError(f"{path}: no policy to test: put {stem}.yaml next to it, or add `policy: FILE` "
                      "(relative to the test file) or `policy: builtin:default`.")


def run_file(path: Path, run: re.Pattern[str] | None = None) -> FileResult:
    """Run every case of one test file (a file-level problem is reported in `error`)."""
    from kvpolicy.inputs.policy_sources import Sources
    from kvpolicy.inputs.yamlio import error_problems, position
    from kvpolicy.rules.validate import load_policy

    result = FileResult(file=str(path))
    try:
        tests, raw = load_test_file(path)
        result.policy_file = policy_for(path, tests)
        loaded = load_policy(result.policy_file)
    except KvPolicyError as exc:
        first = error_problems(exc, str(path))[0]
        result.error, result.error_line, result.error_col = str(exc), first.line, first.col
        if first.file != str(path):
            result.error_line = result.error_col = None
        return result
    result.policy = loaded.label
    policy = loaded.policy
    # Coverage counts what this repository wrote; built-in policies have their own tests.
    src = Sources.of(loaded)
    own = {n for n in loaded.chain if not n.startswith("builtin:")}
    result.rules = [r.id for r in policy.rules if r.enabled and r.status != "deprecated"
                    and (src.item("rules", "id", r.id) or ("",))[0] in own]
    result.rules += [f"pin:{p.name}" for p in policy.pins if (src.item("pins", "name", p.name) or ("",))[0] in own]
    for i, case in enumerate(tests.cases):
        if run is not None and not run.search(case.name):
            continue
        pos = position(raw, ("cases", i))
        line = pos[0] if pos else None
        if case.name.startswith("todo_"):
            result.cases.append(CaseResult(case.name, "SKIPPED", line))
            continue
        start = time.perf_counter()
        outcome = _run_case(path, tests, case, loaded)
        outcome.line = line
        outcome.duration_ms = round((time.perf_counter() - start) * 1000, 2)
        result.cases.append(outcome)
    return result


def _layered(path: Path, tests: PolicyTestFile, case: Case, loaded: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(inputs, fact overrides) after layering deployment, fixture and case."""
    from kvpolicy.policy.deployments import find_deployment

    layers: list[TestInputs] = []
    if case.fixture is not None:
        if case.fixture not in tests.fixtures:
            raise PolicyError(f"unknown fixture `{case.fixture}`.{did_you_mean(case.fixture, tests.fixtures)} "
                              "Define it under `fixtures:`.")
        layers.append(tests.fixtures[case.fixture])
    layers.append(case)
    dep_name = next((lay.deployment for lay in reversed(layers) if lay.deployment), None)
    inputs: dict[str, Any] = {}
    if dep_name is not None:
        dep = find_deployment(loaded, dep_name)
        # A `tp` the deployment leaves out stays out, so its `gpu: 2xh100` still gives the count.
        inputs = dep.model_dump(exclude={"name"} | ({"tp"} - dep.model_fields_set))
        inputs["model"] = _dep_model(loaded, dep.model)
    facts: dict[str, Any] = {}
    for layer in layers:
        data = layer.model_dump(exclude_unset=True, exclude={"facts", "deployment", "name", "description",
                                                              "fixture", "expect"})
        if "model" in data and data["model"]:
            data["model"] = _case_model(path, data["model"])
        inputs.update({k: v for k, v in data.items() if v is not None})
        facts.update(layer.facts)
    return inputs, facts


def _dep_model(loaded: Any, spec: str) -> str:
    from kvpolicy.policy.deployments import _model_spec

    return _model_spec(loaded, spec)


def _case_model(path: Path, spec: str) -> str:
    if (spec.startswith(("./", "../")) or spec.endswith(".json")) and not Path(spec).is_absolute():
        return str(path.parent / spec)
    return spec


def _facts_for(inputs: dict[str, Any], overrides: dict[str, Any], loaded: Any) -> dict[str, Any]:
    from kvpolicy.facts.build import FACTS, build_facts
    from kvpolicy.inputs.catalog import gpu_and_count, resolve_model
    from kvpolicy.inputs.workload import make_workload

    bad = [k for k in overrides if k not in FACTS]
    if bad:
        raise PolicyError(f"facts: unknown fact `{bad[0]}`.{did_you_mean(bad[0], FACTS)} `kvpolicy facts` lists them.")
    decided = [k for k in overrides if k.startswith("decision.")]
    if decided:
        raise PolicyError(f"facts: `{decided[0]}` is set by the engine as it decides; test it through `expect:`.")
    has_model, has_gpu = bool(inputs.get("model")), bool(inputs.get("gpu"))
    if has_model != has_gpu:
        raise PolicyError("give both `model` and `gpu` (or neither, with `facts:` holding every fact the rules read).")
    if not has_model:
        if not overrides:
            raise PolicyError("the case has no inputs: give `model` and `gpu`, a `deployment`, a `fixture`, "
                              "or `facts`.")
        return dict(overrides)
    arch = resolve_model(inputs["model"], where="model")
    gpu, tp = gpu_and_count(inputs["gpu"], inputs.get("tp"), where="gpu", count_where="tp")
    workload_args = {k: inputs[k] for k in ("context", "priority", "concurrency", "accuracy_floor",
                                            "gpu_memory_utilization") if inputs.get(k) is not None}
    workload_args["tp"] = tp
    workload = make_workload(loaded, **workload_args)
    facts = build_facts(arch, gpu, workload, loaded.policy)
    facts.update(overrides)
    return facts


def _run_case(path: Path, tests: PolicyTestFile, case: Case, loaded: Any) -> CaseResult:
    from kvpolicy.rules.engine import decide

    expect = case.expect
    known = {r.id for r in loaded.policy.rules} | {f"pin:{p.name}" for p in loaded.policy.pins} | {"default"}
    named = list(expect.not_decided_by)
    if isinstance(expect.decided_by, str):
        named.append(expect.decided_by)
    elif isinstance(expect.decided_by, dict):
        named.extend(expect.decided_by.values())
        bad_fields = [f for f in expect.decided_by if f not in DECISION_FIELDS]
        if bad_fields:
            return CaseResult(case.name, "ERROR", message=f"expect.decided_by: unknown field `{bad_fields[0]}`."
                              f"{did_you_mean(bad_fields[0], DECISION_FIELDS)}")
    unknown = [n for n in named if n not in known]
    if unknown:
        return CaseResult(case.name, "ERROR", message=f"expect names unknown rule `{unknown[0]}`."
                          f"{did_you_mean(unknown[0], known)} (A typo here would make the case pass by accident.)")
    try:
        inputs, overrides = _layered(path, tests, case, loaded)
        facts = _facts_for(inputs, overrides, loaded)
        outcome = decide(loaded.policy, facts)
    except KvPolicyError as exc:
        if expect.error is not None and expect.error in str(exc):
            return CaseResult(case.name, "PASS", message=str(exc))
        if expect.error is not None:
            return CaseResult(case.name, "FAIL", message=str(exc), mismatches=[
                {"what": "error", "expected": f"an error containing {expect.error!r}", "got": str(exc)}])
        return CaseResult(case.name, "ERROR", message=str(exc))
    return _compare(case, outcome, loaded.policy)


def _compare(case: Case, outcome: Any, policy: Any) -> CaseResult:
    expect = case.expect
    trace = outcome.trace
    rules = {o["id"]: o for o in trace["rules"]}
    fields = {}
    for name, ft in trace["fields"].items():
        by = ft["decided_by"]
        reason = rules[by]["reason"] if by in rules else ("a pin" if by.startswith("pin:") else "no rule decided it")
        fields[name] = {"value": ft["value"], "decided_by": by, "reason": reason}
    advice = {r.id for r in policy.rules if not r.then.fields()}
    fired = [o["id"] for o in trace["rules"] if o["decided"] or (o["matched"] and o["id"] in advice)]
    fired += [ft["decided_by"] for ft in trace["fields"].values() if ft["decided_by"].startswith("pin:")]
    mismatches: list[dict[str, Any]] = []
    decision = outcome.decision.model_dump()
    for name in DECISION_FIELDS:
        if name in expect.model_fields_set and getattr(expect, name) != decision[name]:
            mismatches.append({"what": name, "expected": getattr(expect, name), "got": decision[name],
                               "decided_by": fields[name]["decided_by"], "reason": fields[name]["reason"]})
    if isinstance(expect.decided_by, str) and expect.decided_by not in fired:
        r = rules.get(expect.decided_by)
        why = (f"matched ({r['reason']}) but lost every field to earlier rules" if r and r["matched"] else
               f"did not match: {r['reason']}" if r else "is disabled or deprecated")
        mismatches.append({"what": "decided_by", "expected": f"{expect.decided_by} decides", "got": why})
    elif isinstance(expect.decided_by, dict):
        for name, rid in expect.decided_by.items():
            if fields[name]["decided_by"] != rid:
                mismatches.append({"what": f"decided_by.{name}", "expected": rid, "got": fields[name]["decided_by"],
                                   "reason": fields[name]["reason"]})
    for rid in expect.not_decided_by:
        if rid in fired:
            decided = [n for n, f in fields.items() if f["decided_by"] == rid]
            mismatches.append({"what": "not_decided_by", "expected": f"{rid} does not decide",
                               "got": f"{rid} decided {', '.join(decided) or 'its advice'}",
                               "reason": rules[rid]["reason"] if rid in rules else ""})
    for kind, texts, got in (("warnings", expect.warnings, outcome.warnings),
                             ("alternatives", expect.alternatives, outcome.alternatives)):
        for text in texts:
            if not any(text in g for g in got):
                mismatches.append({"what": kind, "expected": f"one containing {text!r}", "got": got})
    if expect.error is not None:
        mismatches.append({"what": "error", "expected": f"an error containing {expect.error!r}",
                           "got": "a decision"})
    status = "FAIL" if mismatches else "PASS"
    return CaseResult(case.name, status, mismatches=mismatches, fired=fired, fields=fields)
