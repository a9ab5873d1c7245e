"""What `kvpolicy bench` needs in GPU memory, and what it says when a point does not fit."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the runtime needs torch (pip install -e .[kernels])")

from kvpolicy.inputs.catalog import resolve_model
from kvpolicy.runtime.bench import (
    GIB,
    cache_bytes,
    largest_fit,
    memory_refusal,
    usable_bytes,
    working_bytes,
)
from kvpolicy.runtime.variants import Variant

LLAMA = resolve_model("llama-3.1-8b")


def test_llama_batch_8_at_128k_fits_an_h200_and_the_kv_bytes_are_the_formula():
    # 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes per token, one more position than the context, whole pages
    assert cache_bytes(LLAMA, Variant("auto"), 8, 131072) == 32 * 8 * 128 * 2 * 2 * 8 * (131072 + 16)
    assert memory_refusal(LLAMA, Variant("auto"), 8, 131072, int(139.1 * GIB)) is None


def test_a_refusal_says_what_is_needed_and_what_fits():
    free = int(100 * GIB)
    why = memory_refusal(LLAMA, Variant("auto"), 8, 131072, free)
    assert why is not None
    kv = cache_bytes(LLAMA, Variant("auto"), 8, 131072) / GIB
    assert f"{kv:.1f} GiB of KV cache" in why and "working buffers" in why and "100.0 GiB free" in why
    context, batch = largest_fit(LLAMA, Variant("auto"), 8, 131072, usable_bytes(free))
    assert f"{context:,} tokens at batch 8" in why and f"batch {batch} at 131,072 tokens" in why
    # the largest points fit, one page or one sequence more does not
    need = lambda b, c: cache_bytes(LLAMA, Variant("auto"), b, c) + working_bytes(LLAMA, Variant("auto"), b, c)
    assert need(8, context) <= usable_bytes(free) < need(8, context + 16)
    assert need(batch, 131072) <= usable_bytes(free) < need(batch + 1, 131072)
    # FP8 halves the caches: more fits
    assert largest_fit(LLAMA, Variant("fp8"), 8, 131072, usable_bytes(free))[0] > context
