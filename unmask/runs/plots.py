"""`unmask plot`: one or more runs' metrics.jsonl drawn as PNG files, one per quantity
(loss with eval-loss markers, learning rate, gradient norm, tokens/s, skipped non-finite
steps; expert load and the held-out exact match when a run logged them), the runs overlaid,
x = optimizer step.

`build_figures` returns the matplotlib figures (tests read their labels); `plot_runs`
checks every input, builds the figures and only then writes. matplotlib is the optional
`plot` extra, imported when a figure is built.
"""

import math
from dataclasses import dataclass
from pathlib import Path

from unmask.errors import InputError
from unmask.runs.report import HELDOUT_KEY, PLOTS_DIR, SKIP_KEYS, read_history, series

MISSING_MATPLOTLIB = "unmask plot needs matplotlib: pip install 'unmask[plot]'"
FIGSIZE = (7.0, 4.2)  # inches
DPI = 120
WIDE = 30.0  # a positive quantity whose max / min reaches this gets a log y axis
X_LABEL = "optimizer step"
LEGEND_INSIDE = 3  # runs whose legend fits inside the axes


@dataclass(frozen=True)
class Quantity:
    """One PNG: `name`.png draws `keys` of metrics.jsonl."""

    name: str
    keys: tuple[str, ...]
    title: str
    ylabel: str
    log_if_wide: bool = False  # log y axis when the values span >= WIDE


QUANTITIES = (
    Quantity("loss", ("loss", "eval_loss"), "Loss: training (lines), eval (markers)", "loss",
             log_if_wide=True),
    Quantity("learning_rate", ("learning_rate",), "Learning rate", "learning rate"),
    Quantity("grad_norm", ("grad_norm",), "Gradient norm (before clipping)",
             "gradient norm (L2, all parameters)", log_if_wide=True),
    Quantity("tokens_per_second", ("tokens_per_second",), "Training throughput",
             "tokens / second"),
    Quantity("skipped_steps", SKIP_KEYS, "Skipped (non-finite) steps",
             "skipped steps (logged count)"),
    # mixture of experts only (dense runs never log it, and get no note about it)
    Quantity("moe_load", ("moe_load_max_over_mean",),
             "Expert load: largest expert over the mean (1 = balanced), worst layer",
             "max / mean tokens per expert"),
    # runs with QK-clip only (optim.qk_clip_threshold; the others get no note about it)
    Quantity("qk_max_logit", ("qk_max_logit",),
             "Largest pre-softmax attention logit of the step, over heads and layers (QK-clip)",
             "max logit", log_if_wide=True),
    # runs with eval.generate_accuracy only (the others get no note about it)
    Quantity("heldout_exact_match", (HELDOUT_KEY,),
             "Held-out exact match (greedy answers; legend: the last one)",
             "exact match"),
)  # fmt: skip
#: drawn only when a run logged them: no note when none did
OPTIONAL = ("moe_load", "qk_max_logit", "heldout_exact_match")


@dataclass
class Run:
    """A run's label (its directory name, or its path where two names collide) and records."""

    label: str
    records: list[dict]


def load_runs(run_dirs: list[str | Path]) -> list[Run]:
    """Every run directory's history (InputError on the first bad one), labelled."""
    histories = [read_history(path) for path in run_dirs]
    names = [Path(path).resolve().name for path in run_dirs]
    labels = [name if names.count(name) == 1 else str(path) for name, path in zip(names, run_dirs)]
    return [Run(label, records) for label, records in zip(labels, histories)]


def _matplotlib():
    """Figure and the ticker module; imported here: matplotlib is the optional `plot` extra."""
    try:
        from matplotlib import ticker
        from matplotlib.figure import Figure
    except ImportError:
        raise InputError(MISSING_MATPLOTLIB) from None
    return Figure, ticker


def _logged(run: Run, quantity: Quantity) -> bool:
    """The run logged this quantity (skipped steps: logged a count above 0)."""
    if quantity.name == "skipped_steps":
        return any(v > 0 for key in quantity.keys for v in series(run.records, key)[1])
    return bool(series(run.records, quantity.keys[0])[1])


