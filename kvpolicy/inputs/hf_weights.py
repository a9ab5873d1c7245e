"""Bytes of weights vLLM loads for a checkpoint, from its config's shapes and its quantization.

Each module of the decoder is listed with its matrices (embeddings, attention or
MLA projections, the sparse-MLA indexer, dense MLPs, routed and shared experts,
Mamba / gated-delta-net mixers, the vision tower), then priced in the bytes per
element of the checkpoint's scheme as vLLM 0.33 allocates them
(`model_executor/layers/quantization/*`, `create_weights`): fp8 per tensor or per
128x128 block, MXFP4 experts (gpt-oss), NVFP4 (ModelOpt, compressed-tensors),
INT4/INT8 with group scales (compressed-tensors, GPTQ, AWQ), Quark FP8 per channel.
Embeddings, norms and routers stay in the model dtype; modules in the config's
ignore lists too. MTP / next-n layers are left out: vLLM's main model skips them.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field
from typing import Any

from kvpolicy.inputs.arch import LayerSpec

Matrix = tuple[int, int]
"""(output rows N, input columns K) of one linear weight."""


@dataclass
class Module:
    """One named part of the model: linear matrices (quantizable) and other parameters (model dtype)."""

    name: str
    linears: list[Matrix] = field(default_factory=list)
    other: int = 0
    """Parameters kept in the model dtype (norms, biases, embeddings, small vectors)."""
    count: int = 1
    """Copies (experts of one layer)."""
    experts: bool = False
    router: bool = False

    @property
    def params(self) -> int:
        return self.count * (sum(n * k for n, k in self.linears) + self.other)


def _i(cfg: dict[str, Any], *keys: str, default: int = 0) -> int:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v:
            return int(v)
    return default


# -- the model's modules -----------------------------------------------------------------


def modules(cfg: dict[str, Any], top: dict[str, Any], layers: list[LayerSpec], *, model_type: str,
            num_heads: int) -> list[Module]:
    """Every module of the checkpoint that vLLM loads (MTP layers left out)."""
    h = _i(cfg, "hidden_size", "d_model")
    vocab = _i(cfg, "vocab_size", "padded_vocab_size")
    out = [Module("model.embed_tokens", other=vocab * h)]
    # A multimodal wrapper's own flag wins (transformers ties through the top-level config).
    tied = bool(top["tie_word_embeddings"] if top is not cfg and "tie_word_embeddings" in top
                else cfg.get("tie_word_embeddings", False))
    if not tied:
        out.append(Module("lm_head", linears=[(vocab, h)]))
    out.append(Module("model.norm", other=h))
    if cfg.get("hidden_size_per_layer_input") and cfg.get("vocab_size_per_layer_input"):
        # Gemma-3n/4 per-layer embeddings: one table of layers x per-layer width, plus its projections.
        n, w = len({s.index for s in layers}), int(cfg["hidden_size_per_layer_input"])
        out.append(Module("model.embed_tokens_per_layer", other=int(cfg["vocab_size_per_layer_input"]) * n * w))
        out.append(Module("model.per_layer_model_projection", linears=[(n * w, h)], other=n * w))
    by_index: dict[int, list[LayerSpec]] = {}
    for s in layers:
        by_index.setdefault(s.index, []).append(s)
    for i in sorted(by_index):
        out.extend(_layer_modules(cfg, i, by_index[i], h=h, num_heads=num_heads, model_type=model_type))
    out.extend(_vision_modules(top))
    return out


def _layer_modules(cfg: dict[str, Any], i: int, specs: list[LayerSpec], *, h: int, num_heads: int,
                   model_type: str) -> list[Module]:
    p = f"model.layers.{i}"
    mods: list[Module] = [Module(f"{p}.norms", other=2 * h)]
    for s in specs:
        if s.kind == "mla":
            mods.extend(_mla(cfg, p, h, num_heads, s))
        elif s.kind in ("full", "sliding", "chunked", "shared"):
            mods.extend(_attention(cfg, p, h, num_heads, s, model_type))
        elif s.kind in ("mamba", "gdn", "conv") and s.state is not None:
            mods.append(_mixer(cfg, p, h, s))
    if cfg.get("hybrid_override_pattern"):
        ch = str(cfg["hybrid_override_pattern"])[i]
        if ch == "-":
            inter = _i(cfg, "intermediate_size")
            mods.append(Module(f"{p}.mixer", linears=[(inter, h), (h, inter)]))  # relu^2 MLP: up, down
        elif ch == "E":
            mods.extend(_moe(cfg, p, h, model_type))
        return mods
    if specs and specs[0].kind == "none":
        return mods
    if _is_moe_layer(cfg, i, model_type):
        mods.extend(_moe(cfg, p, h, model_type))
    else:
        inter = _i(cfg, "intermediate_size_mlp", "intermediate_size", "ffn_hidden_size") if model_type.startswith(
            "llama4") else _i(cfg, "intermediate_size", "ffn_hidden_size")
        if cfg.get("use_double_wide_mlp") and specs and specs[0].kind == "shared":
            inter *= 2  # Gemma-4: KV-shared layers run a double-wide MLP (models/gemma4.py)
        if inter:
            mods.append(Module(f"{p}.mlp.gate_up_proj", linears=[(2 * inter, h)]))
            mods.append(Module(f"{p}.mlp.down_proj", linears=[(h, inter)]))
    return mods


def _attention(cfg: dict[str, Any], p: str, h: int, num_heads: int, s: LayerSpec,
               model_type: str) -> list[Module]:
    a = f"{p}.self_attn"
    if s.kind == "shared":
        # KV-shared layers (Gemma-3n/4) keep q and o only.
        hd = _i(cfg, "head_dim", default=h // num_heads)
        return [Module(f"{a}.q_proj", linears=[(num_heads * hd, h)]), Module(f"{a}.o_proj", linears=[(h, num_heads * hd)])]
    heads = num_heads
    if s.kind == "sliding" and cfg.get("swa_num_attention_heads"):
        heads = int(cfg["swa_num_attention_heads"])
    q, kv, v = heads * s.head_size, s.num_kv_heads * s.head_size, s.num_kv_heads * s.head_size_v
    if cfg.get("attn_output_gate"):
        q *= 2  # Qwen3-Next / 3.5 gate the attention output through a doubled q_proj
    bias = bool(cfg.get("attention_bias")) or model_type in ("qwen2", "qwen2_5_vl", "qwen2_vl")
    mods = [Module(f"{a}.q_proj", linears=[(q, h)], other=q if bias else 0),
            Module(f"{a}.k_proj", linears=[(kv, h)], other=kv if bias else 0)]
    if not (model_type.startswith("gemma4") and s.kind == "full" and cfg.get("attention_k_eq_v")):
        mods.append(Module(f"{a}.v_proj", linears=[(v, h)], other=v if bias else 0))  # k_eq_v: V reuses K's weights
    mods.append(Module(f"{a}.o_proj", linears=[(h, heads * s.head_size_v)]))
    return mods


def _mla(cfg: dict[str, Any], p: str, h: int, heads: int, s: LayerSpec) -> list[Module]:
    nope, rope = _i(cfg, "qk_nope_head_dim"), _i(cfg, "qk_rope_head_dim")
    v, rank, qr = _i(cfg, "v_head_dim", default=nope), _i(cfg, "kv_lora_rank"), _i(cfg, "q_lora_rank")
    q = [(qr, h), (heads * (nope + rope), qr)] if qr else [(heads * (nope + rope), h)]
    a = f"{p}.self_attn"
    qmods = ([Module(f"{a}.q_a_proj", linears=[(qr, h)], other=qr), Module(f"{a}.q_b_proj", linears=[q[1]])] if qr
             else [Module(f"{a}.q_proj", linears=q)])
    mods = [*qmods, Module(f"{a}.kv_a_proj_with_mqa", linears=[(rank + rope, h)], other=rank),
            Module(f"{a}.kv_b_proj", linears=[(heads * (nope + v), rank)]),
            Module(f"{a}.o_proj", linears=[(h, heads * v)])]
    if s.indexer_head_dim:
        ih, inh = s.indexer_head_dim, _i(cfg, "index_n_heads", default=64)
        mods.append(Module(f"{p}.self_attn.indexer", linears=[(inh * ih, qr or h), (ih, h)], other=2 * ih))
        mods.append(Module(f"{p}.self_attn.indexer.weights_proj", linears=[(inh, h)]))
    return mods


def _mixer(cfg: dict[str, Any], p: str, h: int, s: LayerSpec) -> Module:
    st = s.state
    assert st is not None
    k = st.conv_kernel
    if st.type == "mamba2":
        conv = st.intermediate + 2 * st.n_groups * st.state_size
        in_proj = 2 * st.intermediate + 2 * st.n_groups * st.state_size + st.num_heads
        return Module(f"{p}.mamba", linears=[(in_proj, h), (h, st.intermediate)],
                      other=conv * k + conv + 3 * st.num_heads + st.intermediate)
    if st.type == "mamba1":
        inner = st.intermediate
        dt_rank = _i(cfg, "mamba_dt_rank", default=math.ceil(h / 16))
        return Module(f"{p}.mamba", linears=[(2 * inner, h), (dt_rank + 2 * st.state_size, inner), (inner, dt_rank),
                                             (h, inner)],
                      other=inner * k + inner * st.state_size + 3 * inner + 2 * st.state_size + dt_rank)
    if st.type == "gdn":
        kd, vd = st.num_k_heads * st.head_k_dim, st.num_v_heads * st.head_v_dim
        conv = 2 * kd + vd
        return Module(f"{p}.linear_attn", linears=[(2 * kd + 2 * vd, h), (2 * st.num_v_heads, h), (h, vd)],
                      other=conv * k + 2 * st.num_v_heads + st.head_v_dim)
    return Module(f"{p}.conv", linears=[(3 * st.intermediate, h), (h, st.intermediate)], other=st.intermediate * k)


def _is_moe_layer(cfg: dict[str, Any], i: int, model_type: str) -> bool:
    experts = _i(cfg, "n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
    if not experts:
        return False
    freq = cfg.get("moe_layer_freq")
    if isinstance(freq, list):
        return bool(freq[i]) if i < len(freq) else False
    if i in (cfg.get("mlp_only_layers") or []):
        return False
    if cfg.get("first_k_dense_replace") is not None and i < int(cfg["first_k_dense_replace"]):
        return False
    if cfg.get("expert_layer_period"):
        return i % int(cfg["expert_layer_period"]) == int(cfg.get("expert_layer_offset") or 0)
    if model_type.startswith("llama4"):
        step = int(cfg.get("interleave_moe_layer_step") or 1)
        return (i + 1) % step == 0
    step = int(cfg.get("decoder_sparse_step") or 1)
    return (i + 1) % step == 0 if step > 1 else True


def _moe(cfg: dict[str, Any], p: str, h: int, model_type: str) -> list[Module]:
    e = _i(cfg, "n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")
    inter = _i(cfg, "moe_intermediate_size", "expert_hidden_dim", "intermediate_size")
    mlp = "block_sparse_moe" if model_type in ("mixtral", "minimax_m2") else (
        "feed_forward" if model_type.startswith("llama4") else "mlp")
    bias = (3 * inter + h) if model_type == "gpt_oss" else 0  # gpt-oss experts carry biases
    mods = [Module(f"{p}.{mlp}.gate", linears=[(e, h)], router=True, other=e if model_type == "gpt_oss" else 0),
            Module(f"{p}.{mlp}.experts", linears=[(2 * inter, h), (h, inter)], other=bias, count=e, experts=True)]
    shared_inter = _i(cfg, "shared_expert_intermediate_size", "shared_intermediate_size")
    n_shared = _i(cfg, "n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
    if shared_inter:
        mods.append(Module(f"{p}.{mlp}.shared_expert", linears=[(2 * shared_inter, h), (h, shared_inter), (1, h)]))
    elif n_shared:
        si = n_shared * inter
        mods.append(Module(f"{p}.{mlp}.shared_experts", linears=[(2 * si, h), (h, si)]))
    elif model_type.startswith("llama4"):
        mods.append(Module(f"{p}.{mlp}.shared_expert", linears=[(2 * inter, h), (h, inter)]))
    return mods


def _vision_modules(top: dict[str, Any]) -> list[Module]:
    """A ViT tower and its projector from vision_config (SigLIP, Qwen-VL, Pixtral, MoonViT layouts)."""
    v = top.get("vision_config")
    if not isinstance(v, dict):
        return []
    h = _i(v, "hidden_size", "vt_hidden_size", "embed_dim")
    inter = _i(v, "intermediate_size", "vt_intermediate_size")
    depth = _i(v, "depth", "num_hidden_layers", "vt_num_hidden_layers")
    if not (h and inter and depth):
        return []
    gated = str(v.get("hidden_act") or "") == "silu"
    patch = _i(v, "patch_size", "spatial_patch_size", default=14)
    channels = _i(v, "in_channels", "in_chans", "num_channels", default=3)
    temporal = _i(v, "temporal_patch_size", default=1)
    mlp = [(inter, h), (inter, h), (h, inter)] if gated else [(inter, h), (h, inter)]
    tower = Module("model.visual.blocks", linears=[(3 * h, h), (h, h), *mlp], other=9 * h + inter, count=depth)
    positions = _i(v, "num_position_embeddings") or ((_i(v, "image_size") // patch) ** 2 if v.get("image_size") else 0)
    embed = Module("model.visual.patch_embed", other=channels * temporal * patch * patch * h + positions * h)
    text_h = _i(top.get("text_config") or {}, "hidden_size") or _i(top, "hidden_size") or _i(v, "out_hidden_size",
                                                                                          "text_hidden_size")
    merge = _i(v, "spatial_merge_size", default=0) or (2 if v.get("merge_kernel_size") else 0)
    if merge:
        wide = h * merge * merge
        proj = Module("model.visual.merger", linears=[(wide, wide), (_i(v, "out_hidden_size", default=text_h), wide)])
    else:
        proj = Module("multi_modal_projector", linears=[(text_h, h)], other=h)
    return [tower, embed, proj]


# -- quantization ------------------------------------------------------------------------


@dataclass
class Scheme:
    """How one quantization config stores a linear weight, and which modules it leaves alone."""

    label: str
    kind: str
    """none, fp8_block, fp8_tensor, fp8_channel, int_group, fp4_16, mxfp4_experts."""
    bits: int = 16
    group: int = 0
    block: tuple[int, int] = (128, 128)
    zero_point: bool = False
    ignore: list[str] = field(default_factory=list)
    experts_only: bool = False

    def linear_bytes(self, n: int, k: int) -> float:
        """Bytes of one N x K weight and its scales (per rank sums match the whole model's)."""
        if self.kind == "fp8_block":
            bn, bk = self.block
            return n * k + 4 * math.ceil(n / bn) * math.ceil(k / bk)
        if self.kind == "fp8_tensor":
            return n * k + 4
        if self.kind == "fp8_channel":
            return n * k + 4 * n
        if self.kind == "int_group":
            g = self.group if self.group > 0 else k
            groups = math.ceil(k / g)
            zeros = n * groups * self.bits / 8 if self.zero_point else 0
            scales = 2 * n * groups if self.group else 4 * n
            return n * k * self.bits / 8 + scales + zeros
        if self.kind == "fp4_16":
            return n * k / 2 + n * k / 16 + 8
        if self.kind == "mxfp4_experts":
            return n * k / 2 + n * k / 32
        return 2 * n * k


_UNQUANTIZED = Scheme("model dtype (bf16)", "none")


def scheme(q: dict[str, Any] | None) -> Scheme:
    """The weight scheme of a normalised quantization config (None: the model dtype)."""
    if not q:
        return _UNQUANTIZED
    m = q["quant_method"]
    if m in ("fp8", "fbgemm_fp8"):
        ignore = list(q.get("ignored_layers") or q.get("modules_to_not_convert") or [])
        block = q.get("weight_block_size")
        if isinstance(block, list) and len(block) == 2:
            return Scheme(f"fp8 {block[0]}x{block[1]} blocks (fp32 scales)", "fp8_block", 8,
                          block=(int(block[0]), int(block[1])), ignore=ignore)
        return Scheme("fp8 per tensor", "fp8_tensor", 8, ignore=ignore)
    if m in ("mxfp4", "gpt_oss_mxfp4"):
        return Scheme("MXFP4 experts (E8M0 scale per 32), other modules bf16", "mxfp4_experts", 4,
                      ignore=list(q.get("modules_to_not_convert") or []), experts_only=True)
    if m.startswith("modelopt"):
        inner = q.get("quantization") if isinstance(q.get("quantization"), dict) else q
        ignore = list(inner.get("exclude_modules") or q.get("exclude_modules") or q.get("ignore") or [])
        algo = str(inner.get("quant_algo") or q.get("quant_algo") or "").upper()
        if m == "modelopt_fp4" or algo == "NVFP4" or _groups_fp4(q):
            return Scheme("NVFP4 (E4M3 scale per 16)", "fp4_16", 4, group=16, ignore=ignore)
        return Scheme("ModelOpt fp8 per tensor", "fp8_tensor", 8, ignore=ignore)
    if m == "compressed-tensors":
        ignore = list(q.get("ignore") or [])
        for group in (q.get("config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            bits, typ = int(w.get("num_bits") or 16), str(w.get("type") or "int")
            if typ == "float" and bits == 4:
                return Scheme("compressed-tensors NVFP4", "fp4_16", 4, group=16, ignore=ignore)
            if typ == "float" and bits == 8:
                strat = str(w.get("strategy") or "channel")
                return Scheme(f"compressed-tensors fp8 per {strat}", "fp8_channel" if strat == "channel"
                              else "fp8_tensor", 8, ignore=ignore)
            g = int(w.get("group_size") or 0) if str(w.get("strategy") or "group") == "group" else 0
            return Scheme(f"compressed-tensors int{bits}" + (f" group {g}" if g else " per channel"), "int_group",
                          bits, group=g, zero_point=w.get("symmetric") is False, ignore=ignore)
        return _UNQUANTIZED
    if m in ("gptq", "gptq_marlin", "auto_gptq", "awq", "awq_marlin", "auto_awq", "moe_wna16"):
        bits, g = int(q.get("bits") or q.get("w_bit") or 4), int(q.get("group_size") or q.get("q_group_size") or 128)
        ignore = list(q.get("modules_to_not_convert") or [])
        return Scheme(f"{m} int{bits} group {g}", "int_group", bits, group=g, zero_point=True, ignore=ignore)
    if m == "quark":
        ignore = list(q.get("exclude") or [])
        w = ((q.get("global_quant_config") or {}).get("weight") or {})
        if str(w.get("dtype", "")).startswith("fp8"):
            kind = "fp8_channel" if w.get("qscheme") == "per_channel" else "fp8_tensor"
            return Scheme(f"Quark fp8 {w.get('qscheme') or 'per tensor'}", kind, 8, ignore=ignore)
        return Scheme("Quark (unrecognised weight scheme: counted at the model dtype)", "none", ignore=ignore)
    return Scheme(f"{m} (not priced by kvpolicy: counted at the model dtype)", "none")


def _groups_fp4(q: dict[str, Any]) -> bool:
    for group in (q.get("config_groups") or {}).values():
        w = (group or {}).get("weights") or {}
        if w.get("num_bits") == 4 and w.get("type") == "float":
            return True
    return False


class _Ignore:
    """vLLM-style skip lists: exact names, dotted suffixes/prefixes, `re:` regexes and `*` globs."""

    def __init__(self, entries: list[str]) -> None:
        entries = [e.removesuffix(".weight") for e in entries]
        self.exact = {e for e in entries if not e.startswith("re:") and "*" not in e}
        pats = [e[3:] for e in entries if e.startswith("re:")]
        pats += [fnmatch.translate(e).replace(r"\Z", "") + r"(\..*)?\Z" for e in entries
                 if "*" in e and not e.startswith("re:")]
        self.regex = re.compile("|".join(f"(?:{p})" for p in pats)) if pats else None

    def __call__(self, name: str) -> bool:
        if self.exact:
            parts = name.split(".")
            for a in range(len(parts)):
                for b in range(a + 1, len(parts) + 1):
                    if ".".join(parts[a:b]) in self.exact and (a == 0 or b == len(parts)):
                        return True
        return bool(self.regex and self.regex.match(name))


def active_matmul_params(mods: list[Module], cfg: dict[str, Any]) -> int:
    """Weights one text token multiplies through (lm_head included, embeddings and the vision tower not):
    routed experts count `num_experts_per_tok` of their copies. Two FLOPs per such weight per token."""
    top_k = _i(cfg, "num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "top_k")
    total = 0
    for m in mods:
        if not m.linears or m.name.startswith(("model.visual", "multi_modal_projector", "vision")):
            continue
        copies = min(top_k, m.count) if m.experts and top_k else m.count
        total += copies * sum(n * k for n, k in m.linears)
    return total


def weights_bytes(mods: list[Module], sch: Scheme) -> tuple[int, int]:
    """(bytes vLLM loads, parameters) for the modules under one scheme."""
    skip = _Ignore(sch.ignore)
    total = 0.0
    params = 0
    for m in mods:
        params += m.params
        # ParallelLMHead and the routers are built without the quant config (vocab_parallel_embedding.py).
        quantized = sch.kind != "none" and bool(m.linears) and not m.router and m.name != "lm_head"
        if sch.experts_only and not m.experts:
            quantized = False
        if quantized and m.name.startswith(("model.visual", "multi_modal_projector")):
            vision_ignored = any(x in sch.ignore for x in ("model.vision_tower", "vision_tower", "model.visual"))
            quantized = not vision_ignored and sch.kind != "int_group"
        if quantized and skip(m.name):
            quantized = False
        if quantized:
            lin = sum(sch.linear_bytes(n, k) for n, k in m.linears)
        else:
            lin = sum(2 * n * k for n, k in m.linears)
        total += m.count * (lin + 2 * m.other)
    return int(total), params
