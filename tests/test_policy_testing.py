"""`kvpolicy test`: the built-in policy's own cases, outcomes, filters, formats and coverage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpolicy.cli import main
from kvpolicy.policy.testing import Case, Expect, Fixture, PolicyTestFile, run_file
from kvpolicy.rules.validate import load_policy

ROOT = Path(__file__).resolve().parent.parent
POLICY = "version: 1\nname: team\nextends: builtin:default\n"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_builtin_policy_tests_pass_and_cover_every_rule():
    result = run_file(ROOT / "kvpolicy" / "rules" / "default_test.yaml")
    assert result.error is None
    failed = [(c.name, c.status, c.message, c.mismatches) for c in result.cases if c.status != "PASS"]
    assert not failed
    fired = {x for c in result.cases for x in c.fired}
    assert set(result.rules) <= fired
    # Convention 8: each rule has a case where it decides and one where it does not.
    rules = [r.id for r in load_policy().policy.rules]
    names = [c.name for c in result.cases]
    for rid in rules:
        assert any(n.startswith(f"{rid.lower()}-decides-") for n in names), rid
        assert any(n.startswith(f"{rid.lower()}-quiet-") for n in names), rid


def test_kvpolicy_test_policies_folder_passes(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err = run_cli(capsys, "test", "kvpolicy/rules/", "--fail-on-empty")
    assert code == 0, out + err
    assert "0 failed, 0 errors" in out
    assert "coverage: kvpolicy/rules/default.yaml: all 41 rules and pins it defines fired" in out


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("team.yaml").write_text(POLICY + """
pins:
  - name: kimi-per-head
    when: {fact: model.family, op: eq, value: kimi}
    set: {scale_source: checkpoint_per_head}
constraints: {forbid: {kv_cache_dtype: ['turboquant_*']}, min_accuracy_floor: 0.9}
deployments:
  - {name: chat, model: llama-3.1-8b, gpu: h100, context: 32k}
""")
    return tmp_path


CASES = """
fixtures:
  h100: {model: llama-3.1-8b, gpu: h100}
cases:
  - name: passes
    deployment: chat
    expect: {kv_cache_dtype: fp8, decided_by: {kv_cache_dtype: KV107}, not_decided_by: KV106}
  - name: fails
    fixture: h100
    context: 4k
    expect: {kv_cache_dtype: fp8, decided_by: KV107}
  - name: errors
    model: lama
    gpu: h100
    expect: {kv_cache_dtype: fp8}
  - name: todo_skipped
    expect: {}
  - name: pin-decides
    model: kimi-k2.5
    gpu: h200
    tp: 8
    expect: {scale_source: checkpoint_per_head, decided_by: {scale_source: "pin:kimi-per-head"}}
  - name: expected-error
    deployment: chat
    accuracy_floor: 0.5
    expect: {error: min_accuracy_floor}
  - name: facts-only
    facts: {gpu.generation: blackwell, gpu.fp8_compute: true, workload.context_tokens: 100000,
            latency.fp8_best_break_even_tokens: 4000}
    expect: {kv_cache_dtype: fp8, attention_backend: FLASHINFER}
