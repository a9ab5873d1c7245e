"""`kvpolicy serve`: the real server on 127.0.0.1 in a subprocess, spoken to over HTTP with httpx."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvpolicy.commands.catalogs import schemas  # noqa: E402
from kvpolicy.inputs.catalog import load_gpus, load_models, resolve_gpu, resolve_model
from kvpolicy.inputs.workload import Workload, make_workload
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.validate import load_policy
from kvpolicy.service.api import MAX_BODY_BYTES, MAX_CHECK_DEPLOYMENTS, RecommendRequest

POLICY = """\
version: 1
name: team
extends: builtin:default
constraints:
  min_accuracy_floor: 0.9
deployments:
  - {name: chat, model: gpt-oss-20b, gpu: h100, context: 32k}
  - {name: rag, model: llama-3.1-8b, gpu: b200, context: 6k, priority: balanced}
  - {name: typo, model: gpt-oss-2b, gpu: h100}
"""
# The same policy with a pin that keeps gpt-oss in BF16: a good edit that changes the answer.
PINNED = POLICY + """\
pins:
  - name: gpt-oss-bf16
    when: {fact: model.family, op: eq, value: gpt-oss}
    set: {kv_cache_dtype: auto}
"""
BROKEN = {
    "yaml": POLICY + "rules: [\n",
    "schema": POLICY + "thresholds: {break_even_tokens: {value: lots}}\n",
    "unknown fact": POLICY + "pins:\n  - name: p\n    when: {fact: model.headdim, op: eq, value: 1}\n"
                    "    set: {kv_cache_dtype: auto}\n",
    "empty": "",
}
CHAT = {"model": "gpt-oss-20b", "gpu": "h100", "context": "32k"}


class Server:
    """`kvpolicy serve` in a subprocess on a free loopback port; its log goes to a file."""

    def __init__(self, policy: Path | str, log: Path, *args: str) -> None:
        self.log_path = log
        self._log = log.open("w")
        cmd = [sys.executable, "-m", "kvpolicy", "serve", "--policy", str(policy), "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not (m := re.search(r"on (http://127\.0\.0\.1:\d+)", self.log())):
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.05)
        self.url = m.group(1)
        self.client = httpx.Client(base_url=self.url, timeout=10)
        while True:
            try:
                if self.client.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, self.log()
                time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text()

    def hash(self) -> str:
        return self.client.get("/healthz").json()["policy_hash"]

    def wait_for(self, predicate, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.05)

    def stop(self) -> None:
        self.client.close()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def team_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("policy") / "team.yaml"
    path.write_text(POLICY)
    return path


@pytest.fixture(scope="module")
def server(team_file, tmp_path_factory):
    srv = Server(team_file, tmp_path_factory.mktemp("log") / "serve.log", "--reload-interval", "0")
    yield srv
    srv.stop()
    assert srv.proc.returncode in (0, 130) and "Application shutdown complete" in srv.log(), srv.log()


@pytest.fixture(scope="module")
def published():
    return schemas()


def _expected(policy: Path, **req) -> dict:
    loaded = load_policy(policy)
    model, gpu = req.pop("model"), req.pop("gpu")
    rec = recommend(resolve_model(model), resolve_gpu(gpu), make_workload(loaded, **req), loaded)
    return rec.model_dump(mode="json")


def _validate(doc, schema: dict) -> None:
    import jsonschema

    jsonschema.validate(doc, schema)


# -- endpoints ---------------------------------------------------------------------------------


def test_recommend_is_the_cli_recommendation(server, team_file, published):
    r = server.client.post("/v1/recommend", json=CHAT)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == _expected(team_file, **CHAT)
    _validate(body, published["recommendation.schema.json"])
    assert body["decision"]["kv_cache_dtype"] == "fp8"
    assert body["policy"] == f"team@{r.headers['x-kvpolicy-policy']}"
    # `32k` and 32768 are the same request; every optional field can be given.
    full = {**CHAT, "context": 32768, "priority": "decode", "concurrency": 1, "tp": 1, "accuracy_floor": None,
            "gpu_memory_utilization": 0.92}
    assert server.client.post("/v1/recommend", json=full).json() == body


def test_a_gpu_name_with_a_count_is_the_tp(server, team_file):
    # Spaces, case and a count are read as the CLI reads them: `2x RTX 4090` is rtx-4090 at tp 2.
    r = server.client.post("/v1/recommend", json={**CHAT, "gpu": "2x RTX 4090"})
    assert r.status_code == 200, r.text
    assert r.json() == _expected(team_file, **{**CHAT, "gpu": "rtx-4090", "tp": 2})
    assert r.json()["workload"]["tp"] == 2
    assert server.client.post("/v1/recommend", json={**CHAT, "gpu": "rtx4090x2", "tp": 2}).json() == r.json()
    check = server.client.post("/v1/check", json={"deployments": [{**CHAT, "gpu": "2xh100"}]}).json()
    assert check["results"][0]["report"]["vllm_args"] == server.client.post(
        "/v1/recommend", json={**CHAT, "gpu": "h100", "tp": 2}).json()["vllm_args"]


def test_recommend_matches_cli_json_output(server, team_file):
    out = subprocess.run([sys.executable, "-m", "kvpolicy", "recommend", "-m", "llama-3.1-8b", "-g", "b200",
                          "-c", "6k", "--priority", "balanced", "--policy", str(team_file), "--format", "json"],
                         capture_output=True, text=True, check=True).stdout
    r = server.client.post("/v1/recommend", json={"model": "llama-3.1-8b", "gpu": "b200", "context": "6k",
                                                  "priority": "balanced"})
    assert r.json() == json.loads(out)


def test_catalog_endpoints(server):
    models = server.client.get("/v1/models")
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["models"]] == list(load_models())
    gpus = server.client.get("/v1/gpus").json()
    assert [g["id"] for g in gpus["gpus"]] == list(load_gpus())
    assert models.json()["policy"] == gpus["policy"] == f"team@{models.headers['x-kvpolicy-policy']}"


def test_healthz(server, team_file):
    r = server.client.get("/healthz")
    body = r.json()
    assert body["status"] == "ok"
    assert body["policy_hash"] == r.headers["x-kvpolicy-policy"] == load_policy(team_file).content_hash
    assert body["policy_path"] == str(team_file)


def test_check_batch(server, published, team_file):
    from kvpolicy.inputs.policy_schema import Deployment
    from kvpolicy.policy.deployments import check_deployment

    batch = {"deployments": [
        {"name": "chat", **CHAT},
        {"model": "llama-3.1-8b", "gpu": "h100", "context": 4096},
        {"name": "typo", "model": "gpt-oss-2b", "gpu": "h100"},
        {"name": "old-gpu", "model": "gpt-oss-20b", "gpu": "h10"},
        {"name": "floor", "model": "gpt-oss-20b", "gpu": "h100", "accuracy_floor": 0.5},
        {"name": "too-big", "model": "llama-3.1-405b", "gpu": "l40s", "context": "128k"},
    ]}
    r = server.client.post("/v1/check", json=batch)
    assert r.status_code == 200, r.text
    body = r.json()
    _validate(body, published["serve-check-response.schema.json"])
    assert (body["source"], body["ok"], body["num_deployments"]) == ("request", False, 6)
    assert (body["num_ok"], body["num_violations"], body["num_errors"]) == (2, 1, 3)
    chat, unnamed, typo, old_gpu, floor, too_big = body["results"]
    # The report is `kvpolicy check`'s own, for the same deployment.
    expected = check_deployment(load_policy(team_file), Deployment(name="chat", model="gpt-oss-20b", gpu="h100-sxm",
                                                                   context=32768))
    assert chat["status"] == "ok" and chat["report"]["decision"] == expected["decision"]
    assert chat["report"]["vllm_args"] == expected["vllm_args"] == server.client.post(
        "/v1/recommend", json=CHAT).json()["vllm_args"]
    assert unnamed["name"] == "deployment-2" and unnamed["report"]["decision"]["kv_cache_dtype"] == "auto"
    assert typo["error"]["error"] == "unknown_model" and "Did you mean `gpt-oss-20b`" in typo["error"]["detail"]
    assert old_gpu["error"]["error"] == "unknown_gpu" and old_gpu["error"]["location"] == "gpu"
    assert floor["status"] == "error" and "min_accuracy_floor 0.9" in floor["error"]["detail"]
    assert too_big["status"] == "violation" and "no memory for a KV cache" in too_big["violations"][0]


def test_check_without_deployments_evaluates_the_policys(server):
    for kwargs in ({"content": b""}, {"json": {}}, {"json": {"deployments": None}}):
        body = server.client.post("/v1/check", **kwargs).json()
        assert body["source"] == "policy" and body["ok"] is False
        assert [(r["name"], r["status"]) for r in body["results"]] == [("chat", "ok"), ("rag", "ok"), ("typo", "error")]
        assert body["results"][0]["report"]["line"] == 7
        assert body["results"][2]["error"]["error"] == "deployment_error"


def test_metrics(server):
    server.client.post("/v1/recommend", json=CHAT)
    server.client.post("/v1/recommend", json={"model": "nope", "gpu": "h100"})
    text = server.client.get("/metrics").text
    h = server.hash()
    assert f'kvpolicy_policy_info{{name="team",hash="{h}",path=' in text
    assert re.search(r'kvpolicy_http_requests_total\{route="/v1/recommend",method="POST",status="200"\} [1-9]', text)
    assert re.search(r'kvpolicy_http_errors_total\{route="/v1/recommend",error="unknown_model"\} [1-9]', text)
    assert re.search(r'kvpolicy_http_request_duration_seconds_bucket\{route="/v1/recommend",le="\+Inf"\} [1-9]', text)
    assert 'kvpolicy_policy_reload_total{result="rejected"} 0' in text
    # Client-chosen paths and methods never become labels. (httptools refuses an unknown method itself
    # with a 400 before the app sees it; h11 passes it on and it is counted as `other`.)
    assert server.client.request("BREW", "/coffee/" + "x" * 50).status_code in (400, 404)
    server.client.request("PATCH", "/coffee/" + "y" * 50)
    text = server.client.get("/metrics").text
    assert "coffee" not in text and "BREW" not in text and 'route="unmatched",method="PATCH",status="404"' in text


# -- bad requests: every one a 4xx JSON error naming what is wrong ------------------------------


@pytest.mark.parametrize(("path", "kwargs", "status", "kind", "location", "says"), [
    ("/v1/recommend", {"content": b"{\"model\": "}, 400, "invalid_json", "body", "malformed JSON"),
    ("/v1/recommend", {"content": b"\xff\xfe"}, 400, "invalid_json", "body", "malformed JSON"),
    ("/v1/recommend", {"content": b""}, 400, "invalid_json", "body", "malformed JSON"),
    ("/v1/recommend", {"json": [CHAT]}, 422, "invalid_request", "body", "an object"),
    ("/v1/recommend", {"json": {**CHAT, "tp": "2"}}, 422, "invalid_request", "tp", "valid integer"),
    ("/v1/recommend", {"json": {**CHAT, "concurrency": True}}, 422, "invalid_request", "concurrency", "true"),
    ("/v1/recommend", {"json": {**CHAT, "tp": 0}}, 422, "invalid_request", "tp", "greater than 0"),
    ("/v1/recommend", {"json": {**CHAT, "context": "lots"}}, 422, "invalid_request", "context", "token count"),
    ("/v1/recommend", {"json": {**CHAT, "context": 1.5}}, 422, "invalid_request", "context", "token count"),
    ("/v1/recommend", {"json": {**CHAT, "priority": "fast"}}, 422, "invalid_request", "priority", "decode"),
    ("/v1/recommend", {"json": {**CHAT, "contxt": "8k"}}, 422, "invalid_request", "contxt", "`context`"),
    ("/v1/recommend", {"json": {"gpu": "h100"}}, 422, "invalid_request", "model", "missing"),
    ("/v1/recommend", {"json": {**CHAT, "gpu": "auto"}}, 422, "invalid_request", "gpu", "catalog GPU"),
    ("/v1/recommend", {"json": {**CHAT, "accuracy_floor": 0.5}}, 422, "invalid_request", "accuracy_floor",
     "min_accuracy_floor"),
    ("/v1/recommend", {"json": {**CHAT, "model": "gpt-oss-2b"}}, 404, "unknown_model", "model",
     "Did you mean `gpt-oss-20b`"),
    ("/v1/recommend", {"json": {**CHAT, "gpu": "h1000"}}, 404, "unknown_gpu", "gpu", "Did you mean"),
    ("/v1/recommend", {"json": {**CHAT, "gpu": "2xh100", "tp": 4}}, 422, "invalid_request", "tp",
     "names 2 GPUs but tp is 4"),
    # A known GPU with a count out of range is a bad field, not an unknown GPU.
    ("/v1/recommend", {"json": {**CHAT, "gpu": "0xh100"}}, 422, "invalid_request", "gpu",
     "the count must be in 1..1024"),
    # Paths are never read: a config.json path is just an unknown name.
    ("/v1/recommend", {"json": {**CHAT, "model": "tests/fixtures/hf/gpt-oss-20b"}}, 404, "unknown_model", "model",
     "paths are not accepted"),
    ("/v1/recommend", {"json": {**CHAT, "model": "/etc/passwd"}}, 404, "unknown_model", "model", "not accepted"),
    ("/v1/check", {"json": {"deployments": [CHAT, {**CHAT, "tpp": 2}]}}, 422, "invalid_request",
     "deployments[1].tpp", "`tp`"),
    ("/v1/check", {"json": {"deployments": [CHAT] * (MAX_CHECK_DEPLOYMENTS + 1)}}, 422, "invalid_request",
     "deployments", "at most 128"),
    ("/v1/check", {"json": {"deployment": []}}, 422, "invalid_request", "deployment", "`deployments`"),
    ("/v1/recommend", {"content": b" " * (MAX_BODY_BYTES + 1)}, 413, "body_too_large", "body", "65,536"),
    ("/v1/check", {"content": iter([b"{" + b" " * 4096] * 17)}, 413, "body_too_large", "body", "65,536"),
    ("/v1/recommend", {"method": "GET"}, 405, "method_not_allowed", None, "use POST"),
    ("/v1/models", {"method": "POST"}, 405, "method_not_allowed", None, "use GET"),
    ("/v2/recommend", {}, 404, "not_found", None, "/v1/recommend"),
])
def test_bad_requests(server, published, path, kwargs, status, kind, location, says):
    method = kwargs.pop("method", "POST")
    r = server.client.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.headers["x-kvpolicy-policy"] == server.hash()
    body = r.json()
    _validate(body, published["serve-error.schema.json"])
    assert (body["error"], body["location"]) == (kind, location)
    assert says in body["detail"]
    assert body["policy"].startswith("team@")


def test_chunked_body_over_the_limit_is_refused_while_reading(server):
    # No Content-Length at all: the limit is counted as the chunks arrive.
    sent = []

    def chunks():
        for _ in range(64):
            sent.append(1)
            yield b" " * 4096

    r = server.client.post("/v1/recommend", content=chunks())
    assert r.status_code == 413
    assert server.client.post("/v1/recommend", json=CHAT).status_code == 200


def test_request_and_workload_bounds_agree():
    fields = Workload.model_json_schema()["properties"]
    mine = RecommendRequest.model_json_schema()["properties"]
    for name in ("concurrency", "tp", "gpu_memory_utilization"):
        assert (mine[name].get("exclusiveMinimum"), mine[name].get("maximum")) == (
            fields[name].get("exclusiveMinimum"), fields[name].get("maximum")), name
    floor = next(s for s in mine["accuracy_floor"]["anyOf"] if s.get("type") == "number")
    assert (floor["exclusiveMinimum"], floor["maximum"]) == (0, fields["accuracy_floor"]["maximum"])


_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
_json = st.recursive(_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                     max_leaves=10)
_names = st.sampled_from([*load_models(), *load_gpus(), "h100", "auto", "", " ", "../x.json", "gpt-oss-2b"])
_fields = {
    "model": _names | _json, "gpu": _names | _json,
    "context": st.integers(-5, 1 << 25) | st.sampled_from(["32k", "1m", "0", "1.5k", "k", "16m", "17m"]) | _json,
    "priority": st.sampled_from(["decode", "prefill", "balanced", "DECODE"]) | _json,
    "concurrency": st.integers(-2, 2_000_000) | _json, "tp": st.integers(-2, 2048) | _json,
    "accuracy_floor": st.floats(-0.5, 1.5) | st.none() | _json,
    "gpu_memory_utilization": st.floats(-0.5, 1.5) | _json, "extra": _json,
}
_requests = st.fixed_dictionaries({}, optional=_fields)
_bodies = st.one_of(st.binary(max_size=64), _json.map(lambda v: json.dumps(v).encode()),
                    _requests.map(lambda v: json.dumps(v).encode()),
                    st.lists(_requests, max_size=3).map(lambda v: json.dumps({"deployments": v}).encode()))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=_bodies, path=st.sampled_from(["/v1/recommend", "/v1/check"]))
def test_garbage_never_gets_a_500(server, body, path):
    r = server.client.post(path, content=body)
    assert r.status_code in (200, 400, 404, 413, 422), r.text
    assert r.headers["x-kvpolicy-policy"]
    assert "policy" in r.json()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=st.sampled_from(list(load_models())), gpu=st.sampled_from(list(load_gpus())),
       context=st.integers(1, 1 << 24), priority=st.sampled_from(["decode", "prefill", "balanced"]),
       concurrency=st.integers(1, 1_000_000), tp=st.sampled_from([1, 2, 4, 8, 16, 1024]),
       floor=st.none() | st.floats(0.9, 1.0), util=st.floats(0.01, 1.0))
def test_every_valid_request_gets_an_answer(server, model, gpu, context, priority, concurrency, tp, floor, util):
    req = {"model": model, "gpu": gpu, "context": context, "priority": priority, "concurrency": concurrency,
           "tp": tp, "accuracy_floor": floor, "gpu_memory_utilization": util}
    r = server.client.post("/v1/recommend", json=req)
    arch = load_models()[model]
    # What vLLM itself refuses is the request's error (422, pointing at the field); the rest gets an answer.
    refused = "tp" if tp not in arch.valid_tp_sizes(tp) else "context" if context > arch.max_model_len else None
    if refused:
        assert r.status_code == 422 and r.json()["location"] == refused, r.text
    else:
        assert r.status_code == 200, r.text


def test_limits_vllm_enforces_are_422s_naming_the_field(server):
    r = server.client.post("/v1/recommend", json={"model": "phi-4", "gpu": "h100", "context": "64k"})
    assert r.status_code == 422 and r.json()["location"] == "context"
    assert "16,384" in r.json()["detail"] and "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in r.json()["detail"]
    r = server.client.post("/v1/recommend", json={"model": "llama-3.1-8b", "gpu": "h100", "tp": 3})
    assert r.status_code == 422 and r.json()["location"] == "tp"
    assert "Valid tensor-parallel sizes up to 8: 1, 2, 4, 8" in r.json()["detail"]
    r = server.client.post("/v1/recommend", json={"model": "deepseek-v3", "gpu": "h100"})
    assert r.status_code == 200 and "--tp 16" in r.json()["blockers"][0]


# -- hot reload ----------------------------------------------------------------------------------


@pytest.fixture
def reloading(tmp_path):
    policy = tmp_path / "team.yaml"
    policy.write_text(POLICY)
    srv = Server(policy, tmp_path / "serve.log", "--reload-interval", "0.05", "--reload-settle", "0.05")
    yield srv, policy
    srv.stop()


def _write(path: Path, text: str) -> None:
    """Replace the file in one step, as editors and config management do."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _dtype(srv: Server) -> str:
    return srv.client.post("/v1/recommend", json=CHAT).json()["decision"]["kv_cache_dtype"]


