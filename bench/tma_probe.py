"""Does a TMA box copy from a start column that is not on a 16-byte boundary? (Hopper, Gluon; run on the GPU.)

    python3 bench/tma_probe.py

Each case copies one [16, C] box at column `col` of a 2-D tensor (rows of 528 bytes: two KV heads of vLLM's
264-byte per-token-head rows) into shared memory and back, in a subprocess of its own (a failed copy poisons
the CUDA context). Why it matters: vLLM's per-token-head rows put odd KV heads 8 bytes off a 16-byte boundary
and the value codes 4 or 12 bytes off, so `pth_gluon.py` copies them with cp.async instead (bench/KERNELS.md).
"""
from __future__ import annotations

import subprocess
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

CASES = [("u8", 128, 0, 128), ("u8", 128, 264, 128), ("u8", 128, 132, 128), ("u8", 128, 8, 128), ("u8", 64, 36, 64),
         ("i32", 4, 32, 0), ("i32", 4, 62, 0), ("i32", 4, 33, 0)]
"""(element type, box columns, start column in elements, swizzle bytes): byte offsets 0, 264, 132, 8, 36, 128,
248, 132."""


@gluon.jit
def _copy(desc, out_ptr, row, col, R: gl.constexpr, C: gl.constexpr):
    buf = gl.allocate_shared_memory(desc.dtype, [R, C], desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, R * C * desc.dtype.primitive_bitwidth // 8)
    tma.async_copy_global_to_shared(desc, [row, col], bar, buf)
    mbarrier.wait(bar, 0)
    lay: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
    x = buf.load(lay)
    r = gl.arange(0, R, layout=gl.SliceLayout(1, lay))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, lay))
    gl.store(out_ptr + r[:, None] * C + c[None, :], x)
    mbarrier.invalidate(bar)


def probe(kind: str, cols: int, col: int, swizzle: int) -> str:
    dtype = {"u8": torch.uint8, "i32": torch.int32}[kind]
    src = torch.arange(64 * 528, device="cuda", dtype=torch.int32).to(torch.uint8).view(64, 528).view(dtype)
    width = src.shape[1]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=src.element_size() * 8, rank=2)
    desc = TensorDescriptor(src, [64, width], [width, 1], [16, cols], layout)
    out = torch.empty(16, cols, dtype=dtype, device="cuda")
    _copy[(1,)](desc, out, 16, col, 16, cols, num_warps=4)
    torch.cuda.synchronize()
    ok = torch.equal(out, src[16:32, col:col + cols])
    return "copied right" if ok else "WRONG bytes"


def main() -> int:
    if len(sys.argv) == 5:
        print(probe(sys.argv[1], *map(int, sys.argv[2:])))
        return 0
    print("| box | start byte | result |\n|---|---|---|")
    for kind, cols, col, swizzle in CASES:
        args = [sys.executable, __file__, kind, str(cols), str(col), str(swizzle)]
        r = subprocess.run(args, capture_output=True, check=False, text=True, timeout=120)
        err = [ln for ln in r.stderr.splitlines() if "Error" in ln]
        result = r.stdout.strip() or (err[-1].split(": ", 1)[-1] if err else f"exit {r.returncode}")
        size = 4 if kind == "i32" else 1
        print(f"| [16, {cols * size} B] | {col * size} | {result} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
