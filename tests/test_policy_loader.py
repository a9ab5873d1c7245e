"""Loading user policies: extends/merge semantics and every class of bad input (clear message, exit 2)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvpolicy.cli import main
from kvpolicy.errors import InputError, PolicyError
from kvpolicy.inputs.policy_schema import resolve_threshold
from kvpolicy.rules.validate import load_policy

HEADER = "version: 1\nname: team\nextends: builtin:default\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- merge semantics -------------------------------------------------------------------------


def test_new_rules_come_first_disable_and_order(tmp_path):
    path = write(tmp_path, "team.yaml", HEADER + """
rules:
  - id: TEAM101
    name: mine
    statement: s
    when: {fact: model.family, op: eq, value: llama}
    then: {kv_cache_dtype: fp8}
    evidence: [fp8-capacity]
disable: [KV106]
order: [KV504]
""")
    policy = load_policy(path).policy
    ids = [r.id for r in policy.rules]
    assert ids[:2] == ["KV504", "TEAM101"]
    assert ids.index("TEAM101") < ids.index("KV100")
    assert not next(r for r in policy.rules if r.id == "KV106").enabled


def test_threshold_overrides_merge_values_key_by_key(tmp_path):
    path = write(tmp_path, "team.yaml", HEADER + """
thresholds:
  break_even_tokens:
    values: {hopper: 9000}
  max_skip_window_tokens:
    value: 300
