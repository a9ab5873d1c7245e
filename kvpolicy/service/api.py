"""The wire contract of `kvpolicy serve`: request and response bodies, and readable validation errors.

Plain pydantic, no web framework, so `kvpolicy schema` can publish these models
without importing the server stack. Requests are strict (`"8"` is not a number,
`true` is not a count) and closed (unknown fields are errors), so a typo in a
deployment tool fails loudly instead of silently falling back to a default.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from kvpolicy import new_list
from kvpolicy.errors import InputError, did_you_mean
from kvpolicy.inputs.workload import Priority, Workload

MAX_BODY_BYTES = 64 * 1024
"""Largest request body accepted; longer bodies get 413 (counted while reading, not from Content-Length)."""
MAX_CHECK_DEPLOYMENTS = 128
"""Most deployments one `POST /v1/check` may carry (each costs a fraction of a millisecond of CPU)."""
MAX_CONTEXT_TOKENS: int = next(m.le for m in Workload.model_fields["context_tokens"].metadata if hasattr(m, "le"))
"""The Workload's bound on context_tokens, applied to `context` before the request is evaluated."""

ErrorKind = Literal["invalid_json", "invalid_request", "unknown_model", "unknown_gpu", "deployment_error",
                    "body_too_large", "not_found", "method_not_allowed", "internal_error"]


def _tokens(value: Any) -> int:
    """`32k` or 131072 -> tokens, with the CLI's parser and the Workload's bound."""
    from kvpolicy.inputs.workload import parse_tokens

    if not isinstance(value, (int, str)) or isinstance(value, bool):
        raise ValueError(f"expected a token count such as 131072 or \"32k\", found {value!r}")
    try:
        tokens = parse_tokens(value, what="context")
    except InputError as exc:
        raise ValueError(str(exc).removeprefix("context: ")) from None
    if tokens > MAX_CONTEXT_TOKENS:
        raise ValueError(f"{value!r} is {tokens:,} tokens; at most {MAX_CONTEXT_TOKENS:,} are allowed")
    return tokens


class _Body(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid", strict=True, allow_inf_nan=False)


class RecommendRequest(_Body):
    """`POST /v1/recommend`: the inputs of `kvpolicy recommend`, as JSON."""

    model: str = Field(min_length=1, max_length=256)
    """Catalog model id, alias or Hugging Face id (`gpt-oss-20b`, `openai/gpt-oss-20b`); no file paths."""
    gpu: str = Field(min_length=1, max_length=256)
    """Catalog GPU id, alias or nvidia-smi name (`h100`, `RTX 4090`, `b200`); `2xh100` or `h100x2` gives `tp` 2 when
    `tp` is left out. `auto` is not accepted by the service."""
    context: Annotated[int | str, BeforeValidator(_tokens)] = 32768
    """Context length per request: a token count (131072) or a string with k/m (`"32k"`)."""
    priority: Priority = "decode"
    """What latency matters most: decode, prefill or balanced."""
    concurrency: int = Field(default=1, gt=0, le=1_000_000)
    """Requests served at once at that context."""
    tp: int = Field(default=1, gt=0, le=1024)
    """Tensor-parallel size (GPUs per replica); default 1, or the count in `gpu` (`2xh100`)."""
    accuracy_floor: float | None = Field(default=None, gt=0, le=1)
    """Lowest acceptable accuracy recovery vs BF16; null takes the policy's threshold."""
    gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1)
    """Fraction of GPU memory vLLM may use."""

    @field_validator("gpu")
    @classmethod
    def _no_auto(cls, v: str) -> str:
        if v.strip().lower() == "auto":
            raise ValueError("`auto` would probe the server's own GPU; name a catalog GPU such as `h100`")
        return v

    def workload_args(self) -> dict[str, Any]:
        """Keyword arguments for `make_workload`."""
        return self.model_dump(exclude={"model", "gpu", "name"})


class CheckDeployment(RecommendRequest):
    """One deployment of a `POST /v1/check` batch."""

    name: str | None = Field(default=None, max_length=200)
    """Name echoed in the result (default `deployment-N`, counting from 1)."""


class CheckRequest(_Body):
    """`POST /v1/check`: deployments to evaluate; an empty body evaluates the policy's own `deployments:`."""

    deployments: list[CheckDeployment] | None = Field(default=None, max_length=MAX_CHECK_DEPLOYMENTS)
    """The batch; null or absent means the deployments listed in the served policy."""


class FieldError(_Body):
    """One problem with a request."""

    location: str | None
    """Field path such as `deployments[2].tp`, `body` for the whole body, or null."""
    detail: str
    """What is wrong and what is allowed."""


