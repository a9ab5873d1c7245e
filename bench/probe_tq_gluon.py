"""Sweep the Gluon TurboQuant kernel's knobs (tile, stages, register cap, split count) against the Triton
TurboQuant kernel and cuDNN BF16 SDPA, on the issue-5 geometries, all measured in the same run on the same
caches; each config's output is checked against the Triton kernel's. GPU only (sm_90).

Usage: python bench/probe_tq_gluon.py [--formats turboquant_4bit_nc,turboquant_k8v4] [--contexts 32768,131072]
       [--batch 1,8] [--block-n 64,128] [--maxnreg 0,128] [--split-scale 1,2] [--lazy 1,0]
       [--per-warp 0,1] [--pages-ahead 1,2] [--sum-pages 0,1] [--fused-merge 0,1] [--pages random,sequential]
       [--out JSON]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import (
    FORMATS,
    GEOMETRIES,
    build_case,
    kv_bytes,
    rel_err,
    rotation_copies,
    sdpa_times,
    time_calls,
    write_probe,
)
from kvpolicy.kernels import tq_gluon as tg
from kvpolicy.kernels import tq_warp
from kvpolicy.kernels.tq_decode import decode_attention_tq
from kvpolicy.kernels.turboquant import planar_from_slots


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="turboquant_4bit_nc,turboquant_k8v4")
    p.add_argument("--geometries", default=",".join(GEOMETRIES))
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--maxnreg", default="0", help="register caps to try (0: none)")
    p.add_argument("--block-n", default="64,128")
    p.add_argument("--split-scale", default="1,2")
    p.add_argument("--lazy", default="1", help="lazy softmax max (TQGluonConfig.lazy_max) to try: 1, 0 or 1,0")
    p.add_argument("--per-warp", default="0", help="TQGluonConfig.per_warp (kernels/tq_warp.py) to try: 0, 1 or 0,1")
    p.add_argument("--pages-ahead", default="2", help="TQGluonConfig.pages_ahead to try: 1, 2 or 1,2")
    p.add_argument("--sum-pages", default="0", help="TQGluonConfig.sum_pages (per-warp kernel) to try: 0, 1 or 0,1")
    p.add_argument("--unroll", default="0", help="TQGluonConfig.unroll (per-warp kernel) to try: 0, 1 or 0,1")
    p.add_argument("--mma-sums", default="0", help="TQGluonConfig.mma_sums (per-warp kernel) to try: 0, 1 or 0,1")
    p.add_argument("--rotate", default="0", help="TQGluonConfig.rotate_query (per-warp kernel) to try: 0, 1 or 0,1")
    p.add_argument("--fused-merge", default="0",
                   help="TQGluonConfig.fused_merge (per-warp kernel; the default config's) to try: 0, 1 or 0,1")
    p.add_argument("--pages", default="random", help="block tables: random, sequential or both (bench_decode.build_case)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    fmts = args.formats.split(",")
    rows = {n: FORMATS[n] for n in fmts}
    results = []
    for gname, pages in itertools.product(args.geometries.split(","), args.pages.split(",")):
        geom = GEOMETRIES[gname]
        for batch in map(int, args.batch.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                torch.manual_seed(0)
                copies = rotation_copies(geom, batch, ctx)
                case = build_case(geom, batch, ctx, rows, sdpa=True, copies=copies, device=dev, pages=pages)
                tables, q, sl = case["tables"], case["query"], case["seq_lens"]
                base = {"sdpa_cudnn": min(sdpa_times(case, geom, copies, SDPBackend.CUDNN_ATTENTION, "sdpa_cudnn").values(),
                                          default=float("nan"))}
                for fmt in fmts:
                    cache = case["caches"][fmt]
                    calls = [lambda c=c, f=fmt, cache=cache: FORMATS[f]["decode"](cache, q, tables[c], sl, case["sinks"])
                             for c in range(copies)]
                    base[fmt] = time_calls(calls)
                print(f"{gname} {pages} pages b{batch} {ctx}: " + ", ".join(f"{k} {v:.1f}us" for k, v in base.items()), flush=True)
                for fmt in fmts:
                    nbytes = kv_bytes(FORMATS[fmt], geom, batch, ctx)
                    want = FORMATS[fmt]["decode"](case["caches"][fmt], q, tables[0], sl, case["sinks"]).float()
                    # the Gluon kernel reads the planar layout of the same bytes
                    cache = planar_from_slots(case["caches"][fmt], fmt, geom.head_dim)
                    for maxnreg, block_n, lazy, per_warp, ahead, sum_pages, unroll, mma_sums, rotate, fused in itertools.product(
                            map(int, args.maxnreg.split(",")), map(int, args.block_n.split(",")),
                            map(int, args.lazy.split(",")), map(int, args.per_warp.split(",")),
                            map(int, args.pages_ahead.split(",")), map(int, args.sum_pages.split(",")),
                            map(int, args.unroll.split(",")), map(int, args.mma_sums.split(",")),
                            map(int, args.rotate.split(",")), map(int, args.fused_merge.split(","))):
                        if (per_warp and fmt not in tq_warp.FORMATS) or ((sum_pages or unroll or mma_sums or rotate
                                                                           or fused) and not per_warp):
                            continue
                        cfg = tg.TQGluonConfig(block_n=block_n, maxnreg=maxnreg or None, lazy_max=bool(lazy),
                                               per_warp=bool(per_warp), pages_ahead=ahead, sum_pages=bool(sum_pages),
                                               unroll=bool(unroll), mma_sums=bool(mma_sums), rotate_query=bool(rotate),
                                               fused_merge=bool(fused))
                        res = tg.programs_per_sm(fmt, geom.head_dim, dev, cfg)
                        default = tg.default_splits(fmt, batch, geom.num_kv_heads, tables.shape[2] * tg.PAGE,
                                                    geom.head_dim, dev, cfg)
                        tg.default_config = lambda fmt, head_dim, cfg=cfg: cfg
                        for scale in map(float, args.split_scale.split(",")):
                            splits = max(1, int(default * scale))
                            try:
                                err = rel_err(decode_attention_tq(q, cache, tables[0], sl, fmt, sinks=case["sinks"],
                                                                  num_splits=splits, kernel="gluon").float(), want)
                                us = time_calls([lambda c=c: decode_attention_tq(q, cache, tables[c], sl, fmt, sinks=case["sinks"],
                                                                                 num_splits=splits, kernel="gluon")
                                                 for c in range(copies)])
                            except Exception as exc:  # noqa: BLE001 - a config that fails is reported, not fatal
                                print(f"  {fmt} {cfg} splits={splits}: {type(exc).__name__} {str(exc)[:300]}")
                                continue
                            results.append({"geometry": gname, "pages": pages, "batch": batch, "context": ctx, "format": fmt,
                                            "maxnreg": maxnreg, "block_n": block_n, "lazy_max": bool(lazy),
                                            "per_warp": bool(per_warp), "pages_ahead": ahead, "sum_pages": bool(sum_pages),
                                            "unroll": bool(unroll), "mma_sums": bool(mma_sums), "rotate_query": bool(rotate),
                                            "fused_merge": bool(fused),
                                            "resident": res,
                                            "splits": splits, "us": us, "tbs": nbytes / us / 1e6, "rel_err_vs_triton": err,
                                            "baselines": base})
                            print(f"  {fmt}_gl block_n={block_n} lazy={lazy} per_warp={per_warp} ahead={ahead} sum={sum_pages} unroll={unroll} "
                                  f"mma_sums={mma_sums} rotate={rotate} fused={fused} maxnreg={maxnreg} "
                                  f"resident={res} "
                                  f"splits={splits}: {us:.1f} us ({nbytes / us / 1e6:.2f} TB/s; vs Triton "
                                  f"{base[fmt] / us:.2f}x; err vs Triton {err:.1e})", flush=True)
                    del cache
                del case
                torch.cuda.empty_cache()
    write_probe(args.out, "probe_tq_gluon.json", results)


if __name__ == "__main__":
    main()
