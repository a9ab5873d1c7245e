"""Where each part of a merged policy was written: file, line and column.

A merged `Policy` has lost its origins; `Sources` finds them again in the
round-trip YAML of every file of the `extends` chain (the extending file first),
so lint, test and check can point at `team.yaml:14:9` instead of "rule KV900".
Built-in policies are parsed without positions; their problems name the file only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvpolicy.inputs.yamlio import Problem, position


class Sources:
    """Positions of rules, pins, thresholds and deployments in the files of a chain."""

    def __init__(self, chain: list[str], raw: dict[str, Any]) -> None:
        self.chain = chain
        self.raw = raw

    @classmethod
    def of(cls, loaded: Any) -> Sources:
        """Sources of a LoadedPolicy."""
        return cls(loaded.chain, loaded.raw)

    def _files(self) -> Iterator[tuple[str, Any]]:
        for name in self.chain:
            data = self.raw.get(name)
            if isinstance(data, dict):
                yield name, data

    def at(self, file: str, loc: tuple[Any, ...]) -> tuple[str, int | None, int | None]:
        """(file, line, col) of `loc` in one file (the nearest parent when `loc` is not there)."""
        pos = position(self.raw.get(file), loc)
        return file, (pos[0] if pos else None), (pos[1] if pos else None)

    def item(self, section: str, key: str, value: Any) -> tuple[str, tuple[Any, ...]] | None:
        """(file, loc) of the first entry of list `section` whose `key` equals `value`, extending file first."""
        for name, data in self._files():
            entries = data.get(section)
            if isinstance(entries, list):
                for i, entry in enumerate(entries):
                    if isinstance(entry, dict) and entry.get(key) == value:
                        return name, (section, i)
        return None

    def rule(self, rule_id: str, *sub: Any) -> tuple[str, int | None, int | None]:
        """Where rule `rule_id` (or its part `sub`, e.g. "when") is written."""
        found = self.item("rules", "id", rule_id)
        if found is None:
            return self.chain[0], None, None
        return self.at(found[0], found[1] + sub)

    def pin(self, name: str, *sub: Any) -> tuple[str, int | None, int | None]:
        """Where pin `name` is written."""
        found = self.item("pins", "name", name)
        if found is None:
            return self.chain[0], None, None
        return self.at(found[0], found[1] + sub)

    def deployment(self, name: str, *sub: Any) -> tuple[str, int | None, int | None]:
        """Where deployment `name` is written (deployments come from the extending file only)."""
        found = self.item("deployments", "name", name)
        if found is None:
            return self.chain[0], None, None
        return self.at(found[0], found[1] + sub)

    def key(self, *loc: Any) -> tuple[str, int | None, int | None]:
        """Where a top-level path (e.g. `thresholds`, `break_even_tokens`, `value`) is set, extending file first."""
        for name, data in self._files():
            node = data
            ok = True
            for part in loc:
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                    node = node[part]
                else:
                    ok = False
                    break
            if ok:
                return self.at(name, loc)
        return self.chain[0], None, None

    def find(self, file: str, loc: tuple[Any, ...], key: str, value: Any) -> tuple[str, int | None, int | None]:
        """Where, under `loc` in `file`, a mapping sets `key: value` (e.g. `fact: model.headdim`)."""
        node: Any = self.raw.get(file)
        for part in loc:
            try:
                node = node[part]
            except (KeyError, IndexError, TypeError):
                return self.at(file, loc)
        hit = _search(node, key, value)
        if hit is None:
            return self.at(file, loc)
        return self.at(file, loc + hit)

    def problem(self, where: tuple[str, int | None, int | None], message: str, kind: str = "reference") -> Problem:
        """A Problem at `where`."""
        return Problem(where[0], message, where[1], where[2], kind=kind)


def _search(node: Any, key: str, value: Any) -> tuple[Any, ...] | None:
    """Path to the first `key` whose value is `value` (or, for {threshold: x}, holds it) below `node`."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key and v == value:
                return (k,)
        for k, v in node.items():
            sub = _search(v, key, value)
            if sub is not None:
                return (k,) + sub
    elif isinstance(node, list):
        for i, v in enumerate(node):
            sub = _search(v, key, value)
            if sub is not None:
                return (i,) + sub
    return None
