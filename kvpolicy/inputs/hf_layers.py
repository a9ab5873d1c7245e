"""Per-layer KV cache modules of a Hugging Face config, built the way vLLM 0.33's models build them.

`build_layers` follows each model's `get_kv_cache_spec` inputs (paths relative to
`vllm/`): which decoder layers hold full, sliding-window, chunked-local or MLA
attention, their KV heads and head sizes, the sparse-MLA indexer, KV sharing, and
the recurrent state of Mamba-family layers. `tp_rules` lists the divisibility
checks vLLM applies to the tensor-parallel size. Both read the decoder (text)
config only.
"""

from __future__ import annotations

from typing import Any

from kvpolicy import noun
from kvpolicy.errors import InputError
from kvpolicy.inputs.arch import LayerSpec, RecurrentState, TpRule

_SLIDING = {"sliding_attention", "sliding_window_attention", "local_attention", "local", "sliding"}
_FULL = {"full_attention", "attention", "global_attention", "global", "full", "hybrid", "indexed_attention",
         "chunked_attention"}
_RECURRENT = {"linear_attention": "gdn", "mamba": "mamba", "mamba2": "mamba", "conv": "conv"}
_NO_CACHE = {"mlp", "moe"}
_PATTERN = {"*": "full", "M": "mamba", "-": "none", "E": "none"}
"""NemotronH `hybrid_override_pattern`: `*` attention, `M` Mamba-2, `-` MLP, `E` MoE (`models/nemotron_h.py`)."""

_LINEAR = "model_executor/layers/linear.py QKVParallelLinear (divide)"
_MODEL = "config/model.py ModelConfig.verify_with_parallel_config"


def num_kv_heads(cfg: dict[str, Any], num_heads: int) -> int:
    """`CONFIG_FIELD_ALIASES` (`transformers_utils/config.py`): the first KV-head key present, else MHA."""
    for key in ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups"):
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return num_heads


def head_size(cfg: dict[str, Any], num_heads: int, where: str) -> int:
    """`get_head_size` (`transformers_utils/model_arch_config_convertor.py`): head_dim, else hidden / heads."""
    for key in ("head_dim", "attention_head_dim", "hidden_size_per_head"):
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    hidden = cfg.get("hidden_size")
    if not isinstance(hidden, int) or hidden <= 0:
        raise InputError(
            f"{where}: neither `head_dim` nor `hidden_size` is set, so the head dimension is unknown. "
            "Add `head_dim` (or `hidden_size`, from which head_dim = hidden_size / num_attention_heads)."
        )
    return hidden // num_heads


def build_layers(cfg: dict[str, Any], *, model_type: str, arch: str, num_layers: int, num_heads: int,
                 model_dtype: str, where: str) -> list[LayerSpec]:
    """The cache modules of every decoder layer, in index order."""
    mt = model_type
    if cfg.get("kv_lora_rank"):
        return _mla_layers(cfg, num_layers, where)
    heads = num_kv_heads(cfg, num_heads)
    hd = head_size(cfg, num_heads, where)
    if mt == "gpt_oss" or arch.startswith("GptOss"):
        # models/gpt_oss.py: even layers sliding (config.layer_types is not read); heads // tp without max(1, ...).
        window = _window(cfg, where)
        return [LayerSpec(index=i, kind="sliding" if i % 2 == 0 else "full", num_kv_heads=heads, head_size=hd,
                          head_size_v=hd, window=window if i % 2 == 0 else None, replicate_kv=False)
                for i in range(num_layers)]
    if mt.startswith("llama4"):
        return _llama4_layers(cfg, num_layers, heads, hd)
    if mt.startswith("mimo_v2") or "hybrid_layer_pattern" in cfg:
        return _mimo_layers(cfg, num_layers, heads, hd, where)
    if mt.startswith("gemma4"):
        return _gemma4_layers(cfg, num_layers, heads, hd, where)
    if mt.startswith("falcon_h1"):
        return _falcon_h1_layers(cfg, num_layers, heads, hd, model_dtype)
    if mt == "nemotron_h" or isinstance(cfg.get("hybrid_override_pattern"), str):
        return _nemotron_h_layers(cfg, num_layers, heads, hd, where)
    if mt == "jamba" or cfg.get("attn_layer_period"):
        return _jamba_layers(cfg, num_layers, heads, hd, model_dtype)
    if cfg.get("linear_num_value_heads"):
        return _gdn_layers(cfg, num_layers, heads, hd, model_type, model_dtype, where)
    if mt.startswith("lfm2"):
        return _lfm2_layers(cfg, num_layers, heads, hd, model_dtype, where)
    if mt == "granitemoehybrid":
        return _granite_hybrid_layers(cfg, num_layers, heads, hd, model_dtype, where)
    kinds = _attention_kinds(cfg, num_layers, mt, where)
    window = _window(cfg, where) if "sliding" in kinds else None
    layers = [LayerSpec(index=i, kind=k, num_kv_heads=heads, head_size=hd, head_size_v=hd,
                        window=window if k == "sliding" else None) for i, k in enumerate(kinds)]
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    if shared:
        layers = _gemma3n_sharing(layers, shared, num_layers, where)
    return layers


