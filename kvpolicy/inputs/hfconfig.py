"""Reading a Hugging Face `config.json` into a `ModelArch`, as vLLM 0.33 reads it.

The one place that knows how HF checkpoints describe a model: the decoder config
(top level, or nested under a multimodal wrapper's `text_config`), the per-layer
caches (`hf_layers.py`, following the models' `get_kv_cache_spec`), the limits
vLLM derives (`hf_limits.py`: max_model_len, what `--kv-cache-dtype auto` means)
and the weights it loads (`hf_weights.py`, or the safetensors index when the
folder has one). Files are read by `read_json` only. The catalog's bundled configs
go through the same `arch_from_hf_config`, so a catalog id and a folder holding
that config.json give the same answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpolicy import noun
from kvpolicy.errors import InputError
from kvpolicy.inputs import hf_layers, hf_limits, hf_weights
from kvpolicy.inputs.arch import ModelArch

_NESTED_KEYS = ("text_config", "llm_config", "language_config", "thinker_config")
"""Where multimodal wrappers keep the decoder's config (`get_text_config`)."""

_TRANSFORMERS_DEFAULTS: dict[str, dict[str, Any]] = {
    # Gemma3TextConfig defaults: google/gemma-3-4b-it's text_config omits them.
    "gemma3_text": {
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 131072,
        "vocab_size": 262208,
        "tie_word_embeddings": True,
    },
    "gemma4_text": {"tie_word_embeddings": True},
    # NemotronHConfig: the 8B-8K config leaves its MLP width out.
    "nemotron_h": {"intermediate_size": 21504, "vocab_size": 131072, "tie_word_embeddings": False},
    # Gemma2 alternates sliding (even index) and full layers.
    "gemma2": {"sliding_window_pattern": 2},
}
"""Defaults the transformers config class supplies when config.json leaves a key out."""

FAMILIES: dict[str, str] = {
    "llama": "llama", "llama4": "llama", "llama4_text": "llama",
    "gpt_oss": "gpt-oss",
    "qwen2": "qwen2", "qwen2_moe": "qwen2", "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen2_5_vl_text": "qwen2",
    "qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen3_vl": "qwen3", "qwen3_vl_text": "qwen3", "qwen3_vl_moe": "qwen3",
    "qwen3_vl_moe_text": "qwen3",
    "qwen3_next": "qwen3.5", "qwen3_5": "qwen3.5", "qwen3_5_text": "qwen3.5", "qwen3_5_moe": "qwen3.5",
    "qwen3_5_moe_text": "qwen3.5",
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3_text": "gemma", "gemma3n": "gemma",
    "gemma3n_text": "gemma", "gemma4": "gemma", "gemma4_text": "gemma",
    "kimi_k2": "kimi", "kimi_k25": "kimi",
    "deepseek_v2": "deepseek", "deepseek_v3": "deepseek", "deepseek_v32": "deepseek",
    "glm4": "glm", "glm4_moe": "glm", "glm4_moe_lite": "glm", "glm_moe_dsa": "glm",
    "minimax_m2": "minimax",
    "mimo": "mimo", "mimo_v2": "mimo", "mimo_v2_flash": "mimo",
    "mistral": "mistral", "mixtral": "mistral", "mistral3": "mistral", "ministral3": "mistral",
    "ministral": "mistral",
    "phi3": "phi", "phi4": "phi", "phimoe": "phi",
    "nemotron_h": "nemotron",
    "jamba": "jamba",
    "granitemoehybrid": "granite",
    "falcon_h1": "falcon",
    "hy_v3": "hunyuan", "hunyuan_v1_dense": "hunyuan", "hunyuan_v1_moe": "hunyuan",
    "lfm2": "lfm",
}
"""HF `model_type` -> kvpolicy family (the wrapper's type wins over the text tower's)."""

_ARCH_MODEL_TYPE = {"DeepseekV3ForCausalLM": "deepseek_v3", "MiMoV2FlashForCausalLM": "mimo_v2"}
"""Architecture -> model_type for configs whose model_type transformers does not know (kimi_k2)."""


