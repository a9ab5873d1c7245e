"""`kvpolicy plan`: traffic parsing, the candidates from the rules, the load model against the studies, the
CLI and `POST /v1/plan`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpolicy.cli import main
from kvpolicy.errors import InputError
from kvpolicy.facts.estimates import Figures
from kvpolicy.inputs.catalog import resolve_gpu, resolve_model
from kvpolicy.inputs.traffic import parse_slo, parse_traffic
from kvpolicy.inputs.workload import Workload
from kvpolicy.outputs.plan import PlanResult, plan
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.validate import load_policy

LOADED = load_policy(None)


def run_plan(model: str, gpu: str, gpus: int, traffic: str, slo: str = "") -> PlanResult:
    return plan(resolve_model(model), resolve_gpu(gpu), gpus, parse_traffic(traffic),
                parse_slo(slo), LOADED, accuracy_floor=0.95)


def option(result: PlanResult, oid: str):
    return next(o for o in result.options if o.id == oid)


# -- inputs ----------------------------------------------------------------------------------


def test_traffic_and_slo_parse_units():
    t = parse_traffic("isl=20k,osl=1k,rate=120/min")
    assert (t.isl, t.osl, t.rate, t.concurrency) == (20480, 1024, 2.0, None)
    assert parse_traffic("isl=1000,osl=200,concurrency=64").concurrency == 64
    s = parse_slo("ttft=1500ms,tpot=0.04s")
    assert (s.ttft_s, s.tpot_ms) == (1.5, 40.0)


@pytest.mark.parametrize("text, words", [
    ("isl=20k,rate=2/s", "missing osl="),
    ("isl=20k,osl=1k", "give the load"),
    ("isl=20k,osl=1k,rate=2/s,concurrency=8", "either rate="),
    ("isl=20k,osl=1k,concurrency=8,burst=4", "burst="),
    ("isl=20k,osl=1k,qps=3", "not one of"),
    ("isl=20k,osl=1k,rate=fast", "not a rate"),
])
def test_bad_traffic_is_a_clear_error(text, words):
    with pytest.raises(InputError, match=words):
        parse_traffic(text)


def test_cli_bad_input_exits_2(capsys):
    code = main(["plan", "-m", "llama-3.1-8b", "-g", "h100", "-t", "isl=20k,osl=1k", "--slo", "ttft=2s"])
    assert code == 2 and "give the load" in capsys.readouterr().err
    code = main(["plan", "-m", "llama-3.1-8b", "-g", "h100", "-t", "isl=2k,osl=1k,rate=1/s", "--slo", "ttft=soon"])
    assert code == 2 and "not a duration" in capsys.readouterr().err


# -- candidates and capacity come from the rules and the allocator ----------------------------


def test_candidates_are_what_the_rules_choose():
    # gpt-oss-20b is hybrid (sliding window 128): the rules quantize it with the sliding layers kept BF16
    # and never choose TurboQuant for it.
    r = run_plan("gpt-oss-20b", "h100", 1, "isl=20k,osl=2k,concurrency=8")
    assert [o.id for o in r.options] == ["auto@tp1", "fp8+skip@tp1"]
    assert option(r, "fp8+skip@tp1").decision.skip_layers == ["sliding_window"]
    assert "turboquant_4bit_nc" in {e.kv_cache_dtype for e in r.excluded}
    # Ampere: no FP8 tensor cores, so e5m2 storage is the candidate and fp8 is not.
    a = run_plan("llama-3.1-8b", "a100", 1, "isl=8k,osl=1k,rate=1/s")
    assert {o.kv_cache_dtype for o in a.options} == {"auto", "fp8_e5m2"}
    fp8 = next(e for e in a.excluded if e.kv_cache_dtype == "fp8")
    assert "fp8_compute" in fp8.reason  # KV101/KV107: no FP8 tensor cores
    # Each candidate carries the engine's trace with its dtype pinned.
    trace = option(r, "fp8+skip@tp1").trace
    assert trace is not None and trace.fields["kv_cache_dtype"].decided_by == "pin:plan-candidate"
    assert trace.fields["skip_layers"].decided_by.startswith("KV")


def test_capacity_is_the_allocator_plan_at_isl_plus_osl():
    r = run_plan("llama-3.3-70b", "h100", 4, "isl=16k,osl=1k,concurrency=34")
    arch, gpu = resolve_model("llama-3.3-70b"), resolve_gpu("h100")
    wl = Workload(context_tokens=17408, concurrency=34, tp=4)
    fig = Figures(LOADED.policy, arch, gpu, wl)
    for dtype in ("auto", "fp8", "turboquant_4bit_nc"):
        o = option(r, f"{dtype}@tp4")
        assert o.capacity_requests.value == fig.max_concurrency(dtype)
        rec = recommend(arch, gpu, wl.model_copy(update={"concurrency": 1}), LOADED)
        if dtype == rec.decision.kv_cache_dtype:
            assert o.kv_capacity_tokens.value == rec.estimates.kv_capacity_tokens.value
    # FP8 holds twice BF16's tokens, TurboQuant 4bit_nc more (boundary layers stay BF16).
    caps = {d: option(r, f"{d}@tp4").kv_capacity_tokens.value for d in ("auto", "fp8", "turboquant_4bit_nc")}
    assert caps["fp8"] == pytest.approx(2 * caps["auto"], rel=0.01)
    assert 2 * caps["auto"] < caps["turboquant_4bit_nc"] < 3.7 * caps["auto"]
    # TP 1 cannot hold the 141 GB of weights: no option there.
    assert {o.tp for o in r.options} == {4, 2}


# -- the studies' load figures (direction and rough size; errors in README `kvpolicy plan`) --------


def test_llama_70b_memory_bound_ttft_on_4_h100():
    """TurboQuant study: bursty load on 4x H100, BF16 ~17 s, TurboQuant < 3.5 s, FP8 ~1.3 s TTFT.

    The study does not publish the burst's lengths; 34 clients of 16k in / 1k out is a load where BF16's
    cache (28 requests) is full and FP8's (57) is not, the regime the study describes."""
    r = run_plan("llama-3.3-70b", "h100", 4, "isl=16k,osl=1k,concurrency=34", "ttft=2s")
    bf16, fp8, tq = (option(r, f"{d}@tp4") for d in ("auto", "fp8", "turboquant_4bit_nc"))
    assert 17 / 2 < bf16.ttft.value < 17 * 2          # model 16.2 s
    assert 1.3 / 2 < fp8.ttft.value < 1.3 * 2         # model 1.38 s
    assert fp8.ttft.value < tq.ttft.value < 3.5       # model 1.44 s
    assert bf16.running == 28 and bf16.capacity_requests.value == 28
    # TurboQuant's TPOT under load: the study says 1.5-2.5x BF16's (model 1.47x).
    assert 1.2 < tq.tpot.value / bf16.tpot.value < 2.5
    assert r.chosen is not None and r.chosen.option == "fp8@tp4"


