"""How fast can a paged cache be read at all, per cache layout, and how close does decode get?

Why: the FP8 decode kernel stalls at 3.4 TB/s (Llama) and 2.7 TB/s (gpt-oss) while
cuDNN streams contiguous BF16 at ~4.4 (NOTES.md v6). vLLM's default layout, NHD
([blocks, block_size, kv_heads, head_dim]), gives one KV head only head_dim bytes
of each position row (128 B at head_dim 128, 64 B at 64) at a stride of
kv_heads x head_dim; HND ([blocks, kv_heads, block_size, head_dim], vLLM's
FlashInfer layout) gives it block_size x head_dim contiguous bytes per page.
This probe times, in one run and with the same random block tables:
- `_paged_read_kernel`: the decode kernel's tiling and page addressing with no
  math (an XOR of the words read), i.e. the read roofline of each layout;
- `decode_attention` (default config, and with --sweep the tiles and split targets
  of `sweep_configs`) on each layout; for BF16 also cuDNN SDPA on contiguous K/V.
With --tq FORMATS it instead times the TurboQuant kernel at its default tiling and at each
--split-counts value.
Usage: python bench/probe_layout.py [--dtype fp8|bfloat16] [--contexts 32768,131072] [--batch 8,1]
                                    [--geometries gpt-oss-20b] [--sweep] [--split-counts 4,8,16]
                                    [--tq turboquant_4bit_nc] [--device cpu]
(--device cpu: the Triton interpreter on small shapes, untimed; tests/test_bench_probe.py runs it so.)
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from dataclasses import replace

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import (
    BLOCK_SIZE,
    FORMATS,
    GEOMETRIES,
    build_case,
    sdpa_call,
    time_calls,
)
from kvpolicy.kernels.decode_attention import (
    DecodeConfig,
    choose_num_splits,
    decode_attention,
    default_config,
)


@triton.jit
def _paged_read_kernel(k_ptr, v_ptr, bt_ptr, out_ptr, seq_len, stride_bt, tiles_per_split,
                       stride_kb: tl.constexpr, stride_kt: tl.constexpr, stride_kh: tl.constexpr,
                       WORDS: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    offs_w = tl.arange(0, WORDS)
    acc = tl.zeros([BLOCK_N, WORDS], tl.int32)
    lo = split * tiles_per_split
    hi = tl.minimum(lo + tiles_per_split, tl.cdiv(seq_len, BLOCK_N))
    for tile in range(lo, hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        page = tl.load(bt_ptr + seq * stride_bt + offs_n.to(tl.uint32) // PAGE, mask=offs_n < seq_len, other=0).to(tl.int64)
        row = page * stride_kb + (offs_n.to(tl.uint32) % PAGE) * stride_kt + kv_head * stride_kh
        acc ^= tl.load(k_ptr + row[:, None] + offs_w[None, :])
        acc ^= tl.load(v_ptr + row[:, None] + offs_w[None, :])
    tl.store(out_ptr + (seq * tl.num_programs(1) + split) * tl.num_programs(0) + kv_head, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def paged_read(kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, context: int, splits: int, block_n: int):
    """A closure that reads every K/V byte of `context` positions per sequence once, as int32 words."""
    batch = tables.shape[0]
    kw, vw = kc.view(torch.int32), vc.view(torch.int32)  # [blocks, page, heads, head_dim / 4]
    heads, words = kw.shape[2], kw.shape[3]
    tiles = -(-context // block_n)
    out = torch.empty(batch * splits * heads, dtype=torch.int32, device=kc.device)

    def call():
        _paged_read_kernel[(heads, splits, batch)](kw, vw, tables, out, context, tables.stride(0), -(-tiles // splits),
                                                  kw.stride(0), kw.stride(1), kw.stride(2),
                                                  WORDS=words, BLOCK_N=block_n, PAGE=kw.shape[1], num_warps=4, num_stages=3)
        return out
    return call


def caches(geom, batch: int, context: int, fp8: bool, device) -> dict:
    """`bench_decode.build_case` with the format's NHD and HND rows (`caches["nhd"]`, `caches["hnd"]`: the
    same K/V stored into both, one random block table); for BF16 also the contiguous K/V that SDPA reads."""
    name = "fp8" if fp8 else "bf16"
    rows = {"nhd": FORMATS[name], "hnd": FORMATS[name + "_hnd"]}
    return build_case(geom, batch, context, rows, sdpa=not fp8, copies=1, device=device)


def sweep_configs(head_dim: int, fp8: bool, device, swapped: bool = False, splits: bool = False) -> list[DecodeConfig]:
    """Tiles around the default: fewer/more tokens, warps and stages, register caps, and split targets;
    `swapped`: the wgmma form (S^T = K.Q^T, O^T = V^T.P^T) at 64- and 128-token tiles instead;
    `splits`: the default tile with other split targets and split floors (short contexts)."""
    base = default_config(head_dim, fp8, device)
    if splits:
        return [replace(base, programs_per_sm=pps, min_tokens_per_split=floor)
                for pps in (2.0, 4.0, 8.0) for floor in (0, 256, 512)
                if (pps, floor) != (base.programs_per_sm, base.min_tokens_per_split)]
    if swapped:
        sw = replace(base, swap_ab=True, defer_sum=False)
        return [replace(sw, block_n=n, num_stages=st, programs_per_sm=pps, num_warps=w)
                for n in (64, 128) for st in (2, 3) for pps in (8.0, 16.0) for w in (4, 8)
                if not (w == 8 and n == 64)]
    if not fp8:
        n = base.block_n
        return [replace(base, programs_per_sm=p) for p in (1.0, 4.0, 8.0, 16.0) if p != base.programs_per_sm] + [
            replace(base, block_n=n // 2), replace(base, block_n=n // 2, programs_per_sm=8.0),
            replace(base, num_stages=base.num_stages + 1), replace(base, block_n=n * 2, num_stages=2, defer_sum=False)]
    h = base.block_n
    return [replace(base, block_n=h // 2), replace(base, block_n=h // 2, maxnreg=80), replace(base, block_n=h // 2, num_stages=4),
            replace(base, maxnreg=96), replace(base, num_stages=2, maxnreg=96), replace(base, num_warps=8),
            replace(base, block_n=h * 2, num_warps=8), replace(base, num_warps=2, block_n=h // 2, num_stages=4),
            replace(base, programs_per_sm=32.0), replace(base, programs_per_sm=8.0)]


def timer(device: torch.device):
    """CUDA-graph medians on a GPU (bench_decode.time_calls); on a CPU, one wall-clock call (a smoke test)."""
    if device.type == "cuda":
        return time_calls

    def once(calls):
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e6
    return once


def paged_rows(case: dict, geom, layout: str, context: int, fp8: bool, a: argparse.Namespace, device) -> list:
    """(label, call) of one layout: the read roofline, cuDNN (BF16, NHD), the default decode and the sweeps."""
    cache, tables = case["caches"][layout], case["tables"][0]
    kc, vc = cache["key_cache"], cache["value_cache"]
    batch = case["query"].shape[0]
    base = default_config(geom.head_dim, fp8, device)
    splits = choose_num_splits(batch, geom.num_kv_heads, context, base, device)
    rows = [("read roofline (no math), default tiles", paged_read(kc, vc, tables, context, splits, base.block_n))]
    if case["sd_k"] is not None and layout == "nhd":
        rows.append(("sdpa cudnn (contiguous bf16, enable_gqa)", sdpa_call(case, geom, 0, SDPBackend.CUDNN_ATTENTION, "gqa")))
    cfgs = [("decode default " + _short(base), base, None)]
    if a.sweep:
        cfgs += [("decode " + _short(c), c, None) for c in sweep_configs(geom.head_dim, fp8, device, a.swapped, a.splits)]
    cfgs += [(f"decode splits={n}", base, n) for n in _ints(a.split_counts) if n * base.block_n <= context]
    for label, cfg, n in cfgs:
        rows.append((label, functools.partial(decode_attention, case["query"], kc, vc, tables, case["seq_lens"],
                                              k_scale=cache["k_scale"], v_scale=cache["v_scale"], sinks=case["sinks"],
                                              config=cfg, fp8_query=a.fp8_query, num_splits=n)))
    return rows


def measure(rows: list, time_fn, ref: torch.Tensor | None) -> tuple[list[tuple[str, float]], torch.Tensor | None]:
    """Time each row; every decode must agree with the first one (the same cache, other tiles or splits)."""
    timed = []
    for label, call in rows:
        try:
            out = call()
            if label.startswith("decode"):
                ref = out.float() if ref is None else ref
                err = ((out.float() - ref).norm() / ref.norm()).item()
                if err > 5e-2:  # FP8 P rounding differs with the split count: ~2% on zero-mean V
                    raise RuntimeError(f"differs from the first decode by {err:.3g}")
            timed.append((label, time_fn([call])))
        except Exception as exc:  # noqa: BLE001 - a failing config is reported, not fatal
            print(f"  {label}: {type(exc).__name__}: {str(exc)[:160]}")
    return timed, ref


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--batch", default="8,1")
    ap.add_argument("--dtype", default="fp8", choices=["fp8", "bfloat16"], help="cache format")
    ap.add_argument("--geometries", default=",".join(GEOMETRIES))
    ap.add_argument("--sweep", action="store_true", help="also time sweep_configs() on each layout")
    ap.add_argument("--swapped", action="store_true", help="sweep the wgmma (swap_ab) form")
    ap.add_argument("--splits", action="store_true", help="sweep split targets and floors")
    ap.add_argument("--fp8-query", action="store_true", help="decode with fp8_query=True")
    ap.add_argument("--split-counts", default="", help="comma list: also time the default config at these num_splits")
    ap.add_argument("--layouts", default="nhd,hnd")
    ap.add_argument("--tq", default="", help="comma list of TurboQuant formats: sweep their split counts instead")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs the kernels through the Triton interpreter "
                                                     "(TRITON_INTERPRET=1) on small shapes as a smoke test, untimed")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    time_fn = timer(device)
    results = []
    if a.tq:
        for fmt in a.tq.split(","):
            results += tq_split_sweep(fmt, a.geometries.split(","), _ints(a.batch), _ints(a.contexts),
                                      _ints(a.split_counts), device, time_fn)
        _save(results)
        return 0
    print(f"{'geometry':13} {'b':>2} {'ctx':>7} {'layout':6} {'what':44} {'us':>8} {'TB/s':>6}")
    fp8 = a.dtype == "fp8"
    for gname in a.geometries.split(","):
        geom = GEOMETRIES[gname]
        for batch in _ints(a.batch):
            for context in _ints(a.contexts):
                case = caches(geom, batch, context, fp8, device)
                nbytes = 2 * batch * context * geom.num_kv_heads * geom.head_dim * (1 if fp8 else 2)
                ref = None
                for layout in a.layouts.split(","):
                    timed, ref = measure(paged_rows(case, geom, layout, context, fp8, a, device), time_fn, ref)
                    for label, us in timed:
                        results.append(dict(geometry=gname, batch=batch, context=context, page=BLOCK_SIZE, layout=layout,
                                            what=label, us=us, tbps=nbytes / us / 1e6))
                        print(f"{gname:13} {batch:>2} {context:>7} {layout:6} {label:44} {us:8.1f} "
                              f"{nbytes / us / 1e6:6.2f}", flush=True)
                del case
    _save(results)
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _save(results: list[dict]) -> None:
    """$OUT/probe_layout.json, when $OUT is set (the device machine's output folder)."""
    if os.environ.get("OUT"):
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        with open(os.path.join(os.environ["OUT"], "probe_layout.json"), "w") as f:
            json.dump(dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, results=results), f, indent=1)


