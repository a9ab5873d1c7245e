"""`kvpolicy bench` and `kvpolicy verify` end to end on the CPU (torch references, small shapes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpolicy.cli import build_parser, main
from kvpolicy.commands.runtime import _resolve, parse_batches, parse_contexts
from kvpolicy.errors import InputError

HEAVY = ("torch", "triton", "transformers", "matplotlib", "numpy")


def mini_oss(tmp_path: Path) -> Path:
    """A gpt-oss-shaped config.json (sliding window 32 beside full layers, sinks), four layers."""
    folder = tmp_path / "mini-oss"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "gpt_oss", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "hidden_size": 256, "sliding_window": 32, "vocab_size": 512,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "max_position_embeddings": 131072}))
    return folder


def test_contexts_and_batches_parse():
    assert parse_contexts("1k..128k") == [1024 * 2**i for i in range(8)]
    assert parse_contexts("4k,32k,1k..2k") == [1024, 2048, 4096, 32768]
    assert parse_contexts("300..1000") == [300, 600, 1000]
    assert parse_batches("8,1") == [1, 8]
    for bad in ("128k..1k", "", "abc"):
        with pytest.raises(InputError):
            parse_contexts(bad)
    with pytest.raises(InputError):
        parse_batches("0")


@pytest.mark.parametrize("command", ["bench", "verify"])
def test_help_loads_no_heavy_module(command):
    code = (f"import sys; from kvpolicy.cli import main\ntry: main(['{command}', '--help'])\nexcept SystemExit: pass\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def modelled_clock(step):
    """A deterministic stand-in for the clock: KV bytes read at the prepared context, plus a fixed cost per layer.

    CPU reference timings at small contexts are noise; the record path is tested on a clean line.
    """
    context = int(step._prepared.seq_lens[0])
    read = sum(p.bytes_per_token * min(context, p.window or context) for p in step.plans if p.has_cache)
    return 1e-7 * read + 0.01 * len(step.plans) + (0.002 if step.variant.kind != "bf16" else 0.0), "modelled"


def test_bench_on_the_cpu_writes_json_plot_and_records(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    from kvpolicy.runtime import bench
    from kvpolicy.runtime.record import record_bench
    from kvpolicy.runtime.results import BenchResult

    real = bench.time_step
    calls = []

    def clock(step):
        calls.append(real(step))  # the real step still runs every layer through the references
        return modelled_clock(step)

    monkeypatch.setattr(bench, "time_step", clock)
    folder = mini_oss(tmp_path)
    policy = tmp_path / "measured.yaml"
    args = ["bench", "--model", str(folder), "--gpu", "h100", "--device", "cpu", "--contexts", "64,128,256",
            "--compare", "turboquant_4bit_nc", "--out", str(tmp_path / "out"), "--format", "json"]
    # CPU reference timings never become evidence for a GPU: refused before anything runs
    assert main([*args, "--record", str(policy)]) == 2
    err = capsys.readouterr().err
    assert "CPU torch references" in err and "nothing was recorded" in err
    assert not policy.exists() and not calls
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert json.loads((tmp_path / "out" / "bench-mini-oss-h100-sxm.json").read_text()) == result
    names = [v["name"] for v in result["variants"]]
    # BF16 first; the FP8 lines the engine's break-even facts read are always measured.
    assert names[0] == "bf16" and {"fp8", "fp8_skip_sliding", "turboquant_4bit_nc"} <= set(names)
    assert result["environment"]["backend"] == "reference"
    assert len(result["points"]) == len(names) * 3 == len(calls)
    fits = {f["variant"]: f for f in result["fits"]}
    # Half the bytes per token of context (only full layers grow past the window).
    assert fits["fp8"]["slope_ratio"] == fits["fp8_skip_sliding"]["slope_ratio"] == pytest.approx(0.5, abs=1e-3)
    assert fits["fp8_skip_sliding"]["break_even_tokens"] > fits["fp8"]["break_even_tokens"] >= 0
    assert any("CPU run" in w for w in result["warnings"])
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "out" / "bench-mini-oss-h100-sxm.png").stat().st_size > 1000
    except ImportError:
        assert "pip install matplotlib" in err
    # the same lines as a run of the kernels on that GPU would record them
    measured = BenchResult.model_validate(result)
    with pytest.raises(InputError, match="CPU torch references"):
        record_bench(measured, policy)
    measured.environment = measured.environment.model_copy(update={"device": "NVIDIA H100 80GB HBM3",
                                                                   "backend": "triton"})
    assert record_bench(measured, policy) == "bench-itl-mini-oss-h100-sxm"
    code = main(["recommend", "--model", str(folder), "--gpu", "h100", "--policy", str(policy), "--format", "json"])
    rec = json.loads(capsys.readouterr().out)
    assert rec["estimates"]["itl_slope_ratio"]["provenance"] == "measured"


def test_verify_record_on_the_cpu_is_refused(tmp_path, capsys):
    pytest.importorskip("torch")
    policy = tmp_path / "acc.yaml"
    code = main(["verify", "--model", "gpt-oss-20b", "--gpu", "h100", "--device", "cpu", "--contexts", "256,1k",
                 "--batch", "1", "--compare", "fp8", "--out", str(tmp_path), "--record", str(policy)])
    err = capsys.readouterr().err
    assert code == 2 and "accuracy (the exact float64 answer)" in err and not policy.exists()


def test_bench_refuses_a_single_context(tmp_path, capsys):
    pytest.importorskip("torch")
    code = main(["bench", "--model", str(mini_oss(tmp_path)), "--gpu", "h100", "--device", "cpu",
                 "--contexts", "128"])
    assert code == 2 and "at least two different context lengths" in capsys.readouterr().err


def test_verify_on_the_cpu_gives_recovery_and_verdicts(tmp_path, capsys):
    pytest.importorskip("torch")
    code = main(["verify", "--model", "gpt-oss-20b", "--gpu", "h100", "--device", "cpu", "--contexts", "256,1k",
                 "--batch", "1", "--compare", "turboquant_3bit_nc", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads((tmp_path / "verify-gpt-oss-20b-h100-sxm.json").read_text())
    assert result["geometry"] == {"layer": 1, "kind": "full", "num_q_heads": 64, "num_kv_heads": 8, "head_dim": 64}
    by = {(p["variant"], p["context_tokens"]): p for p in result["points"]}
    # The decision at 1k is BF16; FP8 appears only through --compare, so only the 3-bit format and BF16 run.
    assert {v for v, _ in by} == {"bf16", "turboquant_3bit_nc"}
    assert all(by[("bf16", c)]["hits"] == by[("bf16", c)]["trials"] == 64 for c in (256, 1024))
    # gpt-oss alternates sliding (window 128) and full layers: both geometries are tested.
    assert [g["kind"] for g in result["geometries"]] == ["full", "sliding"]
    assert ("bf16", 128) in by
    verdict = {v["variant"]: v for v in result["verdicts"]}["turboquant_3bit_nc"]
    assert verdict["verdict"] in ("pass", "keep_bf16", "undecided") and verdict["min_recovery"] is not None
    assert verdict["recovery_low"] <= verdict["min_recovery"] <= verdict["recovery_high"]
    assert "needle recovery" in out and "model-level check: skipped" in out


def test_bench_measures_flashinfer_decisions_on_hnd_pages(tmp_path):
    """On Blackwell the default policy sends FP8 to FLASHINFER, whose vLLM backend keeps each KV head's page
    contiguous (HND); the runtime allocates its caches that way, and says so in the result."""
    pytest.importorskip("torch")
    out = tmp_path / "out"
    code = main(["bench", "--model", str(mini_oss(tmp_path)), "--gpu", "b200", "--device", "cpu",
                 "--contexts", "8k,32k", "--batch", "1", "--no-plot", "--out", str(out), "--format", "json"])
    assert code == 0
    result = json.loads(next(out.glob("bench-*.json")).read_text())
    assert result["decision"]["attention_backend"] == "FLASHINFER"
    assert {v["cache_layout"] for v in result["variants"]} == {"HND"}


def test_bench_table_names_the_gluon_kernels_where_layers_ran_them(tmp_path, capsys):
    """The text report says when FP8 layers ran the Hopper Gluon kernel (e4m3 query), and stays silent
    where none did (here: a CPU run, then the same result as an H200 run would record it)."""
    pytest.importorskip("torch")
    from kvpolicy.commands.runtime import _print_bench
    from kvpolicy.runtime.results import BenchResult

    out = tmp_path / "out"
    code = main(["bench", "--model", str(mini_oss(tmp_path)), "--gpu", "h200", "--device", "cpu",
                 "--contexts", "8k,32k", "--batch", "1", "--no-plot", "--out", str(out), "--format", "json"])
    assert code == 0
    capsys.readouterr()
    result = BenchResult.model_validate_json(next(out.glob("bench-*.json")).read_text())
    _print_bench(result)
    assert "Gluon" not in capsys.readouterr().out
    fp8 = next(v for v in result.variants if v.kv_cache_dtype == "fp8")
    fp8.layer_paths = {"gluon": [0, 1, 2, 3]}
    _print_bench(result)
    printed = " ".join(capsys.readouterr().out.split())
    assert f"FP8 layers of {fp8.name} on the Gluon kernel" in printed
    assert "TurboQuant layers" not in printed
    # a TurboQuant variant whose layers ran the Gluon TurboQuant kernel is named as such, not as FP8
    tq = fp8.model_copy(update={"name": "turboquant_4bit_nc", "kv_cache_dtype": "turboquant_4bit_nc"})
    result.variants.append(tq)
    _print_bench(result)
    printed = " ".join(capsys.readouterr().out.split())
    assert "TurboQuant layers of turboquant_4bit_nc on the Gluon kernel (planar pages)" in printed
    assert f"FP8 layers of {fp8.name} on" in printed and "FP8 layers of turboquant" not in printed


@pytest.mark.parametrize("command", ["bench", "verify"])
def test_bench_and_verify_read_gpu_names_as_recommend_does(command: str, capsys):
    pytest.importorskip("torch")
    parser, _ = build_parser(command)
    _, gpu, _, rec = _resolve(parser.parse_args(["-m", "llama-3.1-8b", "-g", "2x RTX 4090", "--device", "cpu"]), 4096)
    assert (gpu.id, rec.workload.tp) == ("rtx-4090", 2)
    code = main([command, "-m", "llama-3.1-8b", "-g", "rtx 4091", "--device", "cpu"])
    assert code == 2 and "unknown GPU `rtx 4091`. Did you mean `rtx-4090`" in capsys.readouterr().err


def test_verify_of_a_bf16_decision_says_it_compares_bf16_with_itself(tmp_path, capsys):
    pytest.importorskip("torch")
    code = main(["verify", "--model", "llama-3.1-8b", "--device", "cpu", "--contexts", "256,512", "--batch", "1",
                 "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "no GPU in use and no --gpu: deciding for h100" in err  # README shows --gpu as optional
    assert "compares BF16 with itself" in err and "--compare fp8" in err
    result = json.loads(next(tmp_path.glob("verify-llama-3.1-8b-*.json")).read_text())
    assert result["verdicts"] == [] and any("--compare fp8" in w for w in result["warnings"])


def test_verify_header_counts_the_trials_the_table_shows(tmp_path, capsys):
    """--trials 1 still runs a whole sequence, one trial per query head (32 on Llama): the header says what ran."""
    pytest.importorskip("torch")
    code = main(["verify", "--model", "llama-3.1-8b", "--gpu", "h100", "--device", "cpu", "--contexts", "256,512",
                 "--trials", "1", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    printed = " ".join(out.split())
    assert "; 32 trials per context (1 asked; each sequence gives one per query head)" in printed
    assert "/32" in printed and "1 trial per context" not in printed