class ErrorBody(_Body):
    """Every 4xx/5xx response body."""

    error: ErrorKind
    """Machine-readable kind of error."""
    detail: str
    """What is wrong, where, and how to fix it."""
    location: str | None = None
    """The first offending field (`concurrency`, `deployments[0].gpu`), `body`, or null."""
    errors: list[FieldError] = Field(default_factory=new_list)
    """Every problem found (validation errors)."""
    policy: str
    """Policy name and content hash (`name@hash`) that answered."""


class CheckError(_Body):
    """Why one deployment of a batch could not be evaluated."""

    error: ErrorKind
    """Machine-readable kind of error."""
    detail: str
    """What is wrong and how to fix it."""
    location: str | None = None
    """The offending field of that deployment, when known."""


class CheckResult(_Body):
    """The outcome for one deployment, as `kvpolicy check` judges it."""

    name: str
    """Deployment name."""
    status: Literal["ok", "violation", "error"]
    """ok; violation (evaluated, but breaks a check such as capacity or the accuracy floor); error (not evaluated)."""
    violations: list[str] = Field(default_factory=new_list)
    """What the deployment breaks and how to fix it."""
    error: CheckError | None = None
    """Why it could not be evaluated (status error)."""
    report: dict[str, Any] | None = None
    """What `kvpolicy check` reports for it: decision, vllm_args, decided_by, capacity, accuracy_recovery,
    warnings, model, gpu, tp (tensor-parallel size), policy (null when it could not be evaluated)."""


class CheckResponse(_Body):
    """`POST /v1/check` response."""

    policy: str
    """Policy name and content hash (`name@hash`) that answered."""
    source: Literal["request", "policy"]
    """Where the deployments came from: the request body or the policy's `deployments:`."""
    ok: bool
    """True when every deployment is ok (no violation, no error): the answer a CI gate wants."""
    num_deployments: int
    """Deployments checked."""
    num_ok: int
    """Deployments with status ok."""
    num_violations: int
    """Deployments with status violation."""
    num_errors: int
    """Deployments with status error."""
    results: list[CheckResult]
    """One result per deployment, in request (or policy) order."""


def check_result(name: str, report: dict[str, Any], error_kind: ErrorKind,
                 drop: tuple[str, ...] = ()) -> CheckResult:
    """`check_deployment`'s plain data -> a CheckResult (its whole report kept under `report`)."""
    if report.get("status") == "error":
        return CheckResult(name=name, status="error", error=CheckError(
            error=error_kind, detail=str(report.get("error")), location=None))
    keep = {k: v for k, v in report.items() if k not in ("name", "status", "violations", "error", *drop)}
    return CheckResult(name=name, status=report["status"], violations=list(report.get("violations") or []),
                       report=keep)


def check_response(policy: str, source: Literal["request", "policy"], results: list[CheckResult],
                   strict: bool = False) -> CheckResponse:
    """The one shape of a check's answer (`kvpolicy check --format json` and `POST /v1/check`).

    With `strict` (the CLI's --strict), a deployment with warnings makes `ok` false, as it fails the exit code.
    """
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "violation", "error")}
    warned = strict and any((r.report or {}).get("warnings") for r in results)
    return CheckResponse(policy=policy, source=source, ok=counts["ok"] == len(results) and not warned,
                         num_deployments=len(results), num_ok=counts["ok"], num_violations=counts["violation"],
                         num_errors=counts["error"], results=results)


def field_errors(exc: ValidationError, body: type[BaseModel]) -> list[FieldError]:
    """pydantic errors of validating `body` -> one readable FieldError per problem."""
    out = []
    for err in exc.errors(include_url=False):
        loc = _location(err["loc"])
        kind = err["type"]
        if kind == "json_invalid":
            out.append(FieldError(location="body", detail=f"malformed JSON: {err['ctx']['error']}"))
            continue
        if kind == "extra_forbidden":
            name = str(err["loc"][-1])
            owner = CheckDeployment if err["loc"][0] == "deployments" else body
            allowed = list(owner.model_fields)
            detail = f"unknown field.{did_you_mean(name, allowed)} Allowed fields: {', '.join(allowed)}"
        elif kind == "missing":
            detail = "required field is missing"
        elif kind == "value_error":
            detail = str(err["ctx"]["error"])
        else:
            found = err.get("input")
            shown = "" if isinstance(found, (dict, list)) else f", found {_short(found)}"
            detail = f"{err['msg'][0].lower()}{err['msg'][1:]}{shown}"
        out.append(FieldError(location=loc or "body", detail=detail))
    return out


def _location(loc: tuple[Any, ...]) -> str:
    """('deployments', 2, 'tp') -> `deployments[2].tp`."""
    text = ""
    for p in loc:
        text += f"[{p}]" if isinstance(p, int) else (f".{p}" if text else str(p))
    return text


def _short(value: Any) -> str:
    """The offending value as JSON would spell it, cut to 60 characters."""
    import json

    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
