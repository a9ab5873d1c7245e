"""Reading YAML with positions, and mapping validation errors to file:line:column.

Round-trip loading (ruamel.yaml) keeps line numbers, comments and key order, so
errors point at the offending line and anything written back keeps the user's
formatting. Data files of our own use the faster C-backed safe loader.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpolicy.errors import KvPolicyError, PolicyError, did_you_mean


@dataclass(frozen=True)
class Problem:
    """One message tied to a place in a file; `line` and `col` are 1-based when known."""

    file: str
    """File the problem is in (as the user named it)."""
    message: str
    """What is wrong and how to fix it."""
    line: int | None = None
    """1-based line, when known."""
    col: int | None = None
    """1-based column, when known."""
    kind: str = "schema"
    """yaml, schema, unknown-key, extends or reference (lint maps kinds to its codes)."""

    def __str__(self) -> str:
        at = self.file
        if self.line is not None:
            at += f":{self.line}" + (f":{self.col}" if self.col is not None else "")
        return f"{at}: {self.message}"


def located_error(problems: list[Problem], cls: type[KvPolicyError] = PolicyError, tail: str = "") -> KvPolicyError:
    """An error whose message lists the problems; `error.problems` keeps them for lint and CI output."""
    err = cls("\n".join(str(p) for p in problems) + (f"\n{tail}" if tail else ""))
    err.problems = list(problems)  # type: ignore[attr-defined]
    return err


def error_problems(err: BaseException, fallback_file: str) -> list[Problem]:
    """The problems an error carries, or one problem holding its message."""
    found = getattr(err, "problems", None)
    if found:
        return list(found)
    return [Problem(fallback_file, str(err), kind="schema")]


def read_text(path: Path) -> str:
    """Read a policy-sized YAML file (regular file, size cap, UTF-8); problems are InputErrors naming it."""
    from kvpolicy.inputs.safeio import MAX_POLICY_BYTES
    from kvpolicy.inputs.safeio import read_text as read_checked

    return read_checked(path, what="a policy or test file", max_bytes=MAX_POLICY_BYTES)


def load_safe(text: str, where: str) -> Any:
    """Parse YAML into plain dicts and lists (fast; no positions)."""
    from ruamel.yaml import YAML

    try:
        data = YAML(typ="safe").load(text)
    except Exception as exc:  # noqa: BLE001 - any parser failure is the file's fault, not ours
        raise located_error([yaml_problem(exc, where)]) from None
    return _bounded(data, where)


def load_roundtrip(text: str, where: str) -> Any:
    """Parse YAML keeping positions, comments and order (ruamel CommentedMap/Seq)."""
    try:
        data = _rt_yaml().load(text)
    except Exception as exc:  # noqa: BLE001 - any parser failure is the file's fault, not ours
        raise located_error([yaml_problem(exc, where)]) from None
    return _bounded(data, where)


def _bounded(data: Any, where: str) -> Any:
    """`data` if its aliases and nesting stay within the caps (checked before anything copies it)."""
    from kvpolicy.inputs.safeio import YamlRefused, check_yaml_size

    try:
        check_yaml_size(data)
    except YamlRefused as exc:
        pos = position(data, exc.loc)
        raise located_error([Problem(where, f"refused: {exc}.", pos[0] if pos else None,
                                     pos[1] if pos else None, kind="yaml")]) from None
    return data


def yaml_problem(exc: BaseException, where: str) -> Problem:
    """A parser exception as a Problem with the line and column of the fault."""
    if isinstance(exc, RecursionError):
        return Problem(where, "refused: nested too deeply to parse; flatten the lists and mappings.", kind="yaml")
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    context, opened = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and opened is not None and mark is not None and opened.line < mark.line and (
            "flow" in context or "quoted scalar" in context):
        # An unclosed `[`, `{` or quote is only noticed lines later (often at the end of the file): point
        # at where it opened, which is where the fix goes, and say where the parser gave up.
        what = {"flow sequence": "`[`", "flow mapping": "`{`", "quoted scalar": "quote"}
        opener = next((v for k, v in what.items() if k in context), "construct")
        problem = (f"the {opener} opened here is not closed ({problem} at line {mark.line + 1}, "
                   f"column {mark.column + 1})")
        mark = opened
    line = mark.line + 1 if mark is not None else None
    col = mark.column + 1 if mark is not None else None
    return Problem(where, f"malformed YAML: {problem}. Fix the YAML syntax there.", line, col, kind="yaml")


def _rt_yaml(text: str = "") -> Any:
    """A round-trip YAML instance that writes back in the style of `text` (indents, long lines)."""
    from ruamel.yaml import YAML

    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap the user's long lines
    mapping, offset = _guess_indent(text)
    yaml.indent(mapping=mapping, sequence=offset + 2, offset=offset)
    return yaml


def _guess_indent(text: str) -> tuple[int, int]:
    """(mapping indent, dash offset of block sequences) used in `text`; (2, 2) when it shows neither."""
    mapping: int | None = None
    offset: int | None = None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    for prev, cur in zip(lines, lines[1:]):
        head = prev.lstrip()
        if not head.rstrip().endswith(":") or head.startswith("- "):
            continue
        p, c = len(prev) - len(head), len(cur) - len(cur.lstrip())
        if cur.lstrip().startswith("- ") and offset is None and c >= p:
            offset = c - p
        elif mapping is None and c > p and not cur.lstrip().startswith("- "):
            mapping = c - p
        if mapping is not None and offset is not None:
            break
    return mapping or 2, 2 if offset is None else offset


def dump_roundtrip(data: Any, like: str = "") -> str:
    """Round-trip YAML text of `data`, indented like `like` (comments and key order come with the data)."""
    out = io.StringIO()
    _rt_yaml(like).dump(data, out)
    return out.getvalue()


def write_text_atomic(path: Path, text: str) -> None:
    """Replace a file the user named for updating, completely or not at all (never through a symlink)."""
    from kvpolicy.inputs.safeio import write_text

    write_text(path, text, force=True, what="policy file")


def update_yaml_file(path: Path | str, mutate: Callable[[Any], Any]) -> Any:
    """Load `path` round-trip, let `mutate` change the data in place (or return new data), write it back atomically.

    Comments, key order, quoting, flow style and indentation survive. If `mutate`
    raises, or the result cannot be written, the file is left as it was. A missing
    file starts as an empty mapping. Returns the data written.
    """
    from ruamel.yaml.comments import CommentedMap

    path = Path(path)
    text = read_text(path) if path.exists() else ""
    data = load_roundtrip(text, str(path)) if text.strip() else None
    if data is None:
        data = CommentedMap()
    result = mutate(data)
    if result is not None:
        data = result
    write_text_atomic(path, dump_roundtrip(data, like=text))
    return data


def position(data: Any, loc: tuple[Any, ...]) -> tuple[int, int] | None:
    """1-based (line, column) of the node at `loc` in round-trip data, or of its nearest parent."""
    best: tuple[int, int] | None = None
    node = data
    for key in loc:
        lc = getattr(node, "lc", None)
        if lc is None:
            break
        try:
            if isinstance(node, dict) and key in node:
                line, col = lc.key(key)
                best = (line + 1, col + 1)
                node = node[key]
                continue
            if isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
                line, col = lc.item(key)
                best = (line + 1, col + 1)
                node = node[key]
                continue
        except (KeyError, IndexError, TypeError):
            pass
        break
    lc = getattr(data, "lc", None)
    if best is None and lc is not None and lc.line is not None and lc.col is not None:
        best = (lc.line + 1, lc.col + 1)
    return best


_TYPE_TAGS = {"bool", "int", "float", "str", "none", "list", "dict"}


def _is_tag(part: Any) -> bool:
    """Union members and validators that pydantic names in `loc` (not keys of the data)."""
    if not isinstance(part, str):
        return False
    return part[:1].isupper() or part in _TYPE_TAGS or ("[" in part and part.endswith("]"))


def format_validation_error(exc: Any, data: Any, where: str, model: type | None = None) -> str:
    """Turn a pydantic ValidationError into `file:line:col: message` lines with fixes."""
    return "\n".join(str(p) for p in validation_problems(exc, data, where, model))


def validation_problems(exc: Any, data: Any, where: str, model: type | None = None) -> list[Problem]:
    """A pydantic ValidationError as Problems with positions (at most 12, one per location)."""
    lines: dict[tuple[str, str], Problem] = {}
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        # Union errors name the member class in loc; drop it to get the data path.
        path_loc = tuple(p for p in loc if not _is_tag(p))
        pos = position(data, path_loc)
        at = f"{where}:{pos[0]}:{pos[1]}" if pos else where
        dotted = ".".join(str(p) for p in path_loc) or "(top level)"
        kind = err.get("type", "")
        msg = err.get("msg", "invalid")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if kind == "extra_forbidden":
            key = str(path_loc[-1]) if path_loc else "?"
            allowed = _allowed_keys(model, loc[:-1])
            hint = did_you_mean(key, allowed) if allowed else ""
            msg = f"unknown key `{key}`.{hint} Remove it or fix its spelling."
        elif kind == "missing":
            msg = f"required key `{path_loc[-1] if path_loc else '?'}` is missing; add it."
        else:
            got = err.get("input")
            if kind == "value_error":
                pass  # our validators quote the value themselves
            elif isinstance(got, (dict, list)):
                msg = f"{msg} (found a {'mapping' if isinstance(got, dict) else 'list'})"
            elif got is not None:
                msg = f"{msg} (found {got!r})"
        # Each member of a union reports its own error; the first per location is enough.
        lines.setdefault((at, dotted), Problem(where, f"{dotted}: {msg}", pos[0] if pos else None,
                                               pos[1] if pos else None,
                                               kind="unknown-key" if kind == "extra_forbidden" else "schema"))
    return list(lines.values())[:12]


def _allowed_keys(model: type | None, loc: tuple[Any, ...]) -> list[str]:
    """Field names (and aliases) of the pydantic model reached by following `loc` (tags included) from `model`."""
    from pydantic import BaseModel

    current: Any = model
    for key in loc:
        if _is_tag(key):
            chosen = [m for m in _members(current) if getattr(m, "__name__", None) == key]
            if chosen:
                current = chosen[0]
            continue
        if isinstance(key, int):
            current = _container_item(current, list)
            continue
        model_cls = _only_model(current)
        if model_cls is not None:
            f = model_cls.model_fields.get(key) or next(
                (f for f in model_cls.model_fields.values() if f.alias == key), None)
            if f is None:
                return []
            current = f.annotation
        else:
            current = _container_item(current, dict)
    model_cls = _only_model(current)
    if model_cls is None or not issubclass(model_cls, BaseModel):
        return []
    return [f.alias or name for name, f in model_cls.model_fields.items()]


def _members(annotation: Any) -> list[Any]:
    """The flat list of types a (possibly Annotated / Union) annotation allows."""
    import typing

    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]


def _only_model(annotation: Any) -> Any:
    from pydantic import BaseModel

    models = [m for m in _members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
    return models[0] if len(models) == 1 else None


def _container_item(annotation: Any, kind: type) -> Any:
    """The item type of the first list (or value type of the first dict) an annotation allows."""
    import typing

    for m in _members(annotation):
        if typing.get_origin(m) is kind:
            args = typing.get_args(m)
            return args[-1] if args else Any
    return Any


def to_plain(data: Any) -> Any:
    """Round-trip YAML (CommentedMap/Seq) -> plain dicts and lists with string keys."""
    if isinstance(data, dict):
        return {str(k): to_plain(v) for k, v in data.items()}
    if isinstance(data, list):
        return [to_plain(v) for v in data]
    return data
