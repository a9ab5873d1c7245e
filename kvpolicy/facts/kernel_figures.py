"""kvpolicy's own kernel measurements as estimates: `kernel slope vs cuDNN` and the `kernels.*` facts.

Evidence entries with a `kernels:` block hold decode-attention fits of kvpolicy's
kernels (bench/bench_decode.py --evidence: Triton; on Hopper, Gluon for FP8 and the TurboQuant formats). For a deployment the figure
comes from the user's GPU, else from a GPU of the same generation, at the
measured layer shape whose head_dim is closest to the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpolicy.formats import FORMATS
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.inputs.policy_schema import KernelMeasurement, Policy


@dataclass(frozen=True)
class KernelFigure:
    """kvpolicy's measured decode-attention slope for one format, or why there is none."""

    ratio: float | None
    """Slope over the baseline's (cuDNN BF16), rounded to 3 places; None when not measured."""
    basis: str
    """The estimate's basis: kernel, GPU, geometry, batch, evidence id (or the reason for None)."""
    phrase: str
    """The same in a few words, for policy messages (fact `kernels.<dtype>`)."""


_BASELINE_NAMES = {"sdpa_cudnn": "cuDNN BF16", "sdpa_flash": "flash-attention BF16"}
_KERNEL_NAMES = {"bf16": "BF16", "fp8": "FP8"}


def kernel_column(dtype: str) -> str | None:
    """Column of kernel evidence that measured a dtype (bf16, fp8, turboquant_*); None if kvpolicy has no kernel."""
    fmt = FORMATS.get(dtype)
    if fmt is None or dtype == "float16":
        return None
    if fmt.kind == "bf16":
        return "bf16"
    if fmt.kind == "fp8":
        return "fp8" if fmt.fp8_variant == "e4m3" else None
    return dtype


def kernel_figure(policy: Policy, arch: ModelArch, gpu: GpuSpec, dtype: str) -> KernelFigure:
    """The kernel slope look-up, cached per policy object (recommend and build_facts both call it per deployment)."""
    # The largest head dim is the full layers' (Gemma 4), which dominate the reads at long context.
    head_dim, is_mla = arch.max_head_dim, arch.attention == "mla"
    rows, cache = _kernel_cache(policy)
    key = (gpu.id, gpu.generation, head_dim, is_mla, dtype)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = _kernel_figure(rows, gpu, head_dim, is_mla, dtype)
    return hit


_KernelRow = tuple[str, KernelMeasurement, str | None, str | None]
"""(evidence id, measurement, catalog id and generation of the measured GPU; None when not in the catalog)."""


def _kernel_figure(rows: list[_KernelRow], gpu: GpuSpec, head_dim: int, is_mla: bool, dtype: str) -> KernelFigure:
    column = kernel_column(dtype)
    if column is None:
        why = f"kvpolicy's decode kernels do not implement {dtype}"
        return KernelFigure(None, f"{why}, so there is nothing of ours to compare", f"not measured ({why})")
    if is_mla:
        why = "kvpolicy's decode kernels take GQA/MHA layers; MLA latents run the torch reference"
        return KernelFigure(None, why, "not measured by kvpolicy for MLA layers")
    usable = [r for r in rows if column in r[1].fits]
    # The user's GPU first, then its generation (same memory system, same instructions).
    pool = [r for r in usable if r[2] == gpu.id] or [r for r in usable if r[3] == gpu.generation]
    if not pool:
        if any(r[3] == gpu.generation for r in rows):
            ids = ", ".join(dict.fromkeys(f"`{r[0]}`" for r in rows if r[3] == gpu.generation))
            return KernelFigure(None, f"kvpolicy's kernel measurements for {gpu.generation} GPUs ({ids}) have no "
                                      f"`{column}` fit", f"not measured by kvpolicy on {gpu.generation} GPUs")
        return KernelFigure(None, f"no kvpolicy kernel measurement for {gpu.generation} GPUs; run "
                                  "`python bench/bench_decode.py` on one and add the fits as evidence",
                            f"not measured by kvpolicy on {gpu.generation} GPUs")
    # Closest head_dim first; among equals the last entry wins, so an extending policy's own
    # figures (later in the merged evidence list) replace the built-in ones.
    ev_id, m, m_gpu, _ = min(reversed(pool), key=lambda r: abs(r[1].head_dim - head_dim))
    fit, base = m.fits[column], m.fits[m.baseline]
    raw = fit.slope_ns_per_token / base.slope_ns_per_token
    ratio = round(raw, 3)  # the text rounds `raw` once: 1.0052 reads 1.01x, not round(1.005, 2) = 1.00x
    base_name = _BASELINE_NAMES.get(m.baseline, m.baseline)
    kernel = _KERNEL_NAMES.get(column, "fused")
    where = f"on {m_gpu}" if m_gpu == gpu.id else f"measured on {m_gpu}, same generation as {gpu.id}"
    shape = f"{m.geometry} layer"
    if m.head_dim != head_dim:
        shape += f", head_dim {m.head_dim} vs this model's {head_dim}"
    notes = [f"{shape}, batch {m.batch}"]
    if column != "bf16" and "bf16" in m.fits:
        notes.append(f"our BF16 kernel {m.fits['bf16'].slope_ns_per_token / base.slope_ns_per_token:.2f}x")
    if fit.read_tbps_at_128k is not None:
        notes.append(f"{fit.read_tbps_at_128k:g} TB/s of KV read at 128k")
    notes.append(f"evidence `{ev_id}`")
    basis = f"kvpolicy's {kernel} kernel: {raw:.2f}x {base_name}'s attention slope {where} " \
            f"({'; '.join(notes)})"
    phrase = f"{raw:.2f}x {base_name}'s attention slope in kvpolicy's {kernel} kernel ({m_gpu}, {m.geometry} " \
             f"layer, batch {m.batch})"
    return KernelFigure(ratio, basis, phrase)


def _kernel_cache(policy: Policy) -> tuple[list[_KernelRow], dict[tuple[Any, ...], KernelFigure]]:
    """Every kernel measurement of the policy, and the look-ups made so far; kept on the policy object."""
    hit = policy.derived.get(__name__)
    if hit is None:
        rows = [(ev.id, m, *_catalog_gpu(m.gpu)) for ev in policy.evidence for m in ev.kernels]
        hit = policy.derived[__name__] = (rows, {})
    return hit


def _catalog_gpu(name: str) -> tuple[str | None, str | None]:
    """(catalog id, generation) of a GPU named in evidence by id or alias; (None, None) when unknown."""
    from kvpolicy.errors import InputError
    from kvpolicy.inputs.catalog import resolve_gpu

    if name.strip().lower() == "auto":
        return None, None
    try:
        spec = resolve_gpu(name)
    except InputError:
        return None, None
    return spec.id, spec.generation

