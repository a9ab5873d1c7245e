"""Limits vLLM 0.33 enforces, checked before kvpolicy prints anything, on every surface.

A context above the model's derived max_model_len and a TP size the heads do not
divide are refused (exit 2, the limit and its source named); weights or one request
that do not fit are reported with the smallest TP that fits, and no format prints a
command vLLM would refuse without saying so (exit 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpolicy.cli import main
from kvpolicy.errors import LimitError
from kvpolicy.facts.limits import check_request, smallest_tp, startup_blockers
from kvpolicy.inputs.catalog import load_models, resolve_gpu, resolve_model
from kvpolicy.inputs.workload import Workload, make_workload
from kvpolicy.outputs import vllm_launch
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.validate import load_policy

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FORMATS = ("table", "json", "yaml", "args")


@pytest.fixture(autouse=True)
def _no_long_context_env(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("command", ["recommend", "explain"])
def test_context_above_the_models_limit_is_refused_in_every_format(capsys, command, fmt):
    code, out, err = run_cli(capsys, command, "-m", "phi-4", "-g", "h100", "-c", "64k", "--format", fmt)
    assert code == 2 and out == ""
    # The limit, the config key it comes from, and vLLM's own override.
    assert "16,384" in err and "max_position_embeddings=16384" in err and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in err
    assert "Traceback" not in err


def test_a_local_config_folder_gets_the_same_limit(capsys):
    code, out, err = run_cli(capsys, "recommend", "-m", str(FIXTURES / "phi-4"), "-g", "h100", "-c", "64k",
                             "-f", "args")
    assert code == 2 and out == "" and "16,384" in err


def test_one_million_tokens_is_refused_on_every_model_below_it():
    loaded = load_policy()
    gpu = resolve_gpu("b200")
    checked = 0
    for arch in load_models().values():
        workload = make_workload(loaded, context="1m", tp=arch.valid_tp_sizes(8)[-1])
        if arch.max_model_len >= workload.context_tokens:
            continue
        with pytest.raises(LimitError) as exc:
            recommend(arch, gpu, workload, loaded)
        assert exc.value.field == "context" and f"{arch.max_model_len:,}" in str(exc.value)
        checked += 1
    assert checked >= 40


def test_context_at_the_limit_is_accepted():
    arch = resolve_model("phi-4")
    assert check_request(arch, Workload(context_tokens=arch.max_model_len)) == []


def test_rope_scaling_raises_the_limit_and_the_env_turns_the_refusal_into_a_warning():
    arch = resolve_model("qwen3-30b-a3b")
    with pytest.raises(LimitError):
        check_request(arch, Workload(context_tokens=131072))
    warnings = check_request(arch, Workload(context_tokens=131072), env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "true"})
    assert len(warnings) == 1 and "40,960" in warnings[0] and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in warnings[0]
    assert check_request(resolve_model("qwen3-30b-a3b-2507"), Workload(context_tokens=262144)) == []


def test_the_env_override_reaches_the_cli(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    code, out, _ = run_cli(capsys, "recommend", "-m", "phi-4", "-g", "h100", "-c", "32k", "-f", "json")
    assert code == 0 and any("VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in w for w in json.loads(out)["warnings"])


@pytest.mark.parametrize(("model", "tp", "valid"), [
    ("llama-3.1-8b", 3, "1, 2, 4, 8"),     # 32 heads, 8 KV heads
    ("phi-4", 4, "1, 2, 5"),              # 40 heads, 10 KV heads
    ("qwen2.5-7b", 8, "1, 2, 4"),         # 28 heads, 4 KV heads: 8 is neither a divisor nor a multiple
    ("glm-4.7-flash", 8, "1, 2, 4, 5"),   # MLA: 20 attention heads
])
@pytest.mark.parametrize("fmt", ["table", "args"])
def test_tp_the_heads_do_not_divide_is_refused_with_the_valid_sizes(capsys, model, tp, valid, fmt):
    code, out, err = run_cli(capsys, "recommend", "-m", model, "-g", "h100", "--tp", str(tp), "-c", "8k",
                             "--format", fmt)
    assert code == 2 and out == ""
    assert f"--tp {tp} does not fit {model}" in err and f"Valid tensor-parallel sizes up to 8: {valid}." in err


def test_tp_that_replicates_kv_heads_is_accepted(capsys):
    # 8 KV heads on 16 ranks: vLLM replicates each head on 2 ranks (QKVParallelLinear).
    code, _, _ = run_cli(capsys, "recommend", "-m", "llama-3.1-8b", "-g", "h100", "--tp", "16", "-f", "args")
    assert code == 0


def test_weights_that_do_not_fit_name_the_smallest_tp_and_args_say_so(capsys):
    code, out, err = run_cli(capsys, "recommend", "-m", "deepseek-v3", "-g", "h100", "-f", "args")
    assert code == 1
    assert out.startswith("--kv-cache-dtype")  # the flags, but never silently
    assert "vLLM would refuse to start" in err and "No available memory for the cache blocks" in err
    assert "--tp 16" in err  # 671B fp8 weights: 84 GB per rank at tp 8 is above an H100's 73 GiB
    code, out, _ = run_cli(capsys, "recommend", "-m", "deepseek-v3", "-g", "h100", "--tp", "16", "-f", "args")
    assert code == 0


def test_one_request_that_does_not_fit_is_a_blocker_with_a_shorter_context():
    loaded = load_policy()
    arch, gpu = resolve_model("llama-3.1-70b"), resolve_gpu("h100")
    rec = recommend(arch, gpu, make_workload(loaded, context="128k", tp=2), loaded)
    assert len(rec.blockers) == 1
    text = rec.blockers[0]
    assert "To serve at least one request" in text and "--tp 4" in text and "lower the context to" in text
    assert smallest_tp(arch, gpu, make_workload(loaded, context="128k", tp=2), rec.decision.kv_cache_dtype) == 4
    assert startup_blockers(arch, gpu, make_workload(loaded, context="128k", tp=4), "auto") == []


@pytest.mark.parametrize("fmt", ["table", "json"])
def test_blockers_show_in_table_and_json(capsys, fmt):
    code, out, _ = run_cli(capsys, "recommend", "-m", "deepseek-v3", "-g", "h100", "-f", fmt)
    assert code == 1
    if fmt == "json":
        assert "--tp 16" in json.loads(out)["blockers"][0]
    else:
        assert "vLLM would refuse to start with it" in out and "✗ the weights" in out


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setattr(vllm_launch, "find_vllm", lambda python=None: None)


@pytest.mark.parametrize("mode", ["--dry-run", "--emit-config"])
def test_apply_refuses_before_printing_or_writing(capsys, tmp_path, no_vllm, mode):
    target = tmp_path / "serve.yaml"
    extra = [str(target)] if mode == "--emit-config" else []
    code, out, err = run_cli(capsys, "apply", "-m", "phi-4", "-g", "h100", "-c", "64k", mode, *extra)
    assert code == 2 and out == "" and "16,384" in err and not target.exists()
    code, out, err = run_cli(capsys, "apply", "-m", "llama-3.1-8b", "-g", "h100", "--tp", "3", mode, *extra)
    assert code == 2 and out == "" and "Valid tensor-parallel sizes" in err and not target.exists()
    code, out, err = run_cli(capsys, "apply", "-m", "deepseek-v3", "-g", "h100", mode, *extra)
    assert code == 1 and out == "" and "--tp 16" in err and not target.exists()


def test_check_reports_each_refused_deployment_and_goes_on(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("kvpolicy.yaml").write_text("""extends: builtin:default
deployments:
  - {name: fits, model: llama-3.1-8b, gpu: h100}
  - {name: too-long, model: phi-4, gpu: h100, context: 64k}
  - {name: bad-tp, model: llama-3.1-8b, gpu: h100, tp: 3}
  - {name: too-big, model: deepseek-v3, gpu: h100}
