"""Cold-start wall time of `kvpolicy recommend` (a new process each run).

Usage: python bench/bench_startup.py [--runs 21]

Each run starts the installed `kvpolicy` console script in a fresh process and
waits for it to exit; the table reports the median and spread per output format.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    exe = shutil.which("kvpolicy", path=str(Path(sys.executable).parent)) or shutil.which("kvpolicy")
    if exe is None:
        sys.exit("kvpolicy is not installed in this environment (pip install -e .)")
    base = [exe, "recommend", "--model", "gpt-oss-20b", "--gpu", "h100"]
    cases = {"table": base, "json": base + ["--format", "json"], "args": base + ["--format", "args"],
             "python -c pass": [sys.executable, "-c", "pass"]}
    env = {**os.environ, "COLUMNS": "120"}
    # With PYTHONDONTWRITEBYTECODE an editable install recompiles every kvpolicy module on each start:
    # that is not what an installed kvpolicy (whose .pyc files pip writes) costs a user.
    if env.pop("PYTHONDONTWRITEBYTECODE", None):
        print("note: PYTHONDONTWRITEBYTECODE unset for these runs (cached bytecode, as an installed package has)")
    print(f"{'case':<16} {'median s':>9} {'min s':>7} {'max s':>7}   ({args.runs} runs, {os.cpu_count()} CPUs)")
    for name, argv in cases.items():
        subprocess.run(argv, capture_output=True, env=env, check=True)  # warm the file cache
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            subprocess.run(argv, capture_output=True, env=env, check=True)
            times.append(time.perf_counter() - t0)
        print(f"{name:<16} {statistics.median(times):>9.3f} {min(times):>7.3f} {max(times):>7.3f}")


if __name__ == "__main__":
    main()
