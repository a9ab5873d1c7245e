"""Crafted hostile inputs against the CLI, counted the way issue 41 tabulates them.

Each input runs `python -m kvpolicy ...` in a subprocess with 5 s of CPU (15 s for bench and
verify, which import torch), 60 s of wall time and a 2 GB address-space cap, and is classified
as handled (exit 0/1/2 and the expected kind of answer), internal error (exit 3 or a
traceback), wrong success (exit 0 where a refusal was expected), hang or memory blow-up
(timeout, killed, MemoryError), or data lost (a file the user had changed or replaced).
Prints the table as Markdown.

    PYTHONPATH=$PWD python bench/hostile_inputs.py [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 5.0
"""CPU seconds an input may use (RLIMIT_CPU: a loaded machine does not count as a hang); the runtime
commands get RUNTIME_CPU_S, since importing torch alone takes a few CPU seconds."""
RUNTIME_CPU_S = 15.0
WALL_S = 60.0
"""Wall-clock limit: catches a process blocked on a FIFO or a socket, which burns no CPU."""
MEMORY_BYTES = 2 << 30

POLICY = "version: 1\nname: team\nextends: builtin:default\ndeployments:\n  - {name: chat, model: gpt-oss-20b, gpu: h100}\n"


@dataclass
class Case:
    set: str
    """Which row of the table."""
    argv: list[str]
    expect: str  # "ok" (exit 0), "refuse" (exit 1 or 2), "any" (0/1/2)
    setup: dict[str, str | bytes] = field(default_factory=dict)
    """Files to create (relative to the case folder); a value starting with `->` makes a symlink."""
    keep: list[str] = field(default_factory=list)
    """Files whose content must be unchanged afterwards (data lost otherwise)."""
    label: str = ""
    """What the input is (shown by --show)."""


def _numbers() -> list[str]:
    return ["0", "-1", "1", "nan", "inf", "-inf", "1e309", "1e30", "9" * 320, "2**70", str(2**70), "0x10", "",
            " ", "1_000", "1.5", "-0", "1e-320", "abc", "３２"]


def cli_cases() -> list[Case]:
    cases = []
    base = ["recommend", "-m", "gpt-oss-20b", "-g", "h100"]
    ok_values = {"--context": {"1", "1.5"}, "--concurrency": {"1"}, "--tp": {"1"},
                 "--accuracy-floor": {"1"}, "--gpu-memory-utilization": {"1"},
                 "--weights-gb": {"1", "1.5"}}
    for flag, good in ok_values.items():
        for value in _numbers():
            expect = "ok" if value in good else "any" if value == "1e-320" else "refuse"
            cases.append(Case("cli", base + [f"{flag}={value}"], expect))
    for model in ["/dev/zero", "/dev/null", "/", "x" * 5000, "../../..", "fifo", "config.json", "nope/nope"]:
        cases.append(Case("cli", ["recommend", "-m", model, "-g", "h100"], "refuse",
                          setup={"fifo": "FIFO", "config.json": "{"}))
    configs = {
        "nan": '{"num_hidden_layers": NaN, "num_attention_heads": 8}',
        "big": '{"num_hidden_layers": 1e30, "num_attention_heads": 8}',
        "str": '{"num_hidden_layers": "32", "num_attention_heads": 8}',
        "kv0": '{"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 0, "hidden_size": 64}',
        "layers": '{"num_hidden_layers": 100000000, "num_attention_heads": 8, "hidden_size": 64}',
        "dup": '{"num_hidden_layers": 2, "num_hidden_layers": 3, "num_attention_heads": 8}',
        "inf": '{"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 1e400}',
        "deep": "[" * 200_000 + "]" * 200_000,
        "int": '{"num_hidden_layers": 1' + "0" * 5000 + '}',
        "latin1": b'{"model_type": "caf\xe9"}',
        "list": "[1, 2]",
        "huge": " " * (5 << 20) + "{}",
        "neg": '{"num_hidden_layers": -2, "num_attention_heads": 8}',
        "heads_f": '{"num_hidden_layers": 2, "num_attention_heads": 8.5}',
        "bool": '{"num_hidden_layers": true, "num_attention_heads": 8}',
    }
    for name, text in configs.items():
        cases.append(Case("cli", ["recommend", "-m", "config.json", "-g", "h100"], "refuse",
                          setup={"config.json": text}))
    runtime = [
        ["bench", "-m", "llama-3.1-8b", "-g", "h100", "--device", "cpu", "--seed", str(2**70)],
        ["bench", "-m", "llama-3.1-8b", "-g", "h100", "--device", "cpu", "--batch", "100000"],
        ["bench", "-m", "llama-3.1-8b", "-g", "h100", "--device", "cpu", "--contexts", ""],
        ["bench", "-m", "llama-3.1-8b", "-g", "h100", "--device", "cpu", "--contexts", "16m", "--batch", "8"],
        ["bench", "-m", "llama-3.1-8b", "-g", "h100", "--device", "cpu", "--out", "file.txt"],
        ["verify", "-m", "llama-3.1-8b", "-g", "h100", "--device", "cpu", "--text", "/nope"],
        ["verify", "-m", "llama-3.1-8b", "-g", "h100", "--device", "cpu", "--tokens", "9" * 50],
        ["serve", "--reload-interval", "nan"], ["serve", "--port", "99999"], ["serve", "--port", "-1"],
        ["serve", "--max-connections", "0"], ["serve", "--header-timeout", "inf"],
        ["calibrate", "-m", "llama-3.1-8b", "-g", "h100", "--num-samples", "0"],
        ["calibrate", "-m", "llama-3.1-8b", "-g", "h100", "--num-samples", "1e9"],
        ["diff", "team.yaml@--output=out.txt"], ["diff", "team.yaml", "--git-rev", "--output=out.txt"],
        ["diff", "team.yaml@HEAD..HEAD~1"], ["diff", "team.yaml@-p"],
        ["init", "--dir", ".", "--name", 'x"\nextends: /etc/passwd'],
        ["schema", "--out", "file.txt"],
        ["apply", "-m", "gpt-oss-20b", "-g", "h100", "--dry-run", "--no-validate", "--", "--config", "fifo"],
        ["apply", "-m", "gpt-oss-20b", "-g", "h100", "--dry-run", "--no-validate", "--", "--config", "/dev/zero"],
        ["apply", "-m", "gpt-oss-20b", "-g", "h100", "--dry-run", "--no-validate", "--", "--config", "/bin/ls"],
        ["explain", "-d", "x" * 1000, "-p", "team.yaml"],
    ]
    for argv in runtime:
        cases.append(Case("cli", argv, "refuse", setup={"team.yaml": POLICY, "file.txt": "x\n", "fifo": "FIFO"},
                          keep=["file.txt"]))
    return cases


VALID_DOCS = {"bom", "empty", "long-line", "anchor-keys"}
"""Documents that are valid policies, however odd."""
DEPLOYMENT_ONLY = {"model-dev", "model-fifo"}
"""Documents whose only fault is in a deployment (read by check, not by recommend)."""


def policy_cases() -> list[Case]:
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    docs: dict[str, str | bytes] = {
        "bomb": "version: 1\nname: bomb\n" + bomb,
        "bomb-merge": "version: 1\nname: m\nx0: &x0 {a: 1, b: 2}\n" + "".join(
            f"x{i}: &x{i} {{<<: *x{i - 1}, k{i}: [*x{i - 1}, *x{i - 1}, *x{i - 1}, *x{i - 1}]}}\n"
            for i in range(1, 14)),
        "loop": "version: 1\nname: loop\nx: &a [*a]\n",
        "deep-flow": "version: 1\nname: d\nx: " + "[" * 5000 + "]" * 5000 + "\n",
        "deep-block": "version: 1\nname: d\n" + "".join("  " * i + f"k{i}:\n" for i in range(300)),
        "dup": "version: 1\nname: a\nname: b\n",
        "dup-nested": "version: 1\nname: a\nthresholds:\n  t: {value: 1, value: 2}\n",
        "python-tag": "version: 1\nname: !!python/object/apply:os.system ['true']\n",
        "nan-threshold": "version: 1\nname: t\nthresholds:\n  t: {value: .nan}\n",
        "inf-threshold": "version: 1\nname: t\nthresholds:\n  t: {value: .inf}\n",
        "1e999": "version: 1\nname: t\nthresholds:\n  t: {value: 1e999}\n",
        "big-int": "version: 1\nname: t\nthresholds:\n  t: {value: " + "9" * 5000 + "}\n",
        "ctx-digits": POLICY.replace("gpu: h100}", "gpu: h100, context: " + "9" * 320 + "}"),
        "ctx-huge": POLICY.replace("gpu: h100}", "gpu: h100, context: 99999999999}"),
        "tp-huge": POLICY.replace("gpu: h100}", "gpu: h100, tp: 100000000}"),
        "conc-huge": POLICY.replace("gpu: h100}", "gpu: h100, concurrency: 1e30}"),
        "weights-nan": POLICY.replace("gpu: h100}", "gpu: h100, weights_gb: .nan}"),
        "floor-inf": POLICY.replace("gpu: h100}", "gpu: h100, accuracy_floor: .inf}"),
        "model-dev": POLICY.replace("model: gpt-oss-20b", "model: /dev/zero"),
        "model-fifo": POLICY.replace("model: gpt-oss-20b", "model: fifo"),
        "extends-fifo": POLICY.replace("builtin:default", "fifo"),
        "extends-dev": POLICY.replace("builtin:default", "/dev/zero"),
        "extends-etc": POLICY.replace("builtin:default", "/etc/passwd"),
        "extends-up": POLICY.replace("builtin:default", "../../../../etc/hostname"),
        "extends-self": POLICY.replace("builtin:default", "p.yaml"),
        "extends-dir": POLICY.replace("builtin:default", "."),
        "latin1": b"version: 1\nname: caf\xe9\n",
        "nul": "version: 1\nname: a\x00b\n",
        "bom": "\ufeffversion: 1\nname: bom\n",
        "empty": "",
        "list": "- a\n- b\n",
        "scalar": "hello\n",
        "huge": "#" * (2 << 20),
        "long-line": "version: 1\nname: " + "x" * 500_000 + "\n",
        "many-rules": "version: 1\nname: r\nrules:\n" + "".join(
            f"  - {{id: R{i}, name: r{i}, statement: s, why: w, when: {{fact: model.family, op: eq, value: x}}, "
            f"then: {{kv_cache_dtype: auto}}}}\n" for i in range(3000)),
        "rule-bad-op": "version: 1\nname: r\nrules:\n  - {id: R1, name: r, statement: s, why: w, "
                       "when: {fact: model.family, op: regex, value: x}, then: {kv_cache_dtype: auto}}\n",
        "rule-nan": "version: 1\nname: r\nrules:\n  - {id: R1, name: r, statement: s, why: w, "
                    "when: {fact: workload.context_tokens, op: gt, value: .nan}, then: {kv_cache_dtype: auto}}\n",
        "version-2": "version: 2\nname: v\n",
        "unknown-key": "version: 1\nname: v\nrulez: []\n",
        "anchor-keys": "version: 1\n&n name: v\n",
        "tabs": "version: 1\n\tname: v\n",
        "merge-bad": "version: 1\nname: v\n<<: 5\n",
        "complex-key": "version: 1\nname: v\n? [a, b]\n: c\n",
        "set-tag": "version: 1\nname: !!set {a, b}\n",
        "binary-tag": "version: 1\nname: !!binary aGVsbG8=\n",
        "timestamp": "version: 1\nname: 2001-12-14t21:59:43.10-05:00\n",
        "evidence-inf": "version: 1\nname: e\nevidence:\n  - {id: E1, kind: itl, source: s, measurement: "
                        "{model: m, gpu: g, variants: {bf16: {slope_ms_per_token: .inf}}}}\n",
    }
    cases = []
    for name, text in docs.items():
        setup: dict[str, str | bytes] = {"p.yaml": text, "fifo": "FIFO"}
        for argv in (["lint", "p.yaml"], ["check", "p.yaml"], ["recommend", "-m", "gpt-oss-20b", "-g", "h100",
                                                               "-p", "p.yaml"]):
            # Valid documents (an empty policy is a rule-less one); recommend evaluates no deployment.
            valid = name in VALID_DOCS or (argv[0] == "recommend" and name in DEPLOYMENT_ONLY)
            cases.append(Case("policy", argv, "any" if valid else "refuse", setup=dict(setup), label=name))
    # a test file and the FIFO given directly
    cases.append(Case("policy", ["test", "fifo"], "refuse", setup={"fifo": "FIFO"}))
    cases.append(Case("policy", ["lint", "fifo"], "refuse", setup={"fifo": "FIFO"}))
    cases.append(Case("policy", ["lint", "."], "refuse", setup={"fifo.yaml": "FIFO", "ok.yaml": POLICY}))
    cases.append(Case("policy", ["test", "t_test.yaml"], "refuse",
                      setup={"t_test.yaml": "policy: p.yaml\ncases:\n  - {name: c, given: {model: gpt-oss-20b, "
                                            "gpu: h100, context: " + "9" * 400 + "}, expect: {}}\n",
                             "p.yaml": POLICY}))
    return cases


def write_cases() -> list[Case]:
    apply = ["apply", "-m", "gpt-oss-20b", "-g", "h100", "--no-validate", "--emit-config"]
    calib = ["calibrate", "-m", "llama-3.1-8b", "-g", "h100", "--strategy", "tensor", "--emit-recipe"]
    cases = []
    for argv in (apply, calib):
        cases += [
            Case("write", argv + ["mine.yaml"], "refuse", setup={"mine.yaml": "mine\n"}, keep=["mine.yaml"]),
            Case("write", argv + ["link.yaml", "--force"], "refuse",
                 setup={"precious.txt": "keep\n", "link.yaml": "->precious.txt"}, keep=["precious.txt"]),
            Case("write", argv + ["link.yaml"], "refuse",
                 setup={"precious.txt": "keep\n", "link.yaml": "->precious.txt"}, keep=["precious.txt"]),
            Case("write", argv + ["dangling.yaml"], "refuse", setup={"dangling.yaml": "->nowhere/x"}),
            Case("write", argv + ["nodir/x.yaml"], "refuse"),
            Case("write", argv + ["."], "refuse"),
            Case("write", argv + ["new.yaml"], "ok"),
            Case("write", argv + ["mine.yaml", "--force"], "ok", setup={"mine.yaml": "mine\n"}),
        ]
    cases += [
        Case("write", ["schema", "--out", "s"], "refuse", setup={"s/policy.schema.json": '{"mine": 1}\n'},
             keep=["s/policy.schema.json"]),
        Case("write", ["schema", "--out", "s"], "refuse",
             setup={"precious.txt": "keep\n", "s/policy.schema.json": "->../precious.txt"}, keep=["precious.txt"]),
        Case("write", ["schema", "--out", "precious.txt"], "refuse", setup={"precious.txt": "keep\n"},
             keep=["precious.txt"]),
        Case("write", ["schema", "--out", "s"], "ok"),
        Case("write", ["init", "--dir", ".", "--force"], "refuse",
             setup={"precious.txt": "keep\n", "kvpolicy_test.yaml": "->precious.txt", "kvpolicy.yaml": "mine\n"},
             keep=["precious.txt", "kvpolicy.yaml"]),
        Case("write", ["init", "--dir", "."], "refuse", setup={"kvpolicy.yaml": "mine\n"}, keep=["kvpolicy.yaml"]),
        Case("write", ["bench", "-m", "llama-3.1-8b", "-g", "h100", "--device", "cpu", "--contexts", "256",
                       "--no-plot", "--record", "link.yaml"], "refuse",
             setup={"precious.txt": "keep\n", "link.yaml": "->precious.txt"}, keep=["precious.txt"]),
        Case("write", ["bench", "-m", "llama-3.1-8b", "-g", "h100", "--device", "cpu", "--contexts", "256",
                       "--no-plot", "--out", "precious.txt"], "refuse", setup={"precious.txt": "keep\n"},
             keep=["precious.txt"]),
    ]
    return cases


def _setup(folder: Path, files: dict[str, str | bytes]) -> None:
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content == "FIFO":
            os.mkfifo(path)
        elif isinstance(content, str) and content.startswith("->"):
            path.symlink_to(content[2:])
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def _limiter(cpu_s: float):  # noqa: ANN202
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
        resource.setrlimit(resource.RLIMIT_CPU, (int(cpu_s), int(cpu_s) + 1))
    return limit


def run_case(case: Case) -> str:
    with tempfile.TemporaryDirectory(prefix="kvp-hostile-") as tmp:
        folder = Path(tmp)
        _setup(folder, case.setup)
        before = {k: (folder / k).read_bytes() for k in case.keep if (folder / k).is_file()}
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cpu = RUNTIME_CPU_S if case.argv[0] in ("bench", "verify") else TIMEOUT_S
        try:
            proc = subprocess.run([sys.executable, "-m", "kvpolicy", *case.argv], cwd=folder, env=env,
                                  capture_output=True, text=True, timeout=WALL_S, preexec_fn=_limiter(cpu),
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return "hang"
        after = {k: (folder / k).read_bytes() if (folder / k).is_file() else None for k in before}
        lost = any(after[k] != v for k, v in before.items()) or any(
            not (folder / k).is_symlink() for k, v in case.setup.items() if isinstance(v, str) and v.startswith("->"))
        text = proc.stdout + proc.stderr
        if lost:
            return "lost"
        if proc.returncode < 0 or "MemoryError" in text:
            return "hang"
        if proc.returncode == 3 or "Traceback" in text or proc.returncode not in (0, 1, 2):
            return "internal"
        if case.expect == "refuse" and proc.returncode == 0:
            return "wrong-success"
        if case.expect == "ok" and proc.returncode != 0:
            return "wrong-refusal"
        return "handled"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--show", action="store_true", help="print every input that was not handled")
    parser.add_argument("--only", default="", help="run only the sets whose name starts with this")
    args = parser.parse_args()
    sets = {"CLI arguments, numbers, paths, configs": cli_cases(),
            "policy files (syntax, types, YAML tricks, extends)": policy_cases(),
            "files the tool writes": write_cases()}
    columns = ["handled", "internal", "wrong-success", "hang", "lost", "wrong-refusal"]
    print("| set | inputs | handled | internal error (exit 3) | wrong success | hang or memory blow-up | data lost "
          "| wrongly refused |")
    print("|---|---|---|---|---|---|---|---|")
    for name, cases in sets.items():
        if not name.startswith(args.only):
            continue
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(run_case, cases))
        counts = {c: results.count(c) for c in columns}
        print(f"| {name} | {len(cases)} | " + " | ".join(str(counts[c]) for c in columns) + " |", flush=True)
        if args.show:
            for case, result in zip(cases, results):
                if result != "handled":
                    print(f"  {result}: {case.label} {json.dumps(case.argv)[:200]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
