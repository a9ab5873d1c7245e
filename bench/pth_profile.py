"""What one per-token-head decode call runs on the GPU: its kernels and their GPU time (torch.profiler), the split
count and grid it chose, the compiled kernel's registers and shared memory against the table the split count
assumes (`decode_attention._PTH_PROGRAM_SIZE`), and whether the call captures in a CUDA graph.

    python bench/pth_profile.py [--batch 8] [--context 32768] [--formats int4_per_token_head,...]
"""

from __future__ import annotations

import argparse
import collections

import torch

from kvpolicy.kernels import decode_attention as da
from kvpolicy.kernels.formats import PTH_FORMATS
from kvpolicy.kernels.launch import span, split_count
from kvpolicy.kernels.paged_store import allocate_pth_cache, store_kv_pth

GEOMETRIES = {"llama-3.1-8b": (32, 8, 128), "gpt-oss-20b": (64, 8, 64)}


def compiled_kernels() -> dict[str, tuple]:
    """Every compiled variant of the paged kernel: key -> (registers, spills, shared bytes, stages)."""
    found = {}
    for entry in getattr(da._decode_attention_kernel, "device_caches", {}).values():
        for key, k in entry[0].items():
            md = getattr(k, "metadata", None)
            found[str(key)] = (getattr(k, "n_regs", None), getattr(k, "n_spills", None), getattr(md, "shared", None),
                               getattr(md, "num_stages", None))
    return found


def case(geom: tuple[int, int, int], fmt: str, batch: int, context: int, device: torch.device) -> tuple:
    hq, hkv, d = geom
    pages = batch * (context // 16)
    cache = allocate_pth_cache(pages, 16, hkv, d, fmt, device)
    tables = torch.randperm(pages, device=device, dtype=torch.int64).to(torch.int32).view(batch, context // 16)
    slots = (tables.long()[:, :, None] * 16 + torch.arange(16, device=device)).flatten()
    for chunk in slots.split(1 << 16):
        kv = torch.randn(chunk.numel(), hkv, d, device=device, dtype=torch.bfloat16)
        store_kv_pth(kv, kv * 0.5, cache, chunk, fmt)
    query = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return query, cache, tables, seq_lens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--formats", default=",".join(PTH_FORMATS))
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args()
    device = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, batch {args.batch}, context {args.context}")
    for name, geom in GEOMETRIES.items():
        for fmt in args.formats.split(","):
            q, cache, tables, seq_lens = case(geom, fmt, args.batch, args.context, device)
            before = compiled_kernels()
            out = da.decode_attention_pth(q, cache, tables, seq_lens, fmt)
            torch.cuda.synchronize()
            d = geom[2]
            cfg = da.pth_config(d, fmt, device)
            pps = da.pth_programs_per_sm(d, fmt, device)
            splits = split_count(args.batch, geom[1], span(tables, 16, None, cfg.block_n), cfg.block_n, pps, device,
                                 pow2_fill=0.85)
            table = da._PTH_PROGRAM_SIZE[(fmt, 64 if d <= 64 else 128)]
            print(f"\n## {name} {fmt}: {cfg}, table (regs, smem) {table} -> {pps} programs/SM, {splits} splits, "
                  f"grid {geom[1]} x {splits} x {args.batch} = {geom[1] * splits * args.batch} programs")
            for key, size in compiled_kernels().items():
                if key not in before:
                    print(f"  compiled: regs {size[0]} spills {size[1]} shared {size[2]} stages {size[3]}")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                    torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(args.calls):
                    da.decode_attention_pth(q, cache, tables, seq_lens, fmt, out=out)
                torch.cuda.synchronize()
            gpu = collections.defaultdict(lambda: [0, 0.0])
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    gpu[ev.name][0] += 1
                    gpu[ev.name][1] += ev.device_time_total
            total = 0.0
            for kname, (n, us) in sorted(gpu.items(), key=lambda kv: -kv[1][1]):
                total += us
                print(f"  {n / args.calls:4.1f}/call {us / args.calls:8.1f} us/call  {kname[:90]}")
            print(f"  GPU total {total / args.calls:.1f} us/call")
            try:
                graph = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    da.decode_attention_pth(q, cache, tables, seq_lens, fmt, out=out)
                torch.cuda.current_stream().wait_stream(s)
                with torch.cuda.graph(graph):
                    da.decode_attention_pth(q, cache, tables, seq_lens, fmt, out=out)
                graph.replay()
                torch.cuda.synchronize()
                print("  CUDA graph capture: ok")
            except Exception as exc:  # noqa: BLE001 - reported, the point of the check
                print(f"  CUDA graph capture FAILED: {type(exc).__name__}: {str(exc)[:150]}")
            del q, cache, tables, seq_lens, out
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
