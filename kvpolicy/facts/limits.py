"""Limits vLLM 0.33 enforces on a deployment, checked before kvpolicy prints anything.

Two kinds. `check_request` raises a `LimitError` (exit 2, HTTP 422) for what vLLM refuses
while it builds its config: a `--max-model-len` above the length it derives from the
model's config (`_get_and_verify_max_len`, `config/model.py`), and a tensor-parallel size
the attention or KV heads do not divide (`ModelConfig.verify_with_parallel_config`,
`QKVParallelLinear`). `startup_blockers` lists what stops vLLM when it sizes its KV cache
(`_check_enough_kv_cache_memory`, `v1/core/kv_cache_planning.py`): no memory left after the
weights, or not enough for one request at max_model_len; it is modelled from the KV budget,
so it travels with the recommendation (with the smallest TP that fits) instead of hiding it.
`recommend()` calls both; every surface (CLI formats, explain, apply, check, diff, the HTTP
service) goes through it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvpolicy.errors import LimitError
from kvpolicy.facts.kv_memory import GIB, Layout, kv_budget_bytes, plan
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.inputs.workload import Workload

ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
"""vLLM's escape hatch for a max_model_len above the derived one (`envs.py`: "1" or "true")."""
TP_SEARCH_LIMIT = 64
"""Largest tensor-parallel size kvpolicy suggests."""


def long_context_allowed(env: Mapping[str, str] | None = None) -> bool:
    """`envs.VLLM_ALLOW_LONG_MAX_MODEL_LEN`: vLLM then warns instead of refusing a longer max_model_len."""
    value = (os.environ if env is None else env).get(ALLOW_LONG_ENV, "0")
    return value.strip().lower() in ("1", "true")


def check_request(arch: ModelArch, workload: Workload, env: Mapping[str, str] | None = None) -> list[str]:
    """Raise LimitError for a context or TP size vLLM refuses; return warnings for what it lets through."""
    warnings: list[str] = []
    problem = arch.tp_error(workload.tp)
    if problem:
        raise LimitError(problem + " vLLM refuses the others when it builds the model.", "tp")
    limit = arch.max_model_len
    ctx = workload.context_tokens
    if limit is not None and ctx > limit:
        source = arch.max_model_len_basis or "the model's config.json"
        what = (f"context {ctx:,} tokens (--max-model-len {ctx}) is above {arch.id}'s limit of {limit:,} tokens: "
                f"vLLM 0.33 derives max_model_len from {source} and refuses a longer one (\"User-specified "
                f"max_model_len ({ctx}) is greater than the derived max_model_len\").")
        if not long_context_allowed(env):
            raise LimitError(
                f"{what} Use a context of at most {limit:,} tokens (--context {limit}). vLLM lets you go past it "
                f"only with {ALLOW_LONG_ENV}=1 in its environment (set it for kvpolicy too and this becomes a "
                "warning); with RoPE, positions past the trained length give NaN or garbage, so prefer a "
                "checkpoint whose config declares the longer context (rope_scaling).", "context")
        warnings.append(f"{what} Let through because {ALLOW_LONG_ENV}=1: vLLM starts only with the same variable "
                        "set, and positions past the trained length may give NaN or garbage.")
    return warnings


