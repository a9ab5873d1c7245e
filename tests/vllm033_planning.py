"""Run vLLM 0.33's own KV-cache planning on layer descriptions, for tests/test_kv_specs.py.

Executed by the vLLM 0.33 interpreter (`VLLM033_PYTHON`, CPU build; not kvpolicy's
environment): reads JSON cases on stdin, writes one JSON result per case on stdout.
A case gives each cache module's geometry and KV dtype, the model-level head count
and size, the backends' preferred block size, the in-flight tokens, max_model_len and
a KV budget. Everything else is vLLM's code: the backends' `customize_spec` for the
bytes, `MambaStateShapeCalculator` for the state shapes, `Platform._align_hybrid_block_size`
and `_align_heterogeneous_kv_block_size` for the block size, the layers' spec
construction (`_largest_kernel_block_within` for sliding layers), `get_kv_cache_groups`,
`_get_kv_cache_bytes_per_block`, `max_memory_usage_bytes` and
`get_max_concurrency_for_kv_cache_config` / `get_kv_cache_capacity`.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch

import vllm
from vllm.config import CacheConfig
from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend
from vllm.model_executor.layers.mamba import abstract as mamba_abstract
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
from vllm.model_executor.models import ModelRegistry
from vllm.platforms.interface import Platform
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.flashinfer import FlashInferBackend
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend
from vllm.v1.core import kv_cache_planning as planning
from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    get_kv_quant_mode,
)
from vllm.v1.worker.utils import customize_attention_spec

MODEL_DTYPE = torch.bfloat16


def torch_dtype(name: str) -> torch.dtype:
    return MODEL_DTYPE if name == "auto" else STR_DTYPE_TO_TORCH_DTYPE[name]


def backend_for(dtype: str, mla: bool, sparse: bool) -> type:
    """The backend that owns a dtype's packing (the one vLLM's selection gives it on Hopper)."""
    if mla:
        return FlashMLASparseBackend if sparse else MLACommonBackend
    if dtype.startswith("turboquant_"):
        return TurboQuantAttentionBackend
    if dtype.endswith("_per_token_head"):
        return TritonAttentionBackend
    if dtype.startswith("nvfp4") or dtype == "fp8_e5m2":
        return FlashInferBackend
    return FlashAttentionBackend


def mamba_state(st: dict, tp: int) -> tuple[tuple, tuple]:
    t = st["type"]
    conv_dt, ssm_dt = st["conv_dtype"], st["ssm_dtype"]
    if t == "mamba1":
        shapes = MambaStateShapeCalculator.mamba1_state_shape(tp, st["intermediate"], st["state_size"],
                                                              st["conv_kernel"])
        dtypes = MambaStateDtypeCalculator.mamba1_state_dtype(MODEL_DTYPE, "auto", ssm_dt if ssm_dt != conv_dt else "auto")
    elif t == "mamba2":
        shapes = MambaStateShapeCalculator.mamba2_state_shape(tp, st["intermediate"], st["n_groups"], st["num_heads"],
                                                              st["head_dim"], st["state_size"], st["conv_kernel"])
        dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(MODEL_DTYPE, "auto", ssm_dt if ssm_dt != conv_dt else "auto")
    elif t == "gdn":
        shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(tp, st["num_k_heads"], st["num_v_heads"],
                                                                       st["head_k_dim"], st["head_v_dim"],
                                                                       st["conv_kernel"])
        dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(MODEL_DTYPE, "auto",
                                                                       ssm_dt if ssm_dt != conv_dt else "auto")
    else:
        raise ValueError(t)
    return tuple(tuple(s) for s in shapes), tuple(dtypes)


def run(case: dict) -> dict:
    tp = case["tp"]
    L, mif = case["max_model_len"], case["in_flight_tokens"]
    engine_dtype, skips = case["engine_dtype"], case["skip_layers"]
    mla = case["mla"]
    sparse = any(m.get("indexer_head_dim") for m in case["modules"])
    cache = CacheConfig(block_size=case["block_size"], cache_dtype=engine_dtype,
                        kv_cache_dtype_skip_layers=list(skips))
    cache.kv_cache_layout = "LBNHC"
    hybrid = any(m["kind"] in ("mamba", "gdn") for m in case["modules"])
    if hybrid:
        cache.mamba_cache_mode = "align"
    heads, head = case["model_kv_heads"], case["model_head_size"]
    model = SimpleNamespace(use_mla=mla, dtype=MODEL_DTYPE, is_hybrid=hybrid, architecture="Oracle",
                            max_model_len=L, get_head_size=lambda: head,
                            get_num_kv_heads=lambda pc: 1 if mla else max(1, heads // pc.tensor_parallel_size))
    parallel = SimpleNamespace(tensor_parallel_size=tp, decode_context_parallel_size=1)
    vc = SimpleNamespace(cache_config=cache, model_config=model, parallel_config=parallel,
                         max_in_flight_tokens=mif, num_speculative_tokens=0,
                         scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
                         attention_config=SimpleNamespace(hisparse_config=None))
    first = next(m for m in case["modules"] if m["kind"] in ("full", "sliding", "chunked", "mla"))
    first_backend = backend_for(first["dtype"], mla, sparse)
    states = [m["state"] for m in case["modules"] if m.get("state")]
    if hybrid:
        shapes, dtypes = mamba_state(states[0], tp)
        stub = type("Stub", (), {"get_mamba_state_shape_from_config": classmethod(lambda c, v: shapes),
                                 "get_mamba_state_dtype_from_config": classmethod(lambda c, v: dtypes)})
        ModelRegistry.resolve_model_cls = lambda *a, **k: (stub, "Oracle")
        mamba_abstract.get_mamba_prefill_checkpoint_alignment = lambda v: case["checkpoint_alignment"]
        Platform._find_non_ssm_backends = classmethod(lambda c, v: [first_backend])
        Platform._align_hybrid_block_size(vc, first_backend)
    if skips:
        Platform._align_heterogeneous_kv_block_size(vc, first_backend)
    block = cache.block_size
    specs: dict[str, object] = {}
    per_token: dict[str, int] = {}
    for i, m in enumerate(case["modules"]):
        name = f"layers.{m['index']}.{m['kind']}.{i}"
        kind, dt = m["kind"], m.get("dtype", "auto")
        if kind in ("mamba", "gdn"):
            shapes, dtypes = mamba_state(m["state"], tp)
            ckpt = 1 if m["state"]["type"] == "mamba2" or (m["state"]["type"] == "gdn" and case["checkpoint_alignment"]) else 0
            specs[name] = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=cache.mamba_block_size or L,
                                    page_size_padded=cache.mamba_page_size_padded, mamba_cache_mode=cache.mamba_cache_mode,
                                    num_prefill_checkpoint_blocks=ckpt)
            continue
        backend = backend_for(dt, kind == "mla", sparse)
        mode = get_kv_quant_mode(dt)
        h = m["kv_heads_per_rank"]
        if kind == "mla":
            spec = MLAAttentionSpec(block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=m["head_size"],
                                    dtype=torch_dtype(dt), cache_dtype_str=dt, kv_quant_mode=mode,
                                    state_content_bytes={"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(dt))
            specs[name] = customize_attention_spec(MLACommonBackend, spec)
            per_token[name] = specs[name].real_page_size_bytes // block
            if m.get("indexer_head_dim"):
                d = m["indexer_head_dim"]
                specs[name + ".indexer"] = MLAAttentionSpec(block_size=block, num_kv_heads=1, max_tp_shards=1,
                                                            head_size=d + d // 128 * 4, dtype=torch.uint8,
                                                            cache_role=SparseCacheRole.INDEXER)
                per_token[name + ".indexer"] = d + d // 128 * 4
            continue
        common = dict(num_kv_heads=h, head_size=m["head_size"], dtype=torch_dtype(dt), kv_quant_mode=mode)
        if kind == "sliding":
            one = backend.customize_spec(SlidingWindowSpec(block_size=1, head_size_v=m["head_size_v"],
                                                           sliding_window=m["window"], **common))
            sw_per_token = one.real_page_size_bytes
            budget = cache.skip_page_size_padded or sw_per_token * block
            sw_block = _largest_kernel_block_within(backend, sw_per_token, budget, block, one)
            spec = SlidingWindowSpec(block_size=sw_block, head_size_v=m["head_size_v"], sliding_window=m["window"],
                                     page_size_padded=cache.skip_page_size_padded, **common)
        elif kind == "chunked":
            spec = ChunkedLocalAttentionSpec(block_size=block, attention_chunk_size=m["chunk"], **common)
        else:
            spec = FullAttentionSpec(block_size=block, head_size_v=m["head_size_v"], **common)
        specs[name] = customize_attention_spec(backend, spec)
        per_token[name] = specs[name].real_page_size_bytes // specs[name].block_size
    groups = planning.get_kv_cache_groups(vc, dict(specs))
    layout = cache.get_resolved_kv_cache_layout()
    bytes_per_block = planning._get_kv_cache_bytes_per_block(groups, layout)
    blocks = []
    for g in groups:
        spec = g.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            blocks.append(spec.max_memory_usage_pages(vc))
        else:
            blocks.append(-(-spec.max_memory_usage_bytes(vc) // spec.page_size_bytes))
    num_blocks = case["available"] // bytes_per_block
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    tokens, concurrency = get_kv_cache_capacity(vc, config)
    return {"block_size": block, "bytes_per_block": bytes_per_block, "blocks_per_request": sum(blocks),
            "num_groups": len(groups), "num_blocks": num_blocks, "max_concurrency": concurrency,
            "tokens": tokens, "bytes_per_token": sum(per_token.values()), "vllm": vllm.__version__}


if __name__ == "__main__":
    for line in sys.stdin:
        if line.strip():
            try:
                print(json.dumps({"ok": run(json.loads(line))}), flush=True)
            except Exception as exc:  # reported per case to the test
                print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
