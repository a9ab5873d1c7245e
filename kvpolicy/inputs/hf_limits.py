"""What vLLM 0.33 derives from a config before it builds anything: the longest context it accepts,
and what `--kv-cache-dtype auto` means for the checkpoint.

`max_model_len` follows `_get_and_verify_max_len` (`config/model.py`) and
`derive_max_model_len_and_key` (`transformers_utils/model_arch_config_convertor.py`);
`kv_cache_scheme` follows `resolve_kv_cache_dtype_string` (`utils/torch_utils.py`,
ModelOpt checkpoints, engine level) and `Attention.__init__`
(`model_executor/layers/attention/attention.py`, compressed-tensors, per layer).
"""

from __future__ import annotations

from typing import Any

from kvpolicy.inputs.arch import KvCacheScheme

_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
             "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
"""vLLM's keys, in order; the smallest present value wins."""
_FACTOR_NOT_APPLIED = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
"""RoPE types whose max_position_embeddings is already scaled."""
_MODELOPT_KV = {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}
"""`MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP` (utils/torch_utils.py)."""

CLASS_DEFAULT_MAX_LEN = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768}
"""transformers config-class defaults vLLM sees when config.json leaves `max_position_embeddings` out."""


def rope_dicts(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """RoPE parameter dicts (one, or one per layer type when nested), with legacy types patched
    (`patch_legacy_rope_type`, `iter_rope_parameters`: transformers_utils/config.py)."""
    raw = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if not isinstance(raw, dict) or not raw:
        return []
    nested = all(isinstance(v, dict) for v in raw.values())
    out = []
    for d in (raw.values() if nested else [raw]):
        if not isinstance(d, dict) or not d:
            continue
        d = dict(d)
        kind = d.get("rope_type") or d.get("type") or "default"
        kind = {"su": "longrope", "mrope": "default", "telechat3-yarn": "yarn"}.get(kind, kind)
        d["rope_type"] = kind
        out.append(d)
    return out


def max_model_len(cfg: dict[str, Any], model_type: str) -> tuple[int, str]:
    """(the max_model_len vLLM derives, which key and factor it comes from)."""
    derived: float = float("inf")
    key = None
    for k in _LEN_KEYS:
        value = cfg.get(k)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value < derived:
                key = k
            derived = min(derived, value)
    if cfg.get("max_position_embeddings") is None and model_type in CLASS_DEFAULT_MAX_LEN and key is None:
        derived, key = CLASS_DEFAULT_MAX_LEN[model_type], "max_position_embeddings (transformers class default)"
    mml = cfg.get("model_max_length")
    if mml:
        derived, key = mml, "model_max_length"
    if derived == float("inf"):
        return 2048, "no length key in config.json: vLLM assumes 2048"
    basis = f"{key}={int(derived)}"
    rope = rope_dicts(cfg)
    if rope and "gemma3" not in model_type:
        factor: float | None = 1.0
        for rp in rope:
            if rp["rope_type"] not in _FACTOR_NOT_APPLIED:
                factor = rp.get("factor", factor)
        if factor is None:
            factor = 1.0
        if factor != 1.0:
            basis += f" x rope_scaling factor {factor:g} ({rope[-1]['rope_type']})"
            derived *= factor
        elif any("factor" in rp for rp in rope):
            kinds = sorted({rp["rope_type"] for rp in rope if "factor" in rp})
            basis += f" ({'/'.join(kinds)} factor not applied: vLLM treats the length as already scaled)"
    elif rope and "gemma3" in model_type:
        basis += " (Gemma-3: RoPE factor not applied)"
    if any(rp["rope_type"] == "longrope" for rp in rope) and cfg.get("original_max_position_embeddings"):
        # LongRoPE: the default (no --max-model-len) is the original length; the derived limit stays.
        basis += f"; default without --max-model-len: original_max_position_embeddings={cfg['original_max_position_embeddings']}"
    return int(derived), basis + " (config/model.py _get_and_verify_max_len)"


def quantization_config(config: dict[str, Any], text: dict[str, Any],
                        hf_quant_config: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
    """The checkpoint's quantization config with its quant_method normalised, and the file it came from
    (`_normalize_quantization_config`: ModelOpt producers become modelopt / modelopt_fp4 / modelopt_mixed)."""
    q = config.get("quantization_config") or config.get("compression_config") or text.get("quantization_config")
    where = "config.json quantization_config"
    if not isinstance(q, dict) and isinstance(hf_quant_config, dict):
        q, where = hf_quant_config, "hf_quant_config.json"
    if not isinstance(q, dict):
        return None, ""
    q = dict(q)
    producer = (q.get("producer") or {}).get("name") if isinstance(q.get("producer"), dict) else None
    inner = q.get("quantization") if isinstance(q.get("quantization"), dict) else {}
    if producer == "modelopt" or "modelopt_quant_config" in inner:
        algo = str(inner.get("quant_algo") or q.get("quant_algo") or "").upper()
        if algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"):
            q["quant_method"] = "modelopt"
        elif algo == "NVFP4":
            q["quant_method"] = "modelopt_fp4"
        elif algo == "MIXED_PRECISION":
            q["quant_method"] = "modelopt_mixed"
    q["quant_method"] = str(q.get("quant_method") or "").lower().replace("compressed_tensors", "compressed-tensors")
    return q, where


def kv_cache_scheme(q: dict[str, Any] | None, where: str) -> KvCacheScheme | None:
    """The KV-cache part of a (normalised) quantization config, if it declares one."""
    if not q:
        return None
    method = q["quant_method"]
    inner = q.get("quantization") if isinstance(q.get("quantization"), dict) else {}
    if method.startswith("modelopt"):
        raw = inner.get("kv_cache_scheme") or q.get("kv_cache_scheme") or inner.get("kv_cache_quant_algo") \
            or q.get("kv_cache_quant_algo")
        key = next((k for k in ("kv_cache_scheme", "kv_cache_quant_algo") if inner.get(k) or q.get(k)), "")
    else:
        raw = q.get("kv_cache_scheme")
        key = "kv_cache_scheme"
        if method == "quark":
            group = (q.get("export") or {}).get("kv_cache_group") if isinstance(q.get("export"), dict) else None
            if not q.get("kv_cache_quant_config") and not group:
                return None
            raw = q.get("kv_cache_quant_config") or {"group": group}
            key = "kv_cache_quant_config"
    if raw is None or raw == {}:
        return None
    src = f"{where} {key}"
    if isinstance(raw, dict):
        return KvCacheScheme(method=method, num_bits=raw.get("num_bits"), type=raw.get("type"),
                             strategy=raw.get("strategy"), dynamic=raw.get("dynamic"), symmetric=raw.get("symmetric"),
                             source=src)
    return KvCacheScheme(method=method, algo=str(raw), source=src)


def auto_kv_dtype(scheme: KvCacheScheme | None, *, is_mla: bool) -> tuple[str, str]:
    """What `--kv-cache-dtype auto` resolves to, and why."""
    if scheme is None:
        return "auto", "no KV-cache scheme in the checkpoint: the model dtype"
    if scheme.method.startswith("modelopt"):
        # get_kv_cache_quant_algo_string (utils/torch_utils.py): engine level, every layer.
        if scheme.algo is not None:
            value = _MODELOPT_KV.get(scheme.algo.lower(), "auto")
        elif scheme.dynamic is False and scheme.num_bits == 8 and scheme.type == "float":
            value = "fp8"
        elif scheme.num_bits == 4 and scheme.type == "float":
            value = "nvfp4"
        else:
            value = "auto"
        return value, (f"ModelOpt {scheme.source}: auto becomes {value} "
                       "(utils/torch_utils.py resolve_kv_cache_dtype_string)")
    if scheme.method == "compressed-tensors":
        # Attention.__init__ turns auto into fp8 when the quant config has a kv_cache_scheme;
        # MLAAttention does not.
        if is_mla:
            return "auto", (f"compressed-tensors {scheme.source}, but MLA layers keep the model dtype under auto "
                            "(model_executor/layers/attention/mla_attention.py)")
        return "fp8", (f"compressed-tensors {scheme.source}: auto becomes fp8 with the checkpoint's scales "
                       "(model_executor/layers/attention/attention.py Attention.__init__)")
    return "auto", (f"{scheme.method} {scheme.source}: vLLM loads the scales when --kv-cache-dtype fp8 is given; "
                    "auto stays the model dtype (only ModelOpt and compressed-tensors resolve auto)")
