"""Bounded load test of `kvpolicy serve` on loopback: throughput and p50/p99 latency at 1, 8 and 32 clients.

Starts the real server (`python -m kvpolicy serve --port 0`) as a subprocess on
127.0.0.1, sends a fixed number of POST /v1/recommend requests per concurrency
level over keep-alive connections, checks every answer, stops the server and
prints a Markdown table. Nothing leaves the machine; every loop is bounded.

The default client is a few lines of asyncio over raw sockets (one keep-alive
connection per simulated client), so that on a 2-core machine the load
generator costs less CPU than the server it measures; `--client httpx` uses
httpx.AsyncClient instead, for comparison.

    python bench/bench_serve.py                          # 1, 8, 32 clients x 2000 requests x 3 runs
    python bench/bench_serve.py --server-args "--http h11 --loop asyncio"
    python bench/bench_serve.py --requests 500 --client httpx
    python bench/bench_serve.py --reload-churn --server-args "--reload-interval 0.05"   # broken edits under load
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOST = "127.0.0.1"  # loopback only, by design: never point this at another machine


def requests_mix() -> list[bytes]:
    """Varied, valid /v1/recommend bodies: catalog models x GPUs x contexts x priorities."""
    from kvpolicy.inputs.catalog import load_models

    models = list(load_models())
    gpus = ["h100", "h200", "b200", "a100", "l40s", "mi300x"]
    contexts = ["4k", "32k", 131072]
    priorities = ["decode", "prefill", "balanced"]
    bodies = []
    for i, (model, gpu) in enumerate(itertools.product(models, gpus)):
        bodies.append(json.dumps({"model": model, "gpu": gpu, "context": contexts[i % 3],
                                  "priority": priorities[(i // 3) % 3], "concurrency": 1 + i % 16}).encode())
    return bodies


def start_server(policy: str, log: Path, extra: list[str]) -> tuple[subprocess.Popen, int]:
    """`kvpolicy serve` on a free loopback port; returns the process and the port."""
    out = log.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kvpolicy", "serve", "--policy", policy, "--host", HOST,
                             "--port", "0", "--log-level", "warning", "--reload-interval", "0.2", *extra],
                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit(f"server did not start:\n{log.read_text()}")
        m = re.search(r"on http://127\.0\.0\.1:(\d+)", log.read_text())
        if m:
            return proc, int(m.group(1))
        time.sleep(0.05)


ANSWERS: dict[bytes, bytes] = {}
"""The first answer to each request body: the same body must always get the same answer (the policy does not
change during a run; --reload-churn only writes broken edits and the same good file back)."""


async def raw_client(port: int, bodies: list[bytes], count: int, latencies: list[float], errors: list[str]) -> None:
    """One keep-alive connection sending `count` requests one after another."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        for i in range(count):
            body = bodies[i % len(bodies)]
            head = (f"POST /v1/recommend HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            start = time.perf_counter()
            writer.write(head + body)
            status_line = await reader.readline()
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            payload = await reader.readexactly(length)
            latencies.append(time.perf_counter() - start)
            if b" 200 " not in status_line or not payload.startswith(b'{"schema_version":1'):
                errors.append(status_line.decode(errors="replace").strip())
            elif ANSWERS.setdefault(body, payload) != payload:
                errors.append(f"answer changed for {body.decode()}")
    except (OSError, asyncio.IncompleteReadError) as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        writer.close()


async def httpx_client(port: int, bodies: list[bytes], count: int, latencies: list[float], errors: list[str]) -> None:
    """The same with httpx.AsyncClient (more CPU per request on the client side)."""
    import httpx

    async with httpx.AsyncClient(base_url=f"http://{HOST}:{port}", timeout=10) as client:
        for i in range(count):
            start = time.perf_counter()
            try:
                r = await client.post("/v1/recommend", content=bodies[i % len(bodies)],
                                      headers={"Content-Type": "application/json"})
            except httpx.HTTPError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            latencies.append(time.perf_counter() - start)
            body = bodies[i % len(bodies)]
            if r.status_code != 200:
                errors.append(f"{r.status_code} {r.text[:200]}")
            elif ANSWERS.setdefault(body, r.content) != r.content:
                errors.append(f"answer changed for {body.decode()}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc), to separate cost from contention."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_level(port: int, bodies: list[bytes], clients: int, total: int, kind: str, pid: int) -> dict:
    """`total` requests split over `clients` concurrent connections."""
    client = raw_client if kind == "raw" else httpx_client
    cpu_before = cpu_seconds(pid)
    latencies: list[float] = []
    errors: list[str] = []
    per = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]
    # Each client starts at a different place in the mix.
    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(
        client(port, bodies[i * 7 % len(bodies):] + bodies[:i * 7 % len(bodies)], n, latencies, errors)
        for i, n in enumerate(per))), timeout=300)
    wall = time.perf_counter() - start
    server_cpu_s = cpu_seconds(pid) - cpu_before
    lat = sorted(latencies)
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {"clients": clients, "requests": total, "ok": len(lat) - len(errors), "errors": len(errors),
            "wall_s": wall, "throughput_rps": total / wall, "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3,
            "max_ms": lat[-1] * 1e3, "server_cpu_us_per_request": server_cpu_s / total * 1e6,
            "server_cpu_share": server_cpu_s / wall, "first_error": errors[0] if errors else None}