# -- attention models ------------------------------------------------------------------


def _window(cfg: dict[str, Any], where: str) -> int:
    window = cfg.get("sliding_window") or cfg.get("sliding_window_size")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise InputError(
            f"{where}: the config declares sliding-window layers but `sliding_window` is "
            f"{cfg.get('sliding_window')!r}. Add the window size in tokens as `sliding_window`."
        )
    return window


def _attention_kinds(cfg: dict[str, Any], num_layers: int, model_type: str, where: str) -> list[str]:
    """full/sliding per layer: `layer_types` (llama.py, gemma3.py...), Gemma's pattern, or one model-level window."""
    listed = cfg.get("layer_types")
    if isinstance(listed, list) and listed:
        _check_len(listed, "layer_types", num_layers, where)
        out = []
        for i, raw in enumerate(listed):
            name = str(raw).lower()
            if name in _SLIDING:
                out.append("sliding")
            elif name in _FULL:
                out.append("full")
            else:
                raise InputError(
                    f"{where}: `layer_types[{i}]` is {raw!r}, a layer kind kvpolicy does not know for "
                    f"model_type {model_type!r}. Known: {', '.join(sorted(_SLIDING | _FULL | set(_RECURRENT)))}."
                )
        return out
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return ["full"] * num_layers
    every = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
    if every:
        # transformers' Gemma2/3 (and Cohere2) configs: every `every`-th layer is global.
        return ["full" if (i + 1) % int(every) == 0 else "sliding" for i in range(num_layers)]
    if cfg.get("use_sliding_window") is True and "max_window_layers" in cfg:
        # transformers' Qwen2Config: layers from max_window_layers on use the window.
        first = int(cfg.get("max_window_layers") or 0)
        return ["sliding" if i >= first else "full" for i in range(num_layers)]
    # No layer_types and a window: vLLM sets cache_config.sliding_window for every layer
    # (engine/arg_utils.py create_engine_config; Mistral v0.1, Phi-3-mini).
    return ["sliding"] * num_layers


def _gemma3n_sharing(layers: list[LayerSpec], shared: int, num_layers: int, where: str) -> list[LayerSpec]:
    """Gemma-3n: the last `num_kv_shared_layers` read layer first-2 (sliding) or first-1 (full) (models/gemma3n.py)."""
    if not 0 < shared < num_layers:
        raise InputError(
            f"{where}: `num_kv_shared_layers` is {shared}, but it must be between 1 and "
            f"num_hidden_layers - 1 ({num_layers - 1}). Fix the value or remove the key."
        )
    first = num_layers - shared
    out = list(layers[:first])
    for spec in layers[first:]:
        target = first - (2 if spec.kind == "sliding" else 1)
        out.append(LayerSpec(index=spec.index, kind="shared", shared_with=target))
    return out


