"""The runtime's Triton path under the Triton interpreter: the kernel calls the GPU makes, checked on a CPU.

`kvpolicy bench/verify` use the torch references on a CPU; this test drives the
other branch of `runtime/ops.py` (store and decode kernels, scales, windows,
sinks, ring block tables, TurboQuant) on tiny shapes, so wiring mistakes show
up in CI rather than on the GPU. Where a GPU exists, test_runtime_gpu.py does this.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch", reason="the runtime needs torch")
if torch.cuda.is_available():
    pytest.skip("a GPU is present: test_runtime_gpu.py covers the Triton path", allow_module_level=True)
# Before triton itself is imported: triton reads its knobs from the environment at import.
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton path needs triton")

from kvpolicy.inputs.arch import ModelArch
from kvpolicy.runtime import ops
from kvpolicy.runtime.step import DecodeStep
from kvpolicy.runtime.variants import parse_variant

CPU = torch.device("cpu")
# Interpreter output vs the float64 reference on the same cache bytes. The interpreter computes fp8 dots
# exactly (fp16 upcast), so FP8 error is the e4m3 rounding of P (a few percent); BF16 stays near 1e-2.
TOLERANCE = {"bf16": 2e-2, "fp8+per_head": 6e-2, "turboquant_4bit_nc": 4e-2, "fp8_per_token_head": 2e-2,
             "int8_per_token_head": 2e-2, "int4_per_token_head": 2e-2}


@pytest.mark.parametrize("variant", list(TOLERANCE))
def test_triton_branch_agrees_with_the_reference_branch(variant):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernel modules were imported before TRITON_INTERPRET could be set")
    torch.manual_seed(0)
    arch = ModelArch(id="mini-oss", num_layers=6, layer_types=["sliding", "full"] * 3, num_attention_heads=4,
                     num_kv_heads=2, head_dim=64, sliding_window=48, has_attention_sinks=True)
    step = DecodeStep(arch, parse_variant(variant), batch=2, max_context=200, device=CPU, backend="triton")
    step.fill(200)
    step.prepare(150)
    step.run()
    prep = step._prepared
    for plan in step.plans:
        if plan.index not in (2, 3):  # TurboQuant keeps layers 0-1 and 4-5 BF16: look where it applies
            continue
        cache, q = step.caches[plan.index], step.queries[plan.index].float()
        got = ops.decode(cache, plan, q, prep.block_tables[plan.index], prep.seq_lens, "triton")
        want = ops.decode(cache, plan, q, prep.block_tables[plan.index], prep.seq_lens, "reference")
        err = float((got - want).norm() / want.norm())
        assert err < TOLERANCE[variant], f"layer {plan.index} ({plan.kind}): {err:.2e}"


def test_hnd_pages_give_the_nhd_answer():
    """The same step on head-major pages (vLLM's FlashInfer layout on Blackwell): bit-identical decode output."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernel modules were imported before TRITON_INTERPRET could be set")
    from dataclasses import replace

    arch = ModelArch(id="mini-oss", num_layers=2, layer_types=["sliding", "full"], num_attention_heads=4,
                     num_kv_heads=2, head_dim=64, sliding_window=48, has_attention_sinks=True)
    outs = {}
    for layout in ("NHD", "HND"):
        step = DecodeStep(arch, replace(parse_variant("fp8+per_head"), cache_layout=layout), batch=2, max_context=200,
                          device=CPU, backend="triton")
        step.fill(200)
        step.prepare(150)
        prep = step._prepared
        cache = step.caches[1]
        assert cache.key_cache.stride(2) == (16 * 64 if layout == "HND" else 64)
        outs[layout] = [ops.decode(step.caches[p.index], p, step.queries[p.index].float(), prep.block_tables[p.index],
                                   prep.seq_lens, "triton") for p in step.plans]
    for nhd, hnd in zip(outs["NHD"], outs["HND"]):
        assert torch.equal(nhd, hnd)
