"""`verify --record` of the model-level check: next-token figures become accuracy evidence for that model, which
`recommend` cites as its accuracy estimate and its rules act on (a failing FP8 is not served uncalibrated)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="the runtime needs torch (pip install -e .[kernels])")

from pydantic import ValidationError

from kvpolicy.errors import InputError
from kvpolicy.inputs.catalog import resolve_gpu, resolve_model
from kvpolicy.inputs.policy_schema import ModelFigure
from kvpolicy.inputs.workload import make_workload
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.decision import Decision
from kvpolicy.rules.validate import load_policy
from kvpolicy.runtime.record import model_evidence_id, record_verify
from kvpolicy.runtime.results import Environment
from kvpolicy.runtime.verify import ModelCheck, VerifyResult

CPU = Environment(device="cpu", backend="reference", date="2026-12-06T00:00:00+00:00", kvpolicy_version="0.1.0",
                  commit="abc1234", torch_version="2.11.0")
H100 = Environment(device="NVIDIA H100 80GB HBM3", backend="triton", date="2026-12-06T00:00:00+00:00",
                   kvpolicy_version="0.1.0", commit="abc1234", torch_version="2.11.0", triton_version="3.6.0")
GOOD = dict(agreement=0.975, agreement_low=0.958, agreement_high=0.985, kl_mean=0.008, kl_p99=0.05, ppl_delta=0.012)
BAD = dict(agreement=0.80, agreement_low=0.763, agreement_high=0.832, kl_mean=0.09, kl_p99=0.6, ppl_delta=0.11)


def _check(variant: str, fig: dict, tokens: int = 512) -> ModelCheck:
    return ModelCheck(variant=variant, tokens=tokens, kl_max=fig["kl_p99"] * 3, **fig)


def _verify(model: str = "llama-3.1-8b", env: Environment = CPU, gpu: str = "h100-sxm", fp8: dict = GOOD,
            per_head: dict = GOOD, tq: dict = BAD) -> VerifyResult:
    """A verify whose model-level check ran (no needle points needed: they are not what is recorded here)."""
    checks = [_check("bf16 (vs the model's own sdpa attention)", dict(GOOD, agreement=1.0, agreement_high=1.0)),
              _check("fp8", fp8), _check("fp8+per_head", per_head), _check("fp8+one_level", BAD),
              _check("turboquant_4bit_nc", tq)]
    return VerifyResult(model=model, gpu=gpu, environment=env, decision=Decision(kv_cache_dtype="fp8"),
                        model_check=checks, model_check_note=f"{model}: 512 tokens of `pydoc.txt`, float32 weights")


def _rec(path, model: str = "llama-3.1-8b", gpu: str = "h100", **kw):
    loaded = load_policy(str(path) if path else None)
    return recommend(resolve_model(model), resolve_gpu(gpu), make_workload(loaded, **kw), loaded)


def test_a_cpu_model_check_is_recorded_for_the_model_on_any_gpu(tmp_path):
    path = tmp_path / "acc.yaml"
    ids = record_verify(_verify(), path)
    # the CPU's needle recoveries are not recorded, its model-level figures are: scoped to the model, no GPU
    assert ids == [model_evidence_id("llama-3.1-8b", None)] == ["verify-model-llama-3.1-8b"]
    ev = load_policy(str(path)).policy.evidence[-1]
    assert not ev.recovery
    assert [(f.dtype, f.scale_source, f.gpu) for f in ev.model_check] == [
        ("fp8", "uncalibrated", None), ("fp8", "checkpoint_per_head", None), ("turboquant_4bit_nc", "uncalibrated", None)]
    fp8 = ev.model_check[0]
    assert (fp8.agreement, fp8.agreement_low, fp8.kl_p99, fp8.ppl_delta, fp8.tokens) == (0.975, 0.958, 0.05, 0.012, 512)
    assert "pydoc.txt" in fp8.text and "float64 CPU references" in ev.statement


def test_recommend_cites_the_recorded_figure_as_its_accuracy_estimate(tmp_path):
    path = tmp_path / "acc.yaml"
    [rid] = record_verify(_verify(), path)
    before, after = _rec(None, context="128k"), _rec(path, context="128k")
    assert before.decision == after.decision and after.decision.kv_cache_dtype == "fp8"
    acc = after.estimates.accuracy_recovery
    assert (acc.value, acc.unit, acc.provenance) == (0.975, "top-1 agreement", "measured")
    assert f"evidence `{rid}`" in acc.basis and "within the policy's model thresholds" in acc.basis
    assert rid in [e.id for e in after.evidence] and rid not in [e.id for e in before.evidence]
    assert after.trace.facts["accuracy.fp8_model_check"] == "pass"
    # another model keeps the studies' figure
    other = _rec(path, model="qwen3-8b", context="32k").estimates.accuracy_recovery
    assert other.unit == "ratio" and rid not in other.basis


def test_a_failing_fp8_figure_is_not_served_uncalibrated(tmp_path):
    path = tmp_path / "acc.yaml"
    [rid] = record_verify(_verify(fp8=BAD), path)
    rec = _rec(path, context="128k")
    assert rec.trace.facts["accuracy.fp8_model_check"] == "below"
    assert (rec.decision.kv_cache_dtype, rec.decision.scale_source) == ("fp8", "checkpoint_per_head")
    assert rec.trace.fields["scale_source"].decided_by == "KV406"
    assert any(rid in w and "top-1 agreement < 90%" in w for w in rec.warnings)
    # the estimate is now the per-head figure the decision stands on
    acc = rec.estimates.accuracy_recovery
    assert acc.value == 0.975 and "checkpoint per head scales" in acc.basis
    # off Hopper: per-tensor scales
    assert _rec(path, gpu="b200", context="128k").decision.scale_source == "checkpoint_per_tensor"


def test_fp8_failing_with_per_head_scales_too_keeps_bf16_where_it_fits(tmp_path):
    path = tmp_path / "acc.yaml"
    record_verify(_verify(fp8=BAD, per_head=BAD), path)
    rec = _rec(path, context="128k")
    assert rec.decision.kv_cache_dtype == "auto" and rec.trace.fields["kv_cache_dtype"].decided_by == "KV117"
    assert any("keeping BF16" in w for w in rec.warnings)


def test_the_figures_are_judged_by_the_policys_thresholds(tmp_path):
    """Agreement alone does not pass: a perplexity past `model_max_ppl_increase` fails, and lowering that
    threshold in the policy (not re-recording) changes the verdict."""
    path = tmp_path / "acc.yaml"
    record_verify(_verify(fp8=dict(GOOD, ppl_delta=0.08)), path)
    assert _rec(path, context="128k").trace.facts["accuracy.fp8_model_check"] == "below"
    text = path.read_text() + "thresholds:\n  model_max_ppl_increase: {value: 0.1}\n"
    path.write_text(text)
    rec = _rec(path, context="128k")
    assert rec.trace.facts["accuracy.fp8_model_check"] == "pass" and rec.decision.scale_source == "uncalibrated"


def test_an_undecided_agreement_changes_nothing(tmp_path):
    path = tmp_path / "acc.yaml"
    record_verify(_verify(fp8=dict(GOOD, agreement=0.91, agreement_low=0.88, agreement_high=0.935)), path)
    rec = _rec(path, context="128k")
    assert rec.trace.facts["accuracy.fp8_model_check"] == "undecided"
    assert rec.decision.scale_source == "uncalibrated" and "straddles" in rec.estimates.accuracy_recovery.basis


def test_a_gpu_figure_wins_on_its_gpu_and_the_cpu_figure_elsewhere(tmp_path):
    path = tmp_path / "acc.yaml"
    record_verify(_verify(), path)  # CPU: passes
    ids = record_verify(_verify(env=H100, gpu="h100-sxm", fp8=BAD), path)  # the kernels on the H100: fail
    assert ids == ["verify-model-llama-3.1-8b-h100-sxm"]  # no needle points in this result: no needle entry
    h100 = _rec(path, gpu="h100-sxm", context="128k")
    assert h100.trace.facts["accuracy.fp8_model_check"] == "below" and h100.decision.scale_source != "uncalibrated"
    h200 = _rec(path, gpu="h200", context="128k")
    assert h200.trace.facts["accuracy.fp8_model_check"] == "pass"
    assert "verify-model-llama-3.1-8b`" in h200.estimates.accuracy_recovery.basis


def test_turboquant_failing_its_model_check_is_not_chosen_for_capacity(tmp_path):
    kw = dict(context="128k", concurrency=10, tp=4, accuracy_floor=0.9)
    path = tmp_path / "acc.yaml"
    assert _rec(None, model="llama-3.3-70b", **kw).decision.kv_cache_dtype == "turboquant_4bit_nc"
    record_verify(_verify(model="llama-3.3-70b", tq=BAD), path)
    rec = _rec(path, model="llama-3.3-70b", **kw)
    assert rec.trace.facts["accuracy.turboquant_4bit_nc_model_check"] == "below"
    assert rec.decision.kv_cache_dtype == "fp8"


def test_a_cpu_run_without_model_figures_records_nothing(tmp_path):
    path = tmp_path / "acc.yaml"
    result = _verify()
    result.model_check = result.model_check[:1]  # BF16 only
    with pytest.raises(InputError, match="CPU torch references"):
        record_verify(result, path)
    assert not path.exists()


def test_a_figure_outside_its_interval_is_a_schema_error():
    with pytest.raises(ValidationError, match="outside its interval"):
        ModelFigure(dtype="fp8", model="m", tokens=10, agreement=0.9, agreement_low=0.92, agreement_high=0.95,
                    kl_mean=0.01)


def test_lint_knows_the_model_check_facts(tmp_path):
    from kvpolicy.policy.lint import lint_path

    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nextends: builtin:default\nrules:\n"
                    "  - id: XX001\n    name: never\n    statement: s\n    evidence: [fp8-capacity]\n"
                    "    when: {fact: accuracy.fp8_model_check, op: eq, value: fail}\n    then: {kv_cache_dtype: auto}\n")
    codes = {f.code for f in lint_path(path)}
    assert "KVL101" in codes  # `fail` is no verdict: pass, below or undecided


def test_cli_round_trip_on_a_tiny_model(tmp_path, capsys):
    """verify --record on the CPU with a local model folder, then recommend on that folder cites the figures."""
    transformers = pytest.importorskip("transformers")
    import torch

    from kvpolicy.cli import main

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=5,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=32768)
    folder = tmp_path / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    policy = tmp_path / "acc.yaml"
    code = main(["verify", "--model", str(folder), "--gpu", "h100", "--device", "cpu", "--contexts", "128,256",
                 "--batch", "1", "--tokens", "32", "--compare", "fp8", "--out", str(tmp_path / "out"),
                 "--record", str(policy)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "`verify-model-tiny-llama`" in err and "model-level figures only" in err
    ev = load_policy(str(policy)).policy.evidence[-1]
    assert ev.id == "verify-model-tiny-llama" and {f.dtype for f in ev.model_check} == {"fp8"}
    # at 32k the decision is FP8 (past the break-even): its accuracy estimate is the recorded figure
    assert main(["recommend", "--model", str(folder), "--gpu", "h100", "--context", "32k", "--policy", str(policy),
                 "--format", "json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["decision"]["kv_cache_dtype"] == "fp8"
    acc = rec["estimates"]["accuracy_recovery"]
    fig = next(f for f in ev.model_check if f.scale_source == rec["decision"]["scale_source"])
    assert (acc["value"], acc["unit"], acc["provenance"]) == (fig.agreement, "top-1 agreement", "measured")
    assert "evidence `verify-model-tiny-llama`" in acc["basis"]
    assert rec["trace"]["facts"]["accuracy.fp8_model_check"] in ("pass", "below", "undecided")
    assert "verify-model-tiny-llama" in [e["id"] for e in rec["evidence"]]


def test_check_judges_a_recorded_figure_by_the_model_thresholds_not_the_floor(tmp_path):
    """`kvpolicy check`: 93% agreement passes the model thresholds (>= 90%), so it is no floor violation; a pin
    that serves a failing FP8 uncalibrated is one."""
    from kvpolicy.policy.deployments import check_deployment

    path = tmp_path / "acc.yaml"
    record_verify(_verify(fp8=dict(GOOD, agreement=0.93, agreement_low=0.915, agreement_high=0.943)), path)
    path.write_text(path.read_text() + "deployments:\n  - {name: chat, model: llama-3.1-8b, gpu: h100, context: 128k}\n")
    loaded = load_policy(str(path))
    ok = check_deployment(loaded, loaded.policy.deployments[0])
    assert ok["status"] == "ok" and ok["accuracy_recovery"] == 0.93, ok["violations"]
    record_verify(_verify(fp8=BAD), path)
    path.write_text(path.read_text() + "pins:\n  - name: uncalibrated\n    when: {fact: model.id, op: eq, value: "
                    "llama-3.1-8b}\n    set: {scale_source: uncalibrated}\n")
    loaded = load_policy(str(path))
    bad = check_deployment(loaded, loaded.policy.deployments[0])
    assert bad["status"] == "violation"
    assert any("fails the model-level check recorded for llama-3.1-8b" in v for v in bad["violations"])
