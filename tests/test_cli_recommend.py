"""`kvpolicy recommend` / `explain` / `rule` from the command line: formats, errors, start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from kvpolicy.cli import main
from kvpolicy.rules.decision import Recommendation

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
HEAVY = ("torch", "triton", "vllm", "starlette", "uvicorn", "transformers", "numpy", "matplotlib")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_gpu_names_with_spaces_and_counts(capsys):
    base = run_cli(capsys, "recommend", "-m", "llama-3.3-70b", "-g", "h100", "--tp", "2", "-f", "json")[1]
    for gpu in ("2xh100", "2x H100", "h100x2", "NVIDIA H100 80GB HBM3 x2"):
        code, out, err = run_cli(capsys, "recommend", "-m", "llama-3.3-70b", "-g", gpu, "-f", "json")
        assert (code, out) == (0, base), (gpu, err)
    assert run_cli(capsys, "explain", "-m", "llama-3.3-70b", "-g", "2xh100", "--tp", "2", "-f", "json")[0] == 0
    code, out, _ = run_cli(capsys, "recommend", "-m", "llama-3.1-8b", "-g", "rtx 4090", "-f", "json")
    assert code == 0 and json.loads(out)["gpu"] == "rtx-4090"
    code, _, err = run_cli(capsys, "recommend", "-m", "llama-3.3-70b", "-g", "2xh100", "--tp", "4")
    assert code == 2 and "--gpu `2xh100` names 2 GPUs but --tp is 4; give the count once" in err
    code, _, err = run_cli(capsys, "explain", "-m", "llama-3.3-70b", "-g", "rtx 4091")
    assert code == 2 and "unknown GPU `rtx 4091`. Did you mean `rtx-4090`" in err


def test_json_is_a_valid_recommendation(capsys):
    code, out, _ = run_cli(capsys, "recommend", "--model", "gpt-oss-20b", "--gpu", "h100", "--format", "json")
    assert code == 0
    rec = Recommendation.model_validate_json(out)
    assert rec.decision.kv_cache_dtype == "fp8"
    assert rec.estimates.itl_slope_ratio.provenance == "measured"
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(out), Recommendation.model_json_schema())


def test_args_format_prints_only_vllm_flags(capsys):
    code, out, _ = run_cli(capsys, "recommend", "-m", "openai/gpt-oss-20b", "-g", "H100-SXM", "--format", "args")
    assert code == 0
    assert out.split() == ["--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "sliding_window",
                           "--attention-backend", "FLASH_ATTN", "--max-model-len", "32768"]


def test_yaml_format_parses(capsys):
    code, out, _ = run_cli(capsys, "recommend", "-m", "llama-3.1-8b", "-g", "b200", "-c", "6k", "--format", "yaml")
    assert code == 0
    data = YAML(typ="safe").load(out)
    assert data["decision"]["attention_backend"] == "FLASHINFER"
    assert data["workload"]["context_tokens"] == 6144


def test_yaml_format_reads_the_same_in_yaml_1_1(capsys):
    """`two_level_accumulation: on` unquoted is True to PyYAML (YAML 1.1); the words must stay strings."""
    from kvpolicy.outputs.render import to_yaml

    code, out, _ = run_cli(capsys, "recommend", "-m", "gpt-oss-20b", "-g", "h100", "--format", "yaml")
    assert code == 0
    yaml11 = YAML(typ="safe", pure=True)
    yaml11.version = (1, 1)
    for load in (YAML(typ="safe").load, yaml11.load):
        assert load(out)["decision"]["two_level_accumulation"] == "on"
    words = {"a": ["on", "off", "yes", "No", "y", "null", "~", "1:30", "plain", "12"]}
    assert yaml11.load(to_yaml(words)) == words == YAML(typ="safe").load(to_yaml(words))


def test_table_shows_decision_command_and_rules(capsys):
    code, out, _ = run_cli(capsys, "recommend", "--model", "gpt-oss-20b", "--gpu", "h100")
    assert code == 0
    flat = " ".join(out.split())
    assert "vllm serve openai/gpt-oss-20b --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers sliding_window" in flat
    assert "KV201" in out and "KV107" in out
    assert "measured" in out and "modelled" in out


def test_table_command_loads_a_local_config_by_its_folder(capsys):
    """`--model DIR/config.json` prints `vllm serve DIR` (vLLM loads folders, not config files), as apply runs it."""
    folder = FIXTURES / "llama-3.1-8b-instruct"
    code, out, _ = run_cli(capsys, "recommend", "--model", str(folder / "config.json"), "--gpu", "h100")
    assert code == 0
    assert f"vllm serve {folder.resolve()} --kv-cache-dtype" in " ".join(out.split())


def test_explain_lists_every_rule(capsys):
    code, out, _ = run_cli(capsys, "explain", "--model", "llama-3.1-8b", "--gpu", "h100", "--context", "4k")
    assert code == 0
    for rid in ("KV101", "KV106", "KV107", "KV201", "KV301", "KV504"):
        assert rid in out


def test_local_config_folder(capsys):
    code, out, _ = run_cli(capsys, "recommend", "-m", str(FIXTURES / "gpt-oss-20b"), "-g", "h100", "-f", "json")
    assert code == 0
    assert json.loads(out)["decision"]["skip_layers"] == ["sliding_window"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--model", "gpt-oss-21b", "--gpu", "h100"], "gpt-oss-20b"),         # close match offered
        (["--model", "gpt-oss-20b", "--gpu", "h1000"], "h100"),
        (["--model", "gpt-oss-20b", "--gpu", "h100", "--context", "32q"], "--context"),
        (["--model", "gpt-oss-20b", "--gpu", "h100", "--context=-4k"], "--context"),
        (["--model", "gpt-oss-20b", "--gpu", "h100", "--concurrency", "-3"], "--concurrency"),
        (["--model", "gpt-oss-20b", "--gpu", "h100", "--tp", "0"], "--tp"),
        (["--model", "gpt-oss-20b", "--gpu", "h100", "--accuracy-floor", "1.5"], "--accuracy-floor"),
        (["--model", str(FIXTURES / "broken-no-layers"), "--gpu", "h100"], "num_hidden_layers"),
        (["--model", "/no/such/folder/config.json", "--gpu", "h100"], "/no/such/folder"),
        (["--model", "gpt-oss-20b", "--gpu", "h100", "--policy", "/no/such/policy.yaml"], "policy.yaml"),
        (["--model", "gpt-oss-20b", "--gpu", "h100", "--format", "xml"], "--format"),
    ],
)
def test_bad_input_is_one_clear_error_with_exit_2(capsys, argv, needle):
    code, out, err = run_cli(capsys, "recommend", *argv)
    assert code == 2
    assert needle in err
    assert "Traceback" not in err + out
    assert err.strip().count("\n") <= 3  # a paragraph, not a dump


def test_gpu_auto_without_nvidia_smi(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    code, _, err = run_cli(capsys, "recommend", "--model", "gpt-oss-20b", "--gpu", "auto")
    assert code == 2
    assert "nvidia-smi" in err and "--gpu h100" in err


def test_unknown_command_suggests(capsys):
    code, _, err = run_cli(capsys, "recomend")
    assert code == 2 and "recommend" in err


def test_rule_prints_why_and_evidence(capsys):
    code, out, _ = run_cli(capsys, "rule", "KV201")
    assert code == 0
    assert "skip-small-sliding-windows" in out and "7,659" in out and "fp8-itl-gpt-oss-20b-h100" in out
    code, out, _ = run_cli(capsys, "rule", "KV201", "--format", "json")
    assert json.loads(out)["evidence"][0]["id"] == "fp8-itl-gpt-oss-20b-h100"
    code, _, err = run_cli(capsys, "rule", "KV999")
    assert code == 2 and "KV" in err


def _rows(out: str, ids: list[str]) -> dict[str, str]:
    """Each catalog id's first line of a listing."""
    return {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in ids}