def test_llama_8b_fp8_throughput_at_concurrency_8():
    """FP8 study: Llama-3.1-8B on H100, concurrency 8, ~20k in, ~2k out: +14.9% output tok/s (450.3 -> 517.5)."""
    r = run_plan("llama-3.1-8b", "h100", 1, "isl=20k,osl=2k,concurrency=8")
    bf16, fp8 = option(r, "auto@tp1"), option(r, "fp8@tp1")
    gain = fp8.tokens_per_s_per_gpu.value / bf16.tokens_per_s_per_gpu.value - 1
    assert 0.05 < gain < 0.30                                               # model +23.3%
    assert bf16.tokens_per_s_per_gpu.value == pytest.approx(450.3, rel=0.15)  # model 454.6
    assert bf16.decode_slope.provenance == "measured" and fp8.decode_intercept.provenance == "measured"


def test_gpt_oss_fp8_skip_sliding_throughput_at_concurrency_8():
    """FP8 study: gpt-oss-20b FP8 skip-SW +4.8% output tok/s (831.6 -> 871.8) at the same load."""
    r = run_plan("gpt-oss-20b", "h100", 1, "isl=20k,osl=2k,concurrency=8")
    bf16, fp8 = option(r, "auto@tp1"), option(r, "fp8+skip@tp1")
    gain = fp8.tokens_per_s_per_gpu.value / bf16.tokens_per_s_per_gpu.value - 1
    assert 0.0 < gain < 0.12                                                # model +6.6%


# -- load regimes ---------------------------------------------------------------------------


