"""PNG plot of a bench result: ITL vs context, one line per format (matplotlib, the `plot` extra)."""

from __future__ import annotations

from pathlib import Path

from kvpolicy.runtime.results import BenchResult

INSTALL_HINT = "pip install matplotlib (kvpolicy's `plot` extra) to get the PNG plot; the JSON result is written anyway."


def have_matplotlib() -> bool:
    """True when matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_bench(result: BenchResult, path: Path) -> None:
    """Write ITL (ms) against context (tokens), points and fitted lines, one panel per batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = result.batches
    fig, axes = plt.subplots(1, len(batches), figsize=(6.4 * len(batches), 4.6), squeeze=False)
    fits = {(f.variant, f.batch): f for f in result.fits}
    longest = max(result.contexts)
    for ax, batch in zip(axes[0], batches):
        for v in result.variants:
            pts = sorted((p.context_tokens, p.itl_ms) for p in result.points
                         if p.variant == v.name and p.batch == batch)
            if not pts:
                continue
            f = fits.get((v.name, batch))
            label = v.name
            if f is not None and f.slope_ratio is not None:
                be = "never" if f.break_even_tokens is None else f"{f.break_even_tokens:,.0f}"
                label += f" (slope {f.slope_ratio:.2f}x, break-even {be})"
            line = ax.plot([x for x, _ in pts], [y for _, y in pts], "o", ms=4)[0]
            if f is not None:
                ax.plot([0, longest], [f.intercept_ms, f.intercept_ms + f.slope_ms_per_token * longest], "-",
                        color=line.get_color(), lw=1.2, label=label)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode-step attention time (ms)")
        ax.set_title(f"batch {batch}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    env = result.environment
    fig.suptitle(f"{result.model} geometry on {env.device} ({env.backend}), all attention layers", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
