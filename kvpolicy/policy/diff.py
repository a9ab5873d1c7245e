"""`kvpolicy diff`: what a policy change does to each deployment's decision, and why.

The two sides are files, or one file at a git revision (`team.yaml@HEAD~1`), read
with `git show REV:./path` through an argument list (no shell). Files the old
revision `extends` are read at the same revision; built-in policies come from the
installed kvpolicy.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpolicy.errors import InputError, KvPolicyError
from kvpolicy.inputs.policy_loader import LoadedPolicy, Reader
from kvpolicy.inputs.policy_schema import DECISION_FIELDS, Deployment, Policy
from kvpolicy.rules.validate import load_policy


def split_revision(spec: str) -> tuple[str, str | None]:
    """`team.yaml@HEAD~1` -> (`team.yaml`, `HEAD~1`); a path that exists as written is never split."""
    if "@" in spec and not Path(spec).exists():
        path, rev = spec.rsplit("@", 1)
        if path and rev:
            return path, rev
    return spec, None


_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./~^@{}:+-]{0,199}")
"""What a commit, branch, tag or `HEAD~1`-style expression looks like; never an option (no leading `-`)."""


def check_revision(rev: str) -> str:
    """`rev` if it can only be a revision; git is also handed it after `--end-of-options`."""
    if not _REVISION.fullmatch(rev) or ".." in rev or ":" in rev:
        raise InputError(f"`{rev[:80]}` is not a git revision kvpolicy accepts: use a commit, branch or tag "
                         "(letters, digits and _ . / ~ ^ @ { } + -, not starting with `-`), e.g. HEAD~1.")
    return rev


def git_reader(rev: str) -> Reader:
    """A Reader that returns a file's text at git revision `rev`."""
    check_revision(rev)

    def read(path: Path) -> str:
        folder = path.parent if str(path.parent) else Path(".")
        rel = Path(path.name)
        while not folder.is_dir() and folder != folder.parent:
            rel = Path(folder.name) / rel
            folder = folder.parent
        try:
            proc = subprocess.run(["git", "show", "--end-of-options", f"{rev}:./{rel.as_posix()}"],
                                  cwd=folder or ".", capture_output=True, timeout=60, check=False)
        except FileNotFoundError:
            raise InputError("git is not installed (or not on PATH); compare two files instead: "
                             "`kvpolicy diff OLD.yaml NEW.yaml`.") from None
        except (OSError, subprocess.SubprocessError) as exc:
            raise InputError(f"{path}@{rev}: cannot run git ({exc}).") from None
        if proc.returncode == 0:
            from kvpolicy.inputs.safeio import MAX_POLICY_BYTES, decode_utf8

            if len(proc.stdout) > MAX_POLICY_BYTES:
                raise InputError(f"{path}@{rev}: {len(proc.stdout):,} bytes, over the {MAX_POLICY_BYTES:,}-byte "
                                 "limit for a policy file.")
            return decode_utf8(proc.stdout, f"{path}@{rev}")
        stderr = proc.stderr.decode("utf-8", "replace")
        err = (stderr.strip().splitlines() or ["git show failed"])[-1].removeprefix("fatal: ").rstrip(".")
        if "not a git repository" in err:
            raise InputError(f"{path}@{rev}: {folder.resolve()} is not inside a git repository. Run from a "
                             "checkout, or compare two files: `kvpolicy diff OLD.yaml NEW.yaml`.")
        if "does not exist" in err or "exists on disk, but not in" in err:
            raise InputError(f"{path} does not exist at revision {rev}. Check the path and revision "
                             f"(`git log --oneline -- {path}`).")
        if "invalid object name" in err or "bad revision" in err or "unknown revision" in err:
            raise InputError(f"unknown git revision `{rev}` ({err}). Use a commit, branch or tag, e.g. HEAD~1.")
        raise InputError(f"{path}@{rev}: git show failed: {err}.")

    return read


def load_side(spec: str, rev: str | None = None) -> tuple[str, LoadedPolicy]:
    """(label, policy) of one side of a diff."""
    path, at = split_revision(spec) if rev is None else (spec, rev)
    if at is None:
        return path, load_policy(path)
    return f"{path}@{at}", load_policy(path, read=git_reader(at))


@dataclass
class FieldChange:
    """One decision field that differs."""

    field: str
    old: Any
    new: Any
    old_by: str
    new_by: str
    reason: str = ""


@dataclass
class DeploymentDiff:
    """How one deployment's decision changes."""

    name: str
    status: str
    """changed, unchanged, added, removed or error."""
    changes: list[FieldChange] = field(default_factory=list)
    old_decision: dict[str, Any] | None = None
    new_decision: dict[str, Any] | None = None
    old_concurrency: float | None = None
    new_concurrency: float | None = None
    warnings_added: list[str] = field(default_factory=list)
    warnings_removed: list[str] = field(default_factory=list)
    input_changes: list[str] = field(default_factory=list)
    """Changes to the deployment itself (model, GPU, workload), e.g. `context: 8k -> 4k`."""
    error: str = ""


def _reason(rec: Any, rule_id: str) -> str:
    for o in rec.trace.rules:
        if o.id == rule_id:
            return o.reason
    return "pin" if rule_id.startswith("pin:") else "no rule decided it"


