"""Reading YAML with positions, and mapping validation errors to file:line:column.

Round-trip loading (ruamel.yaml) keeps line numbers, comments and key order, so
errors point at the offending line and anything written back keeps the user's
formatting. Data files of our own use the faster C-backed safe loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpolicy.errors import InputError, PolicyError, did_you_mean


def read_text(path: Path) -> str:
    """Read a file, turning OS errors into an InputError that names the file."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: file not found. Check the path (it is relative to {Path.cwd()}).") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a folder, not a YAML file.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot be read ({exc}).") from None


def load_safe(text: str, where: str) -> Any:
    """Parse YAML into plain dicts and lists (fast; no positions)."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    try:
        return YAML(typ="safe").load(text)
    except YAMLError as exc:
        raise PolicyError(f"{where}: malformed YAML: {_yaml_problem(exc)}") from None


def load_roundtrip(text: str, where: str) -> Any:
    """Parse YAML keeping positions, comments and order (ruamel CommentedMap/Seq)."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    try:
        return YAML(typ="rt").load(text)
    except YAMLError as exc:
        raise PolicyError(f"{where}: malformed YAML: {_yaml_problem(exc)}") from None


def _yaml_problem(exc: Exception) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}. Fix the YAML syntax there."
    return f"{problem}."


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
    if best is None and getattr(data, "lc", None) is not None:
        best = (data.lc.line + 1, data.lc.col + 1)
    return best


def format_validation_error(exc: Any, data: Any, where: str, model: type | None = None) -> str:
    """Turn a pydantic ValidationError into `file:line:col: message` lines with fixes."""
    lines: dict[tuple[str, str], str] = {}
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        # Union errors name the member class in loc; drop it to get the data path.
        path_loc = tuple(p for p in loc if not (isinstance(p, str) and p[:1].isupper()))
        pos = position(data, path_loc)
        at = f"{where}:{pos[0]}:{pos[1]}" if pos else where
        dotted = ".".join(str(p) for p in path_loc) or "(top level)"
        msg = err.get("msg", "invalid")
        kind = err.get("type", "")
        if kind == "extra_forbidden":
            key = str(path_loc[-1]) if path_loc else "?"
            allowed = _allowed_keys(model, path_loc[:-1])
            hint = did_you_mean(key, allowed) if allowed else ""
            msg = f"unknown key `{key}`.{hint} Remove it or fix its spelling."
        elif kind == "missing":
            msg = f"required key `{path_loc[-1] if path_loc else '?'}` is missing; add it."
        else:
            got = err.get("input")
            if not isinstance(got, (dict, list)) and got is not None:
                msg = f"{msg} (found {got!r})"
        # Each member of a union reports its own error; the first per location is enough.
        lines.setdefault((at, dotted), f"{at}: {dotted}: {msg}")
    return "\n".join(list(lines.values())[:12])


def _allowed_keys(model: type | None, loc: tuple[Any, ...]) -> list[str]:
    """Field names (and aliases) of the pydantic model reached by following `loc` from `model`."""
    import typing

    from pydantic import BaseModel

    def fields_of(m: Any) -> dict[str, Any]:
        return m.model_fields if isinstance(m, type) and issubclass(m, BaseModel) else {}

    current: Any = model
    for key in loc:
        if isinstance(key, int):
            continue
        f = fields_of(current).get(key)
        if f is None:
            return []
        current = _first_model(f.annotation, typing)
    names = []
    for name, f in fields_of(current).items():
        names.append(f.alias or name)
    return names


def _first_model(annotation: Any, typing: Any) -> Any:
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _first_model(arg, typing)
        if found is not None:
            return found
    return None