def test_open_loop_saturation_is_said_plainly():
    r = run_plan("llama-3.1-8b", "h100", 1, "isl=20k,osl=2k,rate=50/s", "ttft=2s")
    for o in r.options:
        assert o.saturated and o.ttft.value is None
        assert any("saturated" in f for f in o.failures)
    assert r.chosen is None and r.closest is not None


def test_open_loop_uses_littles_law():
    r = run_plan("llama-3.1-8b", "h100", 1, "isl=4k,osl=512,rate=2/s")
    o = option(r, "auto@tp1")
    assert not o.saturated
    # Little: running = rate x time in system; time in system >= TTFT + (osl - 1) x TPOT.
    in_system = o.running / 2.0
    assert in_system == pytest.approx(o.ttft.value + 511 * o.tpot.value / 1e3, rel=0.05)
    assert o.tokens_per_s_per_gpu.value == pytest.approx(2.0 * 512, rel=1e-3)


def test_more_gpus_add_replicas():
    one = run_plan("llama-3.1-8b", "h100", 1, "isl=8k,osl=1k,rate=1/s")
    two = run_plan("llama-3.1-8b", "h100", 2, "isl=8k,osl=1k,rate=1/s")
    tp1 = option(two, "auto@tp1")
    assert tp1.replicas == 2 and {o.tp for o in two.options} == {1, 2}
    assert tp1.running < option(one, "auto@tp1").running


def test_one_request_is_singular_in_the_load_note():
    r = run_plan("llama-3.3-70b", "h100", 2, "isl=30k,osl=4k,concurrency=3")
    assert option(r, "fp8@tp2").load_note.startswith("2 of 3 clients wait for KV room (1 request fits): ")


def test_burst_waves_make_bf16_wait():
    r = run_plan("llama-3.3-70b", "h100", 4, "isl=8k,osl=1k,burst=100")
    bf16, fp8 = option(r, "auto@tp4"), option(r, "fp8@tp4")
    assert "2 waves" in bf16.load_note and "1 wave " in fp8.load_note
    assert bf16.ttft.value > fp8.ttft.value


# -- CLI, plot, service ----------------------------------------------------------------------


def test_cli_json_round_trips_and_table_names_the_choice(capsys):
    argv = ["plan", "-m", "llama-3.1-8b", "-g", "h100", "-t", "isl=20k,osl=2k,concurrency=8", "--slo", "tpot=40ms"]
    assert main([*argv, "--format", "json"]) == 0
    result = PlanResult.model_validate_json(capsys.readouterr().out)
    assert result.chosen is not None and result.chosen.option == "fp8@tp1"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "chosen     fp8@tp1" in out and "--kv-cache-dtype fp8" in out and "runner-up" in out
    assert "vllm serve meta-llama/Llama-3.1-8B-Instruct --kv-cache-dtype fp8" in out


def test_table_command_names_the_model_as_apply_loads_it(capsys):
    """A local config prints its folder (what `kvpolicy apply` hands vLLM), never a placeholder or config.json."""
    folder = Path(__file__).parent / "fixtures" / "hf" / "llama-3.1-8b-instruct"
    for spec in (folder, folder / "config.json"):
        assert main(["plan", "-m", str(spec), "-g", "h100", "-t", "isl=20k,osl=2k,concurrency=8"]) == 0
        out = capsys.readouterr().out
        assert f"vllm serve {folder.resolve()} --kv-cache-dtype" in out, out


