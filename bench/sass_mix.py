"""Compile the decode kernels for sm_90 on a machine without a GPU and count SASS instructions.

Why: device time is scarce, and the FP8 decode kernel is instruction-bound
(bench/NOTES.md v2), so the instruction mix of the KV loop predicts its speed.
Usage: python bench/sass_mix.py [--fp8] [--fp8-query] [--head-dim 128] [--block-n 128]
       python bench/sass_mix.py --tq-gluon turboquant_4bit_nc --block-n 64 [--exact-max]
(the loop count of the Gluon kernel covers both edge/non-edge copies and, with the lazy max, the rare
exact-max path: compare variants, not absolute numbers)
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from kvpolicy.kernels import decode_attention as da
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

POINTERS = {"q_ptr": "*bf16", "k_cache_ptr": "*u8", "v_cache_ptr": "*u8", "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "sinks_ptr": "*fp32",
            "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}
FLOATS = {"sm_scale"}


def compile_decode(fp8: bool, fp8_query: bool, head_dim: int, block_n: int, num_warps: int, num_stages: int,
                   group: int, two_level: bool, maxnreg: int | None = None, defer_sum: bool = False,
                   swap_ab: bool = False):
    fn = da._decode_attention_kernel
    constexprs = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
                      NUM_SUB=1, PAGE_SIZE=16, KV_FP8=fp8, FP8_QUERY=fp8_query, HAS_K_SCALE=fp8, HAS_V_SCALE=fp8,
                      K_SCALE_STRIDE=1, V_SCALE_STRIDE=1, HAS_WINDOW=False, HAS_SINKS=False, IS_SPLIT=True,
                      TWO_LEVEL=two_level, SWAP_AB=swap_ab, DEFER_SUM=defer_sum,
                      INTERPRET=False, PDL=False)
    # the cache strides are compile-time constants: a contiguous cache of 8 KV heads, 16-token pages
    for t in "kv":
        constexprs.update({f"stride_{t}b": 16 * 8 * head_dim, f"stride_{t}t": 8 * head_dim, f"stride_{t}h": head_dim})
    pointers = POINTERS if fp8 else {**POINTERS, "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16"}
    aligned = {n for n in fn.arg_names if n.startswith("stride_") and n != "stride_ps"}
    return _compile(fn, constexprs, pointers, FLOATS, aligned, num_warps, num_stages, maxnreg)


def _compile(fn, constexprs: dict, pointers: dict, floats: set, aligned: set, num_warps: int, num_stages: int | None,
             maxnreg: int | None, source=ASTSource):
    """triton.compile for sm_90: pointers and the `aligned` ints marked 16-divisible, other ints i32.
    `source`: the front end (ASTSource, or Gluon's GluonASTSource); num_stages None: its default."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = pointers.get(name) or ("fp32" if name in floats else "i32")
            if name in pointers or name in aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(num_warps=num_warps, **({"num_stages": num_stages} if num_stages else {}),
                   **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(source(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def compile_tq(fmt: str, head_dim: int, block_n: int, num_warps: int, num_stages: int, group: int,
               prefetch: bool, maxnreg: int | None = None, slot: int | None = None):
    """The TurboQuant decode kernel (kernels/tq_decode.py) for `fmt`, 8 KV heads, 16-token pages, split, no sinks."""
    from kvpolicy.kernels import tq_decode as tq
    from kvpolicy.kernels.turboquant import tq_layout

    lay = tq_layout(fmt, head_dim)
    fn = tq._tq_decode_kernel
    constexprs = {"NUM_KV": 8, "GROUP": group, "HEAD_DIM": head_dim, "SLOT": slot or lay.slot_bytes, "PAGE": 16,
                  "KEY_BITS": lay.key_bits, "V_BITS": lay.value_bits, "V_OFF": lay.val_off,
                  "KNORM_OFF": max(lay.knorm_off, 0), "VSCALE_OFF": lay.vscale_off, "VZERO_OFF": lay.vzero_off,
                  "BLOCK_M": max(16, triton.next_power_of_2(group)), "BLOCK_N": block_n, "SPLIT": True,
                  "HAS_WINDOW": False, "HAS_SINKS": False, "ASM": True, "PREFETCH": prefetch}
    pointers = {"q_ptr": "*bf16", "qr_ptr": "*fp16", "cache_u8_ptr": "*u8", "cache_f16_ptr": "*fp16",
                "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "cb_ptr": "*fp16", "sinks_ptr": "*fp32",
                "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}
    return _compile(fn, constexprs, pointers, {"q_scale"}, set(), num_warps, num_stages, maxnreg)


def compile_tq_gluon(fmt: str, head_dim: int, block_n: int, group: int, lazy: bool = True,
                     maxnreg: int | None = None, per_warp: bool = False, pages_ahead: int = 2, sum_pages: bool = False,
                     unroll: bool = False, mma_sums: bool = False, rotate: bool = False,
                     off32: bool = True, fused_splits: int = 0, stamps: bool = False,
                     first_wave: float = 1.0):
    """The Gluon TurboQuant kernel (kernels/tq_gluon.py; per_warp: kernels/tq_warp.py, 1, 2 or 4 pages per warp
    for block_n 64, 128 or 256) for `fmt`, 8 KV heads, planar pages, split, no sinks; fused_splits: the split
    merge in the kernel for that many splits (`TQGluonConfig.fused_merge`); stamps: the probe's timer reads
    (`tq_gluon.STAMPS`)."""
    from kvpolicy.kernels import tq_gluon as tg
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = tg.TQGluonConfig(block_n=block_n, maxnreg=maxnreg, lazy_max=lazy, pages_ahead=pages_ahead)
    constexprs = {**tg.kernel_constexprs(fmt, head_dim, 8 * group, 8, cfg),
                  "HAS_WINDOW": False, "HAS_SINKS": False, "IS_SPLIT": True}
    fn = tg._tq_gluon_kernel
    if per_warp:
        from kvpolicy.kernels import tq_warp as tw

        fn = tw._tq_warp_kernel
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
    if per_warp:
        constexprs.update(tw.layouts(constexprs["KBM"], head_dim, constexprs["V_BITS"], block_n, sum_pages, mma_sums))
        w1, w2 = tw.split_weights(first_wave)
        constexprs.update(UNROLL=unroll, ROTATE=rotate, OFF32=off32, FUSED=fused_splits > 1, STAMPS=stamps,
                          WAVE_W1=w1, WAVE_W2=w2, **tw.merge_blocks(max(fused_splits, 1), head_dim))
    pointers = {"q_ptr": "*bf16" if rotate else "*fp16", "order_ptr": "*i32", "rot_ptr": "*fp16", "cache32_ptr": "*i32", "cache16_ptr": "*i16",
                "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "sinks_ptr": "*fp32", "out_ptr": "*bf16",
                "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "cnt_ptr": "*i32", "stamp_ptr": "*i64"}
    pointers = {k: v for k, v in pointers.items() if k in fn.arg_names}
    return _compile(fn, constexprs, pointers, {"q_scale"}, set(), 4, None, maxnreg, GluonASTSource)


def _on_cubin(kernel, tool: str, *args: str) -> str:
    """stdout of Triton's bundled `tool` (cuobjdump, nvdisasm) run on the kernel's cubin; its stderr as the error."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        r = subprocess.run([os.path.join(BIN, tool), *args, f.name], capture_output=True, text=True, check=False)
    finally:
        os.unlink(f.name)
    if r.returncode:
        raise SystemExit(f"{tool} failed: {r.stderr.strip()}")
    return r.stdout


def sass(kernel) -> str:
    return _on_cubin(kernel, "cuobjdump", "-sass")


def live_counts(kernel) -> str:
    """nvdisasm's listing with the number of live registers at each instruction (`--life-range-mode count`)."""
    return _on_cubin(kernel, "nvdisasm", "-lrm", "count")


def resources(kernel) -> str:
    out = _on_cubin(kernel, "cuobjdump", "-res-usage")
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"registers {m.group(1)}, stack {m.group(2)} B" if m else out.strip()


def _listing(text: str) -> dict[int, str]:
    """cuobjdump's instruction lines by address."""
    out = {}
    for ln in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/", ln)
        if m:
            out[int(m.group(1), 16)] = ln
    return out


def _target(ln: str) -> int | None:
    """A branch's target (cuobjdump prints absolute addresses; `BRA P5, 0x...` has a second predicate)."""
    m = re.search(r"BRA\s+(?:!?U?P\d, )?0x([0-9a-f]+)", ln)
    return int(m.group(1), 16) if m else None


def _main_loop(at: dict[int, str]) -> tuple[int, int]:
    """(head, backward branch) of the longest loop."""
    back = [(a, t) for a, ln in at.items() if (t := _target(ln)) is not None and t < a]
    end, head = max(back, key=lambda b: b[0] - b[1])
    return head, end


def _mix(lines) -> collections.Counter:
    ops = collections.Counter()
    for ln in lines:
        m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", ln)
        if m:
            ops[m.group(1)] += 1
    return ops


def loop_mix(text: str) -> collections.Counter:
    """Opcode counts of the largest backward-branch loop body."""
    at = _listing(text)
    head, end = _main_loop(at)
    return _mix(at[a] for a in sorted(at) if head <= a <= end)


def common_path(text: str, tiles: int = 0) -> tuple[int, int, collections.Counter]:
    """(instructions, tiles) on the Gluon TurboQuant kernel's common path through its loop: the path from the
    loop head to the backward branch with the most MMAs and, among those, the fewest instructions: it takes
    the non-edge copy of `_attend`, the lazy max's skip of the exact-max redo, and every tile of an unrolled
    loop (`TQGluonConfig.unroll`); per thread. Tiles: `tiles`, or the loop iteration's tiles of the warpgroup
    kernel (two wgmma per tile). Also the path's opcode counts."""
    at = _listing(text)
    head, end = _main_loop(at)
    # address -> (-MMAs to the end, count to the end, next address)
    best: dict[int, tuple[int, int, int | None]] = {end: (0, 1, None)}
    for pc in sorted((a for a in at if head <= a < end), reverse=True):
        t, ln = _target(at[pc]), at[pc]
        conditional = bool(re.search(r"\*/\s+@", ln) or re.search(r"BRA\s+!?U?P\d,", ln))
        nxt = [pc + 16] if t is None or t <= pc or conditional else []
        nxt += [t] if t is not None and t > pc else []
        n = min((n for n in nxt if n in best), key=lambda n: best[n][:2])
        best[pc] = (best[n][0] - bool(re.search(r"\b(HMMA|IMMA|HGMMA|QGMMA)", ln)), 1 + best[n][1], n)
    arrives, pc, path = 0, head, []
    while pc is not None:
        arrives += "WARPGROUP.ARRIVE" in at[pc]
        path.append(at[pc])
        pc = best[pc][2]
    return best[head][1], tiles or max(1, arrives // 2), _mix(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--fp8-query", action="store_true")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=2)
    ap.add_argument("--one-level", action="store_true")
    ap.add_argument("--maxnreg", type=int)
    ap.add_argument("--swap", action="store_true", help="DecodeConfig.swap_ab (wgmma form)")
    ap.add_argument("--defer-sum", action="store_true", help="DecodeConfig.defer_sum")
    ap.add_argument("--tq", metavar="FORMAT", help="count the TurboQuant kernel for this format instead")
    ap.add_argument("--tq-gluon", metavar="FORMAT", help="count the Gluon TurboQuant kernel (planar pages) instead")
    ap.add_argument("--exact-max", action="store_true", help="Gluon TurboQuant: TQGluonConfig.lazy_max off")
    ap.add_argument("--per-warp", action="store_true", help="Gluon TurboQuant: the per-warp kernel (tq_warp.py)")
    ap.add_argument("--sum-pages", action="store_true", help="per-warp kernel: TQGluonConfig.sum_pages")
    ap.add_argument("--unroll", action="store_true", help="per-warp kernel: TQGluonConfig.unroll")
    ap.add_argument("--mma-sums", action="store_true", help="per-warp kernel: TQGluonConfig.mma_sums")
    ap.add_argument("--rotate", action="store_true", help="per-warp kernel: TQGluonConfig.rotate_query")
    ap.add_argument("--fused-splits", type=int, default=0,
                    help="per-warp kernel: the split merge in the kernel (TQGluonConfig.fused_merge) for N splits")
    ap.add_argument("--first-wave", type=float, default=1.0,
                    help="per-warp kernel: TQGluonConfig.first_wave_weight (weighted splits, split-major grid)")
    ap.add_argument("--stamps", action="store_true", help="per-warp kernel: the probe's timer reads (tq_gluon.STAMPS)")
    ap.add_argument("--off64", action="store_true", help="per-warp kernel: 64-bit page offsets (caches of 8 GiB or more)")
    ap.add_argument("--pages-ahead", type=int, default=2, help="Gluon TurboQuant: TQGluonConfig.pages_ahead")
    ap.add_argument("--prefetch", action="store_true", help="TurboQuant: register prefetch of the next tile")
    ap.add_argument("--slot", type=int, help="TurboQuant: slot stride in bytes (padding experiments)")
    ap.add_argument("--dump", help="write the full SASS here")
    ap.add_argument("--live", help="write nvdisasm's live-register count per instruction here (where the registers go; "
                    "nvdisasm refuses kernels of 255 registers)")
    a = ap.parse_args()
    if a.tq_gluon:
        k = compile_tq_gluon(a.tq_gluon, a.head_dim, a.block_n, a.group, not a.exact_max, a.maxnreg, a.per_warp, a.pages_ahead,
                             a.sum_pages, a.unroll, a.mma_sums, a.rotate, not a.off64, a.fused_splits, a.stamps,
                             a.first_wave)
    elif a.tq:
        k = compile_tq(a.tq, a.head_dim, a.block_n, a.num_warps, a.num_stages, a.group, a.prefetch, a.maxnreg, a.slot)
    else:
        k = compile_decode(a.fp8, a.fp8_query, a.head_dim, a.block_n, a.num_warps, a.num_stages, a.group, not a.one_level, a.maxnreg,
                           a.defer_sum, a.swap)
    text = sass(k)
    if a.live:
        with open(a.live, "w") as f:
            f.write(live_counts(k))
    if a.dump:
        with open(a.dump, "w") as f:
            f.write(text)
            f.write("\n\n// TTGIR\n" + k.asm["ttgir"])
    ops = loop_mix(text)
    total = sum(ops.values())
    if a.tq or a.tq_gluon:
        from kvpolicy.kernels.turboquant import tq_layout
        kv_bytes = a.block_n * tq_layout(a.tq or a.tq_gluon, a.head_dim).slot_bytes
    else:
        kv_bytes = a.block_n * a.head_dim * 2 * (1 if a.fp8 else 2)
    print(f"shared {k.metadata.shared} B; {resources(k)}")
    bars = sum(n for op, n in ops.items() if op.startswith("BAR"))
    print(f"loop: {total} instructions per thread per tile of {kv_bytes // 1024} KB = {total / (kv_bytes / 1024):.1f}/KB, "
          f"{total * a.num_warps / (kv_bytes / 1024):.1f} warp-instructions/KB, {bars} barriers")
    fam = collections.Counter()
    for op, n in ops.items():
        fam[op.split(".")[0]] += n
    if a.tq_gluon:
        n, tiles, path_ops = common_path(text, 2 if a.unroll else 0)
        print(f"common path: {n / tiles:.1f} instructions per thread per tile, "
              f"{n * a.num_warps / (tiles * a.block_n):.1f} warp-instructions per (token, KV head)")
        print("  common path: " + "  ".join(f"{op} {k}" for op, k in path_ops.most_common(24)))
    print("  " + "  ".join(f"{op} {n}" for op, n in fam.most_common(18)))
    print("  " + "  ".join(f"{op} {n}" for op, n in ops.most_common() if op.startswith(("LDS", "LDSM", "STS", "LDG", "F2FP", "F2F", "HMMA", "HGMMA", "QGMMA"))))


if __name__ == "__main__":
    main()
