"""Every model field is documented (vLLM's convention): the docs and schemas are generated from it."""

from __future__ import annotations

import pytest

from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.inputs.policy_schema import Policy
from kvpolicy.outputs.fielddocs import attach_docstrings, field_docstrings, model_tree
from kvpolicy.rules.decision import Recommendation

ROOTS = [Policy, Recommendation, ModelArch, GpuSpec]


@pytest.mark.parametrize("model", [m for root in ROOTS for m in model_tree(root)], ids=lambda m: m.__name__)
def test_every_field_has_a_docstring(model):
    docs: dict[str, str] = {}
    for klass in reversed(model.__mro__):
        if klass.__module__.startswith("kvpolicy"):
            docs.update(field_docstrings(klass))
    missing = [name for name in model.model_fields if not docs.get(name)]
    assert not missing, f"{model.__name__}: fields without a docstring: {missing}"


def test_schema_carries_the_docstrings():
    attach_docstrings(Policy)
    schema = Policy.model_json_schema(by_alias=True)
    assert schema["properties"]["rules"]["description"] == "Rules in evaluation order."
    rule = schema["$defs"]["Rule"]["properties"]
    assert rule["id"]["description"].startswith("Permanent id")
