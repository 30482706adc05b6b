"""QK-clip's cost and effect on the quickstart config (configs/quickstart.yaml), on CPU.

(a) Cost: training tokens/s with optim.qk_clip_threshold off and on (100, Megatron's
    default: the capture runs every training forward, the clip after every step), in
    interleaved rounds (off, on, off, on, ...), each a fresh run of --steps steps whose
    tokens/s is the whole run's window; medians and spreads reported.
(b) The exploding-logit demo: the quickstart model without q/k norm (model.qk_norm: false)
    at a high learning rate (--demo-lr, Muon and AdamW), once with a threshold that never
    clips (1e9: the capture alone, so the max logit is logged) and once with --demo-tau;
    the largest logged qk_max_logit of each run, and its last.

Run: python benchmarks/qk_clip.py [--steps 40 --rounds 3]   (prints a markdown report;
     --out FILE writes it)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
import yaml
from common import machine

from unmask.config import validate_tree
from unmask.train.trainer import Trainer

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


def run(tree: dict, out: Path) -> list[dict]:
    tree = json.loads(json.dumps(tree))
    tree["train"]["output_dir"] = str(out)
    Trainer(validate_tree(tree)).train()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def base(steps: int, logging: int) -> dict:
    tree = yaml.safe_load(QUICKSTART.read_text())
    tree["data"]["synthetic_train_size"] = 4000
    tree.pop("eval", None)
    tree["train"].update(max_steps=steps, logging_steps=logging, eval_steps=0, save_steps=0,
                         num_threads=1)  # fmt: skip
    tree["optim"]["warmup_steps"] = 0
    return tree


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--demo-steps", type=int, default=150)
    parser.add_argument("--demo-lr", type=float, default=0.05)
    parser.add_argument("--demo-tau", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="qk_clip_bench_"))
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            tree = base(args.steps, args.steps)
            if name == "on":
                tree["optim"]["qk_clip_threshold"] = 100.0
            records = run(tree, root / f"{name}-{r}")
            rates[name].append(next(m["tokens_per_second"] for m in records
                                    if "tokens_per_second" in m))  # fmt: skip
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    lines = [
        "# QK-clip on the quickstart config (CPU)",
        "",
        f"{machine('torch')}; one thread; {args.steps} steps of 64 rows x 20 tokens a run.",
        "",
        "| optim.qk_clip_threshold | tokens/s (median) | runs |",
        "|---|---|---|",
        f"| null (off) | {off:,.0f} | {', '.join(f'{v:,.0f}' for v in rates['off'])} |",
        f"| 100 | {on:,.0f} | {', '.join(f'{v:,.0f}' for v in rates['on'])} |",
        "",
        f"Cost: {100 * (1 - on / off):.1f}% fewer tokens/s with the capture and the clip.",
        "",
        f"## Exploding logits: qk_norm false, learning_rate = muon_lr = {args.demo_lr}, "
        f"{args.demo_steps} steps",
        "",
        "| threshold | largest qk_max_logit | last qk_max_logit | steps that clipped |",
        "|---|---|---|---|",
    ]
    for tau in (1e9, args.demo_tau):
        tree = base(args.demo_steps, 1)
        tree["model"]["qk_norm"] = False
        tree["optim"].update(learning_rate=args.demo_lr, muon_lr=args.demo_lr,
                             qk_clip_threshold=tau, max_grad_norm=0.0)  # fmt: skip
        records = [m for m in run(tree, root / f"demo-{tau:g}") if "qk_max_logit" in m]
        peaks = [m["qk_max_logit"] for m in records]
        clipped = sum(1 for m in records if m["qk_clipped_heads"] > 0)
        label = "1e9 (capture only)" if tau == 1e9 else f"{tau:g}"
        lines.append(f"| {label} | {max(peaks):.1f} | {peaks[-1]:.1f} | {clipped} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
