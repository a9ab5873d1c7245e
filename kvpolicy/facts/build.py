"""Facts: the flat, typed, read-only view of everything a rule may test.

Rules name facts by path (`model.head_dim`, `gpu.generation`...). `FACTS` lists
every path with a description: `kvpolicy facts` prints it, lint checks rules
against it, and `build_facts` must produce exactly these keys (a test checks).
"""

from __future__ import annotations

from typing import Any

from kvpolicy.facts.backends import AttentionShape
from kvpolicy.facts.estimates import Figures
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.inputs.policy_schema import Policy
from kvpolicy.inputs.workload import Workload

FACTS: dict[str, str] = {
    "model.id": "catalog id of the model",
    "model.family": "model family (llama, qwen3, gpt-oss, gemma, kimi, deepseek, ...)",
    "model.attention": "attention kind: gqa, mha, mqa or mla",
    "model.head_dim": "head dimension of the sliding/regular attention layers",
    "model.max_head_dim": "largest head dimension over the KV-holding layers",
    "model.num_layers": "decoder layers",
    "model.num_kv_heads": "KV heads per layer",
    "model.num_full_layers": "full-attention layers",
    "model.num_sliding_layers": "sliding-window layers",
    "model.num_mla_layers": "MLA layers",
    "model.num_linear_layers": "recurrent-state layers (Mamba, gated delta net, short conv, linear attention)",
    "model.num_kv_layers": "layers that hold a KV cache of their own",
    "model.sliding_window": "sliding window in tokens (absent when none)",
    "model.is_hybrid": "more than one kind of layer cache (sliding, chunked, recurrent or shared beside full)",
    "model.has_attention_sinks": "learned attention sinks (gpt-oss)",
    "model.head_sizes": "every attention head size over the layers, joined by commas (MLA: the latent width)",
    "model.sparse_mla": "MLA with the DSA indexer (DeepSeek-V3.2, GLM-5): served by the sparse-MLA backends",
    "model.qk_nope_head_dim": "MLA: the non-RoPE part of the query/key head (absent without MLA)",
    "model.num_attention_heads_per_rank": "query heads per tensor-parallel rank",
    "model.has_kv_scales": "the checkpoint declares calibrated KV-cache scales (a kv_cache_scheme)",
    "model.checkpoint_kv_dtype": "what `--kv-cache-dtype auto` stores for this checkpoint when its quantization "
                                 "config makes it quantized (fp8, fp8_e4m3, nvfp4; absent: the model dtype)",
    "model.checkpoint_kv_scales": "per_tensor or per_head when the checkpoint declares FP8 KV scales that vLLM "
                                  "loads into an FP8 cache (kv_cache_scheme; absent when none)",
    "gpu.id": "catalog id of the GPU",
    "gpu.vendor": "nvidia or amd",
    "gpu.generation": "ampere, ada, hopper, blackwell, cdna3 or cdna4",
    "gpu.sm": "compute capability as an integer (90 for 9.0)",
    "gpu.fp8_compute": "FP8 tensor cores exist",
    "gpu.memory_gib": "device memory in GiB",
    "gpu.bandwidth_tbs": "memory bandwidth in TB/s",
    "workload.context_tokens": "context length per request",
    "workload.priority": "decode, prefill or balanced",
    "workload.concurrency": "requests served at once",
    "workload.tp": "tensor-parallel size",
    "workload.accuracy_floor": "lowest acceptable accuracy recovery",
    "memory.weights_fit": "the weights fit on the GPUs with room for a KV cache",
    "memory.max_concurrency_bf16": "requests at the context that fit with a BF16 cache",
    "memory.max_concurrency_fp8": "requests at the context that fit with an FP8 cache",
    "memory.max_concurrency_turboquant_4bit_nc": "requests at the context that fit with turboquant_4bit_nc",
    "memory.fits_bf16": "the concurrency fits with a BF16 cache",
    "memory.fits_fp8": "the concurrency fits with an FP8 cache",
    "memory.fits_turboquant_4bit_nc": "the concurrency fits with turboquant_4bit_nc",
    "memory.max_concurrency_nvfp4": "requests at the context that fit with an nvfp4 cache",
    "memory.fits_nvfp4": "the concurrency fits with an nvfp4 cache",
    "memory.max_concurrency_int4_per_token_head": "requests at the context that fit with int4_per_token_head",
    "memory.fits_int4_per_token_head": "the concurrency fits with int4_per_token_head",
    "memory.max_concurrency_fp8_ds_mla": "requests at the context that fit with fp8_ds_mla (sparse MLA)",
    "memory.fits_fp8_ds_mla": "the concurrency fits with fp8_ds_mla (sparse MLA)",
    "memory.max_concurrency_nvfp4_ds_mla": "requests at the context that fit with nvfp4_ds_mla (sparse MLA)",
    "memory.fits_nvfp4_ds_mla": "the concurrency fits with nvfp4_ds_mla (sparse MLA)",
    "memory.pressure_bf16": "KV needed / KV available with BF16 (above 1: does not fit)",
    "latency.fp8_break_even_tokens": "context above which FP8 (all layers) decodes faster than BF16",
    "latency.fp8_skip_sliding_break_even_tokens": "the same with sliding layers kept BF16 (absent without sliding layers)",
    "latency.fp8_best_break_even_tokens": "the lower of the two",
    "latency.fp8_never_faster": "measured ITL lines show no FP8 variant ever decoding faster than BF16 here",
    "accuracy.fp8_recovery": "expected FP8 accuracy recovery at this context (uncalibrated)",
    "accuracy.turboquant_4bit_nc_recovery": "expected turboquant_4bit_nc accuracy recovery",
    "accuracy.fp8_model_check": "verdict of the model-level figures recorded for this model with uncalibrated FP8 "
                                "(`kvpolicy verify --record`) against the `model_*` thresholds: pass, below or "
                                "undecided (absent when none is recorded)",
    "accuracy.fp8_per_head_model_check": "the same for FP8 with per-head scales (the verify's +per_head twin)",
    "accuracy.turboquant_4bit_nc_model_check": "the same for turboquant_4bit_nc",
    "accuracy.fp8_model_figures": "the recorded uncalibrated FP8 figures, their evidence id and verdict, as a phrase "
                                  "for messages (absent when none is recorded)",
    "kernels.turboquant_4bit_nc": "turboquant_4bit_nc in kvpolicy's fused kernel vs cuDNN BF16 (attention slope), "
                                  "as a phrase for messages",
    "decision.kv_cache_dtype": "KV dtype decided so far (for rules after the dtype stage)",
    "decision.kv_format": "family of the decided dtype: bf16, fp8 or turboquant",
    "decision.skip_layers": "`sliding_window`, indices joined by commas, or empty",
    "decision.two_level_accumulation": "on, off or not_applicable",
    "decision.scale_source": "scale source decided so far",
    "decision.attention_backend": "attention backend (advice rules only: it is decided last)",
    "decision.vllm_backend": "the backend vLLM 0.33 picks by itself for the decided dtype (None: none serves it)",
}
"""Every fact path with a one-line description."""


