"""Read a policy file: parse, resolve `extends`, merge, validate against the schema.

Each file is validated on its own first (so errors point at its lines), then
merged, then the merged policy is validated and the rule ids in `disable`/`order`
are checked. Names the rules stage defines (facts, dtypes) are checked by
`rules.validate.load_policy`, which is what commands call.

Merge rules (child = the extending file):
- thresholds: per name, the child's keys replace the parent's, `values` merge
  key by key, and a child `value` alone turns a keyed threshold into one number;
- rules: the child's new rules come first, a child rule with an inherited id
  replaces that rule in place; `disable:` switches rules off; `order:` moves
  rules to the front in the order given;
- evidence: union, the child's entry wins on the same id;
- pins: parent's then child's; constraints: forbid lists united, the highest
  `min_accuracy_floor` kept; deployments: the child's own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpolicy.errors import KvPolicyError, PolicyError, did_you_mean
from kvpolicy.inputs.datacache import PACKAGE_DIR, builtin_data
from kvpolicy.inputs.policy_schema import Policy, PolicyLayer
from kvpolicy.inputs.yamlio import (
    Problem,
    load_roundtrip,
    load_safe,
    located_error,
    position,
    read_text,
    to_plain,
    validation_problems,
)

Reader = Callable[[Path], str]
"""Reads a policy file's text (the working tree by default; `kvpolicy diff` reads git revisions)."""

BUILTIN = "builtin:"
DEFAULT_POLICY = "builtin:default"

EXTENDS_ANYWHERE: ContextVar[bool] = ContextVar("extends_anywhere", default=False)
"""True lets `extends:` leave the policy's repository (the CLI's --allow-extends-outside sets it).

Off by default: a policy from a pull request must not read (and echo the keys of) any
file on the machine that runs it."""


def extends_root(first: Path) -> Path:
    """The folder `extends:` paths must stay in: the git work tree holding `first`, else its folder."""
    folder = first.resolve().parent
    for candidate in (folder, *folder.parents):
        if (candidate / ".git").exists():
            return candidate
    return folder


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
    except ValueError:
        return False
    return True


@dataclass
class LoadedPolicy:
    """A validated, merged policy and where its parts came from."""

    policy: Policy
    """The merged policy."""
    chain: list[str]
    """Files read, the requested one first, then what it extends."""
    content_hash: str
    """sha256 (12 hex digits) over the raw text of every file in the chain."""
    raw: dict[str, Any] = field(default_factory=dict)
    """Round-trip YAML of each file by name (for positions in lint and errors)."""

    @property
    def label(self) -> str:
        """`name@hash` as shown in outputs."""
        return f"{self.policy.name}@{self.content_hash}"


def _builtin_root() -> Path:
    # The built-in policies are the rules stage's data (kvpolicy/rules/*.yaml), read as package files:
    # no module of the rules stage is imported (nor importlib.resources: kvpolicy is installed as files).
    return PACKAGE_DIR / "rules"


def builtin_names() -> list[str]:
    """Names of the built-in policies."""
    root = _builtin_root()
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def _builtin_text(name: str) -> str:
    root = _builtin_root()
    f = root / f"{name}.yaml"
    if not f.is_file():
        raise PolicyError(
            f"`{BUILTIN}{name}`: no such built-in policy. Available: "
            + ", ".join(f"{BUILTIN}{n}" for n in builtin_names())
        )
    return f.read_text(encoding="utf-8")


def _read(spec: str, base: Path | None, read: Reader, root: Path | None = None) -> tuple[str, str, Path | None]:
    """(display name, text, folder for relative extends) of a policy reference."""
    if spec.startswith(BUILTIN):
        name = spec[len(BUILTIN):]
        return spec, _builtin_text(name), None
    path = Path(spec)
    if base is not None and not path.is_absolute():
        path = base / path
    if root is not None and not _inside(path, root):
        raise PolicyError(f"{path} is outside {root}, the policy's git work tree (or folder); `extends:` stays inside it "
                          "(pass --allow-extends-outside to allow it).")
    if base is not None and read is read_text:
        if not path.exists():
            raise PolicyError(f"no such file {path}.")
        if path.is_dir():
            raise PolicyError(f"{path} is a folder, not a policy file.")
    return str(path), read(path), path.parent


