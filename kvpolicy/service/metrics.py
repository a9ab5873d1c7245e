"""Prometheus metrics of `kvpolicy serve`, in the text exposition format (version 0.0.4).

Written by hand rather than with prometheus_client: the service needs three
counters, one histogram and two info-style gauges in a single process, and the
format is a few lines of text; a dependency would cost more start-up and
packaging than it saves. Route labels are the fixed endpoint paths (or
`unmatched`), so a client cannot grow the label set.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
"""Upper bounds of the request-latency histogram, in seconds (the target is p99 < 20 ms)."""


class Metrics:
    """Counters and the latency histogram of one server process."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, int]] = Counter()
        """Requests by (route, method, status)."""
        self.errors: Counter[tuple[str, str]] = Counter()
        """Error responses by (route, error kind)."""
        self.buckets: dict[str, list[int]] = {}
        """Per route: count of requests at or under each bucket bound (not cumulative; summed on output)."""
        self.sums_s: Counter[str] = Counter()
        """Per route: total seconds spent."""
        self.started_at = time.time()

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one finished request."""
        self.requests[(route, method, status)] += 1
        counts = self.buckets.setdefault(route, [0] * (len(LATENCY_BUCKETS_S) + 1))
        for i, bound in enumerate(LATENCY_BUCKETS_S):
            if seconds <= bound:
                counts[i] += 1
                break
        else:
            counts[-1] += 1
        self.sums_s[route] += seconds

    def error(self, route: str, kind: str) -> None:
        """Count one error response."""
        self.errors[(route, kind)] += 1

    def render(self, snap: Any, reloads: Counter[str]) -> str:
        """The exposition text; `snap` is the serving policy Snapshot, `reloads` the reload counts by result."""
        out = [
            "# HELP kvpolicy_http_requests_total HTTP requests by route, method and status.",
            "# TYPE kvpolicy_http_requests_total counter",
        ]
        for (route, method, status), n in sorted(self.requests.items()):
            out.append(f"kvpolicy_http_requests_total{_labels(route=route, method=method, status=status)} {n}")
        out += ["# HELP kvpolicy_http_errors_total Error responses by route and error kind.",
                "# TYPE kvpolicy_http_errors_total counter"]
        for (route, kind), n in sorted(self.errors.items()):
            out.append(f"kvpolicy_http_errors_total{_labels(route=route, error=kind)} {n}")
        out += ["# HELP kvpolicy_http_request_duration_seconds Time from request start to response end.",
                "# TYPE kvpolicy_http_request_duration_seconds histogram"]
        name = "kvpolicy_http_request_duration_seconds"
        for route, counts in sorted(self.buckets.items()):
            total = 0
            for bound, n in zip((*LATENCY_BUCKETS_S, "+Inf"), counts):
                total += n
                out.append(f"{name}_bucket{_labels(route=route, le=bound)} {total}")
            out.append(f"{name}_sum{_labels(route=route)} {self.sums_s[route]:.6f}")
            out.append(f"{name}_count{_labels(route=route)} {total}")
        out += ["# HELP kvpolicy_policy_info The serving policy (value 1).",
                "# TYPE kvpolicy_policy_info gauge",
                f"kvpolicy_policy_info{_labels(name=snap.loaded.policy.name, hash=snap.hash, path=snap.path)} 1",
                "# HELP kvpolicy_policy_loaded_timestamp_seconds When the serving policy was loaded.",
                "# TYPE kvpolicy_policy_loaded_timestamp_seconds gauge",
                f"kvpolicy_policy_loaded_timestamp_seconds {snap.loaded_at:.3f}",
                "# HELP kvpolicy_policy_reload_total Policy reload attempts by result.",
                "# TYPE kvpolicy_policy_reload_total counter"]
        for result in ("accepted", "rejected", "unchanged"):
            out.append(f"kvpolicy_policy_reload_total{_labels(result=result)} {reloads[result]}")
        out += ["# HELP kvpolicy_process_start_time_seconds Start time of the process.",
                "# TYPE kvpolicy_process_start_time_seconds gauge",
                f"kvpolicy_process_start_time_seconds {self.started_at:.3f}"]
        return "\n".join(out) + "\n"


def _labels(**labels: Any) -> str:
    """`{a="x",b="y"}` with the format's escapes (backslash, quote, newline)."""
    def esc(v: Any) -> str:
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"
