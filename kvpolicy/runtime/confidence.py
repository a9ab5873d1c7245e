"""95% intervals for measured proportions, and how many trials decide one against a floor.

A recovery (needle hits kept) or a top-1 agreement is k successes in n trials;
its Wilson score interval is honest at small n and near 1, where the normal
approximation claims certainty it does not have. A verdict is given only when
the whole interval lies on one side of the floor. Pure Python: no torch here.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054
"""Two-sided 95% normal quantile."""
MAX_TRIALS = 1_000_000
"""Beyond this many trials a figure at the floor counts as undecidable (it sits on the line)."""


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of k successes in n trials ((0, 1) when n is 0)."""
    if n <= 0:
        return 0.0, 1.0
    k = min(max(k, 0), n)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def side(k: int, n: int, floor: float) -> str:
    """`above` (interval at or above the floor), `below` (entirely under it) or `undecided`."""
    lo, hi = wilson(k, n)
    if lo >= floor:
        return "above"
    if hi < floor:
        return "below"
    return "undecided"


def trials_to_decide(p: float, floor: float) -> int | None:
    """Fewest trials at which a true rate `p` would put the Wilson interval on one side of `floor`.

    None when p is within rounding of the floor (no finite number of trials decides it).
    """
    if abs(p - floor) < 1e-9:
        return None

    def decided(n: int) -> bool:
        return side(round(p * n), n, floor) != "undecided"

    hi = 1
    while not decided(hi):
        hi *= 2
        if hi > MAX_TRIALS:
            return None
    lo = hi // 2
    while lo + 1 < hi:  # decided() is monotone in n up to rounding of p * n: a bisection is close enough
        mid = (lo + hi) // 2
        if decided(mid):
            hi = mid
        else:
            lo = mid
    return hi


def default_trials(floor: float, distance: float = 0.03) -> int:
    """Trials that decide a format `distance` from the floor on either side (the larger of the two counts)."""
    counts = [trials_to_decide(p, floor) for p in (floor - distance, min(1.0, floor + distance))]
    return max(c for c in counts if c is not None)


def fmt_interval(lo: float, hi: float) -> str:
    """`[91.2%, 98.9%]`."""
    return f"[{lo:.1%}, {hi:.1%}]"
