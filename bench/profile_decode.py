"""Run one decode kernel a few times on a bench_decode case, for Nsight Compute (bench/profile_gpu.sh).

Why: the FP8 kernel is latency-bound at ~1 IPC (NOTES.md v5) and static SASS counts
stopped predicting its speed (v6); ncu's warp-stall sampling says where warps wait.
Usage: python bench/profile_decode.py --format fp8 [--geometry llama-3.1-8b] [--batch 8] [--context 32768]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import FORMATS, GEOMETRIES, build_case
from kvpolicy.kernels.tq_decode import decode_attention_tq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", required=True, choices=list(FORMATS))
    ap.add_argument("--geometry", default="llama-3.1-8b", choices=list(GEOMETRIES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--per-warp", action="store_true", help="_gl rows: the per-warp kernel (TQGluonConfig.per_warp), whatever the default")
    a = ap.parse_args()
    device = torch.device("cuda")
    geom = GEOMETRIES[a.geometry]
    row = FORMATS[a.format]
    if a.per_warp:
        from kvpolicy.kernels import tq_gluon as tg

        tg.default_config = lambda fmt, head_dim: tg.TQGluonConfig(  # the router reads it
            block_n=64, per_warp=True, maxnreg=128 if head_dim >= 128 else None)
    case = build_case(geom, a.batch, a.context, {a.format: row}, sdpa=False, copies=1, device=device)
    args = (case["caches"][a.format], case["query"], case["tables"][0], case["seq_lens"])
    for _ in range(a.iters):
        if a.format.startswith("turboquant") and not a.format.endswith("_gl"):
            # the library defaults, not bench_decode's in-run tile search (whose trial launches ncu would catch)
            decode_attention_tq(args[1], args[0], args[2], args[3], a.format)
        else:
            row["decode"](*args, None)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