def read_json(path: Path, *, required: bool) -> Any:
    """The JSON document at `path` (None when it is absent and not required); errors name the file and the fix.

    Read by the hardened reader (regular file, size cap, UTF-8, strict JSON): a file that is
    present but broken is an error even when optional, since skipping it would change the answer.
    """
    from kvpolicy.inputs.safeio import MAX_CONFIG_BYTES, MAX_INDEX_BYTES, load_json, read_text

    if not required and not path.exists() and not path.is_symlink():
        return None
    cap = MAX_INDEX_BYTES if path.name.endswith(".index.json") else MAX_CONFIG_BYTES
    text = read_text(path, what="a Hugging Face config file", max_bytes=cap)
    try:
        return load_json(text, str(path))
    except InputError as exc:
        raise InputError(f"{exc} A Hugging Face config.json must be one JSON object.") from None


def load_hf_config(path: str | Path, *, model_id: str | None = None, weights_gb: float | None = None) -> ModelArch:
    """Read a local `config.json` (or the folder holding it) into a ModelArch.

    The model id is the folder name. Beside config.json, the folder may hold
    `hf_quant_config.json` (ModelOpt's quantization, when config.json has none) and
    `model.safetensors.index.json`, whose total_size is what vLLM loads.
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
    config = read_json(file, required=True)
    if not isinstance(config, dict):
        raise InputError(
            f"{file}: expected a JSON object of config keys, found a {type(config).__name__}. "
            "Pass the model's config.json."
        )
    if model_id is None:
        model_id = (folder.resolve().name or "local-model") if file.name == "config.json" else file.stem
    weights = None
    hf_quant = None
    if file.name == "config.json":
        hf_quant = read_json(folder / "hf_quant_config.json", required=False)
        total = _index_total(read_json(folder / "model.safetensors.index.json", required=False))
        if total is not None:
            weights = (total, f"model.safetensors.index.json total_size ({total:,} bytes)")
        elif (files := _safetensors_files_bytes(folder)) is not None:
            weights = (files, f"*.safetensors files in {folder} ({files:,} bytes)")
    return arch_from_hf_config(config, model_id, str(file), hf_quant_config=hf_quant, checkpoint_bytes=weights,
                               weights_gb=weights_gb)


def arch_from_hf_config(config: dict[str, Any], model_id: str, source: str, *,
                        hf_quant_config: dict[str, Any] | None = None,
                        checkpoint_bytes: tuple[int, str] | None = None,
                        weights_gb: float | None = None, meta: dict[str, Any] | None = None) -> ModelArch:
    """Build a ModelArch from a parsed HF config; `source` names the file in errors.

    `checkpoint_bytes` (bytes, basis) is the safetensors total when known; `weights_gb`
    overrides every weight figure; `meta` adds catalog fields (hf_id, aliases, family).
    """
    cfg, nested_in = _decoder_config(config)
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    archs = [str(a) for a in (config.get("architectures") or cfg.get("architectures") or []) if a]
    arch_name = archs[0] if archs else ""
    if model_type in ("kimi_k2",) or (not model_type and arch_name in _ARCH_MODEL_TYPE):
        model_type = model_type or _ARCH_MODEL_TYPE[arch_name]
    defaults = _TRANSFORMERS_DEFAULTS.get(model_type)
    if defaults:
        cfg = {**defaults, **cfg}
    where = f"{source} ({nested_in})" if nested_in else source
    check_numbers(cfg, where)
    if nested_in:
        check_numbers(config, source)

    num_layers = _positive_int(cfg, "num_hidden_layers", where)
    num_heads = _positive_int(cfg, "num_attention_heads", where)
    model_dtype = _model_dtype(config, cfg)
    layers = hf_layers.build_layers(cfg, model_type=model_type, arch=arch_name, num_layers=num_layers,
                                    num_heads=num_heads, model_dtype=model_dtype, where=where)
    rules = hf_layers.tp_rules(cfg, layers, num_heads=num_heads, model_type=model_type, arch=arch_name)
    mml, mml_basis = hf_limits.max_model_len(cfg, model_type)
    q, q_where = hf_limits.quantization_config(config, cfg, hf_quant_config)
    scheme = hf_limits.kv_cache_scheme(q, q_where)
    is_mla = bool(cfg.get("kv_lora_rank"))
    auto, auto_basis = hf_limits.auto_kv_dtype(scheme, is_mla=is_mla)

    mods = hf_weights.modules(cfg, config, layers, model_type=model_type, num_heads=num_heads)
    wscheme = hf_weights.scheme(q)
    shape_bytes, params = hf_weights.weights_bytes(mods, wscheme)
    mtp = int(cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers")
              or (cfg.get("num_mtp_modules") if cfg.get("use_mtp") else 0) or 0)
    mtp_note = f"; {mtp} MTP {noun(mtp, 'layer')} left out (vLLM's main model skips them)" if mtp else ""
    if checkpoint_bytes is not None:
        w_bytes, w_basis = checkpoint_bytes
        w_basis += f"; the config's shapes give {shape_bytes / 1e9:.1f} GB ({params / 1e9:.2f}B parameters, {wscheme.label})"
    else:
        w_bytes = shape_bytes
        w_basis = f"config shapes: {params / 1e9:.2f}B parameters, {wscheme.label}{mtp_note}"
    if weights_gb is not None:
        w_basis = f"--weights-gb {weights_gb:g} (override; {w_basis})"

    attn = [s for s in layers if s.kind in ("full", "sliding", "chunked")]
    first = attn[0] if attn else None
    heads = first.num_kv_heads if first else hf_layers.num_kv_heads(cfg, num_heads)
    head = hf_layers.head_size(cfg, num_heads, where) if not is_mla else \
        _positive_int(cfg, "qk_nope_head_dim", where) + _positive_int(cfg, "qk_rope_head_dim", where)
    sliding = [s for s in layers if s.kind == "sliding"]
    if sliding:
        head = sliding[0].head_size
    full = [s for s in layers if s.kind == "full"]
    full_head = full[0].head_size if full and full[0].head_size != head else None
    v_head = cfg.get("v_head_dim") if is_mla else (first.head_size_v if first and first.head_size_v != first.head_size
                                                   else None)
    family = FAMILIES.get(str(config.get("model_type") or ""), FAMILIES.get(model_type, model_type.replace("_", "-")))
    fields: dict[str, Any] = {
        "id": model_id,
        "family": family,
        "model_type": model_type,
        "architecture": arch_name,
        "num_layers": num_layers,
        "layers": layers,
        "num_attention_heads": num_heads,
        "num_kv_heads": heads if not is_mla else hf_layers.num_kv_heads(cfg, num_heads),
        "head_dim": head,
        "v_head_dim": v_head or None,
        "full_head_dim": full_head,
        "sliding_window": sliding[0].window if sliding else None,
        "attention": "mla" if is_mla else _attention_kind(num_heads, heads),
        "kv_lora_rank": cfg.get("kv_lora_rank") or None,
        "qk_rope_head_dim": cfg.get("qk_rope_head_dim") if is_mla else None,
        "has_attention_sinks": _has_sinks(config, cfg, model_type),
        "rotary_dim": _rotary_dim(cfg, head),
        "max_position_embeddings": cfg.get("max_position_embeddings") or None,
        "max_model_len": mml,
        "max_model_len_basis": mml_basis,
        "model_dtype": model_dtype,
        "quant_method": (q or {}).get("quant_method") or "",
        "kv_cache_scheme": scheme,
        "auto_kv_dtype": auto,
        "auto_kv_basis": auto_basis,
        "weights_bytes": w_bytes,
        "weights_basis": w_basis,
        "weights_gb": weights_gb,
        "params_b": round(params / 1e9, 3) or None,
        "active_params_b": round(hf_weights.active_matmul_params(mods, cfg) / 1e9, 3) or None,
        "tp_rules": rules,
        "source": source,
    }
    if meta:
        fields.update({k: v for k, v in meta.items() if v is not None})
    return _build(fields, where)


# -- pieces -----------------------------------------------------------------------------


def _decoder_config(config: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The decoder's own config: the nested text tower of a multimodal wrapper, or the top level."""
    for key in _NESTED_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict) and ("num_hidden_layers" in nested or "num_hidden_layers" not in config):
            return nested, key
    return config, None


