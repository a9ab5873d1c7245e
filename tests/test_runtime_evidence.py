"""`verify --record`: needle recoveries become accuracy evidence for the model and GPU measured, and only from a
run of the kernels on that GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the runtime needs torch (pip install -e .[kernels])")

from pydantic import ValidationError

from kvpolicy.errors import InputError
from kvpolicy.inputs.catalog import resolve_gpu, resolve_model
from kvpolicy.inputs.policy_schema import Recovery
from kvpolicy.inputs.workload import make_workload
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.decision import Decision
from kvpolicy.rules.validate import load_policy
from kvpolicy.runtime.record import record_verify, verify_evidence_id
from kvpolicy.runtime.results import Environment
from kvpolicy.runtime.verify import NeedlePoint, VerifyResult

GPU_ENV = Environment(device="NVIDIA H200", backend="triton", date="2026-12-05T00:00:00+00:00",
                      kvpolicy_version="0.1.0", commit="abc1234", torch_version="2.11.0", triton_version="3.6.0")


def _verify(fp8: dict[int, float], env: Environment = GPU_ENV, gpu: str = "h200") -> VerifyResult:
    """A verify of llama-3.1-8b: BF16 hits every trial; fp8 recovers `fp8[context]`; fp8+one_level collapses."""
    points = []
    for ctx, rec in fp8.items():
        points.append(NeedlePoint(variant="bf16", context_tokens=ctx, hits=100, trials=128, recovery=1.0,
                                  p_abs_error=0.0, out_rel_error=0.0))
        points.append(NeedlePoint(variant="fp8", context_tokens=ctx, hits=round(100 * rec), trials=128,
                                  recovery=rec, p_abs_error=0.01, out_rel_error=1e-3))
        points.append(NeedlePoint(variant="fp8+one_level", context_tokens=ctx, hits=0, trials=128, recovery=0.0,
                                  p_abs_error=0.5, out_rel_error=0.6))
    return VerifyResult(model="llama-3.1-8b", gpu=gpu, environment=env, decision=Decision(kv_cache_dtype="fp8"),
                        contexts=sorted(fp8), batch=4, points=points)


def _recovery(policy: str, gpu: str = "h200", context: str = "128k"):
    """The FP8 recovery estimate the engine works from for llama-3.1-8b on `gpu` (the rules read it whatever
    they decide: below the floor they move off uncalibrated FP8)."""
    from kvpolicy.facts.estimates import recovery

    loaded = load_policy(policy)
    wl = make_workload(loaded, context=context)
    return recovery(loaded.policy, "fp8", wl.context_tokens, resolve_model("llama-3.1-8b"), resolve_gpu(gpu))


def test_recorded_recoveries_are_measured_for_that_model_and_gpu_only(tmp_path):
    path = tmp_path / "acc.yaml"
    [rid] = record_verify(_verify({65536: 0.99, 131072: 0.91, 262144: 0.97}), path)
    assert rid == verify_evidence_id("llama-3.1-8b", "h200") == "verify-needle-llama-3.1-8b-h200"
    ev = load_policy(str(path)).policy.evidence[-1]
    # one figure per context, each the lowest recovery up to it; the +one_level diagnostic is not a figure
    assert [(r.dtype, r.max_context_tokens, r.value) for r in ev.recovery] == [
        ("fp8", 65536, 0.99), ("fp8", 131072, 0.91), ("fp8", 262144, 0.91)]
    assert {(r.model, r.gpu) for r in ev.recovery} == {("llama-3.1-8b", "h200")}
    est = _recovery(str(path), context="100k")
    assert est.provenance == "measured" and est.value == 0.91 and rid in est.basis
    assert _recovery(str(path), context="32k").value == 0.99
    # the measured 0.91 is below the 0.95 floor: the engine moves off uncalibrated FP8 at 100k
    loaded = load_policy(str(path))
    rec = recommend(resolve_model("llama-3.1-8b"), resolve_gpu("h200"), make_workload(loaded, context="100k"), loaded)
    assert (rec.decision.kv_cache_dtype, rec.decision.scale_source) != ("fp8", "uncalibrated")
    # another GPU keeps the studies' figure
    assert rid not in _recovery(str(path), gpu="h100", context="32k").basis
    # a second run replaces the entry
    record_verify(_verify({65536: 1.0, 131072: 0.98}), path)
    evidence = load_policy(str(path)).policy.evidence
    assert [e.id for e in evidence].count(rid) == 1 and _recovery(str(path), context="100k").value == 0.98


def test_a_collapse_is_recorded_as_the_lowest_figure_the_schema_takes(tmp_path):
    path = tmp_path / "acc.yaml"
    result = _verify({65536: 0.5})
    result.points = [p.model_copy(update={"variant": "fp8", "recovery": 0.0}) if p.variant == "fp8" else p
                     for p in result.points]
    record_verify(result, path)
    assert load_policy(str(path)).policy.evidence[-1].recovery[0].value == 0.001


def test_reference_runs_are_never_recorded(tmp_path):
    path = tmp_path / "acc.yaml"
    cpu = Environment(device="cpu", backend="reference")
    with pytest.raises(InputError, match="CPU torch references"):
        record_verify(_verify({4096: 1.0}, env=cpu), path)
    assert not path.exists()


def test_a_measured_recovery_names_model_and_gpu_together():
    with pytest.raises(ValidationError, match="both `model` and `gpu`"):
        Recovery(dtype="fp8", value=0.9, model="llama-3.1-8b")
