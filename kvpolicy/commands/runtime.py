"""`kvpolicy bench` and `kvpolicy verify`: the embedded runtime on the user's GPU (or the CPU references).

Nothing heavy is imported here: torch, triton and transformers load inside
`run`, through `kvpolicy.runtime`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpolicy.commands.common import bounded_int, positive_int, unit_float
from kvpolicy.errors import InputError

GPU_CONTEXTS = {"bench": "1k..128k", "verify": "4k..128k"}
"""Default --contexts on a GPU (the documents' range)."""
CPU_CONTEXTS = {"bench": "256..1k", "verify": "512..2k"}
"""Default --contexts on the CPU: the torch references on small shapes."""
MAX_BATCH = 1024
"""Largest batch bench and verify run."""
MAX_TOKENS_IN_FLIGHT = {"triton": 1 << 24, "torch": 1 << 20}
"""Most tokens (batch x longest context) one run holds in its caches, by backend: beyond this the
synthetic K/V alone would exhaust GPU (or, for the torch references, host) memory."""


CPU_DEFAULT_GPU = "h100"
"""The decision's GPU when --gpu is left out on a machine without one (a CPU run only tries the flow out)."""


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """Options of bench / verify."""
    parser.add_argument("--model", "-m", required=True,
                        help="catalog id (llama-3.1-8b), HF id, or a local model folder / config.json "
                             "(verify: a folder with weights adds the model-level check)")
    parser.add_argument("--gpu", "-g", default=None,
                        help="GPU the decision is for (h100, h200, 2xh100 for tensor-parallel 2...), or `auto` to "
                             "detect the local one; default: "
                             f"the local GPU, or {CPU_DEFAULT_GPU} when there is none (the run then uses the torch "
                             "references on the CPU)")
    parser.add_argument("--policy", "-p", default=None, help="policy file (default builtin:default)")
    parser.add_argument("--contexts", default=None,
                        help=f"context lengths: `1k..128k` (doubling) or a list `4k,32k,128k` (default "
                             f"{GPU_CONTEXTS[name]} on a GPU, {CPU_CONTEXTS[name]} on the CPU)")
    parser.add_argument("--compare", action="append", default=[], metavar="VARIANTS",
                        help="more variants beside BF16 and the decision, comma separated: fp8, "
                             "fp8_skip_sliding, turboquant_4bit_nc, ...; FP8 modifiers +one_level, +per_head, "
                             "+per_tensor (e.g. fp8+one_level)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="auto (default): the Triton kernels on CUDA when present, else the torch references")
    parser.add_argument("--out", "-o", default="kvpolicy-results", help="folder for the JSON (and PNG) results")
    parser.add_argument("--format", "-f", choices=["table", "json"], default="table", help="what to print")
    parser.add_argument("--seed", type=bounded_int("--seed", 0, 2**32 - 1), default=0,
                        help="random seed of the synthetic K/V (default 0)")
    what = ("slopes and break-even into this policy file as evidence for this model and GPU (GPU runs only)"
            if name == "bench" else "needle recoveries (per dtype and context; GPU runs only) and model-level figures "
            "(from the GPU or the CPU) into this policy file as evidence for this model")
    parser.add_argument("--record", metavar="FILE", default=None,
                        help=f"write the measured {what} (created, extending builtin:default, when missing)")
    if name == "bench":
        parser.add_argument("--batch", "-b", default="1",
                            help="batch sizes, comma separated (default 1: the documents' single request)")
        parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
        parser.epilog = ("Example: kvpolicy bench --model llama-3.1-8b --contexts 1k..128k --record "
                         "policies/measured.yaml\n         kvpolicy recommend -m llama-3.1-8b -g auto "
                         "--policy policies/measured.yaml")
    else:
        parser.add_argument("--batch", "-b", type=positive_int("--batch", MAX_BATCH), default=None,
                            help="sequences per context (default: as many as --trials needs)")
        parser.add_argument("--trials", type=positive_int("--trials", 1_000_000), default=None,
                            help="needle trials per context and layer geometry (sequences x query heads; default: "
                                 "enough for a 95%% interval to decide a format 3 points from the floor, 207 at 95%%)")
        parser.add_argument("--accuracy-floor", type=unit_float("--accuracy-floor"), default=None,
                            help="recovery below this fails (default: the policy's, 0.95)")
        parser.add_argument("--text", type=Path, default=None,
                            help="text for the model-level check (needs a tokenizer in the model folder)")
        parser.add_argument("--tokens", type=positive_int("--tokens", 1 << 20), default=None,
                            help="tokens of text for the model-level check (default 512; the text defaults to Python's "
                                 "pydoc help topics)")
        parser.add_argument("--retrieval", type=bounded_int("--retrieval", 0, 10_000), default=None,
                            metavar="N",
                            help="prompts per context of the model-level retrieval test (a passcode planted in real "
                                 "text, asked at the end; contexts up to 32k; default 10 on a GPU, 0 = off on the CPU, "
                                 "where each prompt is a float64 pass)")
        parser.epilog = "Example: kvpolicy verify --model gpt-oss-20b --compare turboquant_4bit_nc"
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def parse_contexts(text: str) -> list[int]:
    """`1k..128k` -> 1024, 2048, ..., 131072; `4k,32k` -> 4096, 32768; both forms mix."""
    from kvpolicy.inputs.workload import parse_tokens

    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if ".." in part:
            lo_text, hi_text = part.split("..", 1)
            lo, hi = parse_tokens(lo_text, "--contexts"), parse_tokens(hi_text, "--contexts")
            if lo > hi:
                raise InputError(f"--contexts `{part}`: the range runs from {lo} down to {hi}; write it low..high.")
            x = lo
            while x < hi:
                out.append(x)
                x *= 2
            out.append(hi)
        else:
            out.append(parse_tokens(part, "--contexts"))
    if not out:
        raise InputError("--contexts: no context given; write e.g. 1k..128k or 4k,32k,128k.")
    return sorted(set(out))


def parse_batches(text: str) -> list[int]:
    """`1,8` -> [1, 8]."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()] if len(text) <= 200 else []
    except ValueError:
        raise InputError(f"--batch `{text}`: write whole numbers separated by commas, e.g. 1,8.") from None
    if not values or any(not 0 < v <= MAX_BATCH for v in values):
        raise InputError(f"--batch `{text}`: batch sizes must be in 1..{MAX_BATCH}, e.g. 1,8.")
    return sorted(set(values))


def _resolve(args: argparse.Namespace, longest: int) -> tuple[Any, Any, Any, Any]:
    """(arch, gpu, loaded policy, recommendation at the longest context)."""
    import torch

    from kvpolicy.inputs.catalog import gpu_and_count, resolve_gpu, resolve_model
    from kvpolicy.inputs.workload import make_workload
    from kvpolicy.outputs.recommend import recommend
    from kvpolicy.rules.validate import load_policy

    loaded = load_policy(args.policy)
    arch = resolve_model(args.model)
    tp = 1
    if args.gpu in (None, "auto") and args.device != "cpu" and torch.cuda.is_available():
        gpu = resolve_gpu(torch.cuda.get_device_name(0), where="--gpu auto")
    elif args.gpu is None:
        gpu = resolve_gpu(CPU_DEFAULT_GPU)
        sys.stderr.write(f"kvpolicy {args.command}: no GPU in use and no --gpu: deciding for {CPU_DEFAULT_GPU}, run "
                         "with the torch references on the CPU (pass --gpu to decide for another GPU).\n")
    else:
        # 2xh100 decides for two GPUs (tensor-parallel 2); the kernels still run on one.
        gpu, tp = gpu_and_count(args.gpu, None)
    floor = getattr(args, "accuracy_floor", None)
    workload = make_workload(loaded, context=longest, tp=tp, accuracy_floor=floor)
    return arch, gpu, loaded, recommend(arch, gpu, workload, loaded)


def _progress(total: int, label: str) -> Any:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    progress = Progress(SpinnerColumn(), TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TextColumn("{task.description}"),
                        console=Console(stderr=True), transient=True)
    return progress


def run(args: argparse.Namespace) -> int:
    """Run bench or verify."""
    from kvpolicy.runtime.step import pick_backend

    device, backend = pick_backend(args.device)
    default = (GPU_CONTEXTS if backend == "triton" else CPU_CONTEXTS)[args.command]
    contexts = parse_contexts(args.contexts if args.contexts is not None else default)
    batches = parse_batches(args.batch) if args.command == "bench" else [args.batch or 1]
    limit = MAX_TOKENS_IN_FLIGHT.get(backend, MAX_TOKENS_IN_FLIGHT["torch"])
    if max(batches) * max(contexts) > limit:
        raise InputError(f"--batch {max(batches)} x --contexts {max(contexts):,} = {max(batches) * max(contexts):,} "
                         f"tokens in the cache; at most {limit:,} on this backend ({backend}). Lower one of them.")
    _check_outputs(args)
    arch, gpu, loaded, rec = _resolve(args, max(contexts))
    if args.record:
        model_level = args.command == "verify" and _model_source(args, backend) is not None
        _check_record_target(args.command, device, backend, gpu, model_level)
    compare = [c for item in args.compare for c in item.split(",")]
    out_dir = Path(args.out)
    from kvpolicy.runtime.ops import trusted_indices

    # The runtime builds every block table and slot itself: the kernels' range checks would add a host sync
    # to each eager call and time it.
    with trusted_indices():
        if args.command == "bench":
            return _bench(args, arch, gpu, loaded, rec, contexts, compare, device, backend, out_dir)
        return _verify(args, arch, gpu, loaded, rec, contexts, compare, device, backend, out_dir)


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse unwritable outputs before a run of minutes, not after it."""
    import os

    from kvpolicy.inputs.safeio import check_writable

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: is a file; --out names the folder results go in.")
    existing = out if out.is_dir() else next((p for p in out.parents if p.is_dir()), Path("."))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}: {existing} is not writable; choose another folder.")
    for path in out.glob(f"{args.command}-*") if out.is_dir() else []:
        if path.is_symlink():
            raise InputError(f"{path} is a symbolic link; kvpolicy never writes through one. Remove it.")
    record = getattr(args, "record", None)
    if record:
        check_writable(record, force=True, what="--record policy file")
    text = getattr(args, "text", None)
    if text is not None:
        from kvpolicy.inputs.safeio import MAX_TEXT_BYTES, read_bytes

        read_bytes(text, what="--text", max_bytes=MAX_TEXT_BYTES)  # refused now, not after the run


def _bench(args: argparse.Namespace, arch: Any, gpu: Any, loaded: Any, rec: Any, contexts: list[int],
           compare: list[str], device: Any, backend: str, out_dir: Path) -> int:
    from kvpolicy.inputs.safeio import write_text
    from kvpolicy.runtime.bench import run_bench
    from kvpolicy.runtime.plot import INSTALL_HINT, have_matplotlib, plot_bench
    from kvpolicy.runtime.variants import cache_layout, variant_list

    batches = parse_batches(args.batch)
    # The engine's break-even facts read the fp8 (and, with sliding layers, fp8_skip_sliding) lines of a
    # model's ITL evidence: always measure those, so that --record can feed them.
    facts_variants = ["fp8", "fp8_skip_sliding"] if arch.count("sliding") else ["fp8"]
    variants = variant_list(rec.decision, [*compare, *facts_variants], cache_layout(rec.decision, gpu.generation))
    record = Path(args.record) if args.record else None
    total = len(variants) * len(batches) * len(contexts)
    with _progress(total, "bench") as progress:
        task = progress.add_task("", total=total)

        def step(desc: str) -> None:
            progress.update(task, advance=1, description=desc)

        result = run_bench(arch, gpu, rec.decision, variants, contexts, batches, device, backend,
                           policy_label=loaded.label, on_point=step, seed=args.seed)
    stem = f"bench-{arch.id}-{gpu.id}"
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{stem}.json"
    notes = []
    png_path = None
    if not args.no_plot:
        if have_matplotlib():
            png_path = out_dir / f"{stem}.png"
            plot_bench(result, png_path)
        else:
            notes.append(f"no plot: {INSTALL_HINT}")
    recorded = None
    write_text(json_path, result.model_dump_json(indent=2) + "\n", force=True, what="results file")
    if record is not None:
        from kvpolicy.runtime.record import record_bench

        recorded = record_bench(result, record)
    if args.format == "json":
        print(result.model_dump_json(indent=2))
    else:
        _print_bench(result)
    err = sys.stderr
    err.write(f"JSON: {json_path}\n" + (f"plot: {png_path}\n" if png_path else ""))
    for n in notes:
        err.write(n + "\n")
    if recorded:
        err.write(f"recorded evidence `{recorded}` in {record}: `kvpolicy recommend --model {arch.id} --gpu "
                  f"{gpu.id} --policy {record}` now uses these numbers.\n")
    return 0


def _check_record_target(command: str, device: Any, backend: str, gpu: Any, model_level: bool = False) -> None:
    """Before any measurement: --record needs the kernels on the GPU the evidence names, except for a verify's
    model-level figures, which the CPU references measure for the model on any GPU (record.py says why)."""
    if backend != "triton" and model_level:
        sys.stderr.write("kvpolicy verify: note: on the CPU --record writes the model-level figures only (for this "
                         "model on any GPU: the formats' exact rounding); the needle recoveries need the kernels on "
                         "the GPU.\n")
        return
    if backend != "triton":
        raise InputError(f"--record: this {command} would run the CPU torch references, not the kernels on `{gpu.id}`; "
                         "their " + ("timings" if command == "bench" else "accuracy (the exact float64 answer)")
                         + " say nothing about that GPU, and recorded evidence is what `recommend` treats as measured "
                         "there. Run it on the GPU (--device cuda), or drop --record; nothing was recorded."
                         + (" (A verify of a local model folder or .gguf file with weights records its model-level "
                            "figures from the CPU too.)" if command == "verify" else ""))
    import torch

    from kvpolicy.inputs.catalog import resolve_gpu

    here = resolve_gpu(torch.cuda.get_device_name(device), where="the local GPU")
    if here.id != gpu.id:
        raise InputError(f"--record: this run measures {here.name} (`{here.id}`), but --gpu names `{gpu.id}`; "
                         "evidence must name the GPU it was measured on. Use --gpu auto.")


def _print_bench(result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    env = result.environment
    layouts = {v.cache_layout for v in result.variants}
    pages = " on HND pages (FlashInfer's layout)" if layouts == {"HND"} else ""
    gluon = [v.name for v in result.variants if "gluon" in v.layer_paths]
    fp8_gl = [n for n in gluon if not n.startswith("turboquant")]
    tq_gl = [n for n in gluon if n.startswith("turboquant")]
    # Which kernel ran matters to anyone comparing with vLLM: on Hopper, FP8 layers run the Gluon kernel
    # with an e4m3 query (FA3's FP8 numerics), and TurboQuant layers the Gluon kernel on
    # planar pages, not the Triton ones.
    kernels = f"; FP8 layers of {', '.join(fp8_gl)} on the Gluon kernel (e4m3 query)" if fp8_gl else ""
    kernels += f"; TurboQuant layers of {', '.join(tq_gl)} on the Gluon kernel (planar pages)" if tq_gl else ""
    console.print(f"[bold]{result.model}[/] on [bold]{env.device}[/] ({env.backend}); decision "
                  f"[bold]{result.decision.kv_cache_dtype}[/] skip {result.decision.skip_layers or '[]'}; "
                  f"{result.timing}{pages}{kernels}")
    table = Table(title="ITL = slope x context + intercept (decode-step attention, all layers)")
    for col in ("variant", "batch", "slope ms/token", "intercept ms", "slope vs BF16", "break-even tokens", "r2"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for f in result.fits:
        be = "-" if f.slope_ratio is None else ("never" if f.break_even_tokens is None else f"{f.break_even_tokens:,.0f}")
        if f.problems:  # the warnings below say why
            be = "no fit" if f.slope_ratio is not None else be
        table.add_row(f.variant, str(f.batch), f"{f.slope_ms_per_token:.3e}", f"{f.intercept_ms:.4f}",
                      "-" if f.slope_ratio is None else f"{f.slope_ratio:.1%}", be,
                      f"{f.r2:.4f}" + (" (!)" if f.problems else ""))
    console.print(table)
    for w in result.warnings:
        console.print(f"[yellow]warning:[/] {w}")


def _verify(args: argparse.Namespace, arch: Any, gpu: Any, loaded: Any, rec: Any, contexts: list[int],
            compare: list[str], device: Any, backend: str, out_dir: Path) -> int:
    from kvpolicy.formats import FORMATS
    from kvpolicy.inputs.safeio import write_text
    from kvpolicy.runtime.variants import cache_layout, variant_list
    from kvpolicy.runtime.verify import run_verify, with_calibrated_twins

    # One run per distinct (format, switches); skip-sliding variants differ only where there are sliding layers.
    sliding = bool(arch.count("sliding"))
    variants, seen = [], set()
    for v in with_calibrated_twins(variant_list(rec.decision, compare, cache_layout(rec.decision, gpu.generation))):
        key = (v.kv_cache_dtype, v.two_level, v.scale_source, v.skip_layers if sliding else ())
        if key not in seen:
            seen.add(key)
            variants.append(v)
    self_compare = None
    if all(FORMATS[v.kv_cache_dtype].kind == "bf16" for v in variants):
        # The decision is BF16 at these contexts (always so at the CPU's short defaults): no verdict can come.
        self_compare = (f"the decision for {arch.id} on {gpu.id} at {max(contexts):,} tokens is BF16 "
                        f"(kv-cache-dtype {rec.decision.kv_cache_dtype}), so this run compares BF16 with itself and "
                        "gives no verdict. Add --compare fp8 (or turboquant_4bit_nc, ...) to test a quantized format.")
        sys.stderr.write(f"kvpolicy verify: note: {self_compare}\n")
    from kvpolicy.runtime.needle import geometry_plans

    source = _model_source(args, backend)
    total = len(variants) * sum(len({min(c, g.window) if g.window else c for c in contexts})
                                for g in geometry_plans(arch))
    retrieval = 0
    if source is not None:
        total += len(variants) * (1 if backend == "reference" else 2) + 2  # load, own attention, the variants
        retrieval = args.retrieval if args.retrieval is not None else (10 if backend == "triton" else 0)
        total += len(variants) * len(contexts) if retrieval else 0
    with _progress(total, "verify") as progress:
        task = progress.add_task("", total=total)

        def step(desc: str) -> None:
            progress.update(task, advance=1, description=desc)

        result = run_verify(arch, gpu, rec.decision, variants, contexts, args.batch, device, backend,
                            accuracy_floor=rec.workload.accuracy_floor, policy_label=loaded.label,
                            on_point=step, seed=args.seed, trials=args.trials)
        _model_check(args, arch, variants, device, backend, result, source, loaded, step, contexts, retrieval)
    if self_compare:
        result.warnings.append(self_compare)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"verify-{arch.id}-{gpu.id}.json"
    write_text(json_path, result.model_dump_json(indent=2) + "\n", force=True, what="results file")
    recorded = None
    if args.record:
        from kvpolicy.runtime.record import record_verify

        recorded = record_verify(result, Path(args.record))
    if args.format == "json":
        print(result.model_dump_json(indent=2))
    else:
        _print_verify(result)
    sys.stderr.write(f"JSON: {json_path}\n")
    if recorded:
        model_ref = args.model if Path(args.model).expanduser().exists() else arch.id
        sys.stderr.write(f"recorded evidence {', '.join(f'`{r}`' for r in recorded)} in {args.record}: `kvpolicy "
                         f"recommend --model {model_ref} --gpu {gpu.id} --policy {args.record}` now uses these "
                         "figures.\n")
    return 0


def _model_source(args: argparse.Namespace, backend: str) -> Path | None:
    """The folder or .gguf file the model-level check loads (None: no weights, or no transformers)."""
    from kvpolicy.runtime.hfcheck import has_weights

    path = Path(args.model).expanduser()
    if path.is_file() and path.suffix.lower() != ".gguf":
        path = path.parent
    if not has_weights(path):
        return None
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    return path


def _model_check(args: argparse.Namespace, arch: Any, variants: list[Any], device: Any, backend: str,
                 result: Any, source: Path | None, loaded: Any, step: Any, contexts: list[int],
                 retrieval: int) -> None:
    from kvpolicy.runtime.hfcheck import has_weights

    if source is None:
        path = Path(args.model).expanduser()
        result.model_check_note = (
            "skipped: transformers is not installed (pip install transformers)" if has_weights(path) else
            "skipped: --model is not a local Hugging Face folder with weights or a .gguf file (pass one, with "
            "transformers installed, for next-token agreement, KL and perplexity)")
        return
    from kvpolicy.runtime.hfcheck import run_model_check
    from kvpolicy.runtime.verify import (
        KERNEL_KL_RATIO_MAX,
        model_thresholds,
        model_verdicts,
    )

    tokens = args.tokens or 512
    checks, note, points, retrieval_note = run_model_check(
        source, arch, list(variants), device, backend, args.text, tokens, args.seed, on_step=step,
        retrieval_contexts=contexts, retrieval_trials=retrieval)
    result.model_check = checks
    result.model_check_note = note
    result.retrieval = points
    if not retrieval:
        retrieval_note = ("off: --retrieval N runs N prompts per context" + (
            " (off by default on the CPU, where each prompt is a float64 pass)" if backend == "reference" else ""))
    result.retrieval_note = retrieval_note
    for c in checks[1:]:
        if c.kernel_kl_ratio is not None and c.kernel_kl_ratio > KERNEL_KL_RATIO_MAX:
            result.warnings.append(
                f"{c.variant}: the kernels' mean KL ({c.kl_mean:.3g}) is {c.kernel_kl_ratio:.2f}x the float64 "
                f"references' ({c.reference_kl_mean:.3g}), above {KERNEL_KL_RATIO_MAX}x: the kernels add error of "
                "their own to the format's.")
    result.model_thresholds = model_thresholds(loaded.policy)
    result.verdicts = model_verdicts(checks, result.verdicts, variants, result.model_thresholds)


def _needle_cell(p: Any) -> str:
    if p.recovery is None:
        return f"{p.hits}/{p.trials}"
    if p.recovery_low is None:
        return f"{p.recovery:.1%} ({p.hits}/{p.trials}) err {p.out_rel_error:.1e}"
    return (f"{p.recovery:.1%} [{p.recovery_low:.1%}, {p.recovery_high:.1%}] ({p.kept}/{p.bf16_hits}) "
            f"err {p.out_rel_error:.1e}")


def _retrieval_cell(p: Any) -> str:
    if p.bf16_hits is None:
        return f"{p.hits}/{p.trials} hit"
    if p.recovery is None:
        return f"BF16 hit none ({p.hits}/{p.trials})"
    return f"{p.recovery:.0%} [{p.recovery_low:.0%}, {p.recovery_high:.0%}] ({p.kept}/{p.bf16_hits})"


def _context_table(title: str, points: list[Any], cell: Callable[[Any], str]) -> Any:
    """A rich table of hit-or-miss points: a row per variant, a column per context, `cell` of each point."""
    from rich.table import Table

    contexts = sorted({p.context_tokens for p in points})
    table = Table(title=title)
    table.add_column("variant")
    for c in contexts:
        table.add_column(f"{c // 1024}k" if c % 1024 == 0 else str(c), justify="right")
    at = {(p.variant, p.context_tokens): p for p in points}
    for name in dict.fromkeys(p.variant for p in points):
        table.add_row(name, *("-" if (name, c) not in at else cell(at[name, c]) for c in contexts))
    return table


def _print_verify(result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    env, g = result.environment, result.geometry
    labels = [str(x.get("label", "")) for x in result.geometries] or [""]
    geo_text = "; ".join(labels) if labels != [""] else (
        f"layer {g['layer']} ({g['kind']}, {g['num_q_heads']} query heads, {g['num_kv_heads']} KV heads, "
        f"head_dim {g['head_dim']})")
    asked = result.trials_per_context or result.batch
    ran = sorted({p.trials for p in result.points})  # whole sequences: one trial per sequence and query head
    trials = "/".join(map(str, ran)) if ran else str(asked)
    plural = "s" * (trials != "1")
    extra = f" ({asked} asked; each sequence gives one per query head)" if ran and ran != [asked] else ""
    console.print(f"[bold]{result.model}[/] needle test on [bold]{env.device}[/] ({env.backend}): {geo_text}; "
                  f"{trials} trial{plural} per context{extra}")
    for label in labels:
        points = [p for p in result.points if p.geometry == label or label == ""]
        console.print(_context_table("needle recovery vs BF16 [95% interval] (kept / BF16 hits; output error vs "
                                     "float64)" + (f": {label}" if label else ""), points, _needle_cell))
    colors = {"pass": "green", "calibrate": "yellow", "keep_bf16": "red", "undecided": "magenta",
              "not_applicable": "dim"}
    if result.model_check:
        t = Table(title="model-level check vs the BF16 cache: top-1 agreement [95% interval], KL (nats), perplexity")
        twin = any(m.reference_kl_mean is not None for m in result.model_check)
        cols = ["variant", "tokens", "agreement", "KL mean", "KL p99", "KL max", "perplexity"]
        cols += ["float64 ref: agreement", "KL mean", "kernel / ref KL"] if twin else []
        for col in cols:
            t.add_column(col, justify="left" if col == "variant" else "right")
        for m in result.model_check:
            agree = f"{m.agreement:.1%}" + (f" [{m.agreement_low:.1%}, {m.agreement_high:.1%}]"
                                            if m.agreement_low is not None else "")
            row = [m.variant, str(m.tokens), agree, f"{m.kl_mean:.3g}",
                   "-" if m.kl_p99 is None else f"{m.kl_p99:.3g}", f"{m.kl_max:.3g}",
                   "-" if m.ppl_delta is None else f"{m.ppl_delta:+.2%}"]
            if twin:
                row += ["-" if m.reference_agreement is None else f"{m.reference_agreement:.1%}",
                        "-" if m.reference_kl_mean is None else f"{m.reference_kl_mean:.3g}",
                        "-" if m.kernel_kl_ratio is None else f"{m.kernel_kl_ratio:.2f}x"]
            t.add_row(*row)
        console.print(t)
    console.print(f"model-level check: {result.model_check_note}")
    if result.retrieval:
        console.print(_context_table("model-level retrieval in real text: recovery vs BF16 [95% interval] "
                                     "(kept / BF16 hits)", result.retrieval, _retrieval_cell))
    if result.retrieval_note:
        console.print(f"retrieval: {result.retrieval_note}")
    if result.model_thresholds is not None:
        th = result.model_thresholds
        console.print(f"verdicts from the model (policy thresholds): top-1 agreement >= {th.min_top1_agreement:.0%} "
                      f"(95% interval), mean KL <= {th.max_kl_mean:g}, p99 KL <= {th.max_kl_p99:g}, perplexity <= "
                      f"+{th.max_ppl_increase:.0%}")
    for v in result.verdicts:
        beside = f" [dim](needle test: {v.needle_verdict})[/]" if v.basis == "model" and v.needle_verdict else ""
        console.print(f"[{colors.get(v.verdict, 'white')}]{v.verdict}[/] {v.variant}: {v.reason}{beside}")
    for w in result.warnings:
        console.print(f"[yellow]warning:[/] {w}")
