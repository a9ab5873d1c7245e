"""The one reader and the one writer for every file kvpolicy opens or writes.

Policies arrive in pull requests and config.json files from the Hub, so every file is
read as if hostile: regular files only (a FIFO or a device would block or never end),
a size cap, strict UTF-8, JSON without duplicate keys or non-finite numbers, YAML with a
cap on nesting and on what its aliases expand to. Writes go to a temporary file in the
target's folder and are renamed into place, never through a symlink, and never over an
existing file unless the user said --force.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

from kvpolicy.errors import InputError

KIB = 1024
MIB = 1024 * KIB

MAX_POLICY_BYTES = 1 * MIB
"""Policy, test and --config YAML files (the built-in policy is about 30 KB)."""
MAX_CONFIG_BYTES = 4 * MIB
"""A model's config.json (the largest Hub configs are a few tens of KB)."""
MAX_INDEX_BYTES = 64 * MIB
"""model.safetensors.index.json (a 1T-parameter checkpoint's index is about 10 MB)."""
MAX_EVIDENCE_BYTES = 16 * MIB
"""Evidence and results JSON files."""
MAX_TEXT_BYTES = 64 * MIB
"""Free text fed to a model (`verify --text`)."""

MAX_YAML_NODES = 200_000
"""Most values a YAML document may hold once its aliases are expanded (the alias-bomb guard)."""
MAX_DEPTH = 64
"""Deepest nesting of lists and mappings in a YAML or JSON document."""


def _located(path: Path | str, message: str, line: int | None = None) -> InputError:
    at = f"{path}:{line}" if line is not None else str(path)
    return InputError(f"{at}: {message}")


def read_bytes(path: Path | str, *, what: str = "file", max_bytes: int = MAX_POLICY_BYTES) -> bytes:
    """The bytes of a regular file of at most `max_bytes`; anything else is an InputError (exit 2).

    The type is checked with stat before opening, and the file is opened non-blocking and
    checked again, so a FIFO or a device is refused at once instead of blocking or streaming
    forever; at most `max_bytes + 1` bytes are ever read.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise _located(p, f"file not found. Check the path (relative paths start at {Path.cwd()}).") from None
    except NotADirectoryError:
        raise _located(p, "file not found (a part of the path is not a folder).") from None
    except OSError as exc:
        raise _located(p, f"cannot be read ({exc.strerror or exc}).") from None
    _check_regular(p, st, what, max_bytes)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(p, flags)
    except OSError as exc:
        raise _located(p, f"cannot be read ({exc.strerror or exc}). Check its permissions.") from None
    try:
        _check_regular(p, os.fstat(fd), what, max_bytes)  # swapped for a FIFO between stat and open
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 * MIB, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise _located(p, f"cannot be read ({exc.strerror or exc}).") from None
    finally:
        os.close(fd)
    if size > max_bytes:
        raise _located(p, f"grew past the {max_bytes:,}-byte limit for {what} while being read.")
    return b"".join(chunks)


def _check_regular(p: Path, st: os.stat_result, what: str, max_bytes: int) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise _located(p, f"is a folder; {what} must be a file.")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or
                stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise _located(p, f"is {kind}; {what} must be a regular file (refused without reading it).")
    if st.st_size > max_bytes:
        raise _located(p, f"is {st.st_size:,} bytes, over the {max_bytes:,}-byte limit for {what}. "
                          "Is this the right file?")


def decode_utf8(data: bytes, where: str) -> str:
    """UTF-8 text (a leading BOM dropped); a bad byte is reported with its line."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise _located(where, f"byte {exc.start} is not UTF-8 ({exc.reason}); save the file as UTF-8.",
                       line) from None


def read_text(path: Path | str, *, what: str = "file", max_bytes: int = MAX_POLICY_BYTES) -> str:
    """`read_bytes` decoded as UTF-8."""
    return decode_utf8(read_bytes(path, what=what, max_bytes=max_bytes), str(path))


# -- JSON -------------------------------------------------------------------------------------


