"""`kvpolicy lint`: each check fires on a minimal policy, and the shipped policies are clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpolicy.cli import main
from kvpolicy.policy.lint import lint_path
from kvpolicy.policy.lint_checks import BY_CODE, CHECKS

ROOT = Path(__file__).resolve().parent.parent
HEADER = "version: 1\nname: team\nextends: builtin:default\n"


def rule(rid: str, when: str | None, then: str, evidence: str = "[fp8-capacity]", extra: str = "") -> str:
    text = f"  - id: {rid}\n    name: r-{rid.lower()}\n    statement: s\n"
    if when:
        text += f"    when: {when}\n"
    text += f"    then: {then}\n    evidence: {evidence}\n" + extra
    return text


CASES = {
    "KVL101": HEADER + "rules:\n" + rule("TEAM101", "{fact: gpu.generation, op: eq, value: hoper}",
                                         "{kv_cache_dtype: fp8}"),
    "KVL102": HEADER + "rules:\n" + rule("TEAM101", "{fact: model.family, op: eq, value: llama}",
                                         "{attention_backend: TRITON_ATTN}")
    + rule("TEAM102", "{all: [{fact: model.family, op: eq, value: llama}, {fact: workload.tp, op: gt, value: 1}]}",
           "{attention_backend: FLASHINFER}"),
    "KVL103": HEADER + "rules:\n" + rule("TEAM101", "{fact: model.family, op: in, value: [qwen3]}",
                                         "{attention_backend: FLASHINFER}")
    + rule("TEAM102", "{fact: model.family, op: eq, value: qwen3}", "{attention_backend: TRITON_ATTN}"),
    "KVL104": HEADER + "rules:\n" + rule("TEAM101", "{fact: model.family, op: eq, value: llama}",
                                         "{attention_backend: FLASHINFER}", evidence="[]"),
    "KVL105": HEADER + "rules:\n" + rule("TEAM101", "{fact: model.family, op: eq, value: llama}",
                                         "{attention_backend: FLASHINFER}", evidence="[fp8-capcity]"),
    "KVL106": HEADER + "rules:\n  - {id: TEAM101, name: nothing, statement: s, evidence: [fp8-capacity]}\n",
    "KVL107": HEADER + "rules:\n" + rule("TEAM101", "{fact: model.family, op: eq, value: llama}",
                                         "{kv_cache_dtype: turboquant_4bit_nc}")
    + "constraints: {forbid: {kv_cache_dtype: ['turboquant_*']}}\n",
    "KVL108": HEADER + "rules:\n" + rule("TEAM101", "{fact: decision.attention_backend, op: eq, value: FLASH_ATTN}",
                                         "{scale_source: checkpoint_per_head}"),
    "KVL109": HEADER + "rules:\n" + rule(
        "TEAM101", "{all: [{fact: model.id, op: eq, value: deepseek-v3}, {fact: gpu.generation, op: eq, "
        "value: blackwell}]}", "{attention_backend: FLASHMLA}"),
    "KVL201": HEADER + "thresholds:\n  accuracy_floor: {value: 1.2}\n",
    "KVL202": HEADER + "thresholds:\n  brek_even: {value: 3}\n",
    "KVL203": HEADER + "thresholds:\n  accuracy_floor: {min: 0.1}\n",
    "KVL204": HEADER + "thresholds:\n  break_even_tokens:\n    values: {hopper: 2000}\n",
    "KVL301": HEADER + "pins:\n  - {name: a, when: {fact: model.id, op: eq, value: kimi-k2.5}, "
              "set: {scale_source: checkpoint_per_head}}\n"
              "  - {name: b, when: {fact: model.family, op: exists}, set: {scale_source: checkpoint_per_tensor}}\n",
    "KVL303": HEADER + "pins:\n  - {name: a, when: {fact: model.id, op: eq, value: kimi-k2.5}, "
              "set: {scale_source: checkpoint_per_head}}\n",
    "KVL302": HEADER + "constraints: {forbid: {kv_cache_dtype: ['turboquant-*']}}\n",
    "KVL401": HEADER + "deployments:\n  - {name: chat, model: lama-3.1-8b, gpu: h100}\n",
    "KVL402": HEADER + "constraints: {min_accuracy_floor: 0.95}\n"
              "deployments:\n  - {name: chat, model: llama-3.1-8b, gpu: h100, accuracy_floor: 0.9}\n",
}


def test_every_check_has_a_case_and_codes_are_unique():
    assert len(BY_CODE) == len(CHECKS)
    semantic = {c.code for c in CHECKS if c.code >= "KVL100"}
    assert semantic == set(CASES)
    for c in CHECKS:
        assert c.severity in ("error", "warning", "info") and c.name == c.name.lower() and c.summary.endswith(".")


@pytest.mark.parametrize("code", sorted(CASES))
def test_check_fires_with_a_position(code, tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text(CASES[code])
    findings = lint_path(path)
    hits = [f for f in findings if f.code == code]
    assert hits, [str(vars(f)) for f in findings]
    assert hits[0].file == str(path) and hits[0].line is not None
    # Only the expected problem: a minimal policy shows no unrelated findings.
    assert {f.code for f in findings} == {code}, [vars(f) for f in findings]


def test_messages_suggest_the_fix(tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text(CASES["KVL101"])
    assert "Did you mean `hopper`" in lint_path(path)[0].message
    path.write_text(CASES["KVL302"])
    assert "Did you mean `turboquant_" in lint_path(path)[0].message
    path.write_text(CASES["KVL202"])
    assert "Did you mean `break_even_tokens`" in lint_path(path)[0].message


def test_inherited_rules_hidden_by_a_new_rule_are_reported_once_at_the_new_rule(tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text(HEADER + "rules:\n" + rule("TEAM101", None, "{kv_cache_dtype: fp8}"))
    # FP8 everywhere also meets GPUs where vLLM has no FP8 backend for the model (KVL109).
    findings = [f for f in lint_path(path) if f.code != "KVL109"]
    assert [f.code for f in findings] == ["KVL102"]
    assert findings[0].line == 5 and "KV106" in findings[0].message and "KV107" in findings[0].message


@pytest.mark.parametrize("policy", ["kvpolicy/rules/default.yaml", "policies/examples/team/kvpolicy.yaml",
                                    "kvpolicy/policy/examples/starter/kvpolicy.yaml"])
def test_shipped_policies_are_clean(policy):
    assert [f for f in lint_path(ROOT / policy) if f.severity != "info"] == []


def test_break_even_change_names_the_models_it_cannot_move(tmp_path, capsys):
    """Lowering break_even_tokens on Hopper leaves llama-3.1-8b and gpt-oss-20b on H100 where they were."""
    path = tmp_path / "team.yaml"
    path.write_text(CASES["KVL204"])
    (note,) = lint_path(path)
    assert note.severity == "info" and note.line == 5
    assert "llama-3.1-8b on h100-sxm (`fp8-itl-llama-3.1-8b-h100`)" in note.message
    assert "gpt-oss-20b on h100-sxm" in note.message and "b200" not in note.message
    code, out, _ = run_cli(capsys, "lint", str(path), "--strict")
    assert code == 0 and "1 note" in out  # a note informs; it never fails CI
    code, out, _ = run_cli(capsys, "lint", str(path), "--format", "github")
    assert out.startswith("::notice file=")
    path.write_text(HEADER + "thresholds:\n  break_even_tokens:\n    values: {ada: 2000}\n")
    assert lint_path(path) == []  # no measured line on an Ada GPU


def test_test_files_are_validated(tmp_path):
    path = tmp_path / "team_test.yaml"
    path.write_text("cases:\n  - name: x\n    expct: {}\n")
    codes = {f.code for f in lint_path(path)}
    assert codes == {"KVL002", "KVL003"}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_exit_codes_and_formats(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("warn.yaml").write_text(CASES["KVL104"])
    Path("err.yaml").write_text(CASES["KVL101"])
    code, out, _ = run_cli(capsys, "lint", "warn.yaml")
    assert code == 0 and "warn.yaml:5:5: KVL104 [warning]" in out
    assert run_cli(capsys, "lint", "warn.yaml", "--strict")[0] == 1
    assert run_cli(capsys, "lint", "err.yaml", "--ignore", "KVL101")[0] == 0
    code, out, _ = run_cli(capsys, "lint", "err.yaml", "--format", "github")
    assert code == 1
    assert out.startswith("::error file=err.yaml,line=8,col=5,title=KVL101 unreachable-rule::rule TEAM101 can never")
    code, out, _ = run_cli(capsys, "lint", "--format", "json")  # discovers both files in the folder
    data = json.loads(out)
    assert code == 1 and data["files"] == 2 and data["errors"] == 1 and data["warnings"] == 1
    assert {f["code"] for f in data["findings"]} == {"KVL101", "KVL104"}


def test_cli_usage_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "lint")
    assert code == 2 and "no policy files found" in err and "kvpolicy init" in err
    code, _, err = run_cli(capsys, "lint", "--ignore", "KVL999")
    assert code == 2 and "--list-checks" in err
    code, _, err = run_cli(capsys, "lint", "nope/")
    assert code == 2 and "no such file or folder" in err


def test_discovery_skips_yaml_that_is_not_a_policy(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "k8s.yaml").write_text("apiVersion: rbac/v1\nkind: Role\nrules: []\n")
    (tmp_path / ".github").mkdir()
    (tmp_path / ".github" / "ci.yaml").write_text("rules: [broken\n")
    (tmp_path / "kvpolicy.yaml").write_text(HEADER)
    code, out, _ = run_cli(capsys, "lint")
    assert code == 0 and "1 file linted" in out


def test_list_checks(capsys):
    code, out, _ = run_cli(capsys, "lint", "--list-checks")
    assert code == 0 and "KVL102  shadowed-rule" in out
    code, out, _ = run_cli(capsys, "lint", "--list-checks", "--format", "json")
    assert len(json.loads(out)) == len(CHECKS)


@pytest.mark.parametrize(("text", "opener"), [
    ("disable: [KV106\n\n\n\n", "`[`"),
    ("disable: [KV106,\nrules: []\nthresholds: {}\n", "`[`"),
    ("thresholds: {accuracy_floor: {value: 0.9}\n\ndeployments: []\n", "`{`"),
])
def test_unclosed_bracket_is_reported_where_it_opened(tmp_path, text, opener):
    path = tmp_path / "team.yaml"
    path.write_text(HEADER + text)
    (finding,) = lint_path(path)
    assert finding.code == "KVL001" and finding.line == 4, vars(finding)
    assert f"the {opener} opened here is not closed" in finding.message


def test_servability_names_the_refusal_and_the_case(tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text(CASES["KVL109"])
    (hit,) = [f for f in lint_path(path) if f.code == "KVL109"]
    assert "deepseek-v3 on b200" in hit.message and "FlashMLA Dense is only supported on Hopper" in hit.message
    path.write_text(CASES["KVL303"])
    (hit,) = [f for f in lint_path(path) if f.code == "KVL303"]
    assert "pin `a`" in hit.message and "per-head KV scales" in hit.message and hit.severity == "error"
