"""kvpolicy/facts/backends.yaml against vLLM 0.33's own backend classes.

The classes are imported by a vLLM 0.33 install's python in a subprocess (kvpolicy never
imports vLLM): /work/venv033, or $KVPOLICY_VLLM033_PYTHON. Skipped where there is none.
The CUDA extension vLLM's platform module loads at import cannot load without a driver, so
the probe stands an empty module in for it; only class attributes and pure methods are read.
What depends on the machine (FlashAttention's versions, FlashMLA's build) is not compared.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvpolicy.facts.backends import AttentionShape, matrix, priority_list, refusals

PYTHON = os.environ.get("KVPOLICY_VLLM033_PYTHON", "/work/venv033/bin/python")
CCS = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0)]
SIZES = [32, 64, 80, 96, 128, 192, 256, 320, 512, 576]
# Import fails without a GPU (they allocate or load CUDA code at import).
NOT_IMPORTABLE_ON_CPU = {"CUTLASS_MLA", "FLASH_ATTN_MLA"}
# supports_head_size / supports_sink / per-head scales read the installed FlashAttention versions.
PLATFORM_DEPENDENT = {"FLASH_ATTN", "FLASHINFER"}

PROBE = r"""
import json, sys, types, logging
sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
logging.disable(logging.WARNING)
import torch
import vllm
from vllm.platforms.interface import DeviceCapability
from vllm.platforms.cuda import _get_backend_priorities
from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
req = json.loads(sys.argv[1])
out = {"version": vllm.__version__, "backends": {}, "priorities": {}}
for name in req["backends"]:
    try:
        c = E[name].get_class()
    except Exception as exc:
        out["backends"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        continue
    row = {"kv": list(c.supported_kv_cache_dtypes), "mla": c.is_mla(), "sparse": c.is_sparse(),
           "cc": [a * 10 + b for a, b in req["ccs"] if c.supports_compute_capability(DeviceCapability(a, b))],
           "sizes": [s for s in req["sizes"] if c.supports_head_size(s)],
           "sliding": c.supports_sliding_window()}
    if name not in req["platform_dependent"]:
        row["sink"] = c.supports_sink()
        row["per_head"] = c.supports_per_head_quant_scales()
    out["backends"][name] = row
for key, (mla, cc, heads, dtype, head) in req["priority_cases"].items():
    out["priorities"][key] = [b.name for b in _get_backend_priorities(
        use_mla=mla, device_capability=DeviceCapability(*cc), num_heads=heads, kv_cache_dtype=dtype, head_size=head)]
fi = E["FLASHINFER"].get_class()
out["flashinfer_combination"] = {
    f"{d}|{a}{b}|{h}|{s}": fi.supports_combination(h, torch.bfloat16, d, None, False, s, False, False,
                                                   DeviceCapability(a, b))
    for d in ("nvfp4", "nvfp4_4over6", "fp8") for a, b in ((9, 0), (10, 0), (12, 0)) for h in (64, 128)
    for s in (False, True)}
fs = E["FLASHMLA_SPARSE"].get_class()
out["flashmla_sparse_combination"] = {
    f"{d}|{a}{b}": fs.supports_combination(576, torch.bfloat16, d, None, True, False, True, False,
                                           DeviceCapability(a, b))
    for d in ("fp8_ds_mla", "nvfp4_ds_mla", "fp8") for a, b in ((9, 0), (10, 0))}
print("KVPOLICY-MATRIX " + json.dumps(out))
"""

PRIORITY_CASES = {
    "standard_sm90": (False, (9, 0), 32, "fp8", 128),
    "standard_sm100": (False, (10, 0), 32, "fp8", 128),
    "mla_sm90": (True, (9, 0), 16, "fp8", 576),
    "mla_sm100_fp8": (True, (10, 0), 16, "fp8", 576),
    "mla_sm100_bf16_few": (True, (10, 0), 16, "auto", 576),
    "mla_sm100_bf16_many": (True, (10, 0), 64, "auto", 576),
    "mla_sm90_head512": (True, (9, 0), 16, "auto", 512),
}


@pytest.fixture(scope="module")
def vllm033() -> dict:
    if not Path(PYTHON).is_file():
        pytest.skip(f"no vLLM 0.33 python at {PYTHON} (set KVPOLICY_VLLM033_PYTHON)")
    req = {"backends": list(matrix().backends), "ccs": CCS, "sizes": SIZES,
           "platform_dependent": sorted(PLATFORM_DEPENDENT), "priority_cases": PRIORITY_CASES}
    done = subprocess.run([PYTHON, "-c", PROBE, json.dumps(req)], capture_output=True, text=True, timeout=600,
                          check=False, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("KVPOLICY-MATRIX ")]
    assert lines, done.stderr[-3000:]
    data = json.loads(lines[-1].removeprefix("KVPOLICY-MATRIX "))
    if not data["version"].startswith("0.33."):
        pytest.skip(f"{PYTHON} has vLLM {data['version']}, not 0.33")
    return data


def refusals_for_sizes(name: str, shape: AttentionShape) -> list[str]:
    return [r for r in refusals(name, "auto", None, shape) if r.startswith("head_size")]


@pytest.mark.parametrize("name", list(matrix().backends))
def test_row_matches_the_backend_class(vllm033, name):
    row = matrix().backends[name]
    got = vllm033["backends"][name]
    if "error" in got:
        assert name in NOT_IMPORTABLE_ON_CPU, got["error"]
        pytest.skip(f"{name} does not import without a GPU: {got['error']}")
    assert row.kv_dtypes == got["kv"], "supported_kv_cache_dtypes"
    assert (row.kind != "standard") == got["mla"] and (row.kind == "sparse_mla") == got["sparse"]
    assert [c for c in row.sm if c in {a * 10 + b for a, b in CCS}] == got["cc"], "supports_compute_capability"
    assert bool(row.sliding_window) == got["sliding"], "supports_sliding_window"
    shape_kind = row.kind
    matrix_sizes = [s for s in SIZES
                    if not refusals_for_sizes(name, AttentionShape(kind=shape_kind, head_sizes=(s,)))]
    if name == "FLASH_ATTN":
        # Up to 256 everywhere; 257-512 only where FlashAttention 4 runs (not on this CPU).
        assert [s for s in matrix_sizes if s <= 256] == got["sizes"]
    else:
        assert matrix_sizes == got["sizes"], "supports_head_size"
    if "sink" in got:
        assert bool(row.sinks) == got["sink"], "supports_sink"
        assert bool(row.per_head_scales) == got["per_head"], "supports_per_head_quant_scales"


def test_auto_selection_order_matches_platforms_cuda(vllm033):
    p = matrix().priorities
    unmodelled = set(matrix().unavailable)
    for key, (mla, cc, heads, dtype, head) in PRIORITY_CASES.items():
        kind = "standard" if not mla else "mla"
        dense = priority_list(cc[0] * 10 + cc[1], AttentionShape(kind=kind, head_sizes=(head,), num_heads=heads), dtype)
        got = vllm033["priorities"][key]
        assert set(dense) <= set(got), (key, dense, got)
        # Same relative order for every backend both know.
        both = [b for b in got if b in dense]
        assert both == [b for b in dense if b in got], key
        missing = [b for b in got if b not in dense and b not in p.get("mla", []) and b not in unmodelled]
        sparse_known = {b for k, v in p.items() if k.startswith("sparse") for b in v}
        assert all(b in sparse_known for b in missing), (key, missing)


def test_supports_combination_refusals_match(vllm033):
    for key, reason in vllm033["flashinfer_combination"].items():
        dtype, cc, head, sink = key.split("|")
        shape = AttentionShape(kind="standard", head_sizes=(int(head),), sinks=sink == "True")
        ours = [r for r in refusals("FLASHINFER", dtype, int(cc), shape, runtime=False)
                if "supports_combination" in r]
        assert bool(ours) == (reason is not None), (key, reason, ours)
    for key, reason in vllm033["flashmla_sparse_combination"].items():
        dtype, cc = key.split("|")
        shape = AttentionShape(kind="sparse_mla", head_sizes=(576,), qk_nope_head_dim=128)
        ours = [r for r in refusals("FLASHMLA_SPARSE", dtype, int(cc), shape, runtime=False)
                if "supports_combination" in r]
        assert bool(ours) == (reason is not None), (key, reason, ours)
