"""Reading a Hugging Face `config.json` into a `ModelArch`.

The one place that knows how HF configs spell the KV layout: `num_key_value_heads`
(absent means MHA), explicit `head_dim`, sliding windows (`layer_types`, Gemma's
`sliding_window_pattern`, Qwen2's `use_sliding_window`/`max_window_layers`, or one
window on every layer as in Mistral v0.1), MLA (`kv_lora_rank`), layers without a
per-token cache (Qwen3.5 / Qwen3-Next `linear_attention`, Jamba's
`attn_layer_period`, NemotronH's `hybrid_override_pattern`, Granite-4.0-H's
`layer_types: mamba`, Qwen3-Next's `full_attention_interval`, LFM2's
`full_attn_idxs`), KV sharing (Gemma 3n/4 `num_kv_shared_layers`) and multimodal
wrappers that nest the decoder under `text_config`. Falcon-H1 runs attention
beside Mamba in every layer, so all its layers are full attention here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvpolicy.errors import InputError
from kvpolicy.inputs.arch import LayerKind, ModelArch

_NESTED_KEYS = ("text_config", "llm_config", "language_config")
"""Where multimodal wrappers keep the decoder's config."""

_LAYER_TYPE_KINDS: dict[str, LayerKind] = {
    "full_attention": "full",
    "attention": "full",
    "global_attention": "full",
    "global": "full",
    "full": "full",
    "sliding_attention": "sliding",
    "sliding_window_attention": "sliding",
    "local_attention": "sliding",
    "local": "sliding",
    "sliding": "sliding",
    "linear_attention": "linear",
    "mamba": "linear",
    "mamba2": "linear",
    "conv": "linear",
    "linear": "linear",
}
"""`layer_types` / `layers_block_type` spellings and the cache kind each means."""

_BLOCK_TYPE_KINDS: dict[str, LayerKind] = {
    **_LAYER_TYPE_KINDS,
    # Attention-free MLP / MoE blocks hold no cache; `linear` is the closest kind
    # (no per-token KV) until ModelArch has a kind for cache-free blocks.
    "mlp": "linear",
    "moe": "linear",
}

_PATTERN_KINDS: dict[str, LayerKind] = {"*": "full", "M": "linear", "-": "linear", "E": "linear"}
"""NemotronH `hybrid_override_pattern`: `*` attention, `M` Mamba-2, `-` MLP, `E` MoE."""

_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    # Gemma3TextConfig defaults: google/gemma-3-4b-it's text_config omits them.
    "gemma3_text": {
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 131072,
    },
    # Gemma2 alternates sliding (even index) and full layers.
    "gemma2": {"sliding_window_pattern": 2},
}
"""Defaults the transformers config class supplies when config.json leaves a key out."""

_FAMILIES: dict[str, str] = {
    "llama": "llama",
    "gpt_oss": "gpt-oss",
    "qwen2": "qwen2",
    "qwen2_moe": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "qwen3_next": "qwen3.5",
    "qwen3_5": "qwen3.5",
    "qwen3_5_text": "qwen3.5",
    "qwen3_5_moe": "qwen3.5",
    "qwen3_5_moe_text": "qwen3.5",
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3_text": "gemma",
    "gemma3n": "gemma",
    "gemma3n_text": "gemma",
    "gemma4": "gemma",
    "gemma4_text": "gemma",
    "kimi_k2": "kimi",
    "kimi_k25": "kimi",
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    "minimax_m2": "minimax",
    "mistral": "mistral",
    "mixtral": "mistral",
    "mistral3": "mistral",
    "ministral3": "mistral",
    "nemotron_h": "nemotron",
    "jamba": "jamba",
    "granitemoehybrid": "granite",
    "falcon_h1": "falcon",
}
"""HF `model_type` -> kvpolicy family (the wrapper's type wins over the text tower's)."""


