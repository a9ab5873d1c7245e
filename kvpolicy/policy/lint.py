"""`kvpolicy lint`: problems a policy file has beyond its schema, each with file:line:col.

Every check is data (code, name, severity, summary), like ruff's registry;
`kvpolicy lint --list-checks` prints them. Codes by area: KVL0xx the file cannot
be loaded (exit code 2), KVL1xx rules, KVL2xx thresholds, KVL3xx pins and
constraints, KVL4xx deployments. Findings in built-in policies a user file
extends are not reported unless the user file causes them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpolicy.errors import InputError, KvPolicyError
from kvpolicy.inputs.policy_loader import BUILTIN, LoadedPolicy
from kvpolicy.inputs.policy_sources import Sources
from kvpolicy.inputs.yamlio import error_problems
from kvpolicy.rules.validate import load_policy


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
          "A rule, pin or `disable:` names an unknown fact, threshold, dtype or rule."),
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
    Check("KVL201", "threshold-out-of-range", "error", "A threshold's value lies outside its `min`/`max`."),
    Check("KVL202", "unused-threshold", "warning", "A threshold no rule, pin or estimate reads."),
    Check("KVL203", "threshold-bounds-changed", "warning", "An extending file moves an inherited threshold's `min`/`max`."),
    Check("KVL301", "overridden-pin", "warning", "A later pin always replaces this pin's field."),
    Check("KVL302", "constraint-matches-nothing", "warning", "A `forbid` pattern that matches no known value."),
    Check("KVL401", "bad-deployment", "error", "A deployment names an unknown model or GPU, or an invalid context."),
    Check("KVL402", "deployment-floor-too-low", "error", "A deployment's accuracy floor is below `min_accuracy_floor`."),
]
BY_CODE = {c.code: c for c in CHECKS}
LOAD_CODES = {"yaml": "KVL001", "schema": "KVL002", "unknown-key": "KVL003", "extends": "KVL004",
              "reference": "KVL005", "io": "KVL006"}
CODE_THRESHOLDS = {"break_even_tokens", "fp8_slope_overhead", "accuracy_floor"}
"""Thresholds kvpolicy's estimates and defaults read (besides those rules name)."""
DECISION_FACT_FIELD = {"decision.kv_cache_dtype": "kv_cache_dtype", "decision.kv_format": "kv_cache_dtype",
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


def lint_path(path: str | Path) -> list[Finding]:
    """Lint one policy file (or validate one `*_test.yaml`); load failures become KVL0xx findings."""
    path = str(path)
    if path.endswith(("_test.yaml", "_test.yml")):
        from kvpolicy.policy.testing import load_test_file

        try:
            load_test_file(Path(path))
        except KvPolicyError as exc:
            return _load_findings(exc, path)
        return []
    try:
        loaded = load_policy(path)
    except KvPolicyError as exc:
        return _load_findings(exc, path)
    return lint_loaded(loaded)


def _load_findings(exc: KvPolicyError, path: str) -> list[Finding]:
    problems = error_problems(exc, path)
    io = isinstance(exc, InputError) and not getattr(exc, "problems", None)
    return [Finding("KVL006" if io else LOAD_CODES.get(p.kind, "KVL002"), p.message.removeprefix(f"{p.file}: "),
                    p.file, p.line, p.col) for p in problems]


def is_load_failure(findings: list[Finding]) -> bool:
    """True when a file could not be loaded at all (exit code 2)."""
    return any(f.code < "KVL100" for f in findings)


class _Linter:
    def __init__(self, loaded: LoadedPolicy) -> None:
        from kvpolicy.policy.analysis import conjunction

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
        import fnmatch

        values = value if isinstance(value, list) else [value]
        for pattern in self.policy.constraints.forbid.get(field, []):
            if any(fnmatch.fnmatchcase(str(v), pattern) for v in values):
                return pattern
        return None


def lint_loaded(loaded: LoadedPolicy) -> list[Finding]:
    """Every finding for a loaded policy, sorted by file and line."""
    from kvpolicy.policy import lint_checks

    linter = _Linter(loaded)
    lint_checks.rules(linter)
    lint_checks.shadowing(linter)
    lint_checks.pins_and_constraints(linter)
    lint_checks.thresholds(linter)
    lint_checks.deployments(linter)
    return sorted(linter.findings, key=lambda f: (f.file, f.line or 0, f.col or 0, f.code))