def _model_dtype(config: dict[str, Any], cfg: dict[str, Any]) -> str:
    """`--dtype auto` (config/model.py _resolve_auto_dtype): bf16/fp16 kept, float32 -> bfloat16 on SM80+."""
    raw = config.get("torch_dtype") or config.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    raw = str(raw).removeprefix("torch.")
    return "float16" if raw == "float16" else "bfloat16"


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


_INT = (int,)
_NUM = (int, float)
_BOUNDS: dict[str, tuple[tuple[type, ...], float, float]] = {
    # key: (types, lowest, highest). Ranges are far beyond any released model and far below what
    # would make kvpolicy build millions of layer objects or overflow a byte count.
    "num_hidden_layers": (_INT, 1, 4096),
    "num_attention_heads": (_INT, 1, 16384),
    "num_key_value_heads": (_INT, 1, 16384),
    "head_dim": (_INT, 1, 65536),
    "hidden_size": (_INT, 1, 1 << 20),
    "intermediate_size": (_INT, 0, 1 << 24),
    "moe_intermediate_size": (_INT, 0, 1 << 24),
    "shared_expert_intermediate_size": (_INT, 0, 1 << 24),
    "vocab_size": (_INT, 1, 1 << 27),
    "max_position_embeddings": (_INT, 1, 1 << 31),
    "sliding_window": (_INT, 0, 1 << 31),
    "num_experts": (_INT, 0, 1 << 16),
    "num_local_experts": (_INT, 0, 1 << 16),
    "n_routed_experts": (_INT, 0, 1 << 16),
    "n_shared_experts": (_INT, 0, 1 << 16),
    "num_experts_per_tok": (_INT, 0, 1 << 16),
    "kv_lora_rank": (_INT, 0, 65536),
    "q_lora_rank": (_INT, 0, 65536),
    "qk_nope_head_dim": (_INT, 0, 65536),
    "qk_rope_head_dim": (_INT, 0, 65536),
    "v_head_dim": (_INT, 0, 65536),
    "num_nextn_predict_layers": (_INT, 0, 4096),
    "rotary_dim": (_INT, 0, 65536),
    "partial_rotary_factor": (_NUM, 0, 1),
    "rope_theta": (_NUM, 0, 1e15),
}
"""Numeric config.json keys kvpolicy reads, with their type and range (null means "not set")."""