def load_hf_config(path: str | Path) -> ModelArch:
    """Read a local `config.json` (or the folder holding it) into a ModelArch.

    The model id is the folder name. When the folder also holds the weights,
    `weights_gb` is taken from `model.safetensors.index.json` (or the size of the
    `*.safetensors` files), which is what vLLM loads, quantized or not.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        folder, file = path, path / "config.json"
        if not file.is_file():
            raise InputError(
                f"{path}: this folder has no config.json. Pass the folder of a Hugging Face "
                "checkpoint (the one with config.json) or the config.json file itself."
            )
    else:
        folder, file = path.parent, path
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(
            f"{file}: file not found. Pass an existing config.json or its folder "
            f"(relative paths start at {Path.cwd()})."
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{file}: cannot be read ({exc}). Check the file's permissions and encoding.") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{file}:{exc.lineno}:{exc.colno}: invalid JSON ({exc.msg}). "
            "A Hugging Face config.json must be one JSON object; fix the syntax there."
        ) from None
    if not isinstance(config, dict):
        raise InputError(
            f"{file}: expected a JSON object of config keys, found a {type(config).__name__}. "
            "Pass the model's config.json."
        )
    model_id = (folder.resolve().name or "local-model") if file.name == "config.json" else file.stem
    arch = arch_from_hf_config(config, model_id, str(file))
    weights_gb = _checkpoint_gb(folder)
    if weights_gb is not None:
        arch = arch.model_copy(update={"weights_gb": weights_gb})
    return arch


def arch_from_hf_config(config: dict[str, Any], model_id: str, source: str) -> ModelArch:
    """Build a ModelArch from a parsed HF config; `source` names the file in errors."""
    cfg, nested_in = _decoder_config(config)
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    defaults = _TRANSFORMERS_DEFAULTS.get(model_type)
    if defaults:
        cfg = {**defaults, **cfg}
    where = f"{source} ({nested_in})" if nested_in else source

    num_layers = _positive_int(cfg, "num_hidden_layers", where)
    num_heads = _positive_int(cfg, "num_attention_heads", where)
    num_kv_heads = _positive_int(cfg, "num_key_value_heads", where) if cfg.get("num_key_value_heads") else num_heads
    family = _FAMILIES.get(str(config.get("model_type") or ""), _FAMILIES.get(model_type, model_type.replace("_", "-")))
    fields: dict[str, Any] = {
        "id": model_id,
        "family": family,
        "num_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "max_position_embeddings": cfg.get("max_position_embeddings") or None,
        "has_attention_sinks": _has_sinks(config, cfg),
        "source": source,
    }

    if cfg.get("kv_lora_rank"):
        # MLA: one latent (kv_lora_rank) plus the decoupled RoPE key per token and layer.
        nope = _positive_int(cfg, "qk_nope_head_dim", where)
        rope = _positive_int(cfg, "qk_rope_head_dim", where)
        fields.update(
            attention="mla",
            kv_lora_rank=_positive_int(cfg, "kv_lora_rank", where),
            qk_rope_head_dim=rope,
            head_dim=nope + rope,
            v_head_dim=cfg.get("v_head_dim") or None,
            layer_types=["mla"] * num_layers,
        )
        return _build(fields, where)

    head_dim = _head_dim(cfg, num_heads, where)
    global_head_dim = cfg.get("global_head_dim")
    types = _layer_types(cfg, num_layers, where)
    window = cfg.get("sliding_window") if "sliding" in types else None
    if "sliding" in types and not window:
        raise InputError(
            f"{where}: the config declares sliding-window layers but `sliding_window` is "
            f"{cfg.get('sliding_window')!r}. Add the window size in tokens as `sliding_window`."
        )
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    if shared:
        if not 0 < shared < num_layers:
            raise InputError(
                f"{where}: `num_kv_shared_layers` is {shared}, but it must be between 1 and "
                f"num_hidden_layers - 1 ({num_layers - 1}). Fix the value or remove the key."
            )
        types = [t if i < num_layers - shared else "shared" for i, t in enumerate(types)]
    fields.update(
        attention=_attention_kind(num_heads, num_kv_heads),
        head_dim=head_dim,
        full_head_dim=global_head_dim if global_head_dim and global_head_dim != head_dim else None,
        sliding_window=window,
        layer_types=types,
    )
    return _build(fields, where)


# -- pieces -----------------------------------------------------------------------------


def _decoder_config(config: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The decoder's own config: the nested text tower of a multimodal wrapper, or the top level."""
    for key in _NESTED_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict) and ("num_hidden_layers" in nested or "num_hidden_layers" not in config):
            return nested, key
    return config, None


