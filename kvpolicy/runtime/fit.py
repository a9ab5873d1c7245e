"""The documents' latency method: ITL = slope x context + intercept, and the break-even it implies.

Pure Python (no torch), so the fitting and the break-even rule are tested on
their own and shared by `bench`, `--record` and the plots.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LineFit:
    """A least-squares line through (context tokens, ITL ms) points."""

    slope_ms_per_token: float
    """ms of ITL per token of context."""
    intercept_ms: float
    """ITL at zero context, in ms."""
    r2: float
    """Coefficient of determination of the fit (1.0 = a perfect line)."""


def fit_line(contexts: list[int], itl_ms: list[float]) -> LineFit:
    """Ordinary least squares of ITL on context; needs at least two distinct contexts."""
    if len(contexts) != len(itl_ms) or len(set(contexts)) < 2:
        raise ValueError(f"a line needs two or more distinct contexts, got {contexts}")
    n = len(contexts)
    mean_x = sum(contexts) / n
    mean_y = sum(itl_ms) / n
    sxx = sum((x - mean_x) ** 2 for x in contexts)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in zip(contexts, itl_ms))
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    ss_tot = sum((y - mean_y) ** 2 for y in itl_ms)
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(contexts, itl_ms))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return LineFit(slope, intercept, r2)


MIN_R2 = 0.9
"""Below this the points do not lie on a line, and the line's slope and intercept describe nothing."""


def fit_problems(line: LineFit, contexts: int) -> list[str]:
    """Why a line through `contexts` distinct contexts says nothing (empty when it is a usable fit)."""
    problems = []
    if contexts < 3:
        problems.append(f"only {contexts} contexts: a line passes through any two points (r2 = 1 by construction)")
    elif line.r2 < MIN_R2:
        problems.append(f"r2 {line.r2:.2f} < {MIN_R2}: the times do not grow linearly with the context")
    if line.intercept_ms < 0:
        problems.append(f"negative intercept ({line.intercept_ms:.3g} ms): no decode step takes less than nothing")
    return problems


def break_even_tokens(baseline: LineFit, variant: LineFit) -> float | None:
    """Context above which `variant` decodes faster than `baseline`: intercept difference / slope difference.

    0 when the variant is never slower; None when its slope is not below the
    baseline's (it never catches up).
    """
    if variant.slope_ms_per_token >= baseline.slope_ms_per_token:
        return None
    gap = (variant.intercept_ms - baseline.intercept_ms) / (baseline.slope_ms_per_token - variant.slope_ms_per_token)
    return max(gap, 0.0)
