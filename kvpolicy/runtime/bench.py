"""`kvpolicy bench`: decode-step attention time across contexts, fitted per the documents' method.

For every variant (BF16, the decision, `--compare`) and batch, the caches are
allocated once for the longest context and filled with random K/V; each context
is then timed as one decode step of every attention layer (store the new token,
attend). On a GPU the step is captured in a CUDA graph and its replays timed by
`triton.testing.do_bench` (median, L2 flushed between replays); on the CPU the
torch references are timed by the wall clock (the same code path, not a
performance figure). ITL = slope x context + intercept is fitted per variant,
and the break-even against BF16 is intercept difference / slope difference.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kvpolicy.errors import InputError
from kvpolicy.facts.kv_memory import Layout
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.rules.decision import Decision
from kvpolicy.runtime.caches import BLOCK_SIZE, pages_per_sequence, plan_layers
from kvpolicy.runtime.fit import break_even_tokens, fit_line, fit_problems
from kvpolicy.runtime.results import (
    BenchFit,
    BenchPoint,
    BenchResult,
    VariantInfo,
    environment,
)
from kvpolicy.runtime.step import DecodeStep
from kvpolicy.runtime.variants import Variant

GPU_WARMUP_MS = 25
"""do_bench warm-up per point (ms of replays)."""
GPU_REP_MS = 100
"""do_bench measurement per point (ms of replays); the median is kept."""
CPU_REPS = 2
"""Timed runs per point on the CPU after one warm-up (the references are slow)."""
MEMORY_RESERVE_GIB = 1.0
MEMORY_RESERVE_SHARE = 0.03
"""Free GPU memory left to what `working_bytes` does not count (the allocator's rounding, Triton's and cuDNN's
workspaces, the CUDA graph itself): this many GiB plus this share of what is free."""


def cache_bytes(arch: ModelArch, variant: Variant, batch: int, max_context: int) -> int:
    """Bytes the variant's caches take for `batch` sequences of `max_context` tokens (window-bounded)."""
    total = 0
    for plan in plan_layers(arch, variant):
        if plan.has_cache:
            total += plan.bytes_per_token * batch * pages_per_sequence(plan, max_context + 1) * BLOCK_SIZE
    return total


def time_step(step: DecodeStep) -> tuple[float, str]:
    """Median ms of one decode step, and how it was timed."""
    if step.device.type != "cuda":
        step.run()
        times = []
        for _ in range(CPU_REPS):
            t0 = time.perf_counter()
            step.run()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), f"wall clock, median of {CPU_REPS} after 1 warm-up (torch references)"
    import triton.testing

    for _ in range(2):
        step.run()
    torch.cuda.synchronize()
    if "reference" in step.layer_paths():
        # The float64 reference reads sequence lengths on the host: it cannot be captured in a graph.
        fn, how = step.run, "eager launches (some layers run the torch reference)"
    else:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step.run()
        torch.cuda.synchronize()
        fn, how = graph.replay, "CUDA graph replay"
    ms = triton.testing.do_bench(fn, warmup=GPU_WARMUP_MS, rep=GPU_REP_MS, return_mode="median")
    return float(ms), f"{how}, triton.testing.do_bench median ({GPU_REP_MS} ms of replays, L2 flushed)"


def run_bench(arch: ModelArch, gpu: GpuSpec, decision: Decision, variants: list[Variant], contexts: list[int],
              batches: list[int], device: torch.device, backend: str, policy_label: str = "",
              on_point: Callable[[str], None] | None = None, seed: int = 0) -> BenchResult:
    """Time every (variant, batch, context) and fit the lines."""
    if len(set(contexts)) < 2:
        raise InputError("--contexts: a line needs at least two different context lengths, e.g. 1k..128k.")
    contexts = sorted(set(contexts))
    env = environment(device, backend)
    result = BenchResult(model=arch.id, gpu=gpu.id, environment=env, policy=policy_label, decision=decision,
                         contexts=contexts, batches=batches, variants=[], block_size=BLOCK_SIZE)
    longest = contexts[-1]
    for variant in variants:
        for batch in batches:
            _check_memory(arch, variant, batch, longest, device)
            try:
                _measure(result, arch, variant, batch, contexts, device, backend, seed, on_point)
            except torch.cuda.OutOfMemoryError:
                raise InputError(f"{variant.name} at batch {batch} and {longest:,} tokens ran out of GPU memory "
                                 f"although {_need_words(arch, variant, batch, longest)} were counted to fit: "
                                 "something else holds GPU memory. Use a smaller --batch or a shorter longest "
                                 "--contexts.") from None
    result.fits = fit_all(result)
    result.warnings += fit_warnings(result.fits)
    if backend != "triton":
        result.warnings.append("CPU run: the torch references were timed, not the kernels; these numbers test "
                               "the code path and say nothing about a GPU.")
    return result