def test_models_list_parameters_and_the_max_context_vllm_accepts(capsys, monkeypatch):
    from kvpolicy.errors import LimitError
    from kvpolicy.facts.limits import check_request
    from kvpolicy.inputs.catalog import load_models
    from kvpolicy.inputs.workload import Workload

    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run_cli(capsys, "models")
    assert code == 0
    assert out.splitlines()[0].split() == ["id", "params", "active", "max", "context", "Hugging", "Face", "id",
                                           "KV", "layers"]
    models = load_models()
    rows = _rows(out, list(models))
    assert list(rows) == list(models)
    assert rows["llama-3.1-8b"].split()[1:5] == ["8.03B", "7.50B", "131,072", "meta-llama/Llama-3.1-8B-Instruct"]
    assert rows["gpt-oss-120b"].split()[1:4] == ["117B", "5.13B", "131,072"]
    # The column is the limit `check_request` holds a --context to: that length passes, one more is refused.
    for model_id, line in rows.items():
        limit = int(line.split()[3].replace(",", ""))
        arch = models[model_id]
        check_request(arch, Workload(context_tokens=limit), env={})
        with pytest.raises(LimitError, match="derived max_model_len"):
            check_request(arch, Workload(context_tokens=limit + 1), env={})


@pytest.mark.parametrize("command", ["models", "gpus"])
def test_listings_fit_80_columns_and_cut_no_name(command: str, capsys, monkeypatch):
    from kvpolicy.inputs.catalog import load_gpus, load_models

    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli(capsys, command)
    assert code == 0
    assert max(map(len, out.splitlines())) <= 80
    assert out.startswith("id  ")
    if command == "models":
        names = [m.hf_id for m in load_models().values()]
        assert list(_rows(out, list(load_models()))) == list(load_models())
    else:
        names = [a for g in load_gpus().values() for a in g.aliases if " " not in a]
        assert list(_rows(out, list(load_gpus()))) == list(load_gpus())
        assert "2xh100" in out
    words = set(out.replace(",", " ").split())
    assert [n for n in names if n not in words] == []


