"""The needle test, the documents' verdict rule, and the model-level check on a tiny random model (CPU)."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch", reason="the runtime needs torch (pip install -e .[kernels])")

from kvpolicy.cli import main
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.catalog import resolve_gpu
from kvpolicy.rules.decision import Decision
from kvpolicy.runtime.needle import (
    MARGIN_NATS,
    geometry_plan,
    make_case,
    plan_for,
    score,
)
from kvpolicy.runtime.variants import Variant, parse_variant, variant_list
from kvpolicy.runtime.verify import (
    NeedlePoint,
    run_verify,
    verdicts,
    with_calibrated_twins,
)

CPU = torch.device("cpu")


def mini(**kw) -> ModelArch:
    base = {"id": "mini", "num_layers": 2, "layer_types": ["sliding", "full"], "num_attention_heads": 8,
            "num_kv_heads": 2, "head_dim": 64, "sliding_window": 32, "has_attention_sinks": True}
    return ModelArch(**{**base, **kw})


def test_needles_have_their_planted_margin():
    plan = geometry_plan(mini())
    assert plan.kind == "full" and plan.index == 1
    case = make_case(plan, batch=2, context=700, device=CPU, dtype=torch.float32, seed=3)
    lo, hi = (1 / (1 + math.exp(-m)) for m in MARGIN_NATS)
    # Exact weights come out where the margins put them (the solve is exact up to fp32 storage).
    assert ((case.p_exact > lo - 1e-3) & (case.p_exact < hi + 1e-3)).all()
    bf16 = score(plan, Variant("auto"), case, CPU, "reference")
    assert bf16.hits == bf16.trials == 16 and bf16.p_abs_error < 0.01


def test_mla_needles_live_in_the_latent():
    arch = ModelArch(id="mini-mla", num_layers=1, layer_types=["mla"], num_attention_heads=4, num_kv_heads=4,
                     head_dim=48, kv_lora_rank=64, qk_rope_head_dim=16, attention="mla")
    plan = geometry_plan(arch)
    case = make_case(plan, batch=1, context=300, device=CPU, dtype=torch.float32, seed=1)
    assert case.value is case.key  # K and V are the one latent
    s = score(plan_for(arch, plan, Variant("fp8")), Variant("fp8"), case, CPU, "reference")
    assert s.trials == 4 and s.hits >= 3


def test_lower_bits_recover_less():
    arch = mini(num_attention_heads=16, num_kv_heads=4)
    variants = variant_list(Decision(kv_cache_dtype="fp8"), ["turboquant_3bit_nc"])
    res = run_verify(arch, resolve_gpu("h100"), Decision(kv_cache_dtype="fp8"), variants, [512, 1024], 4, CPU,
                     "reference")
    err = {p.variant: p.out_rel_error for p in res.points if p.context_tokens == 1024}
    assert err["bf16"] < err["fp8"] < err["turboquant_3bit_nc"]
    assert res.geometry["num_q_heads"] == 16
    # Both layer geometries are tested: the full layer at every context, the sliding one within its window.
    assert [g["kind"] for g in res.geometries] == ["full", "sliding"]
    assert sorted({(p.geometry.split(" (")[0], p.context_tokens) for p in res.points}) == [
        ("layer 0", 32), ("layer 1", 512), ("layer 1", 1024)]
    assert len(res.points) == 9


def _point(variant: str, recovery: float, n: int = 400) -> NeedlePoint:
    kept = round(recovery * n)
    return NeedlePoint(variant=variant, context_tokens=131072, hits=kept, trials=n, recovery=kept / n, kept=kept,
                       bf16_hits=n, p_abs_error=0.0, out_rel_error=0.0)


@pytest.mark.parametrize("fp8,per_head,expected", [(0.99, 0.99, "pass"), (0.90, 0.99, "calibrate"),
                                                    (0.80, 0.90, "keep_bf16"), (0.94, 0.99, "undecided"),
                                                    (0.90, 0.95, "keep_bf16")])
def test_the_documents_rule(fp8, per_head, expected):
    """Verdicts on 95% intervals: `calibrate` needs the per-head twin decidedly above the floor (at 95.0% it
    is on the line, so FP8 below the floor is kept BF16); 94% of 400 straddles the floor: undecided."""
    variants = with_calibrated_twins([Variant("auto"), Variant("fp8")])
    assert [v.name for v in variants] == ["bf16", "fp8", "fp8+per_head"]
    from kvpolicy.runtime.results import Environment
    from kvpolicy.runtime.verify import VerifyResult

    result = VerifyResult(model="m", gpu="h100-sxm", environment=Environment(), decision=Decision(),
                          points=[_point("bf16", 1.0), _point("fp8", fp8), _point("fp8+per_head", per_head)])
    got = {v.variant: v for v in verdicts(result, variants, {v.name: object() for v in variants})}
    assert got["fp8"].verdict == expected
    assert "95%" in got["fp8"].reason and "95% CI" in got["fp8"].reason
    if expected == "undecided":
        assert got["fp8"].trials_to_decide > 400 and f"--trials {got['fp8'].trials_to_decide}" in got["fp8"].reason


def test_model_level_check_on_a_tiny_random_llama(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=5,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=512)
    folder = tmp_path / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    code = main(["verify", "--model", str(folder), "--gpu", "h100", "--device", "cpu", "--contexts", "128,256",
                 "--tokens", "32", "--compare", "fp8,turboquant_4bit_nc", "--out", str(tmp_path), "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    checks = {c["variant"].split(" ")[0]: c for c in result["model_check"]}
    assert set(checks) == {"bf16", "fp8", "fp8+per_head", "turboquant_4bit_nc"}
    # Our BF16 cache path reproduces the model's own attention (fp32 weights, bf16 K/V rounding only).
    assert checks["bf16"]["agreement"] >= 0.95 and checks["bf16"]["kl_mean"] < 1e-3
    assert checks["fp8"]["tokens"] == 32 and checks["fp8"]["kl_mean"] >= 0.0
    # TurboQuant keeps the first and last two layers BF16: only layer 2 of 5 is quantized, yet it shows.
    assert checks["turboquant_4bit_nc"]["kl_mean"] > 0.0
    assert "random token ids" in result["model_check_note"]


def test_variants_for_verify():
    d = Decision(kv_cache_dtype="fp8", skip_layers=["sliding_window"], two_level_accumulation="off",
                 scale_source="checkpoint_per_tensor")
    v = Variant.of_decision(d)
    assert v.name == "fp8_skip_sliding+one_level+per_tensor" and not v.two_level
    assert parse_variant("fp8", default_two_level=v.two_level).two_level is False


def test_calibrated_scales_cover_every_needle():
    # The needle's value stands out by NEEDLE_LIFT: scales taken from a prefix that misses it would clip it.
    plan = geometry_plan(mini())
    case = make_case(plan, batch=2, context=3000, device=CPU, dtype=torch.float32, seed=5)
    from kvpolicy.runtime.needle import _calibrated_scales

    k_scale, v_scale = _calibrated_scales(case, per_head=True)
    assert k_scale.shape == (2,) and (v_scale * 448 >= case.value.abs().amax(dim=(0, 1, 3)) * (1 - 1e-6)).all()
    v = parse_variant("fp8+per_head")
    s = score(plan_for(mini(), plan, v), v, case, CPU, "reference")
    assert s.hits >= s.trials - 1 and s.out_rel_error < 0.05
    with pytest.raises(ValueError):
        score(plan, v, case, CPU, "reference")  # a BF16 plan cannot hold an FP8 variant
