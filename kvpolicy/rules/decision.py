"""The decision and everything that travels with it: inputs, estimates, trace.

`Recommendation` is the one output object: `recommend --format json`, the HTTP
service and `apply` all carry it; its JSON Schema is published in `schemas/`.
Consumers never re-decide: they read a `Decision`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvpolicy import new_list
from kvpolicy.facts.estimates import Estimates
from kvpolicy.inputs.policy_schema import ScaleSource, TwoLevel
from kvpolicy.inputs.workload import Workload


class _Model(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid")


class Decision(_Model):
    """The KV-cache settings kvpolicy selects."""

    kv_cache_dtype: str = "auto"
    """KV-cache dtype as vLLM spells it (`auto` keeps the model dtype, BF16)."""
    skip_layers: list[str] = Field(default_factory=new_list)
    """Layers kept in BF16: `sliding_window` or layer indices as strings."""
    two_level_accumulation: TwoLevel = "not_applicable"
    """FP8 P.V accumulated tile by tile into FP32 registers (Hopper); n/a elsewhere."""
    scale_source: ScaleSource = "uncalibrated"
    """Where FP8 scales come from: 1.0, checkpoint per tensor, checkpoint per head, or in-kernel per token-head."""
    attention_backend: str | None = None
    """vLLM attention backend (`--attention-backend`); None lets vLLM choose."""


class RuleOutcome(_Model):
    """What one rule did."""

    id: str
    """Rule id, e.g. KV101."""
    name: str
    """Kebab-case rule name."""
    matched: bool
    """Whether its condition held."""
    reason: str
    """The condition's evaluation, e.g. `workload.context_tokens (32768) >= break_even (7659)`."""
    decided: list[str] = Field(default_factory=new_list)
    """Fields this rule set."""
    overridden: list[str] = Field(default_factory=new_list)
    """Fields it would set but an earlier rule (or a pin) had already decided."""
    evidence: list[str] = Field(default_factory=new_list)
    """Evidence ids it cites."""


class FieldTrace(_Model):
    """How one decision field was decided."""

    value: Any
    """Final value."""
    decided_by: str
    """Rule id, `pin:<name>`, `constraint:<name>`, `checkpoint` (scales the checkpoint declares) or `default`."""
    losers: list[str] = Field(default_factory=new_list)
    """Rules that matched and wanted another value."""


class Trace(_Model):
    """The engine's reasoning."""

    rules: list[RuleOutcome]
    """Every rule considered, in evaluation order."""
    fields: dict[str, FieldTrace]
    """Per decision field: who decided it."""
    facts: dict[str, Any]
    """The facts the rules saw."""


class EvidenceRef(_Model):
    """A measurement a rule cites."""

    id: str
    """Evidence id."""
    statement: str
    """The figure in words."""
    source: str
    """Where it was measured."""


class Recommendation(_Model):
    """Everything `kvpolicy recommend` returns."""

    schema_version: Literal[1] = 1
    """Version of this document's schema."""
    model: str
    """Model id as resolved."""
    gpu: str
    """GPU id as resolved."""
    workload: Workload
    """The workload inputs."""
    policy: str
    """Policy name and content hash."""
    decision: Decision
    """The selected settings."""
    vllm_args: list[str]
    """`vllm serve` flags that carry the decision out."""
    estimates: Estimates
    """Predicted effects."""
    warnings: list[str]
    """What the user must know or do (custom builds, calibration, accuracy caveats)."""
    blockers: list[str] = Field(default_factory=new_list)
    """Why vLLM would stop at start-up with `vllm_args` (weights or one request at the context do not fit,
    modelled), each with the smallest TP that fits; empty when it starts. The CLI exits 1 while any remain."""
    alternatives: list[str] = Field(default_factory=new_list)
    """Options considered and why they were not chosen."""
    unsupported: list[str] = Field(default_factory=new_list)
    """What stock vLLM 0.33 would refuse or cannot carry out of this decision (`check --strict` and
    `apply --strict` refuse it)."""
    evidence: list[EvidenceRef]
    """Evidence cited by the rules that decided."""
    trace: Trace
    """Rule-by-rule reasoning."""
