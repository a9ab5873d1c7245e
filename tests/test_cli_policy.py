"""`kvpolicy init`, `check`, `explain --deployment`, the committed schemas, CI outputs and start-up imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from kvpolicy.cli import main
from kvpolicy.commands.policy_output import annotation

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "triton", "vllm", "starlette", "uvicorn", "numpy", "transformers")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- init ------------------------------------------------------------------------------------


def test_init_lint_test_check_in_an_empty_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_cli(capsys, "init")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [".kvpolicy", "kvpolicy.yaml", "kvpolicy_test.yaml"]
    policy = Path("kvpolicy.yaml").read_text()
    assert policy.startswith("# yaml-language-server: $schema=.kvpolicy/policy.schema.json\n")
    assert Path("kvpolicy_test.yaml").read_text().startswith(
        "# yaml-language-server: $schema=.kvpolicy/policy-test.schema.json\n")
    assert f"name: {tmp_path.name.lower()}" in policy or "name: " in policy
    schema = json.loads(Path(".kvpolicy/policy.schema.json").read_text())
    assert schema["title"] == "kvpolicy policy file"
    for argv in (["lint"], ["test", "--fail-on-empty"], ["check"], ["explain", "--deployment", "chat"]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, (argv, out, err)


def test_init_never_overwrites_without_force(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("kvpolicy.yaml").write_text("# mine\n")
    code, _, err = run_cli(capsys, "init")
    assert code == 2 and "already exists" in err and "--force" in err
    assert Path("kvpolicy.yaml").read_text() == "# mine\n"
    assert not Path("kvpolicy_test.yaml").exists()  # nothing half-done
    assert run_cli(capsys, "init", "--force", "--name", "platform")[0] == 0
    assert "name: platform\n" in Path("kvpolicy.yaml").read_text()


def test_init_uses_the_repository_schemas_or_a_given_reference(tmp_path, capsys, monkeypatch):
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "policy.schema.json").write_text("{}")
    (tmp_path / "schemas" / "policy-test.schema.json").write_text("{}")
    (tmp_path / "deploy").mkdir()
    monkeypatch.chdir(tmp_path / "deploy")
    assert run_cli(capsys, "init")[0] == 0
    assert Path("kvpolicy.yaml").read_text().startswith("# yaml-language-server: $schema=../schemas/policy.schema.json")
    assert not Path(".kvpolicy").exists()
    url = "https://example.com/kvpolicy/v1/policy.schema.json"
    assert run_cli(capsys, "init", "--force", "--schema-ref", url)[0] == 0
    assert Path("kvpolicy_test.yaml").read_text().startswith(
        "# yaml-language-server: $schema=https://example.com/kvpolicy/v1/policy-test.schema.json")


def test_init_into_a_missing_folder_is_an_input_error(tmp_path, capsys):
    code, _, err = run_cli(capsys, "init", "--dir", str(tmp_path / "nope"))
    assert code == 2 and "no such folder" in err


# -- check -----------------------------------------------------------------------------------


TEAM = ROOT / "policies" / "examples" / "team" / "kvpolicy.yaml"


def test_check_the_team_example(capsys):
    code, out, _ = run_cli(capsys, "check", str(TEAM))
    assert code == 0
    assert "ok    batch-summarize" in out and "kv_cache_dtype fp8 (INF101)" in out
    assert "5 deployments checked against inference-platform@" in out
    code, out, _ = run_cli(capsys, "check", str(TEAM), "-d", "agent-kimi", "--format", "json")
    data = json.loads(out)
    assert code == 0 and [d["name"] for d in data["results"]] == ["agent-kimi"]
    assert data["results"][0]["report"]["decided_by"]["scale_source"] == "pin:kimi-k2.5-calibrated-scales"


def test_check_json_is_the_services_check_response(capsys):
    """One shape, one schema: `check --format json` and `POST /v1/check` answer the same document."""
    from kvpolicy.service.api import CheckResponse

    code, out, _ = run_cli(capsys, "check", str(TEAM), "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["ok"] is True and data["source"] == "policy" and data["num_deployments"] == 5
    assert CheckResponse.model_validate_json(out).results[0].report["line"] is not None
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "schemas" / "serve-check-response.schema.json").read_text())
    jsonschema.validate(data, schema)


BELOW_FLOOR = """extends: builtin:default
deployments:
  - {name: long, model: qwen3-30b-a3b-instruct-2507, gpu: b200, context: 256k}
