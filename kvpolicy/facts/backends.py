"""Which vLLM 0.33 attention backend serves which KV dtype on which GPU and model: the support matrix.

The data is `backends.yaml` beside this file (each row cites the vLLM source it follows);
this module only evaluates it: `refusals` says why one backend cannot serve a combination
(as `AttentionBackend.validate_configuration` would), `auto_backend` names the one vLLM's
CUDA platform would pick by itself, and `problems` lists what vLLM 0.33 would refuse in a
decision. Every command that emits or checks a decision goes through `problems`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvpolicy import new_dict, new_list
from kvpolicy.errors import InputError
from kvpolicy.formats import FORMATS
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.datacache import builtin_data

MATRIX_FILE = Path(__file__).with_name("backends.yaml")
BackendKind = Literal["standard", "mla", "sparse_mla"]


class _Strict(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid")


class HeadSizes(_Strict):
    """`supports_head_size` as bounds."""

    min: int | None = None
    max: int | None = None
    multiple_of: int | None = None


class When(_Strict):
    """Conditions of one refusal; all given ones must hold."""

    dtypes: list[str] | None = None
    quantized: bool | None = None
    sm: list[int] | None = None
    head_sizes: list[int] | None = None
    head_size_gt: int | None = None
    head_size_not: list[int] | None = None
    sinks: bool | None = None
    rope: bool | None = None
    qk_nope_head_dim_not: list[int] | None = None


class Refusal(_Strict):
    """A combination the backend's `supports_combination` (or a kernel choice after it) refuses."""

    when: When
    reason: str
    runtime: bool = False
    """Refused after selection (kernel choice), not by validate_configuration."""


class BackendRow(_Strict):
    """One attention backend of vLLM 0.33."""

    source: str
    kind: BackendKind
    kv_dtypes: list[str]
    sm: list[int]
    head_sizes: list[int] | HeadSizes | None = None
    sinks: list[int] = Field(default_factory=new_list)
    sliding_window: list[int] = Field(default_factory=new_list)
    per_head_scales: list[int] = Field(default_factory=new_list)
    refuse: list[Refusal] = Field(default_factory=new_list)


class Matrix(_Strict):
    """The whole support matrix."""

    vllm_version: str
    backends: dict[str, BackendRow]
    priorities: dict[str, list[str]]
    unavailable: dict[str, str] = Field(default_factory=new_dict)


def _parse_yaml(text: str) -> Any:
    from ruamel.yaml import YAML

    return YAML(typ="safe").load(text)


@functools.cache
def matrix() -> Matrix:
    """The matrix, read once (a broken file is a bug in kvpolicy, so it raises)."""
    data = builtin_data(MATRIX_FILE, MATRIX_FILE.read_text(encoding="utf-8"), _parse_yaml)
    m = Matrix.model_validate(data)
    for name, row in m.backends.items():
        unknown = [d for d in row.kv_dtypes if d not in FORMATS]
        if unknown:
            raise ValueError(f"{MATRIX_FILE}: {name}: unknown KV dtypes {unknown}")
    return m


def backend_names() -> list[str]:
    """Every backend the matrix knows."""
    return list(matrix().backends)


