"""Parsed built-in YAML (catalogs, backend matrix, built-in policies) cached as JSON per user.

Parsing these files with ruamel.yaml costs more than the rest of a `kvpolicy recommend`; the
plain data they parse to is kept as JSON in the user's cache folder and used only while the
sha256 of the file's text still matches, so an edited file (an editable install, an upgrade)
is parsed again. Only JSON is ever read back (no pickle, nothing executable), the result is
validated by the same models as a fresh parse, and a cache file not owned by this user, or
writable by others, is ignored. Any problem with the cache falls back to parsing.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parents[1]
FORMAT = 1
"""Bumped when what the cache holds changes meaning (e.g. another YAML loader)."""


def cache_dir() -> Path | None:
    """$KVPOLICY_CACHE_DIR, else $XDG_CACHE_HOME/kvpolicy, else ~/.cache/kvpolicy; None when set to ""."""
    explicit = os.environ.get("KVPOLICY_CACHE_DIR")
    if explicit is not None:
        return Path(explicit) if explicit.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or ""
    try:
        root = Path(base) if base.strip() else Path.home() / ".cache"
    except RuntimeError:  # no home directory
        return None
    return root / "kvpolicy"


def builtin_data(path: Path, text: str, parse: Callable[[str], Any]) -> Any:
    """`parse(text)` for a data file shipped inside the package, from the cache when its text is unchanged.

    Files outside the package (a user's catalog or policy) are always parsed: they change
    often and their parse is not worth a cache entry each.
    """
    try:
        rel = path.resolve().relative_to(PACKAGE_DIR)
    except (ValueError, OSError):
        return parse(text)
    folder = cache_dir()
    if folder is None:
        return parse(text)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    # One entry per installed file: a new version replaces the old entry instead of adding one.
    name = hashlib.sha256(f"{PACKAGE_DIR}\0{rel.as_posix()}".encode()).hexdigest()[:24]
    entry = folder / f"yaml-{name}.json"
    found = _read(entry, digest)
    if found is not None:
        return found[0]
    data = parse(text)
    _write(folder, entry, digest, data)
    return data


def _read(entry: Path, digest: str) -> tuple[Any] | None:
    """(data,) from a cache entry for text with this digest, or None (missing, stale, foreign or broken)."""
    try:
        fd = os.open(entry, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o022 or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            return None
        with os.fdopen(fd, "rb") as fh:
            fd = -1
            doc = json.loads(fh.read())
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        if fd >= 0:
            os.close(fd)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("sha256") != digest or "data" not in doc:
        return None
    return (doc["data"],)


def _write(folder: Path, entry: Path, digest: str, data: Any) -> None:
    """Store `data` if JSON gives it back exactly; a cache that cannot be written is skipped silently."""
    if not _json_exact(data):
        return
    text = json.dumps({"format": FORMAT, "sha256": digest, "data": data}, ensure_ascii=False, allow_nan=True)
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, entry)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


def _json_exact(value: Any, depth: int = 0) -> bool:
    """True when JSON round-trips `value` with the same types (str keys; no dates, sets or tuples)."""
    if depth > 100:
        return False
    if value is None or type(value) in (str, int, float, bool):
        return True
    if type(value) is list:
        return all(_json_exact(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _json_exact(v, depth + 1) for k, v in value.items())
    return False