def _llama4_layers(cfg: dict[str, Any], num_layers: int, heads: int, hd: int) -> list[LayerSpec]:
    """models/llama4.py: no_rope_layers[i] == 0 is a global NoPE layer; the others are chunked local."""
    chunk = cfg.get("attention_chunk_size")
    nope = cfg.get("no_rope_layers")
    if not isinstance(nope, list) or len(nope) != num_layers:
        step = int(cfg.get("no_rope_layer_interval") or 4)
        nope = [0 if (i + 1) % step == 0 else 1 for i in range(num_layers)]
    out = []
    for i in range(num_layers):
        local = bool(chunk) and nope[i] != 0
        out.append(LayerSpec(index=i, kind="chunked" if local else "full", num_kv_heads=heads, head_size=hd,
                             head_size_v=hd, chunk=int(chunk) if local else None))
    return out


def _mimo_layers(cfg: dict[str, Any], num_layers: int, heads: int, hd: int, where: str) -> list[LayerSpec]:
    """models/mimo_v2.py: hybrid_layer_pattern[i] == 1 is an SWA layer with its own heads and head dims."""
    pattern = cfg.get("hybrid_layer_pattern")
    if not isinstance(pattern, list):
        raise InputError(f"{where}: MiMo-V2 needs `hybrid_layer_pattern` (one 0/1 per layer).")
    _check_len(pattern, "hybrid_layer_pattern", num_layers, where)
    window = cfg.get("sliding_window_size") or cfg.get("sliding_window")
    v = cfg.get("v_head_dim") or hd
    swa_heads = cfg.get("swa_num_key_value_heads") or heads
    swa_hd = cfg.get("swa_head_dim") or hd
    swa_v = cfg.get("swa_v_head_dim") or swa_hd
    out = []
    for i, p in enumerate(pattern):
        if p == 1:
            out.append(LayerSpec(index=i, kind="sliding", num_kv_heads=swa_heads, head_size=swa_hd, head_size_v=swa_v,
                                 window=int(window) if window else _window(cfg, where)))
        else:
            out.append(LayerSpec(index=i, kind="full", num_kv_heads=heads, head_size=hd, head_size_v=v))
    return out


def _gemma4_layers(cfg: dict[str, Any], num_layers: int, heads: int, hd: int, where: str) -> list[LayerSpec]:
    """models/gemma4.py: per_layer_config head_dim / KV heads (global_head_dim, num_global_key_value_heads
    on full layers, as transformers' Gemma4 config builds them); the last num_kv_shared_layers share KV."""
    kinds = _attention_kinds(cfg, num_layers, "gemma4", where)
    window = _window(cfg, where) if "sliding" in kinds else None
    full_hd = cfg.get("global_head_dim") or hd
    full_heads = cfg.get("num_global_key_value_heads") or heads
    layers = []
    for i, k in enumerate(kinds):
        if k == "sliding":
            layers.append(LayerSpec(index=i, kind="sliding", num_kv_heads=heads, head_size=hd, head_size_v=hd,
                                    window=window))
        else:
            # attention_k_eq_v loads K weights into V; V is still cached.
            layers.append(LayerSpec(index=i, kind="full", num_kv_heads=full_heads, head_size=full_hd,
                                    head_size_v=full_hd))
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    if not shared:
        return layers
    if not 0 < shared < num_layers:
        raise InputError(
            f"{where}: `num_kv_shared_layers` is {shared}, but it must be between 1 and "
            f"num_hidden_layers - 1 ({num_layers - 1}). Fix the value or remove the key."
        )
    first = num_layers - shared
    out = layers[:first]
    for spec in layers[first:]:
        # The last non-shared layer of the same attention type.
        same = [s.index for s in layers[:first] if s.kind == spec.kind]
        out.append(LayerSpec(index=spec.index, kind="shared", shared_with=same[-1] if same else None))
    return out


