"""Render a PlanResult: a table for people, JSON for machines, a Pareto plot (PNG) on request."""

from __future__ import annotations

from pathlib import Path

from kvpolicy.facts.estimates import Estimate
from kvpolicy.outputs.plan import PlanOption, PlanResult
from kvpolicy.outputs.render import shell_command, to_json


def render_plan(result: PlanResult, fmt: str, *, model_ref: str | None = None) -> None:
    """Print the plan as `table` or `json` (`model_ref`: the model as `vllm serve` loads it)."""
    if fmt == "json":
        print(to_json(result))
    else:
        _table(result, model_ref or result.model)


def _v(e: Estimate, digits: str = ".3g") -> str:
    return "unbounded" if e.value is None else format(e.value, digits)


def _table(r: PlanResult, model_ref: str) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    # The table has ten columns: below 132 characters rich would elide them, so wider lines are left to wrap.
    console = Console(soft_wrap=False, width=max(Console().width, 132))
    title = (f"{r.model} on {r.gpus} x {r.gpu}  ·  {r.traffic.describe()}  ·  SLO {r.slo.describe()}  ·  "
             f"accuracy >= {r.accuracy_floor:g}")
    console.print(Text(title, style="bold"), soft_wrap=True)
    t = Table(header_style="bold", box=None, padding=(0, 1))
    for col in ("option", "KV tokens", "fit", "run", "TTFT s", "TPOT ms", "tok/s/GPU", "tok/s/user", "acc", "ok"):
        t.add_column(col, justify="left" if col == "option" else "right", no_wrap=True)
    chosen = r.chosen.option if r.chosen else None
    runner = r.runner_up.option if r.runner_up else None
    for o in r.options:
        mark = " *" if o.id == chosen else (" +" if o.id == runner else "")
        ok = "[green]yes[/]" if o.meets_slo and o.meets_accuracy else "[red]no[/]"
        t.add_row(o.id + mark, f"{int(o.kv_capacity_tokens.value or 0):,}", f"{int(o.capacity_requests.value or 0)}",
                  f"{o.running:g}", _v(o.ttft), _v(o.tpot), _v(o.tokens_per_s_per_gpu, ",.0f"),
                  _v(o.tokens_per_s_per_user, ",.1f"), _v(o.accuracy_recovery, ".2f"), ok)
    console.print(t)
    console.print(Text("* chosen, + runner-up; fit: requests of isl + osl the KV cache of one replica holds; "
                       "run: admitted per replica", style="dim"), soft_wrap=True)
    for o in r.options:
        if o.failures:
            console.print(Text(f"  {o.id} misses: " + "; ".join(o.failures), style="red"), soft_wrap=True)
    if r.chosen:
        console.print(Text("chosen     ", style="bold green") + Text(f"{r.chosen.option}: {r.chosen.why}"),
                      soft_wrap=True)
        best = next(o for o in r.options if o.id == r.chosen.option)
        console.print(Text("             " + shell_command(model_ref, best.vllm_args)), soft_wrap=True,
                      highlight=False, markup=False)
    else:
        console.print(Text("no option meets the targets", style="bold red"), soft_wrap=True)
        if r.closest:
            console.print(Text("closest    ", style="bold yellow") + Text(f"{r.closest.option}: {r.closest.why}"),
                          soft_wrap=True)
    if r.runner_up:
        console.print(Text("runner-up  ", style="bold") + Text(f"{r.runner_up.option}: {r.runner_up.why}"),
                      soft_wrap=True)
    console.print(Text(f"recommend at this load: {r.engine_choice}", style="dim"), soft_wrap=True)
    for e in r.excluded:
        console.print(Text(f"not a candidate: {e.kv_cache_dtype} ({e.reason})", style="dim"), soft_wrap=True)
    focus = next((o for o in r.options if o.id == (chosen or (r.closest.option if r.closest else ""))), None)
    if focus is not None:
        _inputs(console, focus)
    console.print(Text("model: " + " | ".join(r.assumptions), style="dim"), soft_wrap=True)


def _inputs(console: object, o: PlanOption) -> None:
    from rich.table import Table

    t = Table(title=f"inputs of {o.id}", title_justify="left", header_style="bold", box=None, padding=(0, 1))
    t.add_column("input", no_wrap=True)
    t.add_column("value", no_wrap=True)
    t.add_column("basis", overflow="fold", min_width=40)
    for name, e in (("decode slope", o.decode_slope), ("decode intercept", o.decode_intercept),
                    ("prefill", o.prefill), ("KV capacity", o.kv_capacity_tokens), ("admitted", o.capacity_requests),
                    ("TTFT", o.ttft), ("accuracy", o.accuracy_recovery)):
        t.add_row(name, f"{_v(e)} {e.unit} ({e.provenance})", e.basis)
    console.print(t)  # type: ignore[attr-defined]


def plot_plan(result: PlanResult, path: str) -> Path:
    """Pareto plot: tokens/s per user vs tokens/s per GPU, one curve per option, the TPOT target as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from kvpolicy.errors import InputError

        raise InputError("--plot needs matplotlib: `pip install matplotlib` (kvpolicy's `plot` extra).") from None
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ttft = result.slo.ttft_s
    for curve in result.curves:
        if not curve.points:
            continue
        xs = [p.tokens_per_s_per_user for p in curve.points]
        ys = [p.tokens_per_s_per_gpu for p in curve.points]
        (line,) = ax.plot(xs, ys, marker="o", label=curve.option,
                          linewidth=2.5 if result.chosen and curve.option == result.chosen.option else 1.2)
        late = [(x, y) for x, y, p in zip(xs, ys, curve.points) if ttft is not None and p.ttft_s > ttft]
        if late:
            ax.scatter(*zip(*late), s=80, facecolors="white", edgecolors=line.get_color(), zorder=3)
        for x, y, p in zip(xs, ys, curve.points):
            ax.annotate(str(p.concurrency), (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    if result.slo.tpot_ms is not None:
        ax.axvline(1e3 / result.slo.tpot_ms, color="red", linestyle="--",
                   label=f"TPOT {result.slo.tpot_ms:g} ms (right of it meets)")
    if ttft is not None:
        ax.scatter([], [], s=80, facecolors="white", edgecolors="gray", label=f"hollow: TTFT > {ttft:g} s")
    for o in result.options:
        if o.tokens_per_s_per_user.value and o.tokens_per_s_per_gpu.value:
            ax.scatter([o.tokens_per_s_per_user.value], [o.tokens_per_s_per_gpu.value], marker="*", s=160,
                       color="black", zorder=4)
    ax.scatter([], [], marker="*", s=120, color="black", label="at the given traffic")
    ax.set_xlabel("output tokens/s per user (1 / TPOT)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(f"{result.model} on {result.gpus} x {result.gpu}: {result.traffic.describe()}\n"
                 "closed loop over concurrency (labels: clients in all)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    out = Path(path)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