def _positive_int(cfg: dict[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if value is None:
        raise InputError(
            f"{where}: required key `{key}` is missing. A Hugging Face config.json of a decoder "
            "model has it; check this is the model's config.json (not generation_config.json), "
            "or pick a catalog model (`kvpolicy models`)."
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value <= 0:
        raise InputError(f"{where}: `{key}` is {value!r}; it must be a positive whole number. Fix the value.")
    return int(value)


def _head_dim(cfg: dict[str, Any], num_heads: int, where: str) -> int:
    for key in ("head_dim", "attention_head_dim"):
        if cfg.get(key):
            return _positive_int(cfg, key, where)
    hidden = cfg.get("hidden_size")
    if not hidden:
        raise InputError(
            f"{where}: neither `head_dim` nor `hidden_size` is set, so the head dimension is unknown. "
            "Add `head_dim` (or `hidden_size`, from which head_dim = hidden_size / num_attention_heads)."
        )
    return _positive_int(cfg, "hidden_size", where) // num_heads


def _attention_kind(num_heads: int, num_kv_heads: int) -> str:
    if num_kv_heads == num_heads:
        return "mha"
    return "mqa" if num_kv_heads == 1 else "gqa"


def _has_sinks(config: dict[str, Any], cfg: dict[str, Any]) -> bool:
    """gpt-oss learns a sink logit per head; its configs say so only through the model type."""
    types = {str(config.get("model_type")), str(cfg.get("model_type"))}
    archs = [str(a) for a in (config.get("architectures") or []) if a]
    return "gpt_oss" in types or any(a.startswith("GptOss") for a in archs)


def _layer_types(cfg: dict[str, Any], num_layers: int, where: str) -> list[LayerKind]:
    """Per-layer cache kind from whichever spelling the config uses; all full when none."""
    for key, kinds in (("layer_types", _LAYER_TYPE_KINDS), ("layers_block_type", _BLOCK_TYPE_KINDS)):
        listed = cfg.get(key)
        if isinstance(listed, list) and listed:
            return _mapped(listed, kinds, key, num_layers, where)
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        return _mapped(list(pattern), _PATTERN_KINDS, "hybrid_override_pattern", num_layers, where)
    period = cfg.get("attn_layer_period")
    if period:
        # Jamba: attention where index % period == offset, Mamba elsewhere.
        offset = int(cfg.get("attn_layer_offset") or 0)
        return ["full" if i % int(period) == offset else "linear" for i in range(num_layers)]
    interval = cfg.get("full_attention_interval")
    if interval and cfg.get("linear_num_value_heads"):
        # Qwen3-Next without an explicit list: every interval-th layer is full attention.
        return ["full" if (i + 1) % int(interval) == 0 else "linear" for i in range(num_layers)]
    attn_idxs = cfg.get("full_attn_idxs")
    if isinstance(attn_idxs, list):
        # LFM2: attention at the listed indices, short convolutions elsewhere.
        return ["full" if i in set(attn_idxs) else "linear" for i in range(num_layers)]
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return ["full"] * num_layers
    every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
    if every:
        # Gemma 2/3, Cohere2: every `every`-th layer (index every-1, 2*every-1, ...) is global.
        return ["full" if (i + 1) % int(every) == 0 else "sliding" for i in range(num_layers)]
    if cfg.get("use_sliding_window") is True and "max_window_layers" in cfg:
        # Qwen2: layers from max_window_layers on use the window.
        first = int(cfg.get("max_window_layers") or 0)
        return ["sliding" if i >= first else "full" for i in range(num_layers)]
    # Mistral v0.1, Phi-3: one window on every layer.
    return ["sliding"] * num_layers


def _mapped(
    listed: list[Any], kinds: dict[str, LayerKind], key: str, num_layers: int, where: str
) -> list[LayerKind]:
    if len(listed) != num_layers:
        raise InputError(
            f"{where}: `{key}` lists {len(listed)} layers but num_hidden_layers is {num_layers}. "
            "The two must agree; fix one of them."
        )
    out: list[LayerKind] = []
    for i, raw in enumerate(listed):
        kind = kinds.get(str(raw)) if key == "hybrid_override_pattern" else kinds.get(str(raw).lower())
        if kind is None:
            allowed = ", ".join(f"`{k}`" for k in kinds)
            raise InputError(
                f"{where}: `{key}[{i}]` is {raw!r}, a layer kind kvpolicy does not know. "
                f"Known: {allowed}. Use a catalog model (`kvpolicy models`) or report the kind."
            )
        out.append(kind)
    return out


def _build(fields: dict[str, Any], where: str) -> ModelArch:
    from pydantic import ValidationError

    try:
        return ModelArch(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise InputError(f"{where}: the config does not describe a valid model ({problems}). Fix those keys.") from None


def _checkpoint_gb(folder: Path) -> float | None:
    """Checkpoint size in GB (1e9 bytes) from the safetensors index or files, if present."""
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            total = json.loads(index.read_text(encoding="utf-8")).get("metadata", {}).get("total_size")
            if isinstance(total, (int, float)) and total > 0:
                return round(total / 1e9, 3)
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    except (OSError, ValueError, AttributeError):
        return None
    return round(size / 1e9, 3) if size > 0 else None
