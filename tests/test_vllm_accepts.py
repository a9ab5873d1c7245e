"""vLLM 0.33 itself accepts every argument list `recommend` emits for the fixtures, and refuses what kvpolicy refuses.

Where vLLM 0.33 is installed and named by `VLLM033_PYTHON` (skipped otherwise),
`tests/vllm033_engine.py` builds `EngineArgs.create_engine_config()` on the CPU platform from
each fixture folder and the flags recommend printed: the config must build, with the same
max_model_len, TP size and (after vLLM resolves `auto` for the checkpoint) the same cache dtype.
Then the refusals: a context above the model's limit and a TP size the attention heads do not
divide must be refused by both. One vLLM process runs every case (importing vLLM takes a minute).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvpolicy.errors import LimitError
from kvpolicy.facts.limits import smallest_tp
from kvpolicy.inputs.catalog import resolve_gpu
from kvpolicy.inputs.hfconfig import load_hf_config
from kvpolicy.inputs.workload import make_workload
from kvpolicy.outputs.recommend import recommend
from kvpolicy.rules.validate import load_policy

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
ENGINE = Path(__file__).parent / "vllm033_engine.py"
VLLM033 = Path(os.environ.get("VLLM033_PYTHON", "/nonexistent"))
"""Opt-in (about a minute per architecture on a busy CPU): set VLLM033_PYTHON to vLLM 0.33's python."""
FOLDERS = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file() and not p.name.startswith("broken"))
REFUSED = {  # name -> (fixture, how kvpolicy's inputs break a limit vLLM enforces)
    "phi-4-context": ("phi-4", {"context": 16384 + 1024}),
    "mistral-context": ("mistral-7b-instruct-v0.3", {"context": "64k"}),
    "qwen3-moe-1m": ("qwen3-30b-a3b", {"context": "1m"}),
    "llama-tp3": ("llama-3.1-8b-instruct", {"tp": 3}),
    "glm-4.7-flash-tp8": ("glm-4.7-flash", {"tp": 8}),  # MLA, 20 attention heads
}
# A TP size that divides the attention heads but not the KV heads (phi-4 at tp 4: 40 and 10) passes vLLM's
# config check and fails later, in QKVParallelLinear while the model is built; the config cannot show it.


def _accepted_case(name: str) -> dict:
    """recommend's flags for one fixture: H100 (B200 for NVFP4 weights), context min(32k, the limit), the
    smallest valid TP at which it starts."""
    loaded = load_policy()
    arch = load_hf_config(FIXTURES / name)
    gpu = resolve_gpu("b200" if "nvfp4" in name else "h100")
    ctx = min(32768, arch.max_model_len)
    wl = make_workload(loaded, context=ctx)
    rec = recommend(arch, gpu, wl, loaded)
    if rec.blockers:
        tp = smallest_tp(arch, gpu, wl, rec.decision.kv_cache_dtype, rec.decision.skip_layers) or 64
        wl = make_workload(loaded, context=ctx, tp=tp)
        rec = recommend(arch, gpu, wl, loaded)
    want_dtype = arch.auto_kv_dtype if rec.decision.kv_cache_dtype == "auto" else rec.decision.kv_cache_dtype
    return {"folder": str(FIXTURES / name), "args": rec.vllm_args, "want": {
        "max_model_len": ctx, "tp": wl.tp, "cache_dtype": want_dtype}}


def _refused_case(name: str) -> dict:
    folder, change = REFUSED[name]
    loaded = load_policy()
    arch = load_hf_config(FIXTURES / folder)
    wl = make_workload(loaded, **change)
    with pytest.raises(LimitError):
        recommend(arch, resolve_gpu("h100"), wl, loaded)
    # What a user would pass to vLLM for that workload, had kvpolicy printed it.
    return {"folder": str(FIXTURES / folder),
            "args": ["--tensor-parallel-size", str(wl.tp), "--max-model-len", str(wl.context_tokens)]}


@pytest.fixture(scope="module")
def vllm_results() -> dict[str, dict]:
    if not VLLM033.exists():
        pytest.skip("set VLLM033_PYTHON to a vLLM 0.33 interpreter to build its engine config from the fixtures")
    cases = {f"accept:{n}": _accepted_case(n) for n in FOLDERS}
    cases |= {f"refuse:{n}": _refused_case(n) for n in REFUSED}
    stdin = "".join(json.dumps({"folder": c["folder"], "args": c["args"]}) + "\n" for c in cases.values())
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_ALLOW_LONG_MAX_MODEL_LEN", None)
    proc = subprocess.run([str(VLLM033), str(ENGINE)], input=stdin, capture_output=True, text=True, env=env,
                          timeout=3000, check=False)
    lines = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == len(cases), proc.stderr[-3000:]
    return {name: {**case, "got": got} for (name, case), got in zip(cases.items(), lines)}


@pytest.mark.parametrize("name", FOLDERS)
def test_vllm_accepts_what_recommend_emits(vllm_results, name):
    case = vllm_results[f"accept:{name}"]
    got = case["got"]
    if not got["ok"] and got["stage"] == "config":
        pytest.skip(f"vLLM 0.33 cannot read this config here: {got['error'][:200]}")
    assert got["ok"], (case["args"], got["error"])
    assert {k: got[k] for k in ("max_model_len", "tp", "cache_dtype")} == case["want"], case["args"]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_vllm_refuses_what_kvpolicy_refuses(vllm_results, name):
    got = vllm_results[f"refuse:{name}"]["got"]
    assert not got["ok"] and got["stage"] == "args", got
    key = "tp" if "tp" in REFUSED[name][1] else "context"
    assert ("tensor parallel size" in got["error"]) if key == "tp" else ("max_model_len" in got["error"]), got
