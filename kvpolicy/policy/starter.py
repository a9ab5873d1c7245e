"""`kvpolicy init`: a commented starter policy and its tests, with editor validation.

The files come from `kvpolicy/policy/examples/starter/` (linted and tested with the
built-in policy, so the starter never rots). Their first line points editors at
the JSON Schema (`# yaml-language-server: $schema=...`). The reference must work
offline and on every clone, so it is a relative path: to the repository's own
`schemas/policy.schema.json` when one exists in this folder or above it, or else
to a copy generated from the installed kvpolicy into `.kvpolicy/` (commit it;
`kvpolicy schema --out .kvpolicy` refreshes it after an upgrade). `--schema-ref`
takes a URL instead, e.g. a pinned raw GitHub URL.
"""

from __future__ import annotations

import json
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any

from kvpolicy.errors import InputError
from kvpolicy.inputs.yamlio import write_text_atomic

POLICY_FILE = "kvpolicy.yaml"
TEST_FILE = "kvpolicy_test.yaml"
SCHEMA_DIR = ".kvpolicy"
_SCHEMA_LINE = re.compile(r"^# yaml-language-server: \$schema=.*$", re.M)


def policy_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schemas of a policy file and of its `*_test.yaml`, by published file name."""
    from kvpolicy.inputs.policy_schema import Policy
    from kvpolicy.outputs.fielddocs import json_schema
    from kvpolicy.policy.testcases import PolicyTestFile

    return {
        "policy.schema.json": json_schema(Policy, "kvpolicy policy file"),
        "policy-test.schema.json": json_schema(PolicyTestFile, "kvpolicy policy test file (*_test.yaml)"),
    }


def _template(name: str) -> str:
    return (resources.files("kvpolicy.policy") / "examples" / "starter" / name).read_text(encoding="utf-8")


def _default_name(folder: Path) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", folder.resolve().name.lower()).strip("-")
    return slug or "my-team"


def _find_repo_schemas(folder: Path) -> Path | None:
    """`schemas/` holding policy.schema.json in `folder` or a parent (stopping at a repository root)."""
    current = folder.resolve()
    for _ in range(8):
        candidate = current / "schemas" / "policy.schema.json"
        if candidate.is_file():
            return candidate.parent
        if (current / ".git").exists() or current.parent == current:
            return None
        current = current.parent
    return None


def _refs(folder: Path, schema_ref: str | None, force: bool) -> tuple[str | None, str | None, list[tuple[Path, str]]]:
    """($schema for the policy, for the tests, schema files to write)."""
    if schema_ref:
        test_ref = schema_ref.replace("policy.schema.json", "policy-test.schema.json")
        return schema_ref, test_ref if test_ref != schema_ref else None, []
    repo = _find_repo_schemas(folder)
    if repo is not None:
        rel = Path(os.path.relpath(repo, folder.resolve())).as_posix()
        test = repo / "policy-test.schema.json"
        return f"{rel}/policy.schema.json", f"{rel}/policy-test.schema.json" if test.is_file() else None, []
    published = policy_schemas()
    writes = []
    for name in ("policy.schema.json", "policy-test.schema.json"):
        path = folder / SCHEMA_DIR / name
        if force or not path.exists():
            writes.append((path, json.dumps(published[name], indent=2) + "\n"))
    return f"{SCHEMA_DIR}/policy.schema.json", f"{SCHEMA_DIR}/policy-test.schema.json", writes


def _with_schema(text: str, ref: str | None) -> str:
    line = f"# yaml-language-server: $schema={ref}" if ref else ""
    out = _SCHEMA_LINE.sub(line, text, count=1)
    return out.lstrip("\n") if not ref else out


def _yaml_name(name: str) -> str:
    """`name` as one YAML scalar: plain when safe, else double-quoted (a quote or newline never adds keys)."""
    if not name.strip() or len(name) > 200 or any(ord(c) < 32 or c == "\x7f" for c in name):
        raise InputError(f"--name {name[:60]!r}: a policy name is one line of at most 200 printable characters.")
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\- ]*", name) and not name.endswith(" "):
        return name
    return json.dumps(name, ensure_ascii=False)


def write_starter(folder: Path, *, force: bool = False, name: str | None = None,
                  schema_ref: str | None = None) -> list[str]:
    """Write kvpolicy.yaml and kvpolicy_test.yaml into `folder` (never over existing files unless `force`)."""
    if not folder.is_dir():
        raise InputError(f"{folder}: no such folder. Create it first, or pass an existing --dir.")
    targets = [folder / POLICY_FILE, folder / TEST_FILE]
    existing = [str(p) for p in targets if p.exists()]
    if existing and not force:
        raise InputError(f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; kvpolicy init "
                         "never overwrites. Edit the file, or rerun with --force to replace it.")
    policy_ref, test_ref, schema_files = _refs(folder, schema_ref, force)
    policy_text = _with_schema(_template(POLICY_FILE), policy_ref)
    policy_text = re.sub(r"^name: .*$", lambda _: f"name: {_yaml_name(name or _default_name(folder))}", policy_text,
                         count=1, flags=re.M)
    test_text = _with_schema(_template(TEST_FILE), test_ref)
    from kvpolicy.inputs.safeio import check_writable

    for path in [*targets, *(p for p, _ in schema_files)]:  # refuse before the first file changes
        if path.parent.is_dir():
            check_writable(path, force=True, what="starter file")
    lines = []
    for path, text in schema_files:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
        lines.append(f"wrote {path} (JSON Schema for editors; commit it)")
    write_text_atomic(targets[0], policy_text)
    lines.append(f"wrote {targets[0]} (extends builtin:default; one deployment)")
    write_text_atomic(targets[1], test_text)
    lines.append(f"wrote {targets[1]} (policy unit tests)")
    lines.append("next: kvpolicy lint && kvpolicy test && kvpolicy check")
    return lines
