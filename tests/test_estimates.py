"""`kernel slope vs cuDNN`: kvpolicy's own decode kernels (evidence `kernels:`) beside vLLM's published costs."""

from __future__ import annotations

import json

import pytest

from kvpolicy.cli import main
from kvpolicy.inputs.catalog import resolve_gpu, resolve_model
from kvpolicy.inputs.workload import make_workload
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.decision import Recommendation
from kvpolicy.rules.validate import load_policy


def _h200_slopes(geometry: str) -> dict[str, float]:
    """The H200 figures of `kvpolicy-kernels-h200` in kvpolicy/rules/default.yaml (slope ns/token, batch 8):
    read from the policy, so a re-recorded run changes them in one place."""
    entry = next(e for e in load_policy().policy.evidence if e.id == "kvpolicy-kernels-h200")
    m = next(k for k in entry.kernels if k.geometry == geometry)
    return {col: fit.slope_ns_per_token for col, fit in m.fits.items()}


LLAMA = _h200_slopes("llama-3.1-8b")
GPT_OSS = _h200_slopes("gpt-oss-20b")
BF16_RATIO = f"{LLAMA['bf16'] / LLAMA['sdpa_cudnn']:.2f}x"
TQ_RATIO = f"{LLAMA['turboquant_4bit_nc'] / LLAMA['sdpa_cudnn']:.2f}x"
TQ_PHRASE = f"{TQ_RATIO} cuDNN BF16's attention slope in kvpolicy's fused kernel (h200, llama-3.1-8b layer, batch 8)"
MEMORY_BOUND = dict(context="128k", concurrency=10, tp=4)


@pytest.fixture(scope="module")
def builtin():
    return load_policy()


def rec(loaded, model: str, gpu: str, **workload) -> Recommendation:
    return recommend(resolve_model(model), resolve_gpu(gpu), make_workload(loaded, **workload), loaded)


def test_turboquant_chosen_on_h100_shows_our_h200_kernel(builtin):
    r = rec(builtin, "llama-3.3-70b", "h100", accuracy_floor=0.9, **MEMORY_BOUND)
    assert r.decision.kv_cache_dtype == "turboquant_4bit_nc"
    k = r.estimates.kernel_slope_ratio
    assert k.provenance == "measured"
    assert k.value == round(LLAMA["turboquant_4bit_nc"] / LLAMA["sdpa_cudnn"], 3)
    assert "measured on h200, same generation as h100-sxm" in k.basis
    assert "`kvpolicy-kernels-h200`" in k.basis
    # vLLM's published figure stays where it was: no slope, 10-68% added latency.
    assert r.estimates.itl_slope_ratio.value is None
    kv103 = [w for w in r.warnings if w.startswith("turboquant_4bit_nc: needed")]
    assert len(kv103) == 1 and "Costs in vLLM" in kv103[0] and TQ_PHRASE in kv103[0]


def test_default_floor_offers_turboquant_with_our_kernel_and_rates_fp8(builtin):
    r = rec(builtin, "llama-3.3-70b", "h100", **MEMORY_BOUND)
    assert r.decision.kv_cache_dtype == "fp8"
    offer = [a for a in r.alternatives if a.startswith("turboquant_4bit_nc would hold")]
    assert len(offer) == 1 and TQ_PHRASE in offer[0]
    k = r.estimates.kernel_slope_ratio
    assert k.value == round(LLAMA["fp8"] / LLAMA["sdpa_cudnn"], 3) and k.provenance == "measured"
    assert "kvpolicy's FP8 kernel" in k.basis and f"our BF16 kernel {BF16_RATIO}" in k.basis


def test_head_dim_64_model_uses_the_gpt_oss_layer(builtin):
    r = rec(builtin, "gpt-oss-20b", "h200", context="32k")
    assert r.decision.kv_cache_dtype == "fp8"
    k = r.estimates.kernel_slope_ratio
    assert k.value == round(GPT_OSS["fp8"] / GPT_OSS["sdpa_cudnn"], 3)
    assert "on h200 (gpt-oss-20b layer, batch 8" in k.basis
    assert "same generation" not in k.basis
    # A head_dim 128 model on the same GPU takes the Llama layer.
    llama = rec(builtin, "qwen3-8b", "h200", context="32k").estimates.kernel_slope_ratio
    assert "llama-3.1-8b layer" in llama.basis