def tq_split_sweep(fmt: str, geometries: list[str], batches: list[int], contexts: list[int], counts: list[int],
                   device, time_fn=time_calls) -> list[dict]:
    """decode_attention_tq at its default tiling and each split count in `counts` (and its own default)."""
    from kvpolicy.kernels.tq_decode import decode_attention_tq
    from kvpolicy.kernels.turboquant import tq_layout

    results = []
    for gname in geometries:
        geom = GEOMETRIES[gname]
        slot = tq_layout(fmt, geom.head_dim).slot_bytes
        for batch in batches:
            for context in contexts:
                case = build_case(geom, batch, context, {fmt: FORMATS[fmt]}, sdpa=False, copies=1, device=device)
                cache, tables, query = case["caches"][fmt], case["tables"][0], case["query"]
                seq_lens, sinks = case["seq_lens"], case["sinks"]
                nbytes = batch * context * geom.num_kv_heads * slot
                for n in [None, *counts]:
                    if n is not None and n * 64 > context:
                        continue
                    us = time_fn([functools.partial(decode_attention_tq, query, cache, tables, seq_lens, fmt, sinks=sinks,
                                                    num_splits=n)])
                    label = "tq default splits" if n is None else f"tq splits={n}"
                    results.append(dict(geometry=gname, batch=batch, context=context, layout="nhd", what=label, us=us,
                                        tbps=nbytes / us / 1e6, format=fmt))
                    print(f"{gname:13} {batch:>2} {context:>7} {fmt:20} {label:24} {us:8.1f} {nbytes / us / 1e6:6.2f}", flush=True)
                del case, cache
    return results


def _short(c: DecodeConfig) -> str:
    return (("swap/" if c.swap_ab else "") + f"n{c.block_n}/w{c.num_warps}/s{c.num_stages}/pps{c.programs_per_sm:g}"
            + (f"/r{c.maxnreg}" if c.maxnreg else "") + (f"/floor{c.min_tokens_per_split}" if c.min_tokens_per_split else ""))


if __name__ == "__main__":
    sys.exit(main())
