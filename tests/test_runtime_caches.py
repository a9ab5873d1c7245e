"""Per-layer caches from a model architecture and a variant; one decode step over them (CPU references)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch", reason="the runtime needs torch (pip install -e .[kernels])")

from kvpolicy.errors import InputError
from kvpolicy.facts.kv_memory import Layout, layer_kv_bytes_per_token
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.catalog import resolve_model
from kvpolicy.runtime import ops
from kvpolicy.runtime.caches import (
    BLOCK_SIZE,
    allocate,
    gluon_available,
    pages_per_sequence,
    plan_layers,
    slots_for,
)
from kvpolicy.runtime.step import DecodeStep
from kvpolicy.runtime.variants import Variant, parse_variant

CPU = torch.device("cpu")


def small_hybrid() -> ModelArch:
    """gpt-oss's shape in miniature: alternating sliding (window 40) and full layers, sinks."""
    return ModelArch(id="mini-oss", num_layers=6, layer_types=["sliding", "full"] * 3, num_attention_heads=4,
                     num_kv_heads=2, head_dim=64, sliding_window=40, has_attention_sinks=True)


@pytest.mark.parametrize("model,variant", [
    ("llama-3.1-8b", "fp8"), ("gpt-oss-20b", "fp8_skip_sliding"), ("gpt-oss-20b", "turboquant_4bit_nc"),
    ("deepseek-v3", "fp8"), ("qwen3.5-27b", "bf16"), ("gemma-4-e2b", "fp8"),
])
def test_plans_follow_the_estimates_layout(model, variant):
    arch = resolve_model(model)
    v = parse_variant(variant)
    plans = plan_layers(arch, v)
    layout = Layout.of(arch, v.kv_cache_dtype, list(v.skip_layers))
    for plan, fmt in zip(plans, layout.formats):
        if plan.kind in ("linear", "shared"):
            assert not plan.has_cache
        else:
            assert plan.fmt == fmt
            assert plan.bytes_per_token == layer_kv_bytes_per_token(arch, plan.index, fmt)
    assert sum(p.bytes_per_token for p in plans) == layout.bytes_per_token()


def test_mla_latent_is_one_kv_head_of_rank_plus_rope():
    plan = plan_layers(resolve_model("deepseek-v3"), Variant("fp8"))[0]
    assert (plan.num_kv_heads, plan.head_dim, plan.out_dim, plan.num_q_heads) == (1, 576, 512, 128)
    assert plan.sm_scale == pytest.approx(192**-0.5)  # un-absorbed qk dim (128 nope + 64 rope)


def test_shared_layers_read_the_last_layer_of_their_kind():
    plans = plan_layers(resolve_model("gemma-4-e2b"), Variant("auto"))
    # Layers 15-34 reuse layer 13 (sliding) or 14 (full), as in the catalog's note.
    assert {p.index: p.source for p in plans if p.kind == "shared"} == {
        i: (14 if i % 5 == 4 else 13) for i in range(15, 35)}


def test_turboquant_rejects_head_dims_its_kernels_do_not_take():
    with pytest.raises(InputError, match="head_dim 512"):
        plan_layers(resolve_model("gemma-4-e2b"), Variant("turboquant_4bit_nc"))


@pytest.mark.parametrize("variant", ["bf16", "fp8", "turboquant_k3v4_nc"])
def test_allocated_bytes_equal_the_kv_bytes_formula(variant):
    arch = small_hybrid()
    plans = plan_layers(arch, parse_variant(variant))
    caches = allocate(plans, batch=2, max_context=1000, device=CPU)
    for plan, cache in zip(plans, caches):
        pages = pages_per_sequence(plan, 1000)
        assert cache.nbytes == plan.bytes_per_token * 2 * pages * BLOCK_SIZE
    # Sliding layers are bounded to their window, full layers hold the whole context.
    assert pages_per_sequence(plans[0], 1000) == math.ceil(40 / BLOCK_SIZE) + 1
    assert pages_per_sequence(plans[1], 1000) == math.ceil(1000 / BLOCK_SIZE)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200), st.integers(1, 3000))
def test_a_ring_never_maps_two_positions_of_one_window_to_one_slot(window, context):
    arch = ModelArch(id="w", num_layers=1, layer_types=["sliding"], num_attention_heads=1, num_kv_heads=1,
                     head_dim=16, sliding_window=window)
    plan = plan_layers(arch, Variant("auto"))[0]
    cache = allocate([plan], batch=2, max_context=context + 1, device=CPU)[0]
    positions = torch.arange(max(0, context - window), context + 1)
    slots = slots_for(positions, cache.block_tables)
    assert len(set(slots.flatten().tolist())) == slots.numel()


