"""The documents' fit, `--record` into a policy file, and what recording changes in `recommend` (no torch)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy.errors import PolicyError
from kvpolicy.inputs.catalog import resolve_gpu, resolve_model
from kvpolicy.inputs.workload import make_workload
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.decision import Decision
from kvpolicy.rules.validate import load_policy
from kvpolicy.runtime.fit import LineFit, break_even_tokens, fit_line, fit_problems
from kvpolicy.runtime.record import evidence_id, record_bench
from kvpolicy.runtime.results import BenchFit, BenchResult, Environment, VariantInfo


def test_fit_recovers_an_exact_line():
    xs = [1024, 2048, 4096, 8192, 131072]
    fit = fit_line(xs, [4.37e-05 * x + 6.44 for x in xs])
    assert fit.slope_ms_per_token == pytest.approx(4.37e-05)
    assert fit.intercept_ms == pytest.approx(6.44)
    assert fit.r2 == pytest.approx(1.0)


def test_break_even_is_intercept_difference_over_slope_difference():
    # The documents' Llama-3.1-8B H100 figures: (6.58 - 6.44) / (4.37e-05 - 2.37e-05) = 7,000 tokens.
    bf16, fp8 = LineFit(4.37e-05, 6.44, 1.0), LineFit(2.37e-05, 6.58, 1.0)
    assert break_even_tokens(bf16, fp8) == pytest.approx(7000)
    assert break_even_tokens(bf16, LineFit(5e-05, 6.0, 1.0)) is None  # steeper: never catches up
    assert break_even_tokens(bf16, LineFit(2e-05, 6.0, 1.0)) == 0.0  # faster everywhere


@given(st.floats(1e-7, 1e-3), st.floats(0.01, 20), st.floats(0.1, 0.95), st.floats(-1, 1))
def test_break_even_is_where_the_lines_cross(slope, intercept, ratio, delta):
    base, other = LineFit(slope, intercept, 1.0), LineFit(slope * ratio, intercept + delta, 1.0)
    be = break_even_tokens(base, other)
    assert be is not None and be >= 0
    if delta > 0:
        at = lambda f, x: f.slope_ms_per_token * x + f.intercept_ms
        assert at(base, be) == pytest.approx(at(other, be), rel=1e-9, abs=1e-9)


def test_fit_needs_two_contexts():
    with pytest.raises(ValueError):
        fit_line([4096, 4096], [1.0, 1.1])


def test_meaningless_fits_are_named():
    """Two points always fit (r2 = 1); scattered CPU times and negative intercepts are no line either."""
    xs = [1024, 4096, 16384, 65536]
    good = fit_line(xs, [4.37e-05 * x + 6.44 for x in xs])
    assert fit_problems(good, len(xs)) == []
    two = fit_line([256, 512], [3.0, 2.0])
    assert two.r2 == 1.0 and any("only 2 contexts" in p for p in fit_problems(two, 2))
    scattered = fit_line(xs, [5.0, 1.0, 6.0, 2.5])
    assert any(p.startswith("r2 ") for p in fit_problems(scattered, len(xs)))
    negative = fit_line(xs, [0.001 * x - 3 for x in xs])
    assert any("negative intercept" in p for p in fit_problems(negative, len(xs)))


def test_bench_warns_about_meaningless_fits():
    from kvpolicy.runtime.bench import fit_all, fit_warnings
    from kvpolicy.runtime.results import BenchPoint

    result = _result()
    result.contexts, result.batches = [256, 512], [1]
    result.points = [BenchPoint(variant=v, batch=1, context_tokens=c, itl_ms=ms)
                     for v, c, ms in (("bf16", 256, 2.0), ("bf16", 512, 3.0), ("fp8", 256, 2.5), ("fp8", 512, 2.9))]
    fits = fit_all(result)
    assert all(f.problems for f in fits)
    warnings = fit_warnings(fits)
    assert len(warnings) == 2 and "the fit is meaningless (only 2 contexts" in warnings[1]


def _result(model: str = "llama-3.1-8b", gpu: str = "h200", fp8_intercept: float = 0.30) -> BenchResult:
    env = Environment(device="NVIDIA H200", backend="triton", date="2026-11-30T00:00:00+00:00",
                      kvpolicy_version="0.1.0", commit="abc1234", torch_version="2.11.0", triton_version="3.6.0")
    fits = [
        BenchFit(variant="bf16", key="bf16", batch=1, slope_ms_per_token=3.2e-05, intercept_ms=0.25, r2=1.0),
        BenchFit(variant="fp8", key="fp8", batch=1, slope_ms_per_token=1.7e-05, intercept_ms=fp8_intercept, r2=1.0,
                 slope_ratio=0.53, break_even_tokens=round((fp8_intercept - 0.25) / 1.5e-05)),
        BenchFit(variant="fp8+one_level", key="fp8", batch=1, slope_ms_per_token=1.0e-05, intercept_ms=0.3, r2=1.0,
                 slope_ratio=0.31, break_even_tokens=2273),
        BenchFit(variant="fp8", key="fp8", batch=8, slope_ms_per_token=9e-05, intercept_ms=1.0, r2=1.0),
    ]
    variants = [VariantInfo(name="bf16", key="bf16", kv_cache_dtype="auto"),
                VariantInfo(name="fp8", key="fp8", kv_cache_dtype="fp8"),
                VariantInfo(name="fp8+one_level", key="fp8", kv_cache_dtype="fp8", two_level=False)]
    return BenchResult(model=model, gpu=gpu, environment=env, decision=Decision(kv_cache_dtype="fp8"),
                       contexts=[1024, 131072], batches=[1, 8], variants=variants, fits=fits)


def _recommend(policy: str, context: str = "32k"):
    loaded = load_policy(policy)
    arch, gpu = resolve_model("llama-3.1-8b"), resolve_gpu("h200")
    return recommend(arch, gpu, make_workload(loaded, context=context), loaded)


def test_record_creates_a_policy_that_makes_the_estimates_measured(tmp_path):
    before = _recommend("builtin:default")
    assert before.estimates.break_even_tokens.provenance == "modelled"  # no H200 study figure
    path = tmp_path / "measured.yaml"
    rid = record_bench(_result(), path)
    assert rid == evidence_id("llama-3.1-8b", "h200") == "bench-itl-llama-3.1-8b-h200"
    text = path.read_text()
    assert "extends: builtin:default" in text and text.startswith("#")
    after = _recommend(str(path))
    est = after.estimates
    assert est.itl_slope_ratio.provenance == "measured" and est.itl_slope_ratio.value == pytest.approx(0.531, abs=1e-3)
    assert rid in est.itl_slope_ratio.basis
    assert est.break_even_tokens.provenance == "measured" and est.break_even_tokens.value == 3333
    # The engine's threshold follows the measurement: the dtype rules read this fact.
    assert after.trace.facts["latency.fp8_break_even_tokens"] == 3333
    # The plain (two-level, uncalibrated) line is recorded, not the +one_level one, and batch 1 only.
    fits = load_policy(str(path)).policy.evidence[-1].itl.variants
    assert fits["fp8"].slope_ms_per_token == pytest.approx(1.7e-05)


def test_recorded_break_even_changes_the_decision(tmp_path):
    # A GPU where FP8 only pays past 100k tokens: at 64k the decision flips back to BF16.
    default = _recommend("builtin:default", "64k")
    assert default.decision.kv_cache_dtype == "fp8"
    path = tmp_path / "slow-fp8.yaml"
    record_bench(_result(fp8_intercept=0.25 + 1.5e-05 * 100_000), path)
    assert _recommend(str(path), "64k").decision.kv_cache_dtype == "auto"
    assert _recommend(str(path), "128k").decision.kv_cache_dtype == "fp8"


def test_record_keeps_comments_and_replaces_its_own_entry(tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text(
        "# Team policy: keep this header.\n"
        "version: 1\n"
        "name: team  # inline comment\n"
        "extends: builtin:default\n"
        "evidence:\n"
        "  # our own notes\n"
        "  - id: team-note\n"
        "    statement: \"A note.\"\n"
        "    source: wiki\n"
    )
    record_bench(_result(), path)
    record_bench(_result(fp8_intercept=0.4), path)  # a second run replaces, never duplicates
    text = path.read_text()
    for comment in ("# Team policy: keep this header.", "# inline comment", "# our own notes"):
        assert comment in text
    policy = load_policy(str(path)).policy
    ids = [e.id for e in policy.evidence]
    assert ids.count("bench-itl-llama-3.1-8b-h200") == 1 and "team-note" in ids
    assert policy.evidence[-1].itl.variants["fp8"].intercept_ms == pytest.approx(0.4)
    assert "abc1234" in policy.evidence[-1].source and "NVIDIA H200" in policy.evidence[-1].source


def test_record_refuses_a_file_that_is_not_a_policy(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("version: 1\nrules: 3\n")
    with pytest.raises(PolicyError):
        record_bench(_result(), path)
    assert path.read_text() == "version: 1\nrules: 3\n"  # untouched


def test_users_evidence_wins_over_the_studies_for_the_same_gpu(tmp_path):
    path = tmp_path / "h100.yaml"
    record_bench(_result(gpu="h100-sxm"), path)
    rec = recommend(resolve_model("llama-3.1-8b"), resolve_gpu("h100"),
                    make_workload(load_policy(str(path)), context="32k"), load_policy(str(path)))
    assert "bench-itl-llama-3.1-8b-h100-sxm" in rec.estimates.itl_slope_ratio.basis
