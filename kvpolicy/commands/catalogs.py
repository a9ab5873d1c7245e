"""Reference commands: `rule`, `facts`, `models`, `gpus`, `schema`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from kvpolicy.errors import InputError, PolicyFailure, did_you_mean
from kvpolicy.outputs.render import echo, to_json


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """Options of the reference commands."""
    if name == "rule":
        parser.add_argument("rule_id", nargs="?", help="rule id such as KV106, or a rule name; omit to list all")
        parser.add_argument("--policy", "-p", default=None, help="policy file (default: the built-in policy)")
    if name == "schema":
        parser.add_argument("--out", default="schemas", help="folder to write to (default schemas/)")
        parser.add_argument("--check", action="store_true",
                            help="exit 1 if the files in --out differ from the code (for CI)")
        parser.add_argument("--force", action="store_true",
                            help="replace files in --out that kvpolicy did not write (its own schemas are "
                                 "always refreshed)")
    if name != "schema":
        parser.add_argument("--format", "-f", choices=["table", "json"], default="table",
                            help="table (people) or json (machines)")


def run(args: argparse.Namespace) -> int:
    """Dispatch to the command."""
    return {"rule": _rule, "facts": _facts, "models": _models, "gpus": _gpus, "schema": _schema}[args.command](args)


def _rule(args: argparse.Namespace) -> int:
    from kvpolicy.rules.validate import load_policy

    loaded = load_policy(args.policy)
    rules = loaded.policy.rules
    evidence = {e.id: e for e in loaded.policy.evidence}
    if args.rule_id is None:
        if args.format == "json":
            echo(json.dumps([{"id": r.id, "name": r.name, "status": r.status, "enabled": r.enabled,
                              "statement": r.statement} for r in rules], indent=2))
        else:
            for r in rules:
                off = "" if r.enabled else "  [disabled]"
                echo(f"{r.id}  {r.name:<38} {r.statement}{off}")
        return 0
    key = args.rule_id
    found = [r for r in rules if r.id.lower() == key.lower() or r.name == key]
    if not found:
        names = [r.id for r in rules] + [r.name for r in rules]
        raise InputError(f"no rule `{key}` in {loaded.label}.{did_you_mean(key, names)} "
                         "Run `kvpolicy rule` to list the rules.")
    r = found[0]
    if args.format == "json":
        data = r.model_dump(mode="json", by_alias=True, exclude_none=True)
        data["evidence"] = [evidence[e].model_dump(mode="json", exclude_none=True) for e in r.evidence if e in evidence]
        echo(to_json(data))
        return 0
    echo(f"{r.name} ({r.id}) [{r.status}{'' if r.enabled else ', disabled'}]\n")
    echo(f"What it does\n  {r.statement}\n")
    echo(f"Why\n  {r.why.strip() or '(not given)'}\n")
    if r.when is not None:
        echo("When\n  " + json.dumps(r.when.model_dump(mode="json", by_alias=True, exclude_defaults=True)))
    echo("Then\n  " + (json.dumps(r.then.fields()) if r.then.fields() else "(advice only)") + "\n")
    echo("Evidence")
    for e in r.evidence:
        ev = evidence.get(e)
        echo(f"  {e}: " + (f"{ev.statement}\n    source: {ev.source}" if ev else "(missing from the policy)"))
    return 0


def _facts(args: argparse.Namespace) -> int:
    from kvpolicy.facts.build import FACTS

    if args.format == "json":
        echo(json.dumps(FACTS, indent=2))
    else:
        width = max(map(len, FACTS))
        for path, desc in FACTS.items():
            echo(f"{path.ljust(width)}  {desc}")
    return 0


def _models(args: argparse.Namespace) -> int:
    from kvpolicy.inputs.catalog import load_models

    models = load_models()
    if args.format == "json":
        echo(json.dumps([m.model_dump(mode="json", exclude_defaults=True) for m in models.values()], indent=2))
        return 0
    rows = []
    for m in models.values():
        kinds = ", ".join(f"{m.count(k)} {k}" for k in ("full", "sliding", "mla", "linear", "shared") if m.count(k))
        window = f", window {m.sliding_window}" if m.sliding_window and m.count("sliding") else ""
        # max_model_len is what facts/limits.py holds a --context to: the length vLLM derives from the config.
        rows.append([m.id, _billions(m.params_b), _billions(m.active_params_b),
                     f"{m.max_model_len:,}" if m.max_model_len else "?", m.hf_id or "",
                     f"{m.attention}, head_dim {m.head_dim}, {kinds}{window}"])
    headers = ["id", "params", "active", "max context", "Hugging Face id", "KV layers"]
    echo("\n".join(_table(headers, rows, right={1, 2, 3}, fold_from=4)))
    return 0


def _gpus(args: argparse.Namespace) -> int:
    from kvpolicy.inputs.catalog import load_gpus

    gpus = load_gpus()
    if args.format == "json":
        echo(json.dumps([g.model_dump(mode="json", exclude_defaults=True) for g in gpus.values()], indent=2))
        return 0
    rows = [[g.id, g.generation, f"{g.memory_gib:.1f} GiB", f"{g.bandwidth_tbs:.2f} TB/s",
             "yes" if g.fp8_compute else "no", ", ".join([g.name, *g.aliases])] for g in gpus.values()]
    headers = ["id", "generation", "memory", "bandwidth", "FP8 compute", "names (as nvidia-smi prints, and aliases)"]
    echo("\n".join(_table(headers, rows, right={2, 3}, fold_from=5)))
    echo("Names match ignoring case, spaces and hyphens; --gpu 2xh100 also sets --tp 2.")
    return 0


def _billions(value: float | None) -> str:
    """8.03B, 70.6B, 406B: three significant figures, enough to tell sizes apart."""
    if value is None:
        return "?"
    return f"{value:.2f}B" if value < 10 else f"{value:.1f}B" if value < 100 else f"{value:.0f}B"


def _table(headers: list[str], rows: list[list[str]], *, right: set[int], fold_from: int) -> list[str]:
    """Aligned columns under their headers, as wide as the terminal allows (80 in pipes and CI logs, or
    $COLUMNS): when a row does not fit, its columns from `fold_from` on go on a line of their own under it,
    indented and wrapped between words, so no word is cut."""
    import shutil
    import textwrap

    width = shutil.get_terminal_size().columns
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    if sum(widths) + 2 * (len(widths) - 1) <= width:
        return [line(row).rstrip() for row in [headers, *rows]]
    out = []
    for row in [headers, *rows]:
        out.append(line(row[:fold_from]).rstrip())
        rest = " · ".join(c for c in row[fold_from:] if c)
        out.extend(textwrap.wrap(rest, width, initial_indent="    ", subsequent_indent="      ",
                                 break_long_words=False, break_on_hyphens=False))
    return out


def schemas() -> dict[str, dict]:
    """The published JSON Schemas by file name."""
    from kvpolicy.outputs.fielddocs import json_schema
    from kvpolicy.policy.starter import policy_schemas
    from kvpolicy.rules.decision import Recommendation
    # kvpolicy.service.api is plain pydantic: no server stack is imported.
    from kvpolicy.service import api

    return {
        **policy_schemas(),
        "recommendation.schema.json": json_schema(Recommendation, "kvpolicy recommendation"),
        "serve-recommend-request.schema.json": json_schema(api.RecommendRequest,
                                                           "kvpolicy serve: POST /v1/recommend body"),
        "serve-check-request.schema.json": json_schema(api.CheckRequest, "kvpolicy serve: POST /v1/check body"),
        "serve-check-response.schema.json": json_schema(api.CheckResponse, "kvpolicy serve: POST /v1/check response"),
        "serve-error.schema.json": json_schema(api.ErrorBody, "kvpolicy serve: error response (4xx/5xx)"),
        **_plan_schemas(json_schema),
    }


def _plan_schemas(json_schema: Callable[..., dict]) -> dict[str, dict]:
    """`kvpolicy plan --format json` and the body of `POST /v1/plan`."""
    from kvpolicy.outputs.plan import PlanResult
    from kvpolicy.service.plan_api import PlanRequest

    return {"plan.schema.json": json_schema(PlanResult, "kvpolicy plan"),
            "serve-plan-request.schema.json": json_schema(PlanRequest, "kvpolicy serve: POST /v1/plan body")}


def _schema(args: argparse.Namespace) -> int:
    from kvpolicy.inputs.safeio import check_writable, read_text, write_text

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: is a file; --out names the folder the schemas go in.")
    texts = {out / name: json.dumps(schema, indent=2) + "\n" for name, schema in schemas().items()}
    if args.check:
        missing, stale = [], []
        for path, text in texts.items():
            if not path.is_file():
                missing.append(str(path))
                continue
            try:
                same = read_text(path, what="a JSON Schema", max_bytes=16 << 20) == text
            except InputError:
                same = False
            if not same:
                stale.append(str(path))
        problems = ([f"missing JSON Schema: {', '.join(missing)}"] if missing else []) + (
            [f"stale JSON Schema (differs from the code): {', '.join(stale)}"] if stale else [])
        if problems:
            write = "kvpolicy schema" + ("" if args.out == "schemas" else f" --out {args.out}")
            raise PolicyFailure("; ".join(problems) + f". Run `{write}` and commit.")
        return 0
    # Every target is checked before the first is written, so a refusal changes nothing.
    todo = {}
    for path, text in texts.items():
        if out.is_dir():
            check_writable(path, force=args.force or _written_by_us(path, json.loads(text)["title"]),
                           what="JSON Schema")
        todo[path] = text
    out.mkdir(parents=True, exist_ok=True)
    for path, text in todo.items():
        write_text(path, text, force=True, what="JSON Schema")
        echo(f"wrote {path}")
    return 0


def _written_by_us(path: Path, title: str) -> bool:
    """Whether `path` is a JSON Schema kvpolicy wrote under this title (safe to refresh without --force)."""
    from kvpolicy.inputs.safeio import read_json

    if path.is_symlink() or not path.is_file():
        return False
    try:
        data = read_json(path, what="a JSON Schema", max_bytes=16 << 20)
    except InputError:
        return False
    return isinstance(data, dict) and data.get("title") == title
