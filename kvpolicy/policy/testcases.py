"""The `*_test.yaml` file: fixtures and cases with their inputs and expectations (pydantic).

Its JSON Schema is published as `schemas/policy-test.schema.json`; `kvpolicy
init` points the starter test file at it.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvpolicy import new_dict, new_list
from kvpolicy.inputs.policy_schema import Scalar, ScaleSource, TwoLevel


class _Strict(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid", allow_inf_nan=False)


class TestInputs(_Strict):
    """Inputs shared by fixtures and cases; every field is optional and overrides what it is layered on."""

    model: str | None = None
    """Model catalog id, Hugging Face id or local config path (relative to the test file)."""
    gpu: str | None = None
    """GPU catalog id or alias."""
    context: Union[int, str, None] = None
    """Context length (`32k` or a number of tokens)."""
    priority: Literal["decode", "prefill", "balanced"] | None = None
    """decode, prefill or balanced."""
    concurrency: int | None = Field(default=None, gt=0, le=1_000_000)
    """Requests served at once."""
    tp: int | None = Field(default=None, gt=0, le=1024)
    """Tensor-parallel size."""
    accuracy_floor: float | None = Field(default=None, gt=0, le=1)
    """Accuracy floor."""
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """Fraction of GPU memory vLLM may use."""
    deployment: str | None = None
    """Start from this deployment of the policy (its model, GPU and workload)."""
    facts: dict[str, Scalar] = Field(default_factory=new_dict)
    """Fact overrides applied after the facts are built (`kvpolicy facts` lists them); alone, the only facts."""


class Expect(_Strict):
    """What a case expects; decision fields left out are not checked."""

    kv_cache_dtype: str | None = None
    """Expected KV-cache dtype."""
    skip_layers: list[str] | None = None
    """Expected skip layers (`[]` for none)."""
    two_level_accumulation: TwoLevel | None = None
    """Expected two-level accumulation."""
    scale_source: ScaleSource | None = None
    """Expected scale source."""
    attention_backend: str | None = None
    """Expected attention backend (`null` for vLLM's choice)."""
    decided_by: Union[str, dict[str, str], None] = None
    """A rule id that must decide a field (or fire its advice), or field -> rule id / `pin:<name>` / `default`."""
    not_decided_by: list[str] = Field(default_factory=new_list)
    """Rule ids that must not decide any field (nor fire their advice)."""
    warnings: list[str] = Field(default_factory=new_list)
    """Substrings each of which some warning must contain."""
    alternatives: list[str] = Field(default_factory=new_list)
    """Substrings each of which some alternative (advice) must contain."""
    error: str | None = None
    """The evaluation must fail with an error containing this text (e.g. a pin a constraint forbids)."""

    @field_validator("not_decided_by", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("skip_layers", mode="before")
    @classmethod
    def _stringify(cls, v: Any) -> Any:
        return [str(x) for x in v] if isinstance(v, list) else v


class Fixture(TestInputs):
    """Named inputs that cases start from (`fixture: name`)."""


class Case(TestInputs):
    """One test case."""

    name: str = Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*$")
    """Case name; a `todo_` prefix skips it."""
    description: str = ""
    """What the case checks."""
    fixture: str | None = None
    """Fixture to start from."""
    expect: Expect
    """Expected decision fields and deciding rules."""


class PolicyTestFile(_Strict):
    """A `*_test.yaml` file."""

    version: Literal[1] = 1
    """Schema version."""
    policy: str | None = None
    """Policy under test: a path relative to this file or `builtin:NAME`; default: `X.yaml` for `X_test.yaml`."""
    fixtures: dict[str, Fixture] = Field(default_factory=new_dict)
    """Named inputs."""
    cases: list[Case] = Field(default_factory=new_list)
    """Test cases."""

    @field_validator("cases")
    @classmethod
    def _unique(cls, cases: list[Case]) -> list[Case]:
        seen: set[str] = set()
        for c in cases:
            if c.name in seen:
                raise ValueError(f"case name `{c.name}` appears twice; names must be unique")
            seen.add(c.name)
        return cases
