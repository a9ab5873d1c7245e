"""The policy file's schema: rules, conditions, thresholds, evidence, pins, constraints.

Everything here is data. Conditions are a closed set of operators over named
facts; no string is ever evaluated. The JSON Schema in `schemas/` is generated
from these models (`kvpolicy schema`), so the docs and editor validation follow
the code.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from kvpolicy import new_dict, new_list

TwoLevel = Literal["on", "off", "not_applicable"]
ScaleSource = Literal["uncalibrated", "checkpoint_per_tensor", "checkpoint_per_head", "per_token_head"]
DECISION_FIELDS = ("kv_cache_dtype", "skip_layers", "two_level_accumulation", "scale_source", "attention_backend")
"""Decision fields in the order the engine decides them; a rule may test only earlier ones."""

Operator = Literal["eq", "ne", "lt", "le", "gt", "ge", "in", "not_in", "exists", "glob"]
"""Comparison operators. `exists` tests that a fact has a value; `glob` matches fnmatch patterns."""

Scalar = Union[bool, int, float, str, None]


class _Strict(BaseModel):
    # NaN and infinities compare false with everything, so a rule or threshold holding one never fires.
    # Built at import, unlike kvpolicy's other models (defer_build): `kvpolicy schema` attaches field docstrings
    # and rebuilds, and its output must not depend on which of these models an earlier call built.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ThresholdRef(_Strict):
    """A value taken from a named threshold (`{threshold: break_even_tokens}`)."""

    threshold: str
    """Name of a threshold in `thresholds:`."""


class FactRef(_Strict):
    """A value taken from another fact (`{fact: workload.accuracy_floor}`)."""

    fact: str
    """Fact path, e.g. `workload.accuracy_floor`."""


def _operand_kind(v: Any) -> str:
    """Which Operand member a value is meant to be, so errors speak about that member only."""
    if isinstance(v, (ThresholdRef, FactRef)):
        return type(v).__name__
    if isinstance(v, dict):
        return "FactRef" if "fact" in v and "threshold" not in v else "ThresholdRef"
    return "List" if isinstance(v, list) else "Scalar"


Operand = Annotated[
    Union[
        Annotated[ThresholdRef, Tag("ThresholdRef")],
        Annotated[FactRef, Tag("FactRef")],
        Annotated[Scalar, Tag("Scalar")],
        Annotated[list[Scalar], Tag("List")],
    ],
    Discriminator(_operand_kind),
]
_ORDERED_OPS = ("lt", "le", "gt", "ge")


class Compare(_Strict):
    """`fact op value`: the leaf of a condition."""

    fact: str
    """Fact path on the left, e.g. `model.sliding_window`."""
    op: Operator = "eq"
    """Operator."""
    value: Operand = None
    """Right-hand side: a literal, a list (for in/not_in), `{threshold: name}` or `{fact: path}`."""

    @model_validator(mode="after")
    def _value_fits_op(self) -> Compare:
        v, op = self.value, self.op
        ref = isinstance(v, (ThresholdRef, FactRef))
        if op in ("in", "not_in") and not (isinstance(v, list) or isinstance(v, FactRef)):
            raise ValueError(f"`op: {op}` needs a list value, e.g. `value: [hopper, blackwell]` (found {v!r})")
        if op in _ORDERED_OPS and not ref and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"`op: {op}` compares numbers: give a number, `{{threshold: name}}` or "
                             f"`{{fact: path}}` (found {v!r})")
        if op == "exists" and v not in (None, True, False):
            raise ValueError(f"`op: exists` takes `value: true` (the default) or `false` (found {v!r})")
        if op == "glob" and not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))):
            raise ValueError(f"`op: glob` needs a pattern such as `llama-*` or a list of them (found {v!r})")
        if op in ("eq", "ne") and isinstance(v, list):
            alt = "in" if op == "eq" else "not_in"
            raise ValueError(f"`op: {op}` with a list never matches a single fact value; use `op: {alt}`")
        if isinstance(v, ThresholdRef) and op not in _ORDERED_OPS + ("eq", "ne"):
            raise ValueError(f"`op: {op}` cannot take a threshold; thresholds are numbers (use lt/le/gt/ge/eq/ne)")
        return self


class AllOf(_Strict):
    """True when every sub-condition holds."""

    all: list[Condition] = Field(min_length=1)
    """Sub-conditions."""


class AnyOf(_Strict):
    """True when at least one sub-condition holds."""

    any: list[Condition] = Field(min_length=1)
    """Sub-conditions."""


class Not(_Strict):
    """True when the sub-condition does not hold."""

    not_: Condition = Field(alias="not")
    """Sub-condition."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


