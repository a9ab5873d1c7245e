"""Render a Recommendation: rich panels for people, JSON/YAML for machines, bare flags for shells."""

from __future__ import annotations

import io
import json
import re
import shlex
import sys
from typing import Any

from kvpolicy.facts.estimates import Estimate
from kvpolicy.outputs.vllm_flags import realisation
from kvpolicy.rules.decision import Recommendation

FORMATS = ("table", "json", "yaml", "args")
NARROW = 100
"""Consoles narrower than this (80-column terminals, pipes, CI logs) get lines instead of wide tables."""


def to_json(data: Any) -> str:
    """Pretty JSON of a pydantic model or plain data."""
    if hasattr(data, "model_dump"):
        data = data.model_dump(mode="json")
    return json.dumps(data, indent=2, sort_keys=False)


# Plain scalars that YAML 1.1 readers (PyYAML, which vLLM's --config loader uses) take for booleans, null
# or base-60 numbers, though YAML 1.2 reads them as strings: written quoted, they stay strings everywhere.
_YAML11_SPECIAL = re.compile(r"(?:y|Y|yes|Yes|YES|n|N|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF"
                             r"|~|null|Null|NULL|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)")


def to_yaml(data: Any) -> str:
    """Block-style YAML of a pydantic model or plain data, read the same by YAML 1.1 and 1.2 readers."""
    from ruamel.yaml import YAML
    from ruamel.yaml.representer import SafeRepresenter

    class _Representer(SafeRepresenter):
        def represent_str(self, value: str) -> Any:
            if _YAML11_SPECIAL.fullmatch(value):
                return self.represent_scalar("tag:yaml.org,2002:str", value, style="'")
            return super().represent_str(value)

    _Representer.add_representer(str, _Representer.represent_str)
    if hasattr(data, "model_dump"):
        data = data.model_dump(mode="json")
    out = io.StringIO()
    yaml = YAML(typ="safe", pure=True)
    yaml.Representer = _Representer
    yaml.default_flow_style = False
    yaml.sort_base_mapping_type_on_output = False  # type: ignore[attr-defined]
    yaml.dump(data, out)
    return out.getvalue()


def shell_command(model: str, args: list[str]) -> str:
    """A copy-pasteable `vllm serve` line."""
    return " ".join(shlex.quote(a) for a in ["vllm", "serve", model, *args])


def _fmt(e: Estimate, pct: bool = False) -> str:
    if e.value is None:
        return "n/a"
    if pct:
        text = f"{e.value * 100:.0f}%" + (f" {e.unit}" if e.unit != "ratio" else "")  # e.g. top-1 agreement
    elif e.unit in ("tokens", "requests"):
        text = f"{int(e.value):,} {e.unit}"
    elif e.unit == "ratio":
        text = f"{e.value:.2f}x"
    else:
        text = f"{e.value:g} {e.unit}"
    return f"{text} ({e.provenance})"


def render(rec: Recommendation, fmt: str, *, model_ref: str | None = None, explain: bool = False) -> None:
    """Print a recommendation in one of FORMATS."""
    if fmt == "json":
        print(to_json(rec))
    elif fmt == "yaml":
        print(to_yaml(rec), end="")
    elif fmt == "args":
        print(" ".join(shlex.quote(a) for a in rec.vllm_args))
        for msg in rec.blockers:  # never a command vLLM refuses without saying so
            sys.stderr.write(f"kvpolicy: vLLM would refuse to start with these flags: {msg}\n")
    else:
        _render_rich(rec, model_ref or rec.model, explain=explain)


