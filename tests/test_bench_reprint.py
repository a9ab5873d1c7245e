"""bench/bench_decode.py without a GPU: the measured crossover, `--reprint` of a recorded run, and `--compare`.

RESULTS.md's decode tables are re-derived from the JSON of the run with `--reprint`, and the device's A/B mode
judges a kernel change by `--compare`; these tests keep both paths and the crossover they report honest.
"""

from __future__ import annotations

import copy
import json
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


RUN = BENCH / "results_decode_h200_evidence_tq30.json"
"""The evidence run the policy cites (batch 8) and RESULTS.md's batch-8 tables come from."""


def test_reprint_rederives_the_recorded_run_without_a_gpu():
    out = subprocess.run([sys.executable, str(BENCH / "bench_decode.py"), "--reprint", str(RUN)],
                         capture_output=True, text=True, check=True).stdout
    assert "re-derived from" in out and "commit e693736" in out
    # the 128k Llama batch-8 cells of BF16, FP8 and the Gluon FP8 kernel, and two verdicts, as RESULTS.md quotes them
    assert "| 131072 | 974.2 (4.41) | 630.7 (3.40) | 507.6 (4.23) |" in out
    assert "llama-3.1-8b b=8 fp8: 3.40 TB/s of KV at 128k (target >= 3.8) MISSED" in out
    assert "llama-3.1-8b b=8 fp8_gl: slope 0.529x cuDNN BF16 (target <= 0.55) MET" in out


def test_compare_flags_a_slope_that_moved_more_than_3_percent(capsys):
    """The A/B table: a run against itself is within 3% everywhere; a copy whose 3bit_nc Gluon row takes 5%
    longer from 64k on is flagged, and only that row."""
    run = json.loads(RUN.read_text())
    rows = bench_decode.print_comparison(run, run, ["a", "a"], slope_from=65536)
    assert rows and all(r["ratio"] == 1.0 for r in rows)
    assert "24 of 24 slopes within 3%" in capsys.readouterr().out
    slower = copy.deepcopy(run)
    for r in slower["speed"]:
        if r["column"] == "turboquant_3bit_nc_gl" and r["geometry"] == "llama-3.1-8b" and r["context"] == 131072:
            r["us"] *= 1.05
    rows = bench_decode.print_comparison(run, slower, ["old", "new"], slope_from=65536)
    out = capsys.readouterr().out
    moved = [r for r in rows if abs(r["ratio"] - 1) > 0.03]
    assert [(r["geometry"], r["column"]) for r in moved] == [("llama-3.1-8b", "turboquant_3bit_nc_gl")]
    assert "llama-3.1-8b b=8 turboquant_3bit_nc_gl: new slope" in out and "23 of 24 slopes within 3%" in out


def test_evidence_takes_fp8_from_the_fastest_kernel_and_says_so():
    """--evidence: the fp8 column comes from the Gluon row when the run has one, and the source names it."""
    log = dict(gpu="NVIDIA H200", date="2026-11-30T10:00:00", torch="2.11", triton="3.6", commit="abc1234")
    summary, records = [], []
    for geom in bench_decode.GEOMETRIES:
        for column, slope in (("bf16", 7.0), ("fp8", 4.8), ("fp8_gl", 3.8), ("sdpa_cudnn", 7.2)):
            summary.append(dict(geometry=geom, batch=8, column=column, slope_ns_per_token=slope, intercept_us=8.0))
            records.append(dict(geometry=geom, batch=8, column=column, context=131072, tbps=16384 / slope / 1e3))
    block = bench_decode.evidence_block(records, summary, log, "h200")
    fits = block["kernels"][0]["fits"]
    assert fits["fp8"]["slope_ns_per_token"] == 3.8 and fits["bf16"]["slope_ns_per_token"] == 7.0
    assert "fp8 from the fp8_gl row" in block["source"]
    # without the Gluon row (another GPU), the Triton row
    block = bench_decode.evidence_block(records, [s for s in summary if s["column"] != "fp8_gl"], log, "h200")
    assert block["kernels"][0]["fits"]["fp8"]["slope_ns_per_token"] == 4.8 and "from the" not in block["source"]


def test_targets_judge_the_gluon_turboquant_rows_against_their_own_fp8_family():
    """The Gluon TurboQuant rows are our fastest kernels: their slope targets must be printed, and k8v4's
    limit is the FP8 ratio of the same family (fp8_gl for the Gluon row, fp8 for the Triton row) + 0.05."""
    summary = [dict(geometry="g", batch=8, column=c, slope_ratio_vs_sdpa_cudnn=r)
               for c, r in (("fp8", 0.66), ("fp8_gl", 0.53), ("turboquant_k8v4", 0.70), ("turboquant_k8v4_gl", 0.60),
                            ("turboquant_4bit_nc_gl", 0.34), ("turboquant_3bit_nc_gl", 0.41))]
    lines = bench_decode.targets([], summary, {})
    assert "g b=8 turboquant_k8v4: slope 0.700x cuDNN BF16 (target <= 0.710) MET" in lines
    assert "g b=8 turboquant_k8v4_gl: slope 0.600x cuDNN BF16 (target <= 0.580) MISSED" in lines
    assert "g b=8 turboquant_4bit_nc_gl: slope 0.340x cuDNN BF16 (target <= 0.350) MET" in lines
    assert "g b=8 turboquant_3bit_nc_gl: slope 0.410x cuDNN BF16 (target <= 0.300) MISSED" in lines
