"""`bench --record FILE` and `verify --record FILE`: write measured ITL lines, or needle recoveries, into a
policy file as evidence.

The entry is an ordinary `evidence:` item with an `itl:` block for the model and
GPU measured, so `--policy FILE` makes the estimates label slope ratio and
break-even *measured* and the engine's `latency.*_break_even_tokens` facts (and
with them the dtype rules' thresholds) follow the user's GPU. An existing file
is updated through `yamlio.update_yaml_file` (comments, order, quoting and
indentation kept; written atomically) after the result validates as a policy;
a missing file becomes a small policy that extends the built-in one.

`verify --record` writes `recovery:` figures scoped to the model and GPU measured, which the accuracy
estimate (and the rules reading it) then use for that deployment ahead of the studies' figures, and, when the
model-level check ran, its next-token figures (`model_check:`) for that model. Needle recoveries and bench
timings are never recorded from a run of the CPU references: their timings say nothing about a GPU, and the
needle's accuracy is the exact float64 answer, not what a GPU kernel computes (one-level accumulation, e4m3
rounding of P), on synthetic heads where that difference is the point. Model-level figures from the CPU are
recorded, scoped to the model and no GPU: they are the format's exact rounding of this model's own K/V, which
every GPU stores alike; the kernels can only add error to it, so a failing CPU figure fails on any GPU, and a
figure measured through the kernels on the GPU takes precedence over it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpolicy.errors import InputError, PolicyError
from kvpolicy.runtime.results import BenchFit, BenchResult, Environment

if TYPE_CHECKING:
    from kvpolicy.runtime.verify import VerifyResult

MIN_RECORDED_RECOVERY = 0.001
"""A recovery of 0 (the format lost every needle) is recorded as this: the evidence schema takes values > 0."""

NEW_POLICY = """\
# Measured evidence, written by `kvpolicy bench --record` (decode latency) and
# `kvpolicy verify --record` (needle recovery, model-level figures). Use it with
# `kvpolicy recommend --policy {name}`: for a model and GPU measured here (a model
# alone for model-level figures from the CPU), the slope ratio, break-even and
# accuracy estimates are labelled measured, and the rules' facts follow these
# numbers instead of the studies'.
version: 1
name: measured-itl
description: Built-in policy plus ITL lines and accuracy measured on our own GPUs.
extends: builtin:default
"""


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", s.lower()).strip("-.") or "x"


def evidence_id(model: str, gpu: str) -> str:
    """Evidence id of a recorded bench: `bench-itl-<model>-<gpu>`."""
    return f"bench-itl-{_slug(model)}-{_slug(gpu)}"


def verify_evidence_id(model: str, gpu: str) -> str:
    """Evidence id of a recorded verify: `verify-needle-<model>-<gpu>`."""
    return f"verify-needle-{_slug(model)}-{_slug(gpu)}"


def model_evidence_id(model: str, gpu: str | None) -> str:
    """Evidence id of recorded model-level figures: `verify-model-<model>[-<gpu>]` (no GPU: the CPU references)."""
    return f"verify-model-{_slug(model)}" + (f"-{_slug(gpu)}" if gpu else "")


def refuse_reference_run(env: Environment, command: str, gpu: str) -> None:
    """InputError unless `env` ran the GPU kernels: CPU reference runs never become evidence for a GPU."""
    if env.backend != "triton":
        raise InputError(
            f"{command} --record: this run used the CPU torch references ({env.device}), not the kernels on "
            f"`{gpu}`. Their {'timings' if command.endswith('bench') else 'accuracy (the exact float64 answer)'} "
            f"say nothing about that GPU, and recorded evidence is what `recommend` treats as measured there. "
            "Run it on the GPU (--device cuda), or drop --record; nothing was recorded.")


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def recorded_fits(result: BenchResult) -> tuple[int, dict[str, BenchFit]]:
    """The batch recorded (1 when measured: the documents' single request) and one fit per evidence key."""
    batch = 1 if 1 in result.batches else min(result.batches)
    plain = {v.name for v in result.variants if v.two_level and v.scale_source == "uncalibrated"}
    fits: dict[str, BenchFit] = {}
    for preferred in (True, False):
        for f in result.fits:
            if f.batch == batch and f.key not in fits and (f.variant in plain) == preferred:
                fits[f.key] = f
    if "bf16" not in fits:
        raise InputError("--record: the bench has no BF16 line to record against.")
    flat = [f"{k} ({f.slope_ms_per_token:.3g} ms/token)" for k, f in fits.items() if f.slope_ms_per_token <= 0]
    if flat:
        raise InputError(f"--record: the fitted slope of {', '.join(flat)} is not positive: at these contexts the "
                         "timings are noise, not a line. Measure longer contexts (e.g. --contexts 1k..128k); "
                         "nothing was recorded.")
    return batch, fits


def evidence_entry(result: BenchResult) -> dict[str, Any]:
    """The evidence item (plain data) for a bench result."""
    refuse_reference_run(result.environment, "kvpolicy bench", result.gpu)
    batch, fits = recorded_fits(result)
    env = result.environment
    base = fits["bf16"]
    parts = [f"BF16 {base.slope_ms_per_token:.3g}"]
    for key, f in fits.items():
        if key != "bf16":
            parts.append(f"{key} {f.slope_ms_per_token:.3g} ({f.slope_ratio:.0%})" if f.slope_ratio is not None
                         else f"{key} {f.slope_ms_per_token:.3g}")
    intercepts = " / ".join(f"{f.intercept_ms:.3g}" for f in fits.values())
    evens = [f"{k} {f.break_even_tokens:,.0f}" if f.break_even_tokens is not None else f"{k} never"
             for k, f in fits.items() if k != "bf16"]
    statement = (f"kvpolicy bench, {result.model} geometry on {env.device}, batch {batch}, contexts "
                 f"{min(result.contexts):,}-{max(result.contexts):,}: decode-step attention slope "
                 f"{', '.join(parts)} ms/token; intercepts {intercepts} ms; break-even "
                 f"{', '.join(evens) or 'n/a'} tokens.")
    source = (f"kvpolicy bench --record, {env.date}, {env.device} ({env.backend}), kvpolicy {env.kvpolicy_version} "
              f"commit {env.commit}, torch {env.torch_version}, triton {env.triton_version or 'none'}")
    variants: dict[str, dict[str, float]] = {}
    for key, f in fits.items():
        fit: dict[str, float] = {"slope_ms_per_token": _sig(f.slope_ms_per_token), "intercept_ms": _sig(f.intercept_ms)}
        if f.break_even_tokens:
            fit["break_even_tokens"] = round(f.break_even_tokens)
        variants[key] = fit
    return {"id": evidence_id(result.model, result.gpu), "statement": statement, "source": source,
            "itl": {"model": result.model, "gpu": result.gpu, "variants": variants}}


def record_bench(result: BenchResult, path: Path) -> str:
    """Write (or replace) the bench's evidence entry in the policy file at `path`; returns the evidence id."""
    entry = evidence_entry(result)

    def mutate(doc: Any) -> None:
        from ruamel.yaml.comments import CommentedMap, CommentedSeq

        items = doc.get("evidence")
        if not isinstance(items, list):
            items = CommentedSeq()
            doc["evidence"] = items
        node = CommentedMap()
        for k in ("id", "statement", "source"):
            node[k] = entry[k]
        itl = CommentedMap(model=entry["itl"]["model"], gpu=entry["itl"]["gpu"])
        variants = CommentedMap()
        for key, fit in entry["itl"]["variants"].items():
            m = CommentedMap(fit)
            m.fa.set_flow_style()
            variants[key] = m
        itl["variants"] = variants
        node["itl"] = itl
        for i, item in enumerate(items):
            if isinstance(item, dict) and item.get("id") == entry["id"]:
                items[i] = node
                return
        items.append(node)

    update_policy_file(path, mutate)
    return entry["id"]


def verify_entry(result: VerifyResult) -> dict[str, Any]:
    """The evidence item (plain data) for a verify result: per candidate dtype (the plain variants: two-level,
    uncalibrated, what the studies' figures describe), one recovery per context measured, each the lowest
    recovery at that context or any shorter one, scoped to the model and GPU."""
    refuse_reference_run(result.environment, "kvpolicy verify", result.gpu)
    env = result.environment
    # +one_level is a diagnostic and +per_head/+per_tensor a remedy: neither is the format as vLLM runs it
    plain = {p.variant for p in result.points if "+" not in p.variant}
    recovery: list[dict[str, Any]] = []
    words = []
    for dtype, name in _plain_dtypes(result, plain):
        pts = sorted((p.context_tokens, p.recovery) for p in result.points
                     if p.variant == name and p.recovery is not None)
        low = None
        for ctx, rec in pts:
            low = rec if low is None else min(low, rec)
            recovery.append({"dtype": dtype, "value": round(max(low, MIN_RECORDED_RECOVERY), 4),
                             "max_context_tokens": ctx, "model": result.model, "gpu": result.gpu})
        if pts:
            words.append(f"{name} " + " / ".join(f"{r:.1%}" for _, r in pts))
    if not recovery:
        raise InputError("verify --record: no candidate format beside BF16 has a recovery to record (compare one, "
                         "e.g. --compare fp8).")
    ctx_words = ", ".join(f"{c:,}" for c in result.contexts)
    statement = (f"kvpolicy verify, {result.model} layer geometry on {env.device}, batch {result.batch}, needle "
                 f"recovery vs BF16 at {ctx_words} tokens: {'; '.join(words)}.")
    source = (f"kvpolicy verify --record, {env.date}, {env.device} ({env.backend}), kvpolicy {env.kvpolicy_version} "
              f"commit {env.commit}, torch {env.torch_version}, triton {env.triton_version or 'none'}")
    return {"id": verify_evidence_id(result.model, result.gpu), "statement": statement, "source": source,
            "recovery": recovery}


def model_entry(result: VerifyResult) -> dict[str, Any] | None:
    """The evidence item of the model-level check (None when it did not run): per format measured (plain and
    calibrated FP8 twins, all layers; the one-level diagnostic and skip-layer variants left out), its figures
    scoped to the model, and to the GPU when the kernels ran there."""
    from kvpolicy.formats import FORMATS
    from kvpolicy.runtime.variants import parse_variant

    env = result.environment
    gpu = result.gpu if env.backend == "triton" else None
    figures: list[dict[str, Any]] = []
    words = []
    for c in result.model_check[1:]:  # the first is BF16 against the model's own attention
        v = parse_variant(c.variant)
        if FORMATS[v.kv_cache_dtype].kind == "bf16" or not v.two_level or v.skip_layers:
            continue
        fig: dict[str, Any] = {"dtype": v.kv_cache_dtype}
        if v.scale_source != "uncalibrated":
            fig["scale_source"] = v.scale_source
        fig.update(model=result.model, **({"gpu": gpu} if gpu else {}), tokens=c.tokens, agreement=c.agreement)
        lo, hi = (c.agreement_low, c.agreement_high) if c.agreement_low is not None and c.agreement_high is not None \
            else _interval(c.agreement, c.tokens)
        fig.update(agreement_low=lo, agreement_high=hi, kl_mean=c.kl_mean)
        if c.kl_p99 is not None:
            fig["kl_p99"] = c.kl_p99
        if c.ppl_delta is not None:
            fig["ppl_delta"] = c.ppl_delta
        fig["text"] = result.model_check_note
        figures.append(fig)
        words.append(f"{c.variant} {c.agreement:.1%} [{lo:.1%}, {hi:.1%}], mean KL {c.kl_mean:.3g}"
                     + (f", p99 KL {c.kl_p99:.3g}" if c.kl_p99 is not None else "")
                     + (f", perplexity {c.ppl_delta:+.1%}" if c.ppl_delta is not None else ""))
    if not figures:
        return None
    path = (f"kvpolicy's kernels on {env.device}" if gpu else
            "the float64 CPU references (the formats' exact rounding; valid for the model on any GPU)")
    statement = (f"kvpolicy verify, model-level check of {result.model} through {path} ({result.model_check_note}): "
                 f"next-token figures vs the BF16 cache, top-1 agreement [95% interval]: {'; '.join(words)}.")
    source = (f"kvpolicy verify --record, {env.date}, {env.device} ({env.backend}), kvpolicy {env.kvpolicy_version} "
              f"commit {env.commit}, torch {env.torch_version}, triton {env.triton_version or 'none'}")
    return {"id": model_evidence_id(result.model, gpu), "statement": statement, "source": source,
            "model_check": figures}


def _interval(agreement: float, tokens: int) -> tuple[float, float]:
    from kvpolicy.runtime.confidence import wilson

    lo, hi = wilson(round(agreement * tokens), tokens)
    return round(min(lo, agreement), 4), round(max(hi, agreement), 4)


def _plain_dtypes(result: VerifyResult, plain: set[str]) -> list[tuple[str, str]]:
    """(vLLM dtype, variant name) of the plain candidates, BF16 left out."""
    from kvpolicy.formats import FORMATS
    from kvpolicy.runtime.variants import parse_variant

    out = []
    for name in dict.fromkeys(p.variant for p in result.points):
        if name not in plain:
            continue
        v = parse_variant(name)
        if FORMATS[v.kv_cache_dtype].kind != "bf16":
            out.append((v.kv_cache_dtype, name))
    return out


def verify_entries(result: VerifyResult) -> list[dict[str, Any]]:
    """The evidence items a verify records: the needle recoveries (kernels on the GPU only) and the model-level
    figures (when that check ran, on the GPU or the CPU)."""
    entries = []
    model = model_entry(result)
    plain = {name for _, name in _plain_dtypes(result, {p.variant for p in result.points if "+" not in p.variant})}
    measured = any(p.recovery is not None and p.variant in plain for p in result.points)
    if model is None or (result.environment.backend == "triton" and measured):
        entries.append(verify_entry(result))  # refuses a CPU run, or one with nothing to record
    if model is not None:
        entries.append(model)
    return entries


def record_verify(result: VerifyResult, path: Path) -> list[str]:
    """Write (or replace) the verify's evidence in the policy file at `path`; returns the evidence ids."""
    entries = verify_entries(result)

    def mutate(doc: Any) -> None:
        from ruamel.yaml.comments import CommentedMap, CommentedSeq

        items = doc.get("evidence")
        if not isinstance(items, list):
            items = CommentedSeq()
            doc["evidence"] = items
        for entry in entries:
            node = CommentedMap()
            for k in ("id", "statement", "source"):
                node[k] = entry[k]
            for key in ("recovery", "model_check"):
                if key in entry:
                    rows = CommentedSeq()
                    for r in entry[key]:
                        m = CommentedMap(r)
                        m.fa.set_flow_style()
                        rows.append(m)
                    node[key] = rows
            for i, item in enumerate(items):
                if isinstance(item, dict) and item.get("id") == entry["id"]:
                    items[i] = node
                    break
            else:
                items.append(node)

    update_policy_file(path, mutate)
    return [e["id"] for e in entries]


def update_policy_file(path: Path, mutate: Any) -> None:
    """Round-trip `path` through `mutate` (a missing or empty file starts as NEW_POLICY), check it, write atomically.

    The file's own content is validated as a policy before anything is written
    (as the loader checks each file of an `extends` chain), so a failed record
    leaves the file as it was.
    """
    from pydantic import ValidationError

    from kvpolicy.inputs.policy_schema import Policy
    from kvpolicy.inputs.yamlio import (
        format_validation_error,
        load_roundtrip,
        to_plain,
        update_yaml_file,
    )

    def change(doc: Any) -> Any:
        if not isinstance(doc, dict):
            raise PolicyError(f"{path}: a policy file must be a YAML mapping; --record cannot add evidence to it.")
        if not doc:
            doc = load_roundtrip(NEW_POLICY.format(name=path.name), str(path))
        mutate(doc)
        plain = {str(k): v for k, v in to_plain(doc).items() if k != "thresholds"}
        try:
            Policy.model_validate(plain)
        except ValidationError as exc:
            raise PolicyError(format_validation_error(exc, doc, str(path), Policy)) from None
        return doc

    if not path.parent.exists():
        path.parent.mkdir(parents=True)
    update_yaml_file(path, change)

