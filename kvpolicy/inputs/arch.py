"""Model architecture: the per-layer caches vLLM builds, and the limits it derives, for one checkpoint.

A Hugging Face `config.json` (local or the catalog's bundled copy) becomes a
`ModelArch` through `hfconfig.py`; its `layers` list one `LayerSpec` per module
that vLLM asks for a KV cache spec (`get_kv_cache_spec`): attention (full, sliding,
chunked local, MLA with or without the sparse-MLA indexer), recurrent state
(Mamba-1/2, gated delta net, short conv, linear attention) and KV-sharing layers.
The allocator (`facts/kv_memory.py`) turns them into vLLM's groups and blocks.
The older per-model summary fields (`layer_types`, `num_kv_heads`, `head_dim`...)
are derived from `layers`; a ModelArch built from those fields alone (tests, small
synthetic models) gets its `layers` derived from them.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpolicy import new_list

LegacyKind = Literal["full", "sliding", "mla", "linear", "shared"]
"""Cache kind per decoder layer in the older summary (`layer_types`): linear = no per-token KV."""
LayerKind = Literal["full", "sliding", "chunked", "mla", "mamba", "gdn", "conv", "linear", "shared", "none"]
"""Kind of one cache-holding module: full / sliding-window / chunked-local attention, MLA latent,
Mamba (1 or 2) state, gated-delta-net state, short-conv state, linear-attention state,
a layer that reads another layer's KV (`shared`), or a decoder layer with no cache (`none`)."""
RecurrentType = Literal["mamba1", "mamba2", "gdn", "short_conv", "linear", "kda"]
AttentionKind = Literal["gqa", "mha", "mqa", "mla"]

ATTENTION_KINDS = frozenset({"full", "sliding", "chunked", "mla"})
RECURRENT_KINDS = frozenset({"mamba", "gdn", "conv", "linear"})
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class _Frozen(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)


