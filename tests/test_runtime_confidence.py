"""95% intervals on recovery figures, and the verdicts they allow (no torch needed)."""

from __future__ import annotations

import pytest

from kvpolicy.runtime.confidence import default_trials, side, trials_to_decide, wilson


def test_wilson_matches_the_textbook_values():
    # 18/18 (the old default's trials at one context) cannot tell 95% from 83%.
    lo, hi = wilson(18, 18)
    assert hi == 1.0 and lo == pytest.approx(0.8241, abs=1e-4)
    lo, hi = wilson(16, 18)
    assert (round(lo, 3), round(hi, 3)) == (0.672, 0.969)
    assert wilson(0, 0) == (0.0, 1.0)


def test_two_misses_in_eighteen_are_undecided_not_a_failure():
    """Issue 42: fp8+per_head at 16/18 (88.9%) was judged `keep BF16`; its interval reaches above 95%."""
    assert side(16, 18, 0.95) == "undecided"
    assert side(200, 200, 0.95) == "above" and side(180, 200, 0.95) == "below"


def test_default_trials_decide_three_points_from_the_floor():
    n = default_trials(0.95)
    for p in (0.92, 0.98):
        assert side(round(p * n), n, 0.95) != "undecided"
    assert side(round(0.94 * n), n, 0.95) == "undecided"  # one point away needs more
    assert trials_to_decide(0.95, 0.95) is None
    assert trials_to_decide(0.98, 0.95) <= n < trials_to_decide(0.94, 0.95)
