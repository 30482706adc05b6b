"""Draw benchmarks/results/adaptation.png from benchmarks/results/adaptation.json: held-out
exact match of the quickstart tasks against training steps, for each adaptation of the
AR baseline and the DLM trained from scratch (docs/adaptation.md, Results). The numbers
are measured by the runs docs/adaptation.md lists; this script only draws them."""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results"


def main() -> None:
    import matplotlib  # the `plot` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads((HERE / "adaptation.json").read_text())
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in data["curves"].items():
        steps, acc = zip(*points)
        ax.plot(steps, [100 * a for a in acc], marker="o", label=name)
    ax.axhline(100 * data["from_scratch_3000_steps"], color="gray", linestyle="--",
               label="from scratch, 3000 steps (README)")  # fmt: skip
    ax.set_xlabel("training steps (batch 64 x 20 tokens)")
    ax.set_ylabel("held-out exact match (%)")
    ax.set_title("quickstart tasks: A2D from the AR baseline vs from scratch")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "adaptation.png", dpi=100)


if __name__ == "__main__":
    main()