def check_numbers(cfg: dict[str, Any], where: str) -> None:
    """Refuse a config whose numbers are of the wrong type, not finite or out of range, naming key and range.

    `num_key_value_heads: 0` would otherwise read as "not set" (multi-head attention) and
    `num_hidden_layers: 1e8` would build a hundred million layer objects.
    """
    import math

    for key, (types, low, high) in _BOUNDS.items():
        value = cfg.get(key)
        if value is None or (key == "sliding_window" and value is False):
            continue
        whole = types is _INT
        ok = not isinstance(value, bool) and isinstance(value, _NUM) and math.isfinite(value)
        if ok and whole and isinstance(value, float):
            ok = value.is_integer()
        if not ok or not low <= value <= high:
            kind = "a whole number" if whole else "a number"
            raise InputError(f"{where}: `{key}` is {str(value)[:40]!r}; it must be {kind} in {low:g}..{high:g}. "
                             "Fix the value (or check this is the model's config.json).")


def _attention_kind(num_heads: int, num_kv_heads: int) -> str:
    if num_kv_heads == num_heads:
        return "mha"
    return "mqa" if num_kv_heads == 1 else "gqa"


def _has_sinks(config: dict[str, Any], cfg: dict[str, Any], model_type: str) -> bool:
    """Learned sink logits: gpt-oss (model type only), MiMo-V2's SWA layers (add_swa_attention_sink_bias)."""
    archs = [str(a) for a in (config.get("architectures") or []) if a]
    if "gpt_oss" in (model_type, str(config.get("model_type"))) or any(a.startswith("GptOss") for a in archs):
        return True
    return bool(cfg.get("add_swa_attention_sink_bias") or cfg.get("add_full_attention_sink_bias"))


def _rotary_dim(cfg: dict[str, Any], head: int) -> int | None:
    """`rope_dim_from_hf_config` (v1/attention/ops/rocm_octave.py): head_size x partial_rotary_factor."""
    if cfg.get("rotary_dim"):
        return int(cfg["rotary_dim"])
    factor = cfg.get("partial_rotary_factor")
    if factor is None:
        rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        factor = rope.get("partial_rotary_factor", 1.0)
    try:
        return int(head * float(factor))
    except (TypeError, ValueError):
        return None


def _index_total(index: Any) -> int | None:
    if not isinstance(index, dict):
        return None
    meta = index.get("metadata")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    return int(total) if isinstance(total, (int, float)) and not isinstance(total, bool) and total > 0 else None


def _safetensors_files_bytes(folder: Path) -> int | None:
    """Bytes of the *.safetensors files in the folder (weights present but no index)."""
    try:
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    except OSError:
        return None
    return size if size > 0 else None


def _build(fields: dict[str, Any], where: str) -> ModelArch:
    from pydantic import ValidationError

    try:
        return ModelArch(**fields)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise InputError(f"{where}: the config does not describe a valid model ({problems}). Fix those keys.") from None
