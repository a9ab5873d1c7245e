"""Where a TurboQuant decode program's time goes, from inside the kernel: each program of the per-warp kernel
(`tq_gluon.default_config`, the merge in the kernel) reads the GPU's global nanosecond timer at the points
`tq_gluon.STAMPS` names (entry, seq_len, the query's loads and product, the prologue, the loop's end, the split
count, the split merge) and its SM's id. Launched eagerly, one launch per cache copy in turn (so the cache is not
in L2), each run's stamps relative to the earliest entry of that launch; printed: medians over the runs of, per
launch, the programs' median and max time at each point, and the median program's prologue, loop and count.
Each stamp waits for its tensor in all 4 warps (a barrier), so the stamped kernel runs slower than the plain
one: the "graph call" column is the plain call, timed as bench_decode times it. Checks first that the stamped
call's output is the plain call's. --variants runs the same with TQGluonConfig fields changed (A/B of a knob
in one run, the default first and last). GPU only (sm_90).

Usage: python bench/probe_tq_stamps.py [--geometries gpt-oss-20b] [--formats turboquant_4bit_nc]
       [--contexts 4096,131072] [--batch 1] [--runs 30] [--rotate 1,0] [--variants "unroll/lazy_max=0"]
       [--raw] [--out JSON]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys

import torch

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
from kvpolicy.kernels import tq_gluon as tg
from kvpolicy.kernels import tq_warp as tw
from kvpolicy.kernels.decode_attention import sm_count
from kvpolicy.kernels.tq_decode import LOG2E, _rotated_query, decode_attention_tq
from probe_tq_floor import _config


def _summary(stamps: torch.Tensor, num_sms: int) -> dict:
    """One launch: stamps [programs, STAMPS_ROW] int64 -> per point (`tq_gluon.STAMPS`; points a program did not
    reach, 0, left out) the programs' median and max in us from the first entry, the median span of a
    program's prologue (entry to the later of query and first tile), loop and count, the loop's end on SMs that
    held one program against those that held two, and the loop of the first wave (a row is the program's linear
    block id: the first `num_sms` went one to each SM) against the second's."""
    names = [n for n in tg.STAMPS if n != "smid"]
    idx = {n: tg.STAMPS.index(n) for n in names}
    s = stamps.double()
    t0 = s[:, 0].min()
    out = {}
    for n in names:
        v = s[:, idx[n]]
        v = (v[v > 0] - t0) / 1e3
        if v.numel():
            out[f"{n} med"], out[f"{n} max"] = float(v.median()), float(v.max())
    at = {n: (s[:, idx[n]] - t0) / 1e3 for n in ("entry", "first_tile", "query", "loop_end", "counted")}
    ready = torch.maximum(at["first_tile"], at["query"])
    out["span prologue"] = float((ready - at["entry"]).median())
    out["span loop"] = float((at["loop_end"] - ready).median())
    if (at["counted"] >= 0).all():  # every program counted: the split merge was in the kernel
        out["span count"] = float((at["counted"] - at["loop_end"]).median())
    sm = stamps[:, tg.STAMPS.index("smid")]
    counts = torch.bincount(sm)[sm]
    for k in (1, 2):
        if (counts == k).any():
            out[f"loop_end med, {k} per SM"] = float(at["loop_end"][counts == k].median())
    first = torch.arange(stamps.shape[0]) < num_sms
    if not first.all():
        loop = at["loop_end"] - ready
        out["span loop, first wave"] = float(loop[first].median())
        out["span loop, second wave"] = float(loop[~first].median())
    return out


