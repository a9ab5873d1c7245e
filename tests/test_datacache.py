"""The cache of parsed built-in YAML: used only for the exact text it was made from, never for foreign files."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvpolicy.inputs.datacache import PACKAGE_DIR, builtin_data
from kvpolicy.rules.validate import load_policy

BUILTIN = PACKAGE_DIR / "rules" / "default.yaml"


class Parser:
    """Counts calls, so a test sees whether the cache answered."""

    def __init__(self, result: Any) -> None:
        self.result = result
        self.calls = 0

    def __call__(self, text: str) -> Any:
        self.calls += 1
        return self.result


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("KVPOLICY_CACHE_DIR", str(folder))
    return folder


def test_second_read_comes_from_the_cache_and_an_edit_parses_again(cache: Path) -> None:
    first = Parser({"a": [1, 2.5, None, True, "x"]})
    assert builtin_data(BUILTIN, "a: 1", first) == {"a": [1, 2.5, None, True, "x"]}
    again = Parser({"a": "stale parser result"})
    assert builtin_data(BUILTIN, "a: 1", again) == {"a": [1, 2.5, None, True, "x"]}
    assert again.calls == 0
    edited = Parser({"a": 2})
    assert builtin_data(BUILTIN, "a: 2", edited) == {"a": 2}
    assert edited.calls == 1
    assert len(list(cache.iterdir())) == 1  # the edit replaced the entry


def test_files_outside_the_package_are_never_cached(cache: Path, tmp_path: Path) -> None:
    parse = Parser({"a": 1})
    for _ in range(2):
        builtin_data(tmp_path / "models.yaml", "a: 1", parse)
    assert parse.calls == 2
    assert not cache.exists()


def test_data_json_would_change_is_not_cached(cache: Path) -> None:
    # YAML gives integer keys and dates; JSON would give them back as strings.
    for value in ({80: "sm80"}, {"when": datetime.date(2026, 1, 1)}, {"t": (1, 2)}):
        parse = Parser(value)
        assert builtin_data(BUILTIN, "x", parse) == value
        assert builtin_data(BUILTIN, "x", parse) == value
        assert parse.calls == 2


def test_tampered_foreign_or_broken_entries_are_ignored(cache: Path) -> None:
    builtin_data(BUILTIN, "a: 1", Parser({"a": 1}))
    (entry,) = cache.iterdir()
    doc = json.loads(entry.read_text())
    for text in ("{not json", json.dumps({**doc, "sha256": "0" * 64}), json.dumps({**doc, "format": 0})):
        entry.write_text(text)
        parse = Parser({"a": 1})
        assert builtin_data(BUILTIN, "a: 1", parse) == {"a": 1}
        assert parse.calls == 1
    if hasattr(os, "getuid"):
        # An entry others may write could hold anything: not trusted even with the right digest.
        entry.write_text(json.dumps({**doc, "data": {"a": "planted"}}))
        entry.chmod(0o666)
        assert builtin_data(BUILTIN, "a: 1", Parser({"a": 1})) == {"a": 1}


def test_unwritable_cache_still_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVPOLICY_CACHE_DIR", str(blocker / "sub"))
    assert builtin_data(BUILTIN, "a: 1", Parser({"a": 1})) == {"a": 1}
    monkeypatch.setenv("KVPOLICY_CACHE_DIR", "")  # empty: caching off
    parse = Parser({"a": 1})
    builtin_data(BUILTIN, "a: 1", parse)
    builtin_data(BUILTIN, "a: 1", parse)
    assert parse.calls == 2


def test_builtin_policy_from_the_cache_is_the_parsed_one(cache: Path) -> None:
    fresh = load_policy()
    assert any(cache.iterdir())
    cached = load_policy()
    assert cached.policy == fresh.policy
    assert cached.raw == fresh.raw
    assert cached.content_hash == fresh.content_hash