def build_facts(arch: ModelArch, gpu: GpuSpec, workload: Workload, policy: Policy, *,
                figures: Figures | None = None) -> dict[str, Any]:
    """Facts for one deployment (decision.* facts are added by the engine as it decides).

    `figures` (of these same inputs) keeps the derived figures for `estimate` to reuse.
    """
    fig = figures if figures is not None else Figures(policy, arch, gpu, workload)
    shape = AttentionShape.of(arch, workload.tp)
    f: dict[str, Any] = {
        "model.id": arch.id,
        "model.family": arch.family,
        "model.attention": arch.attention,
        "model.head_dim": arch.head_dim,
        "model.max_head_dim": arch.max_head_dim,
        "model.num_layers": arch.num_layers,
        "model.num_kv_heads": arch.num_kv_heads,
        "model.num_full_layers": arch.count("full"),
        "model.num_sliding_layers": arch.count("sliding"),
        "model.num_mla_layers": arch.count("mla"),
        "model.num_linear_layers": arch.count("linear"),
        "model.num_kv_layers": len(arch.kv_layer_indices),
        "model.sliding_window": arch.sliding_window if arch.count("sliding") else None,
        "model.is_hybrid": arch.is_hybrid,
        "model.has_attention_sinks": arch.has_attention_sinks,
        "model.head_sizes": ",".join(str(h) for h in shape.head_sizes),
        "model.sparse_mla": shape.kind == "sparse_mla",
        "model.qk_nope_head_dim": shape.qk_nope_head_dim,
        "model.num_attention_heads_per_rank": shape.num_heads,
        "model.has_kv_scales": arch.kv_cache_scheme is not None,
        "model.checkpoint_kv_dtype": arch.auto_kv_dtype if arch.auto_kv_dtype != "auto" else None,
        "model.checkpoint_kv_scales": arch.checkpoint_kv_scales,
        "gpu.id": gpu.id,
        "gpu.vendor": gpu.vendor,
        "gpu.generation": gpu.generation,
        "gpu.sm": gpu.sm,
        "gpu.fp8_compute": gpu.fp8_compute,
        "gpu.memory_gib": gpu.memory_gib,
        "gpu.bandwidth_tbs": gpu.bandwidth_tbs,
        "workload.context_tokens": workload.context_tokens,
        "workload.priority": workload.priority,
        "workload.concurrency": workload.concurrency,
        "workload.tp": workload.tp,
        "workload.accuracy_floor": workload.accuracy_floor,
    }
    f["memory.weights_fit"] = fig.budget > 0
    conc = {dtype: fig.max_concurrency(fig.bf16 if dtype == "auto" else dtype)
            for dtype in ("auto", "fp8", "turboquant_4bit_nc")}
    f["memory.max_concurrency_bf16"] = conc["auto"]
    f["memory.max_concurrency_fp8"] = conc["fp8"]
    f["memory.max_concurrency_turboquant_4bit_nc"] = conc["turboquant_4bit_nc"]
    f["memory.fits_bf16"] = conc["auto"] >= workload.concurrency
    f["memory.fits_fp8"] = conc["fp8"] >= workload.concurrency
    f["memory.fits_turboquant_4bit_nc"] = conc["turboquant_4bit_nc"] >= workload.concurrency
    # The newer formats, only where they are a format of this kind of model.
    extra = ("fp8_ds_mla", "nvfp4_ds_mla") if shape.kind == "sparse_mla" else \
        () if shape.kind == "mla" else ("nvfp4", "int4_per_token_head")
    for dtype in ("nvfp4", "int4_per_token_head", "fp8_ds_mla", "nvfp4_ds_mla"):
        try:
            n = fig.max_concurrency(dtype) if dtype in extra else None
        except ValueError:  # a layout vLLM asserts against (nvfp4 with unequal K/V head sizes)
            n = None
        f[f"memory.max_concurrency_{dtype}"] = n
        f[f"memory.fits_{dtype}"] = n is not None and n >= workload.concurrency
    need = fig.plan(fig.bf16).request_bytes * workload.concurrency
    f["memory.pressure_bf16"] = round(need / fig.budget, 3) if fig.budget > 0 else None

    variants = [fig.break_even("fp8", [], f)]
    if arch.count("sliding"):
        variants.append(fig.break_even("fp8", ["sliding_window"], f))
    f["latency.fp8_break_even_tokens"] = variants[0].value
    f["latency.fp8_skip_sliding_break_even_tokens"] = variants[1].value if len(variants) > 1 else None
    candidates = [e.value for e in variants if e.value is not None]
    f["latency.fp8_best_break_even_tokens"] = min(candidates) if candidates else None
    # A measured line that never crosses BF16's (e.g. a user's own `kvpolicy bench --record`).
    f["latency.fp8_never_faster"] = all(e.value is None and e.provenance == "measured" for e in variants)
    f["accuracy.fp8_recovery"] = fig.recovery("fp8").value
    f["accuracy.turboquant_4bit_nc_recovery"] = fig.recovery("turboquant_4bit_nc").value
    checks = {"fp8": fig.model_check("fp8"), "fp8_per_head": fig.model_check("fp8", "checkpoint_per_head"),
              "turboquant_4bit_nc": fig.model_check("turboquant_4bit_nc")}
    for key, check in checks.items():
        f[f"accuracy.{key}_model_check"] = check.verdict if check is not None else None
    f["accuracy.fp8_model_figures"] = checks["fp8"].phrase() if checks["fp8"] is not None else None
    f["kernels.turboquant_4bit_nc"] = fig.kernel_figure("turboquant_4bit_nc").phrase
    return f