def startup_blockers(arch: ModelArch, gpu: GpuSpec, workload: Workload, dtype: str,
                     skip_layers: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Why vLLM would stop at start-up with this KV cache (modelled budget); empty when it starts."""
    budget = kv_budget_bytes(arch, gpu, workload)
    kv_plan = plan(arch, Layout.of(arch, dtype, skip_layers, workload.tp, gpu), workload.context_tokens, gpu)
    out: list[str] = []
    if kv_plan.problem:
        out.append(f"vLLM 0.33 cannot lay out this KV cache: {kv_plan.problem}.")
    if dtype == "fp8_e5m2" and _loads_kv_scales(arch):
        out.append(f"vLLM refuses fp8_e5m2 with this checkpoint ({arch.quant_method} quantization loads FP8 "
                   "k/v scales): \"fp8_e5m2 kv-cache is not supported with fp8 checkpoints\" "
                   "(model_executor/layers/attention/attention.py _init_kv_cache_quant); use fp8 or auto.")
    ctx, tp = workload.context_tokens, workload.tp
    per_rank = arch.weight_bytes / tp / 1e9
    if budget <= 0:
        out.append(
            f"the weights ({arch.weight_bytes / 1e9:.1f} GB, {per_rank:.1f} GB per rank at tp {tp}) leave no memory "
            f"for a KV cache on {gpu.id} ({gpu.memory_gib:g} GiB x {workload.gpu_memory_utilization:g}, modelled): "
            "vLLM stops with \"No available memory for the cache blocks\" (v1/core/kv_cache_planning.py). "
            + _remedy(arch, gpu, workload, dtype, skip_layers) + ".")
    elif not kv_plan.capacity(budget).fits_one:
        longest = _longest_context(arch, gpu, workload, dtype, skip_layers, budget)
        shorter = f"; or lower the context to {longest:,} tokens or less" if longest else ""
        out.append(
            f"one request of {ctx:,} tokens needs {kv_plan.request_bytes / GIB:.2f} GiB of KV cache per rank, above "
            f"the {budget / GIB:.2f} GiB left after the weights (modelled): vLLM stops with \"To serve at least one "
            "request with the model's max seq len\" (v1/core/kv_cache_planning.py). "
            + _remedy(arch, gpu, workload, dtype, skip_layers) + shorter + ".")
    return out


def _fits(arch: ModelArch, gpu: GpuSpec, workload: Workload, dtype: str, skip: list[str] | tuple[str, ...]) -> bool:
    budget = kv_budget_bytes(arch, gpu, workload)
    if budget <= 0:
        return False
    kv_plan = plan(arch, Layout.of(arch, dtype, skip, workload.tp, gpu), workload.context_tokens, gpu)
    return kv_plan.capacity(budget).fits_one


def smallest_tp(arch: ModelArch, gpu: GpuSpec, workload: Workload, dtype: str,
                skip_layers: list[str] | tuple[str, ...] = ()) -> int | None:
    """The smallest TP size vLLM accepts for this model at which weights and one request fit (None: none to 64)."""
    for tp in arch.valid_tp_sizes(TP_SEARCH_LIMIT):
        if tp > workload.tp and _fits(arch, gpu, workload.model_copy(update={"tp": tp}), dtype, skip_layers):
            return tp
    return None


def _remedy(arch: ModelArch, gpu: GpuSpec, workload: Workload, dtype: str,
            skip_layers: list[str] | tuple[str, ...]) -> str:
    tp = smallest_tp(arch, gpu, workload, dtype, skip_layers)
    if tp is None:
        return (f"No tensor-parallel size up to {TP_SEARCH_LIMIT} that vLLM accepts for {arch.id} fits on {gpu.id}: "
                "use a quantized checkpoint, a larger GPU or pipeline parallelism")
    return (f"The smallest tensor-parallel size that fits is --tp {tp} (with this KV cache, modelled); or use a "
            "quantized checkpoint")


def _longest_context(arch: ModelArch, gpu: GpuSpec, workload: Workload, dtype: str,
                     skip_layers: list[str] | tuple[str, ...], budget: float) -> int:
    """Largest context (a multiple of 1,024 tokens) whose one request fits the budget, as vLLM's
    `estimate_max_model_len` searches for it (0 when not even 1,024 tokens fit)."""
    layout = Layout.of(arch, dtype, skip_layers, workload.tp, gpu)
    lo, hi = 0, workload.context_tokens // 1024
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan(arch, layout, mid * 1024, gpu).capacity(budget).fits_one:
            lo = mid
        else:
            hi = mid - 1
    return lo * 1024


def _loads_kv_scales(arch: ModelArch) -> bool:
    """Whether the checkpoint's quant config hands attention layers a KV-cache method (`BaseKVCacheMethod`):
    Fp8Config always (`Attention` only), the others when they declare a KV scheme; ModelOpt also for MLA."""
    if arch.kv_cache_scheme is not None:
        return arch.attention != "mla" or arch.kv_cache_scheme.method in ("modelopt", "modelopt_fp4")
    return arch.quant_method == "fp8" and arch.attention != "mla"
