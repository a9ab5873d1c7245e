"""Policies that are loaded and dropped are freed: what later stages derive from one lives on it.

`kvpolicy serve` loads a new policy object on every reload; if the compiled rules,
the evidence look-ups or the layouts kept a reference to it in a module-level
cache, every version ever served would stay in memory.
"""

from __future__ import annotations

import gc
import weakref

from kvpolicy.inputs.catalog import load_gpus, load_models
from kvpolicy.inputs.workload import make_workload
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.validate import load_policy
from kvpolicy.service.reload import validate


def _use(loaded) -> str:
    """Fill every per-policy table: decide, estimate, look up kernel figures and recoveries."""
    models, gpus = load_models(), load_gpus()
    rec = recommend(models["gpt-oss-20b"], gpus["h200"], make_workload(loaded, context="128k"), loaded)
    recommend(models["deepseek-v3"], gpus["b200"], make_workload(loaded, tp=8), loaded)
    assert loaded.policy.derived, "nothing was derived: the test would not see a leak"
    return rec.decision.kv_cache_dtype


def test_loaded_and_dropped_policies_are_garbage_collected(tmp_path):
    team = tmp_path / "team.yaml"
    refs = []
    for i in range(6):
        team.write_text(f"extends: builtin:default\nname: team-{i}\n")
        loaded = load_policy(team)
        assert _use(loaded) == "fp8"
        refs.append(weakref.ref(loaded.policy))
        del loaded
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)


def test_policies_the_service_replaces_are_freed():
    """`kvpolicy serve`'s reload path (load, check, smoke-evaluate on every attention kind and generation)."""
    refs = []
    for _ in range(4):
        loaded = validate("builtin:default")
        refs.append(weakref.ref(loaded.policy))
        del loaded
    gc.collect()
    assert all(r() is None for r in refs)


def test_derived_tables_are_per_policy_object():
    """Two loads of the same file are two objects with their own tables (nothing keyed by id() to collide)."""
    a, b = load_policy(), load_policy()
    _use(a)
    assert a.policy.derived and not b.policy.derived
    _use(b)
    assert b.policy.derived.keys() == a.policy.derived.keys()
    assert all(b.policy.derived[k] is not a.policy.derived[k] for k in a.policy.derived)
