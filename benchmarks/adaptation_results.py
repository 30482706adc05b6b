"""Table and plot of benchmarks/results/adaptation.json (written by benchmarks/adaptation.py):
held-out exact match of the quickstart tasks against training steps for each adaptation
of the AR baseline and the DLM trained from scratch, 3 seeds each (mean line, min-max
band); the steps each run took to reach the from-scratch runs' mean final accuracy.

    python benchmarks/adaptation_results.py   # prints the table, writes adaptation.png
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results"
LABELS = {"instant": "instant + shift", "anneal": "anneal + shift",
          "blocks": "block schedule (bd3lm)", "scratch": "from scratch (mdlm)"}  # fmt: skip


def curves(data: dict) -> dict[str, dict[int, dict[int, float]]]:
    """{name: {seed: {step: accuracy}}} for the from-scratch runs and each mode."""
    out = {"scratch": data["scratch"], **data["adapt"]}
    return {name: {int(seed): {int(step): acc for step, acc in points.items()}
                   for seed, points in runs.items()}
            for name, runs in out.items()}  # fmt: skip


def first_reach(points: dict[int, float], target: float) -> int | None:
    """The first scored step whose accuracy is at least `target` (None: never)."""
    return next((step for step in sorted(points) if points[step] >= target - 1e-12), None)


def table(data: dict) -> tuple[list[str], float]:
    runs = curves(data)
    scratch_steps = data["protocol"]["from_scratch_steps"]
    finals = [points[max(points)] for points in runs["scratch"].values()]
    target = statistics.mean(finals)
    lines = [f"from-scratch final held-out accuracy at step {scratch_steps}: "
             f"{100 * target:.1f}% mean ({', '.join(f'{100 * f:.1f}' for f in finals)})",
             "",
             "| run | held-out at its last step, mean (min-max) | steps to reach "
             f"{100 * target:.1f}%, per seed | / {scratch_steps} steps (mean) |",
             "|---|---|---|---|"]  # fmt: skip
    for name, seeds in runs.items():
        last = [points[max(points)] for points in seeds.values()]
        reach = [first_reach(points, target) for points in seeds.values()]
        shown = ", ".join("never" if r is None else str(r) for r in reach)
        ratio = ("-" if None in reach
                 else f"{statistics.mean(reach) / scratch_steps:.2f}x")  # fmt: skip
        lines.append(f"| {LABELS[name]} (to step {max(max(p) for p in seeds.values())}) | "
                     f"{100 * statistics.mean(last):.1f}% ({100 * min(last):.1f}-"
                     f"{100 * max(last):.1f}) | {shown} | {ratio} |")  # fmt: skip
    return lines, target


def main() -> None:
    import matplotlib  # the `plot` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads((HERE / "adaptation.json").read_text())
    lines, target = table(data)
    print("\n".join(lines))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, seeds in curves(data).items():
        steps = sorted(set.intersection(*(set(p) for p in seeds.values())))
        values = [[100 * seeds[s][step] for s in seeds] for step in steps]
        ax.plot(steps, [statistics.mean(v) for v in values], marker="o", markersize=3,
                label=LABELS[name])  # fmt: skip
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2)
    ax.axhline(100 * target, color="gray", linestyle="--", linewidth=1,
               label="from-scratch final (mean of 3 seeds)")  # fmt: skip
    ax.axvline(data["protocol"]["from_scratch_steps"] / 2, color="gray", linestyle=":",
               linewidth=1, label="0.5x the from-scratch steps")  # fmt: skip
    ax.set_xlabel("training steps (batch 64 x 20 tokens; adaptation steps after the AR run)")
    ax.set_ylabel("held-out exact match (%)")
    ax.set_title("quickstart tasks: A2D from the AR baseline vs from scratch (3 seeds)")
    ax.set_ylim(0, 101)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(HERE / "adaptation.png", dpi=100)


if __name__ == "__main__":
    main()
