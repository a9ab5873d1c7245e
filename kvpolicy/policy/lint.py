"""`kvpolicy lint`: problems a policy file has beyond its schema, each with file:line:col.

A file that cannot be loaded gives KVL0xx findings (exit code 2); a loaded one
runs every check of `lint_checks` (the registry of codes is there). Findings in
built-in policies a user file extends are not reported unless the user file
causes them.
"""

from __future__ import annotations

from pathlib import Path

from kvpolicy.errors import InputError, KvPolicyError
from kvpolicy.inputs.policy_loader import LoadedPolicy
from kvpolicy.inputs.yamlio import error_problems
from kvpolicy.policy import lint_checks
from kvpolicy.policy.lint_checks import LOAD_CODES, Finding
from kvpolicy.rules.validate import load_policy


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


def lint_loaded(loaded: LoadedPolicy) -> list[Finding]:
    """Every finding for a loaded policy, sorted by file and line."""
    linter = lint_checks.Linter(loaded)
    lint_checks.rules(linter)
    lint_checks.shadowing(linter)
    lint_checks.pins_and_constraints(linter)
    lint_checks.thresholds(linter)
    lint_checks.measured_break_even(linter)
    lint_checks.deployments(linter)
    lint_checks.servability(linter)
    return sorted(linter.findings, key=lambda f: (f.file, f.line or 0, f.col or 0, f.code))