class RecurrentState(_Frozen):
    """The per-request state of one Mamba-family layer (`MambaStateShapeCalculator`,
    `model_executor/layers/mamba/mamba_utils.py`); shapes depend on the TP size."""

    type: RecurrentType
    """mamba1, mamba2, gdn (gated delta net), short_conv, linear (linear attention) or kda."""
    conv_kernel: int = 0
    """Convolution width K (the conv state keeps K - 1 steps)."""
    intermediate: int = 0
    """Mamba inner size (mamba1/mamba2) or conv channels (short conv)."""
    n_groups: int = 1
    """Mamba-2 B/C groups (replicated up to tp when tp does not divide them)."""
    num_heads: int = 0
    """Mamba-2 / linear-attention / KDA heads."""
    head_dim: int = 0
    """Mamba-2 / linear-attention / KDA head dimension."""
    state_size: int = 0
    """SSM state size (d_state)."""
    num_k_heads: int = 0
    """Gated-delta-net key heads (`linear_num_key_heads`)."""
    num_v_heads: int = 0
    """Gated-delta-net value heads (`linear_num_value_heads`)."""
    head_k_dim: int = 0
    """Gated-delta-net key head size."""
    head_v_dim: int = 0
    """Gated-delta-net value head size."""
    conv_dtype: str = "bfloat16"
    """Element type of the conv state (`mamba_cache_dtype`, auto = the model dtype)."""
    ssm_dtype: str = "bfloat16"
    """Element type of the recurrent state (`mamba_ssm_cache_dtype`)."""

    def shapes(self, tp: int = 1) -> tuple[tuple[int, ...], ...]:
        """State shapes per request on one TP rank, conv layout `SD` (vLLM's default)."""
        t = self.type
        if t == "mamba1":
            return ((self.conv_kernel - 1, self.intermediate // tp), (self.intermediate // tp, self.state_size))
        if t == "mamba2":
            # extra_groups_for_head_shards: groups are replicated up to tp when tp does not divide them.
            groups = self.n_groups + (0 if self.n_groups % tp == 0 else tp - self.n_groups)
            conv_dim = self.intermediate + 2 * groups * self.state_size
            return ((self.conv_kernel - 1, conv_dim // tp), (self.num_heads // tp, self.head_dim, self.state_size))
        if t == "gdn":
            conv_dim = 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim
            return ((self.conv_kernel - 1, conv_dim // tp), (self.num_v_heads // tp, self.head_v_dim, self.head_k_dim))
        if t == "short_conv":
            return ((self.conv_kernel - 1, self.intermediate // tp),)
        if t == "linear":
            return ((self.num_heads // tp, self.head_dim, self.head_dim),)
        # kda
        conv_dim = self.num_heads * self.head_dim + 2 * self.num_k_heads * self.head_k_dim
        return ((self.conv_kernel - 1, conv_dim // tp), (self.num_heads // tp, self.head_dim, self.head_dim))

    def dtypes(self) -> tuple[str, ...]:
        """Element type of each state (`MambaStateDtypeCalculator`)."""
        if self.type in ("short_conv",):
            return (self.conv_dtype,)
        if self.type == "linear":
            return (self.conv_dtype,)
        return (self.conv_dtype, self.ssm_dtype)

    def bytes(self, tp: int = 1) -> int:
        """Bytes of one copy of the state on one rank (`MambaSpec.page_size_bytes` before padding)."""
        return sum(math.prod(s) * _DTYPE_BYTES[d] for s, d in zip(self.shapes(tp), self.dtypes()))


class LayerSpec(_Frozen):
    """One module of the model that vLLM asks for a KV cache spec (or a decoder layer that has none)."""

    index: int = Field(ge=0)
    """Decoder layer index (Falcon-H1 layers appear twice: attention and Mamba)."""
    kind: LayerKind
    """What the module caches (see LayerKind)."""
    num_kv_heads: int = 0
    """KV heads of the whole model (before tensor parallelism); MLA caches one latent."""
    head_size: int = 0
    """Key head size (MLA: kv_lora_rank + qk_rope_head_dim)."""
    head_size_v: int = 0
    """Value head size (0 for MLA, which caches no separate V)."""
    window: int | None = None
    """Sliding window in tokens."""
    chunk: int | None = None
    """Chunk size of chunked local attention (Llama-4)."""
    kv_lora_rank: int | None = None
    """MLA latent rank."""
    rope_dim: int | None = None
    """MLA decoupled RoPE width cached beside the latent."""
    indexer_head_dim: int | None = None
    """Sparse-MLA (DSA) indexer key width; its cache holds head_dim + head_dim/128 x 4 bytes per token."""
    shared_with: int | None = None
    """KV sharing: the layer whose cache this one reads."""
    state: RecurrentState | None = None
    """Recurrent state of Mamba-family layers."""
    replicate_kv: bool = True
    """KV heads per rank are max(1, heads // tp) (False: gpt-oss's plain heads // tp)."""

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Recurrent state shapes per request before TP (empty for attention modules)."""
        return self.state.shapes(1) if self.state is not None else ()

    @property
    def state_dtypes(self) -> tuple[str, ...]:
        """Element types of `state_shapes`."""
        return self.state.dtypes() if self.state is not None else ()

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one TP rank stores (MLA: the whole latent on every rank)."""
        if self.kind == "mla":
            return 1
        return max(1, self.num_kv_heads // tp) if self.replicate_kv else self.num_kv_heads // tp


class KvCacheScheme(_Frozen):
    """What the checkpoint's quantization config says about the KV cache."""

    method: str
    """quant_method: compressed-tensors, modelopt, modelopt_fp4, fp8, quark..."""
    num_bits: int | None = None
    """Bits per KV element."""
    type: str | None = None
    """float or int."""
    strategy: str | None = None
    """tensor or attn_head (compressed-tensors)."""
    dynamic: bool | None = None
    """Scales computed at run time (True) or loaded from the checkpoint (False)."""
    symmetric: bool | None = None
    """Symmetric scales (compressed-tensors requires them)."""
    algo: str | None = None
    """ModelOpt's `kv_cache_quant_algo` string (FP8, NVFP4)."""
    source: str = ""
    """Where it was read: config.json or hf_quant_config.json, and the key."""


class TpRule(_Frozen):
    """One divisibility rule vLLM applies to the tensor-parallel size."""

    name: str
    """The config key (and layer kind) the rule is about."""
    value: int
    """The config's value."""
    rule: Literal["divides", "divides_or_replicated", "divides_or_one", "at_least_tp"]
    """divides: value % tp == 0; divides_or_replicated: value % tp == 0 or tp % value == 0;
    divides_or_one: value % tp == 0 or value == 1; at_least_tp: value >= tp."""
    source: str
    """The vLLM file and function that enforce it."""

    def holds(self, tp: int) -> bool:
        v = self.value
        if self.rule == "divides":
            return v % tp == 0
        if self.rule == "divides_or_replicated":
            return v % tp == 0 if tp < v else tp % v == 0
        if self.rule == "divides_or_one":
            return v % tp == 0 or v == 1
        return v >= tp


class ModelArch(BaseModel):
    """What kvpolicy needs to know about a model to decide its KV cache."""

    model_config = ConfigDict(defer_build=True, extra="forbid", frozen=True)

    id: str
    """Catalog id (lower case), or the folder name of a local config."""
    hf_id: str | None = None
    """Hugging Face repository id, e.g. `openai/gpt-oss-20b`."""
    family: str = ""
    """Model family used by pins, e.g. `llama`, `gpt-oss`, `kimi`."""
    aliases: list[str] = Field(default_factory=new_list)
    """Other names accepted on the command line."""
    model_type: str = ""
    """HF `model_type` of the decoder (text) config."""
    architecture: str = ""
    """The vLLM architecture class (`architectures[0]`)."""
    num_layers: int = Field(gt=0)
    """Decoder layers (`num_hidden_layers`)."""
    layer_types: list[LegacyKind] = Field(default_factory=new_list)
    """Kind of each decoder layer in the older summary vocabulary (derived from `layers`)."""
    layers: list[LayerSpec] = Field(default_factory=new_list)
    """Every cache-holding module, in decoder order (derived from the summary fields when not given)."""
    num_attention_heads: int = Field(gt=0)
    """Query heads per layer."""
    num_kv_heads: int = Field(gt=0)
    """KV heads per layer (`num_key_value_heads`; the first attention layer's when they differ)."""
    head_dim: int = Field(gt=0)
    """Key head dimension of sliding and regular attention layers (MLA: qk_nope + qk_rope)."""
    v_head_dim: int | None = Field(default=None, gt=0)
    """Value head dimension when it differs from `head_dim`."""
    full_head_dim: int | None = Field(default=None, gt=0)
    """Head dimension of full-attention layers when it differs (Gemma 4 `global_head_dim`)."""
    sliding_window: int | None = Field(default=None, gt=0)
    """Window of the sliding-attention layers, in tokens."""
    attention: AttentionKind = "gqa"
    """Attention kind."""
    kv_lora_rank: int | None = Field(default=None, gt=0)
    """MLA latent rank."""
    qk_rope_head_dim: int | None = Field(default=None, gt=0)
    """MLA decoupled RoPE dimension cached beside the latent."""
    has_attention_sinks: bool = False
    """Learned attention sinks (gpt-oss, MiMo-V2 SWA layers)."""
    rotary_dim: int | None = None
    """Rotary dims of the attention heads (partial rotary); the ROCm Octave formats read it."""
    max_position_embeddings: int | None = Field(default=None, gt=0)
    """The config's own key (see `max_model_len` for what vLLM derives)."""
    max_model_len: int | None = Field(default=None, gt=0)
    """The longest `--max-model-len` vLLM 0.33 accepts without VLLM_ALLOW_LONG_MAX_MODEL_LEN."""
    max_model_len_basis: str = ""
    """Which key (and RoPE factor) vLLM derives it from."""
    model_dtype: str = "bfloat16"
    """The dtype vLLM loads the model in (`--dtype auto`: float32 checkpoints load as bfloat16 on SM80+)."""
    quant_method: str = ""
    """The checkpoint's normalised `quant_method` (fp8, compressed-tensors, modelopt...; empty when unquantized)."""
    kv_cache_scheme: KvCacheScheme | None = None
    """The checkpoint's KV-cache quantization, if its quantization config declares one."""
    auto_kv_dtype: str = "auto"
    """What `--kv-cache-dtype auto` becomes for this checkpoint (`auto` = the model dtype)."""
    auto_kv_basis: str = ""
    """Why, with the vLLM source."""
    weights_bytes: int | None = Field(default=None, ge=0)
    """Bytes of weights vLLM loads, all ranks together."""
    weights_basis: str = ""
    """Where `weights_bytes` comes from: the safetensors index, the config's shapes and quantization, or an override."""
    weights_gb: float | None = Field(default=None, gt=0)
    """Override (or older catalog value): weight memory in GB (1e9 bytes), all ranks together."""
    params_b: float | None = Field(default=None, gt=0)
    """Total parameters in billions; weights default to 2 bytes each when nothing else is known."""
    active_params_b: float | None = Field(default=None, gt=0)
    """Weights one token multiplies through, in billions (routed experts: top-k of them; no embeddings)."""
    tp_rules: list[TpRule] = Field(default_factory=new_list)
    """vLLM's divisibility rules for the tensor-parallel size (derived from heads when not given)."""
    source: str = ""
    """Where the numbers come from."""

    @model_validator(mode="before")
    @classmethod
    def _expand(cls, data: Any) -> Any:
        """Summary shorthand (`layer_pattern`, `kv_shared_from`) -> layer_types; layer_types -> layers."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if "layer_types" not in data and not data.get("layers"):
            pattern = data.pop("layer_pattern", None) or ["mla" if data.get("attention") == "mla" else "full"]
            shared_from = data.pop("kv_shared_from", None)
            n = data.get("num_layers")
            if isinstance(n, int) and n > 0:
                types = [pattern[i % len(pattern)] for i in range(n)]
                if shared_from is not None:
                    types = [t if i < shared_from else "shared" for i, t in enumerate(types)]
                data["layer_types"] = types
        if not data.get("layers") and isinstance(data.get("layer_types"), list):
            data["layers"] = _layers_from_summary(data)
        elif data.get("layers") and not data.get("layer_types"):
            data["layer_types"] = _summary_types(data["layers"], data.get("num_layers"))
        return data

    @model_validator(mode="after")
    def _check_layers(self) -> ModelArch:
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_layers is {self.num_layers}"
            )
        if "sliding" in self.layer_types and self.sliding_window is None:
            raise ValueError("sliding layers need `sliding_window`")
        if "mla" in self.layer_types and (self.kv_lora_rank is None or self.qk_rope_head_dim is None):
            raise ValueError("MLA layers need `kv_lora_rank` and `qk_rope_head_dim`")
        return self

    # -- derived ---------------------------------------------------------------------------

    @cached_property
    def kind_counts(self) -> dict[str, int]:
        """Number of modules of each kind (`layers`; Falcon-H1 counts its layers as full and as mamba)."""
        counts: dict[str, int] = {}
        for spec in self.layers:
            counts[spec.kind] = counts.get(spec.kind, 0) + 1
        return counts

    def count(self, kind: str) -> int:
        """Number of modules of one kind; `linear` in the summary sense counts every recurrent-state kind."""
        if kind == "linear":
            return sum(self.kind_counts.get(k, 0) for k in RECURRENT_KINDS)
        return self.kind_counts.get(kind, 0)

    @cached_property
    def head_sizes(self) -> frozenset[int]:
        """Every attention head size over the layers (MLA: the latent width)."""
        return frozenset(s.head_size for s in self.layers if s.kind in ATTENTION_KINDS)

    @cached_property
    def max_head_dim(self) -> int:
        """Largest key head dimension over the layers that hold a GQA/MHA cache."""
        dims = [s.head_size for s in self.layers if s.kind in ("full", "sliding", "chunked")]
        return max(dims) if dims else self.head_dim

    @cached_property
    def kv_layer_indices(self) -> list[int]:
        """Decoder layers that hold a per-token KV cache of their own."""
        return sorted({s.index for s in self.layers if s.kind in ATTENTION_KINDS})

    @cached_property
    def is_hybrid(self) -> bool:
        """More than one kind of cache (sliding, chunked, recurrent state or shared beside full)."""
        return len({s.kind for s in self.layers if s.kind not in ("shared", "none")}) > 1

    @cached_property
    def has_recurrent_state(self) -> bool:
        """vLLM's `model_config.is_hybrid`: Mamba / linear-attention layers beside attention."""
        return any(s.kind in RECURRENT_KINDS for s in self.layers)

    @cached_property
    def is_sparse_mla(self) -> bool:
        """DeepSeek-V3.2 / GLM-5 style sparse MLA with an indexer cache."""
        return any(s.indexer_head_dim for s in self.layers)

    @property
    def checkpoint_kv_scales(self) -> str | None:
        """`per_head` / `per_tensor` when the checkpoint declares FP8 KV scales vLLM loads into an FP8 cache
        (`BaseKVCacheMethod`, model_executor/layers/quantization/kv_cache.py); None otherwise."""
        s = self.kv_cache_scheme
        if s is None:
            return None
        if self.attention == "mla" and not (s.method.startswith("modelopt") and s.method != "modelopt_mixed"):
            # Only ModelOpt's base config hands MLAAttention a KV-cache method (quantization/modelopt.py);
            # fp8 / compressed-tensors / quark match `Attention` only, so MLA layers keep scale 1.0.
            return None
        if s.algo is not None:
            # ModelOpt kv_cache_quant_algo (FP8 / NVFP4), quant_method fp8's `kv_cache_scheme: static`.
            return "per_tensor" if s.algo.lower() in ("fp8", "static") else None
        if s.num_bits not in (None, 8) or (s.type not in (None, "float")) or s.dynamic is True:
            return None
        return "per_head" if s.strategy == "attn_head" else "per_tensor"

    @cached_property
    def content_key(self) -> tuple[Any, ...]:
        """Every field as one hashable tuple: tables derived from the architecture are cached by it."""
        return tuple(_hashable(getattr(self, n)) for n in type(self).model_fields)

    @cached_property
    def content_hash(self) -> int:
        """hash(content_key), computed once (a tuple does not keep its hash, and the layers make it long)."""
        return hash(self.content_key)

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> ModelArch:
        """A copy with `update` applied, whose derived values (the cached properties) are computed afresh."""
        copy = super().model_copy(update=update, deep=deep)
        for name in ("kind_counts", "max_head_dim", "kv_layer_indices", "is_hybrid", "content_key", "content_hash",
                     "head_sizes", "has_recurrent_state", "is_sparse_mla", "_by_index"):
            copy.__dict__.pop(name, None)
        return copy

    @property
    def weight_bytes(self) -> float:
        """Weight memory in bytes (all ranks): the override, else the derived bytes, else 2 bytes per parameter."""
        if self.weights_gb is not None:
            return self.weights_gb * 1e9
        if self.weights_bytes is not None:
            return float(self.weights_bytes)
        return (self.params_b or 0.0) * 1e9 * 2

    def with_weights_gb(self, gb: float | None, where: str = "--weights-gb") -> ModelArch:
        """This model with its weight memory overridden (None: unchanged)."""
        if gb is None:
            return self
        return self.model_copy(update={"weights_gb": gb,
                                       "weights_basis": f"{where} {gb:g} (override; derived: {self.weight_basis})"})

    @property
    def weight_basis(self) -> str:
        """Where `weight_bytes` comes from."""
        if self.weights_gb is not None:
            return self.weights_basis or "weights_gb override"
        if self.weights_bytes is not None:
            return self.weights_basis
        return f"{self.params_b or 0:g}B parameters x 2 bytes" if self.params_b else "unknown (0)"

    @cached_property
    def _by_index(self) -> dict[int, LayerSpec]:
        """The attention (or else first) module of each decoder layer."""
        out: dict[int, LayerSpec] = {}
        for s in self.layers:
            if s.index not in out or (s.kind in ATTENTION_KINDS and out[s.index].kind not in ATTENTION_KINDS):
                out[s.index] = s
        return out

    def layer(self, index: int) -> LayerSpec:
        """The attention module of a decoder layer (or its only module)."""
        return self._by_index[index]

    def head_dims(self, layer: int) -> tuple[int, int]:
        """(key, value) head dimensions of one decoder layer's attention."""
        spec = self._by_index.get(layer)
        if spec is not None and spec.kind == "shared" and spec.shared_with is not None:
            spec = self._by_index.get(spec.shared_with, spec)
        if spec is None or spec.kind not in ("full", "sliding", "chunked"):
            k = self.full_head_dim if (self.layer_types[layer] == "full" and self.full_head_dim) else self.head_dim
            return k, self.v_head_dim or k
        return spec.head_size, spec.head_size_v

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one tensor-parallel rank holds; vLLM replicates heads when tp > kv heads."""
        return max(1, self.num_kv_heads // tp)

    def tp_error(self, tp: int) -> str | None:
        """Why vLLM refuses this tensor-parallel size (None when it accepts it)."""
        broken = [r for r in self.effective_tp_rules if not r.holds(tp)]
        if not broken:
            return None
        what = "; ".join(_rule_text(r, tp) for r in broken)
        valid = ", ".join(str(t) for t in self.valid_tp_sizes(max(8, tp)))
        return (f"--tp {tp} does not fit {self.id}: {what}. Valid tensor-parallel sizes up to "
                f"{max(8, tp)}: {valid or 'none'}.")

    def valid_tp_sizes(self, limit: int) -> list[int]:
        """Every TP size from 1 to `limit` that vLLM's divisibility rules accept."""
        rules = self.effective_tp_rules
        return [t for t in range(1, limit + 1) if all(r.holds(t) for r in rules)]

    @cached_property
    def effective_tp_rules(self) -> list[TpRule]:
        """`tp_rules`, or the attention-head rules when none were derived from a config."""
        if self.tp_rules:
            return list(self.tp_rules)
        rules = [TpRule(name="num_attention_heads", value=self.num_attention_heads, rule="divides",
                        source="config/model.py ModelConfig.verify_with_parallel_config")]
        if self.attention != "mla":
            rules.append(TpRule(name="num_key_value_heads", value=self.num_kv_heads, rule="divides_or_replicated",
                                source="model_executor/layers/linear.py QKVParallelLinear"))
        return rules


def _rule_text(rule: TpRule, tp: int) -> str:
    if rule.rule == "divides":
        return f"{rule.name} = {rule.value} is not divisible by {tp} ({rule.source})"
    if rule.rule == "divides_or_replicated":
        return f"{rule.name} = {rule.value} is neither divisible by {tp} nor a divisor of it ({rule.source})"
    if rule.rule == "divides_or_one":
        return f"{rule.name} = {rule.value} is not divisible by {tp} and not 1 ({rule.source})"
    return f"{rule.name} = {rule.value} is below {tp} ({rule.source})"


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, BaseModel):
        return (type(value).__name__, *(_hashable(getattr(value, n)) for n in type(value).model_fields))
    return value


def _layers_from_summary(data: dict[str, Any]) -> list[dict[str, Any]]:
    """LayerSpecs for a model described by the summary fields only (one kind per decoder layer)."""
    types = data["layer_types"]
    heads = data.get("num_kv_heads") or 0
    head = data.get("head_dim") or 0
    full_head = data.get("full_head_dim") or head
    v = data.get("v_head_dim")
    out: list[dict[str, Any]] = []
    last_of: dict[str, int] = {}
    for i, kind in enumerate(types):
        if kind == "mla":
            rank, rope = data.get("kv_lora_rank") or 0, data.get("qk_rope_head_dim") or 0
            out.append({"index": i, "kind": "mla", "num_kv_heads": 1, "head_size": rank + rope, "head_size_v": 0,
                        "kv_lora_rank": rank or None, "rope_dim": rope or None})
        elif kind in ("full", "sliding"):
            k = full_head if kind == "full" else head
            out.append({"index": i, "kind": kind, "num_kv_heads": heads, "head_size": k, "head_size_v": v or k,
                        "window": data.get("sliding_window") if kind == "sliding" else None})
            last_of[kind] = i
        elif kind == "shared":
            # Gemma-3n/4 style: the last non-shared layer of the same attention type.
            period = [t for t in types if t != "shared"]
            src_kind = period[i % len(period)] if period else "full"
            out.append({"index": i, "kind": "shared", "shared_with": last_of.get(src_kind)})
        else:
            out.append({"index": i, "kind": "none"})
    return out


def _summary_types(layers: list[Any], num_layers: int | None) -> list[str]:
    """The summary kind of each decoder layer from the modules (attention first; state or nothing -> linear)."""
    legacy = {"full": "full", "sliding": "sliding", "chunked": "full", "mla": "mla", "shared": "shared"}
    n = num_layers or (max((_get(s, "index") for s in layers), default=-1) + 1)
    out = ["linear"] * n
    seen_attention = [False] * n
    for s in layers:
        i, kind = _get(s, "index"), _get(s, "kind")
        if kind in legacy and not seen_attention[i]:
            out[i] = legacy[kind]
            seen_attention[i] = True
    return out


def _get(spec: Any, key: str) -> Any:
    return spec[key] if isinstance(spec, dict) else getattr(spec, key)
