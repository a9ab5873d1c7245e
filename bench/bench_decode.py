#!/usr/bin/env python3
"""Decode attention on one GPU in one run: our KV formats against torch SDPA BF16 (cuDNN, flash).

    python bench/bench_decode.py [--quick] [--formats bf16,fp8,sdpa_cudnn] [--contexts 1024,131072]
                                 [--batch 1,8] [--geometries llama-3.1-8b] [--skip-accuracy] [--out PATH]
    python bench/bench_decode.py --reprint RUN.json        # no GPU: the tables of a saved run
    python bench/bench_decode.py --compare OLD.json NEW.json [--slope-from 32768]   # no GPU: slopes of two runs

Each timing is the median replay of a CUDA graph of many calls, rotating over
enough copies of the cache that it cannot sit in L2. Bytes are the KV bytes a
call must read (`kvpolicy.formats.slot_bytes`, plus any scales). Per geometry
and batch it fits ITL = slope x context + intercept over the contexts measured.
Then (unless --skip-accuracy) the long-context accuracy of positive-weighted
P.V and a synthetic needle test. The table is printed last; JSON goes to --out
(default $OUT/bench_decode.json when $OUT is set).

FORMATS is the table of KV formats measured: one dict per row with
`kv_cache_dtype` (vLLM name), `allocate(num_blocks, block_size, num_kv_heads,
head_dim, device) -> cache`, `store(cache, key, value, slot_mapping)` and
`decode(cache, query, block_tables, seq_lens, sinks, **kwargs) -> out`;
optional `scale_bytes(num_kv_heads) -> int`. Other kernels add rows here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvpolicy.formats import get_format
from kvpolicy.kernels.decode_attention import (
    DecodeConfig,
    decode_attention,
    decode_attention_pth,
    default_config,
    pth_config,
)
from kvpolicy.kernels.formats import PTH_FORMATS, TQ_FORMATS
from kvpolicy.kernels.launch import gluon_runs_on
from kvpolicy.kernels.paged_store import allocate_cache, allocate_pth_cache, compute_kv_scales, store_kv, store_kv_pth
from kvpolicy.kernels.reference import ref_decode_attention
from kvpolicy.kernels.tq_decode import decode_attention_tq
from kvpolicy.kernels.tq_store import store_kv_tq
from kvpolicy.kernels.turboquant import allocate_tq_cache, allocate_tq_planar_cache
from kvpolicy.runtime.fit import break_even_tokens, fit_line

BLOCK_SIZE = 16
"""vLLM's default KV block size."""
ROTATE_BYTES = 512 * 2**20
"""Bytes of BF16 cache each timing rotates over (the H200's L2 is 60 MB)."""
CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
BATCHES = [1, 8]


