"""Host cost of every public store and decode entry point, and what a decode step and a BF16 call cost in graph
replay against eager launches.

Sections (`--sections`, all by default):
- host: each entry point at a small shape (batch 1, 4k tokens, the Llama layer): eager (`do_bench` median,
  L2 flushed), the same call captured in a CUDA graph and replayed, their difference (what the host adds when
  its launches cannot hide behind the GPU), and the host's own time per call (wall clock of back-to-back
  calls, nothing synchronised in between), with the range checks off (`guards.unchecked()`, as the runtime
  calls them) and on (the default for a direct call: one host sync each).
- step: `kvpolicy bench`'s decode step (all layers of llama-3.1-8b, batch 1) per variant at a few contexts, in
  graph replay and eager, and the GPU time per kernel of one eager TurboQuant step (torch.profiler).
- graph: our BF16 Triton kernel against SDPA on cuDNN, batch 1 and 8, 16k-128k, shuffled pages, eager and in
  graph replay (one call per graph, L2 flushed before each).

`python bench/bench_host.py [--sections host,step,graph] [--json FILE]`; on a CPU (`TRITON_INTERPRET=1`)
`--sections host` runs every entry point once at a tiny shape (a smoke test: no timings).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kvpolicy.kernels.formats import TQ_FORMATS  # noqa: E402
from kvpolicy.kernels.guards import unchecked  # noqa: E402
from kvpolicy.kernels.launch import gluon_runs_on  # noqa: E402

HOST_CALLS = 200
"""Back-to-back calls whose wall clock gives the host time per call."""


def do_bench_us(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")) * 1e3


def graph_of(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` captured once (after eager warm-up) in a CUDA graph; its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g.replay


def host_us(fn: Callable[[], Any]) -> float:
    """Wall-clock microseconds per call of HOST_CALLS calls enqueued back to back (the GPU work is small, so the
    host is what limits them)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / HOST_CALLS * 1e6


# --------------------------------------------------------------------------- entry points


