"""Where a batch-1 TurboQuant decode step's time goes: the whole call (the per-warp kernel and the split
merge, `tq_gluon.default_config`), the kernel alone (the merge skipped), the kernel followed by an empty
launch on the merge's grid (the second launch's own cost), the merge alone (on partials of the kernel's
shape) and an empty kernel on the kernel's grid (one launch in a CUDA graph). --fused times instead the call
with the merge in the kernel (`TQGluonConfig.fused_merge`) between two plain calls ("call", "fused",
"call2": the plain call twice, for the run's noise). Each timed like bench_decode (median CUDA-graph
replay, rotating over enough cache copies to miss L2). GPU only (sm_90).

Usage: python bench/probe_tq_floor.py [--geometries gpt-oss-20b] [--formats turboquant_4bit_nc]
       [--contexts 4096,131072] [--batch 1] [--fused] [--out JSON]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import (
    FORMATS,
    GEOMETRIES,
    build_case,
    kv_bytes,
    rotation_copies,
    time_calls,
    write_probe,
)
from kvpolicy.kernels import decode_attention as da
from kvpolicy.kernels import tq_gluon as tg
from kvpolicy.kernels.tq_decode import decode_attention_tq


@triton.jit
def _empty_kernel(x_ptr):
    if tl.program_id(0) < 0:  # never: a launch that does nothing but cannot be compiled away
        tl.store(x_ptr, 0)


@contextlib.contextmanager
def _config(**fields):
    """`tq_gluon.default_config` with `fields` replaced, for the calls inside the block."""
    default = tg.default_config
    tg.default_config = lambda f, d: dataclasses.replace(default(f, d), **fields)
    try:
        yield
    finally:
        tg.default_config = default


def measure(gname: str, batch: int, ctx: int, fmt: str, dev: torch.device, fused: bool = False) -> dict:
    """One case's timings (us), as described at the top. The plain call is the default config with the merge
    kernel (`fused_merge` off), whatever the default, so that "kernel alone" skips the merge."""
    geom, row = GEOMETRIES[gname], FORMATS[f"{fmt}_gl"]
    nbytes = kv_bytes(row, geom, batch, ctx)
    copies = rotation_copies(geom, batch, ctx)
    torch.manual_seed(0)
    case = build_case(geom, batch, ctx, {fmt: row}, sdpa=False, copies=copies, device=dev)
    cache, tables, q, sl, sinks = case["caches"][fmt], case["tables"], case["query"], case["seq_lens"], case["sinks"]
    cfg = tg.default_config(fmt, geom.head_dim)
    splits = tg.default_splits(fmt, batch, geom.num_kv_heads, tables.shape[2] * tg.PAGE, geom.head_dim, dev, cfg)
    out = torch.empty_like(q)
    calls = [lambda c=c: decode_attention_tq(q, cache, tables[c], sl, fmt, sinks=sinks, out=out, kernel="gluon")
             for c in range(copies)]
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    merge = da.launch_merge
    result = {"geometry": gname, "batch": batch, "context": ctx, "format": fmt, "splits": splits, "copies": copies,
              "bytes": nbytes, "us": {}}
    t = result["us"]
    with _config(fused_merge=False):
        t["call"] = time_calls(calls)
    if fused:
        with _config(fused_merge=True):
            t["fused"] = time_calls(calls)
        with _config(fused_merge=False):
            t["call2"] = time_calls(calls)
        return result
    try:  # tq_warp imports launch_merge at call time
        with _config(fused_merge=False):
            da.launch_merge = lambda *a, **k: None
            t["kernel"] = time_calls(calls)
            da.launch_merge = lambda *a, **k: _empty_kernel[(geom.num_q_heads, batch)](flag, num_warps=4)
            t["kernel+empty"] = time_calls(calls)
    finally:
        da.launch_merge = merge
    part_out, part_lse = da.split_partials(out, splits)
    if splits > 1:
        part_out.normal_()
        part_lse.normal_()
        t["merge"] = time_calls([lambda: merge(part_out, part_lse, sinks, out, splits, pdl=False)])
    t["empty"] = time_calls([lambda: _empty_kernel[(geom.num_kv_heads, splits, batch)](flag, num_warps=4)])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometries", default="gpt-oss-20b")
    p.add_argument("--formats", default="turboquant_4bit_nc,turboquant_3bit_nc")
    p.add_argument("--contexts", default="4096,16384,65536,131072")
    p.add_argument("--batch", default="1")
    p.add_argument("--fused", action="store_true", help="time the call with TQGluonConfig.fused_merge instead")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    results = []
    for gname, batch, ctx, fmt in itertools.product(args.geometries.split(","), map(int, args.batch.split(",")),
                                                    map(int, args.contexts.split(",")), args.formats.split(",")):
        r = measure(gname, batch, ctx, fmt, dev, args.fused)
        results.append(r)
        print(f"{gname} b{batch} {ctx} {fmt} splits={r['splits']} copies={r['copies']}: "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["us"].items())
              + f" us ({r['bytes'] / r['us']['call'] / 1e6:.2f} TB/s)", flush=True)
        torch.cuda.empty_cache()
    write_probe(args.out, "probe_tq_floor.json", results)


if __name__ == "__main__":
    main()