@dataclass(frozen=True)
class AttentionShape:
    """What of a model the backends look at."""

    kind: BackendKind
    head_sizes: tuple[int, ...]
    """Every attention head size over the layers (MLA: kv_lora_rank + qk_rope_head_dim)."""
    sinks: bool = False
    sliding_window: bool = False
    qk_nope_head_dim: int | None = None
    rope: bool = True
    num_heads: int | None = None
    """Query heads per rank (sparse MLA's order on SM100 depends on it)."""

    @classmethod
    def of(cls, arch: ModelArch, tp: int = 1) -> AttentionShape:
        """The shape of a catalog or Hugging Face model."""
        sparse = any(layer.kind == "mla" and layer.indexer_head_dim for layer in arch.layers)
        mla = arch.attention == "mla" or arch.count("mla") > 0
        kind: BackendKind = "sparse_mla" if sparse else "mla" if mla else "standard"
        rope = arch.qk_rope_head_dim or 0
        nope = arch.head_dim - rope if mla and rope else None
        return cls(kind=kind, head_sizes=tuple(sorted(arch.head_sizes)), sinks=arch.has_attention_sinks,
                   sliding_window=arch.count("sliding") > 0, qk_nope_head_dim=nope, rope=bool(rope) or not mla,
                   num_heads=max(1, arch.num_attention_heads // max(1, tp)))

    @classmethod
    def from_facts(cls, facts: dict[str, Any]) -> AttentionShape:
        """The same, from the facts `build_facts` wrote (`model.*`)."""
        raw = facts.get("model.head_sizes") or facts.get("model.head_dim")
        parts = str(raw).split(",") if not isinstance(raw, bool) else []
        if not parts or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise InputError(f"fact model.head_sizes / model.head_dim is {raw!r}: expected a head size such as 128 "
                             "(or sizes such as 128,64).")
        sizes = tuple(int(p) for p in parts)
        kind: BackendKind = ("sparse_mla" if facts.get("model.sparse_mla") else
                             "mla" if facts.get("model.attention") == "mla" else "standard")
        return cls(kind=kind, head_sizes=sizes, sinks=bool(facts.get("model.has_attention_sinks")),
                   sliding_window=bool(facts.get("model.num_sliding_layers")),
                   qk_nope_head_dim=facts.get("model.qk_nope_head_dim"),
                   rope=kind == "standard" or bool(facts.get("model.qk_nope_head_dim")),
                   num_heads=facts.get("model.num_attention_heads_per_rank"))


def _head_ok(spec: list[int] | HeadSizes | None, size: int) -> bool:
    if spec is None:
        return True
    if isinstance(spec, list):
        return size in spec
    return ((spec.min is None or size >= spec.min) and (spec.max is None or size <= spec.max)
            and (spec.multiple_of is None or size % spec.multiple_of == 0))


def _holds(w: When, dtype: str, sm: int, size: int, shape: AttentionShape) -> bool:
    fmt = FORMATS[dtype]
    checks = [
        w.dtypes is None or dtype in w.dtypes,
        w.quantized is None or fmt.quantized == w.quantized,
        w.sm is None or sm in w.sm,
        w.head_sizes is None or size in w.head_sizes,
        w.head_size_gt is None or size > w.head_size_gt,
        w.head_size_not is None or size not in w.head_size_not,
        w.sinks is None or shape.sinks == w.sinks,
        w.rope is None or shape.rope == w.rope,
        w.qk_nope_head_dim_not is None or (shape.qk_nope_head_dim is not None
                                           and shape.qk_nope_head_dim not in w.qk_nope_head_dim_not),
    ]
    return all(checks)


def refusals(backend: str, dtype: str, sm: int | None, shape: AttentionShape, *,
             per_head_scales: bool = False, runtime: bool = True) -> list[str]:
    """Why vLLM 0.33 refuses `backend` for this combination; empty when it serves it.

    `sm` None (an unknown GPU) skips the compute-capability checks. `runtime` False leaves
    out refusals vLLM makes only after selection (what validate_configuration alone says).
    """
    return list(_refusals(backend, dtype, sm, shape, per_head_scales, runtime))


# The matrix is read once per process, so the answer depends on the arguments alone; the rules
# engine asks the same few hundred combinations over and over.
@functools.lru_cache(maxsize=16384)
def _refusals(backend: str, dtype: str, sm: int | None, shape: AttentionShape, per_head_scales: bool,
              runtime: bool) -> tuple[str, ...]:
    m = matrix()
    row = m.backends.get(backend)
    if row is None:
        why = m.unavailable.get(backend)
        return (f"{backend}: {why}" if why else f"{backend} is not a CUDA attention backend of vLLM {m.vllm_version}",)
    out: list[str] = []
    if dtype not in row.kv_dtypes:
        out.append(f"kv_cache_dtype {dtype} not supported (serves {', '.join(row.kv_dtypes)})")
    if shape.kind != row.kind:
        need = {"standard": "GQA/MHA attention", "mla": "dense MLA", "sparse_mla": "sparse MLA (DSA indexer)"}
        out.append(f"serves {need[row.kind]} only; the model has {need[shape.kind]}")
    if sm is not None and sm not in row.sm:
        out.append(f"compute capability {sm / 10:.1f} not supported")
    bad_sizes = [s for s in shape.head_sizes if not _head_ok(row.head_sizes, s)]
    if bad_sizes:
        out.append(f"head_size {', '.join(map(str, bad_sizes))} not supported")
    if shape.sinks and (sm is None and not row.sinks or sm is not None and sm not in row.sinks):
        out.append("attention sinks not supported")
    if shape.sliding_window and (sm is None and not row.sliding_window
                                 or sm is not None and sm not in row.sliding_window):
        out.append("sliding window not supported")
    if per_head_scales and (sm is None and not row.per_head_scales
                            or sm is not None and sm not in row.per_head_scales):
        out.append("per-head quant scales not supported")
    if dtype in row.kv_dtypes and shape.kind == row.kind:
        for ref in row.refuse:
            if ref.runtime and not runtime:
                continue
            if sm is None and ref.when.sm is not None:
                continue
            if any(_holds(ref.when, dtype, sm or 0, size, shape) for size in shape.head_sizes):
                out.append(ref.reason)
    return tuple(dict.fromkeys(out))


def priority_list(sm: int, shape: AttentionShape, dtype: str) -> list[str]:
    """`_get_backend_priorities` (platforms/cuda.py): the order vLLM tries backends in."""
    p = matrix().priorities
    major = sm // 10
    if shape.kind == "standard":
        return p["standard_sm100"] if major == 10 else p["standard"]
    if major == 10:
        if FORMATS[dtype].quantized:
            sparse = p["sparse_sm100_quantized"]
        elif shape.num_heads is not None and shape.num_heads <= 16:
            sparse = p["sparse_sm100_bf16_few_heads"]
        else:
            sparse = p["sparse_sm100_bf16"]
        return p["mla_sm100"] + sparse
    if major == 12:
        return p["mla_sm120"]
    return p["mla"] + (p["sparse_head_512"] if 512 in shape.head_sizes else p["sparse"])


def valid_backends(dtype: str, sm: int, shape: AttentionShape, *, per_head_scales: bool = False) -> list[str]:
    """The backends vLLM would accept, in its own order of preference."""
    return list(_valid_backends(dtype, sm, shape, per_head_scales))


@functools.lru_cache(maxsize=4096)
def _valid_backends(dtype: str, sm: int, shape: AttentionShape, per_head_scales: bool) -> tuple[str, ...]:
    return tuple(b for b in priority_list(sm, shape, dtype)
                 if not _refusals(b, dtype, sm, shape, per_head_scales, True))


def auto_backend(dtype: str, sm: int | None, shape: AttentionShape, *, per_head_scales: bool = False) -> str | None:
    """The backend vLLM 0.33 picks without `--attention-backend`, or None when none serves it."""
    if sm is None:
        return None
    found = valid_backends(dtype, sm, shape, per_head_scales=per_head_scales)
    return found[0] if found else None


def dtype_refusal(dtype: str, sm: int | None, shape: AttentionShape, *, vendor: str = "nvidia") -> str | None:
    """Why no vLLM 0.33 backend stores `dtype` for this model and GPU, or None when one does."""
    fmt = FORMATS.get(dtype)
    if fmt is None:
        return f"`{dtype}` is not a --kv-cache-dtype of vLLM {matrix().vllm_version}"
    platform = "rocm" if vendor == "amd" else "cuda"
    if platform not in fmt.platforms:
        return f"{dtype} is stored only on {', '.join(fmt.platforms)} backends"
    if platform != "cuda" or sm is None:
        return None
    if auto_backend("auto", sm, shape) is None:
        return None  # no backend runs this model on this GPU at all: `model_refusal` says so, not the dtype
    if auto_backend(dtype, sm, shape) is None:
        named = [b for b, row in matrix().backends.items() if dtype in row.kv_dtypes and row.kind == shape.kind]
        why = "; ".join(f"{b}: {', '.join(refusals(b, dtype, sm, shape))}" for b in named) or \
            f"no backend stores it for {shape.kind.replace('_', ' ')} attention"
        return f"no vLLM {matrix().vllm_version} attention backend serves {dtype} here ({why})"
    return None


def problems(dtype: str, backend: str | None, sm: int | None, shape: AttentionShape, *,
             per_head_scales: bool = False, vendor: str = "nvidia") -> list[str]:
    """What vLLM 0.33 would refuse about a decision: dtype, backend and scales together."""
    version = matrix().vllm_version
    if vendor != "nvidia":
        return []
    # Checkpoint scales only reach the kernels of an FP8 cache (per-token-head formats ignore them).
    per_head_scales = per_head_scales and dtype in FORMATS and FORMATS[dtype].family == "fp8"
    if sm is not None and auto_backend("auto", sm, shape) is None:
        return [f"no vLLM {version} attention backend runs {shape.kind.replace('_', ' ')} attention with head sizes "
                f"{', '.join(map(str, shape.head_sizes))} on SM {sm / 10:.1f}: choose another GPU"]
    no_dtype = dtype_refusal(dtype, sm, shape, vendor=vendor)
    if no_dtype:
        return [no_dtype]
    if backend is None:
        if per_head_scales and sm is not None and auto_backend(dtype, sm, shape, per_head_scales=True) is None:
            return [f"per-head KV scales with {dtype}: no vLLM {version} backend for this model on SM {sm / 10:.1f} "
                    "takes them (only FLASH_ATTN with FA3/FA4 does); calibrate per-tensor scales instead"]
        return []
    why = refusals(backend, dtype, sm, shape, per_head_scales=per_head_scales)
    if not why:
        return []
    where = f"SM {sm / 10:.1f}" if sm is not None else "this GPU"
    alt = auto_backend(dtype, sm, shape, per_head_scales=per_head_scales)
    fix = f"use {alt} (vLLM's own choice here)" if alt else "no backend of vLLM serves this combination"
    return [f"--attention-backend {backend} with --kv-cache-dtype {dtype} on {where}: vLLM {version} refuses it "
            f"({'; '.join(why)}); {fix}."]
