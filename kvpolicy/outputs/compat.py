"""What stock vLLM 0.33 would refuse, or cannot carry out, of a decision: the one compatibility check.

`recommend` shows these as warnings (`Recommendation.unsupported`), `check --strict` fails
on them, `apply --strict` refuses to launch and the HTTP service returns them: all read
this one list, so the commands cannot disagree. The backend part follows the support
matrix (`kvpolicy/facts/backends.yaml`, vLLM 0.33's `validate_configuration`).
"""

from __future__ import annotations

from pathlib import Path

from kvpolicy.facts.backends import AttentionShape, problems
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.outputs.calibrate import scale_gap
from kvpolicy.rules.decision import Decision


def model_for_vllm(arch: ModelArch, spec: str | None = None) -> str:
    """A local checkpoint's absolute folder, else the Hugging Face id (or the name as given)."""
    # Catalog and GGUF sources are descriptions, not config.json paths: no Path for them (recommend's hot path).
    source = Path(arch.source) if arch.source and "config.json" in arch.source else None
    if source is not None and source.name == "config.json" and source.is_file():
        return str(source.resolve().parent)
    return arch.hf_id or spec or arch.id


def unsupported(decision: Decision, arch: ModelArch, gpu: GpuSpec, tp: int = 1, *,
                model_ref: str | None = None) -> list[str]:
    """Each part of the decision stock vLLM 0.33 refuses or cannot carry out, with what it needs."""
    gaps: list[str] = []
    shape = AttentionShape.of(arch, tp)
    gaps += problems(decision.kv_cache_dtype, decision.attention_backend, gpu.sm, shape,
                     per_head_scales=decision.scale_source == "checkpoint_per_head", vendor=gpu.vendor)
    if decision.two_level_accumulation == "off":
        gaps.append("two-level accumulation off: stock vLLM FA3 FP8 builds always use it; turning it off needs a "
                    "custom vllm-flash-attn build with FLASH_ATTENTION_DISABLE_FP8_TWO_LEVEL_ACCUMULATION=TRUE.")
    # Scales the checkpoint declares are loaded by vLLM: nothing to calibrate.
    from_checkpoint = arch.checkpoint_kv_scales is not None \
        and decision.scale_source == f"checkpoint_{arch.checkpoint_kv_scales}"
    scales = None if from_checkpoint else scale_gap(decision, model_ref or model_for_vllm(arch))
    if scales:
        gaps.append(scales)
    if decision.kv_cache_dtype.startswith("turboquant") and arch.is_hybrid:
        gaps.append(f"{decision.kv_cache_dtype} on {arch.id}: vLLM's TurboQuant has no support for hybrid or "
                    "sliding-window models (vLLM issue #50709); use fp8 or keep BF16.")
    return gaps