def _measure(result: BenchResult, arch: ModelArch, variant: Variant, batch: int, contexts: list[int],
             device: torch.device, backend: str, seed: int, on_point: Callable[[str], None] | None) -> None:
    """Allocate and fill one variant's caches at one batch for the longest context, then time every context."""
    step = DecodeStep(arch, variant, batch, contexts[-1], device, backend, seed=seed)
    try:
        if not any(v.name == variant.name for v in result.variants):
            info = VariantInfo(name=variant.name, key=variant.key, kv_cache_dtype=variant.kv_cache_dtype,
                               skip_layers=list(variant.skip_layers), two_level=variant.two_level,
                               scale_source=variant.scale_source, cache_layout=variant.cache_layout,
                               kv_bytes_per_token=Layout.of(arch, variant.kv_cache_dtype,
                                                            list(variant.skip_layers)).bytes_per_token(),
                               layer_paths=step.layer_paths())
            result.variants.append(info)
            if "reference" in info.layer_paths and backend == "triton":
                result.warnings.append(
                    f"{variant.name}: layers {_span(info.layer_paths['reference'])} run the float64 torch "
                    "reference (the Triton kernels take head_dim 16-256): their time is not a kernel's.")
        step.fill(contexts[-1])
        for context in contexts:
            step.prepare(context)
            ms, how = time_step(step)
            result.timing = how
            result.points.append(BenchPoint(variant=variant.name, batch=batch, context_tokens=context,
                                            itl_ms=round(ms, 6)))
            if on_point:
                on_point(f"{variant.name} batch {batch} {context} tokens: {ms:.3f} ms")
    finally:
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _need_words(arch: ModelArch, variant: Variant, batch: int, context: int) -> str:
    kv, work = cache_bytes(arch, variant, batch, context), working_bytes(arch, variant, batch, context)
    return f"{kv / GIB:.1f} GiB of KV cache and {work / GIB:.1f} GiB of working buffers"


def fit_all(result: BenchResult) -> list[BenchFit]:
    """Lines per (variant, batch), with slope ratio and break-even against BF16 of the same batch."""
    fits: list[BenchFit] = []
    keys = {v.name: v.key for v in result.variants}
    for batch in result.batches:
        lines = {}
        for v in result.variants:
            pts = [p for p in result.points if p.variant == v.name and p.batch == batch]
            if len(pts) >= 2:
                lines[v.name] = fit_line([p.context_tokens for p in pts], [p.itl_ms for p in pts])
        base = lines.get(result.variants[0].name) if result.variants else None
        for name, line in lines.items():
            is_base = name == result.variants[0].name
            ratio = None if is_base or base is None else line.slope_ms_per_token / base.slope_ms_per_token
            be = None if is_base or base is None else break_even_tokens(base, line)
            problems = fit_problems(line, len({p.context_tokens for p in result.points
                                               if p.variant == name and p.batch == batch}))
            fits.append(BenchFit(variant=name, key=keys[name], batch=batch,
                                 slope_ms_per_token=line.slope_ms_per_token, intercept_ms=line.intercept_ms,
                                 r2=round(line.r2, 5), slope_ratio=None if ratio is None else round(ratio, 4),
                                 break_even_tokens=None if be is None else round(be), problems=problems))
    return fits


def fit_warnings(fits: list[BenchFit]) -> list[str]:
    """One warning per meaningless line: its slope, ratio and break-even are not results."""
    return [f"{f.variant} batch {f.batch}: the fit is meaningless ({'; '.join(f.problems)}); its slope, slope ratio "
            "and break-even are not results. Measure more contexts (e.g. --contexts 1k..128k) on a GPU."
            for f in fits if f.problems]


