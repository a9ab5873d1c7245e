"""bench/bench_decode.py without a GPU: the measured crossover and `--reprint` of a recorded run.

RESULTS.md's decode tables are re-derived from the JSON of the run with `--reprint`; these tests
keep that path and the crossover it reports honest.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="bench_decode imports torch")
pytest.importorskip("triton", reason="bench_decode imports triton")

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import bench_decode  # noqa: E402


def _rows(times: dict[str, list[float]], contexts=(1024, 2048, 4096, 8192)) -> list[dict]:
    return [dict(column=c, context=n, us=t) for c, ts in times.items() for n, t in zip(contexts, ts)]


def test_measured_crossover_is_where_the_variant_stays_ahead():
    # faster at 1k, slower at 2k, faster from 4k on: the crossover is 4k, not 1k
    rows = _rows({"bf16": [10, 20, 40, 80], "fp8": [9, 21, 30, 50]})
    assert bench_decode.measured_crossover(rows, "bf16", "fp8") == 4096
    assert bench_decode.measured_crossover(_rows({"bf16": [10, 20, 40, 80], "fp8": [9, 19, 39, 79]}), "bf16", "fp8") == 1024
    # slower at the longest context measured: no crossover
    assert bench_decode.measured_crossover(_rows({"bf16": [10, 20, 40, 80], "fp8": [9, 19, 39, 81]}), "bf16", "fp8") is None


def test_reprint_rederives_the_recorded_run_without_a_gpu():
    run = BENCH / "results_decode_h200_full_0850.json"
    out = subprocess.run([sys.executable, str(BENCH / "bench_decode.py"), "--reprint", str(run)],
                         capture_output=True, text=True, check=True).stdout
    assert "re-derived from" in out and "commit 09d1bb5" in out
    # the 128k Llama batch-8 FP8 cell and its verdict line, as RESULTS.md quotes them
    assert "| 131072 | 976.8 (4.40) | 633.8 (3.39) |" in out
    assert "llama-3.1-8b b=8 fp8: 3.39 TB/s of KV at 128k (target >= 3.8) MISSED" in out
    assert "llama-3.1-8b b=8 fp8: break-even vs our BF16 0 tokens (target < 2048) MET; measured: as fast or faster from 1024 tokens on" in out