def test_bf16_decision_rates_our_bf16_kernel(builtin):
    r = rec(builtin, "llama-3.1-8b", "h100", context="4k")
    assert r.decision.kv_cache_dtype == "auto"
    k = r.estimates.kernel_slope_ratio
    assert k.value == round(LLAMA["bf16"] / LLAMA["sdpa_cudnn"], 3)
    assert k.basis.startswith(f"kvpolicy's BF16 kernel: {BF16_RATIO} cuDNN BF16's")


def test_no_measurement_for_the_generation_says_so(builtin):
    r = rec(builtin, "llama-3.1-8b", "a100", context="32k")
    k = r.estimates.kernel_slope_ratio
    assert (k.value, k.provenance) == (None, "modelled")
    assert k.basis.startswith("no kvpolicy kernel measurement for ampere GPUs; run `python bench/bench_decode.py`")
    assert r.trace.facts["kernels.turboquant_4bit_nc"] == "not measured by kvpolicy on ampere GPUs"
    # fp8_e5m2 (A100 under memory pressure) has no kvpolicy kernel at all.
    e5m2 = rec(builtin, "llama-3.1-8b", "a100", context="128k", concurrency=16)
    assert e5m2.decision.kv_cache_dtype == "fp8_e5m2"
    assert e5m2.estimates.kernel_slope_ratio.value is None
    assert "do not implement fp8_e5m2" in e5m2.estimates.kernel_slope_ratio.basis


def test_extending_policy_supplies_its_own_gpu_figures(tmp_path):
    path = tmp_path / "ours.yaml"
    path.write_text(
        "extends: builtin:default\n"
        "evidence:\n"
        "  - id: our-kernels\n"
        "    statement: our A100 and a newer H200 run\n"
        "    source: bench/bench_decode.py\n"
        "    kernels:\n"
        "      - gpu: a100\n"                      # an alias of a100-80gb-sxm
        "        geometry: llama-3.1-8b\n"
        "        head_dim: 128\n"
        "        batch: 8\n"
        "        fits:\n"
        "          bf16: {slope_ns_per_token: 15.0}\n"
        "          sdpa_cudnn: {slope_ns_per_token: 12.0}\n"
        "      - gpu: h200\n"
        "        geometry: llama-3.1-8b\n"
        "        head_dim: 128\n"
        "        batch: 8\n"
        "        fits:\n"
        "          turboquant_4bit_nc: {slope_ns_per_token: 6.0}\n"
        "          sdpa_cudnn: {slope_ns_per_token: 7.5}\n"
    )
    loaded = load_policy(path)
    a100 = rec(loaded, "llama-3.1-8b", "a100", context="32k").estimates.kernel_slope_ratio
    assert (a100.value, a100.provenance) == (1.25, "measured")
    assert "on a100-80gb-sxm" in a100.basis and "`our-kernels`" in a100.basis
    # Same GPU (h200, for an h100) and geometry as the built-in entry: the later (user's) entry wins.
    tq = rec(loaded, "llama-3.3-70b", "h100", accuracy_floor=0.9, **MEMORY_BOUND)
    assert tq.decision.kv_cache_dtype == "turboquant_4bit_nc"
    assert tq.estimates.kernel_slope_ratio.value == 0.8
    assert "`our-kernels`" in tq.estimates.kernel_slope_ratio.basis
    # Columns the user did not measure still come from the built-in figures.
    fp8 = rec(loaded, "llama-3.1-8b", "h200", context="32k").estimates.kernel_slope_ratio
    assert fp8.value == round(LLAMA["fp8"] / LLAMA["sdpa_cudnn"], 3)