def test_ring_decode_equals_attention_over_the_last_window():
    arch = small_hybrid()
    plan = plan_layers(arch, Variant("auto"))[0]
    context = 300
    cache = allocate([plan], batch=1, max_context=context, device=CPU)[0]
    key = torch.randn(context, 2, 64)
    value = torch.randn(context, 2, 64)
    # Store in order, so each ring page is overwritten by later positions as in a real decode.
    for lo in range(0, context, 37):
        hi = min(lo + 37, context)
        slots = slots_for(torch.arange(lo, hi), cache.block_tables).reshape(-1)
        ops.store(cache, key[lo:hi], value[lo:hi], slots, "reference")
    query = torch.randn(1, 4, 64)
    out = ops.decode(cache, plan, query, cache.block_tables, torch.tensor([context], dtype=torch.int32), "reference")
    k = key[-40:].to(torch.bfloat16).double().repeat_interleave(2, dim=1)
    v = value[-40:].to(torch.bfloat16).double().repeat_interleave(2, dim=1)
    logits = torch.einsum("hd,lhd->hl", query[0].double(), k) / 8.0
    logits = torch.cat([logits, cache.sinks.double()[:, None]], dim=1)
    want = torch.einsum("hl,lhd->hd", torch.softmax(logits, 1)[:, :-1], v)
    torch.testing.assert_close(out[0].double(), want, rtol=1e-5, atol=1e-5)  # fp32 output of a float64 reference


@pytest.mark.parametrize("variant", ["bf16", "fp8+per_head", "turboquant_4bit_nc"])
def test_a_decode_step_runs_every_layer(variant):
    arch = small_hybrid()
    step = DecodeStep(arch, parse_variant(variant), batch=2, max_context=200, device=CPU, backend="reference")
    step.fill(200)
    for context in (50, 200):
        step.prepare(context)
        out = step.run()
        assert out.shape == (2, 4, 64) and torch.isfinite(out).all()
    assert step.layer_paths() == {"reference": list(range(6))}
    with pytest.raises(ValueError):
        step.prepare(201)


def test_linear_and_mla_layers():
    qwen = resolve_model("qwen3.5-27b")
    paths = DecodeStep.__new__(DecodeStep)
    paths.plans, paths.backend, paths.device = plan_layers(qwen, Variant("fp8")), "triton", CPU
    paths.variant = Variant("fp8")
    assert "none (linear)" in DecodeStep.layer_paths(paths)
    mla = ModelArch(id="mini-mla", num_layers=2, layer_types=["mla", "mla"], num_attention_heads=4, num_kv_heads=4,
                    head_dim=48, kv_lora_rank=64, qk_rope_head_dim=16, attention="mla")
    step = DecodeStep(mla, Variant("fp8"), batch=1, max_context=64, device=CPU, backend="reference")
    step.fill(64)
    step.prepare(64)
    assert step.run().shape == (1, 4, 64)  # absorbed-MLA output: kv_lora_rank dims per head
    # On a GPU the 80-wide latent is not a kernel head dim: the reference runs it, and says so.
    assert plan_layers(mla, Variant("fp8"))[0].kernel_path("triton") == "reference"


def test_variants_parse_and_name():
    assert parse_variant("fp8_skip_sliding").skip_layers == ("sliding_window",)
    assert parse_variant("fp8+one_level+per_head").name == "fp8+one_level+per_head"
    assert parse_variant("turboquant_3bit_nc").key == "turboquant_3bit_nc"
    for bad in ("fp9", "fp8+fast", "turboquant_4bit_nc+per_head", "fp8_e5m2"):
        with pytest.raises(InputError):
            parse_variant(bad)


def test_fill_writes_every_slot_a_shorter_context_can_read():
    step = DecodeStep(small_hybrid(), Variant("auto"), batch=2, max_context=200, device=CPU, backend="reference")
    for c in step.caches:
        c.key_cache.fill_(float("nan"))
        c.value_cache.fill_(float("nan"))
    step.fill(200)
    for context in (41, 150, 200):
        step.prepare(context)
        assert torch.isfinite(step.run()).all()
    ring = step.caches[0].key_cache
    assert not torch.isnan(ring).any()  # sliding layers: the whole ring holds data


def test_cache_layout_follows_the_backend_vllm_would_use():
    """FlashInfer on Blackwell keeps heads contiguous per page (HND); everything else kvpolicy selects is NHD."""
    from kvpolicy.rules.decision import Decision
    from kvpolicy.runtime.variants import cache_layout, variant_list

    flashinfer = Decision(kv_cache_dtype="fp8", attention_backend="FLASHINFER")
    assert cache_layout(flashinfer, "blackwell") == "HND"
    assert cache_layout(flashinfer, "hopper") == "NHD"
    assert cache_layout(Decision(kv_cache_dtype="fp8", attention_backend="FLASH_ATTN"), "blackwell") == "NHD"
    variants = variant_list(flashinfer, ["turboquant_4bit_nc"], "HND")
    assert [v.key for v in variants] == ["bf16", "fp8", "turboquant_4bit_nc"]
    assert {v.cache_layout for v in variants} == {"HND"}