def measure(gname: str, batch: int, ctx: int, fmt: str, runs: int, rotate: bool, dev: torch.device,
            fields: dict | None = None, raw: bool = False) -> dict:
    geom, row = GEOMETRIES[gname], FORMATS[f"{fmt}_gl"]
    copies = rotation_copies(geom, batch, ctx)
    torch.manual_seed(0)
    case = build_case(geom, batch, ctx, {fmt: row}, sdpa=False, copies=copies, device=dev)
    cache, tables, q, sl, sinks = case["caches"][fmt], case["tables"], case["query"], case["seq_lens"], case["sinks"]
    cfg = dataclasses.replace(tg.default_config(fmt, geom.head_dim), rotate_query=rotate, **(fields or {}))
    if not cfg.per_warp:
        raise SystemExit(f"{fmt}: the stamps are the per-warp kernel's")
    splits = tg.default_splits(fmt, batch, geom.num_kv_heads, tables.shape[2] * tg.PAGE, geom.head_dim, dev, cfg)
    scale = geom.head_dim ** -0.5
    programs = geom.num_kv_heads * splits * batch
    stamps = torch.zeros(programs, tg.STAMPS_ROW, dtype=torch.int64, device=dev)
    out = torch.empty_like(q)
    # as `tq_decode._decode_gluon`: the query rotated in the kernel, or once before it (not timed here)
    q16, q_scale = (q, scale * LOG2E) if rotate else (_rotated_query(q, fmt, geom.num_kv_heads, scale), 1.0)

    def stamped(c: int) -> torch.Tensor:
        return tw.decode_tq_warp(q, q16, q_scale, cache, fmt, tables[c], sl, sliding_window=None, sinks=sinks,
                                 splits=splits, out=out, cfg=cfg, stamps=stamps)

    with _config(rotate_query=rotate, **(fields or {})):  # the same config without stamps: the same output
        plain = decode_attention_tq(q, cache, tables[0], sl, fmt, sinks=sinks, kernel="gluon").clone()
    err = float((stamped(0).float() - plain.float()).abs().max())
    num_sms = sm_count(dev)
    per_run = []
    for r in range(runs + 2):
        stamps.zero_()
        stamped(r % copies)
        torch.cuda.synchronize()
        if r >= 2:  # the first two: compile and first touch
            per_run.append(_summary(stamps.cpu(), num_sms))
    res = {k: statistics.median(p[k] for p in per_run) for k in per_run[0]}
    # the timer's step: the smallest gap between two distinct stamps of the last run (bit 0 is the read's +0/1)
    e = stamps[:, [i for i, n in enumerate(tg.STAMPS) if n != "smid"]].flatten()
    e = (e[e > 0] >> 1).unique() << 1
    step = int((e[1:] - e[:-1]).min()) if e.numel() > 1 else 0
    calls = [lambda c=c: decode_attention_tq(q, cache, tables[c], sl, fmt, sinks=sinks, out=out, kernel="gluon")
             for c in range(copies)]
    with _config(rotate_query=rotate, **(fields or {})):
        graph_us = time_calls(calls)
    return {"geometry": gname, "batch": batch, "context": ctx, "format": fmt, "rotate_query": rotate,
            "config": dict(fields or {}), "splits": splits, "programs": programs, "copies": copies,
            "bytes": kv_bytes(row, geom, batch, ctx), "max_abs_diff_vs_plain": err, "timer_step_ns": step,
            "graph_call_us": graph_us, "us": res,
            **({"last_run": stamps.cpu().tolist(), "last_run_rows": "linear block id"}
               if raw else {})}


def _field(text: str) -> tuple[str, bool | int | float]:
    """'name' (turned on) or 'name=N' (an int, or a float where it has a point): one TQGluonConfig field of a
    variant."""
    name, _, value = text.partition("=")
    if not value:
        return name, True
    return name, float(value) if "." in value else int(value)


def _name(fields: dict) -> str:
    return "+".join(f"{k}={v}" for k, v in fields.items()) or "default"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometries", default="gpt-oss-20b")
    p.add_argument("--formats", default="turboquant_4bit_nc,turboquant_3bit_nc")
    p.add_argument("--contexts", default="4096,131072")
    p.add_argument("--batch", default="1")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--rotate", default="1", help="TQGluonConfig.rotate_query: 1 (the default), 0, or 1,0")
    p.add_argument("--variants", default="",
                   help="TQGluonConfig fields to turn on (or name=N), variants split by '/', fields by '+' (e.g. "
                        "'unroll/unroll+maxnreg=168'); each case runs the default, each variant, the default again")
    p.add_argument("--raw", action="store_true", help="also keep the last run's stamps of each case in the JSON")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    results = []
    for gname, batch, ctx, fmt, rot in itertools.product(
            args.geometries.split(","), map(int, args.batch.split(",")), map(int, args.contexts.split(",")),
            args.formats.split(","), map(int, args.rotate.split(","))):
        variants = [{}] + [dict(_field(f) for f in v.split("+")) for v in args.variants.split("/") if v]
        for fields in variants + ([{}] if len(variants) > 1 else []):
            r = measure(gname, batch, ctx, fmt, args.runs, bool(rot), dev, fields, args.raw)
            results.append(r)
            print(f"{gname} b{batch} {ctx} {fmt} rotate_query={rot} {_name(fields)}: splits "
                  f"{r['splits']}, {r['programs']} programs, timer step {r['timer_step_ns']} ns, |stamped - plain| "
                  f"{r['max_abs_diff_vs_plain']:.1e}, graph call {r['graph_call_us']:.2f} us", flush=True)
            print("    " + "  ".join(f"{k} {v:.2f}" for k, v in r["us"].items()))
        torch.cuda.empty_cache()
    write_probe(args.out, "probe_tq_stamps.json", results)


if __name__ == "__main__":
    main()