def _reloads(srv: Server, result: str) -> int:
    m = re.search(rf'kvpolicy_policy_reload_total{{result="{result}"}} (\d+)', srv.client.get("/metrics").text)
    return int(m.group(1))


def test_reload_good_and_broken_edits(reloading):
    srv, policy = reloading
    first = srv.hash()
    assert _dtype(srv) == "fp8"
    _write(policy, PINNED)
    srv.wait_for(lambda: srv.hash() != first)
    assert srv.hash() == load_policy(policy).content_hash
    assert _dtype(srv) == "auto"
    assert _reloads(srv, "accepted") == 1
    pinned = srv.hash()
    for n, (what, text) in enumerate(BROKEN.items(), 1):
        _write(policy, text)
        srv.wait_for(lambda n=n: _reloads(srv, "rejected") == n)
        assert srv.hash() == pinned and _dtype(srv) == "auto", what
        last = srv.client.get("/healthz").json()["last_reload"]
        assert last["result"] == "rejected" and last["error"], what
    assert srv.log().count("rejected, still serving team@" + pinned) == len(BROKEN)
    assert "model.headdim" in srv.log() and "policy file is empty" in srv.log()
    _write(policy, POLICY)
    srv.wait_for(lambda: srv.hash() == first)
    assert _dtype(srv) == "fp8"