def test_plot_writes_a_png_and_keeps_an_existing_file(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "pareto.png"
    argv = ["plan", "-m", "llama-3.1-8b", "-g", "h100", "-t", "isl=8k,osl=1k,concurrency=16", "--slo",
            "ttft=1s,tpot=30ms", "--plot", str(png)]
    assert main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    png.write_bytes(b"mine")
    assert main(argv) == 2 and png.read_bytes() == b"mine"
    assert "--force" in capsys.readouterr().err


def test_plan_loads_no_heavy_modules():
    probe = (
        "import sys, io, contextlib\n"
        "from kvpolicy.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    code = main(['plan', '-m', 'gpt-oss-20b', '-g', 'h100', '-t', 'isl=8k,osl=1k,rate=1/s'])\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'triton', 'vllm', 'matplotlib', "
        "'starlette', 'numpy'})\n"
        "print(code, ','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "120"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0"], out.stdout


def test_service_plan_is_the_cli_function():
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    import kvpolicy.service.app as service
    from kvpolicy.service.reload import PolicyHolder

    client = TestClient(service.create_app(PolicyHolder("builtin:default")), raise_server_exceptions=False)
    body = {"model": "llama-3.1-8b", "gpu": "h100", "traffic": {"isl": "20k", "osl": 2048, "concurrency": 8},
            "slo": {"tpot_ms": 40}}
    r = client.post("/v1/plan", json=body)
    assert r.status_code == 200, r.text
    got = PlanResult.model_validate(r.json())
    want = run_plan("llama-3.1-8b", "h100", 1, "isl=20k,osl=2k,concurrency=8", "tpot=40ms")
    assert got.model_dump() == want.model_dump()
    bad = client.post("/v1/plan", json={**body, "traffic": {"isl": 1024, "osl": 128}})
    assert bad.status_code == 422 and "give the load" in bad.json()["detail"]
    assert "serve-plan-request.schema.json" in bad.json()["detail"]
    unknown = client.post("/v1/plan", json={**body, "model": "no-such-model"})
    assert unknown.status_code == 404 and unknown.json()["error"] == "unknown_model"
    assert client.post("/v1/plan", json={**body, "gpus": "4"}).status_code == 422
    # `2xh100` is two GPUs when `gpus` is left out; a `gpus` that says otherwise is refused.
    two = client.post("/v1/plan", json={**body, "gpu": "2x H100"})
    assert two.status_code == 200, two.text
    assert two.json() == client.post("/v1/plan", json={**body, "gpus": 2}).json()
    clash = client.post("/v1/plan", json={**body, "gpu": "2xh100", "gpus": 4})
    assert clash.status_code == 422 and clash.json()["location"] == "gpus"
    assert "names 2 GPUs but gpus is 4" in clash.json()["detail"]
    # A count out of range is a bad field, not an unknown GPU.
    huge = client.post("/v1/plan", json={**body, "gpu": "h100x2000"})
    assert (huge.status_code, huge.json()["error"], huge.json()["location"]) == (422, "invalid_request", "gpu")


def test_cli_gpu_count_is_the_gpus_unless_given(capsys):
    argv = ["plan", "-m", "llama-3.1-8b", "-t", "isl=8k,osl=1k,rate=1/s", "-f", "json"]
    assert main([*argv, "-g", "h100x2"]) == 0
    named = PlanResult.model_validate_json(capsys.readouterr().out)
    assert named.model_dump() == run_plan("llama-3.1-8b", "h100", 2, "isl=8k,osl=1k,rate=1/s").model_dump()
    assert main([*argv, "-g", "2xh100", "--gpus", "4"]) == 2
    assert "--gpu `2xh100` names 2 GPUs but --gpus is 4" in capsys.readouterr().err


def test_plan_models_are_documented():
    from kvpolicy.outputs.fielddocs import field_docstrings, model_tree
    from kvpolicy.service.plan_api import PlanRequest

    for root in (PlanResult, PlanRequest):
        for model in model_tree(root):
            if not model.__module__.startswith("kvpolicy"):
                continue
            docs: dict[str, str] = {}
            for klass in reversed(model.__mro__):
                if klass.__module__.startswith("kvpolicy"):
                    docs.update(field_docstrings(klass))
            assert not [n for n in model.model_fields if not docs.get(n)], model.__name__


def test_json_has_no_infinities(capsys):
    assert main(["plan", "-m", "llama-3.1-8b", "-g", "h100", "-t", "isl=20k,osl=2k,rate=50/s", "-f", "json"]) == 0
    json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_counts_of_one_take_the_singular():
    """One GPU, a burst of one request, one prefill chunk, one request in a block, one admitted request."""
    o = option(run_plan("llama-3.1-8b", "h100", 1, "isl=8,osl=8,burst=1"), "fp8@tp1")
    assert o.tokens_per_s_per_gpu.basis.endswith("x 1 replica / 1 GPU")
    assert o.load_note.startswith("1 request in 1 wave of up to")
    assert "+ 1 chunk step" in o.ttft.basis and "chunk steps" not in o.ttft.basis
    assert "1 full group x 1 block of 16 tokens" in o.capacity_requests.basis
    tight = option(run_plan("llama-3.1-70b", "h100", 2, "isl=60k,osl=1k,rate=100/s"), "fp8@tp2")
    assert "is the most 1 admitted request completes;" in tight.load_note
