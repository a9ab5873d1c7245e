"""Cold-start wall time of `kvpolicy recommend` (a new process each run), beside `python -c pass`.

Usage: python bench/bench_startup.py [--runs 21] [--baseline /path/to/other/bin/kvpolicy]

Each run starts the installed `kvpolicy` console script in a fresh process and waits
for it to exit. The cases take turns (one run of each, then the next round), so a
load that comes and goes on a shared machine falls on all of them alike; the table
reports the median, the spread, the median CPU time (user + system) and the median
as a multiple of `python -c pass`; `import pydantic` (its model machinery alone) is the
floor of any start that builds pydantic models. `--baseline` adds the same commands through another
installation (e.g. a checkout of main in its own virtual environment).
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


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
    if proc.stderr:
        proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{err}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--baseline", default=None, help="another kvpolicy executable to time in the same run")
    args = parser.parse_args()
    exe = shutil.which("kvpolicy", path=str(Path(sys.executable).parent)) or shutil.which("kvpolicy")
    if exe is None:
        sys.exit("kvpolicy is not installed in this environment (pip install -e .)")
    recommend = ["recommend", "--model", "gpt-oss-20b", "--gpu", "h100"]
    cases: dict[str, list[str]] = {}
    for tag, path in (("", exe), ("baseline ", args.baseline)):
        if path is None:
            continue
        cases[f"{tag}table"] = [path, *recommend]
        cases[f"{tag}json"] = [path, *recommend, "--format", "json"]
        cases[f"{tag}args"] = [path, *recommend, "--format", "args"]
    # The floor of any start that uses pydantic models: importing pydantic's model machinery, nothing else.
    cases["import pydantic"] = [sys.executable, "-c", "import pydantic.main"]
    cases["python -c pass"] = [sys.executable, "-c", "pass"]
    env = {**os.environ, "COLUMNS": "120"}
    # With PYTHONDONTWRITEBYTECODE an editable install recompiles every kvpolicy module on each start:
    # that is not what an installed kvpolicy (whose .pyc files pip writes) costs a user.
    if env.pop("PYTHONDONTWRITEBYTECODE", None):
        print("note: PYTHONDONTWRITEBYTECODE unset for these runs (cached bytecode, as an installed package has)")
    for argv in cases.values():
        _run(argv, env)  # warm the file cache (and kvpolicy's cache of the parsed built-in YAML)
    walls: dict[str, list[float]] = {name: [] for name in cases}
    cpus: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, argv in cases.items():
            wall, cpu = _run(argv, env)
            walls[name].append(wall)
            cpus[name].append(cpu)
    base = statistics.median(walls["python -c pass"])
    print(f"kvpolicy: {exe}" + (f"\nbaseline: {args.baseline}" if args.baseline else ""))
    print(f"{'case':<16} {'median s':>9} {'min s':>7} {'max s':>7} {'CPU s':>7} {'x pass':>7}   "
          f"({args.runs} rounds, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f})")
    for name in cases:
        med = statistics.median(walls[name])
        print(f"{name:<16} {med:>9.3f} {min(walls[name]):>7.3f} {max(walls[name]):>7.3f} "
              f"{statistics.median(cpus[name]):>7.3f} {med / base:>7.1f}")


if __name__ == "__main__":
    main()
