"""KV memory as vLLM 0.33 allocates it: per-layer formats, specs, block sizes, groups, blocks and capacity.

`Layout` applies a KV dtype to a model's layers (skip layers and TurboQuant's boundary
layers keep the model dtype; `auto` resolves as the checkpoint says) and gives each
layer's bytes per token on one TP rank. `plan` follows vLLM's allocator step by step
(paths relative to `vllm/`):

1. block size: the backends' preferred block (`Platform.update_block_size_for_backend`,
   `platforms/interface.py`), raised for Mamba hybrids (`_align_hybrid_block_size`) and
   for skip layers (`_align_heterogeneous_kv_block_size`);
2. one spec per cache module (`Attention/MLAAttention/MambaBase.get_kv_cache_spec`);
3. groups (`get_kv_cache_groups`, `v1/core/kv_cache_planning.py`): one group when all
   specs are equal or of one type, else page sizes unified, layers bucketed by spec and
   split into groups of equal size (short groups are padding layers);
4. bytes per block (the widest group), blocks per request per group at max_model_len
   (`max_memory_usage_bytes` of each spec), and from a byte budget the number of blocks,
   "Maximum concurrency" and "GPU KV cache size" (`get_kv_cache_capacity`,
   `v1/core/kv_cache_utils.py`).

The byte budget itself is modelled: `memory x gpu_memory_utilization - weights / tp -
runtime reserve` (vLLM profiles activations and CUDA graphs at start-up).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvpolicy import noun
from kvpolicy.formats import FORMATS, KvFormat
from kvpolicy.inputs.arch import ATTENTION_KINDS, RECURRENT_KINDS, LayerSpec, ModelArch
from kvpolicy.inputs.gpus import GpuSpec
from kvpolicy.inputs.workload import Workload

GIB = 1 << 30
RUNTIME_RESERVE_GIB = 2.5
"""Activations, CUDA graphs and allocator slack vLLM keeps outside the KV cache (modelled; vLLM profiles it)."""
TURBOQUANT_BOUNDARY_LAYERS = 2
"""TurboQuantConfig.get_boundary_skip_layers: the first and last n = min(2, layers // 2) layers stay in the
model dtype, for dense models only (model_executor/layers/quantization/turboquant/config.py)."""
INDEXER_QUANT_BLOCK = 128
"""DSA indexer cache: fp8 keys plus one fp32 scale per 128 values (models/deepseek_v32/attention.py)."""
_STORAGE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def indexer_bytes_per_token(head_dim: int) -> int:
    """`DeepseekV32IndexerCache` head_dim = index_head_dim + index_head_dim // 128 * 4 (uint8, not TP split)."""
    return head_dim + head_dim // INDEXER_QUANT_BLOCK * 4


def _element_bytes(fmt: KvFormat, model_dtype: str) -> int:
    return _STORAGE_BYTES.get(model_dtype, 2) if fmt.storage == "model" else _STORAGE_BYTES.get(fmt.storage, 1)


def attention_bytes(spec: LayerSpec, fmt: KvFormat, tp: int, *, model_dtype: str = "bfloat16",
                    rotary_dim: int | None = None) -> int:
    """Bytes one token adds to one attention module's cache on one TP rank (0 for modules without one)."""
    if spec.kind == "mla":
        assert spec.kv_lora_rank is not None and spec.rope_dim is not None
        if fmt.family == "bf16":
            return (spec.kv_lora_rank + spec.rope_dim) * _element_bytes(fmt, model_dtype)
        return fmt.mla_bytes(spec.kv_lora_rank, spec.rope_dim)
    if spec.kind not in ("full", "sliding", "chunked"):
        return 0
    heads = spec.kv_heads_per_rank(tp)
    if fmt.family == "bf16":
        return heads * (spec.head_size + spec.head_size_v) * _element_bytes(fmt, model_dtype)
    return heads * fmt.slot_bytes(spec.head_size, spec.head_size_v, rotary_dim=rotary_dim)


def layer_kv_bytes_per_token(arch: ModelArch, layer: int, fmt: KvFormat, tp: int = 1) -> int:
    """Bytes one token adds to one decoder layer's attention cache on one rank (the indexer not included)."""
    spec = arch.layer(layer)
    if spec.kind not in ATTENTION_KINDS:
        return 0
    return attention_bytes(spec, fmt, tp, model_dtype=arch.model_dtype, rotary_dim=arch.rotary_dim)


# -- the layout: a KV dtype applied to the layers ---------------------------------------------


@dataclass(frozen=True, eq=False)
class Layout:
    """A KV format per cache module for one deployment, with its byte counts precomputed."""

    arch: ModelArch
    formats: tuple[KvFormat, ...]
    """Format of each decoder layer's attention (the requested one where a layer has none)."""
    tp: int = 1
    by_kind: tuple[tuple[str, int], ...] = ()
    """Bytes per token per rank summed over the modules of each kind (`indexer` for the DSA indexer)."""
    dtype: str = "auto"
    """The requested `--kv-cache-dtype`."""
    skip_layers: tuple[str, ...] = ()
    """`--kv-cache-dtype-skip-layers` as vLLM sees it (TurboQuant's boundary layers added)."""
    module_formats: tuple[KvFormat | None, ...] = ()
    """Format of each module of `arch.layers` (None for modules without a KV cache)."""
    notes: tuple[str, ...] = ()
    """What vLLM changed about the request (auto resolved, sparse-MLA canonicalisation, boundary layers)."""

    @classmethod
    def of(cls, arch: ModelArch, dtype: str, skip_layers: list[str] | tuple[str, ...] = (), tp: int = 1,
           gpu: GpuSpec | None = None) -> Layout:
        """Per-layer formats for a dtype, honouring skip layers (and TurboQuant's boundary layers)."""
        return _layout(_ArchKey(arch), dtype, tuple(skip_layers), tp, gpu.sm if gpu is not None else None)

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes per token per rank, summed over the modules of each kind that hold KV."""
        return dict(self.by_kind)

    def bytes_per_token(self) -> int:
        """Bytes per token per rank over all KV-holding modules."""
        return sum(b for _, b in self.by_kind)

    def growing_bytes(self) -> int:
        """Bytes read per extra token of context at long context (sliding and chunked layers stop growing)."""
        return sum(b for kind, b in self.by_kind if kind in ("full", "mla", "indexer")) or self.bytes_per_token()


class _ArchKey:
    """A ModelArch compared and hashed by its content, so that equal architectures share cached layouts."""

    __slots__ = ("arch", "content", "hash")

    def __init__(self, arch: ModelArch) -> None:
        self.arch = arch
        self.content = arch.content_key
        self.hash = arch.content_hash

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ArchKey) and self.content == other.content


def boundary_layers(arch: ModelArch, dtype: str) -> list[str]:
    """Layers vLLM keeps in the model dtype under TurboQuant / UltraQuant (engine/arg_utils.py)."""
    if not (dtype.startswith("turboquant_") or dtype == "ultraquant_4bit") or arch.has_recurrent_state:
        return []
    n = min(TURBOQUANT_BOUNDARY_LAYERS, arch.num_layers // 2)
    return [str(i) for i in sorted(set(range(n)) | set(range(arch.num_layers - n, arch.num_layers)))]


def resolve_dtype(arch: ModelArch, dtype: str, sm: int | None) -> tuple[str, list[str]]:
    """The engine-level cache dtype for a requested one, and what changed it."""
    notes = []
    if dtype == "auto" and arch.auto_kv_dtype != "auto" and arch.kv_cache_scheme is not None \
            and arch.kv_cache_scheme.method.startswith("modelopt"):
        notes.append(f"auto -> {arch.auto_kv_dtype}: {arch.auto_kv_basis}")
        dtype = arch.auto_kv_dtype
    if dtype == "auto" and arch.architecture == "GlmMoeDsaForCausalLM" and sm is not None and sm // 10 == 10:
        # models/config.py GlmMoeDsaForCausalLM.verify_and_update_config
        notes.append("auto -> fp8_e4m3: GLM-5 on SM10x (models/config.py GlmMoeDsaForCausalLM)")
        dtype = "fp8_e4m3"
    if dtype == "auto" and arch.kv_cache_scheme is not None and arch.kv_cache_scheme.method == "compressed-tensors" \
            and arch.attention != "mla":
        # Attention.__init__ turns auto into fp8 and rewrites cache_config.cache_dtype (attention.py).
        notes.append(f"auto -> fp8: {arch.auto_kv_basis}")
        dtype = "fp8"
    if dtype == "bfloat16" and arch.architecture == "DeepseekV32ForCausalLM":
        dtype = "auto"  # models/config.py DeepseekV32ForCausalLM
    return dtype, notes


def _sparse_mla_dtype(dtype: str, sm: int | None) -> tuple[str, str | None]:
    """`MLAAttention._canonicalize_sparse_mla_kv_cache_dtype` on the backend vLLM picks for sparse MLA
    (platforms/cuda.py priorities): FLASHMLA_SPARSE turns a quantized dtype into fp8_ds_mla (656 B)."""
    fmt = FORMATS[dtype]
    if sm is None or fmt.family == "mla_ds":
        return dtype, None
    major = sm // 10
    if major == 9 and dtype == "fp8":
        return "fp8_ds_mla", "fp8 -> fp8_ds_mla: FLASHMLA_SPARSE on SM90 (mla_attention.py)"
    if major == 12 and dtype in ("auto", "fp8", "fp8_e4m3"):
        return "fp8_ds_mla", f"{dtype} -> fp8_ds_mla: FLASHINFER_MLA_SPARSE_SM120 (mla_attention.py)"
    return dtype, None


# Bounded: layouts for a few thousand (architecture, dtype, skips, tp, sm) combinations.
@functools.lru_cache(maxsize=2048)
def _layout(key: _ArchKey, dtype: str, skip_layers: tuple[str, ...], tp: int, sm: int | None) -> Layout:
    arch = key.arch
    engine_dtype, notes = resolve_dtype(arch, dtype, sm)
    boundary = boundary_layers(arch, engine_dtype)
    skips = tuple(sorted(set(skip_layers) | set(boundary)))
    if boundary:
        notes.append(f"boundary layers {', '.join(boundary)} stay in the model dtype (TurboQuantConfig."
                     "get_boundary_skip_layers)")
    module_formats: list[KvFormat | None] = []
    by_kind: dict[str, int] = {}
    per_layer: dict[int, KvFormat] = {}
    for spec in arch.layers:
        if spec.kind not in ATTENTION_KINDS:
            module_formats.append(None)
            continue
        name = engine_dtype
        skipped = str(spec.index) in skips or (spec.kind == "sliding" and "sliding_window" in skips)
        if skipped:
            name = "auto"
        if spec.kind == "mla" and spec.indexer_head_dim:
            name, note = _sparse_mla_dtype(name, sm)
            if note and note not in notes:
                notes.append(note)
        fmt = FORMATS[name]
        module_formats.append(fmt)
        per_layer.setdefault(spec.index, fmt)
        b = attention_bytes(spec, fmt, tp, model_dtype=arch.model_dtype, rotary_dim=arch.rotary_dim)
        by_kind[spec.kind] = by_kind.get(spec.kind, 0) + b
        if spec.indexer_head_dim:
            by_kind["indexer"] = by_kind.get("indexer", 0) + indexer_bytes_per_token(spec.indexer_head_dim)
    requested = FORMATS[engine_dtype]
    formats = tuple(per_layer.get(i, requested) for i in range(arch.num_layers))
    order = ("full", "sliding", "chunked", "mla", "indexer")
    layout = Layout(arch, formats, tp, tuple((k, by_kind[k]) for k in order if k in by_kind), dtype=dtype,
                    skip_layers=skips, module_formats=tuple(module_formats), notes=tuple(notes))
    # GPUs of another compute capability mostly get the same layout: one object for equal content, so that the
    # specs and groups cached per layout object (`_grouping`) serve all of them.
    same = (key, tuple(f.name for f in formats), tp, layout.by_kind, dtype, skips,
            tuple(f.name if f is not None else None for f in module_formats), layout.notes)
    if len(_LAYOUTS) >= 4096:
        _LAYOUTS.clear()
    return _LAYOUTS.setdefault(same, layout)


_LAYOUTS: dict[tuple[Any, ...], Layout] = {}
"""Layouts by content (`_layout`)."""


# -- vLLM serve defaults that shape the allocation ---------------------------------------------


@dataclass(frozen=True)
class ServeDefaults:
    """The `vllm serve` settings the allocation depends on, as vLLM 0.33 defaults them for a GPU."""

    max_num_batched_tokens: int
    in_flight_tokens: int
    """`VllmConfig.max_in_flight_tokens` = 2 x max_num_batched_tokens (async scheduling, PP = 1)."""
    block_size: int
    """Phase-1 block size: the smallest every attention backend of the model accepts."""
    min_kernel_block: int
    """Smallest kernel block of the first layer's backend."""
    mamba_align: bool = True
    """Prefix caching on (the default): Mamba cache mode `align`."""
    checkpoint_alignment: int | None = None
    """Prefill checkpoint alignment of the Mamba layers (FlashInfer GDN prefill: 64), None when absent."""
    basis: str = ""


def serve_defaults(arch: ModelArch, gpu: GpuSpec | None, dtype: str = "auto") -> ServeDefaults:
    """vLLM's defaults for this model on this GPU (engine/arg_utils.py get_batch_defaults; platforms/cuda.py)."""
    mem = gpu.memory_gib if gpu is not None else 80.0
    name = gpu.name.lower() if gpu is not None else ""
    sm = gpu.sm if gpu is not None else 90
    if mem >= 160:
        mnbt = 16384
    elif mem >= 70 and "a100" not in name and sm != 121:
        mnbt = 8192
    else:
        mnbt = 2048
    basis = f"max_num_batched_tokens {mnbt} (vllm serve default for {mem:g} GiB), in flight 2 x {mnbt}"
    block, kernel = _default_block(arch, sm, dtype)
    ckpt = None
    gdn = [s for s in arch.layers if s.kind == "gdn" and s.state is not None]
    mamba_specs = [s for s in arch.layers if s.kind in RECURRENT_KINDS]
    if gdn and len(gdn) == len(mamba_specs) and sm is not None:
        # qwen_gdn_linear_attn.py _resolve_gdn_prefill_backend: FlashInfer GDN prefill on SM90, and on SM10x/12x
        # with head_k_dim 128 (CUDA >= 13 assumed); its checkpoints align to 64 tokens in align mode.
        hk = gdn[0].state.head_k_dim if gdn[0].state else 0
        if sm // 10 == 9 or (sm // 10 in (10, 12) and hk == 128):
            ckpt = 64
    return ServeDefaults(mnbt, 2 * mnbt, block, kernel, True, ckpt, basis)


def _default_block(arch: ModelArch, sm: int | None, dtype: str) -> tuple[int, int]:
    """(phase-1 block size, smallest kernel block of the first backend) for the backend vLLM picks."""
    if arch.is_sparse_mla:
        return 64, 64  # FLASHMLA_SPARSE / FLASH_ATTN_MLA_SPARSE and the DSA indexer: kernel block 64
    if arch.attention == "mla" and sm is not None:
        major = sm // 10
        quantized = FORMATS[dtype].quantized if dtype in FORMATS else False
        if major == 9 and quantized:
            return 64, 64  # FLASHMLA [64] (FLASH_ATTN_MLA takes bf16 only)
        if major == 10:
            return 32, 32  # FLASHINFER_MLA [32, 64]
        return 16, 16  # FLASH_ATTN_MLA / TRITON_MLA: MultipleOf(16)
    return 16, 16  # FLASH_ATTN / FLASHINFER / TRITON_ATTN / TURBOQUANT all take 16


# -- the allocator ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """One module's KV cache spec, reduced to what grouping and sizing read."""

    cls: str
    """full | sliding | chunked | mla | indexer | mamba."""
    block_size: int
    per_token: int = 0
    """Unpadded bytes per token (attention); the state bytes (mamba)."""
    page_size_padded: int | None = None
    window: int = 0
    identity: tuple = ()
    """Everything else vLLM compares when deciding whether two specs are equal."""
    mamba_blocks: int = 0
    """Blocks per request of a Mamba spec."""

    @property
    def page(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.per_token if self.cls == "mamba" else self.per_token * self.block_size

    def blocks(self, max_len: int, in_flight: int) -> int:
        """`cdiv(max_memory_usage_bytes, page_size_bytes)` at max_model_len."""
        if self.cls == "mamba":
            return self.mamba_blocks
        if self.cls == "sliding":
            return ceil_div(min(self.window - 1 + in_flight, max_len), self.block_size) + 1
        if self.cls == "chunked":
            return ceil_div(min(self.window + in_flight, max_len), self.block_size)
        return ceil_div(max_len, self.block_size)

    @property
    def base_type(self) -> str:
        """KVCacheSpecRegistry base: FullAttentionSpec covers full, MLA and the indexer."""
        return "full" if self.cls in ("full", "mla", "indexer") else self.cls


@dataclass(frozen=True)
class Group:
    """One KV cache group of vLLM's allocator."""

    kind: str
    """The spec class of its layers (`full+mla+indexer` style for one mixed uniform-type group)."""
    num_layers: int
    """Cache modules in the group (real, not padding)."""
    slots: int
    """Layer slots of the group (num_layers + padding)."""
    block_size: int
    """Tokens per block of the group."""
    page_bytes: int
    """Bytes of one block of one layer (the sum over layers for a mixed group)."""
    blocks_per_request: int
    """Blocks one request at max_model_len takes from the pool in this group."""


@dataclass(frozen=True)
class Capacity:
    """What vLLM logs at start-up for a KV budget: `GPU KV cache size` and `Maximum concurrency`."""

    available_bytes: int
    num_blocks: int
    max_concurrency: float
    """num_blocks / blocks per request (vLLM logs it with two decimals)."""
    tokens: int
    """int(max_concurrency x max_model_len): the logged "GPU KV cache size"."""
    requests_that_fit: int
    """Whole requests at max_model_len the pool serves at once (the null block held back)."""
    fits_one: bool
    """vLLM's start-up check: one request at max_model_len fits in the budget minus one block."""


@dataclass(frozen=True)
class KvPlan:
    """vLLM's KV cache layout for one model, dtype, GPU and max_model_len."""

    layout: Layout
    max_model_len: int
    block_size: int
    """`cache_config.block_size` after the hybrid and skip-layer alignment."""
    groups: tuple[Group, ...]
    bytes_per_block: int
    blocks_per_request: int
    defaults: ServeDefaults
    notes: tuple[str, ...] = field(default=())
    problem: str | None = None
    """Why vLLM 0.33 would fail to plan this cache (the figures then pad every page to the largest)."""

    @property
    def request_bytes(self) -> int:
        """Bytes vLLM reserves per request at max_model_len (recurrent state included)."""
        return self.bytes_per_block * self.blocks_per_request

    @property
    def state_request_bytes(self) -> int:
        """The part of `request_bytes` held by Mamba-family groups."""
        return self.bytes_per_block * sum(g.blocks_per_request for g in self.groups if g.kind == "mamba")

    @property
    def padding_layers(self) -> int:
        return sum(g.slots - g.num_layers for g in self.groups)

    def capacity(self, available: float) -> Capacity:
        """Blocks, concurrency and logged tokens for `available` bytes of KV memory on one rank."""
        avail = int(available)
        if avail <= 0 or self.bytes_per_block <= 0 or self.blocks_per_request <= 0:
            return Capacity(max(avail, 0), 0, 0.0, 0, 0, False)
        num_blocks = avail // self.bytes_per_block
        conc = num_blocks / self.blocks_per_request
        fits = self.bytes_per_block * self.blocks_per_request <= avail - self.bytes_per_block
        whole = max(0, (num_blocks - 1) // self.blocks_per_request)
        return Capacity(avail, num_blocks, conc, int(conc * self.max_model_len), whole, fits)

    def describe(self) -> str:
        """The groups, as `n x kind (layers, block tokens, blocks/request)`."""
        parts: dict[tuple[str, int, int, int], int] = {}
        for g in self.groups:
            k = (g.kind, g.slots, g.block_size, g.blocks_per_request)
            parts[k] = parts.get(k, 0) + 1
        out = []
        for (kind, slots, bs, bpr), n in parts.items():
            out.append(f"{n} {kind} {noun(n, 'group')} x {bpr} {noun(bpr, 'block')} of {bs} tokens")
        pad = f", {self.padding_layers} padding layers" if self.padding_layers else ""
        return "; ".join(out) + pad


def plan(arch: ModelArch, layout: Layout, max_model_len: int, gpu: GpuSpec | None = None, *,
         block_size: int | None = None) -> KvPlan:
    """vLLM's groups and blocks for a layout at a max_model_len (every step cites the vLLM function it follows).

    `block_size` is a `--block-size` given to vLLM (`cache_config.user_specified_block_size`): it replaces the
    backend's preferred block of phase 1; the hybrid and skip-layer alignments still apply to it."""
    return _plan(_ArchKey(arch), layout, max_model_len, _GpuKey(gpu), block_size)


class _GpuKey:
    """A GpuSpec hashed by the fields the allocation reads."""

    __slots__ = ("gpu", "content")

    def __init__(self, gpu: GpuSpec | None) -> None:
        self.gpu = gpu
        self.content = None if gpu is None else (gpu.id, gpu.name, gpu.memory_gib, gpu.sm)

    def __hash__(self) -> int:
        return hash(self.content)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _GpuKey) and self.content == other.content


@functools.lru_cache(maxsize=2048)
def _plan(key: _ArchKey, layout: Layout, max_model_len: int, gpu_key: _GpuKey, block_size: int | None) -> KvPlan:
    arch, gpu = key.arch, gpu_key.gpu
    tp = layout.tp
    engine_dtype, _ = resolve_dtype(arch, layout.dtype, gpu.sm if gpu else None)
    defaults = serve_defaults(arch, gpu, engine_dtype)
    notes = list(layout.notes)
    block = block_size or defaults.block_size
    fmt = FORMATS[engine_dtype]
    model_heads = max(1, arch.num_kv_heads // tp)
    elem = _element_bytes(FORMATS["auto"], arch.model_dtype)

    # Model-level pages of one token (ModelConfig.get_num_kv_heads / get_head_size), as the platform computes them.
    if arch.attention == "mla":
        latent = (arch.kv_lora_rank or 0) + (arch.qk_rope_head_dim or 0)
        primary_1tok = latent * (elem if fmt.family == "bf16" else 1)
        auto_1tok = latent * elem
    else:
        d = arch.head_dim
        auto_1tok = model_heads * 2 * d * elem
        primary_1tok = auto_1tok if fmt.family == "bf16" else model_heads * 2 * d * 1

    recurrent, mamba_page = _mamba_page(key, tp)
    mamba_padded: int | None = None
    mamba_block = max_model_len

    # Phase 2: Mamba hybrids (platforms/interface.py _align_hybrid_block_size).
    if recurrent and mamba_page:
        if arch.attention == "mla":
            attn_1tok = primary_1tok
        elif fmt.family in ("turboquant", "ultraquant"):
            packed = model_heads * fmt.slot_bytes(arch.head_dim)
            attn_1tok = math.lcm(packed, auto_1tok) if layout.skip_layers else packed
        else:
            attn_1tok = _packed_1tok(fmt, model_heads, arch, elem)
        k = max(defaults.min_kernel_block, block)
        if arch.attention == "mla":
            k = max(k, 128)
        if defaults.mamba_align:
            k = math.lcm(k, defaults.checkpoint_alignment or 1)
        attn_block = k * ceil_div(mamba_page, k * attn_1tok)
        attn_block = 16 * ceil_div(attn_block, 16)
        block = max(block, attn_block)
        mamba_block = block
        if block * attn_1tok != mamba_page:
            mamba_padded = block * attn_1tok
        notes.append(f"attention block {block} tokens so that its page covers the {mamba_page:,}-byte Mamba state "
                     "(platforms/interface.py _align_hybrid_block_size)")

    # Phase 3: skip layers (platforms/interface.py _align_heterogeneous_kv_block_size).
    skip_padded: int | None = None
    if layout.skip_layers:
        first = layout.module_formats[next((i for i, s in enumerate(arch.layers) if s.kind in ATTENTION_KINDS), 0)] \
            if arch.layers else None
        # The first layer's backend owns the packing of the primary page; FA/Triton-for-auto layers do not pack.
        packs = first is not None and first.name != "auto" or (fmt.family == "nvfp4" and gpu is not None
                                                               and gpu.sm is not None and gpu.sm // 10 == 10)
        primary = _packed_1tok(fmt, model_heads, arch, elem) if packs and arch.attention != "mla" else primary_1tok
        padded = auto_1tok
        if padded > primary:
            k = max(defaults.min_kernel_block, block)
            required = max(padded * defaults.min_kernel_block, mamba_padded or 0)
            pb = k * ceil_div(required, k * primary)
            if block < pb:
                notes.append(f"block size {pb} tokens so that the {engine_dtype} page covers the model-dtype skip "
                             "layers' page (platforms/interface.py _align_heterogeneous_kv_block_size)")
                block = pb
            skip_padded = block * primary
            if mamba_padded is not None:
                mamba_padded = skip_padded
            if recurrent and defaults.mamba_align:
                mamba_block = block

    # Only Mamba specs read mamba_block, which is max_model_len outside the hybrids: without them, one spec list
    # serves every context. GPUs with the same block size and in-flight tokens share the groups.
    groups, problem = _allocation(layout, block, skip_padded, mamba_padded, mamba_block if recurrent else 0,
                                  defaults.mamba_align, defaults.checkpoint_alignment, max_model_len,
                                  defaults.in_flight_tokens)
    bytes_per_block = max(_group_bytes(g) for g in groups) if groups else 0
    bpr = sum(g.blocks_per_request for g in groups)
    return KvPlan(layout, max_model_len, block, groups, bytes_per_block, bpr, defaults, tuple(notes), problem)


@functools.lru_cache(maxsize=1024)
def _mamba_page(key: _ArchKey, tp: int) -> tuple[bool, int]:
    """(the model has recurrent-state layers, the largest state page on one rank), read by every plan."""
    recurrent = [s for s in key.arch.layers if s.kind in RECURRENT_KINDS and s.state is not None]
    return bool(recurrent), max((s.state.bytes(tp) for s in recurrent if s.state), default=0)


@functools.lru_cache(maxsize=4096)
def _allocation(layout: Layout, block: int, skip_padded: int | None, mamba_padded: int | None, mamba_block: int,
                mamba_align: bool, checkpoint_alignment: int | None, max_model_len: int,
                in_flight: int) -> tuple[tuple[Group, ...], str | None]:
    """(KV cache groups, the first thing vLLM would assert on) for the specs of a layout at a max_model_len."""
    shapes, problem = _grouping(layout, block, skip_padded, mamba_padded, mamba_block, mamba_align,
                                checkpoint_alignment)
    return tuple(Group(cls, n, slots, bs, page, max(s.blocks(max_model_len, in_flight) for s in members))
                 for cls, n, slots, bs, page, members in shapes), problem


_Shape = tuple[str, int, int, int, int, tuple["_Spec", ...]]
"""A group before the context is known: (kind, layers, slots, block size, page bytes, the specs whose largest
block count per request is the group's)."""


@functools.lru_cache(maxsize=4096)
def _grouping(layout: Layout, block: int, skip_padded: int | None, mamba_padded: int | None, mamba_block: int,
              mamba_align: bool, checkpoint_alignment: int | None) -> tuple[tuple[_Shape, ...], str | None]:
    """The groups of a layout's specs without their block counts: the grouping does not read the context, so
    every max_model_len (and in-flight count) of the same specs shares it."""
    specs, problems = _specs(layout, block, skip_padded, mamba_padded, mamba_block, mamba_align, checkpoint_alignment)
    problem = problems[0] if problems else None
    try:
        shapes = _groups(specs)
    except ValueError as exc:
        problem = problem or str(exc)
        top = max(s.page for s in specs)
        shapes = _groups([replace(s, page_size_padded=top) for s in specs])
    return tuple(shapes), problem


def _packed_1tok(fmt: KvFormat, heads: int, arch: ModelArch, elem: int) -> int:
    """One token's page at model level through the backend that owns the format's packing (customize_spec)."""
    d = arch.head_dim
    if fmt.family == "bf16":
        return heads * 2 * d * elem
    return heads * fmt.slot_bytes(d, d, rotary_dim=arch.rotary_dim)


def _largest_kernel_block_within(per_token: int, budget: int) -> int:
    """attention.py _largest_kernel_block_within for a MultipleOf(16) backend (FA, Triton): the largest
    multiple of 16 tokens whose page fits the budget, at least 16."""
    return max(16, budget // per_token // 16 * 16)


@functools.lru_cache(maxsize=4096)
def _specs(layout: Layout, block: int, skip_padded: int | None, mamba_padded: int | None, mamba_block: int,
           mamba_align: bool, checkpoint_alignment: int | None) -> tuple[tuple[_Spec, ...], tuple[str, ...]]:
    """One spec per cache module, as the layers' get_kv_cache_spec build them, and what vLLM would assert on."""
    arch, tp = layout.arch, layout.tp
    out: list[_Spec] = []
    problems: list[str] = []
    for spec, fmt in zip(arch.layers, layout.module_formats):
        if spec.kind in ("shared", "none"):
            continue  # KV sharing: no spec at all (v1/worker/gpu_model_runner.py get_kv_cache_spec)
        if spec.kind in RECURRENT_KINDS:
            st = spec.state
            if st is None:
                continue
            # MambaSpec.max_memory_usage_bytes: align mode 2 + spec blocks + prefill checkpoint blocks
            # (Mamba-2 always declares one; GDN only with FlashInfer prefill; Mamba-1 none).
            ckpt = 1 if (st.type == "mamba2" or (st.type == "gdn" and checkpoint_alignment)) else 0
            n = 2 + ckpt if mamba_align else 1
            ident = ("mamba", st.shapes(tp), st.dtypes())
            out.append(_Spec("mamba", mamba_block, st.bytes(tp), mamba_padded, identity=ident, mamba_blocks=n))
            continue
        assert fmt is not None
        per_token = attention_bytes(spec, fmt, tp, model_dtype=arch.model_dtype, rotary_dim=arch.rotary_dim)
        heads = spec.kv_heads_per_rank(tp)
        ident = (spec.kind, heads, spec.head_size, spec.head_size_v, _quant_identity(fmt, spec.kind))
        if spec.kind == "sliding":
            budget = skip_padded or per_token * block
            sw_block = _largest_kernel_block_within(per_token, budget)
            padded = skip_padded
            if padded is not None and padded < sw_block * per_token:
                # AttentionSpec.page_size_bytes asserts page_size_padded >= the unpadded page: the shared skip
                # page is sized from the model-level heads, smaller than this layer's 16-token page.
                problems.append(f"vLLM 0.33 fails at start-up: the skip-layer page of {padded:,} bytes is smaller "
                                f"than layer {spec.index}'s {sw_block}-token page of {sw_block * per_token:,} bytes "
                                "(v1/kv_cache_interface.py AttentionSpec.page_size_bytes asserts)")
                padded = sw_block * per_token
            out.append(_Spec("sliding", sw_block, per_token, padded, spec.window or 0, ident + (spec.window,)))
        elif spec.kind == "chunked":
            out.append(_Spec("chunked", block, per_token, None, spec.chunk or 0, ident + (spec.chunk,)))
        else:
            out.append(_Spec("mla" if spec.kind == "mla" else "full", block, per_token, None, 0, ident))
        if spec.indexer_head_dim:
            ib = indexer_bytes_per_token(spec.indexer_head_dim)
            out.append(_Spec("indexer", block, ib, None, 0, ("indexer", ib)))
    return tuple(out), tuple(problems)


def _quant_identity(fmt: KvFormat, kind: str) -> tuple:
    """What makes two specs' dtypes differ for vLLM: the cache dtype and KVQuantMode (MLA: the dtype string)."""
    if kind == "mla":
        return (fmt.name,)
    mode = "fp8" if fmt.family == "fp8" and fmt.storage == "uint8" else fmt.name
    return (fmt.storage, "none" if fmt.family == "bf16" else mode)


def _group_bytes(g: Group) -> int:
    return g.page_bytes * g.num_layers if not g.kind.startswith("mixed") else g.page_bytes


def _groups(specs: Sequence[_Spec]) -> list[_Shape]:
    """`get_kv_cache_groups` (v1/core/kv_cache_planning.py), block counts left to `_allocation`."""
    if not specs:
        return []
    first = specs[0]
    if all(s == first for s in specs):
        return [(first.cls, len(specs), len(specs), first.block_size, first.page, (first,))]
    if _uniform_type(specs):
        # UniformTypeKVCacheSpecs: one group, each layer keeps its page; blocks = the max over layers.
        kinds = "+".join(dict.fromkeys(s.cls for s in specs))
        return [(f"mixed {kinds}", len(specs), len(specs), first.block_size, sum(s.page for s in specs),
                 tuple(dict.fromkeys(specs)))]
    specs = _unify_page_size(specs)
    buckets: dict[_Spec, list[int]] = {}
    for i, s in enumerate(specs):
        buckets.setdefault(s, []).append(i)
    sizes = [len(v) for v in buckets.values()]
    group_size = min(sizes)
    if max(sizes) < group_size * 1.5:
        group_size = max(sizes)
    groups: list[_Shape] = []
    for s, members in buckets.items():
        num_groups = ceil_div(len(members), group_size)
        for i in range(num_groups):
            layers = members[i::num_groups]
            groups.append((s.cls, len(layers), group_size, s.block_size, s.page, (s,)))
    return groups


def _uniform_type(specs: Sequence[_Spec]) -> bool:
    """`UniformTypeKVCacheSpecs.is_uniform_type`: one block size and one registered spec type."""
    if len({s.block_size for s in specs}) > 1:
        return False
    base = specs[0].base_type
    if any(s.base_type != base for s in specs):
        return False
    if base in ("sliding", "chunked"):
        return len({s.window for s in specs}) == 1
    if base == "mamba":
        return len({s.page for s in specs}) == 1 and len({s.mamba_blocks for s in specs}) == 1
    return True


def _unify_page_size(specs: Sequence[_Spec]) -> Sequence[_Spec]:
    """`unify_kv_cache_spec_page_size`: smaller pages grow their block size, or are padded (Mamba, non-dividing)."""
    pages = {s.page for s in specs}
    if len(pages) <= 1:
        return specs
    top = max(pages)
    out = []
    for s in specs:
        if s.page == top:
            out.append(s)
        elif s.cls == "mamba":
            out.append(replace(s, page_size_padded=top))
        elif top % s.page == 0:
            if s.page_size_padded is not None:
                raise ValueError("vLLM 0.33 asserts here: a padded page that the largest page is a multiple of "
                                 "(v1/core/kv_cache_planning.py unify_kv_cache_spec_page_size)")
            out.append(replace(s, block_size=s.block_size * (top // s.page)))
        elif s.cls not in ("mla", "indexer"):
            out.append(replace(s, page_size_padded=top))
        else:
            raise ValueError("vLLM cannot unify an MLA page with a larger page that it does not divide "
                             "(v1/core/kv_cache_planning.py unify_kv_cache_spec_page_size)")
    return out


# -- the budget --------------------------------------------------------------------------


def kv_budget_bytes(arch: ModelArch, gpu: GpuSpec, workload: Workload) -> float:
    """Bytes of KV cache one rank can hold (modelled; negative when the weights do not fit)."""
    usable = math.ceil(gpu.memory_gib * GIB * workload.gpu_memory_utilization)
    return usable - arch.weight_bytes / workload.tp - RUNTIME_RESERVE_GIB * GIB


def max_concurrency(kv_plan: KvPlan, budget: float) -> int:
    """Whole requests at max_model_len that the budget serves at once."""
    return kv_plan.capacity(budget).requests_that_fit
