"""Decision -> `vllm serve` flags: the one place that knows vLLM's spelling.

vLLM-version specifics live here (see ../shared/reference/vllm-surface.md):
`--attention-backend` replaced the ignored VLLM_ATTENTION_BACKEND variable, and
`--calculate-kv-scales` is gone from vLLM 0.33 (removed July 2026), so it is
never emitted.
"""

from __future__ import annotations

from kvpolicy.decision import Decision, Workload


def serve_args(decision: Decision, workload: Workload, *, max_model_len: bool = True) -> list[str]:
    """Flags for `vllm serve MODEL ...` that carry out the decision for this workload."""
    args = ["--kv-cache-dtype", decision.kv_cache_dtype]
    if decision.skip_layers:
        args += ["--kv-cache-dtype-skip-layers", *decision.skip_layers]
    if decision.attention_backend:
        args += ["--attention-backend", decision.attention_backend]
    if workload.tp > 1:
        args += ["--tensor-parallel-size", str(workload.tp)]
    if max_model_len:
        args += ["--max-model-len", str(workload.context_tokens)]
    if workload.gpu_memory_utilization != Workload.model_fields["gpu_memory_utilization"].default:
        args += ["--gpu-memory-utilization", f"{workload.gpu_memory_utilization:g}"]
    return args


def realisation(decision: Decision) -> str:
    """How stock vLLM carries out the two-level accumulation and scale settings, in one line."""
    parts = []
    if decision.two_level_accumulation == "on":
        parts.append("two-level accumulation: always on in stock vLLM FA3 FP8 builds (no flag)")
    elif decision.two_level_accumulation == "off":
        parts.append("two-level accumulation off: needs a vllm-flash-attn build with "
                     "FLASH_ATTENTION_DISABLE_FP8_TWO_LEVEL_ACCUMULATION=TRUE")
    if decision.scale_source == "uncalibrated":
        if decision.kv_cache_dtype.startswith("fp8"):
            parts.append("scales: 1.0 (no calibrated scales in the checkpoint)")
    elif decision.scale_source.startswith("checkpoint"):
        strategy = "attn_head" if decision.scale_source == "checkpoint_per_head" else "tensor"
        parts.append(f"scales: read from the checkpoint (llm-compressor kv_cache_scheme, strategy {strategy})")
    elif decision.scale_source == "per_token_head":
        parts.append("scales: computed per token and head in the kernel")
    return "; ".join(parts)
