"""Variance and cost of the GRPO log-likelihood estimators (unmask/posttrain/estimators.py)
on a trained model, for fixed completions.

Completions: --prompts held-out prompts of the model's synthetic task, --group sampled
completions each (temperature 1). For each estimator setting, the sequence estimate
(sum over a completion's scored tokens) is computed under --seeds independent mask draws;
reported: the variance over seeds (averaged over completions), forwards per completion,
seconds per estimate, and the mean gap to a K = 64 antithetic ELBO (the quantity the ELBO
estimators target). "Equal cost" rows average one_step over 3 draws (3 forwards), like
coupled's 3 passes.

    OMP_NUM_THREADS=1 python benchmarks/posttrain_estimators.py --model runs/grpo_recipe/base/final
"""

import argparse
import json
import time
from pathlib import Path

import torch

from unmask.posttrain.estimators import estimate
from unmask.posttrain.grpo import group_random, stack_rows
from unmask.sampling.config import SamplingConfig
from unmask.sampling.generate import sample

SETTINGS = [  # (label, estimator, options, draws averaged)
    ("one_step", "one_step", {}, 1),
    ("one_step x3 (equal cost)", "one_step", {}, 3),
    ("coupled", "coupled", {}, 1),
    ("mc K=1", "mc", {"samples": 1, "how": "uniform"}, 1),
    ("mc K=3 uniform", "mc", {"samples": 3, "how": "uniform"}, 1),
    ("mc K=3 antithetic", "mc", {"samples": 3, "how": "antithetic"}, 1),
    ("mc K=3 stratified", "mc", {"samples": 3, "how": "stratified"}, 1),
]


def load(folder: str):
    from unmask.data import build_tokenizer
    from unmask.data.config import DataConfig
    from unmask.models import build_model
    from unmask.models.config import ModelConfig

    model = build_model(ModelConfig(pretrained=folder)).eval()
    tokenizer = build_tokenizer(DataConfig(tokenizer=folder))
    return model, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a trained model folder (final/)")
    parser.add_argument("--config", help="its run's config.yaml (default: next to --model)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/posttrain_estimators.json")
    args = parser.parse_args()
    from unmask.config import load_config
    from unmask.data import heldout_examples

    cfg = load_config(args.config or Path(args.model).parent / "config.yaml")
    model, tok = load(args.model)
    mask_id, eos = tok.mask_token_id, tok.eos_token_id
    prompts = [p for p, _ in heldout_examples(cfg.data)[: args.prompts]]
    sampling = SamplingConfig(temperature=1.0, row_length=cfg.data.packing_length)
    sequences, lengths = [], []
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
            out = sample(model, ids.expand(args.group, -1), sampling, mask_id=mask_id,
                         eos_id=eos, generator=gen)  # fmt: skip
            sequences.append(out.sequences)
            lengths.append(ids.shape[1])
    rows = stack_rows(sequences, lengths, eos)

    def seq_estimates(name, options, draws, seed):
        total = 0.0
        for d in range(draws):
            rand = group_random([seed * 101 + d] * len(prompts), args.group, "cpu", 0)
            passes = estimate(name, model, rows, rand, mask_id, 8192, **options)
            total = total + (passes.token_estimates() * rows.scored).sum(1)
        return total / draws, passes.forwards * draws

    with torch.no_grad():
        reference = torch.stack(
            [
                seq_estimates("mc", {"samples": 64, "how": "antithetic"}, 1, 10_000 + s)[0]
                for s in range(4)
            ]
        ).mean(0)
        table = []
        for label, name, options, draws in SETTINGS:
            started = time.perf_counter()
            values = []
            for seed in range(args.seeds):
                value, forwards = seq_estimates(name, options, draws, seed)
                values.append(value)
            seconds = (time.perf_counter() - started) / args.seeds
            values = torch.stack(values)  # (seeds, R)
            table.append({"estimator": label, "forwards": forwards,
                          "variance": float(values.var(0).mean()),
                          "mean_minus_elbo64": float((values.mean(0) - reference).mean()),
                          "seconds_per_estimate": seconds})  # fmt: skip
            print(json.dumps(table[-1]), flush=True)
    result = {"model": args.model, "completions": rows.ids.shape[0],
              "mean_scored_tokens": float(rows.scored.sum(1).float().mean()),
              "seeds": args.seeds, "elbo64_mean": float(reference.mean()), "table": table}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
