"""What `bench` and `verify` return: pydantic models written as JSON, plus the run's environment."""

from __future__ import annotations

import datetime as _dt
import subprocess
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvpolicy import new_dict, new_list
from kvpolicy.rules.decision import Decision


class _Model(BaseModel):
    model_config = ConfigDict(defer_build=True, use_attribute_docstrings=True, extra="forbid")


class Environment(_Model):
    """Where and with what a measurement ran."""

    device: str = "cpu"
    """GPU name as torch reports it, or `cpu`."""
    backend: str = "reference"
    """`triton` (the kernels) or `reference` (float64 torch references)."""
    date: str = ""
    """UTC date and time of the run (ISO 8601)."""
    kvpolicy_version: str = ""
    """kvpolicy version."""
    commit: str = "unknown"
    """git commit of the kvpolicy checkout (short), `unknown` outside a checkout."""
    torch_version: str = ""
    """torch version."""
    triton_version: str | None = None
    """triton version (None when not installed)."""


class VariantInfo(_Model):
    """A measured KV variant and how its layers ran."""

    name: str
    """Display name, e.g. `fp8_skip_sliding` or `fp8+one_level`."""
    key: str
    """Evidence key: bf16, fp8, fp8_skip_sliding, turboquant_*."""
    kv_cache_dtype: str
    """vLLM `--kv-cache-dtype`."""
    skip_layers: list[str] = Field(default_factory=new_list)
    """Layers kept BF16."""
    two_level: bool = True
    """FP8 two-level accumulation switch."""
    scale_source: str = "uncalibrated"
    """FP8 scale source."""
    cache_layout: str = "NHD"
    """Page order of its BF16/FP8 caches (HND where vLLM's backend keeps heads contiguous per page)."""
    kv_bytes_per_token: int = 0
    """KV bytes per token over all layers (the KV-bytes formula)."""
    layer_paths: dict[str, list[int]] = Field(default_factory=new_dict)
    """Layer indices per path: triton, gluon (FP8 and TurboQuant layers on Hopper), reference, none (linear)."""


class BenchPoint(_Model):
    """One timed decode step."""

    variant: str
    """Variant name."""
    batch: int
    """Sequences decoded at once."""
    context_tokens: int
    """Tokens already in the cache of each sequence."""
    itl_ms: float
    """Median time of one decode step's attention over all layers, in ms."""


class BenchFit(_Model):
    """ITL = slope x context + intercept for one variant and batch, against BF16."""

    variant: str
    """Variant name."""
    key: str
    """Evidence key of the variant."""
    batch: int
    """Batch of the points fitted."""
    slope_ms_per_token: float
    """ms per token of context."""
    intercept_ms: float
    """ms at zero context."""
    r2: float
    """Goodness of the line."""
    slope_ratio: float | None = None
    """Slope over BF16's (None for BF16)."""
    break_even_tokens: float | None = None
    """Context above which the variant beats BF16: intercept difference / slope difference (None: never)."""
    problems: list[str] = Field(default_factory=new_list)
    """Why this line means nothing (too few contexts, poor r2, negative intercept); empty for a usable fit."""


class BenchResult(_Model):
    """Everything `kvpolicy bench` measured."""

    schema_version: int = 1
    """Version of this document's schema."""
    kind: str = "bench"
    """Document kind."""
    model: str
    """Model id."""
    gpu: str
    """GPU catalog id the decision and any recorded evidence are for."""
    environment: Environment
    """Where it ran."""
    policy: str = ""
    """Policy label used for the decision."""
    decision: Decision
    """The decision measured (at the longest context)."""
    timing: str = ""
    """How each point was timed."""
    block_size: int = 16
    """Tokens per page."""
    contexts: list[int]
    """Context lengths measured."""
    batches: list[int]
    """Batch sizes measured."""
    variants: list[VariantInfo]
    """Variants measured, BF16 first."""
    points: list[BenchPoint] = Field(default_factory=new_list)
    """Every timed point."""
    fits: list[BenchFit] = Field(default_factory=new_list)
    """Fitted lines per variant and batch."""
    warnings: list[str] = Field(default_factory=new_list)
    """What the reader must know about these numbers."""


def environment(device: Any, backend: str) -> Environment:
    """The environment of a run on `device` (a torch.device)."""
    import torch

    from kvpolicy import __version__

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Environment(device=name, backend=backend,
                       date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                       kvpolicy_version=__version__, commit=git_commit(), torch_version=torch.__version__,
                       triton_version=triton_version)


def git_commit() -> str:
    """Short commit of the kvpolicy checkout (`-dirty` with local changes); `$KVPOLICY_COMMIT` overrides it.

    Only read-only git commands run. Outside a checkout the answer is `unknown`.
    """
    import os

    if os.environ.get("KVPOLICY_COMMIT"):
        return os.environ["KVPOLICY_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return "unknown"
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + "-dirty" if dirty else head) or "unknown"
