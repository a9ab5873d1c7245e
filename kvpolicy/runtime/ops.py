"""Store and decode for one layer's cache: the Triton kernels on a GPU, the torch references elsewhere.

This is where a layer plan becomes kernel calls. The kernels take tensors, a
cache layout and switches; which switch a layer gets (format, window, sinks,
two-level, scales) comes from its plan and the variant, never from a policy.
`backend` is `triton` (CUDA) or `reference` (float64 torch, any device).
On a Hopper GPU, FP8 layers decode with the Gluon kernel (kvpolicy/kernels/decode_gluon.py,
e4m3 query as in vLLM's FA3 FP8 path), and TurboQuant layers with the
Gluon TurboQuant kernels on planar caches (kvpolicy/kernels/tq_gluon.py, tq_warp.py); `KVPOLICY_GLUON=0`
keeps them on Triton.
Layers the BF16/FP8 kernel does not take (an MLA latent of 576 dims, head dims
above 256) run the reference on every backend; `LayerPlan.kernel_path` says
which, and the results report it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

from kvpolicy.runtime.caches import LayerCache, LayerPlan, gluon_available


def trusted_indices() -> AbstractContextManager[None]:
    """The kernels' range checks off (a host sync per eager call): the runtime builds every block table and slot
    itself."""
    from kvpolicy.kernels.guards import unchecked

    return unchecked()


def store(cache: LayerCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, backend: str) -> None:
    """Write K/V [tokens, num_kv_heads, head_dim] at int64 `slots` [tokens] into the layer's cache."""
    plan = cache.plan
    assert plan.fmt is not None
    if plan.fmt.per_token_head:
        if backend == "triton" and plan.kernel_path(backend) == "triton":
            from kvpolicy.kernels.paged_store import store_kv_pth

            store_kv_pth(key, value, cache.key_cache, slots, plan.fmt.name)
        else:
            from kvpolicy.kernels.reference import ref_store_kv_pth

            ref_store_kv_pth(key, value, cache.key_cache, slots, plan.fmt.name)
        return
    if plan.fmt.kind == "turboquant":
        if backend == "triton":
            from kvpolicy.kernels.tq_store import store_kv_tq

            store_kv_tq(key, value, cache.key_cache, slots, plan.fmt.name)
        else:
            from kvpolicy.kernels.tq_reference import store_kv_ref

            store_kv_ref(key, value, cache.key_cache, slots, plan.fmt.name)
        return
    d = plan.head_dim
    piece = d & -d  # largest power of two dividing the head dim
    if backend == "triton" and piece >= 16 and (piece == d or cache.k_scale is None or cache.k_scale.numel() == 1):
        from kvpolicy.kernels.paged_store import store_kv

        kc, vc = cache.key_cache, cache.value_cache
        if piece != d:
            # An MLA latent (576 = 9 x 64) is stored as power-of-two pieces: the same bytes, in a head dim the
            # kernel takes (a per-tensor scale applies to every piece alike).
            n = d // piece
            key, value = key.reshape(-1, n, piece), value.reshape(-1, n, piece)
            kc, vc = kc.view(*kc.shape[:2], n, piece), vc.view(*vc.shape[:2], n, piece)
        store_kv(key, value, kc, vc, slots, cache.k_scale, cache.v_scale)
        return
    from kvpolicy.kernels.reference import ref_store_kv

    ref_store_kv(key, value, cache.key_cache, cache.value_cache, slots, cache.k_scale, cache.v_scale)


def layer_path(plan: LayerPlan, backend: str, device: torch.device, two_level: bool = True) -> str:
    """The kernel that decodes `plan`'s layer (`LayerPlan.kernel_path`); FP8 layers without two-level
    accumulation take the Triton kernel's FA3 form (e4m3 P.V carried in the MMA), never the Gluon kernel."""
    path = plan.kernel_path(backend, gluon_available(device))
    if path == "gluon" and plan.fmt is not None and plan.fmt.kind == "fp8" and not two_level:
        return "triton"
    return path


def decode(cache: LayerCache, plan: LayerPlan, query: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, backend: str, two_level: bool = True, num_splits: int | None = None) -> torch.Tensor:
    """One query token per sequence over `cache` (possibly another layer's, for shared layers).

    Returns [batch, num_q_heads, out_dim] in the query's dtype. `num_splits` overrides the kernels' split count
    (the references ignore it).
    """
    fmt = cache.plan.fmt
    assert fmt is not None
    hopper_fp8 = plan.kernel_path(backend, gluon_available(query.device)) == "gluon"
    path = layer_path(plan, backend, query.device, two_level)
    common: dict[str, Any] = {"sm_scale": plan.sm_scale, "sliding_window": plan.window, "sinks": cache.sinks}
    if fmt.per_token_head:
        if path in ("triton", "gluon"):
            from kvpolicy.kernels.decode_attention import decode_attention_pth

            out = decode_attention_pth(query, cache.key_cache, block_tables, seq_lens, fmt.name, two_level=two_level,
                                       kernel=path, num_splits=num_splits, **common)
        else:
            from kvpolicy.kernels.reference import ref_decode_attention_pth

            out = ref_decode_attention_pth(query, cache.key_cache, block_tables, seq_lens, fmt.name, **common)
    elif fmt.kind == "turboquant":
        if path in ("triton", "gluon"):
            from kvpolicy.kernels.tq_decode import decode_attention_tq

            out = decode_attention_tq(query, cache.key_cache, block_tables, seq_lens, fmt.name,
                                      kernel="gluon" if path == "gluon" else "triton", num_splits=num_splits,
                                      **common)
        else:
            from kvpolicy.kernels.tq_reference import decode_attention_tq_ref

            out = decode_attention_tq_ref(query, cache.key_cache, block_tables, seq_lens, fmt.name, **common)
    elif path in ("triton", "gluon"):
        from kvpolicy.kernels.decode_attention import decode_attention

        out = decode_attention(query, cache.key_cache, cache.value_cache, block_tables, seq_lens,
                               k_scale=cache.k_scale, v_scale=cache.v_scale, two_level=two_level,
                               fp8_query=hopper_fp8, kernel="gluon" if path == "gluon" else "triton",
                               num_splits=num_splits, **common)
    else:
        from kvpolicy.kernels.reference import ref_decode_attention

        out = ref_decode_attention(query, cache.key_cache, cache.value_cache, block_tables, seq_lens,
                                   k_scale=cache.k_scale, v_scale=cache.v_scale, two_level=two_level, **common)
    out = out.to(query.dtype)
    return out[..., : plan.out_dim] if plan.out_dim != out.shape[-1] else out
