"""Outputs of lint, test, check and diff: a plain table for people, JSON, and GitHub annotations.

`--format github` prints workflow commands (`::error file=F,line=L,col=C,title=T::message`)
that GitHub Actions turns into annotations on the offending line of the pull request.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvpolicy import noun
from kvpolicy.outputs.render import echo

OUTPUT_FORMATS = ("table", "json", "github")


def _escape(text: str, prop: bool = False) -> str:
    text = str(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    if prop:
        text = text.replace(":", "%3A").replace(",", "%2C")
    return text


def repo_path(file: str) -> str:
    """A path relative to the working folder when it lies under it (GitHub resolves annotations from the repo root)."""
    try:
        p = Path(file)
        if p.is_absolute():
            return Path(os.path.relpath(p, Path.cwd())).as_posix() if str(p).startswith(str(Path.cwd())) else str(p)
        return p.as_posix()
    except (OSError, ValueError):
        return file


def annotation(level: str, message: str, file: str | None = None, line: int | None = None,
               col: int | None = None, title: str | None = None) -> str:
    """One GitHub workflow command: level is error, warning or notice."""
    props = []
    if file and not file.startswith("builtin:"):
        props.append(f"file={_escape(repo_path(file), True)}")
        if line is not None:
            props.append(f"line={line}")
            if col is not None:
                props.append(f"col={col}")
    if title:
        props.append(f"title={_escape(title, True)}")
    return f"::{level} {','.join(props)}::{_escape(message)}" if props else f"::{level}::{_escape(message)}"


def at(file: str, line: int | None, col: int | None) -> str:
    """`file:line:col` (as much as is known)."""
    return file + (f":{line}" if line is not None else "") + (f":{col}" if line is not None and col else "")


def dump_json(data: Any) -> None:
    """Pretty JSON on stdout."""
    echo(json.dumps(data, indent=2, default=str))


# -- lint --------------------------------------------------------------------------------


def render_lint(findings: list[Any], num_files: int, fmt: str) -> None:
    """Findings as `file:line:col: CODE [severity] message` lines, JSON, or annotations."""
    errors = sum(f.severity == "error" for f in findings)
    notes = sum(f.severity == "info" for f in findings)
    warnings = len(findings) - errors - notes
    if fmt == "json":
        dump_json({"files": num_files, "errors": errors, "warnings": warnings, "notes": notes,
                   "findings": [f.to_json() for f in findings]})
        return
    if fmt == "github":
        for f in findings:
            level = "notice" if f.severity == "info" else f.severity
            echo(annotation(level, f.message, f.file, f.line, f.col, f"{f.code} {f.name}"))
    else:
        for f in findings:
            echo(f"{at(f.file, f.line, f.col)}: {f.code} [{f.severity}] {f.message}")
    echo(f"{num_files} {noun(num_files, 'file')} linted: {errors} {noun(errors, 'error')}, "
         f"{warnings} {noun(warnings, 'warning')}" + (f", {notes} {noun(notes, 'note')}" if notes else "")
         + ("" if findings else ", all clean"))


def render_checks(checks: list[Any], fmt: str) -> None:
    """The lint checks table (`kvpolicy lint --list-checks`)."""
    if fmt == "json":
        dump_json([vars(c) for c in checks])
        return
    for c in checks:
        echo(f"{c.code}  {c.name:<28} {c.severity:<8} {c.summary}")


# -- test --------------------------------------------------------------------------------


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, list):
        return "[" + ", ".join(map(str, v)) + "]"
    return str(v)


def render_tests(files: list[Any], coverage: dict[str, dict[str, list[str]]], fmt: str,
                 verbose: bool) -> dict[str, int]:
    """The pass/fail table (failures with expected vs got and the deciding rule); returns the counts."""
    counts = {"PASS": 0, "FAIL": 0, "ERROR": 0, "SKIPPED": 0}
    for fr in files:
        for c in fr.cases:
            counts[c.status] += 1
        if fr.error:
            counts["ERROR"] += 1
    if fmt == "json":
        dump_json({"summary": {k.lower(): v for k, v in counts.items()},
                   "files": [{"file": fr.file, "policy_file": fr.policy_file, "policy": fr.policy,
                              "error": fr.error, "cases": [vars(c) for c in fr.cases]} for fr in files],
                   "coverage": coverage})
        return counts
    for fr in files:
        if fmt == "github":
            if fr.error:
                echo(annotation("error", fr.error, fr.file, fr.error_line, fr.error_col, "kvpolicy test"))
            for c in fr.cases:
                if c.status in ("FAIL", "ERROR"):
                    echo(annotation("error", f"{c.status} {c.name}: " + "; ".join(_mismatch_lines(c)),
                                    fr.file, c.line, None, "kvpolicy test"))
            continue
        echo(f"{fr.file}" + (f"  ({fr.policy})" if fr.policy else ""))
        if fr.error:
            echo("  ERROR   " + fr.error.replace("\n", "\n          "))
        for c in fr.cases:
            if c.status == "PASS" and not verbose:
                continue
            echo(f"  {c.status:<7} {c.name}" + (f"  (line {c.line})" if c.line else ""))
            for text in _mismatch_lines(c):
                echo(f"           {text}")
            if c.status == "FAIL" or (verbose and c.fields):
                trace = ", ".join(f"{n}={_value(f['value'])} by {f['decided_by']}" for n, f in c.fields.items())
                if trace:
                    echo(f"           trace: {trace}")
        shown = sum(1 for c in fr.cases if c.status == "PASS")
        if shown and not verbose:
            echo(f"  PASS    {shown} {noun(shown, 'case')}")
    if fmt != "github":
        for policy, cov in coverage.items():
            if cov["uncovered"]:
                echo(f"coverage: {policy}: no case fired {', '.join(cov['uncovered'])}")
            elif cov["rules"]:
                n = len(cov["rules"])
                echo(f"coverage: {policy}: " + ("the one rule or pin it defines" if n == 1 else
                                                f"all {n} rules and pins it defines") + " fired in some case")
            else:
                echo(f"coverage: {policy}: defines no rules or pins of its own (inherited ones are tested upstream)")
    echo(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['ERROR']} {noun(counts['ERROR'], 'error')}, "
         f"{counts['SKIPPED']} skipped")
    return counts


def _mismatch_lines(c: Any) -> list[str]:
    if c.status == "ERROR":
        return [c.message]
    out = []
    for m in c.mismatches:
        line = f"{m['what']}: expected {_value(m['expected'])}, got {_value(m['got'])}"
        if m.get("decided_by"):
            line += f" (decided by {m['decided_by']}: {m.get('reason', '')})"
        elif m.get("reason"):
            line += f" ({m['reason']})"
        out.append(line)
    return out


# -- check -------------------------------------------------------------------------------


def render_check(label: str, results: list[dict[str, Any]], fmt: str, strict: bool = False) -> None:
    """Per deployment: decision, capacity, warnings and violations.

    JSON is the document `POST /v1/check` answers (schemas/serve-check-response.schema.json), so a script
    reads the CLI and the service alike.
    """
    if fmt == "json":
        from kvpolicy.service.api import check_response, check_result

        doc = check_response(label, "policy", [check_result(r["name"], r, "deployment_error") for r in results],
                             strict=strict)
        echo(doc.model_dump_json(indent=2))
        return
    for r in results:
        where = (r["file"], r["line"], r["col"])
        if fmt == "github":
            if r["status"] == "error":
                echo(annotation("error", r["error"], *where, title=f"deployment {r['name']}"))
            for v in r.get("violations", []):
                echo(annotation("error", f"deployment {r['name']}: {v}", *where, title="kvpolicy check"))
            for w in r.get("warnings", []):
                echo(annotation("warning", f"deployment {r['name']}: {w}", *where, title="kvpolicy check"))
            for a in r.get("advice", []):
                echo(annotation("notice", f"deployment {r['name']}: {a}", *where, title="kvpolicy check"))
            continue
        mark = {"ok": "ok", "violation": "FAIL", "error": "ERROR"}[r["status"]]
        echo(f"{mark:<5} {r['name']}  ({at(*where)})")
        if r["status"] == "error":
            echo(f"      {r['error']}")
            continue
        d, cap = r["decision"], r["capacity"]
        by = r["decided_by"]["kv_cache_dtype"]
        # The GPU count as recommend's title writes it, where the vllm serve line has --tensor-parallel-size.
        gpus = f"{r['tp']} x {r['gpu']}" if r.get("tp", 1) > 1 else r["gpu"]
        echo(f"      {r['model']} on {gpus}: kv_cache_dtype {d['kv_cache_dtype']} ({by})"
             f", skip {_value(d['skip_layers'])}, two-level {d['two_level_accumulation']}, scales {d['scale_source']}, "
             f"backend {d['attention_backend'] or 'vLLM default'}")
        fits = cap["max_concurrency"]
        held = "n/a requests fit" if fits is None else "1 request fits" if int(fits) == 1 else f"{int(fits)} requests fit"
        echo(f"      capacity: {held} "
             f"({cap['concurrency']} needed), {cap['capacity_vs_bf16']}x BF16"
             + (f"; accuracy ~{r['accuracy_recovery']:.0%}" if r.get("accuracy_recovery") else ""))
        echo(f"      vllm serve ... {' '.join(r['vllm_args'])}")
        for v in r["violations"]:
            echo(f"      violation: {v}")
        for w in r["warnings"]:
            echo(f"      warning: {w}")
        for a in r.get("advice", []):
            echo(f"      advice: {a}")
    if fmt != "github":
        echo(check_summary(label, results, strict))


def check_summary(label: str, results: list[dict[str, Any]], strict: bool) -> str:
    """The last line of `check`: counts that agree with the exit code (warnings fail under --strict)."""
    n = len(results)
    counts = {s: sum(r["status"] == s for r in results) for s in ("ok", "violation", "error")}
    warned = sum(r["status"] == "ok" and bool(r.get("warnings")) for r in results)
    parts = [f"{counts['ok'] - (warned if strict else 0)} ok"]
    if warned:
        parts.append(f"{warned} with warnings" + (" (failing: --strict)" if strict else ""))
    parts.append(f"{counts['violation']} with violations")
    if counts["error"]:
        parts.append(f"{counts['error']} not evaluated (errors)")
    return f"{n} {noun(n, 'deployment')} checked against {label}: " + ", ".join(parts)


# -- diff --------------------------------------------------------------------------------


def render_diff(old_label: str, new_label: str, changes: list[str], diffs: list[Any], new_file: str,
                sources: Any, fmt: str) -> None:
    """Policy-level changes, then each deployment's decision change with the rules that decide now and before."""
    if fmt == "json":
        dump_json({"old": old_label, "new": new_label, "policy_changes": changes,
                   "deployments": [_diff_json(d) for d in diffs]})
        return
    if fmt == "github":
        for d in diffs:
            if d.status in ("changed", "error"):
                file, line, col = sources.deployment(d.name)
                level = "error" if d.status == "error" else "warning"
                text = d.error if d.status == "error" else "; ".join(_change_text(c) for c in d.changes)
                echo(annotation(level, f"deployment {d.name}: {text}", file, line, col, "kvpolicy diff"))
        return
    echo(f"policy: {old_label} -> {new_label}")
    for line in changes or ["(no change to rules, thresholds, pins, constraints or defaults)"]:
        echo(f"  {line}")
    echo("deployments:")
    if not diffs:
        echo("  (none: add `deployments:` to the policy, or pass --model and --gpu)")
    for d in diffs:
        if d.status == "error":
            echo(f"  ERROR   {d.name}: {d.error}")
        elif d.status in ("added", "removed"):
            dec = d.new_decision or d.old_decision or {}
            echo(f"  {d.status.upper():<7} {d.name}: kv_cache_dtype {dec.get('kv_cache_dtype')}")
        elif d.status == "unchanged":
            echo(f"  same    {d.name}: kv_cache_dtype {d.new_decision['kv_cache_dtype']}")
        else:
            echo(f"  CHANGED {d.name}")
            for c in d.changes:
                echo(f"          {_change_text(c)}")
        for text in d.input_changes:
            echo(f"          deployment {text}")
        if d.status == "changed" and d.old_concurrency != d.new_concurrency:
            echo(f"          max concurrency {d.old_concurrency:g} -> {d.new_concurrency:g}")
        for w in d.warnings_added:
            echo(f"          + warning: {w}")
    changed = sum(d.status == "changed" for d in diffs)
    echo(f"{len(diffs)} {noun(len(diffs), 'deployment')}, {changed} {noun(changed, 'decision')} changed")


def _change_text(c: Any) -> str:
    by = c.new_by if c.old_by == c.new_by else f"{c.old_by} -> {c.new_by}"
    return f"{c.field}: {_value(c.old)} -> {_value(c.new)} ({by}: {c.reason})"


def _diff_json(d: Any) -> dict[str, Any]:
    data = dict(vars(d))
    data["changes"] = [vars(c) for c in d.changes]
    return data