""")
    code, out, _ = run_cli(capsys, "check", "--format", "json")
    assert code == 2  # check's code for deployments it could not evaluate; the others are still judged
    by_name = {d["name"]: d for d in json.loads(out)["results"]}
    assert by_name["fits"]["status"] == "ok"
    assert by_name["too-long"]["status"] == "error" and "16,384" in by_name["too-long"]["error"]["detail"]
    assert "kvpolicy.yaml:4:5: deployment `too-long`" in by_name["too-long"]["error"]["detail"]
    assert by_name["bad-tp"]["status"] == "error"
    assert "Valid tensor-parallel sizes" in by_name["bad-tp"]["error"]["detail"]
    assert by_name["too-big"]["status"] == "violation" and "--tp 16" in by_name["too-big"]["violations"][0]
    code, _, err = run_cli(capsys, "explain", "--deployment", "too-long")
    assert code == 2 and "16,384" in err


def test_a_policy_format_vllm_cannot_store_for_the_model_is_skipped_with_the_reason(capsys, tmp_path):
    # NVFP4 needs head sizes FlashInfer serves; MiMo-V2's keys are 192 wide: the rule never decides, and says why.
    policy = tmp_path / "p.yaml"
    policy.write_text("extends: builtin:default\nrules:\n  - {id: XX001, name: nvfp4-everywhere, statement: s, "
                      "then: {kv_cache_dtype: nvfp4}, evidence: [fp8-capacity]}\n")
    args = ["-m", "mimo-v2.5", "-g", "b200", "-c", "8k", "--tp", "8", "-p", str(policy)]
    code, out, err = run_cli(capsys, "recommend", *args, "-f", "json")
    assert code == 0, err
    rec = json.loads(out)
    assert rec["decision"]["kv_cache_dtype"] != "nvfp4"
    (xx,) = [o for o in rec["trace"]["rules"] if o["id"] == "XX001"]
    assert xx["matched"] and not xx["decided"] and "not served by vLLM 0.33" in xx["reason"]