def build_figures(runs: list[Run]) -> tuple[dict[str, object], list[str]]:
    """The figures by quantity name, for the quantities at least one run logged, and one
    line per quantity or run left out."""
    Figure, ticker = _matplotlib()
    figures, notes = {}, []
    for quantity in QUANTITIES:
        drawn = [(index, run) for index, run in enumerate(runs) if _logged(run, quantity)]
        if not drawn and quantity.name in OPTIONAL:
            continue
        if not drawn:
            what = "skipped a step" if quantity.name == "skipped_steps" else "logged it"
            notes.append(f"no {quantity.name}.png: no run {what}")
            continue
        left_out = [run.label for run in runs if not _logged(run, quantity)]
        if left_out and quantity.name != "skipped_steps":
            notes.append(f"{quantity.name}.png leaves out {', '.join(left_out)} "
                         f"(never logged {quantity.keys[0]})")  # fmt: skip
        fig = Figure(figsize=FIGSIZE, layout="constrained")
        ax = fig.subplots()
        values = []
        for index, run in drawn:
            values += _draw(ax, quantity, run, f"C{index % 10}")
        ax.set_title(quantity.title)
        ax.set_xlabel(X_LABEL)
        ax.set_ylabel(quantity.ylabel)
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        if quantity.name == "skipped_steps":
            ax.yaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        if quantity.log_if_wide and _wide(values):
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(_plain))
            if _span(values) <= 1000:  # wider: minor labels would crowd
                ax.yaxis.set_minor_formatter(ticker.FuncFormatter(_two_and_five))
        elif quantity.name == "learning_rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        elif quantity.name == "heldout_exact_match":
            ax.yaxis.set_major_formatter(ticker.PercentFormatter(1.0))
            ax.set_ylim(-0.03, 1.03)  # 0% to 100%: one run's accuracy reads against the scale
        elif quantity.name == "tokens_per_second":
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(_thousands))
            ax.set_ylim(bottom=0)  # from 0: noise in a flat throughput does not look like a trend
        ax.grid(alpha=0.3)
        if len(drawn) > LEGEND_INSIDE:  # many entries: beside the axes, not over the curves
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.legend(fontsize=8)
        figures[quantity.name] = fig
    return figures, notes


def _draw(ax, quantity: Quantity, run: Run, color: str) -> list[float]:
    """One run's curves on ax; returns the values drawn."""
    drawn = []
    if quantity.name == "skipped_steps":
        steps, values = series(run.records, SKIP_KEYS[0])
        if values:
            ax.step(steps, values, where="post", color=color,
                    marker="." if len(values) < 50 else None, label=run.label)  # fmt: skip
        return values
    steps, values = series(run.records, quantity.keys[0])
    if quantity.name == "heldout_exact_match":  # measured once or a few times: markers
        ax.plot(steps, values, color=color, linewidth=1.0, marker="o", markersize=6,
                label=f"{run.label} ({values[-1]:.1%})")  # fmt: skip
        return values
    marker = "." if len(values) == 1 else None  # a single point shows only as a marker
    ax.plot(steps, values, color=color, linewidth=1.4, marker=marker, label=run.label)
    drawn += values
    if quantity.name == "loss":
        steps, values = series(run.records, "eval_loss")
        if values:
            ax.plot(steps, values, linestyle="none", marker="o", markersize=5, color=color,
                    markeredgecolor="black", markeredgewidth=0.6,
                    label=f"{run.label} (eval)")  # fmt: skip
            drawn += values
    return drawn


def _plain(value: float, _position) -> str:
    """Log-axis labels 0.1, 1, 10 rather than powers of ten."""
    return f"{value:g}"


def _two_and_five(value: float, _position) -> str:
    """Log-axis minor labels at 2 and 5 times a power of ten (0.02, 0.05, 0.2, ...)."""
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return f"{value:g}" if round(mantissa, 6) in (2.0, 5.0) else ""


def _thousands(value: float, _position) -> str:
    """Tick labels 0, 500, 12k, 40k."""
    return f"{value / 1000:g}k" if abs(value) >= 1000 else f"{value:g}"


def _span(values: list[float]) -> float:
    """max / min of the finite values; 0 when some are <= 0 or none are finite."""
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) / min(finite) if finite and min(finite) > 0 else 0.0


def _wide(values: list[float]) -> bool:
    """Positive values spanning a factor of WIDE or more (a loss falling 4 -> 0.05)."""
    return _span(values) >= WIDE


def default_out(run_dirs: list[str | Path]) -> Path:
    """Where the PNGs go without --out: the first run directory's plots/ folder."""
    return Path(run_dirs[0]) / PLOTS_DIR


def plot_runs(run_dirs: list[str | Path], out: str | Path | None = None) -> list[str]:
    """Write one PNG per quantity into out (default: the first run's plots/) and return the
    lines to print: 'wrote PATH' per file, then what was left out. Every run directory and
    out are checked first: bad input is an InputError and nothing is written."""
    if not run_dirs:
        raise InputError("give at least one run directory")
    runs = load_runs(run_dirs)
    out = default_out(run_dirs) if out is None else Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {str(out)!r} is a file; give a folder for the PNGs")
    figures, notes = build_figures(runs)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"--out {str(out)!r}: cannot create the folder ({err.strerror})") from None
    lines = []
    for name, fig in figures.items():
        path = out / f"{name}.png"
        fig.savefig(path, dpi=DPI)
        lines.append(f"wrote {path}")
    return lines + notes