GIB = 2**30
SPLIT_PARTIALS_MAX = 128
"""Most splits per sequence any decode kernel here takes (`launch.split_count`): bounds the partial outputs."""


def working_bytes(arch: ModelArch, variant: Variant, batch: int, max_context: int) -> int:
    """GPU bytes beside the caches, at their peak: the fill's scratch K/V (bf16 draws of `FILL_CHUNK_TOKENS`
    positions per shape, each copied once when cut to a layer's range, and their slots), and one step's split-KV
    partial outputs and log-sum-exps for every attending layer (a captured graph keeps them all)."""
    from kvpolicy.runtime.step import FILL_CHUNK_TOKENS

    plans = plan_layers(arch, variant)
    tokens = batch * min(FILL_CHUNK_TOKENS, max_context)
    shapes = {(p.num_kv_heads, p.head_dim) for p in plans if p.has_cache}
    fill = sum(2 * 2 * tokens * h * d * 2 for h, d in shapes) + 2 * tokens * 8
    partials = sum(batch * p.num_q_heads * SPLIT_PARTIALS_MAX * (p.head_dim + 1) * 4 for p in plans if p.attends)
    return fill + partials


def largest_fit(arch: ModelArch, variant: Variant, batch: int, context: int, usable: int) -> tuple[int, int]:
    """(longest context at `batch`, largest batch at `context`) whose caches and working buffers fit `usable`
    bytes: 0 where none does. Contexts in whole pages."""
    def need(b: int, c: int) -> int:
        return cache_bytes(arch, variant, b, c) + working_bytes(arch, variant, b, c)

    lo, hi = 0, context // BLOCK_SIZE
    while lo < hi:  # the most pages at this batch
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(batch, mid * BLOCK_SIZE) <= usable else (lo, mid - 1)
    best_context = lo * BLOCK_SIZE
    best_batch = 0
    while best_batch < batch and need(best_batch + 1, context) <= usable:
        best_batch += 1
    return best_context, best_batch


def usable_bytes(free: int) -> int:
    """Bytes of `free` GPU memory the caches and working buffers may take."""
    return int(free * (1 - MEMORY_RESERVE_SHARE) - MEMORY_RESERVE_GIB * GIB)


def memory_refusal(arch: ModelArch, variant: Variant, batch: int, context: int, free: int) -> str | None:
    """Why `variant` at `batch` x `context` does not fit `free` bytes of GPU memory (None when it does): what the
    caches and the working buffers need, the share of free memory the runtime takes, and the largest batch and
    context that fit."""
    kv = cache_bytes(arch, variant, batch, context)
    work = working_bytes(arch, variant, batch, context)
    usable = usable_bytes(free)
    if kv + work <= usable:
        return None
    fit_context, fit_batch = largest_fit(arch, variant, batch, context, usable)
    fits = [f"{fit_context:,} tokens at batch {batch}" if fit_context else f"nothing at batch {batch}"]
    if fit_batch:
        fits.append(f"batch {fit_batch} at {context:,} tokens")
    return (f"{variant.name} at batch {batch} and {context:,} tokens needs {(kv + work) / GIB:.1f} GiB: "
            f"{kv / GIB:.1f} GiB of KV cache and {work / GIB:.1f} GiB of working buffers (fill scratch, split-KV "
            f"partials); of the {free / GIB:.1f} GiB free, {usable / GIB:.1f} GiB are usable ({MEMORY_RESERVE_GIB:g} GiB "
            f"+ {MEMORY_RESERVE_SHARE:.0%} stay with the allocator and the kernels' workspaces). What fits: "
            f"{' or '.join(fits)}. Use a smaller --batch or a shorter longest --contexts.")


def _check_memory(arch: ModelArch, variant: Variant, batch: int, context: int, device: torch.device) -> None:
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    why = memory_refusal(arch, variant, batch, context, free)
    if why:
        raise InputError(why)


def _span(indices: list[int]) -> str:
    return f"{indices[0]}-{indices[-1]}" if len(indices) > 2 else ", ".join(map(str, indices))
