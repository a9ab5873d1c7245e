"""Sweep the Gluon FP8 decode kernel's knobs (tile, stages, register cap, split count) against the Triton
FP8 kernel (the default row and fp8_query, NHD and HND pages) on the issue-4 geometries, the baselines
measured in the same run on the same caches. GPU only (sm_90). For cuDNN, use bench_decode.py.

Usage: python bench/probe_gluon.py [--contexts 16384,131072] [--batch 1,8] [--block-n 64,128]
       [--stages 2,3,4] [--maxnreg 128] [--split-scale 0.5,1,2] [--out JSON]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import (
    FORMATS,
    GEOMETRIES,
    build_case,
    kv_bytes,
    time_calls,
    write_probe,
)
from kvpolicy.kernels import decode_gluon as dg
from kvpolicy.kernels.decode_attention import _check_inputs, split_count
from kvpolicy.kernels.paged_store import check_scale


def gluon_call(cache: dict, case: dict, table, cfg: dg.GluonConfig, splits: int):
    q, kc, vc = case["query"], cache["key_cache"], cache["value_cache"]
    out = torch.empty_like(q)
    heads = kc.shape[2]
    ks, vs = check_scale(cache["k_scale"], "k", heads, q.device), check_scale(cache["v_scale"], "v", heads, q.device)
    _check_inputs(q, kc, vc, table, case["seq_lens"])
    return lambda: dg.decode_gluon(q, kc, vc, table, case["seq_lens"], k_scale=cache["k_scale"], v_scale=cache["v_scale"],
                                   k_stride=ks, v_stride=vs, sm_scale=q.shape[-1] ** -0.5, sliding_window=None,
                                   sinks=case["sinks"], two_level=True, splits=splits, out=out, config=cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="16384,131072")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--stages", default="2,3,4")
    p.add_argument("--maxnreg", default="128")
    p.add_argument("--block-n", default="64,128")
    p.add_argument("--split-scale", default="0.5,1,2")
    p.add_argument("--layouts", default="fp8_gl,fp8_gl_hnd", help="the Gluon rows to sweep (NHD, HND pages)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = {n: FORMATS[n] for n in ("fp8", "fp8_hnd", "fp8_gl", "fp8_gl_hnd")}
    results = []
    for gname, geom in GEOMETRIES.items():
        for batch in map(int, args.batch.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                torch.manual_seed(0)
                case = build_case(geom, batch, ctx, rows, sdpa=False, copies=2, device=dev)
                tables = case["tables"]
                base = {}
                for name in rows:
                    calls = [lambda c=c, n=name, case=case: rows[n]["decode"](case["caches"][n], case["query"], case["tables"][c],
                                                                   case["seq_lens"], case["sinks"]) for c in range(2)]
                    base[name] = time_calls(calls)
                nbytes = kv_bytes(FORMATS["fp8"], geom, batch, ctx)
                line = f"{gname} b{batch} {ctx}: " + ", ".join(f"{k} {v:.1f}us ({nbytes / v / 1e6:.2f} TB/s)" for k, v in base.items())
                print(line, flush=True)
                for layout in args.layouts.split(","):
                    cache = case["caches"][layout]
                    for stages, maxnreg, block_n in itertools.product(map(int, args.stages.split(",")),
                                                                     map(int, args.maxnreg.split(",")),
                                                                     map(int, args.block_n.split(","))):
                            cfg = dg.GluonConfig(block_n=block_n, stages=stages, maxnreg=maxnreg)
                            res = dg.programs_per_sm(geom.head_dim, dev, cfg)
                            default = split_count(batch, geom.num_kv_heads, tables.shape[2] * 16, block_n, res, dev, waves=())
                            for scale in map(float, args.split_scale.split(",")):
                                splits = max(1, int(default * scale))
                                try:
                                    us = time_calls([gluon_call(cache, case, tables[c], cfg, splits) for c in range(2)])
                                except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported
                                    print(f"  {layout} {cfg} splits={splits}: {type(exc).__name__} {str(exc)[:120]}")
                                    continue
                                results.append({"geometry": gname, "batch": batch, "context": ctx, "row": layout, "stages": stages,
                                                    "maxnreg": maxnreg, "block_n": block_n, "resident": res, "splits": splits, "us": us,
                                                    "tbs": nbytes / us / 1e6, "baselines": base})
                                print(f"  {layout} block_n={block_n} stages={stages} maxnreg={maxnreg} resident={res} splits={splits}: "
                                      f"{us:.1f} us ({nbytes / us / 1e6:.2f} TB/s)", flush=True)
                del case
                torch.cuda.empty_cache()
    write_probe(args.out, "probe_gluon.json", results)


if __name__ == "__main__":
    main()
