"""`kvpolicy serve`: the policy as an HTTP JSON decision service (Starlette, run by uvicorn).

A thin adapter: each endpoint validates the body (`kvpolicy.service.api`), calls the
functions the CLI calls (`resolve_model`, `resolve_gpu`, `make_workload` and
`recommend` for /v1/recommend, `check_deployment` for /v1/check) and returns
their result as JSON. Every response carries the serving policy's content hash
in the `X-Kvpolicy-Policy` header, and every JSON body its `name@hash` in
`policy`. A request reads the policy once (`holder.current`), so a hot reload
never mixes two policies in one answer. Nothing a request says is executed or
read from disk: models and GPUs resolve against the catalogs only.

One evaluation (a few hundred microseconds of CPU) runs on the event loop: in
one process under the GIL a thread pool adds hand-offs and no parallelism, and
measured slower (bench/RESULTS.md). A `/v1/check` batch goes to a thread
so that one large batch cannot stall every other client.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpolicy.errors import InputError, LimitError
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.catalog import (
    agreed_count,
    load_gpus,
    load_models,
    resolve_gpu_count,
    resolve_model,
)
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.inputs.workload import make_workload
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.decision import Recommendation
from kvpolicy.service.api import (
    MAX_BODY_BYTES,
    CheckError,
    CheckRequest,
    CheckResponse,
    CheckResult,
    ErrorBody,
    FieldError,
    RecommendRequest,
    check_response,
    check_result,
    field_errors,
)
from kvpolicy.service.limits import Limits
from kvpolicy.service.metrics import Metrics
from kvpolicy.service.plan_api import PlanRequest, evaluate_plan
from kvpolicy.service.reload import PolicyHolder, Snapshot

log = logging.getLogger("kvpolicy.serve")

POLICY_HEADER = "X-Kvpolicy-Policy"
"""Response header holding the serving policy's content hash (12 hex digits)."""
ROUTES = ("/healthz", "/metrics", "/v1/models", "/v1/gpus", "/v1/recommend", "/v1/check", "/v1/plan")


