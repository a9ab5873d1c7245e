"""A policy checked against what the rules stage defines: fact paths, thresholds and KV dtypes.

`load_policy` is `read_policy` (schema, `extends`, merge) plus these checks, each
problem at the line that names the unknown fact, threshold or dtype; commands,
the service and the policy tools load policies through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvpolicy.errors import PolicyError, did_you_mean
from kvpolicy.facts.build import FACTS
from kvpolicy.formats import FORMATS
from kvpolicy.inputs.policy_loader import LoadedPolicy, Reader, read_policy
from kvpolicy.inputs.policy_schema import Policy
from kvpolicy.inputs.policy_sources import Sources
from kvpolicy.inputs.yamlio import Problem, located_error
from kvpolicy.rules.engine import fact_paths, placeholder_paths, threshold_refs


def load_policy(spec: str | Path | None = None, *, read: Reader | None = None) -> LoadedPolicy:
    """Load a policy by path or `builtin:NAME` (default: the built-in policy).

    Raises PolicyError or InputError (exit code 2) with file:line:col for every
    problem: malformed YAML, schema errors, unknown keys, missing or circular
    `extends`, unknown facts, thresholds, dtypes or rule ids. `read` replaces
    the file reader (e.g. to read a git revision).
    """
    loaded = read_policy(spec, read=read)
    _check_references(loaded)
    return loaded


@dataclass
class Reference:
    """A name a policy uses that does not exist (a fact, threshold or KV dtype)."""

    owner: str
    """rule, pin or defaults."""
    name: str
    """Rule id or pin name ("" for defaults)."""
    key: str
    """The YAML key that holds the name: fact, threshold, kv_cache_dtype, or warn/advise (a template)."""
    value: str
    """The unknown name."""
    message: str
    """What is wrong, with the closest known names."""


def reference_problems(policy: Policy) -> list[Reference]:
    """Unknown facts (in conditions and in `warn`/`advise` templates), thresholds and dtypes a policy names."""
    problems: list[Reference] = []
    conds = [("rule", r.id, r.when) for r in policy.rules] + [("pin", p.name, p.when) for p in policy.pins]
    for owner, name, cond in conds:
        for path in fact_paths(cond):
            if path not in FACTS:
                problems.append(Reference(owner, name, "fact", path, f"{owner} {name}: unknown fact `{path}`."
                                          f"{did_you_mean(path, FACTS)} `kvpolicy facts` lists them."))
        for ref in threshold_refs(cond):
            if ref not in policy.thresholds:
                problems.append(Reference(owner, name, "threshold", ref, f"{owner} {name}: unknown threshold `{ref}`."
                                          f"{did_you_mean(ref, policy.thresholds)} Define it under `thresholds:`."))
    for r in policy.rules:
        for key in ("warn", "advise"):
            for path in dict.fromkeys(p for text in getattr(r, key) for p in placeholder_paths(text)):
                if path not in FACTS:
                    problems.append(Reference("rule", r.id, key, path, f"rule {r.id}: `{key}:` names unknown fact "
                                              f"`{{{path}}}` (it would print as None).{did_you_mean(path, FACTS)} "
                                              "`kvpolicy facts` lists them."))
    patches = [("rule", r.id, r.then) for r in policy.rules] + [("pin", p.name, p.set) for p in policy.pins]
    patches.append(("defaults", "", policy.defaults))
    for owner, name, patch in patches:
        dtype = patch.kv_cache_dtype
        if dtype is not None and dtype not in FORMATS:
            where = f"{owner} {name}".strip()
            problems.append(Reference(owner, name, "kv_cache_dtype", dtype, f"{where}: unknown kv_cache_dtype "
                                      f"`{dtype}`.{did_you_mean(dtype, FORMATS)} Allowed: {', '.join(FORMATS)}."))
    return problems


def check_references(policy: Policy) -> None:
    """Raise PolicyError for unknown facts, thresholds or dtypes a policy names."""
    problems = reference_problems(policy)
    if problems:
        raise PolicyError("\n".join(p.message for p in problems))


def _check_references(loaded: LoadedPolicy) -> None:
    """Unknown facts, thresholds and dtypes, each with the line that names it."""
    refs = reference_problems(loaded.policy)
    if not refs:
        return
    src = Sources.of(loaded)
    problems = []
    for ref in refs:
        if ref.owner == "rule":
            found = src.item("rules", "id", ref.name)
        elif ref.owner == "pin":
            found = src.item("pins", "name", ref.name)
        else:
            found = next(((n, ("defaults",)) for n in loaded.chain
                          if isinstance(loaded.raw.get(n), dict) and "defaults" in loaded.raw[n]), None)
        if found is None:
            problems.append(Problem(loaded.chain[0], ref.message, kind="reference"))
            continue
        where = src.find(found[0], found[1], ref.key, ref.value)
        problems.append(src.problem(where, ref.message))
    raise located_error(problems)