def _mla_layers(cfg: dict[str, Any], num_layers: int, where: str) -> list[LayerSpec]:
    """DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash: one latent per token (mla_attention.py: head_size =
    kv_lora_rank + qk_rope_head_dim, 1 KV head); DeepSeek-V3.2 / GLM-5 add an indexer cache."""
    rank = _int(cfg, "kv_lora_rank", where)
    rope = _int(cfg, "qk_rope_head_dim", where)
    index_dim = cfg.get("index_head_dim") if cfg.get("index_topk") else None
    freq = int(cfg.get("index_topk_freq") or 1)
    pattern = cfg.get("index_topk_pattern")
    offset = int(cfg.get("index_skip_topk_offset") if cfg.get("index_skip_topk_offset") is not None else 2)
    out = []
    for i in range(num_layers):
        indexer = None
        if index_dim:
            # models/deepseek_v32/attention.py: which layers keep an indexer.
            if isinstance(pattern, (list, str)):
                skip = 0 <= i < len(pattern) and pattern[i] == "S"
            else:
                skip = max(i - offset + 1, 0) % freq != 0
            indexer = None if skip else int(index_dim)
        out.append(LayerSpec(index=i, kind="mla", num_kv_heads=1, head_size=rank + rope, head_size_v=0,
                             kv_lora_rank=rank, rope_dim=rope, indexer_head_dim=indexer))
    return out


# -- recurrent-state hybrids -----------------------------------------------------------


def _mamba_dtypes(model_dtype: str, ssm: str | None) -> tuple[str, str]:
    """(conv, ssm) element types: mamba_cache_dtype auto = the model dtype; ssm auto = conv (mamba_utils.py)."""
    return model_dtype, (ssm or model_dtype)


def _falcon_h1_layers(cfg: dict[str, Any], num_layers: int, heads: int, hd: int, model_dtype: str) -> list[LayerSpec]:
    """models/falcon_h1.py: every layer runs attention and a Mamba-2 mixer in parallel (two specs per layer)."""
    hidden = int(cfg.get("hidden_size") or 0)
    inner = cfg.get("mamba_d_ssm") or int(float(cfg.get("mamba_expand") or 2) * hidden)
    conv, ssm = _mamba_dtypes(model_dtype, None)
    state = RecurrentState(type="mamba2", conv_kernel=int(cfg.get("mamba_d_conv") or 4), intermediate=int(inner),
                           n_groups=int(cfg.get("mamba_n_groups") or 1), num_heads=int(cfg.get("mamba_n_heads") or 0),
                           head_dim=int(cfg.get("mamba_d_head") or 0), state_size=int(cfg.get("mamba_d_state") or 0),
                           conv_dtype=conv, ssm_dtype=ssm)
    out = []
    for i in range(num_layers):
        out.append(LayerSpec(index=i, kind="full", num_kv_heads=heads, head_size=hd, head_size_v=hd))
        out.append(LayerSpec(index=i, kind="mamba", state=state))
    return out


def _nemotron_h_layers(cfg: dict[str, Any], num_layers: int, heads: int, hd: int, where: str) -> list[LayerSpec]:
    """models/nemotron_h.py: hybrid_override_pattern; Mamba-2 SSM state in float32 unless the config says
    otherwise (models/config.py NemotronHForCausalLMConfig)."""
    pattern = cfg.get("hybrid_override_pattern") or ""
    _check_len(list(pattern), "hybrid_override_pattern", num_layers, where)
    ssm = str(cfg.get("mamba_ssm_cache_dtype") or "float32")
    nheads, hdim = int(cfg.get("mamba_num_heads") or 0), int(cfg.get("mamba_head_dim") or 0)
    state = RecurrentState(type="mamba2", conv_kernel=int(cfg.get("conv_kernel") or 4), intermediate=nheads * hdim,
                           n_groups=int(cfg.get("n_groups") or 1), num_heads=nheads, head_dim=hdim,
                           state_size=int(cfg.get("ssm_state_size") or 0), conv_dtype="bfloat16", ssm_dtype=ssm)
    out = []
    for i, ch in enumerate(pattern):
        kind = _PATTERN.get(ch)
        if kind is None:
            raise InputError(f"{where}: `hybrid_override_pattern[{i}]` is {ch!r}; NemotronH uses *, M, - and E.")
        if kind == "full":
            out.append(LayerSpec(index=i, kind="full", num_kv_heads=heads, head_size=hd, head_size_v=hd))
        elif kind == "mamba":
            out.append(LayerSpec(index=i, kind="mamba", state=state))
        else:
            out.append(LayerSpec(index=i, kind="none"))
    return out


