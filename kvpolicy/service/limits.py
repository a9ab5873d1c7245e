"""Limits that keep slow or hostile clients from holding the decision service.

uvicorn closes idle keep-alive connections and caps concurrent connections, but it
waits forever for the headers of a request: a client that sends half a request line
and stops (slowloris) keeps its socket, and a few hundred such clients fill the
connection cap. `guarded_protocol` wraps uvicorn's HTTP protocol with a deadline for
the headers of each request; the body has its own deadline in `read_body`.
"""

from __future__ import annotations

import asyncio
import importlib.util
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Limits:
    """What `kvpolicy serve` allows one client (each is a `serve` flag)."""

    max_connections: int = 256
    """Open connections at once; beyond it uvicorn answers 503."""
    header_timeout_s: float = 10.0
    """Seconds from connecting (or from the previous response) to the end of a request's headers."""
    body_timeout_s: float = 10.0
    """Seconds to receive the whole body once the headers are in; slower gets 408."""
    idle_timeout_s: float = 5.0
    """Seconds an idle keep-alive connection stays open."""
    max_header_bytes: int = 16 * 1024
    """Request line plus headers."""


def guarded_protocol(http: str, limits: Limits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class for `http` (auto, h11, httptools) with a header deadline."""
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]

    class Guarded(base):  # type: ignore[misc, valid-type]
        """Closes a connection whose request headers are not complete within the deadline."""

        _timer: asyncio.TimerHandle | None = None
        _seen: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            if self._timer is None:
                self._timer = self.loop.call_later(limits.header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _too_slow(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:
                self._arm()  # bytes of a new request: its headers are on the clock
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._seen:
                self._seen = self.cycle
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    Guarded.__name__ = f"Guarded{base.__name__}"
    return Guarded
