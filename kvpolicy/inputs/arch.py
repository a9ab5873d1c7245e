"""Model architecture: the per-layer cache kinds, heads and dimensions kvpolicy decides from.

A catalog entry and a Hugging Face `config.json` both become a `ModelArch`; every
number about KV memory is derived from it by `facts.kv_memory.layer_kv_bytes_per_token`,
the one copy of vLLM's formula (vLLM v1 `kv_cache_interface`).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LayerKind = Literal["full", "sliding", "mla", "linear", "shared"]
"""full: global attention; sliding: window-bounded; mla: one latent per token;
linear: linear attention / Mamba (fixed state, no per-token KV);
shared: reuses another layer's KV (no cache of its own)."""

AttentionKind = Literal["gqa", "mha", "mqa", "mla"]


class ModelArch(BaseModel):
    """What kvpolicy needs to know about a model to decide its KV cache."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    """Catalog id (lower case), or the folder name of a local config."""
    hf_id: str | None = None
    """Hugging Face repository id, e.g. `openai/gpt-oss-20b`."""
    family: str = ""
    """Model family used by pins, e.g. `llama`, `gpt-oss`, `kimi`."""
    aliases: list[str] = Field(default_factory=list)
    """Other names accepted on the command line."""
    num_layers: int = Field(gt=0)
    """Decoder layers (`num_hidden_layers`)."""
    layer_types: list[LayerKind]
    """Kind of each decoder layer, index order."""
    num_attention_heads: int = Field(gt=0)
    """Query heads per layer."""
    num_kv_heads: int = Field(gt=0)
    """KV heads per layer (`num_key_value_heads`); MLA models list the nominal value."""
    head_dim: int = Field(gt=0)
    """Key head dimension of sliding and full layers (MLA: qk_nope + qk_rope)."""
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
    """Learned attention sinks (gpt-oss)."""
    max_position_embeddings: int | None = Field(default=None, gt=0)
    """Longest context the model supports."""
    weights_gb: float | None = Field(default=None, gt=0)
    """Weight memory in GB (1e9 bytes) as loaded by vLLM, all ranks together."""
    params_b: float | None = Field(default=None, gt=0)
    """Total parameters in billions; weights default to 2 bytes each when `weights_gb` is unset."""
    source: str = ""
    """Where the numbers come from."""

    @model_validator(mode="before")
    @classmethod
    def _expand_layer_pattern(cls, data: Any) -> Any:
        """Catalog shorthand: `layer_pattern` tiles to num_layers; `kv_shared_from` marks reusers."""
        if not isinstance(data, dict) or "layer_types" in data:
            return data
        data = dict(data)
        pattern = data.pop("layer_pattern", None) or ["mla" if data.get("attention") == "mla" else "full"]
        shared_from = data.pop("kv_shared_from", None)
        n = data.get("num_layers")
        if isinstance(n, int) and n > 0:
            types = [pattern[i % len(pattern)] for i in range(n)]
            if shared_from is not None:
                types = [t if i < shared_from else "shared" for i, t in enumerate(types)]
            data["layer_types"] = types
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
        """Number of layers of each kind."""
        counts: dict[str, int] = {}
        for t in self.layer_types:
            counts[t] = counts.get(t, 0) + 1
        return counts

    def count(self, kind: LayerKind) -> int:
        """Number of layers of one kind."""
        return self.kind_counts.get(kind, 0)

    @cached_property
    def max_head_dim(self) -> int:
        """Largest key head dimension over the layers that hold a GQA/MHA cache."""
        dims = [self.head_dims(i)[0] for i in self.kv_layer_indices if self.layer_types[i] != "mla"]
        return max(dims) if dims else self.head_dim

    @cached_property
    def kv_layer_indices(self) -> list[int]:
        """Layers that hold a per-token KV cache of their own."""
        return [i for i, t in enumerate(self.layer_types) if t in ("full", "sliding", "mla")]

    @cached_property
    def is_hybrid(self) -> bool:
        """True when layers of more than one cache kind exist (sliding, linear or shared beside full)."""
        return len({t for t in self.layer_types if t != "shared"}) > 1

    @cached_property
    def content_key(self) -> tuple[Any, ...]:
        """Every field as one hashable tuple (lists as tuples): tables derived from the architecture are cached by it."""
        return tuple(tuple(v) if isinstance(v, list) else v for v in (getattr(self, n) for n in type(self).model_fields))

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> ModelArch:
        """A copy with `update` applied, whose derived values (the cached properties) are computed afresh."""
        copy = super().model_copy(update=update, deep=deep)
        for name in ("kind_counts", "max_head_dim", "kv_layer_indices", "is_hybrid", "content_key"):
            copy.__dict__.pop(name, None)
        return copy

    @property
    def weight_bytes(self) -> float:
        """Weight memory in bytes (all ranks); 2 bytes per parameter when not given."""
        if self.weights_gb is not None:
            return self.weights_gb * 1e9
        return (self.params_b or 0.0) * 1e9 * 2

    def head_dims(self, layer: int) -> tuple[int, int]:
        """(key, value) head dimensions of one layer."""
        k = self.full_head_dim if (self.layer_types[layer] == "full" and self.full_head_dim) else self.head_dim
        v = self.v_head_dim or k
        return k, v

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one tensor-parallel rank holds; vLLM replicates heads when tp > kv heads."""
        return max(1, self.num_kv_heads // tp)
