"""Calibrated FP8 KV scales: the llm-compressor recipe a decision needs, and what a checkpoint already has.

vLLM reads k/v (and q) scales from a compressed-tensors checkpoint whose
`quantization_config.kv_cache_scheme` llm-compressor wrote; `strategy: tensor`
gives one scale per layer, `strategy: attn_head` one per KV head (FLASH_ATTN
only). Without them vLLM uses 1.0. kvpolicy never runs the calibration: it
writes the recipe and prints the command.
"""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path
from typing import Literal

from kvpolicy.rules.decision import Decision

Strategy = Literal["tensor", "attn_head"]

STRATEGY_BY_SOURCE: dict[str, Strategy] = {"checkpoint_per_tensor": "tensor", "checkpoint_per_head": "attn_head"}
"""Decision scale sources that need a calibrated checkpoint, and the llm-compressor strategy of each."""
DEFAULT_DATASET = "open_platypus"
"""A calibration dataset llm-compressor's `oneshot` knows by name."""
INSTALL_HINT = "pip install llmcompressor"


def strategy_for(decision: Decision) -> Strategy | None:
    """The llm-compressor strategy the decision's scale source needs, or None when it needs no calibration."""
    return STRATEGY_BY_SOURCE.get(decision.scale_source)


def recipe_yaml(strategy: Strategy, *, header: str = "") -> str:
    """An llm-compressor recipe that calibrates only the FP8 KV-cache scales (weights untouched)."""
    comment = "".join(f"# {line}\n" for line in header.splitlines()) if header else ""
    return comment + (
        "quant_stage:\n"
        "  quant_modifiers:\n"
        "    QuantizationModifier:\n"
        "      kv_cache_scheme:\n"
        "        num_bits: 8\n"
        "        type: float\n"
        f"        strategy: {strategy}\n"
        "        dynamic: false\n"
        "        symmetric: true\n"
    )


def oneshot_command(model: str, recipe: str, output_dir: str, *, dataset: str = DEFAULT_DATASET,
                    num_samples: int = 512, max_seq_length: int = 2048) -> list[str]:
    """The command (argument list) that runs the recipe with llm-compressor's `oneshot`."""
    code = (f"from llmcompressor import oneshot; oneshot(model={model!r}, dataset={dataset!r}, "
            f"recipe={recipe!r}, output_dir={output_dir!r}, max_seq_length={max_seq_length}, "
            f"num_calibration_samples={num_samples})")
    return ["python", "-c", code]


def shell_line(argv: list[str]) -> str:
    """A copy-pasteable command line."""
    return " ".join(shlex.quote(a) for a in argv)


def has_llmcompressor() -> bool:
    """Whether llm-compressor is importable here (not imported: it pulls in torch)."""
    return importlib.util.find_spec("llmcompressor") is not None


def checkpoint_strategy(model_ref: str) -> str | None:
    """`tensor` / `attn_head` when a local checkpoint carries calibrated KV scales, else None."""
    path = Path(model_ref)
    config = path if path.name == "config.json" else path / "config.json"
    if not config.is_file():
        return None
    from kvpolicy.errors import InputError
    from kvpolicy.inputs.safeio import MAX_CONFIG_BYTES, read_json

    try:
        data = read_json(config, what="config.json", max_bytes=MAX_CONFIG_BYTES)
    except InputError:
        return None
    if not isinstance(data, dict):
        return None
    quant = data.get("quantization_config") or data.get("compression_config") or {}
    scheme = quant.get("kv_cache_scheme") if isinstance(quant, dict) else None
    if not isinstance(scheme, dict):
        return None
    return str(scheme.get("strategy") or "tensor")


def is_local_model(model_ref: str) -> bool:
    """Whether the model reference is a folder (or config.json) on this machine."""
    path = Path(model_ref)
    return path.is_dir() or (path.name == "config.json" and path.is_file())


def scale_gap(decision: Decision, model_ref: str) -> str | None:
    """What is missing for the decision's calibrated scales, or None when the checkpoint has them."""
    needed = strategy_for(decision)
    if needed is None:
        return None
    kind = "per-head" if needed == "attn_head" else "per-tensor"
    fix = (f"calibrate with llm-compressor (`kvpolicy calibrate --emit-recipe recipe.yaml`, strategy {needed}) "
           "and serve the calibrated checkpoint")
    if not is_local_model(model_ref):
        return (f"{kind} FP8 scales: kvpolicy cannot see whether `{model_ref}` carries calibrated KV scales "
                f"(kv_cache_scheme strategy {needed}); without them vLLM uses 1.0. If it does not, {fix}.")
    found = checkpoint_strategy(model_ref)
    if found is None:
        return (f"{kind} FP8 scales: `{model_ref}` has no calibrated KV scales (no kv_cache_scheme), "
                f"so vLLM uses 1.0: {fix}.")
    if needed == "attn_head" and found != "attn_head":
        return (f"per-head FP8 scales: `{model_ref}` carries `{found}` KV scales, not per-head (attn_head): {fix}.")
    return None