def test_reload_on_sighup(tmp_path):
    policy = tmp_path / "team.yaml"
    policy.write_text(POLICY)
    srv = Server(policy, tmp_path / "serve.log", "--reload-interval", "0")
    try:
        first = srv.hash()
        policy.write_text(PINNED)
        time.sleep(0.3)
        assert srv.hash() == first  # not watched: only SIGHUP reloads
        srv.proc.send_signal(signal.SIGHUP)
        srv.wait_for(lambda: srv.hash() != first)
        assert _dtype(srv) == "auto"
        policy.write_text(BROKEN["yaml"])
        srv.proc.send_signal(signal.SIGHUP)
        srv.wait_for(lambda: _reloads(srv, "rejected") == 1)
        assert _dtype(srv) == "auto" and srv.proc.poll() is None
    finally:
        srv.stop()


def test_broken_edits_under_load_lose_no_request_and_change_no_answer(reloading):
    srv, policy = reloading
    expected = srv.client.post("/v1/recommend", json=CHAT)
    num_clients, per_client = 8, 60
    answers: list[tuple[int, str, bytes]] = []
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            for _ in range(per_client):
                r = c.post("/v1/recommend", json=CHAT)
                with lock:
                    answers.append((r.status_code, r.headers["x-kvpolicy-policy"], r.content))

    threads = [threading.Thread(target=client) for _ in range(num_clients)]
    for t in threads:
        t.start()
    edits = 0
    # Each broken version holds still for three poll intervals (0.05 s), so the watcher can
    # read it even when the requests delay its event loop; once the clients are done, the
    # edits go on until the watcher has rejected one (on a busy machine the clients can
    # finish before any edit was read).
    deadline = time.monotonic() + 30
    while any(t.is_alive() for t in threads) or (_reloads(srv, "rejected") == 0 and time.monotonic() < deadline):
        for text in BROKEN.values():
            policy.write_text(text)
            time.sleep(0.15)
            edits += 1
        policy.write_text(POLICY)
        time.sleep(0.15)
    for t in threads:
        t.join()
    assert len(answers) == num_clients * per_client
    assert {(s, h) for s, h, _ in answers} == {(200, expected.headers["x-kvpolicy-policy"])}
    assert {body for *_, body in answers} == {expected.content}
    assert edits >= 3 and _reloads(srv, "rejected") >= 1
    assert _reloads(srv, "accepted") == 0


