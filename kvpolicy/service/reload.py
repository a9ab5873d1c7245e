"""The policy `kvpolicy serve` answers with, and its hot reload.

The serving policy is one reference (`PolicyHolder.current`, a frozen Snapshot):
a request reads it once, a reload replaces it in one assignment, so no answer
ever mixes two versions. A new version is loaded, reference-checked and
smoke-evaluated before it replaces the old one; a broken edit is logged and
counted, and the last good policy keeps serving. Changes are found by polling
the files' mtime and size (no extra dependency) and on SIGHUP. A changed file is
read only once its size and mtime have held still for the settle time, and the
result is thrown away (and retried) if they moved while it was being read, so a
writer that pauses half-way is not served; replacing the file atomically (temp
file + rename) is still the only way to be sure, and what the docs ask for.
Loading runs in a worker thread: answering never waits for a reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpolicy.errors import PolicyError
from kvpolicy.inputs.policy_loader import BUILTIN, LoadedPolicy
from kvpolicy.inputs.yamlio import read_text
from kvpolicy.rules.validate import load_policy

log = logging.getLogger("kvpolicy.serve")


@dataclass(frozen=True)
class Snapshot:
    """One validated version of the policy, as served."""

    loaded: LoadedPolicy
    """The merged, validated policy."""
    path: str
    """The policy as named on the command line (a path or `builtin:NAME`)."""
    loaded_at: float
    """Unix time it started serving."""

    @property
    def hash(self) -> str:
        """Content hash over every file of the chain (12 hex digits)."""
        return self.loaded.content_hash

    @property
    def label(self) -> str:
        """`name@hash`, as in Recommendation.policy."""
        return self.loaded.label


def _read_nonempty(path: Path) -> str:
    """`read_text` that refuses an empty file.

    An empty file is a valid, rule-less policy, but far more often an editor's write in
    progress (truncate, then write). The check runs on the text that is then loaded: checking
    first and loading after would read the file twice, and a write between the reads would
    serve the empty policy."""
    text = read_text(path)
    if not text.strip():
        raise PolicyError(f"{path}: the policy file is empty; refusing to serve an empty policy.")
    return text


def validate(spec: str) -> LoadedPolicy:
    """Load a policy and prove it can decide: schema, references, and a smoke evaluation.

    The smoke set is the first catalog model of each attention kind on the first
    catalog GPU of each generation, with the policy's default workload, so a rule
    that breaks only on MLA or only on Blackwell is caught before it serves.
    """
    from kvpolicy.inputs.catalog import load_gpus, load_models
    from kvpolicy.inputs.workload import make_workload
    from kvpolicy.outputs.recommend import recommend
    from kvpolicy.rules.validate import check_references

    loaded = load_policy(spec, read=_read_nonempty)
    check_references(loaded.policy)
    workload = make_workload(loaded)
    archs = {m.attention: m for m in reversed(load_models().values())}.values()
    gpus = {g.generation: g for g in reversed(load_gpus().values())}.values()
    for arch in archs:
        # Within the model's own limit: a longer context is the request's error, not the policy's.
        wl = workload if not arch.max_model_len or workload.context_tokens <= arch.max_model_len else \
            workload.model_copy(update={"context_tokens": arch.max_model_len})
        for gpu in gpus:
            recommend(arch, gpu, wl, loaded)
    return loaded


class PolicyHolder:
    """The serving policy, its reload history, and the watcher that keeps it current."""

    def __init__(self, spec: str, *, settle_s: float = 2.0) -> None:
        """Load `spec` (a path or `builtin:NAME`); a broken policy raises here, before anything serves."""
        self.spec = spec
        self.settle_s = settle_s
        """Seconds a changed file must keep its size and mtime before it is read."""
        self.current = Snapshot(validate(spec), spec, time.time())
        self.reloads: Counter[str] = Counter()
        """Reload attempts by result: accepted, rejected, unchanged."""
        self.last_reload: dict[str, Any] | None = None
        """The last attempt: result, reason, time, error (for /healthz)."""
        self._seen = self.signature()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()

    def watched_files(self) -> list[Path]:
        """The requested file and every file of the serving policy's `extends` chain."""
        names = [self.spec, *self.current.loaded.chain]
        return list(dict.fromkeys(Path(n) for n in names if not n.startswith(BUILTIN)))

    def signature(self) -> tuple[tuple[str, int, int], ...]:
        """(path, mtime_ns, size) of each watched file; -1s for a missing one."""
        out = []
        for path in self.watched_files():
            try:
                st = path.stat()
                out.append((str(path), st.st_mtime_ns, st.st_size))
            except OSError:
                out.append((str(path), -1, -1))
        return tuple(out)

    def reload(self, reason: str, expect: tuple[tuple[str, int, int], ...] | None = None) -> str:
        """Validate the file again and swap it in if it is good, new and was not being written while read.

        Returns accepted, rejected, unchanged, or deferred (the files moved between the settle
        check and the end of the read: nothing is swapped, the poller tries again).
        """
        old = self.current
        before = self.signature()
        if expect is not None and before != expect:
            return "deferred"
        try:
            loaded = validate(self.spec)
        except Exception as exc:  # noqa: BLE001 - any failure rejects the edit; the old policy keeps serving
            loaded, error = None, f"{type(exc).__name__}: {exc}"
        else:
            error = None
        if self.signature() != before:
            log.info("policy reload (%s) deferred: the file changed while it was being read", reason)
            self.reloads["deferred"] += 1
            return "deferred"
        if loaded is None:
            result = "rejected"
            log.error("policy reload (%s) rejected, still serving %s:\n%s", reason, old.label, error)
        else:
            if loaded.content_hash == old.hash:
                result = "unchanged"
            else:
                result = "accepted"
                self.current = Snapshot(loaded, self.spec, time.time())
                log.info("policy reload (%s): now serving %s (was %s)", reason, loaded.label, old.label)
        self.reloads[result] += 1
        self.last_reload = {"result": result, "reason": reason, "at": time.time(), "error": error}
        return result

    async def reload_async(self, reason: str, expect: tuple[tuple[str, int, int], ...] | None = None) -> str:
        """`reload` in a worker thread (loading takes tens of ms), one at a time; answering goes on meanwhile."""
        async with self._lock:
            return await asyncio.to_thread(self.reload, reason, expect)

    async def _poll(self, interval_s: float) -> None:
        pending = None
        since = 0.0
        while True:
            await asyncio.sleep(interval_s)
            now = self.signature()
            if now == self._seen:
                pending = None
            elif now != pending:
                # Changed since the last look: wait until it holds still for the settle time, so a
                # write in progress is not read half-done.
                pending, since = now, time.monotonic()
            elif time.monotonic() - since >= self.settle_s:
                pending = None
                if await self.reload_async("file changed", expect=now) != "deferred":
                    self._seen = now

    def _on_sighup(self) -> None:
        task = asyncio.get_running_loop().create_task(self.reload_async("SIGHUP"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @contextlib.asynccontextmanager
    async def watching(self, interval_s: float) -> AsyncIterator[None]:
        """Poll the files every `interval_s` seconds (0: never) and reload on SIGHUP while the block runs."""
        loop = asyncio.get_running_loop()
        if interval_s > 0:
            self._seen = self.signature()
            poller = loop.create_task(self._poll(interval_s))
            self._tasks.add(poller)
        hup = False
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError, AttributeError):
            # Only the main thread of a Unix process can take signals.
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
            hup = True
        try:
            yield
        finally:
            if hup:
                loop.remove_signal_handler(signal.SIGHUP)
            for task in list(self._tasks):
                task.cancel()
