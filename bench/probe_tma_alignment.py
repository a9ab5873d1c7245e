"""Can a TMA tensor copy start at any byte of a row? Copies a [16, W] uint8 box from a [64, 1072]-byte tensor
(8 KV heads x 134-byte turboquant_4bit_nc slots per token row) at inner coordinates 0, 6, 16 and 134, with
and without a shared-memory swizzle, and compares each with torch. GPU only (sm_90).

Why: a TurboQuant slot (134 or 196 bytes at head_dim 128) of head h starts at byte h x slot of the token
row, a multiple of 2 only. Measured on an H200 (bench/NOTES_TQ.md, sixth session): only the 16-byte
aligned starts copy; the others fail the launch, so a TMA producer cannot fetch vLLM's NHD slots per head.

Usage: python bench/probe_tma_alignment.py   (each case in its own process: a failed copy poisons the context)
"""
from __future__ import annotations

import subprocess
import sys

import torch


def case(width: int, col: int, swizzle: bool) -> bool:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    @gluon.jit
    def copy_box(desc, out_ptr, col, W: gl.constexpr):
        buf = gl.allocate_shared_memory(gl.uint8, [16, W], desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        mbarrier.expect(bar, 16 * W)
        tma.async_copy_global_to_shared(desc, [16, col], bar, buf)
        mbarrier.wait(bar, 0)
        lay: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
        r = gl.arange(0, 16, layout=gl.SliceLayout(1, lay))
        c = gl.arange(0, W, layout=gl.SliceLayout(0, lay))
        gl.store(out_ptr + r[:, None] * W + c[None, :], buf.load(lay))

    src = torch.randint(0, 255, (64, 1072), dtype=torch.uint8, device="cuda")
    layout = (gl.NVMMASharedLayout.get_default_for([16, width], gl.uint8) if swizzle
              else gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2))
    desc = TensorDescriptor(src, [64, 1072], [1072, 1], [16, width], layout)
    out = torch.zeros(16, width, dtype=torch.uint8, device="cuda")
    copy_box[(1,)](desc, out, col, W=width, num_warps=4)
    torch.cuda.synchronize()
    return bool((out == src[16:32, col:col + width]).all())


def main() -> None:
    if len(sys.argv) == 4:
        print("match" if case(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1") else "mismatch")
        return
    print("| box width | start byte | swizzle | result |\n|---|---|---|---|")
    for width, col, swizzle in [(64, 0, 1), (64, 16, 1), (64, 6, 1), (64, 6, 0), (16, 6, 0), (128, 6, 1),
                                (16, 134, 0), (16, 144, 0)]:
        run = subprocess.run([sys.executable, __file__, str(width), str(col), str(swizzle)], capture_output=True,
                             text=True, timeout=120)
        lines = run.stdout.strip().splitlines()
        errors = [ln for ln in run.stderr.splitlines() if "error" in ln.lower()] or ["?"]
        result = lines[-1] if run.returncode == 0 and lines else f"failed: {errors[0].strip()[:90]}"
        print(f"| {width} | {col} | {'yes' if swizzle else 'no'} | {result} |", flush=True)


if __name__ == "__main__":
    main()