@dataclass(frozen=True)
class Geometry:
    """One attention layer's shape."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    sinks: bool


GEOMETRIES = {
    "llama-3.1-8b": Geometry(32, 8, 128, sinks=False),
    "gpt-oss-20b": Geometry(64, 8, 64, sinks=True),
}

def _paged_row(name: str, dtype_name: str, per_head_scales: bool, layout: str = "NHD", **decode_kwargs: Any) -> dict[str, Any]:
    """A row for our paged kernels: store_kv + decode_attention with fixed options, on a cache of `layout`."""

    def allocate(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device: torch.device) -> dict:
        k, v = allocate_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype_name, device, layout)
        return {"key_cache": k, "value_cache": v, "k_scale": None, "v_scale": None}

    def store(cache: dict, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if per_head_scales and cache["k_scale"] is None:
            cache["k_scale"], cache["v_scale"] = compute_kv_scales(key, value, per_head=True)
        store_kv(key, value, cache["key_cache"], cache["value_cache"], slot_mapping, cache["k_scale"], cache["v_scale"])

    def decode(cache: dict, query, block_tables, seq_lens, sinks, **kwargs) -> torch.Tensor:
        opts = {**decode_kwargs, **kwargs}
        return decode_attention(
            query, cache["key_cache"], cache["value_cache"], block_tables, seq_lens,
            k_scale=cache["k_scale"], v_scale=cache["v_scale"], sinks=sinks, **opts,
        )

    row = {"kv_cache_dtype": dtype_name, "allocate": allocate, "store": store, "decode": decode}
    if per_head_scales:
        row["scale_bytes"] = lambda num_kv_heads: 2 * 4 * num_kv_heads
    return row


def _tq_row(fmt: str) -> dict[str, Any]:
    """A row for the TurboQuant kernels (issue 5): one packed uint8 cache, fused decode."""

    def allocate(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
        return allocate_tq_cache(num_blocks, block_size, num_kv_heads, head_dim, fmt, device)

    def store(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv_tq(key, value, cache, slot_mapping, fmt)

    def decode(cache: torch.Tensor, query, block_tables, seq_lens, sinks, **kwargs) -> torch.Tensor:
        # the FP8 rows' knobs (two_level, ...) do not apply; pass on the ones that do
        opts = {k: v for k, v in kwargs.items() if k in ("out", "num_splits", "sm_scale", "sliding_window")}
        return decode_attention_tq(query, cache, block_tables, seq_lens, fmt, sinks=sinks, **opts)

    return {"kv_cache_dtype": fmt, "allocate": allocate, "store": store, "decode": decode}


def _tq_gl_row(fmt: str) -> dict[str, Any]:
    """The Gluon TurboQuant kernels (tq_gluon.py, tq_warp.py; Hopper) on a planar cache: the same
    bytes per token, each KV head's page in 16-byte aligned planes (formats.py)."""
    row = dict(_tq_row(fmt))

    def allocate(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
        return allocate_tq_planar_cache(num_blocks, block_size, num_kv_heads, head_dim, fmt, device)

    row["allocate"] = allocate

    def decode(cache: torch.Tensor, query, block_tables, seq_lens, sinks, **kwargs) -> torch.Tensor:
        opts = {k: v for k, v in kwargs.items() if k in ("out", "num_splits", "sm_scale", "sliding_window")}
        return decode_attention_tq(query, cache, block_tables, seq_lens, fmt, sinks=sinks, kernel="gluon", **opts)

    row["decode"] = decode
    return row


def _pth_row(fmt: str, layout: str = "NHD", block_n: int | None = None, stages: int | None = None,
             **decode_kwargs: Any) -> dict[str, Any]:
    """The per-token-head kernels (vLLM's rows of codes and inline scales, `layout` pages); `block_n` overrides
    the tile's tokens (the format's own stages and sums; split counts still assume the default tiling)."""

    def allocate(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, device: torch.device) -> torch.Tensor:
        return allocate_pth_cache(num_blocks, block_size, num_kv_heads, head_dim, fmt, device, layout)

    def store(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        store_kv_pth(key, value, cache, slot_mapping, fmt)

    def decode(cache: torch.Tensor, query, block_tables, seq_lens, sinks, **kwargs) -> torch.Tensor:
        opts = {k: v for k, v in {**decode_kwargs, **kwargs}.items()
                if k in ("out", "num_splits", "sm_scale", "sliding_window", "two_level", "fp8_query", "kernel")}
        if block_n is not None:
            base = pth_config(query.shape[-1], fmt, query.device)
            opts["config"] = DecodeConfig(block_n=block_n, num_stages=stages or base.num_stages,
                                          defer_sum=base.defer_sum)
        return decode_attention_pth(query, cache, block_tables, seq_lens, fmt, sinks=sinks, **opts)

    return {"kv_cache_dtype": fmt, "allocate": allocate, "store": store, "decode": decode}


FORMATS: dict[str, dict[str, Any]] = {
    "bf16": _paged_row("bf16", "bfloat16", per_head_scales=False),
    "fp8": _paged_row("fp8", "fp8", per_head_scales=True),
    "fp8_q8": _paged_row("fp8_q8", "fp8", per_head_scales=True, fp8_query=True),
    # vLLM's FlashInfer layout (one KV head's page contiguous); the rows above are FlashAttention's NHD
    "bf16_hnd": _paged_row("bf16_hnd", "bfloat16", per_head_scales=False, layout="HND"),
    "fp8_hnd": _paged_row("fp8_hnd", "fp8", per_head_scales=True, layout="HND"),
    # the Gluon kernel (decode_gluon.py: TMA pages, fp8 wgmma, e4m3 query), Hopper only
    "fp8_gl": _paged_row("fp8_gl", "fp8", per_head_scales=True, fp8_query=True, kernel="gluon"),
    "fp8_gl_hnd": _paged_row("fp8_gl_hnd", "fp8", per_head_scales=True, layout="HND", fp8_query=True, kernel="gluon"),
    **{fmt: _tq_row(fmt) for fmt in TQ_FORMATS},
    **{f"{fmt}_gl": _tq_gl_row(fmt) for fmt in TQ_FORMATS},
    # vLLM's per-token-head formats (TRITON_ATTN): NHD as vLLM's default, HND, and tile sizes beside the default
    **{fmt: _pth_row(fmt) for fmt in PTH_FORMATS},
    **{f"{fmt}_hnd": _pth_row(fmt, "HND") for fmt in PTH_FORMATS},
    "fp8_per_token_head_q8": _pth_row("fp8_per_token_head", fp8_query=True),
    # the Hopper Gluon kernel (pth_gluon.py: a copying warpgroup, wgmma), NHD only; _q8: fp8 with an e4m3 query;
    # _nTsN: T-token tiles, N stages, beside the default tiling
    **{f"{fmt}_gl": _pth_row(fmt, kernel="gluon") for fmt in PTH_FORMATS},
    "fp8_per_token_head_gl_q8": _pth_row("fp8_per_token_head", fp8_query=True, kernel="gluon"),
    **{f"{fmt}_gl_n{t}s{n}": _pth_row(fmt, block_n=t, stages=n, kernel="gluon") for fmt in PTH_FORMATS
       for t, n in ((128, 2), (64, 4))},
    "int8_per_token_head_n32": _pth_row("int8_per_token_head", block_n=32),
    "int4_per_token_head_n128": _pth_row("int4_per_token_head", block_n=128),
}
GLUON_ROWS = {n for n in FORMATS if n.endswith("_gl") or "_gl_" in n or n.startswith("fp8_gl")}
"""Rows of the Gluon kernels (sm_90 only)."""
SDPA_COLUMNS = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}
GLUON_VARIANTS = {
    "fp8_gl 2L-on 1-split": ("fp8_gl", dict(two_level=True, num_splits=1)),
    "fp8_gl 2L-off 1-split": ("fp8_gl", dict(two_level=False, num_splits=1)),
    "fp8_gl 2L-on": ("fp8_gl", dict(two_level=True)),
}
"""Accuracy and needle variants of the Gluon kernel (Hopper only): its P.V is an fp16 wgmma, carried in the
MMA when two-level is off."""


def gluon_rows_apply(device) -> bool:
    """Whether this GPU runs the Gluon rows (written for sm_90)."""
    device = torch.device(device)
    return device.type == "cuda" and gluon_runs_on(device)[0]


# --------------------------------------------------------------------------- timing


def time_calls(calls: list[Callable[[], Any]], min_graph_ms: float = 3.0, replays: int = 15) -> float:
    """Median microseconds per call: CUDA-graph replays of all `calls` in turn (eager timing if capture fails)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for c in calls:
        c()
    end.record()
    end.synchronize()
    pass_ms = start.elapsed_time(end)
    reps = max(1, min(math.ceil(min_graph_ms / max(pass_ms, 1e-3)), max(1, 2000 // len(calls))))
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for _ in range(reps):
                for c in calls:
                    c()
        graph.replay()
        torch.cuda.synchronize()
        run = graph.replay
    except Exception as exc:  # noqa: BLE001 - a backend that cannot be captured is timed eagerly
        print(f"  (graph capture failed: {type(exc).__name__}: {str(exc)[:120]}; timing eagerly)")
        torch.cuda.synchronize()

        def run() -> None:
            for _ in range(reps):
                for c in calls:
                    c()

    times = []
    for _ in range(replays):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1000.0 / (reps * len(calls))


# --------------------------------------------------------------------------- cases


def kv_bytes(row: dict, geom: Geometry, batch: int, context: int) -> int:
    """KV bytes one call must read: every attended token's stored bytes, plus scales."""
    slot = get_format(row["kv_cache_dtype"]).slot_bytes(geom.head_dim)
    extra = row["scale_bytes"](geom.num_kv_heads) if "scale_bytes" in row else 0
    return batch * context * geom.num_kv_heads * slot + extra


def build_case(geom: Geometry, batch: int, context: int, rows: dict[str, dict], sdpa: bool, copies: int, device,
               pages: str = "random") -> dict:
    """Caches for each row (and contiguous K/V for SDPA) holding `copies` independent random KV sets. `pages`:
    "random" (block tables a random permutation of the cache's pages, as after long serving) or
    "sequential" (each sequence's pages in address order)."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = copies * batch * blocks_per_seq
    if pages not in ("random", "sequential"):
        raise ValueError(f"pages: random or sequential, not {pages!r}")
    perm = (torch.randperm(num_blocks, device=device, dtype=torch.int64) if pages == "random"
            else torch.arange(num_blocks, device=device, dtype=torch.int64))
    tables = perm.view(copies, batch, blocks_per_seq).to(torch.int32)
    caches = {name: row["allocate"](num_blocks, BLOCK_SIZE, geom.num_kv_heads, geom.head_dim, device) for name, row in rows.items()}
    sd_k = sd_v = None
    if sdpa:
        shape = (copies, batch, geom.num_kv_heads, context, geom.head_dim)
        sd_k = torch.empty(shape, dtype=torch.bfloat16, device=device)
        sd_v = torch.empty(shape, dtype=torch.bfloat16, device=device)
    pos = torch.arange(context, device=device)
    for c in range(copies):
        key = torch.randn(batch * context, geom.num_kv_heads, geom.head_dim, device=device, dtype=torch.bfloat16)
        value = torch.randn(batch * context, geom.num_kv_heads, geom.head_dim, device=device, dtype=torch.bfloat16)
        slots = (tables[c].long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
        for name, row in rows.items():
            row["store"](caches[name], key, value, slots)
        if sdpa:
            sd_k[c] = key.view(batch, context, geom.num_kv_heads, geom.head_dim).transpose(1, 2)
            sd_v[c] = value.view(batch, context, geom.num_kv_heads, geom.head_dim).transpose(1, 2)
        del key, value
    query = torch.randn(batch, geom.num_q_heads, geom.head_dim, device=device, dtype=torch.bfloat16)
    sinks = torch.randn(geom.num_q_heads, device=device) if geom.sinks else None
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return dict(caches=caches, tables=tables, sd_k=sd_k, sd_v=sd_v, query=query, sinks=sinks, seq_lens=seq_lens)


def rotation_copies(geom: Geometry, batch: int, context: int) -> int:
    """Copies of a case that each timing rotates over: `ROTATE_BYTES` of BF16 K/V, so that no copy is still in
    L2 when its turn comes (smaller formats rotate over the same count, fewer bytes)."""
    return max(1, min(128, math.ceil(ROTATE_BYTES / (batch * context * geom.num_kv_heads * geom.head_dim * 4))))


def sdpa_times(case: dict, geom: Geometry, copies: int, backend, label: str) -> dict[str, float]:
    """Microseconds per call of SDPA `backend` in both call forms (`sdpa_call`) over the case's copies; a form
    this build lacks is reported under `label` and left out. A baseline is the faster form: on the gpt-oss
    layer at batch 1, 128k, cuDNN took 66 us "gqa" and 1.1 ms "folded"."""
    forms = {}
    for form in ("gqa", "folded"):
        try:
            forms[form] = time_calls([sdpa_call(case, geom, c, backend, form) for c in range(copies)])
        except Exception as exc:  # noqa: BLE001 - a form this build lacks is reported, not fatal
            print(f"  {label}/{form} failed: {type(exc).__name__}: {str(exc)[:160]}")
    return forms


def sdpa_call(case: dict, geom: Geometry, copy: int, backend, form: str = "folded") -> Callable[[], torch.Tensor]:
    """Decode through SDPA on contiguous BF16 K/V [batch, num_kv_heads, context, head_dim], in one of two forms.

    "folded": the GQA group's query heads become the query length (non-causal), K/V unexpanded.
    "gqa": one query position per head with `enable_gqa=True`.
    Both return [batch, num_q_heads, head_dim] (as a view).
    """
    batch = case["query"].shape[0]
    group = geom.num_q_heads // geom.num_kv_heads
    k, v = case["sd_k"][copy], case["sd_v"][copy]
    if form == "folded":
        q = case["query"].view(batch, geom.num_kv_heads, group, geom.head_dim)

        def call() -> torch.Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v).view(batch, geom.num_q_heads, geom.head_dim)
    else:
        q = case["query"].view(batch, geom.num_q_heads, 1, geom.head_dim)

        def call() -> torch.Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True).view(batch, geom.num_q_heads, geom.head_dim)

    return call


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def output_path(out: str | None, name: str) -> str | None:
    """Where a bench script writes its JSON: --out, else $OUT/name when $OUT is set (the device machine's
    output folder), else nowhere."""
    return out or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)


# --------------------------------------------------------------------------- speed table


def speed_table(args, device, log: dict, save: Callable[[], None]) -> list[dict]:
    rows = {n: FORMATS[n] for n in args.formats if n in FORMATS}
    if not gluon_rows_apply(device) and any(n in GLUON_ROWS for n in rows):
        print("  (Gluon rows skipped: the Gluon kernels run on sm_90 only)")
        rows = {n: r for n, r in rows.items() if n not in GLUON_ROWS}
    sdpa_cols = [n for n in args.formats if n in SDPA_COLUMNS]
    records = []
    for gname in args.geometries:
        geom = GEOMETRIES[gname]
        for batch in args.batch:
            for context in args.contexts:
                copies = rotation_copies(geom, batch, context)
                t0 = time.time()
                case = build_case(geom, batch, context, rows, bool(sdpa_cols), copies, device)
                checks = {}
                if sdpa_cols:
                    # Without sinks, against SDPA: catches a config that is fast because it is wrong.
                    try:
                        ref = sdpa_call(case, geom, 0, SDPBackend.FLASH_ATTENTION)()
                        for name, row in rows.items():
                            out = row["decode"](case["caches"][name], case["query"], case["tables"][0], case["seq_lens"], None)
                            checks[name] = rel_err(out, ref)
                    except Exception as exc:  # noqa: BLE001 - reported; the timings still run
                        print(f"  check failed: {type(exc).__name__}: {str(exc)[:300]}")
                for name, row in rows.items():
                    calls = [
                        (lambda c=c, name=name, row=row: row["decode"](case["caches"][name], case["query"], case["tables"][c], case["seq_lens"], case["sinks"]))
                        for c in range(copies)
                    ]
                    try:
                        us = time_calls(calls)
                    except Exception as exc:  # noqa: BLE001 - one failing row must not lose the run
                        print(f"  {name} failed: {type(exc).__name__}: {str(exc)[:300]}")
                        continue
                    nbytes = kv_bytes(row, geom, batch, context)
                    records.append(dict(geometry=gname, batch=batch, context=context, column=name, us=us,
                                        kv_bytes=nbytes, tbps=nbytes / us / 1e6, check_rel_err_vs_sdpa=checks.get(name)))
                for col in sdpa_cols:
                    # Each backend in both call forms; the faster is its number (the baseline is its best).
                    forms = sdpa_times(case, geom, copies, SDPA_COLUMNS[col], col)
                    if not forms:
                        continue
                    form = min(forms, key=forms.get)
                    nbytes = batch * context * geom.num_kv_heads * geom.head_dim * 4
                    records.append(dict(geometry=gname, batch=batch, context=context, column=col, us=forms[form], form=form,
                                        us_by_form=forms, kv_bytes=nbytes, tbps=nbytes / forms[form] / 1e6))
                del case
                torch.cuda.empty_cache()
                line = " ".join(f"{r['column']}={r['us']:.1f}us" for r in records if (r["geometry"], r["batch"], r["context"]) == (gname, batch, context))
                print(f"  {gname} b={batch} ctx={context} copies={copies} ({time.time() - t0:.1f}s): {line}  checks={ {k: f'{v:.2e}' for k, v in checks.items()} }", flush=True)
                log["speed"] = records
                save()
    return records


def summarise(records: list[dict], log: dict) -> list[dict]:
    """Per (geometry, batch, column): fitted slope/intercept, ratios vs SDPA, break-evens, and the targets."""
    summary = []
    keys = sorted({(r["geometry"], r["batch"]) for r in records})
    for gname, batch in keys:
        sel = [r for r in records if r["geometry"] == gname and r["batch"] == batch]
        cols = list(dict.fromkeys(r["column"] for r in sel))
        # kvpolicy.runtime.fit's line and break-even, in us instead of ms (the unit does not enter either)
        fits = {c: fit_line([r["context"] for r in sel if r["column"] == c], [r["us"] for r in sel if r["column"] == c])
                for c in cols if sum(r["column"] == c for r in sel) >= 2}
        for c, line in fits.items():
            slope, intercept = line.slope_ms_per_token, line.intercept_ms
            s = dict(geometry=gname, batch=batch, column=c, slope_ns_per_token=slope * 1e3, intercept_us=intercept)
            for base in ("sdpa_cudnn", "sdpa_flash"):
                if base in fits:
                    s[f"slope_ratio_vs_{base}"] = slope / fits[base].slope_ms_per_token
            # an HND row breaks even against our BF16 on the same layout
            bf16 = "bf16_hnd" if c.endswith("_hnd") else "bf16"
            if not c.startswith(("bf16", "sdpa")) and bf16 in fits:
                s["break_even_vs_bf16"] = break_even_tokens(fits[bf16], line)
                s["crossover_vs_bf16"] = measured_crossover(sel, bf16, c)
            if "sdpa_cudnn" in fits and c != "sdpa_cudnn":
                s["break_even_vs_sdpa_cudnn"] = break_even_tokens(fits["sdpa_cudnn"], line)
            summary.append(s)
    log["summary"] = summary
    return summary


def measured_crossover(sel: list[dict], base: str, col: str) -> int | None:
    """The shortest measured context from which `col` is at least as fast as `base` at every longer one
    measured (None: slower at the longest). Beside the fitted break-even, whose intercepts move by
    ~1 us between runs, i.e. by ~1k tokens of break-even."""
    us = {(r["column"], r["context"]): r["us"] for r in sel}
    ctxs = sorted(c for (k, c) in us if k == col and (base, c) in us)
    best = None
    for ctx in reversed(ctxs):
        if us[(col, ctx)] > us[(base, ctx)]:
            break
        best = ctx
    return best


EVIDENCE_COLUMNS = ("bf16", "fp8", *TQ_FORMATS, "sdpa_cudnn")
"""Columns written by --evidence: the cache formats recommend can choose, and the baseline."""
EVIDENCE_FROM = {"fp8": ("fp8_gl", "fp8"), **{fmt: (f"{fmt}_gl", fmt) for fmt in TQ_FORMATS}}
"""Rows an evidence column is taken from, first present first: our fastest kernel for the format. On
Hopper that is a Gluon kernel: for fp8 with an e4m3 query (what vLLM's FA3 FP8 path does too), for
the TurboQuant formats on planar pages (the same bytes per token)."""


def evidence_block(records: list[dict], summary: list[dict], log: dict, gpu_id: str, batch: int = 8) -> dict[str, Any]:
    """The `kernels` measurements of a policy evidence entry (kvpolicy.inputs.policy_schema.KernelMeasurement) for one batch."""
    measurements = []
    used = set()
    for gname, geom in GEOMETRIES.items():
        fits = {}
        for column in EVIDENCE_COLUMNS:
            for row in EVIDENCE_FROM.get(column, (column,)):
                s = next((s for s in summary if s["geometry"] == gname and s["batch"] == batch and s["column"] == row), None)
                if s is None:
                    continue
                at_128k = [r for r in records if r["geometry"] == gname and r["batch"] == batch
                           and r["column"] == row and r["context"] == 131072]
                fits[column] = dict(slope_ns_per_token=round(s["slope_ns_per_token"], 4),
                                    intercept_us=round(s["intercept_us"], 2),
                                    read_tbps_at_128k=round(at_128k[0]["tbps"], 2) if at_128k else None)
                if row != column:
                    used.add(f"{column} from the {row} row")
                break
        if "sdpa_cudnn" in fits and len(fits) > 1:
            measurements.append(dict(gpu=gpu_id, geometry=gname, head_dim=geom.head_dim, batch=batch,
                                     baseline="sdpa_cudnn", fits=fits))
    rows = f" ({', '.join(sorted(used))})" if used else ""
    return {"kernels": measurements,
            "source": f"bench/bench_decode.py on an {log['gpu']}, {log['date'][:10]}, torch {log['torch']}, "
                      f"Triton {log['triton']}, commit {log['commit']}{rows}"}


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def copy_bandwidth(device, nbytes: int = 1 << 30) -> dict[str, float]:
    """Device-to-device copy of `nbytes` (the issue-5 bandwidth reference), timed like the kernels.

    Two copies: torch's `copy_` (a memcpy; inside a CUDA graph it becomes a memcpy node) and a
    Triton kernel that streams 16-byte vectors through the SMs, as the decode kernels do. The
    faster is the reference."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    s32, d32 = src.view(torch.int32), dst.view(torch.int32)
    n, block = s32.numel(), 8192
    ways = {"memcpy": lambda: dst.copy_(src),
            "kernel": lambda: _copy_kernel[(triton.cdiv(n, block),)](s32, d32, n, BLOCK=block, num_warps=8)}
    us = {name: time_calls([call], min_graph_ms=20.0) for name, call in ways.items()}
    del src, dst, s32, d32
    torch.cuda.empty_cache()
    best = min(us.values())
    return {"bytes": nbytes, "us": best, "us_by_way": us, "read_tbps": nbytes / best / 1e6,
            "read_plus_write_tbps": 2 * nbytes / best / 1e6}


TQ_SLOPE_TARGETS = {"turboquant_4bit_nc": 0.35, "turboquant_3bit_nc": 0.30}
"""Issue 5: slope at most this multiple of cuDNN BF16's; k8v4 below FP8's ratio + 0.05."""


def targets(records: list[dict], summary: list[dict], log: dict) -> list[str]:
    """The issues' targets, per geometry and batch, with the measured numbers."""
    lines = []
    copy = log.get("copy_bandwidth")
    # k8v4's slope limit comes from the FP8 kernel of the same family: the Gluon k8v4 row against fp8_gl
    fp8_ratio = {(s["geometry"], s["batch"], s["column"]): s["slope_ratio_vs_sdpa_cudnn"] for s in summary
                 if s["column"] in ("fp8", "fp8_gl") and "slope_ratio_vs_sdpa_cudnn" in s}
    by = {(r["geometry"], r["batch"], r["context"], r["column"]): r for r in records}
    for s in summary:
        g, b, c = s["geometry"], s["batch"], s["column"]
        if c.startswith("fp8") and "slope_ratio_vs_sdpa_cudnn" in s:
            ratio = s["slope_ratio_vs_sdpa_cudnn"]
            lines.append(f"{g} b={b} {c}: slope {ratio:.3f}x cuDNN BF16 (target <= 0.55) {'MET' if ratio <= 0.55 else 'MISSED'}")
        if c.startswith("fp8") and (g, b, 131072, c) in by:
            tb = by[(g, b, 131072, c)]["tbps"]
            lines.append(f"{g} b={b} {c}: {tb:.2f} TB/s of KV at 128k (target >= 3.8) {'MET' if tb >= 3.8 else 'MISSED'}")
        if c.startswith("fp8") and "break_even_vs_bf16" in s:
            be = s["break_even_vs_bf16"]
            ok = be is not None and be < 2048
            cross = s.get("crossover_vs_bf16")
            lines.append(f"{g} b={b} {c}: break-even vs our BF16 {'never' if be is None else f'{be:.0f}'} tokens (target < 2048) "
                         f"{'MET' if ok else 'MISSED'}; measured: as fast or faster from {cross if cross else 'none'} tokens on")
        if c.startswith("turboquant_") and "slope_ratio_vs_sdpa_cudnn" in s:
            ratio = s["slope_ratio_vs_sdpa_cudnn"]
            fmt, gluon = c.removesuffix("_gl"), c.endswith("_gl")
            limit = TQ_SLOPE_TARGETS.get(fmt)
            fp8_key = (g, b, "fp8_gl" if gluon else "fp8")
            if limit is None and fmt == "turboquant_k8v4" and fp8_key in fp8_ratio:
                limit = fp8_ratio[fp8_key] + 0.05
            if limit is not None:
                lines.append(f"{g} b={b} {c}: slope {ratio:.3f}x cuDNN BF16 (target <= {limit:.3f}) {'MET' if ratio <= limit else 'MISSED'}")
        if c.startswith("turboquant_") and copy and (g, b, 131072, c) in by:
            tb, ref = by[(g, b, 131072, c)]["tbps"], 0.7 * copy["read_plus_write_tbps"]
            lines.append(f"{g} b={b} {c}: {tb:.2f} TB/s of KV at 128k (target >= 70% of this run's copy, "
                         f"{ref:.2f} TB/s read+write) {'MET' if tb >= ref else 'MISSED'}")
        if c in ("bf16", "bf16_hnd"):
            worst = None
            for ctx in sorted({r["context"] for r in records if r["context"] >= 16384}):
                if (g, b, ctx, c) in by and (g, b, ctx, "sdpa_cudnn") in by:
                    ratio = by[(g, b, ctx, c)]["us"] / by[(g, b, ctx, "sdpa_cudnn")]["us"]
                    worst = max(worst or 0, ratio)
            if worst is not None:
                lines.append(f"{g} b={b} {c}: worst time vs cuDNN at >=16k {worst:.3f}x (target <= 1.10) {'MET' if worst <= 1.10 else 'MISSED'}")
    log["targets"] = lines
    return lines


# --------------------------------------------------------------------------- accuracy


def accuracy(contexts: list[int], device, log: dict) -> list[dict]:
    """Relative error vs float64 of positive-weighted P.V (softmax weights, V in [0, 2)), Llama layer, batch 1."""
    geom = GEOMETRIES["llama-3.1-8b"]
    variants = {
        "bf16": ("bf16", {}),
        "fp8 2L-on 1-split": ("fp8", dict(two_level=True, num_splits=1)),
        "fp8 2L-off 1-split": ("fp8", dict(two_level=False, num_splits=1)),
        "fp8 2L-on": ("fp8", dict(two_level=True)),
        "fp8_q8 2L-on": ("fp8_q8", dict(two_level=True)),
        **(GLUON_VARIANTS if gluon_rows_apply(device) else {}),
    }
    out = []
    for context in contexts:
        pos = torch.arange(context, device=device)
        table = torch.randperm(-(-context // BLOCK_SIZE), device=device).to(torch.int32)[None]
        slots = (table[0].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        key = torch.randn(context, geom.num_kv_heads, geom.head_dim, device=device).bfloat16()
        value = (torch.rand(context, geom.num_kv_heads, geom.head_dim, device=device) * 2).bfloat16()
        query = torch.randn(1, geom.num_q_heads, geom.head_dim, device=device).bfloat16()
        seq_lens = torch.tensor([context], dtype=torch.int32, device=device)
        caches = {}
        for fmt in ("bf16", "fp8", "fp8_q8"):
            caches[fmt] = FORMATS[fmt]["allocate"](table.shape[1], BLOCK_SIZE, geom.num_kv_heads, geom.head_dim, device)
            FORMATS[fmt]["store"](caches[fmt], key, value, slots)
        caches["fp8_gl"] = caches["fp8_q8"]  # the same FP8 NHD cache and scales, read by the Gluon kernel
        refs = {}
        for name, (fmt, kw) in variants.items():
            c = caches[fmt]
            if fmt not in refs:
                refs[fmt] = ref_decode_attention(query, c["key_cache"], c["value_cache"], table, seq_lens, k_scale=c["k_scale"], v_scale=c["v_scale"])
            got = FORMATS[fmt]["decode"](c, query, table, seq_lens, None, out=torch.empty(query.shape, device=device), **kw)
            out.append(dict(context=context, variant=name, rel_err=rel_err(got, refs[fmt])))
        print("  accuracy", context, " ".join(f"{r['variant']}={r['rel_err']:.2e}" for r in out if r["context"] == context), flush=True)
        del caches, refs, key, value
        torch.cuda.empty_cache()
    log["accuracy"] = out
    return out


def needle(contexts: list[int], device, log: dict, margin: float = 13.5, batch: int = 4) -> list[dict]:
    """Synthetic needle: one planted key per (sequence, KV head) with logit `margin` over N(0,1) distractors.

    V is 1 + 0.3*noise for distractors and 1 + 0.5*code for the needle (code in +-1);
    a query head retrieves when sign(out - 1) matches >= 90% of the code.
    """
    geom = GEOMETRIES["llama-3.1-8b"]
    group = geom.num_q_heads // geom.num_kv_heads
    variants = {
        "bf16": ("bf16", {}),
        "fp8 2L-on": ("fp8", dict(two_level=True)),
        "fp8 2L-off 1-split": ("fp8", dict(two_level=False, num_splits=1)),
        "fp8_q8 2L-on": ("fp8_q8", dict(two_level=True)),
        **(GLUON_VARIANTS if gluon_rows_apply(device) else {}),
    }
    res = []
    for context in contexts:
        blocks = -(-context // BLOCK_SIZE)
        tables = torch.randperm(batch * blocks, device=device).view(batch, blocks).to(torch.int32)
        pos = torch.arange(context, device=device)
        slots = (tables.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
        d = geom.head_dim
        direction = F.normalize(torch.randn(batch, geom.num_kv_heads, d, device=device), dim=-1)
        key = torch.randn(batch, context, geom.num_kv_heads, d, device=device)
        value = 1 + 0.3 * torch.randn(batch, context, geom.num_kv_heads, d, device=device)
        code = torch.randint(0, 2, (batch, geom.num_kv_heads, d), device=device).float() * 2 - 1
        where = torch.randint(0, context, (batch, geom.num_kv_heads), device=device)
        bi, hi = torch.meshgrid(torch.arange(batch, device=device), torch.arange(geom.num_kv_heads, device=device), indexing="ij")
        # sm_scale = d**-0.5 and |q| = sqrt(d): distractor logits ~ N(0, 1), the needle's = margin.
        key[bi, where, hi] = direction * margin
        value[bi, where, hi] = 1 + 0.5 * code
        query = (direction * math.sqrt(d)).repeat_interleave(group, dim=1).bfloat16()
        key = key.reshape(-1, geom.num_kv_heads, d).bfloat16()
        value = value.reshape(-1, geom.num_kv_heads, d).bfloat16()
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        caches = {}
        for fmt in ("bf16", "fp8", "fp8_q8"):
            caches[fmt] = FORMATS[fmt]["allocate"](batch * blocks, BLOCK_SIZE, geom.num_kv_heads, d, device)
            FORMATS[fmt]["store"](caches[fmt], key, value, slots)
        caches["fp8_gl"] = caches["fp8_q8"]  # the same FP8 NHD cache and scales, read by the Gluon kernel
        want = code.repeat_interleave(group, dim=1)
        for name, (fmt, kw) in variants.items():
            got = FORMATS[fmt]["decode"](caches[fmt], query, tables, seq_lens, None, out=torch.empty(query.shape, device=device), **kw)
            bits = ((got - 1).sign() == want).float().mean(dim=-1)
            res.append(dict(context=context, margin=margin, variant=name, retrieved=(bits >= 0.9).float().mean().item(), bit_accuracy=bits.mean().item()))
        print("  needle", margin, context, " ".join(f"{r['variant']}={r['retrieved']:.2f}" for r in res if r["context"] == context), flush=True)
        del caches, key, value
        torch.cuda.empty_cache()
    log["needle"] = res
    return res


# --------------------------------------------------------------------------- main


def print_table(records: list[dict], summary: list[dict], target_lines: list[str], acc: list[dict], ndl: list[dict]) -> None:
    cols = list(dict.fromkeys(r["column"] for r in records))
    keys = list(dict.fromkeys((r["geometry"], r["batch"]) for r in records))
    by = {(r["geometry"], r["batch"], r["context"], r["column"]): r for r in records}
    for g, b in keys:
        print(f"\n## {g}, batch {b}: microseconds (TB/s of KV read)")
        print("| context | " + " | ".join(cols) + " |")
        print("|---" * (len(cols) + 1) + "|")
        for ctx in sorted({r["context"] for r in records if (r["geometry"], r["batch"]) == (g, b)}):
            cells = []
            for c in cols:
                r = by.get((g, b, ctx, c))
                cells.append(f"{r['us']:.1f} ({r['tbps']:.2f})" if r else "-")
            print(f"| {ctx} | " + " | ".join(cells) + " |")
        print("\n| column | slope ns/token | intercept us | slope / cuDNN | slope / flash | break-even vs our bf16 "
              "(measured crossover) | vs cuDNN |")
        print("|---" * 7 + "|")
        for s in summary:
            if (s["geometry"], s["batch"]) != (g, b):
                continue
            def f(x, fmt="{:.3f}"):
                return "-" if x is None else fmt.format(x)
            print(f"| {s['column']} | {s['slope_ns_per_token']:.3f} | {s['intercept_us']:.1f} | {f(s.get('slope_ratio_vs_sdpa_cudnn'))} | "
                  f"{f(s.get('slope_ratio_vs_sdpa_flash'))} | "
                  f"{f(s.get('break_even_vs_bf16'), '{:.0f}') + ' (' + f(s.get('crossover_vs_bf16'), '{}') + ')' if 'break_even_vs_bf16' in s else 'n/a'} | "
                  f"{f(s.get('break_even_vs_sdpa_cudnn'), '{:.0f}') if 'break_even_vs_sdpa_cudnn' in s else 'n/a'} |")
    if acc:
        print("\n## accuracy: relative error vs float64, positive-weighted P.V (Llama layer, batch 1)")
        variants = list(dict.fromkeys(r["variant"] for r in acc))
        print("| context | " + " | ".join(variants) + " |")
        print("|---" * (len(variants) + 1) + "|")
        for ctx in sorted({r["context"] for r in acc}):
            print(f"| {ctx} | " + " | ".join(f"{r['rel_err']:.2e}" for v in variants for r in acc if r["context"] == ctx and r["variant"] == v) + " |")
    if ndl:
        print("\n## needle: fraction of query heads retrieving the planted value (bit accuracy)")
        variants = list(dict.fromkeys(r["variant"] for r in ndl))
        print("| margin | context | " + " | ".join(variants) + " |")
        print("|---" * (len(variants) + 2) + "|")
        for margin in sorted({r["margin"] for r in ndl}, reverse=True):
            for ctx in sorted({r["context"] for r in ndl}):
                cells = [f"{r['retrieved']:.2f} ({r['bit_accuracy']:.3f})" for v in variants for r in ndl
                         if (r["margin"], r["context"], r["variant"]) == (margin, ctx, v)]
                print(f"| {margin} | {ctx} | " + " | ".join(cells) + " |")
    if target_lines:
        print("\n## targets")
        for line in target_lines:
            print("- " + line)


def print_comparison(old: dict, new: dict, names: list[str], slope_from: int = 0) -> list[dict]:
    """Per (geometry, batch, column) of both runs: slope ns/token and slope / cuDNN BF16 of each (fitted over the
    contexts >= `slope_from`), and new / old. Prints the table (and a line per column past 3%); returns its rows."""
    fits = []
    for run in (old, new):
        speed = [r for r in run["speed"] if r["context"] >= slope_from]
        fits.append({(s["geometry"], s["batch"], s["column"]): s for s in summarise(speed, {})})
    ctxs = sorted({r["context"] for r in new["speed"] if r["context"] >= slope_from})
    print(f"# slopes over {ctxs[0]}-{ctxs[-1]} tokens: old = {names[0]} (commit {old.get('commit')}), "
          f"new = {names[1]} (commit {new.get('commit')}); {new.get('gpu')}")
    print("| layer | batch | column | old ns/token (x cuDNN) | new ns/token (x cuDNN) | new / old | of the x cuDNN |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for key in sorted(set(fits[0]) & set(fits[1])):
        a, b = fits[0][key], fits[1][key]
        ratio = b["slope_ns_per_token"] / a["slope_ns_per_token"]
        cudnn = [s.get("slope_ratio_vs_sdpa_cudnn") for s in (a, b)]
        cells = [f"{s['slope_ns_per_token']:.3f}" + (f" ({c:.3f}x)" if c is not None else "") for s, c in zip((a, b), cudnn)]
        norm = f"{cudnn[1] / cudnn[0]:.3f}" if None not in cudnn else "-"
        print(f"| {key[0]} | {key[1]} | {key[2]} | {cells[0]} | {cells[1]} | {ratio:.3f} | {norm} |")
        rows.append(dict(geometry=key[0], batch=key[1], column=key[2], old=a["slope_ns_per_token"],
                         new=b["slope_ns_per_token"], ratio=ratio))
    worst = [r for r in rows if r["column"] != "sdpa_cudnn" and abs(r["ratio"] - 1) > 0.03]
    for r in worst:
        print(f"- {r['geometry']} b={r['batch']} {r['column']}: new slope {r['ratio']:.3f}x the old (outside 3%)")
    print(f"{len(rows) - len(worst)} of {len(rows)} slopes within 3% of the old run's")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 3 contexts, batch 8, short accuracy")
    p.add_argument("--formats", default=",".join([*FORMATS, *SDPA_COLUMNS]), help="comma list of FORMATS rows and sdpa_cudnn/sdpa_flash")
    p.add_argument("--contexts", default=None, help="comma list of context lengths")
    p.add_argument("--batch", default=None, help="comma list of batch sizes")
    p.add_argument("--geometries", default=",".join(GEOMETRIES), help="comma list of " + ", ".join(GEOMETRIES))
    p.add_argument("--evidence", default=None, metavar="PATH",
                   help="also write the batch-8 fits as a policy evidence `kernels` block (YAML) for kvpolicy recommend")
    p.add_argument("--skip-accuracy", action="store_true", help="skip the accuracy and needle sections")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/bench_decode.json when $OUT is set)")
    p.add_argument("--reprint", default=None, metavar="JSON",
                   help="no GPU: re-derive fits, targets and tables from a saved run's JSON and print them")
    p.add_argument("--compare", nargs=2, default=None, metavar=("OLD", "NEW"),
                   help="no GPU: each column's slope in two saved runs (vs cuDNN BF16 of the same run) and their ratio")
    p.add_argument("--slope-from", type=int, default=0,
                   help="with --compare: fit the slopes over contexts from this many tokens on")
    args = p.parse_args(argv)
    if args.compare:
        runs = []
        for path in args.compare:
            with open(path) as fh:
                runs.append(json.load(fh))
        print_comparison(*runs, args.compare, args.slope_from)
        return 0
    if args.reprint:
        with open(args.reprint) as fh:
            saved = json.load(fh)
        print(f"# bench_decode {saved['date']} on {saved['gpu']} (torch {saved['torch']}, triton {saved['triton']}, "
              f"commit {saved['commit']}), re-derived from {args.reprint}")
        summary = summarise(saved["speed"], saved)
        print_table(saved["speed"], summary, targets(saved["speed"], summary, saved), saved.get("accuracy", []),
                    saved.get("needle", []))
        return 0
    args.formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in args.formats if f not in FORMATS and f not in SDPA_COLUMNS]
    if unknown:
        p.error(f"unknown formats {unknown}; known: {[*FORMATS, *SDPA_COLUMNS]}")
    args.geometries = [g for g in args.geometries.split(",") if g]
    args.contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else ([1024, 4096, 16384] if args.quick else CONTEXTS)
    args.batch = [int(b) for b in args.batch.split(",")] if args.batch else ([8] if args.quick else BATCHES)
    out_path = output_path(args.out, "bench_decode.json")
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    import triton

    log: dict[str, Any] = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), commit=os.environ.get("KVP_COMMIT", "unknown"), argv=sys.argv[1:],
        block_size=BLOCK_SIZE, rotate_bytes=ROTATE_BYTES,
        default_configs={f"{n}/d{d}": asdict(default_config(d, n != "bf16", device)) for n in ("bf16", "fp8") for d in (64, 128)},
    )

    def save() -> None:
        if out_path:
            os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
            with open(out_path, "w") as fh:
                json.dump(log, fh, indent=1)

    print(f"# bench_decode {log['date']} on {log['gpu']} (torch {log['torch']}, triton {log['triton']}, commit {log['commit']})", flush=True)
    if any(f.startswith("turboquant_") for f in args.formats):
        log["copy_bandwidth"] = copy_bandwidth(device)
        print(f"# copy bandwidth: {log['copy_bandwidth']['read_plus_write_tbps']:.2f} TB/s read+write", flush=True)
    records = speed_table(args, device, log, save)
    summary = summarise(records, log)
    target_lines = targets(records, summary, log)
    save()
    if args.evidence:
        from kvpolicy.inputs.catalog import resolve_gpu
        from kvpolicy.inputs.yamlio import dump_roundtrip

        block = evidence_block(records, summary, log, resolve_gpu(torch.cuda.get_device_name()).id)
        with open(args.evidence, "w") as fh:
            fh.write(dump_roundtrip(block))
    acc, ndl = [], []
    if not args.skip_accuracy:
        acc_contexts = [4096, 16384] if args.quick else [4096, 16384, 65536, 131072]
        acc = accuracy(acc_contexts, device, log)
        save()
        ndl = needle(acc_contexts, device, log, margin=13.5) + needle(acc_contexts, device, log, margin=8.0)
        log["needle"] = ndl
        save()
    print_table(records, summary, target_lines, acc, ndl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