"""


def test_check_fails_when_uncalibrated_accuracy_is_below_the_floor(tmp_path, capsys, monkeypatch):
    """At 256k on B200 FP8 is expected at 94% < 95% uncalibrated; the decision wants per-tensor scales that a hub
    model does not visibly carry, so check fails, as README says, and its summary says why."""
    monkeypatch.chdir(tmp_path)
    Path("kvpolicy.yaml").write_text(BELOW_FLOOR)
    code, out, _ = run_cli(capsys, "check")
    assert code == 1 and "FAIL  long" in out and "below the floor 95%" in out
    assert "kvpolicy calibrate -d long" in out
    assert out.rstrip().endswith("0 ok, 1 with violations")


def test_check_summary_agrees_with_strict(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("kvpolicy.yaml").write_text("extends: builtin:default\ndeployments:\n"
                                     "  - {name: warned, model: llama-3.1-8b, gpu: a100, context: 128k, concurrency: 4}\n")
    code, out, _ = run_cli(capsys, "check")
    assert code == 0, out
    assert "warning:" in out and out.rstrip().endswith("1 ok, 1 with warnings, 0 with violations")
    code, out, _ = run_cli(capsys, "check", "--strict")
    assert code == 1 and out.rstrip().endswith("0 ok, 1 with warnings (failing: --strict), 0 with violations")
    code, out, _ = run_cli(capsys, "check", "--strict", "--format", "json")
    assert code == 1 and json.loads(out)["ok"] is False


def test_check_violations_and_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("kvpolicy.yaml").write_text("""extends: builtin:default
deployments:
  - {name: fits, model: llama-3.1-8b, gpu: h100}
  - {name: too-many, model: llama-3.1-8b, gpu: h100, context: 128k, concurrency: 64}
""")
    code, out, _ = run_cli(capsys, "check")
    assert code == 1 and "FAIL  too-many  (kvpolicy.yaml:4:5)" in out and "the deployment needs 64" in out
    code, out, _ = run_cli(capsys, "check", "--format", "github")
    assert code == 1
    assert out.startswith("::error file=kvpolicy.yaml,line=4,col=5,title=kvpolicy check::deployment too-many: fp8 holds")
    Path("kvpolicy.yaml").write_text("extends: builtin:default\ndeployments:\n  - {name: x, model: lama, gpu: h100}\n")
    code, out, _ = run_cli(capsys, "check")
    assert code == 2 and "kvpolicy.yaml:3:5: deployment `x`: model: unknown model `lama`" in out
    code, _, err = run_cli(capsys, "check", "-d", "y")
    assert code == 2 and "no deployment `y`" in err
    Path("kvpolicy.yaml").write_text("extends: builtin:default\n")
    assert run_cli(capsys, "check")[0] == 0
    assert run_cli(capsys, "check", "--fail-on-empty")[0] == 1
    Path("kvpolicy.yaml").unlink()
    code, _, err = run_cli(capsys, "check")
    assert code == 2 and "kvpolicy init" in err


def test_a_deployment_gpu_with_a_count_is_its_tp(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("kvpolicy.yaml").write_text("""extends: builtin:default
deployments:
  - {name: pair, model: llama-3.3-70b, gpu: 2x H100}
  - {name: clash, model: llama-3.3-70b, gpu: 2xh100, tp: 4}
""")
    Path("kvpolicy_test.yaml").write_text("""cases:
  - {name: pair, deployment: pair, expect: {kv_cache_dtype: fp8}}
  - {name: eight, model: llama-3.3-70b, gpu: h100x8, expect: {kv_cache_dtype: fp8}}
  - {name: clash, model: llama-3.3-70b, gpu: h100x8, tp: 2, expect: {kv_cache_dtype: fp8}}
""")
    code, out, _ = run_cli(capsys, "check")
    assert code == 2 and "ok    pair" in out and "--tensor-parallel-size 2 " in out
    assert "llama-3.3-70b on 2 x h100-sxm: kv_cache_dtype" in out  # the count the serve line gives vLLM
    assert "kvpolicy.yaml:4:5: deployment `clash`: gpu `2xh100` names 2 GPUs but tp is 4" in out
    code, out, _ = run_cli(capsys, "check", "-d", "pair", "-f", "json")
    assert code == 0 and json.loads(out)["results"][0]["report"]["tp"] == 2
    code, out, _ = run_cli(capsys, "explain", "-d", "pair", "-f", "json")
    assert code == 0 and json.loads(out)["workload"]["tp"] == 2
    code, out, _ = run_cli(capsys, "test", "kvpolicy_test.yaml")
    assert "PASS    2 cases" in out and "gpu `h100x8` names 8 GPUs but tp is 2" in out


def test_check_says_one_request_in_the_singular(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("kvpolicy.yaml").write_text("""extends: builtin:default
deployments:
  - {name: one, model: llama-3.3-70b, gpu: h100, tp: 2, context: 64k, concurrency: 2}
