"""Decode and store kernels for every KV format kvpolicy measures, with their float64 torch references.

- `formats`: the format registry (bits, slot and planar page layouts, per-format constants); pure Python.
- `launch`: what every split-KV decode kernel shares: SM count and residency, split count, each split's tile
  range, the partial outputs and their merge; `gluon_runs_on`.
- `decode_attention`: BF16/FP8, the portable Triton kernel and the entry point (`decode_attention`), which sends
  FP8 calls on Hopper to `decode_gluon` (TMA pages, fp8 wgmma).
- `tq_decode`: TurboQuant, the portable Triton kernel and the entry point (`decode_attention_tq`), which sends
  planar caches on Hopper to `tq_gluon` (FP8 keys: k8v4) or `tq_warp` (centroid keys, per-warp mma.sync).
- `turboquant`: TurboQuant's math (Lloyd-Max codebooks, Hadamard rotation, planar page order, PTX unpackers).
- `paged_store`, `tq_store`: the store kernels; `reference`, `tq_reference`: the float64 references.
- `reductions`: reductions that also run under the Triton interpreter.

Figures: bench/RESULTS.md; the designs that won and lost: bench/KERNELS.md.
"""