def test_hnd_caches_are_head_major_and_hold_the_formula_bytes():
    arch = ModelArch(id="mini", num_layers=2, layer_types=["full", "full"], num_attention_heads=4, num_kv_heads=2,
                     head_dim=64)
    plans = plan_layers(arch, Variant("fp8", cache_layout="HND"))
    cache = allocate(plans, batch=2, max_context=100, device="cpu", layout="HND")[0]
    assert cache.key_cache.shape[1:] == (16, 2, 64)
    assert cache.key_cache.stride()[1:] == (64, 16 * 64, 1)  # position, head, dim: one head's page is contiguous


def test_layers_take_the_gluon_kernels_only_where_they_apply(monkeypatch: pytest.MonkeyPatch):
    """On an sm_90 GPU FP8 and TurboQuant layers of head_dim 64/128 report and run `gluon`; BF16 layers,
    head_dim 256, MLA latents and the CPU do not; KVPOLICY_GLUON=0 keeps them on Triton."""
    gpt_oss = resolve_model("gpt-oss-20b")
    fp8 = plan_layers(gpt_oss, Variant("fp8"))
    assert {p.kernel_path("triton", gluon=True) for p in fp8 if p.attends} == {"gluon"}
    assert {p.kernel_path("triton", gluon=False) for p in fp8 if p.attends} == {"triton"}
    assert {p.kernel_path("reference", gluon=True) for p in fp8} == {"reference"}
    # skip-sliding: the BF16 sliding layers stay on Triton, the FP8 full layers go to Gluon
    mixed = plan_layers(gpt_oss, parse_variant("fp8_skip_sliding"))
    assert {p.kind: p.kernel_path("triton", gluon=True) for p in mixed} == {"sliding": "triton", "full": "gluon"}
    assert {p.kernel_path("triton", gluon=True) for p in plan_layers(gpt_oss, parse_variant("bf16"))} == {"triton"}
    # every TurboQuant format takes the Gluon TurboQuant kernel (planar caches) at head_dim 64/128
    for variant in ("turboquant_4bit_nc", "turboquant_k8v4", "turboquant_k3v4_nc", "turboquant_3bit_nc"):
        plans = [p for p in plan_layers(gpt_oss, parse_variant(variant)) if p.attends]
        tq = {p.kernel_path("triton", gluon=True) for p in plans if p.fmt.kind == "turboquant"}
        kept = {p.kernel_path("triton", gluon=True) for p in plans if p.fmt.kind != "turboquant"}
        assert tq == {"gluon"} and kept == {"triton"}  # the layers the variant keeps in BF16 stay on Triton
        assert {p.kernel_path("triton", gluon=False) for p in plans} == {"triton"}
    # head_dim 256 (Gemma 3): the Triton TurboQuant kernel
    gemma = [p for p in plan_layers(resolve_model("gemma-3-4b"), parse_variant("turboquant_3bit_nc")) if p.attends]
    assert {p.head_dim for p in gemma} == {256}
    assert {p.kernel_path("triton", gluon=True) for p in gemma if p.fmt.kind == "turboquant"} == {"triton"}
    mla = resolve_model("deepseek-v3")
    assert plan_layers(mla, Variant("fp8"))[0].kernel_path("triton", gluon=True) == "reference"
    # the device decides: never on the CPU, and the environment can turn it off
    assert not gluon_available(CPU)
    monkeypatch.setattr("kvpolicy.runtime.caches._gluon_on", lambda *a: True)
    assert gluon_available(torch.device("cuda", 0))
    monkeypatch.setenv("KVPOLICY_GLUON", "0")
    assert not gluon_available(torch.device("cuda", 0))


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_4over6"])
def test_nvfp4_says_it_cannot_run_on_hopper(name: str) -> None:
    with pytest.raises(InputError, match="cannot run on Hopper.*evidence"):
        parse_variant(name)


def test_per_token_head_variants_take_their_own_rows() -> None:
    torch = pytest.importorskip("torch")
    from kvpolicy.formats import FORMATS
    from kvpolicy.runtime.caches import allocate, plan_layers

    arch = ModelArch(id="mini", num_layers=2, layer_types=["sliding", "full"], num_attention_heads=4,
                     num_kv_heads=2, head_dim=64, sliding_window=48)
    for name in ("fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"):
        v = parse_variant(name)
        assert v.kind == name
        plans = plan_layers(arch, v)
        caches = allocate(plans, 1, 64, torch.device("cpu"))
        row = FORMATS[name].slot_bytes(64)
        assert all(c.key_cache.shape[2:] == (2, row) and c.value_cache is None for c in caches)
        assert plans[1].kernel_path("triton") == "triton"
