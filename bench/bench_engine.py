"""Throughput of the rules engine: (model, GPU, context, priority) combinations per second.

Usage: python bench/bench_engine.py [--n 10000]

Evaluates N combinations drawn in a fixed cycle over the catalogs, in one
process, through the same `recommend()` the CLI calls (facts, rules, estimates,
trace), and prints the wall time. Also times `decide()` alone.
"""

from __future__ import annotations

import argparse
import itertools
import time

from kvpolicy.errors import LimitError
from kvpolicy.facts.limits import check_request
from kvpolicy.inputs.arch import ModelArch
from kvpolicy.inputs.catalog import load_gpus, load_models
from kvpolicy.facts.build import build_facts
from kvpolicy.rules.engine import decide
from kvpolicy.rules.validate import load_policy
from kvpolicy.inputs.workload import Workload, make_workload
from kvpolicy.outputs.recommend import recommend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    args = parser.parse_args()
    loaded = load_policy()
    models = list(load_models().values())
    gpus = [g for g in load_gpus().values() if g.vendor == "nvidia"]
    contexts = [2048, 4096, 8192, 32768, 131072]
    priorities = ["decode", "prefill", "balanced"]
    workloads = {(c, p): make_workload(loaded, context=c, priority=p, tp=8) for c in contexts for p in priorities}
    # Contexts above a model's limit (or a TP its heads do not divide) are refused before any decision: left out.
    allowed = [(m, c) for m in models for c in contexts if _accepted(m, workloads[(c, priorities[0])])]
    product = [(m, g, c, p) for m, c in allowed for g in gpus for p in priorities]
    combos = list(itertools.islice(itertools.cycle(product), args.n))

    t0, c0 = time.perf_counter(), time.process_time()
    dtypes: dict[str, int] = {}
    for arch, gpu, ctx, prio in combos:
        r = recommend(arch, gpu, workloads[(ctx, prio)], loaded)
        dtypes[r.decision.kv_cache_dtype] = dtypes.get(r.decision.kv_cache_dtype, 0) + 1
    full, full_cpu = time.perf_counter() - t0, time.process_time() - c0

    t0, c0 = time.perf_counter(), time.process_time()
    for arch, gpu, ctx, prio in combos:
        decide(loaded.policy, build_facts(arch, gpu, workloads[(ctx, prio)], loaded.policy))
    engine, engine_cpu = time.perf_counter() - t0, time.process_time() - c0

    print(f"combinations: {args.n} ({len(allowed)} of {len(models)} models x {len(contexts)} contexts within the "
          f"models' limits, x {len(gpus)} GPUs x {len(priorities)} priorities, cycled), tp=8")
    print(f"facts + decide() (the engine):                    {engine:.3f} s wall, {engine_cpu:.3f} s CPU "
          f"({engine / args.n * 1e6:.0f} us each)")
    print(f"recommend() (+ estimates, validated trace, JSON-ready): {full:.3f} s wall, {full_cpu:.3f} s CPU "
          f"({full / args.n * 1e6:.0f} us each)")
    print("decisions:", dict(sorted(dtypes.items())))


def _accepted(arch: ModelArch, workload: Workload) -> bool:
    try:
        check_request(arch, workload)
    except LimitError:
        return False
    return True


if __name__ == "__main__":
    main()
