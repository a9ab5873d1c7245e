"""The embedded runtime: a Decision onto per-layer paged caches and kernel calls, on the user's GPU.

variants (what to measure) -> caches (per-layer plan and allocation, the KV-bytes formula) -> ops
(store/decode: Triton on CUDA, torch references elsewhere) -> step (one decode step over all layers)
-> bench (timing, fits, plot, record) and needle/verify/hfcheck (accuracy). Imported only by the
`bench` and `verify` commands: torch and triton load here, never at `kvpolicy` start-up.
"""