def entry_points(device: torch.device, batch: int, context: int, q_heads: int = 32, kv_heads: int = 8,
                 head_dim: int = 128) -> dict[str, Callable[[], Any]]:
    """name -> a zero-argument call of one public store or decode entry point on ready inputs."""
    from kvpolicy.kernels.decode_attention import decode_attention
    from kvpolicy.kernels.paged_store import allocate_cache, compute_kv_scales, store_kv
    from kvpolicy.kernels.tq_decode import decode_attention_tq
    from kvpolicy.kernels.tq_store import store_kv_tq
    from kvpolicy.kernels.turboquant import allocate_tq_cache, allocate_tq_planar_cache

    page = 16
    pages = math.ceil((context + 1) / page)
    num_blocks = batch * pages
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, torch.bfloat16)

    q = randn(batch, q_heads, head_dim)
    k_new, v_new = randn(batch, kv_heads, head_dim), randn(batch, kv_heads, head_dim)
    tables = (torch.randperm(num_blocks, generator=gen).to(torch.int32).view(batch, pages)).to(device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    slots = (tables[:, context // page].to(torch.int64) * page + context % page).contiguous()
    out = torch.empty_like(q)
    gluon = gluon_runs_on(device)[0]
    calls: dict[str, Callable[[], Any]] = {}

    def fill_paged(kc: torch.Tensor, vc: torch.Tensor, ks: Any, vs: Any) -> None:
        n = batch * context
        allslots = (tables[:, :context // page].to(torch.int64)[:, :, None] * page
                    + torch.arange(page, device=device)).reshape(-1)[:n]
        store_kv(randn(n, kv_heads, head_dim), randn(n, kv_heads, head_dim), kc, vc, allslots, ks, vs)

    for name, dt in (("bf16", "auto"), ("fp8", "fp8")):
        kc, vc = allocate_cache(num_blocks, page, kv_heads, head_dim, dt, device)
        ks = vs = None
        if dt == "fp8":
            ks, vs = compute_kv_scales(k_new, v_new, per_head=True)
        fill_paged(kc, vc, ks, vs)
        calls[f"store_kv {name}"] = lambda kc=kc, vc=vc, ks=ks, vs=vs: store_kv(k_new, v_new, kc, vc, slots, ks, vs)
        common = dict(k_scale=ks, v_scale=vs, out=out)
        calls[f"decode_attention {name} triton"] = lambda kc=kc, vc=vc, c=common: decode_attention(
            q, kc, vc, tables, seq_lens, **c)
        if dt == "fp8":
            calls["decode_attention fp8 triton one_level"] = lambda kc=kc, vc=vc, c=common: decode_attention(
                q, kc, vc, tables, seq_lens, two_level=False, fp8_query=gluon, **c)
            if gluon:
                calls["decode_attention fp8 gluon"] = lambda kc=kc, vc=vc, c=common: decode_attention(
                    q, kc, vc, tables, seq_lens, fp8_query=True, kernel="gluon", **c)
    for fmt in TQ_FORMATS:
        layouts = [("slots", allocate_tq_cache, "triton")]
        if gluon:
            layouts.append(("planar", allocate_tq_planar_cache, "gluon"))
        for lay, alloc, kernel in layouts:
            cache = alloc(num_blocks, page, kv_heads, head_dim, fmt, device)
            n = batch * context
            allslots = (tables[:, :context // page].to(torch.int64)[:, :, None] * page
                        + torch.arange(page, device=device)).reshape(-1)[:n]
            store_kv_tq(randn(n, kv_heads, head_dim), randn(n, kv_heads, head_dim), cache, allslots, fmt)
            calls[f"store_kv_tq {fmt} {lay}"] = lambda c=cache, f=fmt: store_kv_tq(k_new, v_new, c, slots, f)
            calls[f"decode_attention_tq {fmt} {kernel}"] = lambda c=cache, f=fmt, k=kernel: decode_attention_tq(
                q, c, tables, seq_lens, f, out=out, kernel=k)
    calls.update(runtime_layers(device, batch, context))
    return calls


def runtime_layers(device: torch.device, batch: int, context: int) -> dict[str, Callable[[], Any]]:
    """The runtime's per-layer calls (`ops.store` then `ops.decode`, as `DecodeStep.run` makes them) on one
    llama-3.1-8b full layer, per variant."""
    from kvpolicy.inputs.catalog import resolve_model
    from kvpolicy.runtime import ops
    from kvpolicy.runtime.caches import allocate, plan_layers, slots_for
    from kvpolicy.runtime.variants import parse_variant

    arch = resolve_model("llama-3.1-8b")
    backend = "triton" if device.type == "cuda" else "reference"
    calls: dict[str, Callable[[], Any]] = {}
    for name in ("bf16", "fp8", "fp8+one_level", "turboquant_4bit_nc"):
        v = parse_variant(name)
        plan = plan_layers(arch, v)[8]  # a middle layer: TurboQuant's boundary layers are BF16
        cache = allocate([plan], batch, context + 1, device, layout=v.cache_layout)[0]
        assert cache is not None
        gen = torch.Generator(device="cpu").manual_seed(1)
        dt = torch.bfloat16 if backend == "triton" else torch.float32
        q = torch.randn(batch, plan.num_q_heads, plan.head_dim, generator=gen).to(device, dt)
        k = torch.randn(batch, plan.num_kv_heads, plan.head_dim, generator=gen).to(device, dt)
        slots = slots_for(torch.tensor([context], device=device), cache.block_tables).reshape(batch)
        pages = math.ceil((context + 1) / 16)
        tables = cache.block_tables[:, :pages]
        seq_lens = torch.full((batch,), context + 1, dtype=torch.int32, device=device)

        def layer(cache=cache, plan=plan, q=q, k=k, slots=slots, tables=tables, seq_lens=seq_lens, v=v) -> None:
            ops.store(cache, k, k, slots, backend)
            ops.decode(cache, plan, q, tables, seq_lens, backend, v.two_level)

        calls[f"runtime layer {name} (ops.store + ops.decode)"] = layer
    return calls


def section_host(device: torch.device, report: dict) -> None:
    cpu = device.type != "cuda"
    batch, context = (1, 64) if cpu else (1, 4096)
    calls = entry_points(device, batch, context, *((4, 2, 64) if cpu else ()))
    rows = []
    print(f"\n## Host cost per call: batch {batch}, {context} tokens, "
          f"{'4 query / 2 KV heads, head_dim 64' if cpu else 'Llama layer (32 query / 8 KV heads, head_dim 128)'}")
    print("| entry point | eager us | graph replay us | eager - graph us | host us per call | with range checks |")
    print("|---|---|---|---|---|---|")
    for name, fn in calls.items():
        if cpu:
            fn()
            rows.append({"entry": name, "ran": True})
            print(f"| {name} | ran | - | - | - | - |")
            continue
        fn()
        torch.cuda.synchronize()
        checked = host_us(fn)
        with unchecked():
            eager = do_bench_us(fn)
            graph = do_bench_us(graph_of(fn))
            host = host_us(fn)
        rows.append({"entry": name, "eager_us": eager, "graph_us": graph, "host_us": host, "host_us_checked": checked})
        print(f"| {name} | {eager:.1f} | {graph:.1f} | {eager - graph:.1f} | {host:.1f} | {checked:.1f} |", flush=True)
    report["host"] = rows


# --------------------------------------------------------------------------- the runtime's decode step


def section_step(device: torch.device, report: dict) -> None:
    from kvpolicy.inputs.catalog import resolve_model
    from kvpolicy.runtime.bench import time_step
    from kvpolicy.runtime.step import DecodeStep
    from kvpolicy.runtime.variants import parse_variant

    arch = resolve_model("llama-3.1-8b")
    contexts = [1024, 4096, 16384]
    rows = []
    print("\n## kvpolicy bench's decode step, llama-3.1-8b (32 layers), batch 1: ms per step")
    print("| variant | context | graph replay ms | eager ms |")
    print("|---|---|---|---|")
    for name in ("bf16", "fp8", "turboquant_4bit_nc"):
        step = DecodeStep(arch, parse_variant(name), 1, contexts[-1], device, "triton")
        step.fill(contexts[-1])
        for c in contexts:
            step.prepare(c)
            graph_ms, _ = time_step(step)
            eager_ms = do_bench_us(step.run) / 1e3
            rows.append({"variant": name, "context": c, "graph_ms": graph_ms, "eager_ms": eager_ms})
            print(f"| {name} | {c} | {graph_ms:.3f} | {eager_ms:.3f} |", flush=True)
        if name.startswith("turboquant"):
            step.prepare(4096)
            _profile(step, report)
        del step
        torch.cuda.empty_cache()
    report["step"] = rows


def _profile(step: Any, report: dict) -> None:
    for label, fn in (("eager", step.run), ("graph replay", graph_of(step.run))):
        _profile_one(label, fn, report)


def _profile_one(label: str, fn: Callable[[], Any], report: dict) -> None:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            totals.setdefault(e.name[:60], []).append(e.device_time_total if hasattr(e, "device_time_total")
                                                      else e.cuda_time_total)
    rows = sorted(((n, sum(v) / 5, len(v) / 5) for n, v in totals.items()), key=lambda r: -r[1])
    print(f"\n### GPU time per kernel of one {label} turboquant_4bit_nc step at 4096 tokens (torch.profiler, mean of 5)")
    print("| kernel | us per step | launches per step |")
    print("|---|---|---|")
    for n, us, k in rows[:12]:
        print(f"| {n} | {us:.1f} | {k:g} |")
    report[f"step_profile {label}"] = [{"kernel": n, "us": us, "launches": k} for n, us, k in rows]


# --------------------------------------------------------------------------- BF16 vs cuDNN, graph vs eager


def section_graph(device: torch.device, report: dict) -> None:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kvpolicy.kernels.decode_attention import decode_attention
    from kvpolicy.kernels.paged_store import allocate_cache

    qh, kvh, d, page = 32, 8, 128, 16
    rows = []
    print("\n## BF16 decode, Llama layer: our Triton kernel vs SDPA cuDNN, shuffled pages, L2 flushed (us)")
    print("| batch | context | triton eager | triton graph | cuDNN eager | cuDNN graph | graph ratio | eager ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in (1, 8):
        for context in (16384, 32768, 65536, 131072):
            gen = torch.Generator(device="cpu").manual_seed(context + batch)
            pages = context // page
            kc, vc = allocate_cache(batch * pages, page, kvh, d, "auto", device)
            kc.normal_()
            vc.normal_()
            tables = torch.randperm(batch * pages, generator=gen).to(torch.int32).view(batch, pages).to(device)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            q = torch.randn(batch, qh, d, generator=gen).to(device, torch.bfloat16)
            out = torch.empty_like(q)
            k_sd = torch.randn(batch, kvh, context, d, device=device, dtype=torch.bfloat16)
            v_sd = torch.randn_like(k_sd)
            q_sd = q.view(batch, kvh, qh // kvh, d)  # the GQA group as the query length (bench_decode's "folded")

            def ours() -> None:
                decode_attention(q, kc, vc, tables, seq_lens, out=out)

            def cudnn() -> None:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    F.scaled_dot_product_attention(q_sd, k_sd, v_sd)

            r = {"batch": batch, "context": context}
            for label, fn in (("triton", ours), ("cudnn", cudnn)):
                fn()
                torch.cuda.synchronize()
                r[f"{label}_eager"] = do_bench_us(fn)
                r[f"{label}_graph"] = do_bench_us(graph_of(fn))
            rows.append(r)
            print(f"| {batch} | {context} | {r['triton_eager']:.1f} | {r['triton_graph']:.1f} | "
                  f"{r['cudnn_eager']:.1f} | {r['cudnn_graph']:.1f} | {r['triton_graph'] / r['cudnn_graph']:.3f} | "
                  f"{r['triton_eager'] / r['cudnn_eager']:.3f} |", flush=True)
            del kc, vc, k_sd, v_sd
            torch.cuda.empty_cache()
    report["graph"] = rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="host,step,graph", help="comma list of host, step, graph")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if device.type != "cuda" and sections != ["host"]:
        print("no CUDA GPU: only `--sections host` runs here (a smoke test of every entry point)")
        return 2
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    print(f"device: {report['device']}, torch {torch.__version__}")
    for s in sections:
        if s == "host":
            section_host(device, report)
            continue
        with unchecked():  # the runtime's own calls, as kvpolicy bench makes them
            {"step": section_step, "graph": section_graph}[s](device, report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
