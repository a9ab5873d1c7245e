"""Golden outputs of `kvpolicy recommend`: the catalog grid as JSON, the table and args formats, README's samples.

A refactor must leave every answer as it was; a change of behaviour made on purpose
regenerates the files and shows up in review as their diff:

    KVPOLICY_UPDATE_GOLDEN=1 python -m pytest -q tests/test_golden.py

The JSON grid keeps what a user acts on (decision, vLLM flags, estimates with their
basis, warnings, alternatives, evidence ids, who decided each field, every rule's
outcome) and the derived facts; it drops the policy's content hash, the estimates'
units, the evidence statements, the rules' reason strings and the `memory.fits_*`
facts (max concurrency against the workload's), so it stays near 4 MB (49 models).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from kvpolicy.cli import main
from kvpolicy.errors import LimitError
from kvpolicy.inputs.catalog import load_models, resolve_gpu, resolve_model
from kvpolicy.inputs.workload import make_workload
from kvpolicy.outputs.recommend import recommend
from kvpolicy.outputs.render import render
from kvpolicy.rules.validate import load_policy

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("KVPOLICY_UPDATE_GOLDEN") == "1"
GPUS = ("h100", "h200", "b200", "a100-80gb-sxm", "l40s", "mi300x")
CONTEXTS = ("4k", "32k", "128k")
# (gpu, context, workload change) applied to every catalog model: each one changes the decision or its
# messages for part of the catalog (prefill keeps BF16 on Hopper below the long-context bound; tp and
# concurrency move the memory facts). Balanced priority changes nothing today, so it is left out.
EXTRAS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("h100", "32k", {"priority": "prefill"}),
    ("h100", "128k", {"tp": 8}),
    ("l40s", "32k", {"tp": 2}),
    ("a100-80gb-sxm", "32k", {"concurrency": 64}),
)
DERIVED_FACTS = ("memory.", "latency.", "accuracy.")
_HASH = re.compile(r"@[0-9a-f]{12}\b")


def grid() -> dict[str, dict[str, Any]]:
    """Case name -> recommend's inputs."""
    cases: dict[str, dict[str, Any]] = {}
    for model in load_models():
        for gpu in GPUS:
            for context in CONTEXTS:
                cases[f"{model} {gpu} {context}"] = {"model": model, "gpu": gpu, "context": context}
        for gpu, context, change in EXTRAS:
            label = " ".join(f"{k}={v}" for k, v in change.items())
            cases[f"{model} {gpu} {context} {label}"] = {"model": model, "gpu": gpu, "context": context, **change}
    return cases


def cli_json(loaded: Any, model: str, gpu: str, **workload: Any) -> dict[str, Any]:
    """What `kvpolicy recommend --format json` prints, through the calls the command makes."""
    try:
        rec = recommend(resolve_model(model), resolve_gpu(gpu), make_workload(loaded, **workload), loaded)
    except LimitError as exc:  # a context or TP size vLLM refuses: the answer is the error
        return {"error": str(exc)}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        render(rec, "json")
    return json.loads(out.getvalue())


def summary(data: dict[str, Any]) -> dict[str, Any]:
    """The parts of a recommendation the golden file keeps."""
    if "error" in data:
        return data
    trace = data["trace"]
    rules = []
    for o in trace["rules"]:
        text = o["id"] + (" matched" if o["matched"] else " -")
        if o["decided"]:
            text += " decided " + ",".join(o["decided"])
        if o["overridden"]:
            text += " overridden " + ",".join(o["overridden"])
        rules.append(text)
    estimates = {}
    for name, e in data["estimates"].items():
        estimates[name] = e if name.startswith("kv_bytes") else [e["value"], e["provenance"], e["basis"]]
    return {
        "model": data["model"],
        "gpu": data["gpu"],
        "policy": _HASH.sub("", data["policy"]),
        "decision": data["decision"],
        "vllm_args": data["vllm_args"],
        "estimates": estimates,
        "warnings": data["warnings"],
        "blockers": data["blockers"],
        "alternatives": data["alternatives"],
        "evidence": [e["id"] for e in data["evidence"]],
        "fields": {name: [f["decided_by"], *f["losers"]] for name, f in trace["fields"].items()},
        "rules": rules,
        "facts": {k: v for k, v in trace["facts"].items() if k.startswith(DERIVED_FACTS) and ".fits_" not in k},
    }


def _dump(cases: dict[str, Any]) -> str:
    # One case per line: a change of behaviour shows as the lines of the cases it touches.
    lines = [f"{json.dumps(name)}: {json.dumps(case, separators=(',', ':'))}" for name, case in cases.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _differences(want: dict[str, Any], got: dict[str, Any]) -> list[str]:
    out = [f"{name}: missing from the output" for name in want if name not in got]
    out += [f"{name}: not in the golden file" for name in got if name not in want]
    for name in got:
        if name in want and want[name] != got[name]:
            parts = [k for k in got[name] if want[name].get(k) != got[name][k]]
            out.append(f"{name}: {', '.join(parts)} differ; e.g. {parts[0]}: {want[name].get(parts[0])!r} -> "
                       f"{got[name][parts[0]]!r}")
    return out


def test_recommend_json_over_the_catalog_grid():
    loaded = load_policy()
    got = {name: summary(cli_json(loaded, **inputs)) for name, inputs in grid().items()}
    path = GOLDEN / "recommend.json"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_dump(got), encoding="utf-8")
    want = json.loads(path.read_text(encoding="utf-8"))
    diffs = _differences(want, got)
    assert not diffs, (f"{len(diffs)} of {len(got)} cases changed (regenerate with KVPOLICY_UPDATE_GOLDEN=1 only "
                       "if the change is intended):\n" + "\n".join(diffs[:20]))


