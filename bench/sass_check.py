"""The sm_90 code of every default decode path, compiled on a machine without a GPU: record it, compare two trees.

    python bench/sass_check.py record OUT.json [--only REGEX]     # this tree (or PYTHONPATH=TREE for another)
    python bench/sass_check.py compare OLD.json NEW.json
    python bench/sass_check.py show OUT.json CASE                 # resources and the main loop's opcode mix

`record` runs the real entry points (`decode_attention`, `decode_attention_tq`, the stores) on CPU tensors that
report an H200 (`CASES`: every format and kernel, head_dim 64 and 128, with and without splits, window and
sinks), and each `kernel[grid](...)` compiles through Triton's own binder with warmup=True, so the signature,
specialisation and constexprs are the launchers' own and nothing is launched. Per launch it keeps the SASS
(Triton's bundled cuobjdump), the PTX without debug lines, registers, shared memory, stack and spills. The
Gluon kernels need the Triton the device runs (3.6): `pip install triton==3.6.0` into a venv of its own.
Why it matters: bench/KERNELS.md; a change that keeps the SASS keeps the speed.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import types

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

CUDA = torch.device("cuda", 0)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class _OnGpu(torch.Tensor):
    """A CPU tensor that reports the GPU: the launchers take their GPU paths."""

    @property
    def device(self):
        return CUDA

    @property
    def is_cuda(self):
        return True


def _cpu(x):
    if isinstance(x, torch.device) and x.type == "cuda" or isinstance(x, str) and x.startswith("cuda"):
        return "cpu"
    return x


def _wrap(x):
    if isinstance(x, torch.Tensor) and not isinstance(x, _OnGpu):
        return x.as_subclass(_OnGpu)
    return type(x)(_wrap(y) for y in x) if isinstance(x, (tuple, list)) else x


class _FakeH200(TorchFunctionMode):
    """Every allocation on the CPU, every result reporting the GPU."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        if func is torch.Tensor.to:
            args = tuple(_cpu(a) for a in args)
        return _wrap(func(*args, **kwargs))


class _Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return CUDA

    def is_active(self):
        return True


LAUNCHES: list = []


def _install() -> None:
    """An H200 for torch.cuda's queries and Triton's driver; launches compile (warmup) and are recorded."""
    props = types.SimpleNamespace(multi_processor_count=132, shared_memory_per_multiprocessor=233472,
                                  max_threads_per_multi_processor=2048, name="NVIDIA H200", major=9, minor=0)
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.current_device = lambda: 0
    torch.cuda.is_current_stream_capturing = lambda: False
    triton.runtime.driver.set_active(_Driver())
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def warm(self, *args, grid, warmup, **kwargs):
        k = run(self, *args, grid=grid, warmup=True, **kwargs)
        LAUNCHES.append((self.fn.__name__, k.result() if hasattr(k, "result") else k))

    JITFunction.run = warm


# --------------------------------------------------------------------------- cases

GEOMS = {128: 32, 64: 64}  # head_dim -> query heads, 8 KV heads: the Llama and gpt-oss layers
SHAPES = {"b8_32k": (8, 32768, None, False), "b1_128k": (1, 131072, None, True), "b8_win": (8, 131072, 128, True),
          "b64_4k": (64, 4096, None, True), "b8_128k": (8, 131072, None, False), "b1_4k": (1, 4096, None, False)}
"""(batch, context, sliding window, sinks): split and unsplit calls, the first-wave weight, window and sinks."""
TQ = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")