def _jamba_layers(cfg: dict[str, Any], num_layers: int, heads: int, hd: int, model_dtype: str) -> list[LayerSpec]:
    """models/jamba.py: attention where index % attn_layer_period == attn_layer_offset, Mamba-1 elsewhere."""
    period, offset = int(cfg.get("attn_layer_period") or 8), int(cfg.get("attn_layer_offset") or 0)
    listed = cfg.get("layers_block_type")
    hidden = int(cfg.get("hidden_size") or 0)
    conv, ssm = _mamba_dtypes(model_dtype, None)
    state = RecurrentState(type="mamba1", conv_kernel=int(cfg.get("mamba_d_conv") or 4),
                           intermediate=int(cfg.get("mamba_expand") or 2) * hidden,
                           state_size=int(cfg.get("mamba_d_state") or 16), conv_dtype=conv, ssm_dtype=ssm)
    out = []
    for i in range(num_layers):
        attn = (listed[i] == "attention") if isinstance(listed, list) and len(listed) == num_layers \
            else i % period == offset
        out.append(LayerSpec(index=i, kind="full", num_kv_heads=heads, head_size=hd, head_size_v=hd) if attn
                   else LayerSpec(index=i, kind="mamba", state=state))
    return out


def _gdn_layers(cfg: dict[str, Any], num_layers: int, heads: int, hd: int, model_type: str, model_dtype: str,
                where: str) -> list[LayerSpec]:
    """Qwen3-Next / Qwen3.5: `layer_types` linear_attention = gated delta net (qwen3_next.py, qwen3_5.py).
    Qwen3.5 keeps its SSM state in the config's mamba_ssm_dtype (models/config.py); Qwen3-Next in the model dtype."""
    listed = cfg.get("layer_types")
    if isinstance(listed, list) and listed:
        _check_len(listed, "layer_types", num_layers, where)
        linear = [str(t) == "linear_attention" for t in listed]
    else:
        interval = int(cfg.get("full_attention_interval") or 4)
        linear = [(i + 1) % interval != 0 for i in range(num_layers)]
    ssm = str(cfg.get("mamba_ssm_dtype")) if model_type.startswith("qwen3_5") and cfg.get("mamba_ssm_dtype") else None
    conv, ssm_dt = _mamba_dtypes(model_dtype, ssm)
    state = RecurrentState(type="gdn", conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4),
                           num_k_heads=int(cfg.get("linear_num_key_heads") or 0),
                           num_v_heads=int(cfg.get("linear_num_value_heads") or 0),
                           head_k_dim=int(cfg.get("linear_key_head_dim") or 0),
                           head_v_dim=int(cfg.get("linear_value_head_dim") or 0), conv_dtype=conv, ssm_dtype=ssm_dt)
    return [LayerSpec(index=i, kind="gdn", state=state) if lin
            else LayerSpec(index=i, kind="full", num_kv_heads=heads, head_size=hd, head_size_v=hd)
            for i, lin in enumerate(linear)]


def _lfm2_layers(cfg: dict[str, Any], num_layers: int, heads: int, hd: int, model_dtype: str,
                 where: str) -> list[LayerSpec]:
    """models/lfm2.py: layer_types full_attention, short convolutions elsewhere."""
    listed = cfg.get("layer_types")
    if isinstance(listed, list) and listed:
        _check_len(listed, "layer_types", num_layers, where)
        attn = [str(t) == "full_attention" for t in listed]
    else:
        idxs = set(cfg.get("full_attn_idxs") or [])
        attn = [i in idxs for i in range(num_layers)]
    state = RecurrentState(type="short_conv", conv_kernel=int(cfg.get("conv_L_cache") or 3),
                           intermediate=int(cfg.get("conv_dim") or cfg.get("hidden_size") or 0), conv_dtype=model_dtype)
    return [LayerSpec(index=i, kind="full", num_kv_heads=heads, head_size=hd, head_size_v=hd) if a
            else LayerSpec(index=i, kind="conv", state=state) for i, a in enumerate(attn)]