def test_baseline_must_be_measured(tmp_path):
    from kvpolicy.errors import KvPolicyError

    path = tmp_path / "bad.yaml"
    path.write_text(
        "extends: builtin:default\n"
        "evidence:\n"
        "  - id: no-baseline\n"
        "    statement: s\n"
        "    source: s\n"
        "    kernels:\n"
        "      - {gpu: h200, geometry: llama-3.1-8b, head_dim: 128, batch: 8,\n"
        "         fits: {bf16: {slope_ns_per_token: 7.4}}}\n"
    )
    with pytest.raises(KvPolicyError, match="sdpa_cudnn"):
        load_policy(path)


def test_table_and_json_show_the_kernel_estimate(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    argv = ["recommend", "--model", "llama-3.3-70b", "--gpu", "h100", "--tp", "4", "--context", "128k",
            "--concurrency", "10", "--accuracy-floor", "0.9"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    line = next(line for line in table.splitlines() if "kernel slope vs cuDNN" in line)
    assert f"{TQ_RATIO} (measured)" in line
    assert main([*argv, "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["estimates"]["kernel_slope_ratio"]["value"] == round(LLAMA["turboquant_4bit_nc"] / LLAMA["sdpa_cudnn"], 3)


@pytest.mark.parametrize("model,gpu,context", [("gpt-oss-20b", "h100", "32k"), ("llama-3.1-8b", "l40s", "128k"),
                                               ("gemma-3-12b", "b200", "4k")])
def test_each_figure_is_computed_once_and_the_estimates_match_the_facts(builtin, monkeypatch, model, gpu, context):
    """build_facts and estimate share one Figures per deployment: no break-even, recovery, concurrency or kernel
    look-up runs twice for the same variant, and the decided variant's estimates are the facts' figures."""
    from kvpolicy.facts import build, estimates

    # What each function computes a figure of: the variant (the layout object, cached per variant) or the dtype.
    variant = {"break_even": lambda a: (a[3], tuple(a[4])), "recovery": lambda a: a[1],
               "plan": lambda a: id(a[1]), "kernel_figure": lambda a: a[3]}
    calls: list[tuple[str, object]] = []
    for name, key in variant.items():
        for module in (estimates, build):  # wherever the facts or the estimates could call it from
            if hasattr(module, name):
                real = getattr(module, name)
                monkeypatch.setattr(module, name,
                                    lambda *a, _n=name, _k=key, _f=real: calls.append((_n, _k(a))) or _f(*a))
    r = rec(builtin, model, gpu, context=context)
    assert {n for n, _ in calls} == set(variant)
    assert len(calls) == len(set(calls)), calls
    facts, est, d = r.trace.facts, r.estimates, r.decision
    fmt = {"auto": "bf16", "fp8": "fp8"}.get(d.kv_cache_dtype)
    if fmt and not d.skip_layers:
        # The facts count whole requests (the null block held back); the estimate is what vLLM logs.
        whole = facts[f"memory.max_concurrency_{fmt}"]
        assert whole <= est.max_concurrency.value < whole + 2
    if d.kv_cache_dtype == "fp8":
        variant = "fp8_skip_sliding" if d.skip_layers == ["sliding_window"] else "fp8"
        assert est.break_even_tokens.value == facts[f"latency.{variant}_break_even_tokens"]
        assert est.accuracy_recovery.value == facts["accuracy.fp8_recovery"]


@pytest.mark.parametrize(("context", "provenance"), [(262144, "measured"), (1048576, "extrapolated")])
def test_accuracy_beyond_the_measured_contexts_is_labelled_extrapolated(context, provenance):
    """The study measured FP8 MRCR up to 256k; its figure applied at 1M must not read as measured."""
    from kvpolicy.facts.estimates import recovery

    acc = recovery(load_policy().policy, "fp8", context, resolve_model("qwen3-30b-a3b"), resolve_gpu("h100"))
    assert acc.provenance == provenance
    if provenance == "extrapolated":
        assert acc.value == 0.93 and "measured up to 262,144 tokens, extrapolated to 1,048,576" in acc.basis