def _inputs(shape: str, d: int):
    batch, context, window, sinks = SHAPES[shape]
    q = torch.randn(batch, GEOMS[d], d, device="cuda").to(torch.bfloat16)
    bt = torch.zeros(batch, -(-context // 16), dtype=torch.int32, device="cuda")
    sl = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return q, bt, sl, window, (torch.zeros(GEOMS[d], device="cuda") if sinks else None)


def _paged(kind: str, d: int, shape: str, layout: str = "NHD", **kw) -> None:
    from kvpolicy.kernels.decode_attention import decode_attention

    q, bt, sl, window, sinks = _inputs(shape, d)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float8_e4m3fn
    dims = (64, 8, 16, d) if layout == "HND" else (64, 16, 8, d)
    k, v = (torch.empty(dims, dtype=dtype, device="cuda") for _ in range(2))
    if layout == "HND":
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    scales = (torch.ones(8, device="cuda"), torch.ones(8, device="cuda")) if kind == "fp8" else (None, None)
    decode_attention(q, k, v, bt, sl, k_scale=scales[0], v_scale=scales[1], sliding_window=window, sinks=sinks, **kw)


def _tq(fmt: str, d: int, shape: str, kernel: str) -> None:
    from kvpolicy.kernels.tq_decode import decode_attention_tq
    from kvpolicy.kernels.turboquant import allocate_tq_cache, allocate_tq_planar_cache

    q, bt, sl, window, sinks = _inputs(shape, d)
    cache = (allocate_tq_planar_cache if kernel == "gluon" else allocate_tq_cache)(64, 16, 8, d, fmt, "cuda")
    decode_attention_tq(q, cache, bt, sl, fmt, sliding_window=window, sinks=sinks, kernel=kernel)


def _store(fmt: str, d: int, planar: bool = False) -> None:
    key, value = (torch.randn(40, 8, d, device="cuda").to(torch.bfloat16) for _ in range(2))
    slots = torch.arange(40, dtype=torch.int64, device="cuda")
    if fmt in ("bf16", "fp8"):
        from kvpolicy.kernels.paged_store import store_kv

        dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
        k, v = (torch.empty(64, 16, 8, d, dtype=dtype, device="cuda") for _ in range(2))
        scale = torch.ones(8, device="cuda") if fmt == "fp8" else None
        return store_kv(key, value, k, v, slots, scale, scale)
    from kvpolicy.kernels.tq_store import store_kv_tq
    from kvpolicy.kernels.turboquant import allocate_tq_cache, allocate_tq_planar_cache

    store_kv_tq(key, value, (allocate_tq_planar_cache if planar else allocate_tq_cache)(64, 16, 8, d, fmt, "cuda"),
                slots, fmt)


def _pth(fmt: str, d: int, shape: str, layout: str = "NHD", **kw) -> None:
    from kvpolicy.kernels.decode_attention import decode_attention_pth
    from kvpolicy.kernels.paged_store import allocate_pth_cache

    q, bt, sl, window, sinks = _inputs(shape, d)
    decode_attention_pth(q, allocate_pth_cache(64, 16, 8, d, fmt, "cuda", layout), bt, sl, fmt, sliding_window=window,
                         sinks=sinks, **kw)


def _store_pth(fmt: str, d: int) -> None:
    from kvpolicy.kernels.paged_store import allocate_pth_cache, store_kv_pth

    key = torch.randn(40, 8, d, device="cuda").to(torch.bfloat16)
    store_kv_pth(key, key, allocate_pth_cache(64, 16, 8, d, fmt, "cuda"), torch.arange(40, device="cuda"), fmt)


def _config(block_n: int, stages: int):
    from kvpolicy.kernels.decode_attention import DecodeConfig

    return DecodeConfig(block_n=block_n, num_stages=stages, defer_sum=False)


PTH = ("fp8_per_token_head", "int8_per_token_head", "int4_per_token_head")


def cases() -> list[tuple[str, functools.partial]]:
    """(name, call) of every default path compared."""
    P, out = functools.partial, []
    for d in (128, 64):
        for shape in ("b8_32k", "b1_128k", "b8_win", "b64_4k"):
            out += [(f"bf16_d{d}_{shape}", P(_paged, "bf16", d, shape)), (f"fp8_d{d}_{shape}", P(_paged, "fp8", d, shape)),
                    (f"fp8gl_d{d}_{shape}", P(_paged, "fp8", d, shape, kernel="gluon", fp8_query=True)),
                    (f"fp8gl_hnd_d{d}_{shape}", P(_paged, "fp8", d, shape, "HND", kernel="gluon", fp8_query=True))]
        out += [(f"bf16_hnd_d{d}_b8_32k", P(_paged, "bf16", d, "b8_32k", "HND")),
                (f"fp8_1level_d{d}_b1_128k", P(_paged, "fp8", d, "b1_128k", two_level=False)),
                (f"fp8q8_d{d}_b8_32k", P(_paged, "fp8", d, "b8_32k", fp8_query=True)),
                (f"fp8gl_1level_d{d}_b1_128k", P(_paged, "fp8", d, "b1_128k", two_level=False, kernel="gluon",
                                                  fp8_query=True))]
        for fmt in TQ:
            short = fmt.removeprefix("turboquant_")
            out += [(f"{short}_triton_d{d}_{s}", P(_tq, fmt, d, s, "triton")) for s in ("b8_32k", "b1_128k", "b8_win")]
            out += [(f"{short}_gl_d{d}_{s}", P(_tq, fmt, d, s, "gluon")) for s in SHAPES]
            out += [(f"store_{short}_d{d}", P(_store, fmt, d)), (f"store_{short}_planar_d{d}", P(_store, fmt, d, True))]
        out += [(f"store_bf16_d{d}", P(_store, "bf16", d)), (f"store_fp8_d{d}", P(_store, "fp8", d))]
        for fmt in PTH:
            short = fmt.removesuffix("_per_token_head") + "_pth"
            out += [(f"{short}_d{d}_{s}", P(_pth, fmt, d, s)) for s in ("b8_32k", "b1_128k", "b8_win")]
            gl_kw = dict(kernel="gluon", fp8_query=fmt == "fp8_per_token_head")
            out += [(f"{short}_gl_d{d}_{s}", P(_pth, fmt, d, s, **gl_kw)) for s in ("b8_32k", "b1_128k", "b8_win")]
            out += [(f"{short}_gl_n64s4_d{d}_b8_32k", P(_pth, fmt, d, "b8_32k", config=_config(64, 4), **gl_kw))]
            if fmt == "fp8_per_token_head":
                out += [(f"{short}_gl_f16q_d{d}_{s}", P(_pth, fmt, d, s, kernel="gluon")) for s in ("b8_32k", "b8_win")]
            out += [(f"{short}_hnd_d{d}_b8_32k", P(_pth, fmt, d, "b8_32k", "HND")), (f"store_{short}_d{d}", P(_store_pth, fmt, d))]
    return out


# --------------------------------------------------------------------------- record, compare, show


def _cuobjdump(kernel, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([os.path.join(BIN, "cuobjdump"), *args, f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def describe(kernel) -> dict:
    """Resources, SASS (addresses and encodings dropped), opcodes, and the PTX without debug lines or labels."""
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", _cuobjdump(kernel, "-res-usage"))
    lines = [ln for ln in _cuobjdump(kernel, "-sass").splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    sass = [re.sub(r"\s*/\*[0-9a-f]{4,}\*/", "", ln).split(";")[0].strip() for ln in lines]
    ops = [(re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", s) or re.match("(.*)", s)).group(1) for s in sass]
    ptx = kernel.asm["ptx"].split("\t.section\t.debug")[0]
    ptx = "\n".join(ln for ln in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__)", ln))
    return dict(regs=int(m.group(1)), stack=int(m.group(2)), local=int(m.group(4)), shared=kernel.metadata.shared,
                n=len(sass), ops=ops, sass="\n".join(sass), ptx=re.sub(r"_param_\d+", "_param_N", ptx))


def record(path: str, only: str | None) -> None:
    _install()
    result = {}
    for name, call in cases():
        if only and not re.search(only, name):
            continue
        LAUNCHES.clear()
        try:
            with _FakeH200():
                call()
            result[name] = [dict(kernel=fn, **describe(k)) for fn, k in LAUNCHES]
        except Exception as exc:  # noqa: BLE001 - one path that does not compile is reported, the rest still run
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(name, result[name]["error"][:200] if isinstance(result[name], dict) else
              ", ".join(f"{d['kernel']} {d['n']} instructions, {d['regs']} registers" for d in result[name]), flush=True)
    with open(path, "w") as fh:
        json.dump(result, fh)


def _params_out(sass: str) -> list[str]:
    return [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][param]", ln) for ln in sass.splitlines()]


def verdict(a: dict, b: dict) -> str:
    """How the code of one launch compares: identical, identical but for kernel-parameter offsets, the same
    instructions in order with some operands changed, the same instruction multiset reordered, or different."""
    if a["sass"] == b["sass"]:
        return "identical"
    if _params_out(a["sass"]) == _params_out(b["sass"]):
        return "identical but the kernel parameters' offsets"
    same_res = all(a[k] == b[k] for k in ("regs", "stack", "local", "shared"))
    if a["ops"] == b["ops"] and same_res:
        nd = sum(x != y for x, y in zip(_params_out(a["sass"]), _params_out(b["sass"])))
        return f"same instructions, {nd} operands differ"
    if collections.Counter(a["ops"]) == collections.Counter(b["ops"]) and same_res:
        return "same instructions reordered" + (" (same PTX)" if a["ptx"] == b["ptx"] else "")
    return "DIFFERENT"


def compare(old_path: str, new_path: str) -> int:
    old, new = (json.load(open(p)) for p in (old_path, new_path))
    tally, differ = collections.Counter(), 0
    for case, a_all in old.items():
        b_all = new.get(case)
        if isinstance(a_all, dict) or not isinstance(b_all, list) or len(a_all) != len(b_all):
            print(f"{case}: launches {a_all if isinstance(a_all, dict) else [a['kernel'] for a in a_all]} -> "
                  f"{b_all if not isinstance(b_all, list) else [b['kernel'] for b in b_all]}")
            differ += 1
            continue
        for a, b in zip(a_all, b_all):
            v = verdict(a, b)
            tally[(b["kernel"], v)] += 1
            differ += v == "DIFFERENT"
            print(f"{case} | {a['kernel']}{'' if a['kernel'] == b['kernel'] else ' -> ' + b['kernel']} | {v} | "
                  f"{a['n']}->{b['n']} instructions, {a['regs']}->{b['regs']} registers, smem {a['shared']}->"
                  f"{b['shared']}, stack {a['stack']}->{b['stack']}, local {a['local']}->{b['local']}")
    print("\n| kernel | verdict | launches |\n|---|---|---|")
    for (kernel, v), n in sorted(tally.items()):
        print(f"| {kernel} | {v} | {n} |")
    return 1 if differ else 0


def show(path: str, case: str) -> None:
    for d in json.load(open(path))[case]:
        print(f"{d['kernel']}: {d['n']} instructions, {d['regs']} registers, shared {d['shared']} B, "
              f"stack {d['stack']} B, local {d['local']} B")
        fam = collections.Counter(op.split(".")[0] for op in d["ops"])
        print("  " + "  ".join(f"{op} {n}" for op, n in fam.most_common(20)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="compile every default path of this tree and record its code")
    r.add_argument("out")
    r.add_argument("--only", help="a regular expression over the case names")
    c = sub.add_parser("compare", help="compare two records launch by launch; exit 1 if any code differs")
    c.add_argument("old")
    c.add_argument("new")
    s = sub.add_parser("show", help="one case's launches: resources and opcode counts")
    s.add_argument("record")
    s.add_argument("case")
    a = ap.parse_args()
    if a.cmd == "record":
        record(a.out, a.only)
        return 0
    if a.cmd == "compare":
        return compare(a.old, a.new)
    show(a.record, a.case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