def summarise(runs: list[dict]) -> dict:
    """Medians over repeated runs of one level (the machine is shared; one run can be unlucky), plus the worst."""
    med = {k: statistics.median(r[k] for r in runs)
           for k in ("throughput_rps", "p50_ms", "p99_ms", "server_cpu_us_per_request", "server_cpu_share")}
    return {**runs[0], **med, "runs": len(runs), "requests": sum(r["requests"] for r in runs),
            "errors": sum(r["errors"] for r in runs), "worst_p99_ms": max(r["p99_ms"] for r in runs),
            "max_ms": max(r["max_ms"] for r in runs), "per_run": runs,
            "policy_writes": sum(r.get("policy_writes", 0) for r in runs)}


async def churn(policy: Path, stop: asyncio.Event) -> int:
    """Rewrite the policy file with broken edits and back, until stopped; returns the number of writes."""
    good = policy.read_text()
    broken = [good + "rules: [\n", good + "thresholds: {break_even_tokens: {value: lots}}\n"]
    writes = 0
    while not stop.is_set():
        for text in [*broken, good]:
            policy.write_text(text)
            writes += 1
            await asyncio.sleep(0.25)
    policy.write_text(good)
    return writes


async def main_async(args: argparse.Namespace) -> list[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="kvpolicy-bench-"))
    policy = workdir / "policy.yaml"
    policy.write_text("version: 1\nname: bench\nextends: builtin:default\n")
    proc, port = start_server(str(policy), workdir / "serve.log", args.server_args.split())
    bodies = requests_mix()
    results = []
    try:
        await run_level(port, bodies, 4, args.warmup, args.client, proc.pid)
        for clients in args.clients:
            runs = []
            for _ in range(args.repeat):
                stop = asyncio.Event()
                churner = asyncio.create_task(churn(policy, stop)) if args.reload_churn else None
                runs.append(await run_level(port, bodies, clients, args.requests, args.client, proc.pid))
                if churner is not None:
                    stop.set()
                    runs[-1]["policy_writes"] = await churner
            results.append(summarise(runs))
    finally:
        proc.terminate()
        proc.wait(10)
        log = (workdir / "serve.log").read_text()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.reload_churn:
        print(f"server log: {log.count('rejected, still serving')} broken edits rejected, "
              f"{log.count('now serving')} accepted", file=sys.stderr)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32], help="concurrency levels")
    parser.add_argument("--requests", type=int, default=2000, help="requests per level (default 2000)")
    parser.add_argument("--warmup", type=int, default=200, help="requests before measuring (default 200)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per level; medians are reported (default 3)")
    parser.add_argument("--client", choices=["raw", "httpx"], default="raw")
    parser.add_argument("--server-args", default="", help="extra `kvpolicy serve` options, e.g. '--http h11'")
    parser.add_argument("--reload-churn", action="store_true",
                        help="write broken policy edits (and the good file back) every 0.25 s during each level")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    args = parser.parse_args()
    if not 1 <= args.requests <= 100_000 or max(args.clients) > 256 or not 1 <= args.repeat <= 20:
        parser.error("keep the load bounded: --requests 1..100000, at most 256 clients, --repeat 1..20")
    results = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"server: kvpolicy serve {args.server_args or '(defaults)'}; client: {args.client}; "
              f"median of {args.repeat} runs per level")
        print("| clients | requests | errors | throughput (req/s) | p50 (ms) | p99 (ms) | worst p99 (ms) | max (ms) "
              "| server CPU/request (us) | server CPU share |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in results:
            print(f"| {r['clients']} | {r['requests']} | {r['errors']} | {r['throughput_rps']:.0f} | "
                  f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['worst_p99_ms']:.2f} | {r['max_ms']:.2f} | "
                  f"{r['server_cpu_us_per_request']:.0f} | {r['server_cpu_share']:.0%} |")
        if args.reload_churn:
            print(f"policy file rewrites during the runs: {sum(r['policy_writes'] for r in results)}")
    return 1 if any(r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