def compare_deployment(name: str, old: tuple[LoadedPolicy, Deployment] | None,
                       new: tuple[LoadedPolicy, Deployment] | None) -> DeploymentDiff:
    """Evaluate a deployment on both sides and list what changed."""
    from kvpolicy.policy.deployments import evaluate

    recs: list[Any] = []
    try:
        for side in (old, new):
            recs.append(evaluate(*side) if side is not None else None)
    except KvPolicyError as exc:
        return DeploymentDiff(name, "error", error=str(exc))
    a, b = recs
    out = DeploymentDiff(name, "unchanged")
    if old is not None and new is not None:
        before, after = old[1].model_dump(), new[1].model_dump()
        out.input_changes = [f"{k}: {before[k]} -> {after[k]}" for k in after if before.get(k) != after[k]]
    if a is not None:
        out.old_decision = a.decision.model_dump()
        out.old_concurrency = a.estimates.max_concurrency.value
    if b is not None:
        out.new_decision = b.decision.model_dump()
        out.new_concurrency = b.estimates.max_concurrency.value
    if a is None or b is None:
        out.status = "added" if a is None else "removed"
        return out
    for f in DECISION_FIELDS:
        ov, nv = out.old_decision[f], out.new_decision[f]
        oby, nby = a.trace.fields[f].decided_by, b.trace.fields[f].decided_by
        if ov != nv:
            out.changes.append(FieldChange(f, ov, nv, oby, nby, _reason(b, nby)))
    out.warnings_added = [w for w in b.warnings if w not in a.warnings]
    out.warnings_removed = [w for w in a.warnings if w not in b.warnings]
    if out.changes:
        out.status = "changed"
    return out


def compare(old: LoadedPolicy, new: LoadedPolicy, extra: list[Deployment] | None = None) -> list[DeploymentDiff]:
    """Every deployment of either side (by name), plus `extra` ones evaluated under both policies."""
    old_deps = {d.name: d for d in old.policy.deployments}
    new_deps = {d.name: d for d in new.policy.deployments}
    diffs = []
    for name, dep in new_deps.items():
        before = (old, old_deps[name]) if name in old_deps else None
        diffs.append(compare_deployment(name, before, (new, dep)))
    for name, dep in old_deps.items():
        if name not in new_deps:
            diffs.append(compare_deployment(name, (old, dep), None))
    for dep in extra or []:
        diffs.append(compare_deployment(dep.name, (old, dep), (new, dep)))
    return diffs


def policy_changes(old: Policy, new: Policy) -> list[str]:
    """What differs between two merged policies, one line each (`+` added, `-` removed, `~` changed)."""
    lines: list[str] = []
    old_rules = {r.id: r for r in old.rules}
    new_rules = {r.id: r for r in new.rules}
    for rid, r in new_rules.items():
        if rid not in old_rules:
            lines.append(f"+ rule {rid} {r.name}: {r.statement}")
            continue
        before = old_rules[rid]
        if before.enabled != r.enabled:
            lines.append(f"~ rule {rid} {'enabled' if r.enabled else 'disabled'}")
        if before.model_dump(exclude={"enabled"}) != r.model_dump(exclude={"enabled"}):
            changed = [k for k in r.model_fields if k != "enabled" and getattr(before, k) != getattr(r, k)]
            lines.append(f"~ rule {rid} changed: {', '.join(changed)}")
    for rid in old_rules:
        if rid not in new_rules:
            lines.append(f"- rule {rid} {old_rules[rid].name}")
    common = [rid for rid in new_rules if rid in old_rules and new_rules[rid].enabled]
    old_order = [rid for rid in old_rules if rid in common]
    if common != old_order:
        moved = [rid for i, rid in enumerate(common) if old_order[i] != rid]
        lines.append(f"~ rule order changed: {', '.join(moved[:8])}{' ...' if len(moved) > 8 else ''} moved")
    for name in sorted(set(old.thresholds) | set(new.thresholds)):
        a, b = old.thresholds.get(name), new.thresholds.get(name)
        if a is None:
            lines.append(f"+ threshold {name}: {_threshold(b)}")
        elif b is None:
            lines.append(f"- threshold {name}")
        elif _threshold(a) != _threshold(b):
            lines.append(f"~ threshold {name}: {_threshold(a)} -> {_threshold(b)}")
    old_pins = {p.name: p for p in old.pins}
    new_pins = {p.name: p for p in new.pins}
    for name in new_pins:
        if name not in old_pins:
            lines.append(f"+ pin {name}: sets {new_pins[name].set.fields()}")
        elif old_pins[name] != new_pins[name]:
            lines.append(f"~ pin {name} changed")
    lines.extend(f"- pin {name}" for name in old_pins if name not in new_pins)
    if old.constraints != new.constraints:
        lines.append(f"~ constraints: {old.constraints.model_dump(exclude_defaults=True)} -> "
                     f"{new.constraints.model_dump(exclude_defaults=True)}")
    if old.defaults.fields() != new.defaults.fields():
        lines.append(f"~ defaults: {old.defaults.fields()} -> {new.defaults.fields()}")
    return lines


def _threshold(t: Any) -> str:
    if t.by is None:
        return f"{t.value:g}"
    values = ", ".join(f"{k} {v:g}" for k, v in t.values.items())
    default = f", default {t.default:g}" if t.default is not None else ""
    return f"by {t.by}: {values}{default}"