def test_listing_json_keeps_its_shape(capsys):
    code, out, _ = run_cli(capsys, "models", "--format", "json")
    first = json.loads(out)[0]
    assert code == 0 and first["id"] == "llama-3.1-8b" and first["max_model_len"] == 131072
    assert first["params_b"] == pytest.approx(8.03, abs=0.01)
    code, out, _ = run_cli(capsys, "gpus", "--format", "json")
    assert code == 0 and json.loads(out)[0]["id"] == "a100-80gb-sxm"


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["recommend", "--model", "gpt-oss-20b", "--gpu", "h100"],
    ["explain", "--model", "gpt-oss-20b", "--gpu", "h100", "--format", "json"],
    ["rule", "KV106"],
    ["models"],
    ["gpus"],
])
def test_startup_loads_no_heavy_modules(argv):
    """recommend/explain/--help must not import torch, triton, vllm or the server stack."""
    probe = (
        "import sys, io, contextlib\n"
        "from kvpolicy.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    code = main({argv!r})\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        "print(code, ','.join(heavy))\n"
    )
    env = {**os.environ, "COLUMNS": "120"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    code, _, heavy = out.stdout.strip().partition(" ")
    assert code == "0"
    assert heavy == "", f"loaded {heavy}"


def test_weights_gb_overrides_the_derived_weights(capsys):
    code, out, _ = run_cli(capsys, "recommend", "--model", "llama-3.1-8b", "--gpu", "h100", "--format", "json")
    base = Recommendation.model_validate_json(out)
    code, out, _ = run_cli(capsys, "recommend", "--model", "llama-3.1-8b", "--gpu", "h100", "--format", "json",
                           "--weights-gb", "40")
    assert code == 0
    heavy = Recommendation.model_validate_json(out)
    assert "--weights-gb 40 (override" in heavy.estimates.kv_capacity_tokens.basis
    assert "weights 40.0 GB" in heavy.estimates.kv_capacity_tokens.basis
    # 24 GB more weights: about 24e9 / 1 MiB fewer fp8 blocks.
    lost = (base.estimates.max_concurrency.value - heavy.estimates.max_concurrency.value) * 2048 * (1 << 20)
    assert lost == pytest.approx(40e9 - 16_060_522_496, rel=1e-3)


@pytest.mark.parametrize("bad", ["-3", "0", "lots", "inf", "nan"])
def test_bad_weights_gb_is_a_usage_error(capsys, bad):
    code, _, err = run_cli(capsys, "recommend", "--model", "llama-3.1-8b", "--gpu", "h100", "--weights-gb", bad)
    assert code == 2 and "argument --weights-gb" in err and "Traceback" not in err


def test_a_deployment_can_override_the_weights(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("kvpolicy.yaml").write_text("extends: builtin:default\ndeployments:\n"
                                     "  - {name: big, model: llama-3.1-8b, gpu: h100, weights_gb: 60}\n")
    code, out, _ = run_cli(capsys, "explain", "--deployment", "big", "--format", "json")
    assert code == 0, out
    assert "weights_gb: 60 (override" in json.loads(out)["estimates"]["kv_capacity_tokens"]["basis"]


@pytest.mark.parametrize("columns", ["80", "60"])
@pytest.mark.parametrize("args", [["-m", "gpt-oss-20b", "-g", "h100"], ["-m", "llama-3.1-8b", "-g", "b200", "-c", "128k"],
                                  ["-m", "kimi-k2.5", "-g", "h200", "-c", "128k", "--tp", "8"]])
def test_narrow_tables_never_split_ids(capsys, monkeypatch, columns, args):
    """Pipes and CI logs are 80 columns: evidence ids, rule ids and names must stay whole to be searchable."""
    import re

    monkeypatch.setenv("COLUMNS", columns)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    rec = Recommendation.model_validate_json(run_cli(capsys, "recommend", *args, "--format", "json")[1])
    code, out, _ = run_cli(capsys, "explain", *args)
    assert code == 0
    lines = out.splitlines()
    cited = re.findall(r"`[\w.+-]+`", " ".join(e.basis for e in vars(rec.estimates).values() if hasattr(e, "basis")))
    assert cited, "no evidence id in the estimates to check"
    for word in cited + [o.name for o in rec.trace.rules] + [o.id for o in rec.trace.rules]:
        assert any(word in line for line in lines), f"`{word}` is split or cut at {columns} columns"
    assert "…" not in out