def _render_rich(rec: Recommendation, model_ref: str, explain: bool) -> None:
    from rich.console import Console, Group
    from rich.padding import Padding
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    console = Console(soft_wrap=False)
    d, e, w = rec.decision, rec.estimates, rec.workload
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    stored = rec.trace.facts.get("model.checkpoint_kv_dtype")
    auto = f"  ({stored}, from the checkpoint's quantization config)" if stored else "  (BF16, the model dtype)"
    head.add_row("KV-cache dtype", d.kv_cache_dtype + (auto if d.kv_cache_dtype == "auto" else ""))
    head.add_row("skip layers", ", ".join(d.skip_layers) or "none")
    head.add_row("two-level accumulation", d.two_level_accumulation.replace("_", " "))
    head.add_row("scale source", d.scale_source.replace("_", " "))
    head.add_row("attention backend", d.attention_backend or "vLLM's default")
    how = realisation(d)
    if how:
        head.add_row("in vLLM", how)

    kinds = ", ".join(f"{k} {v:,}" for k, v in e.kv_bytes_per_token.items()) or "0"
    kinds_bf16 = ", ".join(f"{k} {v:,}" for k, v in e.kv_bytes_per_token_bf16.items()) or "0"
    rows = [
        ("KV bytes/token/rank", kinds, f"BF16: {kinds_bf16}"),
        ("KV capacity", _fmt(e.kv_capacity_tokens), e.kv_capacity_tokens.basis),
        (f"max concurrency @ {w.context_tokens:,}", _fmt(e.max_concurrency), e.max_concurrency.basis),
        ("capacity vs BF16", _fmt(e.capacity_vs_bf16), e.capacity_vs_bf16.basis),
        ("ITL slope vs BF16", _fmt(e.itl_slope_ratio, pct=True), e.itl_slope_ratio.basis),
        ("kernel slope vs cuDNN", _fmt(e.kernel_slope_ratio), e.kernel_slope_ratio.basis),
        ("break-even context", _fmt(e.break_even_tokens), e.break_even_tokens.basis),
        ("accuracy recovery", _fmt(e.accuracy_recovery, pct=True), e.accuracy_recovery.basis),
    ]
    est: Any
    if console.width < NARROW:
        # Three columns leave the basis a sliver that splits evidence ids mid-word: the basis goes under
        # its estimate instead, indented, wrapped between words.
        est = Group(*[part for name, value, basis in rows for part in
                      (Text.assemble((name, "bold"), "  ", value), Padding(Text(basis), (0, 0, 0, 4)))])
    else:
        est = Table(show_header=True, header_style="bold", box=None, padding=(0, 2))
        est.add_column("estimate")
        est.add_column("value")
        est.add_column("basis", overflow="fold", max_width=70)
        for row in rows:
            est.add_row(*row)

    title = (f"{rec.model} on {w.tp} x {rec.gpu}  ·  {w.context_tokens:,} tokens  ·  {w.priority}  ·  "
             f"concurrency {w.concurrency}")
    parts: list[Any] = [head, Text(""), est]
    console.print(Panel(Group(*parts), title=title, subtitle=rec.policy, expand=False))
    console.print(Text("vLLM command", style="bold")
                  + (Text("  (vLLM would refuse to start with it: see ✗ below)", style="bold red")
                     if rec.blockers else Text("")))
    console.print("  " + shell_command(model_ref, rec.vllm_args), soft_wrap=True, highlight=False, markup=False)
    for msg in rec.blockers:
        console.print(Text("✗ ", style="bold red") + Text(msg), soft_wrap=True)
    for msg in rec.warnings:
        console.print(Text("! ", style="bold yellow") + Text(msg), soft_wrap=True)
    for msg in rec.unsupported:
        console.print(Text("! ", style="bold red") + Text(f"stock vLLM cannot carry out: {msg}"), soft_wrap=True)
    for msg in rec.alternatives:
        console.print(Text("→ ", style="bold cyan") + Text(msg), soft_wrap=True)
    _render_trace(console, rec, full=explain)


def _render_trace(console: Any, rec: Recommendation, full: bool) -> None:
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    fields = rec.trace.fields
    decided = {fid: name for name, fid in ((n, f.decided_by) for n, f in fields.items())}
    rows = []
    for o in rec.trace.rules:
        if not full and not (o.decided or (o.matched and o.id in decided)):
            continue
        mark = "[green]✓[/]" if o.matched else "[dim]·[/]"
        rows.append((o.id, o.name, mark, ", ".join(o.decided) or ("(lost)" if o.overridden else ""), o.reason))
    for name, f in fields.items():
        if f.decided_by in ("default", "checkpoint") or f.decided_by.startswith("pin:"):
            rows.append((f.decided_by, name, "", name, f"value {f.value!r}"))
    if console.width < NARROW:
        # Too narrow for four columns beside the reason: one rule a line, its reason indented under it,
        # so ids, names and fields stay whole (a table would cut them with an ellipsis).
        console.print(Text("rule trace" if full else "deciding rules", style="italic"))
        for rule, name, mark, field, reason in rows:
            console.print(f"{rule} {name} {mark} {field}".rstrip(), soft_wrap=True, highlight=False)
            console.print(Padding(Text(reason), (0, 0, 0, 4)))
        _trace_footer(console, rec, full)
        return
    table = Table(title="rule trace" if full else "deciding rules", title_justify="left", box=None,
                  header_style="bold", padding=(0, 1))
    table.add_column("rule")
    table.add_column("name")
    table.add_column("")
    table.add_column("decided")
    table.add_column("reason", overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    _trace_footer(console, rec, full)


def _trace_footer(console: Any, rec: Recommendation, full: bool) -> None:
    if not full:
        console.print("[dim]Full trace: kvpolicy explain (same options); evidence: kvpolicy rule ID[/]")
    else:
        for ev in rec.evidence:
            console.print(f"[bold]{ev.id}[/]: {ev.statement} [dim]({ev.source})[/]", soft_wrap=True)


def echo(text: str) -> None:
    """Print plain text to stdout."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
