"""Writing YAML back: comments, key order, quoting and indentation survive; writes are all-or-nothing."""

from __future__ import annotations

import pytest

from kvpolicy.errors import PolicyError
from kvpolicy.inputs.yamlio import load_roundtrip, update_yaml_file, write_text_atomic

TEAM = """\
# yaml-language-server: $schema=schemas/policy.schema.json
# Our team's policy.
version: 1
name: team   # shown in outputs
extends: builtin:default

thresholds:
  accuracy_floor:
    value: 0.95          # product's floor
  break_even_tokens:
    values: {hopper: 8192, blackwell: 4000}

rules:
  - id: TEAM101
    name: long-context-fp8
    statement: "Quoted: kept as written."
    when: {fact: workload.context_tokens, op: ge, value: 65536}
    then: {kv_cache_dtype: fp8}
    evidence: [fp8-capacity]
"""


def test_update_keeps_comments_order_and_formatting(tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text(TEAM)

    def bump(data):
        data["thresholds"]["accuracy_floor"]["value"] = 0.96
        data["rules"][0]["evidence"].append("fp8-load-throughput-h100")

    update_yaml_file(path, bump)
    expected = (TEAM.replace("value: 0.95          # product's floor", "value: 0.96          # product's floor")
                .replace("evidence: [fp8-capacity]", "evidence: [fp8-capacity, fp8-load-throughput-h100]"))
    assert path.read_text() == expected


def test_update_with_four_space_indents_and_unindented_lists(tmp_path):
    text = "a:\n    b: 1  # keep\nitems:\n- x\n- y\n"
    path = tmp_path / "x.yaml"
    path.write_text(text)
    update_yaml_file(path, lambda d: d["items"].append("z"))
    assert path.read_text() == "a:\n    b: 1  # keep\nitems:\n- x\n- y\n- z\n"


def test_update_creates_a_missing_file(tmp_path):
    path = tmp_path / "new.yaml"
    update_yaml_file(path, lambda d: d.update({"name": "x"}))
    assert path.read_text() == "name: x\n"


def test_a_failing_change_leaves_the_file_untouched(tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text(TEAM)

    def boom(data):
        data["name"] = "half-written"
        raise RuntimeError("change failed")

    with pytest.raises(RuntimeError):
        update_yaml_file(path, boom)
    assert path.read_text() == TEAM
    assert [p.name for p in tmp_path.iterdir()] == ["team.yaml"]  # no temp file left behind


def test_malformed_file_is_not_rewritten(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("a: [1, 2\n")
    with pytest.raises(PolicyError, match="malformed YAML"):
        update_yaml_file(path, lambda d: None)
    assert path.read_text() == "a: [1, 2\n"


def test_atomic_write_keeps_mode_and_reports_bad_folders(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text("a: 1\n")
    path.chmod(0o640)
    write_text_atomic(path, "a: 2\n")
    assert path.read_text() == "a: 2\n"
    assert path.stat().st_mode & 0o777 == 0o640
    from kvpolicy.errors import InputError

    with pytest.raises(InputError, match="cannot write"):
        write_text_atomic(tmp_path / "missing-folder" / "f.yaml", "x")


def test_roundtrip_load_gives_positions():
    data = load_roundtrip(TEAM, "team.yaml")
    assert data.lc.key("rules") == (12, 0)