CLI_CASES = {
    "gpt-oss-20b-h100": ["--model", "gpt-oss-20b", "--gpu", "h100"],
    "llama-3.1-70b-h200-128k-tp2": ["--model", "llama-3.1-70b", "--gpu", "h200", "--context", "128k", "--tp", "2"],
    "gemma-3-12b-l40s-prefill": ["--model", "gemma-3-12b", "--gpu", "l40s", "--context", "32k",
                                 "--priority", "prefill"],
    "deepseek-v3-b200-tp8-concurrency": ["--model", "deepseek-v3", "--gpu", "b200", "--context", "64k", "--tp", "8",
                                         "--concurrency", "16"],
}


@pytest.mark.parametrize("fmt", ["table", "args"])
@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_table_and_args(case, fmt, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # rich sizes the table to the terminal; pin it
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    assert main(["recommend", *CLI_CASES[case], "--format", fmt]) == 0
    out = _HASH.sub("@<hash>", capsys.readouterr().out)
    path = GOLDEN / "cli" / f"{case}.{fmt}.txt"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(out, encoding="utf-8")
    assert out == path.read_text(encoding="utf-8")


# -- README samples ----------------------------------------------------------------------------
# A fenced block right after SAMPLE_MARK is output of the tool: every `$ ` line in it is a command, the lines
# up to the next command its output. The same KVPOLICY_UPDATE_GOLDEN=1 run that regenerates the golden files
# rewrites these blocks, so README's samples change with recommend's answers and can never go stale.

README = Path(__file__).resolve().parents[1] / "README.md"
SAMPLE_MARK = "<!-- sample: generated by KVPOLICY_UPDATE_GOLDEN=1 python -m pytest -q tests/test_golden.py -->"
_SAMPLE_BLOCK = re.compile(re.escape(SAMPLE_MARK) + r"\n```[a-z]*\n(.*?)^```", re.S | re.M)
_CURL = re.compile(r"curl -s localhost:8080/v1/recommend -d '(?P<body>[^']*)' \| jq (?P<filter>.*)")
# The jq filters a README sample may use on a `/v1/recommend` answer (the same document as recommend's JSON).
_JQ = {
    "-c .decision": lambda doc: json.dumps(doc["decision"], separators=(",", ":")),
    "-r '.vllm_args | join(\" \")'": lambda doc: " ".join(doc["vllm_args"]),
}


def _run_kvpolicy(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    assert code == 0, f"README sample `kvpolicy {' '.join(argv)}` exited {code}"
    return out.getvalue()


def _sample_output(command: str) -> str:
    """What a README sample command prints (kvpolicy in this process; curl as the service would answer)."""
    import shlex

    if command.startswith("kvpolicy "):
        return _run_kvpolicy(shlex.split(command)[1:])
    curl = _CURL.fullmatch(command)
    if curl is None or curl["filter"] not in _JQ:
        raise AssertionError(f"README sample `{command}`: not a command the generator can run; generated blocks "
                             f"take `kvpolicy ...` and `curl .../v1/recommend -d BODY | jq` with {sorted(_JQ)}")
    from kvpolicy.service.api import RecommendRequest

    req = RecommendRequest.model_validate_json(curl["body"])
    argv = ["recommend", "--model", req.model, "--gpu", req.gpu, "--context", str(req.context),
            "--priority", req.priority, "--concurrency", str(req.concurrency), "--tp", str(req.tp), "--format", "json"]
    return _JQ[curl["filter"]](json.loads(_run_kvpolicy(argv))) + "\n"


def render_samples(text: str) -> str:
    """README text with every generated block rebuilt from its commands."""

    def block(match: re.Match[str]) -> str:
        lines = []
        for command in (line[2:] for line in match[1].splitlines() if line.startswith("$ ")):
            lines.append(f"$ {command}")
            lines += [line.rstrip() for line in _sample_output(command).rstrip("\n").splitlines()]
        fence = match[0][len(SAMPLE_MARK) + 1:].split("\n", 1)[0]
        return f"{SAMPLE_MARK}\n{fence}\n" + "\n".join(lines) + "\n```"

    return _SAMPLE_BLOCK.sub(block, text)


def test_readme_samples_are_the_tools_output(monkeypatch):
    monkeypatch.chdir(README.parent)  # sample commands name files relative to the repository root
    monkeypatch.setenv("COLUMNS", "120")  # the width README's samples are printed at
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    text = README.read_text(encoding="utf-8")
    assert len(_SAMPLE_BLOCK.findall(text)) >= 2, "README lost its generated samples"
    got = render_samples(text)
    if UPDATE:
        README.write_text(got, encoding="utf-8")
        return
    if got != text:
        import difflib

        diff = "".join(difflib.unified_diff(text.splitlines(True), got.splitlines(True), "README.md", "generated",
                                            n=1))
        raise AssertionError("README's samples differ from what the tool prints; regenerate them with "
                             f"KVPOLICY_UPDATE_GOLDEN=1 python -m pytest -q tests/test_golden.py\n{diff[:4000]}")