""")
    code, out, _ = run_cli(capsys, "check")
    assert code == 1 and "capacity: 1 request fits (2 needed)" in out
    assert "violation: fp8 holds 1 request of 65,536 tokens" in out


def test_explain_a_deployment(capsys):
    code, out, _ = run_cli(capsys, "explain", "--policy", str(TEAM), "-d", "rag-gpt-oss", "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["decision"]["skip_layers"] == ["sliding_window"]
    assert data["workload"]["context_tokens"] == 65536 and data["policy"].startswith("inference-platform@")
    code, _, err = run_cli(capsys, "explain", "-p", str(TEAM), "-d", "rag", "-m", "llama-3.1-8b")
    assert code == 2 and "drop --model/--gpu" in err
    code, _, err = run_cli(capsys, "explain", "-p", str(TEAM), "-d", "rag")
    assert code == 2 and "Did you mean `rag-gpt-oss`" in err


# -- CI plumbing -----------------------------------------------------------------------------


def test_github_annotations_escape_their_payload():
    line = annotation("error", "50%\nnext, line", "a,b:c.yaml", 3, 4, "KVL101 x")
    assert line == "::error file=a%2Cb%3Ac.yaml,line=3,col=4,title=KVL101 x::50%25%0Anext, line"
    assert annotation("warning", "m", "builtin:default", 3) == "::warning::m"


def test_pre_commit_hooks_are_declared():
    hooks = YAML(typ="safe").load((ROOT / ".pre-commit-hooks.yaml").read_text())
    by_id = {h["id"]: h for h in hooks}
    assert by_id["kvpolicy-lint"]["entry"] == "kvpolicy lint"
    assert by_id["kvpolicy-test"]["entry"].startswith("kvpolicy test")
    assert all(h["language"] == "python" and "name" in h for h in hooks)


def test_committed_schemas_are_fresh(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err = run_cli(capsys, "schema", "--check")
    assert code == 0, f"stale schemas/: run `kvpolicy schema` and commit ({err})"


@pytest.mark.parametrize("path,schema", [
    ("kvpolicy/rules/default.yaml", "policy"), ("policies/examples/team/kvpolicy.yaml", "policy"),
    ("kvpolicy/policy/examples/starter/kvpolicy.yaml", "policy"), ("kvpolicy/rules/default_test.yaml", "policy-test"),
    ("policies/examples/team/kvpolicy_test.yaml", "policy-test"),
    ("kvpolicy/policy/examples/starter/kvpolicy_test.yaml", "policy-test")])
def test_shipped_yaml_validates_against_the_published_schema(path, schema):
    jsonschema = pytest.importorskip("jsonschema")
    published = json.loads((ROOT / "schemas" / f"{schema}.schema.json").read_text())
    data = YAML(typ="safe").load((ROOT / path).read_text())
    jsonschema.Draft202012Validator(published).validate(data)
    first = (ROOT / path).read_text().splitlines()[0]
    assert first.startswith("# yaml-language-server: $schema=") and first.endswith(f"/{schema}.schema.json")


@pytest.mark.parametrize("argv", [["lint", "kvpolicy/rules/"], ["test", "policies/"],
                                  ["explain", "-m", "gpt-oss-20b", "-g", "h100", "-f", "json"],
                                  ["check", "policies/examples/team/kvpolicy.yaml"]])
def test_policy_commands_do_not_load_heavy_modules(argv):
    code = (f"import sys; from kvpolicy.cli import main; rc = main({argv!r}); "
            f"heavy = [m for m in {HEAVY!r} if m in sys.modules]; "
            "sys.stderr.write(repr(heavy)); sys.exit(rc if not heavy else 99)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_readme_policy_example_lints_and_its_tests_pass(tmp_path, capsys, monkeypatch):
    import re

    readme = (ROOT / "README.md").read_text()
    section = readme.split("<!-- section:policy-as-code -->")[1].split("<!-- /section:policy-as-code -->")[0]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    monkeypatch.chdir(tmp_path)
    Path("kvpolicy.yaml").write_text(blocks[0])
    Path("kvpolicy_test.yaml").write_text(blocks[1])
    for argv in (["lint"], ["test", "--fail-on-empty"], ["check"]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 0, (argv, out, err)


def test_every_option_of_every_command_says_what_it_does():
    from kvpolicy.cli import COMMANDS, build_parser

    empty = []
    for name in COMMANDS:
        parser, _ = build_parser(name)
        empty += [f"{name} {'/'.join(a.option_strings) or a.dest}" for a in parser._actions if not (a.help or "").strip()]
    assert not empty, f"options without help text: {empty}"


def test_no_policy_found_message_reads_well(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "lint")
    assert code == 2 and "found under `.`. Pass a file" in err and ".." not in err