def test_good_edit_under_load_swaps_atomically(reloading):
    srv, policy = reloading
    answers: list[dict] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            while not stop.is_set() and len(answers) < 2000:
                r = c.post("/v1/recommend", json=CHAT)
                answers.append({"status": r.status_code, "hash": r.headers["x-kvpolicy-policy"], **r.json()})

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    policy.write_text(PINNED)
    new = load_policy(policy).content_hash
    srv.wait_for(lambda: any(a["hash"] == new for a in answers))
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join()
    # Every answer is wholly the old policy's or wholly the new one's.
    dtype = {load_policy(policy).content_hash: "auto"}
    for a in answers:
        assert a["status"] == 200
        assert a["policy"] == f"team@{a['hash']}"
        assert a["decision"]["kv_cache_dtype"] == dtype.get(a["hash"], "fp8")
    assert {a["hash"] for a in answers} == {new, answers[0]["hash"]} and answers[0]["hash"] != new


# -- command line ----------------------------------------------------------------------------------


def test_broken_policy_at_start_is_a_usage_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN["unknown fact"])
    out = subprocess.run([sys.executable, "-m", "kvpolicy", "serve", "--policy", str(bad), "--port", "0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "model.headdim" in out.stderr and "Did you mean" in out.stderr


def test_port_in_use_is_a_usage_error(server):
    port = server.url.rsplit(":", 1)[1]
    out = subprocess.run([sys.executable, "-m", "kvpolicy", "serve", "--port", port],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr


def test_other_commands_do_not_import_the_server_stack(team_file):
    code = ("import sys; from kvpolicy.cli import main; "
            "main(['recommend', '-m', 'gpt-oss-20b', '-g', 'h100', '--format', 'json']); "
            "main(['schema', '--check', '--out', sys.argv[1]]); "
            "print(sorted(m for m in ('starlette', 'uvicorn', 'httpx', 'anyio') if m in sys.modules), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code, str(team_file.parent)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr


def test_api_fields_are_documented():
    from kvpolicy.outputs.fielddocs import field_docstrings, model_tree
    from kvpolicy.service import api

    for root in (api.RecommendRequest, api.CheckRequest, api.CheckResponse, api.ErrorBody):
        for model in model_tree(root):
            if not model.__module__.startswith("kvpolicy.service.api"):
                continue
            docs: dict[str, str] = {}
            for klass in reversed(model.__mro__):
                if klass.__module__.startswith("kvpolicy"):
                    docs.update(field_docstrings(klass))
            assert not [n for n in model.model_fields if not docs.get(n)], model.__name__


def test_a_bug_is_a_json_500_and_the_server_stays_up(monkeypatch):
    # In-process (Starlette's TestClient): the one way to make kvpolicy itself fail on purpose.
    from starlette.testclient import TestClient

    import kvpolicy.service.app as service
    from kvpolicy.service.reload import PolicyHolder

    def broken(*args, **kwargs):
        raise RuntimeError("simulated bug")

    client = TestClient(service.create_app(PolicyHolder("builtin:default")), raise_server_exceptions=False)
    monkeypatch.setattr(service, "recommend", broken)
    r = client.post("/v1/recommend", json=CHAT)
    assert r.status_code == 500 and r.json()["error"] == "internal_error" and "bug" in r.json()["detail"]
    assert r.headers["x-kvpolicy-policy"]
    monkeypatch.undo()
    assert client.post("/v1/recommend", json=CHAT).status_code == 200
    assert 'status="500"} 1' in client.get("/metrics").text