def _granite_hybrid_layers(cfg: dict[str, Any], num_layers: int, heads: int, hd: int, model_dtype: str,
                           where: str) -> list[LayerSpec]:
    """models/granitemoehybrid.py: layer_types attention / mamba (Mamba-2, inner = mamba_expand x hidden)."""
    listed = cfg.get("layer_types") or cfg.get("layers_block_type") or ["attention"] * num_layers
    _check_len(listed, "layer_types", num_layers, where)
    hidden = int(cfg.get("hidden_size") or 0)
    state = RecurrentState(type="mamba2", conv_kernel=int(cfg.get("mamba_d_conv") or 4),
                           intermediate=int(cfg.get("mamba_expand") or 2) * hidden,
                           n_groups=int(cfg.get("mamba_n_groups") or 1), num_heads=int(cfg.get("mamba_n_heads") or 0),
                           head_dim=int(cfg.get("mamba_d_head") or 0), state_size=int(cfg.get("mamba_d_state") or 0),
                           conv_dtype=model_dtype, ssm_dtype=model_dtype)
    return [LayerSpec(index=i, kind="mamba", state=state) if str(t) == "mamba"
            else LayerSpec(index=i, kind="full", num_kv_heads=heads, head_size=hd, head_size_v=hd)
            for i, t in enumerate(listed)]


# -- tensor parallelism ----------------------------------------------------------------


def tp_rules(cfg: dict[str, Any], layers: list[LayerSpec], *, num_heads: int, model_type: str,
             arch: str) -> list[TpRule]:
    """vLLM's divisibility checks on the TP size for this model."""
    rules = [TpRule(name="num_attention_heads", value=num_heads, rule="divides", source=_MODEL)]
    seen: set[tuple[str, int]] = set()

    def add(name: str, value: int, rule: str, source: str) -> None:
        if value > 0 and (name, value) not in seen:
            seen.add((name, value))
            rules.append(TpRule(name=name, value=value, rule=rule, source=source))  # type: ignore[arg-type]

    for spec in layers:
        if spec.kind in ("full", "sliding", "chunked") and spec.num_kv_heads:
            key = "swa_num_key_value_heads" if (spec.kind == "sliding" and cfg.get("swa_num_key_value_heads")) \
                else ("num_global_key_value_heads" if spec.kind == "full" and cfg.get("num_global_key_value_heads")
                      else "num_key_value_heads")
            add(key, spec.num_kv_heads, "divides_or_replicated", _LINEAR)
        st = spec.state
        if st is None:
            continue
        if st.type == "mamba2":
            add("mamba num_heads", st.num_heads, "divides",
                "model_executor/layers/mamba/mamba_mixer2.py MambaMixer2 (num_heads % tp)")
            add("mamba n_groups", st.n_groups, "divides_or_one",
                "model_executor/layers/mamba/mamba_mixer2.py MambaMixer2 (n_groups % tp or 1)")
        elif st.type == "mamba1":
            add("mamba intermediate_size", st.intermediate, "divides",
                "model_executor/layers/mamba/mamba_utils.py mamba1_state_shape (divide)")
        elif st.type == "gdn":
            add("linear_num_value_heads", st.num_v_heads, "divides",
                "model_executor/layers/mamba/mamba_utils.py gated_delta_net_state_shape (divide)")
            add("linear_num_key_heads", st.num_k_heads, "divides",
                "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py (num_k_heads // tp)")
    if cfg.get("swa_num_attention_heads"):
        add("swa_num_attention_heads", int(cfg["swa_num_attention_heads"]), "divides",
            "models/mimo_v2.py MiMoV2Attention (heads // tp)")
    if model_type == "gpt_oss" or arch.startswith("GptOss"):
        kv = num_kv_heads(cfg, num_heads)
        add("num_key_value_heads (gpt-oss)", kv, "at_least_tp", "models/gpt_oss.py (kv heads // tp, no max(1, ...))")
        if cfg.get("intermediate_size"):
            add("intermediate_size", int(cfg["intermediate_size"]), "divides", "models/gpt_oss.py (assert)")
    return rules


def _check_len(listed: list[Any], key: str, num_layers: int, where: str) -> None:
    if len(listed) != num_layers:
        raise InputError(
            f"{where}: `{key}` lists {len(listed)} {noun(len(listed), 'layer')} but num_hidden_layers is {num_layers}. "
            "The two must agree; fix one of them."
        )


def _int(cfg: dict[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value <= 0:
        raise InputError(f"{where}: `{key}` is {value!r}; it must be a positive whole number. Fix the value.")
    return int(value)
