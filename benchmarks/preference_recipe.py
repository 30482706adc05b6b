"""Preference optimization recipe on the built-in tasks: from a model stopped early, DPO on
ELBOs (diffusion.objective: preference) with pairs of right and wrong answers raises
held-out exact match.

1. Base: a smaller quickstart (hidden 64, 3 layers, 0.16M parameters; reverse, sort and
   add on 2-4 digits, rows of 16 tokens, constant learning rate) stopped after only
   --base-steps steps, so held-out exact match is low (40-70%).
2. Pairs: the base model answers --pair-prompts training prompts (greedy, the held-out
   sampler); every wrong answer gives a pair (chosen: the right answer, rejected: the
   model's own answer). Written to pairs.jsonl: the run reads them like any pair file.
3. Preference runs from the base (model.pretrained), the reference being the base itself:
   plain DPO on ELBOs (VRPO), and the same with preference.chosen_nll_weight = --nll (an
   NLL term on the chosen answers); held-out exact match (the task set's held-out prompts,
   never trained on) measured every --every steps on the policy as it trains.
4. Control: the same number of steps of the base's own objective (mdlm) on the chosen
   answers alone (SFT on the right answers of the same prompts), same optimizer settings:
   what the right answers alone buy, without the rejected ones.

Writes benchmarks/results/preference_recipe.{md,json,png}.
Run: python benchmarks/preference_recipe.py          (about 10 minutes on 2 CPU cores)
     python benchmarks/preference_recipe.py --quick  (a smoke run; prints only)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from unmask.config import load_config
from unmask.data.synthetic import make_synthetic, make_synthetic_heldout
from unmask.sampling.accuracy import heldout_accuracy
from unmask.train.trainer import Trainer

RESULTS = Path(__file__).parent / "results"
BASE = ["model.hidden_size=64", "model.intermediate_size=192", "model.num_hidden_layers=3",
        "data.synthetic_max_digits=4", "data.synthetic_train_size=40000",
        "data.packing_length=16"]  # fmt: skip
QUIET = ["train.disable_tqdm=true", "train.overwrite_output_dir=true",
         "eval.generate_accuracy=false", "train.eval_steps=0"]  # fmt: skip


def train_base(out: Path, steps: int) -> Path:
    final = out / "base" / "final"
    if not final.is_dir():
        Trainer(load_config(None, [*BASE, f"train.output_dir={out / 'base'}",
                                   f"train.max_steps={steps}", "train.save_steps=0",
                                   "train.logging_steps=100", "optim.warmup_steps=30",
                                   "optim.lr_scheduler_type=constant_with_warmup",
                                   "train.per_device_train_batch_size=32",
                                   *QUIET])).train()  # fmt: skip
    return final


def accuracy(model, tokenizer, examples, cfg) -> tuple[float, list]:
    return heldout_accuracy(model, tokenizer, examples, cfg.eval, cfg.data.packing_length,
                            next(model.parameters()).device)  # fmt: skip


def make_pairs(base: Path, out: Path, prompts: int, seed: int) -> tuple[int, float]:
    """pairs.jsonl: the base model's wrong answers to training prompts, rejected against the
    right answers. Returns (pairs, the base's exact match on those prompts)."""
    cfg = load_config(None, [*BASE, f"model.pretrained={base}", f"data.tokenizer={base}"])
    train, _ = make_synthetic(cfg.data)
    examples = random.Random(seed).sample(train, prompts)
    from unmask.checkpoint import load_for_sampling

    sm = load_for_sampling(str(base))
    cfg.eval = cfg.eval.model_copy(update={"max_examples": prompts})
    acc, rows = accuracy(sm.model, sm.tokenizer, examples, cfg)
    pairs = [{"prompt": p, "chosen": want, "rejected": got} for p, want, got in rows if got != want]
    with open(out / "pairs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in pairs)
    with open(out / "chosen.jsonl", "w") as f:  # the control's SFT rows: right answers only
        f.writelines(json.dumps({"prompt": r["prompt"], "response": r["chosen"]}) + "\n"
                     for r in pairs)  # fmt: skip
    return len(pairs), acc


def run_curve(overrides: list[str], every: int, heldout: list) -> tuple[list, float]:
    """Train with `overrides`, scoring held-out exact match at step 0 and every `every`
    steps on the live model; returns ([(step, accuracy)], seconds)."""
    cfg = load_config(None, overrides)
    trainer = Trainer(cfg)
    curve = [(0, accuracy(trainer.model, trainer.tokenizer, heldout, cfg)[0])]
    save = trainer.save

    def save_and_score():
        curve.append((trainer.step, accuracy(trainer.model, trainer.tokenizer, heldout, cfg)[0]))
        print(f"  step {trainer.step}: held-out exact match {curve[-1][1]:.1%}", flush=True)
        return save()

    trainer.save = save_and_score
    started = time.perf_counter()
    trainer.train()
    return curve, time.perf_counter() - started


def common(base: Path, out: Path, name: str, args) -> list[str]:
    return [*BASE, f"model.pretrained={base}", f"data.tokenizer={base}", "data.eval_split=0",
            f"train.output_dir={out / name}", f"train.max_steps={args.steps}",
            f"train.save_steps={args.every}", "train.save_total_limit=1",
            f"train.logging_steps={args.every}", f"train.seed={args.seed}",
            f"train.per_device_train_batch_size={args.batch}",
            f"optim.learning_rate={args.lr}", "optim.lr_scheduler_type=constant_with_warmup",
            "optim.warmup_steps=10", "optim.weight_decay=0.0", *QUIET]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/unmask-preference-recipe")
    parser.add_argument("--base-steps", type=int, default=1800)
    parser.add_argument("--base", help="a trained base folder to start from (skips step 1)")
    parser.add_argument("--pair-prompts", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--nll", type=float, default=1.0, help="preference.chosen_nll_weight")
    parser.add_argument("--skip-control", action="store_true")
    parser.add_argument("--heldout", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: tiny models on a shared machine run faster)",
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.base_steps, args.pair_prompts, args.steps, args.every, args.heldout = 30, 64, 4, 2, 16
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    base = Path(args.base) if args.base else train_base(out, args.base_steps)
    num_pairs, base_train_acc = make_pairs(base, out, args.pair_prompts, args.seed)
    print(f"{num_pairs} pairs from {args.pair_prompts} training prompts "
          f"(base exact match on them {base_train_acc:.1%})", flush=True)  # fmt: skip
    heldout = make_synthetic_heldout(load_config(None, BASE).data)[: args.heldout]

    def pref(name: str, nll: float) -> list[str]:
        return [*common(base, out, name, args), "diffusion.objective=preference",
                f"data.dataset={out / 'pairs.jsonl'}", f"preference.beta={args.beta}",
                f"preference.num_samples={args.samples}",
                f"preference.chosen_nll_weight={nll}"]  # fmt: skip

    print("preference run: DPO on ELBOs (VRPO)", flush=True)
    pref_curve, pref_s = run_curve(pref("preference", 0.0), args.every, heldout)
    print(f"preference run with chosen_nll_weight {args.nll}", flush=True)
    nll_curve, nll_s = run_curve(pref("preference_nll", args.nll), args.every, heldout)
    # the control sees each chosen answer as often as the preference run: same rows per step
    sft = [*common(base, out, "sft", args), "diffusion.objective=mdlm",
           f"data.dataset={out / 'chosen.jsonl'}"]  # fmt: skip
    print("control: the base objective on the chosen answers only", flush=True)
    sft_curve, sft_s = ([], 0.0) if args.skip_control else run_curve(sft, args.every, heldout)
    metrics = [json.loads(line) for line in (out / "preference" / "metrics.jsonl").open()]
    result = {"args": vars(args), "pairs": num_pairs, "base_train_exact_match": base_train_acc,
              "preference": pref_curve, "preference_nll": nll_curve, "control_sft": sft_curve,
              "preference_seconds": pref_s, "preference_nll_seconds": nll_s,
              "control_seconds": sft_s,
              "reward_accuracy": [(m["step"], m["reward_accuracy"]) for m in metrics
                                  if "reward_accuracy" in m],
              "total_seconds": time.perf_counter() - started}  # fmt: skip
    print(json.dumps(result, indent=1))
    if not args.quick:
        write_results(result)


def write_results(result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "preference_recipe.json").write_text(json.dumps(result, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    a = result["args"]
    for key, label in (("preference", "DPO on ELBOs (VRPO)"),
                       ("preference_nll", f"DPO + NLL on chosen (weight {a['nll']})"),
                       ("control_sft", "control: mdlm on the chosen answers")):  # fmt: skip
        steps, accs = zip(*result[key])
        ax.plot(steps, [100 * a for a in accs], marker="o", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out exact match (%)")
    ax.set_title("From a model stopped early (quickstart tasks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "preference_recipe.png", dpi=100)
    rows = "\n".join(f"| {s} | {100 * p:.1f}% | {100 * n:.1f}% | {100 * c:.1f}% |"
                     for (s, p), (_, n), (_, c) in zip(result["preference"],
                                                       result["preference_nll"],
                                                       result["control_sft"]))  # fmt: skip
    text = f"""# Preference optimization recipe (benchmarks/preference_recipe.py)

Base: a smaller quickstart model (hidden 64, 3 layers; reverse, sort, add on 2-4
digits) trained {a["base_steps"]} steps at a constant learning rate (folder:
{a["base"] or "step 1 of the script"}). Pairs: its wrong answers to
{a["pair_prompts"]} training prompts ({result["pairs"]} pairs; base exact match on those
prompts {100 * result["base_train_exact_match"]:.1f}%), chosen = the right answer.
Preference: beta {a["beta"]}, {a["samples"]} ELBO samples per completion, stratified t,
shared noise, {a["batch"]} pairs per step, AdamW lr {a["lr"]} (constant after 10 warmup
steps); plain DPO, and DPO with preference.chosen_nll_weight {a["nll"]}. Control: the mdlm
objective on the chosen answers alone, same steps, rows per step and optimizer. Held-out
exact match on {a["heldout"]} held-out prompts (greedy), scored on the live model.

| step | DPO (VRPO) | DPO + NLL | control (mdlm on chosen) |
|---|---|---|---|
{rows}

Wall time: DPO {result["preference_seconds"]:.0f} s, DPO + NLL
{result["preference_nll_seconds"]:.0f} s, control
{result["control_seconds"]:.0f} s (held-out scoring included); whole script
{result["total_seconds"]:.0f} s.

![curve](preference_recipe.png)
"""
    (RESULTS / "preference_recipe.md").write_text(text)


if __name__ == "__main__":
    main()