""")
    policy = load_policy(path).policy
    assert resolve_threshold(policy, "break_even_tokens", {"gpu.generation": "hopper"}) == 9000
    # The other generations keep the inherited values (not replaced by the child's partial map).
    assert resolve_threshold(policy, "break_even_tokens", {"gpu.generation": "blackwell"}) == 4000
    assert resolve_threshold(policy, "max_skip_window_tokens", {}) == 300
    assert policy.thresholds["max_skip_window_tokens"].min == 1  # bounds inherited


def test_a_plain_value_replaces_a_keyed_threshold(tmp_path):
    path = write(tmp_path, "team.yaml", HEADER + "thresholds:\n  break_even_tokens: {value: 12000}\n")
    policy = load_policy(path).policy
    assert policy.thresholds["break_even_tokens"].by is None
    assert resolve_threshold(policy, "break_even_tokens", {"gpu.generation": "blackwell"}) == 12000


def test_extends_a_relative_file_chain(tmp_path):
    (tmp_path / "base").mkdir()
    write(tmp_path / "base", "org.yaml", HEADER + "constraints: {forbid: {kv_cache_dtype: ['turboquant_*']}}\n")
    path = write(tmp_path, "team.yaml", "extends: base/org.yaml\nname: team\n"
                 "constraints: {min_accuracy_floor: 0.9}\n")
    loaded = load_policy(path)
    assert loaded.chain == [str(path), str(tmp_path / "base" / "org.yaml"), "builtin:default"]
    assert loaded.policy.constraints.forbid == {"kv_cache_dtype": ["turboquant_*"]}
    assert loaded.policy.constraints.min_accuracy_floor == 0.9


# -- bad input: one test per class, each through the CLI (exit 2, file:line:col, no traceback) --


BAD = {
    "malformed-yaml": ("rules:\n  - id: KV1\n   name: x\n", "bad.yaml:3:4: malformed YAML"),
    "wrong-type": (HEADER + "thresholds:\n  accuracy_floor:\n    value: high\n",
                   "bad.yaml:6:5: thresholds.accuracy_floor.value"),
    "unknown-key": (HEADER + "rules:\n  - id: TEAM101\n    name: x\n    statment: s\n",
                    "Did you mean `statement`"),
    "unknown-key-in-condition": (HEADER + "rules:\n  - id: TEAM101\n    name: x\n    statement: s\n"
                                 "    when: {fact: model.family, op: eq, valeu: llama}\n",
                                 "bad.yaml:8:40: rules.0.when.valeu: unknown key `valeu`. Did you mean `value`?"),
    "missing-extends": ("extends: nope.yaml\n", "bad.yaml:1:1: `extends: nope.yaml`: no such file"),
    "unknown-builtin": ("extends: builtin:defualt\n", "no such built-in policy. Available: builtin:default"),
    "unknown-fact": (HEADER + "rules:\n  - id: TEAM101\n    name: x\n    statement: s\n"
                     "    when: {fact: model.headdim, op: ge, value: 256}\n    then: {kv_cache_dtype: auto}\n",
                     "bad.yaml:8:12: rule TEAM101: unknown fact `model.headdim`. Did you mean `model.head_dim`"),
    "unknown-fact-in-a-warning": (HEADER + "rules:\n  - id: TEAM101\n    name: x\n    statement: s\n"
                                  "    warn: ['{workload.concurency|request} at once']\n",
                                  "rule TEAM101: `warn:` names unknown fact `{workload.concurency}` (it would print "
                                  "as None). Did you mean `workload.concurrency`"),
    "unknown-threshold": (HEADER + "rules:\n  - id: TEAM101\n    name: x\n    statement: s\n"
                          "    when: {fact: model.head_dim, op: ge, value: {threshold: prefill_head_dim}}\n"
                          "    then: {kv_cache_dtype: auto}\n", "Did you mean `prefill_head_dim_min`"),
    "unknown-dtype": (HEADER + "rules:\n  - id: TEAM101\n    name: x\n    statement: s\n"
                      "    then: {kv_cache_dtype: fp9}\n", "unknown kv_cache_dtype `fp9`. Did you mean `fp8`"),
    "unknown-disabled-rule": (HEADER + "disable: [KV1006]\n", "bad.yaml:4:11: disable: unknown rule id `KV1006`"),
    "op-needs-a-list": (HEADER + "rules:\n  - id: TEAM101\n    name: x\n    statement: s\n"
                        "    when: {fact: gpu.generation, op: in, value: hopper}\n", "`op: in` needs a list value"),
    "not-a-mapping": ("- just\n- a list\n", "bad.yaml:1:1: a policy file must be a YAML mapping"),
    "duplicate-rule-id": (HEADER + "rules:\n" + "  - {id: TEAM101, name: a, statement: s}\n" * 2,
                          "id `TEAM101` appears twice"),
    "keyed-threshold-with-value": ("thresholds:\n  t: {by: gpu.generation, values: {hopper: 1}, value: 2}\n",
                                   "ignores `value`"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_policy_is_a_clear_exit_2(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text, expected = BAD[case]
    write(tmp_path, "bad.yaml", text)
    for argv in (["recommend", "-m", "llama-3.1-8b", "-g", "h100", "-p", "bad.yaml"], ["check", "bad.yaml"],
                 ["lint", "bad.yaml"]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 2, (argv, out, err)
        m = re.match(r"^(bad\.yaml:\d+:\d+): (.*)$", expected)
        at, message = (m.group(1), m.group(2)) if m else ("", expected)
        assert message in out + err, (argv, out + err)
        assert at in out + err, (argv, out + err)
        assert "Traceback" not in out + err


def test_circular_extends_points_at_the_line_that_closes_the_loop(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, "a.yaml", "name: a\nextends: b.yaml\n")
    write(tmp_path, "b.yaml", "name: b\nextends: a.yaml\n")
    with pytest.raises(PolicyError) as exc:
        load_policy("a.yaml")
    assert "b.yaml:2:1: circular `extends`: a.yaml -> b.yaml -> a.yaml" in str(exc.value)
    code, out, _ = run_cli(capsys, "lint", "a.yaml", "--format", "github")
    assert code == 2
    assert "::error file=b.yaml,line=2,col=1,title=KVL004 bad-extends::circular" in out


def test_unreadable_files(tmp_path):
    with pytest.raises(InputError, match="file not found"):
        load_policy(tmp_path / "missing.yaml")
    with pytest.raises(InputError, match="is a folder"):
        load_policy(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes(b"name: caf\xe9\n")
    with pytest.raises(InputError, match=r"latin1.yaml:1: byte 9 is not UTF-8"):
        load_policy(tmp_path / "latin1.yaml")


@pytest.mark.skipif(os.geteuid() == 0 if hasattr(os, "geteuid") else True, reason="root reads anything")
def test_permission_denied_is_an_input_error(tmp_path):
    path = write(tmp_path, "locked.yaml", HEADER)
    path.chmod(0)
    with pytest.raises(InputError, match="cannot be read"):
        load_policy(path)


def test_validation_errors_name_the_intended_condition_form(tmp_path):
    # Without the discriminator every form (all/any/not/compare) reported its own error.
    path = write(tmp_path, "team.yaml", HEADER + "rules:\n  - id: TEAM101\n    name: x\n    statement: s\n"
                 "    when: {fact: model.family, op: eq, value: llama, extra: 1}\n")
    with pytest.raises(PolicyError) as exc:
        load_policy(path)
    lines = str(exc.value).splitlines()
    assert len(lines) == 1 and "unknown key `extra`" in lines[0]
    assert exc.value.problems[0].line == 8  # type: ignore[attr-defined]