class _JsonRefusal(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _JsonRefusal(f"duplicate key `{key}`", key)
        out[key] = value
    return out


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _JsonRefusal(f"number {text} is out of range (beyond +-1.8e308)")
    return value


def _constant(name: str) -> Any:
    raise _JsonRefusal(f"`{name}` is not a JSON number; write a finite number")


def load_json(text: str, where: str) -> Any:
    """Strict JSON: no duplicate keys, no NaN/Infinity, finite floats, nesting at most MAX_DEPTH."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates, parse_float=_finite, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}:{exc.lineno}:{exc.colno}: invalid JSON ({exc.msg}); fix the syntax there.") from None
    except _JsonRefusal as exc:
        line = _key_line(text, exc.args[1]) if len(exc.args) > 1 else None
        raise _located(where, f"{exc.args[0]}; a key may appear once per object.", line) from None
    except RecursionError:
        raise _located(where, f"nested deeper than {MAX_DEPTH} levels; refused.") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise _located(where, f"invalid JSON ({exc}).") from None
    if depth(data) > MAX_DEPTH:
        raise _located(where, f"nested deeper than {MAX_DEPTH} levels; refused.")
    return data


def _key_line(text: str, key: str) -> int | None:
    """Line of the second `"key":` in the text (where a duplicate is most likely)."""
    hits = [m.start() for m in re.finditer(re.escape(json.dumps(key)) + r"\s*:", text)]
    return text.count("\n", 0, hits[1]) + 1 if len(hits) > 1 else None


def read_json(path: Path | str, *, what: str = "JSON file", max_bytes: int = MAX_EVIDENCE_BYTES) -> Any:
    """A strict JSON document from a regular file."""
    return load_json(read_text(path, what=what, max_bytes=max_bytes), str(path))


def depth(data: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of lists and mappings (stops counting past `limit`)."""
    best = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, (dict, list)):
            d += 1
            best = max(best, d)
            if d > limit:
                return d
            stack.extend((v, d) for v in (node.values() if isinstance(node, dict) else node))
    return best


# -- YAML -------------------------------------------------------------------------------------


class YamlRefused(ValueError):
    """A YAML document past the node or depth cap, or holding a non-plain value; `loc` is where."""

    def __init__(self, message: str, loc: tuple[Any, ...]) -> None:
        super().__init__(message)
        self.loc = loc


def check_yaml_size(data: Any, *, max_nodes: int = MAX_YAML_NODES, max_depth: int = MAX_DEPTH) -> None:
    """Refuse a loaded YAML document whose aliases expand past `max_nodes` values, or that nests too deep.

    A loader keeps an alias as a second reference to one object, so a 600-byte document
    can stand for billions of values that only appear when it is copied into plain data.
    Sizes are counted once per shared object (memoised), so the check itself is linear in
    the document; a self-referencing alias is refused too.
    """
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any, loc: tuple[Any, ...], level: int) -> int:
        if not isinstance(node, (dict, list)):
            if node is not None and not isinstance(node, (str, int, float)):
                # !!binary, !!set, !!omap, dates: not data a policy holds, and bytes would pass as a string
                raise YamlRefused(f"a {type(node).__name__} value (from a YAML tag or an unquoted date) is not "
                                   "allowed; quote it or write a plain string, number, list or mapping", loc)
            return 1
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise YamlRefused("an alias refers to the mapping or list that holds it (a loop); remove it", loc)
        if level > max_depth:
            raise YamlRefused(f"nested deeper than {max_depth} levels", loc)
        active.add(key)
        total = 1
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            total += size(v, loc + (k,), level + 1)
            if total > max_nodes:
                raise YamlRefused(f"its aliases expand to more than {max_nodes:,} values (an alias bomb?); "
                                   "write the values out or use fewer aliases", loc + (k,))
        active.discard(key)
        sizes[key] = total
        return total

    size(data, (), 1)


# -- writing ----------------------------------------------------------------------------------


def check_writable(path: Path | str, *, force: bool = False, what: str = "output file") -> Path:
    """Refuse a target that cannot be written before any work starts: a symlink, a folder, an
    existing file without `force`, or a folder that does not exist or is not writable."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise InputError(f"{p}: cannot write {what} ({exc.strerror or exc}).") from None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise InputError(f"{p} is a symbolic link; kvpolicy never writes through one. "
                             "Remove the link or choose another path.")
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"{p} is a folder; give a file name for the {what}.")
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{p} is not a regular file; choose another path for the {what}.")
        if not force:
            raise InputError(f"{p} already exists; pass --force to replace it, or choose another path.")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"{p}: cannot write: the folder {folder} does not exist; create it first.")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{p}: cannot write: the folder {folder} is not writable; choose another path.")
    return p


def write_text(path: Path | str, text: str, *, force: bool = False, what: str = "output file") -> None:
    """Write a file completely or not at all: a temp file in the same folder, fsync, then rename.

    An existing regular file is replaced only with `force` (its permissions kept); a symlink
    is never followed or replaced; a failure (full disk, no permission) leaves the target as
    it was and no temp file behind.
    """
    p = check_writable(path, force=force, what=what)
    folder = p.parent if str(p.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise InputError(f"{p}: cannot write ({exc.strerror or exc}). Check that {folder} is writable.") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            mode = os.lstat(p).st_mode & 0o7777
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        if os.path.islink(p):  # appeared since the check: still never replace a link
            raise InputError(f"{p} became a symbolic link while writing; nothing was changed.")
        os.replace(tmp, p)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise InputError(f"{p}: cannot write ({exc.strerror or exc}). Nothing was changed.") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