def _condition_kind(v: Any) -> str:
    """Which condition form a mapping is meant to be (`all`, `any`, `not` or a comparison)."""
    if isinstance(v, BaseModel):
        return type(v).__name__
    if isinstance(v, dict):
        for key, kind in (("all", "AllOf"), ("any", "AnyOf"), ("not", "Not"), ("not_", "Not")):
            if key in v:
                return kind
    return "Compare"


# The discriminator picks the form from the keys present, so a typo in a comparison
# is reported against Compare alone instead of against all four forms.
Condition = Annotated[
    Union[
        Annotated[AllOf, Tag("AllOf")],
        Annotated[AnyOf, Tag("AnyOf")],
        Annotated[Not, Tag("Not")],
        Annotated[Compare, Tag("Compare")],
    ],
    Discriminator(_condition_kind),
]
for _m in (AllOf, AnyOf, Not):
    _m.model_rebuild()


class DecisionPatch(_Strict):
    """Decision fields a rule or pin sets; fields left out are not touched."""

    kv_cache_dtype: str | None = None
    """KV-cache dtype as vLLM spells it."""
    skip_layers: list[str] | None = None
    """`[sliding_window]`, layer indices as strings, or `[]` for none."""
    two_level_accumulation: TwoLevel | None = None
    """on / off / not_applicable."""
    scale_source: ScaleSource | None = None
    """uncalibrated / checkpoint_per_tensor / checkpoint_per_head / per_token_head."""
    attention_backend: str | None = None
    """vLLM backend name, e.g. FLASH_ATTN."""

    @field_validator("skip_layers", mode="before")
    @classmethod
    def _stringify(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [str(x) for x in v]
        return v

    def fields(self) -> dict[str, Any]:
        """The fields this patch sets, in decision order."""
        data = self.model_dump(exclude_unset=True)
        return {k: data[k] for k in DECISION_FIELDS if k in data}


class Rule(_Strict):
    """One rule: when a condition holds, set decision fields; cite evidence."""

    id: str = Field(pattern=r"^[A-Z]{2,4}\d{3}$")
    """Permanent id, e.g. KV101 (never reused)."""
    name: str = Field(pattern=r"^[a-z0-9]+(-[a-z0-9]+)*$")
    """Kebab-case name."""
    status: Literal["stable", "preview", "deprecated"] = "stable"
    """Deprecated rules are never evaluated."""
    statement: str
    """One line: what the rule does."""
    why: str = ""
    """Why the rule exists (what goes wrong without it)."""
    when: Condition | None = None
    """Condition; omitted = always."""
    then: DecisionPatch = Field(default_factory=lambda: DecisionPatch())
    """Fields set when the condition holds; empty for advice rules."""
    warn: list[str] = Field(default_factory=new_list)
    """Messages shown when this rule decides a field; `{fact.path}` placeholders are filled in, and
    `{fact.path|request}` adds a noun, plural unless the value is 1 (`{fact.path|query|queries}` names the plural)."""
    advise: list[str] = Field(default_factory=new_list)
    """Advice listed under alternatives when the condition holds (evaluated after every field is decided);
    placeholders as in `warn`."""
    evidence: list[str] = Field(default_factory=new_list)
    """Evidence ids backing the rule."""
    enabled: bool = True
    """False disables the rule (kept for the record)."""


class ItlFit(_Strict):
    """A measured single-request ITL line (ITL = slope x context + intercept)."""

    slope_ms_per_token: float = Field(gt=0)
    """Slope in ms of ITL per token of context."""
    intercept_ms: float | None = None
    """Intercept in ms."""
    break_even_tokens: float | None = Field(default=None, gt=0)
    """Measured break-even against BF16 in tokens, when the study gives it."""


class ItlMeasurement(_Strict):
    """ITL fits of one model on one GPU, one entry per KV variant."""

    model: str
    """Model catalog id (or family with `family:` prefix)."""
    gpu: str
    """GPU catalog id."""
    variants: dict[str, ItlFit]
    """`bf16`, `fp8`, `fp8_skip_sliding`, `turboquant_4bit_nc`, ... -> fit."""


class Recovery(_Strict):
    """A measured accuracy recovery vs BF16 for a KV dtype up to a context length."""

    dtype: str
    """KV dtype (vLLM name)."""
    value: float = Field(gt=0, le=1.2)
    """Recovery (score / BF16 score); the lower bound of the study's range."""
    max_context_tokens: int = Field(default=1 << 30, gt=0)
    """Longest context this figure covers."""
    measured_up_to_tokens: int | None = Field(default=None, gt=0)
    """Longest context the study measured, when the figure is applied further (up to max_context_tokens):
    an estimate beyond it is labelled extrapolated, not measured."""
    model: str | None = None
    """Model catalog id the figure was measured on (`kvpolicy verify --record`); with `gpu`, it then applies to
    that model on that GPU only, ahead of the unscoped figures. None: a study's figure for every model."""
    gpu: str | None = None
    """GPU catalog id the figure was measured on; set together with `model`."""

    @model_validator(mode="after")
    def _scoped_together(self) -> Recovery:
        if (self.model is None) != (self.gpu is None):
            raise ValueError("a measured recovery names both `model` and `gpu` (the deployment it was measured "
                             "on), or neither (a study's figure)")
        return self


class ModelFigure(_Strict):
    """Next-token figures of one KV format on one model against its BF16 cache, over a text
    (`kvpolicy verify --record` on a model with weights)."""

    dtype: str
    """KV dtype (vLLM name)."""
    scale_source: ScaleSource = "uncalibrated"
    """FP8 scales the figures were measured with (`checkpoint_per_head`: the verify's `+per_head` twin)."""
    model: str
    """Model catalog id (for a local folder or .gguf file: the id `recommend` gives it, its name)."""
    gpu: str | None = None
    """GPU catalog id when measured through kvpolicy's kernels on that GPU; None when measured on the CPU's float64
    reference path, which computes the format's exact rounding and no GPU's arithmetic: such a figure stands for
    the model on every GPU, after one measured on the GPU itself."""
    tokens: int = Field(gt=0)
    """Positions compared."""
    agreement: float = Field(ge=0, le=1)
    """Fraction of positions whose argmax next token equals the BF16 cache's."""
    agreement_low: float = Field(ge=0, le=1)
    """Lower end of the 95% Wilson interval of `agreement`."""
    agreement_high: float = Field(ge=0, le=1)
    """Upper end of that interval."""
    kl_mean: float = Field(ge=0)
    """Mean KL(BF16 || format) of the next-token distributions, nats."""
    kl_p99: float | None = Field(default=None, ge=0)
    """99th percentile of the per-position KL, nats."""
    ppl_delta: float | None = Field(default=None, gt=-1)
    """Perplexity of the text under this format over BF16's, minus 1 (0.013 = +1.3%)."""
    text: str = ""
    """What was read: tokens, text, weights and device."""

    @model_validator(mode="after")
    def _interval_holds_the_figure(self) -> ModelFigure:
        if not self.agreement_low <= self.agreement <= self.agreement_high:
            raise ValueError(f"the agreement {self.agreement:g} lies outside its interval [{self.agreement_low:g}, "
                             f"{self.agreement_high:g}]; agreement_low <= agreement <= agreement_high")
        return self


class KernelFit(_Strict):
    """A measured decode-attention line of one kernel: time per call = slope x context + intercept."""

    slope_ns_per_token: float = Field(gt=0)
    """Slope in ns of one call (one layer, the whole batch) per token of context."""
    intercept_us: float | None = None
    """Intercept in microseconds."""
    read_tbps_at_128k: float | None = Field(default=None, gt=0)
    """Effective TB/s of KV bytes read at 131,072 tokens (bytes the format stores / time)."""


class KernelMeasurement(_Strict):
    """Decode-attention fits of kvpolicy's Triton kernels for one layer shape on one GPU."""

    gpu: str
    """GPU catalog id or alias, e.g. `h200`; other GPUs of its generation use these figures when they have none."""
    geometry: str
    """Model catalog id whose attention layer shape was measured, e.g. `llama-3.1-8b`."""
    head_dim: int = Field(gt=0)
    """Head dimension of the measured layer; `recommend` uses the geometry closest to the model's."""
    batch: int = Field(gt=0)
    """Sequences per call, all at the same context."""
    baseline: str = "sdpa_cudnn"
    """Column the ratios are taken against (torch SDPA on cuDNN, BF16, by default)."""
    fits: dict[str, KernelFit]
    """`bf16`, `fp8`, `turboquant_k8v4`, `turboquant_4bit_nc`, `turboquant_k3v4_nc`, `turboquant_3bit_nc`,
    `sdpa_cudnn` -> fit."""

    @model_validator(mode="after")
    def _baseline_measured(self) -> KernelMeasurement:
        if self.baseline not in self.fits:
            raise ValueError(f"`baseline: {self.baseline}` has no fit; add `{self.baseline}` under `fits:` or name "
                             f"one of: {', '.join(self.fits) or '(none)'}")
        return self


class Evidence(_Strict):
    """A measurement or documented fact that rules cite."""

    id: str = Field(pattern=r"^[a-z0-9]+(-[a-z0-9.]+)*$")
    """Permanent kebab-case id."""
    statement: str
    """The figure in words."""
    source: str
    """Study, document or benchmark run it comes from."""
    itl: ItlMeasurement | None = None
    """Machine-readable ITL fits, used by the latency estimates."""
    recovery: list[Recovery] = Field(default_factory=new_list)
    """Machine-readable accuracy recoveries, used by the accuracy estimates."""
    model_check: list[ModelFigure] = Field(default_factory=new_list)
    """Model-level next-token figures of one model (`kvpolicy verify --record`): its accuracy estimate, judged by
    the `model_*` thresholds, and the `accuracy.*_model_check` facts the rules read."""
    kernels: list[KernelMeasurement] = Field(default_factory=new_list)
    """Decode-attention fits of kvpolicy's own kernels, attention only; used by the kernel slope estimate."""


class Threshold(_Strict):
    """A named number rules compare against, optionally keyed by a fact (e.g. GPU generation)."""

    description: str = ""
    """What the number means and where it comes from."""
    value: float | None = None
    """The value when not keyed."""
    by: str | None = None
    """Fact whose value selects an entry of `values`, e.g. `gpu.generation`."""
    values: dict[str, float] = Field(default_factory=new_dict)
    """Per-key values when `by` is set."""
    default: float | None = None
    """Value when `by`'s fact matches no key."""
    min: float | None = None
    """Lowest sensible value (lint checks overrides)."""
    max: float | None = None
    """Highest sensible value (lint checks overrides)."""
    evidence: list[str] = Field(default_factory=new_list)
    """Evidence ids backing the number."""

    @model_validator(mode="after")
    def _one_form(self) -> Threshold:
        if self.by is None and self.value is None:
            raise ValueError("a threshold needs `value`, or `by` with `values`")
        if self.by is not None and not self.values:
            raise ValueError("`by` needs `values`")
        if self.by is not None and self.value is not None:
            raise ValueError(f"a threshold keyed `by: {self.by}` ignores `value`; use `default` for keys not "
                             "in `values`, or drop `by`/`values` for one number")
        if self.by is None and (self.values or self.default is not None):
            raise ValueError("`values` and `default` need `by` (the fact that selects an entry)")
        return self


class ThresholdPatch(_Strict):
    """A threshold in a file that `extends` another: any subset of the keys, merged over the inherited one.

    Giving `value` alone turns an inherited keyed threshold into one number; `values`
    are merged key by key.
    """

    description: str | None = None
    """What the number means and where it comes from."""
    value: float | None = None
    """The value when not keyed."""
    by: str | None = None
    """Fact whose value selects an entry of `values`."""
    values: dict[str, float] | None = None
    """Per-key values when `by` is set (merged over the inherited ones)."""
    default: float | None = None
    """Value when `by`'s fact matches no key."""
    min: float | None = None
    """Lowest sensible value."""
    max: float | None = None
    """Highest sensible value."""
    evidence: list[str] | None = None
    """Evidence ids backing the number."""


class Pin(_Strict):
    """Fixed decision fields for a model, family or deployment; applied after the rules."""

    name: str
    """Name shown in the trace as `pin:<name>`."""
    when: Condition
    """Which deployments the pin applies to, e.g. `{fact: model.family, op: eq, value: kimi}`."""
    set: DecisionPatch
    """Fields to force."""
    reason: str = ""
    """Why the pin exists."""


class Constraints(_Strict):
    """Hard limits every decision must respect."""

    forbid: dict[str, list[str]] = Field(default_factory=new_dict)
    """Field -> fnmatch patterns of values that must never be chosen, e.g. `kv_cache_dtype: [turboquant_*]`."""
    min_accuracy_floor: float | None = Field(default=None, gt=0, le=1)
    """The accuracy floor may not be set lower than this."""

    @field_validator("forbid")
    @classmethod
    def _known_fields(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for key in v:
            if key not in DECISION_FIELDS:
                raise ValueError(f"unknown decision field `{key}`; allowed: {', '.join(DECISION_FIELDS)}")
        return v


class Deployment(_Strict):
    """A serving target kept in the policy repo."""

    name: str
    """Deployment name."""
    model: str
    """Model catalog id, HF id or local config path."""
    gpu: str
    """GPU catalog id or alias; `2xh100` or `h100x2` gives `tp` 2 when `tp` is left out."""
    context: Union[Annotated[int, Field(gt=0, le=16_777_216)],
                   Annotated[str, Field(max_length=32, pattern=r"^\s*[0-9]+(\.[0-9]+)?\s*[kKmM]?\s*$")]] = 32768
    """Context length (`32k`, `1m` or a number of tokens)."""
    priority: Literal["decode", "prefill", "balanced"] = "decode"
    """decode, prefill or balanced."""
    concurrency: int = Field(default=1, gt=0, le=1_000_000)
    """Requests served at once."""
    tp: int = Field(default=1, gt=0, le=1024)
    """Tensor-parallel size (default 1, or the count in `gpu`)."""
    accuracy_floor: float | None = Field(default=None, gt=0, le=1)
    """Accuracy floor (defaults to the policy's threshold)."""
    gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1)
    """Fraction of GPU memory vLLM may use."""
    weights_gb: float | None = Field(default=None, gt=0, le=1_000_000)
    """Weight memory in GB (1e9 bytes), all ranks together; overrides what kvpolicy derives from the checkpoint."""


class Policy(_Strict):
    """A KV-cache policy file."""

    version: Literal[1] = 1
    """Schema version."""
    name: str = "policy"
    """Policy name, shown in outputs."""
    description: str = ""
    """What the policy is for."""
    extends: str | None = None
    """`builtin:default` or a path (relative to this file) whose content this file refines."""
    thresholds: dict[str, Threshold] = Field(default_factory=new_dict)
    """Named numbers; an extending file may override `value`/`values` only."""
    defaults: DecisionPatch = Field(default_factory=DecisionPatch)
    """Decision fields no rule decides."""
    rules: list[Rule] = Field(default_factory=new_list)
    """Rules in evaluation order."""
    disable: list[str] = Field(default_factory=new_list)
    """Rule ids of the extended policy to switch off."""
    order: list[str] = Field(default_factory=new_list)
    """Rule ids to move to the front, in this order (re-ordering an extended policy)."""
    evidence: list[Evidence] = Field(default_factory=new_list)
    """Measurements the rules cite."""
    pins: list[Pin] = Field(default_factory=new_list)
    """Forced fields, applied after the rules."""
    constraints: Constraints = Field(default_factory=Constraints)
    """Hard limits."""
    deployments: list[Deployment] = Field(default_factory=new_list)
    """Serving targets evaluated by `kvpolicy check`."""

    @cached_property
    def derived(self) -> dict[str, Any]:
        """Tables later stages build from this policy once (compiled rules, evidence look-ups), by module name.

        They live on the policy object, not in module-level caches, so a policy that
        `kvpolicy serve` replaces is freed together with them."""
        return {}

    @field_validator("rules", "evidence", "deployments", "pins")
    @classmethod
    def _unique(cls, items: list[Any]) -> list[Any]:
        key = "name" if items and isinstance(items[0], (Deployment, Pin)) else "id"
        seen: set[str] = set()
        for item in items:
            value = getattr(item, key)
            if value in seen:
                raise ValueError(f"{key} `{value}` appears twice; {key}s must be unique (rename or remove one)")
            seen.add(value)
        return items


class PolicyLayer(Policy):
    """One file of an `extends` chain checked on its own: its thresholds may be partial."""

    thresholds: dict[str, ThresholdPatch] = Field(default_factory=new_dict)  # type: ignore[assignment]
    """Threshold changes, merged over the inherited thresholds."""


def resolve_threshold(policy: Policy, name: str, facts: dict[str, Any]) -> float | None:
    """Value of a named threshold for these facts (keyed thresholds look up `by`'s fact)."""
    t = policy.thresholds.get(name)
    if t is None:
        return None
    if t.by is None:
        return t.value
    key = facts.get(t.by)
    return t.values.get(str(key), t.default)
