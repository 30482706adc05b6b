"""The GRPO recipe on a built-in task: held-out exact match before and after GRPO with the
exact-match reward, next to a baseline whose rewards are shuffled within each group.

1. base: recipes/grpo_reverse_base.yaml (a small DLM, the mdlm objective on `reverse`), in
   segments of --base-segment steps, stopped at the first held-out exact match in
   [--low, --high] (the recipe's starting point: a model stopped early);
2. two GRPO runs from it (recipes/grpo_reverse.yaml), run side by side: `grpo` and
   `shuffled` (grpo.shuffle_rewards: true), each for --minutes of training wall time, in
   segments of --segment steps (the trainer resumes from its checkpoint), with held-out exact
   match (greedy, --eval-prompts prompts) after every segment (evaluation time not counted).

Writes benchmarks/results/grpo_recipe.{json,md,png}. A benchmark, not a test: numbers depend
on the machine and its load (run with OMP_NUM_THREADS=1 per process).

    OMP_NUM_THREADS=1 python benchmarks/grpo_recipe.py --minutes 15
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "grpo_reverse.yaml"
BASE_RECIPE = ROOT / "recipes" / "grpo_reverse_base.yaml"
RESULTS = ROOT / "benchmarks" / "results"


def recipe(path: Path = RECIPE) -> dict:
    """The recipe's tree, without its held-out generation (measured here, after each
    segment, and left out of the training time)."""
    tree = yaml.safe_load(path.read_text())
    tree["eval"] = {"generate_accuracy": False}
    return tree


def heldout_em(model, tokenizer, cfg, prompts: int) -> float:
    from unmask.config import EvalConfig
    from unmask.data import heldout_examples
    from unmask.sampling.accuracy import heldout_accuracy

    examples = heldout_examples(cfg.data)[:prompts]
    acc, _ = heldout_accuracy(model, tokenizer, examples, EvalConfig(max_examples=prompts,
                              batch_size=100), cfg.data.packing_length, torch.device("cpu"))  # fmt: skip
    return acc


def run_segment(tree: dict, out: Path, steps: int, prompts: int, resume: bool):
    """Train to `steps` (resuming from out's checkpoint), then the held-out EM of the model."""
    from unmask.config import validate_tree
    from unmask.train.trainer import Trainer

    tree = json.loads(json.dumps(tree))
    tree.setdefault("train", {}).update(output_dir=str(out), max_steps=steps, save_steps=steps,
                                        resume_from_checkpoint=resume, disable_tqdm=True)  # fmt: skip
    trainer = Trainer(validate_tree(tree))
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    return trainer, seconds, heldout_em(trainer.model, trainer.tokenizer, trainer.cfg, prompts)


def base_exact_match(folder: str, prompts: int) -> float:
    from unmask.config import validate_tree
    from unmask.data import build_tokenizer
    from unmask.models import ModelConfig, build_model

    cfg = validate_tree({"data": recipe()["data"]})
    model = build_model(ModelConfig(pretrained=folder)).eval()
    tokenizer = build_tokenizer(cfg.data.model_copy(update={"tokenizer": folder}))
    return heldout_em(model, tokenizer, cfg, prompts)


def train_base(args, out: Path) -> dict:
    tree = recipe(BASE_RECIPE)
    assert tree["data"] == recipe()["data"], "the base trains on the GRPO recipe's data"
    history, steps, total = [], 0, 0.0
    while steps < args.base_max_steps:
        steps += args.base_segment
        _, seconds, em = run_segment(tree, out, steps, args.eval_prompts, steps > args.base_segment)
        total += seconds
        history.append({"step": steps, "heldout_exact_match": em, "train_seconds": total})
        print(f"base step {steps}: held-out exact match {em:.1%} ({total:.0f}s)", flush=True)
        if em >= args.low:
            break
    (out / "base_history.json").write_text(json.dumps(history, indent=2))
    return {"history": history, "final": str(out / "final"), "exact_match": history[-1][
        "heldout_exact_match"]}  # fmt: skip


def grpo_arm(args, base_final: str, out: Path, shuffled: bool) -> dict:
    r = recipe()
    r["model"] = {"pretrained": base_final}
    r["grpo"]["shuffle_rewards"] = shuffled
    r.setdefault("train", {})["log_mfu"] = False
    history, steps, total = [], 0, 0.0
    while total < args.minutes * 60:
        steps += args.segment
        _, seconds, em = run_segment(r, out, steps, args.eval_prompts, steps > args.segment)
        total += seconds
        history.append({"step": steps, "heldout_exact_match": em, "train_seconds": total})
        print(f"{'shuffled' if shuffled else 'grpo'} step {steps}: held-out exact match "
              f"{em:.1%} ({total:.0f}s)", flush=True)  # fmt: skip
    return {"history": history}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/grpo_recipe")
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--segment", type=int, default=50)
    parser.add_argument("--base-segment", type=int, default=25)
    parser.add_argument("--base-max-steps", type=int, default=3000)
    parser.add_argument("--low", type=float, default=0.4)
    parser.add_argument("--high", type=float, default=0.7)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--arm", choices=["grpo", "shuffled"], help=argparse.SUPPRESS)
    parser.add_argument("--base-final", help="start from this model folder (skip step 1)")
    args = parser.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    if args.arm:  # one GRPO arm, in its own process
        result = grpo_arm(args, args.base_final, out / args.arm, args.arm == "shuffled")
        (out / f"{args.arm}.json").write_text(json.dumps(result, indent=2))
        return
    started = time.perf_counter()
    if args.base_final:  # a base trained before (its held-out exact match measured again)
        saved = Path(args.base_final).parent / "base_history.json"  # train_base's, if any
        history = json.loads(saved.read_text()) if saved.is_file() else []
        base = {"history": history, "final": args.base_final,
                "exact_match": base_exact_match(args.base_final, args.eval_prompts)}  # fmt: skip
    else:
        base = train_base(args, out / "base")
    if not args.low <= base["exact_match"] <= args.high:
        print(f"base exact match {base['exact_match']:.1%} is outside [{args.low}, {args.high}]")
    arms = {}
    procs = {arm: subprocess.Popen([sys.executable, __file__, "--arm", arm, "--base-final",
                                    base["final"], "--out", str(out), "--minutes",
                                    str(args.minutes), "--segment", str(args.segment),
                                    "--eval-prompts", str(args.eval_prompts)])
             for arm in ("grpo", "shuffled")}  # fmt: skip
    for arm, proc in procs.items():
        proc.wait()
        arms[arm] = json.loads((out / f"{arm}.json").read_text())
    result = {"base": base, "arms": arms, "minutes": args.minutes,
              "wall_seconds": time.perf_counter() - started, "recipe": recipe()}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grpo_recipe.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "grpo_recipe.png")
    print(json.dumps({k: v["history"][-1] for k, v in arms.items()}, indent=2))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    start = result["base"]["exact_match"]
    for arm, data in result["arms"].items():
        xs = [0.0] + [h["train_seconds"] / 60 for h in data["history"]]
        ys = [start] + [h["heldout_exact_match"] for h in data["history"]]
        ax.plot(xs, [100 * y for y in ys], marker="o", label=arm)
    ax.set_xlabel("GRPO training wall time (minutes, evaluation excluded)")
    ax.set_ylabel("held-out exact match (%)")
    ax.set_title("GRPO with exact_match on `reverse` vs shuffled rewards")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
