"""`POST /v1/plan`: the body of a plan request, and its evaluation through `kvpolicy plan`'s own function."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, model_validator

from kvpolicy.errors import InputError
from kvpolicy.service.api import _Body, _tokens


class PlanTraffic(_Body):
    """Request lengths and one load (as `--traffic`)."""

    isl: Annotated[int | str, BeforeValidator(_tokens)]
    """Input tokens per request: 20480 or `"20k"`."""
    osl: Annotated[int | str, BeforeValidator(_tokens)]
    """Output tokens per request."""
    rate: float | None = Field(default=None, gt=0, le=1_000_000)
    """Open loop: requests per second over the whole deployment."""
    concurrency: int | None = Field(default=None, gt=0, le=1_000_000)
    """Closed loop: clients sending their next request when the last one ends."""
    burst: int | None = Field(default=None, gt=0, le=1_000_000)
    """Requests at once; with `rate`, bursts of this size at that mean rate."""

    @model_validator(mode="after")
    def _one_load(self) -> PlanTraffic:
        from kvpolicy.inputs.traffic import make_traffic

        try:
            make_traffic(self.model_dump(), "traffic")
        except InputError as exc:
            raise ValueError(str(exc).removeprefix("traffic: ")) from None
        return self


class PlanSlo(_Body):
    """Latency targets (as `--slo`); a missing one is not checked."""

    ttft_s: float | None = Field(default=None, gt=0)
    """Mean time to first token, seconds."""
    tpot_ms: float | None = Field(default=None, gt=0)
    """Mean time per output token, milliseconds."""


class PlanRequest(_Body):
    """`POST /v1/plan`: the inputs of `kvpolicy plan`, as JSON."""

    model: str = Field(min_length=1, max_length=256)
    """Catalog model id, alias or Hugging Face id; no file paths."""
    gpu: str = Field(min_length=1, max_length=256)
    """Catalog GPU id or alias; `4xh100` gives `gpus` 4 when `gpus` is left out. `auto` is not accepted by the
    service."""
    gpus: int = Field(default=1, gt=0, le=64)
    """GPUs to serve with (default 1, or the count in `gpu`): every TP size vLLM accepts up to it is tried, the rest as replicas."""
    traffic: PlanTraffic
    """Lengths and load."""
    slo: PlanSlo = Field(default_factory=PlanSlo)
    """Latency targets."""
    accuracy_floor: float | None = Field(default=None, gt=0, le=1)
    """Lowest acceptable accuracy recovery vs BF16; null takes the policy's threshold."""
    gpu_memory_utilization: float = Field(default=0.92, gt=0, le=1)
    """Fraction of GPU memory vLLM may use."""


def evaluate_plan(loaded: Any, req: PlanRequest, resolve: Any, error: type[Exception]) -> Any:
    """The plan for a request (`resolve`: the service's catalog look-up; `error`: its 4xx exception)."""
    from kvpolicy.inputs.traffic import Slo, make_traffic
    from kvpolicy.inputs.workload import make_workload
    from kvpolicy.outputs.plan import plan

    if req.gpu.strip().lower() == "auto":
        raise error(422, "invalid_request", "`auto` would probe the server's own GPU; name a catalog GPU such as "
                    "`h100`", "gpu")
    arch, gpu, gpus = resolve(req, "gpus")
    try:
        floor = make_workload(loaded, accuracy_floor=req.accuracy_floor).accuracy_floor
    except InputError as exc:
        raise error(422, "invalid_request", str(exc), "accuracy_floor") from None
    traffic = make_traffic(req.traffic.model_dump(), "traffic")
    slo = Slo(**req.slo.model_dump())
    try:
        return plan(arch, gpu, gpus, traffic, slo, loaded, accuracy_floor=floor,
                    gpu_memory_utilization=req.gpu_memory_utilization)
    except InputError as exc:
        raise error(422, "invalid_request", str(exc), "gpus") from None
