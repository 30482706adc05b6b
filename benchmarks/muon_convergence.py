"""AdamW vs Muon on the quickstart task: same config, same steps, each optimizer with the
best learning rate of a small sweep. Writes eval-loss curves as a PNG and a table.

    python benchmarks/muon_convergence.py [--steps 1000] [--adamw-lrs ...] [--muon-lrs ...]
    python benchmarks/muon_convergence.py --quick   (20 steps, one lr each; writes nothing)

Runs on CPU; Muon's Newton-Schulz iterates in float32 here because bf16 matmuls are slow
on most CPUs (on GPU keep the bf16 default).
"""

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from unmask.config import load_config
from unmask.train.trainer import Trainer

RESULTS = Path(__file__).parent / "results"


def run_one(name: str, lr: float, steps: int, root: Path, extra: list[str]) -> dict:
    out = root / f"{name}-{lr:g}"
    overrides = [
        f"train.output_dir={out}",
        f"train.max_steps={steps}",
        f"train.eval_steps={max(1, steps // 10)}",
        "train.eval_max_batches=null",
        f"train.logging_steps={max(1, steps // 10)}",
        f"train.save_steps={steps}",
        "train.disable_tqdm=true",
        f"optim.name={name}",
        f"optim.learning_rate={lr}",
        "optim.ns_dtype=float32",
        "eval.generate_accuracy=true",
        *extra,
    ]
    started = time.perf_counter()
    final = Trainer(load_config(None, overrides)).train()
    seconds = time.perf_counter() - started
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    return {
        "optimizer": name,
        "lr": lr,
        "curve": curve,
        "final_eval_loss": curve[-1][1],
        "heldout_exact_match": final.get("heldout_exact_match"),
        "seconds": seconds,
    }


def plot(runs: list[dict], best: dict, path: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"adamw": "tab:blue", "muon": "tab:red"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        steps_, losses = zip(*run["curve"])
        is_best = run is best[run["optimizer"]]
        ax.plot(
            steps_,
            losses,
            color=colors[run["optimizer"]],
            alpha=1.0 if is_best else 0.25,
            linewidth=2.2 if is_best else 1.0,
            label=f"{run['optimizer']} lr={run['lr']:g}" + (" (best)" if is_best else ""),
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("eval loss (MDLM ELBO per token)")
    ax.set_title(f"Quickstart task, {steps} steps: AdamW vs Muon (each at its best lr)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(runs: list[dict], best: dict) -> str:
    lines = [
        "| optimizer | lr | final eval loss | held-out exact match | wall s | best |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        acc = run["heldout_exact_match"]
        lines.append(
            f"| {run['optimizer']} | {run['lr']:g} | {run['final_eval_loss']:.4f} | "
            f"{'-' if acc is None else f'{acc:.1%}'} | {run['seconds']:.0f} | {'yes' if run is best[run['optimizer']] else ''} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--adamw-lrs", default="3e-4,1e-3,3e-3,1e-2")
    parser.add_argument("--muon-lrs", default="3e-3,1e-2,3e-2")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--reuse", action="store_true", help="keep runs already in OUT/muon_convergence.json"
    )
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 20 steps, one lr each, 20 held-out prompts, small data; "
                        "prints, writes no file")  # fmt: skip
    args = parser.parse_args()
    extra = []
    if args.quick:
        args.steps, args.adamw_lrs, args.muon_lrs = 20, "3e-4", "3e-3"
        extra = ["eval.max_examples=20", "data.synthetic_train_size=2000"]
        args.out = Path(tempfile.mkdtemp(prefix="unmask-muon-convergence-"))
        torch.set_num_threads(1)  # tiny GEMMs: a second thread only spins on a shared box
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "muon_convergence.json"
    done = {}
    if args.reuse and saved.is_file():
        for run in json.loads(saved.read_text()):
            if len(run["curve"]) and run["curve"][-1][0] == args.steps:
                done[(run["optimizer"], run["lr"])] = run
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs)):
            for lr in (float(x) for x in lrs.split(",")):
                run = done.get((name, lr)) or run_one(name, lr, args.steps, Path(tmp), extra)
                runs.append(run)
    best = {}
    for run in runs:
        current = best.get(run["optimizer"])
        if current is None or run["final_eval_loss"] < current["final_eval_loss"]:
            best[run["optimizer"]] = run
    plot(runs, best, args.out / "muon_convergence.png", args.steps)
    text = (
        f"# AdamW vs Muon on the quickstart task ({args.steps} steps, same config)\n\n"
        + table(runs, best)
        + "\n\nThe comparison is per optimizer step; `wall s` is only indicative (runs may share"
        + " the CPU with other work), see benchmarks/muon.py for the cost of a Muon step.\n"
        + "\n![eval loss curves](muon_convergence.png)\n"
    )
    (args.out / "muon_convergence.md").write_text(text)
    (args.out / "muon_convergence.json").write_text(json.dumps(runs, indent=1))
    print(text)
    if args.quick:
        shutil.rmtree(args.out)


if __name__ == "__main__":
    main()
