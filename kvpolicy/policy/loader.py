"""Load a policy file: parse, resolve `extends`, merge, validate.

Merge rules (child = the extending file):
- thresholds: per name, the child's keys replace the parent's;
- rules: the child's new rules come first, a child rule with an inherited id
  replaces that rule in place; `disable:` switches rules off; `order:` moves
  rules to the front in the order given;
- evidence: union, the child's entry wins on the same id;
- pins: parent's then child's; constraints: forbid lists united, the highest
  `min_accuracy_floor` kept; deployments: the child's own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from kvpolicy.errors import PolicyError
from kvpolicy.policy.schema import Policy
from kvpolicy.yamlio import format_validation_error, load_roundtrip, load_safe, read_text

BUILTIN = "builtin:"
DEFAULT_POLICY = "builtin:default"


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


def builtin_names() -> list[str]:
    """Names of the built-in policies."""
    root = resources.files("kvpolicy.policies")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def _builtin_text(name: str) -> str:
    root = resources.files("kvpolicy.policies")
    f = root / f"{name}.yaml"
    if not f.is_file():
        raise PolicyError(
            f"`{BUILTIN}{name}`: no such built-in policy. Available: "
            + ", ".join(f"{BUILTIN}{n}" for n in builtin_names())
        )
    return f.read_text(encoding="utf-8")


def _read(spec: str, base: Path | None) -> tuple[str, str, Path | None]:
    """(display name, text, folder for relative extends) of a policy reference."""
    if spec.startswith(BUILTIN):
        name = spec[len(BUILTIN):]
        return spec, _builtin_text(name), None
    path = Path(spec)
    if base is not None and not path.is_absolute():
        path = base / path
    return str(path), read_text(path), path.resolve().parent


def load_policy(spec: str | Path | None = None) -> LoadedPolicy:
    """Load a policy by path or `builtin:NAME` (default: the built-in policy)."""
    spec = str(spec) if spec is not None else DEFAULT_POLICY
    chain: list[str] = []
    texts: list[str] = []
    raws: dict[str, Any] = {}
    layers: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    base: Path | None = None
    current: str | None = spec
    while current is not None:
        name, text, folder = _read(current, base)
        key = name if name.startswith(BUILTIN) else str(Path(name).resolve())
        if key in seen:
            cycle = " -> ".join(chain + [name])
            raise PolicyError(f"circular `extends`: {cycle}. Remove the `extends:` that closes the loop.")
        seen.add(key)
        chain.append(name)
        texts.append(text)
        data = load_safe(text, name) if name.startswith(BUILTIN) else load_roundtrip(text, name)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise PolicyError(f"{name}: a policy file must be a YAML mapping (found {type(data).__name__}).")
        raws[name] = data
        layers.append((name, data))
        ext = data.get("extends")
        if ext is not None and not isinstance(ext, str):
            raise PolicyError(f"{name}: `extends` must be a string such as `builtin:default` or `../base.yaml`.")
        base = folder
        current = ext

    merged: dict[str, Any] = {}
    for name, data in reversed(layers):
        merged = _merge(merged, _plain(data)) if merged else _plain(data)
    merged.pop("extends", None)
    if len(layers) > 1:
        merged["extends"] = layers[0][1].get("extends")

    # Validate each file alone first so that errors point at the right file and line.
    for name, data in layers:
        _validate(_plain(data), data, name, partial=True)
    policy = _validate(merged, layers[0][1], chain[0], partial=False)
    digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:12]
    return LoadedPolicy(policy=policy, chain=chain, content_hash=digest, raw=raws)


def _plain(data: Any) -> Any:
    """Round-trip YAML -> plain dicts and lists."""
    if isinstance(data, dict):
        return {str(k): _plain(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_plain(v) for v in data]
    return data


def _validate(plain: dict[str, Any], raw: Any, where: str, partial: bool) -> Policy:
    from pydantic import ValidationError

    if partial:
        # A file may override only part of an inherited threshold, so thresholds
        # are checked once merged; everything else must stand on its own.
        plain = {k: v for k, v in plain.items() if k != "thresholds"}
    try:
        return Policy.model_validate(plain)
    except ValidationError as exc:
        raise PolicyError(format_validation_error(exc, raw, where, Policy)) from None


def _merge(parent: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    out = dict(parent)
    for key in ("version", "name", "description"):
        if key in child:
            out[key] = child[key]

    thresholds = {k: dict(v) for k, v in (parent.get("thresholds") or {}).items()}
    for k, v in (child.get("thresholds") or {}).items():
        thresholds[k] = {**thresholds.get(k, {}), **(v or {})}
    out["thresholds"] = thresholds

    out["defaults"] = {**(parent.get("defaults") or {}), **(child.get("defaults") or {})}

    inherited = list(parent.get("rules") or [])
    index = {r.get("id"): i for i, r in enumerate(inherited) if isinstance(r, dict)}
    fresh = []
    for r in child.get("rules") or []:
        rid = r.get("id") if isinstance(r, dict) else None
        if rid in index:
            inherited[index[rid]] = r
        else:
            fresh.append(r)
    rules = fresh + inherited
    disabled = set(child.get("disable") or [])
    for r in rules:
        if isinstance(r, dict) and r.get("id") in disabled:
            r["enabled"] = False
    front = [rid for rid in (child.get("order") or [])]
    by_id = {r.get("id"): r for r in rules if isinstance(r, dict)}
    moved = [by_id[rid] for rid in front if rid in by_id]
    rules = moved + [r for r in rules if not (isinstance(r, dict) and r.get("id") in front)]
    out["rules"] = rules
    out["disable"] = sorted(set(parent.get("disable") or []) | disabled)
    out["order"] = front

    evidence = {e.get("id"): e for e in (parent.get("evidence") or []) if isinstance(e, dict)}
    for e in child.get("evidence") or []:
        if isinstance(e, dict):
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
