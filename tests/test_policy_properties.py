"""Property tests: generated policies and inputs never crash the engine, and decisions are deterministic.

Either a decision comes out or a KvPolicyError says why not (the CLI turns it into
exit code 2 with a message); any other exception is a bug.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvpolicy.errors import InputError, KvPolicyError
from kvpolicy.facts.build import FACTS
from kvpolicy.formats import FORMATS
from kvpolicy.inputs.catalog import load_gpus, load_models, resolve_gpu, resolve_model
from kvpolicy.inputs.policy_schema import DECISION_FIELDS
from kvpolicy.inputs.workload import make_workload
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.engine import decide
from kvpolicy.rules.validate import load_policy

BUILTIN = load_policy()
RULE_IDS = [r.id for r in BUILTIN.policy.rules]
THRESHOLDS = list(BUILTIN.policy.thresholds)
MODELS = sorted(load_models())
GPUS = sorted(load_gpus())
WORKDIR = Path(tempfile.mkdtemp(prefix="kvpolicy-props-"))
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 2_000_000),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["hopper", "blackwell", "ampere", "mla", "gqa", "llama", "kimi", "fp8", "auto"]))
numbers = st.one_of(st.integers(0, 2_000_000), st.floats(-1, 2e6, allow_nan=False))

compare = st.builds(
    lambda fact, op, value: {"fact": fact, "op": op, "value": value},
    st.sampled_from(sorted(FACTS)),
    st.sampled_from(["eq", "ne", "lt", "le", "gt", "ge", "in", "not_in", "exists", "glob"]),
    st.one_of(scalars, st.lists(scalars, max_size=3), st.builds(lambda t: {"threshold": t}, st.sampled_from(THRESHOLDS)),
              st.builds(lambda f: {"fact": f}, st.sampled_from(sorted(FACTS)))),
)
conditions = st.recursive(compare, lambda inner: st.one_of(
    st.builds(lambda xs: {"all": xs}, st.lists(inner, min_size=1, max_size=3)),
    st.builds(lambda xs: {"any": xs}, st.lists(inner, min_size=1, max_size=3)),
    st.builds(lambda x: {"not": x}, inner)), max_leaves=5)
field_values = {
    "kv_cache_dtype": st.sampled_from(sorted(FORMATS)),
    "skip_layers": st.one_of(st.just([]), st.just(["sliding_window"]), st.lists(st.integers(0, 80), max_size=3)),
    "two_level_accumulation": st.sampled_from(["on", "off", "not_applicable"]),
    "scale_source": st.sampled_from(["uncalibrated", "checkpoint_per_tensor", "checkpoint_per_head", "per_token_head"]),
    "attention_backend": st.sampled_from([None, "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLASHMLA", "TURBOQUANT"]),
}
patches = st.fixed_dictionaries({}, optional=field_values)
rules = st.builds(
    lambda i, when, then, enabled: {"id": f"GEN{i:03d}", "name": f"gen-{i}", "statement": "generated",
                                    "when": when, "then": then, "enabled": enabled, "evidence": ["fp8-capacity"]},
    st.integers(0, 999), st.one_of(st.none(), conditions), patches, st.booleans())
pins = st.builds(lambda i, when, then: {"name": f"pin-{i}", "when": when, "set": then},
                 st.integers(0, 99), conditions, patches)
threshold_overrides = st.dictionaries(st.sampled_from(THRESHOLDS), st.one_of(
    st.builds(lambda v: {"value": v}, numbers),
    st.builds(lambda v: {"values": {"hopper": v}}, numbers)), max_size=3)
layers = st.fixed_dictionaries(
    {"extends": st.just("builtin:default"), "name": st.just("generated")},
    optional={
        "thresholds": threshold_overrides,
        "rules": st.lists(rules, max_size=4, unique_by=lambda r: r["id"]),
        "disable": st.lists(st.sampled_from(RULE_IDS), max_size=6, unique=True),
        "order": st.lists(st.sampled_from(RULE_IDS), max_size=6, unique=True),
        "pins": st.lists(pins, max_size=3, unique_by=lambda p: p["name"]),
        "defaults": patches,
        "constraints": st.fixed_dictionaries({}, optional={
            "forbid": st.dictionaries(st.sampled_from(list(DECISION_FIELDS)),
                                      st.lists(st.sampled_from(["turboquant_*", "fp8*", "auto", "on", "*"]), max_size=2),
                                      max_size=2),
            "min_accuracy_floor": st.floats(0.01, 1.0)}),
    })
inputs = st.fixed_dictionaries({
    "model": st.sampled_from(MODELS), "gpu": st.sampled_from(GPUS),
    "context": st.integers(1, 2_000_000), "priority": st.sampled_from(["decode", "prefill", "balanced"]),
    "concurrency": st.integers(1, 512), "tp": st.sampled_from([1, 2, 4, 8]),
    "accuracy_floor": st.one_of(st.none(), st.floats(0.5, 1.0)),
})


def load_layer(layer: object) -> object:
    """Write a generated layer (JSON is YAML) and load it; KvPolicyError is an acceptable answer."""
    path = WORKDIR / "generated.yaml"
    path.write_text(json.dumps(layer))
    return load_policy(path)


def evaluate(loaded: object, spec: dict) -> object:
    arch, gpu = resolve_model(spec["model"]), resolve_gpu(spec["gpu"])
    workload = make_workload(loaded, context=spec["context"], priority=spec["priority"],  # type: ignore[arg-type]
                             concurrency=spec["concurrency"], tp=spec["tp"], accuracy_floor=spec["accuracy_floor"])
    return recommend(arch, gpu, workload, loaded)  # type: ignore[arg-type]


def outcome(loaded: object, spec: dict) -> object:
    try:
        return evaluate(loaded, spec).model_dump()  # type: ignore[attr-defined]
    except KvPolicyError as exc:
        return ("error", type(exc).__name__, str(exc))


@SETTINGS
@given(layers, st.lists(inputs, min_size=1, max_size=3))
def test_generated_policies_decide_or_say_why_and_are_deterministic(layer, specs):
    try:
        loaded = load_layer(layer)
    except KvPolicyError as exc:
        assert str(exc)  # a message, never an empty error
        return
    for spec in specs:
        first = outcome(loaded, spec)
        again = outcome(load_layer(layer), spec)
        assert first == again
        if isinstance(first, dict):
            decision = first["decision"]
            for field, patterns in loaded.policy.constraints.forbid.items():  # type: ignore[attr-defined]
                value = decision[field]
                import fnmatch

                values = value if isinstance(value, list) else [value]
                assert not any(fnmatch.fnmatchcase(str(v), p) for v in values for p in patterns), (field, value)


@SETTINGS
@given(inputs)
def test_builtin_policy_always_decides_for_catalog_inputs(spec):
    first = outcome(BUILTIN, spec)
    assert first == outcome(BUILTIN, spec)
    if isinstance(first, tuple):
        # Only input problems are acceptable here (a floor below a constraint, a context or TP vLLM refuses),
        # never policy errors.
        assert first[1] in ("InputError", "LimitError"), first


json_data = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=8)
policy_keys = st.sampled_from(["version", "name", "thresholds", "defaults", "rules", "disable", "order", "evidence",
                               "pins", "constraints", "deployments", "extends", "bogus"])


@SETTINGS
@given(st.dictionaries(policy_keys, json_data, max_size=4))
def test_arbitrary_structures_never_crash_the_loader(doc):
    try:
        load_layer(doc)
    except KvPolicyError as exc:
        assert str(exc)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
@example("=")  # YAML 1.1's value tag: a scalar without a position
def test_arbitrary_text_never_crashes_the_loader(text):
    path = WORKDIR / "text.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_policy(path)
    except KvPolicyError as exc:
        assert str(exc)


@SETTINGS
@given(st.dictionaries(st.sampled_from(sorted(FACTS)), scalars, max_size=12))
def test_engine_on_arbitrary_facts(facts):
    try:
        a = decide(BUILTIN.policy, facts)
    except KvPolicyError:
        return
    b = decide(BUILTIN.policy, facts)
    assert a.decision == b.decision and a.trace == b.trace


def test_a_head_size_fact_that_is_no_number_is_an_input_error():
    """A policy test case may write any facts: a head size that is not a number is named, not a traceback."""
    with pytest.raises(InputError, match="model.head_dim"):
        decide(BUILTIN.policy, {"model.attention": False, "model.head_dim": False})
