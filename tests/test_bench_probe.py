"""bench/probe_layout.py on the CPU (Triton interpreter, tiny shapes): the probe that found the HND and
split-count results runs end to end, and every decode it times agrees across layouts and split counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the probe needs torch")
pytest.importorskip("triton", reason="the probe needs triton")
if torch.cuda.is_available():
    pytest.skip("on a GPU the probe is a benchmark, run by hand (bench/NOTES.md v7)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import probe_layout  # noqa: E402


def test_probe_times_both_layouts_and_split_counts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    code = probe_layout.main(["--device", "cpu", "--contexts", "256", "--batch", "1", "--geometries", "gpt-oss-20b",
                              "--split-counts", "1,2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "differs from the first decode" not in out and "Error" not in out
    rows = json.loads((tmp_path / "probe_layout.json").read_text())["results"]
    got = {(r["layout"], r["what"].split(" n")[0] if r["what"].startswith("decode default") else r["what"]) for r in rows}
    for layout in ("nhd", "hnd"):
        for what in ("read roofline (no math), default tiles", "decode default", "decode splits=1", "decode splits=2"):
            assert (layout, what) in got


def test_probe_sweeps_turboquant_split_counts(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert probe_layout.main(["--device", "cpu", "--tq", "turboquant_4bit_nc", "--contexts", "160", "--batch", "1",
                              "--geometries", "llama-3.1-8b", "--split-counts", "2"]) == 0
    rows = json.loads((tmp_path / "probe_layout.json").read_text())["results"]
    assert [r["what"] for r in rows] == ["tq default splits", "tq splits=2"]