def read_policy(spec: str | Path | None = None, *, read: Reader | None = None) -> LoadedPolicy:
    """Read a policy by path or `builtin:NAME` (default: the built-in policy), without checking its names.

    Raises PolicyError or InputError (exit code 2) with file:line:col for every
    problem: malformed YAML, schema errors, unknown keys, missing or circular
    `extends`, unknown rule ids. `read` replaces the file reader (e.g. to read a
    git revision).
    """
    spec = str(spec) if spec is not None else DEFAULT_POLICY
    reader = read or read_text
    chain: list[str] = []
    texts: list[str] = []
    raws: dict[str, Any] = {}
    layers: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    base: Path | None = None
    root: Path | None = None
    current: str | None = spec
    while current is not None:
        referrer = layers[-1] if layers else None
        try:
            name, text, folder = _read(current, base, reader, root)
        except KvPolicyError as exc:
            if referrer is None:
                raise
            raise _at_extends(referrer, f"`extends: {current}`: {exc} Fix the path (relative to the folder of "
                                        f"{referrer[0]}) or use `builtin:default`.", type(exc)) from None
        key = name if name.startswith(BUILTIN) else str(Path(name).resolve())
        if key in seen and referrer is not None:
            cycle = " -> ".join(chain + [name])
            raise _at_extends(referrer, f"circular `extends`: {cycle}. Remove the `extends:` that closes the loop.")
        seen.add(key)
        chain.append(name)
        texts.append(text)
        if name.startswith(BUILTIN):
            data = builtin_data(_builtin_root() / f"{name[len(BUILTIN):]}.yaml", text,
                                lambda t, where=name: load_safe(t, where))
        else:
            data = load_roundtrip(text, name)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise located_error([Problem(name, f"a policy file must be a YAML mapping (found {type(data).__name__}); "
                                         "start from `kvpolicy init`.", 1, 1)])
        raws[name] = data
        layers.append((name, data))
        ext = data.get("extends")
        if ext is not None and (not isinstance(ext, str) or not ext.strip()):
            raise _at_extends((name, data), "`extends` must name a policy, such as `builtin:default` or "
                                            f"`../base.yaml` (found {ext!r}).")
        # Each file on its own first, so that errors point at the right file and line.
        alone = _validate(to_plain(data), data, name, PolicyLayer if ext is not None else Policy)
        if root is None and folder is not None and not EXTENDS_ANYWHERE.get():
            root = extends_root(Path(name))
        base = folder
        current = ext

    # Merge from the root of the chain down to the requested file.
    merged: dict[str, Any] = {}
    for index in range(len(layers) - 1, -1, -1):
        name, data = layers[index]
        plain = to_plain(data)
        _check_rule_ids(plain, merged.get("rules") or [], name, data)
        merged = plain if index == len(layers) - 1 else _merge(merged, plain)
    merged.pop("extends", None)
    if len(layers) > 1:
        merged["extends"] = layers[0][1].get("extends")

    # A file that extends nothing is its own merged policy: validated above already.
    policy = alone if len(layers) == 1 else _validate(merged, layers[0][1], chain[0], Policy)
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:12]
    return LoadedPolicy(policy=policy, chain=chain, content_hash=digest, raw=raws)


def _at_extends(layer: tuple[str, Any], message: str, cls: type[KvPolicyError] = PolicyError) -> KvPolicyError:
    name, data = layer
    pos = position(data, ("extends",))
    return located_error([Problem(name, message, pos[0] if pos else None, pos[1] if pos else None, kind="extends")],
                         cls)


def _check_rule_ids(child: dict[str, Any], inherited: list[Any], name: str, raw: Any) -> None:
    """`disable:` and `order:` must name rules that exist (a typo would silently keep a rule on)."""
    known = [r.get("id") for r in list(inherited) + list(child.get("rules") or []) if isinstance(r, dict)]
    problems = []
    for section in ("disable", "order"):
        for i, rid in enumerate(child.get(section) or []):
            if rid not in known:
                pos = position(raw, (section, i))
                problems.append(Problem(name, f"{section}: unknown rule id `{rid}`.{did_you_mean(str(rid), known)} "
                                        "`kvpolicy rule` lists the rules.", pos[0] if pos else None,
                                        pos[1] if pos else None, kind="reference"))
    if problems:
        raise located_error(problems)


def _validate(plain: dict[str, Any], raw: Any, where: str, model: type[Policy]) -> Policy:
    from pydantic import ValidationError

    try:
        return model.model_validate(plain)
    except ValidationError as exc:
        raise located_error(validation_problems(exc, raw, where, model)) from None


def _merge(parent: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    out = dict(parent)
    for key in ("version", "name", "description"):
        if key in child:
            out[key] = child[key]

    thresholds = {k: dict(v) for k, v in (parent.get("thresholds") or {}).items()}
    for k, v in (child.get("thresholds") or {}).items():
        patch = {key: val for key, val in (v or {}).items() if val is not None}
        old = thresholds.get(k, {})
        if "value" in patch and "by" not in patch and "values" not in patch:
            # One number replaces a keyed threshold outright.
            old = {key: val for key, val in old.items() if key not in ("by", "values", "default")}
        new = dict(old)
        for key, val in patch.items():
            if key == "values" and isinstance(old.get("values"), dict):
                new["values"] = {**old["values"], **val}
            else:
                new[key] = val
        thresholds[k] = new
    out["thresholds"] = thresholds

    out["defaults"] = {**(parent.get("defaults") or {}), **(child.get("defaults") or {})}

    inherited = list(parent.get("rules") or [])
    index = {r.get("id"): i for i, r in enumerate(inherited)}
    fresh = []
    for r in child.get("rules") or []:
        if r.get("id") in index:
            inherited[index[r.get("id")]] = r
        else:
            fresh.append(r)
    rules = [dict(r) for r in fresh + inherited]
    disabled = set(child.get("disable") or [])
    for r in rules:
        if r.get("id") in disabled:
            r["enabled"] = False
    front = list(child.get("order") or [])
    by_id = {r.get("id"): r for r in rules}
    moved = [by_id[rid] for rid in front if rid in by_id]
    rules = moved + [r for r in rules if r.get("id") not in front]
    out["rules"] = rules
    out["disable"] = sorted(set(parent.get("disable") or []) | disabled)
    out["order"] = front

    evidence = {e.get("id"): e for e in (parent.get("evidence") or [])}
    for e in child.get("evidence") or []:
        evidence[e.get("id")] = e
    out["evidence"] = list(evidence.values())

    out["pins"] = list(parent.get("pins") or []) + list(child.get("pins") or [])
    pc, cc = parent.get("constraints") or {}, child.get("constraints") or {}
    forbid = {k: list(v) for k, v in (pc.get("forbid") or {}).items()}
    for k, v in (cc.get("forbid") or {}).items():
        forbid[k] = sorted(set(forbid.get(k, [])) | set(v or []))
    floors = [f for f in (pc.get("min_accuracy_floor"), cc.get("min_accuracy_floor")) if f is not None]
    out["constraints"] = {"forbid": forbid, **({"min_accuracy_floor": max(floors)} if floors else {})}
    out["deployments"] = list(child.get("deployments") or [])
    return out