class ServiceError(Exception):
    """A request the service refuses: becomes a 4xx JSON ErrorBody."""

    def __init__(self, status: int, kind: str, detail: str, location: str | None = None,
                 errors: list[FieldError] | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.kind, self.detail, self.location = status, kind, detail, location
        self.errors = errors or []
        self.headers = headers or {}


# -- request evaluation (pure functions over a Snapshot) -------------------------------------


def resolve(req: RecommendRequest | PlanRequest, count_field: str = "tp") -> tuple[ModelArch, GpuSpec, int]:
    """Model, GPU and GPU count from the catalogs only (never a file, never nvidia-smi); unknown names are 404s.

    The count is `count_field` (`tp`, or `gpus` for a plan), or the one in `gpu` (`2xh100`) when the body
    leaves that field out; the two disagreeing, or a count in `gpu` out of range (`0xh100`), is a 422.
    """
    try:
        arch = resolve_model(req.model, where="model", allow_paths=False)
    except InputError as exc:
        raise ServiceError(404, "unknown_model", str(exc), "model") from None
    try:
        gpu, named = resolve_gpu_count(req.gpu, where="gpu")  # an unknown name is a 404, a count out of range a 422
    except LimitError as exc:
        raise ServiceError(422, "invalid_request", str(exc), exc.field or "gpu") from None
    except InputError as exc:
        raise ServiceError(404, "unknown_gpu", str(exc), "gpu") from None
    given = getattr(req, count_field) if count_field in req.model_fields_set else None
    try:
        count = agreed_count(req.gpu, gpu, named, given, where="gpu", count_where=count_field)
    except InputError as exc:
        raise ServiceError(422, "invalid_request", str(exc), count_field) from None
    return arch, gpu, count


def evaluate(snap: Snapshot, req: RecommendRequest) -> Recommendation:
    """One deployment through the CLI's own flow (`recommend`)."""
    arch, gpu, tp = resolve(req)
    try:
        workload = make_workload(snap.loaded, **{**req.workload_args(), "tp": tp})
    except InputError as exc:
        raise ServiceError(422, "invalid_request", str(exc), "accuracy_floor") from None
    try:
        return recommend(arch, gpu, workload, snap.loaded)
    except LimitError as exc:  # a context or TP size vLLM itself refuses
        raise ServiceError(422, "invalid_request", str(exc), exc.field) from None


def check(snap: Snapshot, body: CheckRequest) -> CheckResponse:
    """Judge a batch with `kvpolicy check`'s own function: the request's deployments, or the policy's own."""
    from kvpolicy.inputs.policy_schema import Deployment
    from kvpolicy.policy.deployments import check_deployment

    results = []
    if body.deployments is not None:
        for i, req in enumerate(body.deployments, 1):
            name = req.name or f"deployment-{i}"
            try:
                arch, gpu, tp = resolve(req)
            except ServiceError as exc:
                results.append(CheckResult(name=name, status="error", error=CheckError(
                    error=exc.kind, detail=exc.detail, location=exc.location)))  # type: ignore[arg-type]
                continue
            dep = Deployment(name=name, model=arch.id, gpu=gpu.id, **{**req.workload_args(), "tp": tp})
            report = check_deployment(snap.loaded, dep)
            # A request's deployment is not written in the policy file: no file position.
            results.append(check_result(name, report, "invalid_request", drop=("file", "line", "col")))
    else:
        for dep in snap.loaded.policy.deployments:
            if dep.gpu.strip().lower() == "auto":
                results.append(CheckResult(name=dep.name, status="error", error=CheckError(
                    error="deployment_error", location="gpu",
                    detail=f"deployment `{dep.name}`: gpu `auto` would probe the server's own GPU; the service "
                           "does not evaluate it. Name a catalog GPU in the policy.")))
                continue
            # The policy file is the operator's, so its deployments may name local config.json files.
            results.append(check_result(dep.name, check_deployment(snap.loaded, dep), "deployment_error"))
    return check_response(snap.label, "request" if body.deployments is not None else "policy", results)


def parse(raw: bytes, body: type[BaseModel]) -> Any:
    """Validate a JSON body: malformed JSON (or a key given twice) is 400, a well-formed body with bad fields 422."""
    duplicate = _duplicate_key(raw)
    if duplicate:
        raise ServiceError(400, "invalid_json", f"key `{duplicate[:80]}` appears twice in one object; send it once.",
                           "body", [FieldError(location="body", detail=f"duplicate key `{duplicate[:80]}`")])
    try:
        return body.model_validate_json(raw)
    except ValidationError as exc:
        errors = field_errors(exc, body)
        malformed = errors[0].detail.startswith("malformed JSON")
        detail = "; ".join(f"`{e.location}`: {e.detail}" for e in errors[:8])
        hint = f" Fix the request; its JSON Schema is schemas/{_SCHEMA_FILES[body]}."
        raise ServiceError(400 if malformed else 422, "invalid_json" if malformed else "invalid_request",
                           detail + "." + hint, errors[0].location, errors) from None


def _duplicate_key(raw: bytes) -> str | None:
    """The first key repeated within one JSON object (the last would silently win), or None."""
    found: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        if not found and len(set(keys)) != len(keys):
            found.append(next(k for i, k in enumerate(keys) if k in keys[:i]))
        return {}

    try:
        json.loads(raw, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None  # malformed: the validator below says where
    return found[0] if found else None


_SCHEMA_FILES = {RecommendRequest: "serve-recommend-request.schema.json",
                 CheckRequest: "serve-check-request.schema.json",
                 PlanRequest: "serve-plan-request.schema.json"}


# -- HTTP plumbing ----------------------------------------------------------------------------


async def read_body(request: Request, limit: int = MAX_BODY_BYTES, timeout_s: float | None = None) -> bytes:
    """The request body, refused with 413 as soon as it passes `limit` bytes (whatever Content-Length says),
    and with 408 when it has not all arrived within `timeout_s` seconds."""
    import asyncio

    if timeout_s is None:
        timeout_s = request.app.state.limits.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(request, limit)
    except TimeoutError:
        raise ServiceError(408, "invalid_request", f"the request body did not arrive within {timeout_s:g} s.",
                           "body", headers={"Connection": "close"}) from None


async def _read_body(request: Request, limit: int) -> bytes:
    too_large = ServiceError(413, "body_too_large", f"the request body is larger than {limit:,} bytes; "
                             "send fewer deployments per request.", "body", headers={"Connection": "close"})
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        # Not a server error: the answer goes nowhere, but the metrics should say what happened.
        raise ServiceError(400, "invalid_request", "the client closed the connection before the body ended.",
                           "body") from None
    return b"".join(chunks)


def _json(snap: Snapshot, content: bytes | str, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(content, status_code=status, media_type="application/json",
                    headers={POLICY_HEADER: snap.hash, **(headers or {})})


def _error_response(request: Request, exc: ServiceError) -> Response:
    service: Service = request.app.state.service
    snap = service.holder.current
    service.metrics.error(_route(request.scope), exc.kind)
    body = ErrorBody(error=exc.kind, detail=exc.detail, location=exc.location, errors=exc.errors,  # type: ignore[arg-type]
                     policy=snap.label)
    return _json(snap, body.model_dump_json(), exc.status, exc.headers)


def _route(scope: Scope) -> str:
    path = scope.get("path", "")
    return path if path in ROUTES else "unmatched"


def _method(scope: Scope) -> str:
    method = scope.get("method", "")
    return method if method in _METHODS else "other"


_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class Service:
    """What the endpoints share: the policy holder, the metrics and the catalog listings."""

    def __init__(self, holder: PolicyHolder) -> None:
        self.holder = holder
        self.metrics = Metrics()
        self.started_at = time.time()
        # The catalogs are package data: listed once, served from memory.
        self.models_json = json.dumps([m.model_dump(mode="json", exclude_defaults=True)
                                       for m in load_models().values()])
        self.gpus_json = json.dumps([g.model_dump(mode="json", exclude_defaults=True)
                                     for g in load_gpus().values()])

    async def recommend(self, request: Request) -> Response:
        """POST /v1/recommend: one deployment -> Recommendation (the schema of `recommend --format json`)."""
        snap = self.holder.current
        req = parse(await read_body(request), RecommendRequest)
        return _json(snap, evaluate(snap, req).model_dump_json())

    async def check(self, request: Request) -> Response:
        """POST /v1/check: a batch of deployments (or the policy's own) judged as `kvpolicy check` does."""
        snap = self.holder.current
        raw = await read_body(request)
        body = parse(raw, CheckRequest) if raw.strip() else CheckRequest()
        result = await run_in_threadpool(check, snap, body)
        return _json(snap, result.model_dump_json())

    async def plan(self, request: Request) -> Response:
        """POST /v1/plan: traffic and targets -> PlanResult (the schema of `plan --format json`)."""
        snap = self.holder.current
        req = parse(await read_body(request), PlanRequest)
        # A plan is tens of evaluations (formats x TP sizes x load probes): off the event loop.
        result = await run_in_threadpool(evaluate_plan, snap.loaded, req, resolve, ServiceError)
        return _json(snap, result.model_dump_json())

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the model catalog (as `kvpolicy models --format json`)."""
        snap = self.holder.current
        return _json(snap, f'{{"policy": {json.dumps(snap.label)}, "models": {self.models_json}}}')

    async def gpus(self, request: Request) -> Response:
        """GET /v1/gpus: the GPU catalog (as `kvpolicy gpus --format json`)."""
        snap = self.holder.current
        return _json(snap, f'{{"policy": {json.dumps(snap.label)}, "gpus": {self.gpus_json}}}')

    async def healthz(self, request: Request) -> Response:
        """GET /healthz: liveness, the serving policy and the last reload's outcome."""
        snap = self.holder.current
        body = {"status": "ok", "policy": snap.label, "policy_hash": snap.hash, "policy_path": snap.path,
                "policy_loaded_at": snap.loaded_at, "uptime_s": round(time.time() - self.started_at, 3),
                "last_reload": self.holder.last_reload}
        return _json(snap, json.dumps(body))

    async def metrics_text(self, request: Request) -> Response:
        """GET /metrics: Prometheus text exposition."""
        snap = self.holder.current
        text = self.metrics.render(snap, self.holder.reloads)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8",
                        headers={POLICY_HEADER: snap.hash})


class _Instrument:
    """Outermost ASGI layer: times and counts every request, adds the policy header, never lets a crash out."""

    def __init__(self, app: ASGIApp, service: Service) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0

        async def send_with_header(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-kvpolicy-policy" for k, _ in headers):
                    headers.append((b"x-kvpolicy-policy", self.service.holder.current.hash.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_header)
        except Exception:  # noqa: BLE001 - Starlette already answered 500; keep the server up
            log.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            status = status or 500
        finally:
            self.service.metrics.observe(_route(scope), _method(scope), status or 500,
                                         time.perf_counter() - start)


def create_app(holder: PolicyHolder, *, reload_interval_s: float = 1.0, limits: Limits | None = None) -> ASGIApp:
    """The ASGI app serving `holder`'s policy; the file is polled every `reload_interval_s` (0 = never)."""
    import contextlib

    service = Service(holder)

    async def service_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServiceError)
        return _error_response(request, exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            allowed = ", ".join(sorted((exc.headers or {}).get("Allow", "").split(", ")))
            err = ServiceError(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}; "
                               f"use {allowed}.", None, headers={"Allow": allowed})
        elif exc.status_code == 404:
            err = ServiceError(404, "not_found", f"no endpoint {request.url.path}. Endpoints: "
                               + ", ".join(ROUTES) + ".", None)
        else:
            kind = "invalid_request" if exc.status_code < 500 else "internal_error"
            err = ServiceError(exc.status_code, kind, str(exc.detail), None, headers=dict(exc.headers or {}))
        return _error_response(request, err)

    async def internal_error(request: Request, exc: Exception) -> Response:
        err = ServiceError(500, "internal_error", f"internal error ({type(exc).__name__}); this is a bug in "
                           "kvpolicy, not in the request: the server log has the traceback.")
        return _error_response(request, err)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):  # noqa: ANN202 - Starlette's lifespan protocol
        async with holder.watching(reload_interval_s):
            yield

    routes = [
        Route("/v1/recommend", service.recommend, methods=["POST"]),
        Route("/v1/check", service.check, methods=["POST"]),
        Route("/v1/plan", service.plan, methods=["POST"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/gpus", service.gpus, methods=["GET"]),
        Route("/healthz", service.healthz, methods=["GET"]),
        Route("/metrics", service.metrics_text, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        ServiceError: service_error, HTTPException: http_error, Exception: internal_error})
    app.state.service = service
    app.state.limits = limits or Limits()
    return _Instrument(app, service)