"""


def test_outcomes_pass_fail_error_skipped(repo):
    Path("team_test.yaml").write_text(CASES)
    result = run_file(Path("team_test.yaml"))
    status = {c.name: c.status for c in result.cases}
    assert status == {"passes": "PASS", "fails": "FAIL", "errors": "ERROR", "todo_skipped": "SKIPPED",
                      "pin-decides": "PASS", "expected-error": "PASS", "facts-only": "PASS"}
    fails = next(c for c in result.cases if c.name == "fails")
    dtype = next(m for m in fails.mismatches if m["what"] == "kv_cache_dtype")
    assert (dtype["expected"], dtype["got"], dtype["decided_by"]) == ("fp8", "auto", "KV106")
    assert fails.line == 8
    assert "unknown model `lama`" in next(c for c in result.cases if c.name == "errors").message
    assert result.rules == ["pin:kimi-per-head"]


def test_cli_table_shows_expected_got_and_the_deciding_rule(repo, capsys):
    Path("team_test.yaml").write_text(CASES)
    code, out, _ = run_cli(capsys, "test")
    assert code == 1
    assert "FAIL    fails  (line 8)" in out
    assert "kv_cache_dtype: expected fp8, got auto (decided by KV106: workload.context_tokens (4096) <" in out
    assert "trace: kv_cache_dtype=auto by KV106" in out
    assert "ERROR   errors" in out and "SKIPPED todo_skipped" in out
    assert "4 passed, 1 failed, 1 error, 1 skipped" in out
    assert "coverage: team.yaml: the one rule or pin it defines fired" in out


def test_run_filter_json_and_github(repo, capsys):
    Path("team_test.yaml").write_text(CASES)
    code, out, _ = run_cli(capsys, "test", "--run", "^pass", "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["summary"] == {"pass": 1, "fail": 0, "error": 0, "skipped": 0}
    assert data["files"][0]["cases"][0]["fields"]["kv_cache_dtype"]["decided_by"] == "KV107"
    code, out, _ = run_cli(capsys, "test", "--run", "fails", "--format", "github")
    assert code == 1
    assert out.startswith("::error file=team_test.yaml,line=8,title=kvpolicy test::FAIL fails: kv_cache_dtype")


def test_empty_runs(repo, capsys):
    assert run_cli(capsys, "test")[0] == 0  # nothing found is fine...
    code, out, _ = run_cli(capsys, "test", "--fail-on-empty")
    assert code == 1 and "no test cases ran" in out  # ...unless asked otherwise
    Path("team_test.yaml").write_text(CASES)
    assert run_cli(capsys, "test", "--run", "nothing-matches", "--fail-on-empty")[0] == 1
    code, _, err = run_cli(capsys, "test", "--run", "(")
    assert code == 2 and "not a valid regular expression" in err


def test_bad_test_files_are_input_errors(repo, capsys):
    Path("team_test.yaml").write_text("cases:\n  - name: x\n    expct: {}\n")
    code, out, _ = run_cli(capsys, "test")
    assert code == 2 and "team_test.yaml:3:5: cases.0.expct: unknown key `expct`. Did you mean `expect`" in out
    Path("team_test.yaml").write_text("cases: [\n")
    assert run_cli(capsys, "test")[0] == 2
    Path("team_test.yaml").unlink()
    Path("orphan_test.yaml").write_text("cases: []\n")
    code, out, _ = run_cli(capsys, "test")
    assert code == 2 and "no policy to test" in out


def test_typo_in_an_expected_rule_id_is_an_error_not_a_pass(repo):
    Path("team_test.yaml").write_text("cases:\n  - {name: x, deployment: chat, expect: {not_decided_by: [KV1O6]}}\n")
    case = run_file(Path("team_test.yaml")).cases[0]
    assert case.status == "ERROR" and "Did you mean" in case.message and "`KV106`" in case.message


def test_unknown_fixture_deployment_and_fact(repo):
    Path("team_test.yaml").write_text("""cases:
  - {name: a, fixture: nope, expect: {}}
  - {name: b, deployment: chta, expect: {}}
  - {name: c, model: llama-3.1-8b, gpu: h100, facts: {model.headdim: 3}, expect: {}}
  - {name: d, facts: {decision.kv_format: fp8}, expect: {}}
  - {name: e, model: llama-3.1-8b, expect: {}}
""")
    messages = {c.name: c.message for c in run_file(Path("team_test.yaml")).cases}
    assert "unknown fixture `nope`" in messages["a"]
    assert "no deployment `chta`" in messages["b"] and "Did you mean `chat`" in messages["b"]
    assert "Did you mean `model.head_dim`" in messages["c"]
    assert "set by the engine" in messages["d"]
    assert "give both `model` and `gpu`" in messages["e"]


def test_test_file_models_are_documented():
    from kvpolicy.outputs.fielddocs import field_docstrings

    for model in (PolicyTestFile, Case, Fixture, Expect):
        docs: dict[str, str] = {}
        for klass in reversed(model.__mro__):
            if klass.__module__.startswith("kvpolicy"):
                docs.update(field_docstrings(klass))
        assert not [n for n in model.model_fields if not docs.get(n)], model.__name__
