"""A2D on the quickstart tasks, the issue's protocol: one AR baseline
(recipes/ar_quickstart.yaml), the DLM from scratch (the built-in quickstart) at 3 seeds, and
each adaptation of the AR model (recipes/adapt_instant.yaml, adapt_anneal.yaml,
adapt_blocks.yaml) at 3 seeds for half the from-scratch steps; held-out exact match of
every saved checkpoint (the run's own `eval:` sampler and what its objective fixes), written
to benchmarks/results/adaptation.json and drawn by benchmarks/adaptation_results.py.

    python benchmarks/adaptation.py --out runs/adaptation      # all of it (about an hour
                                                               # of 2-core CPU)

Runs go two at a time with one torch thread each; a run whose final/ exists is not run
again (so an interrupted sweep continues where it stopped); each run's checkpoints are
scored once (scores.json in the run). `--eval RUN` scores one run directory."""

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import run_one_thread

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "adaptation.json"
SEEDS = (42, 43, 44)
MODES = {"instant": "adapt_instant.yaml", "anneal": "adapt_anneal.yaml",
         "blocks": "adapt_blocks.yaml"}  # fmt: skip
EVERY = 100  # steps between scored checkpoints


def unmask(args: list[str], log: Path) -> None:
    code = run_one_thread(["-m", "unmask", *args], log)
    if code:
        raise SystemExit(f"{' '.join(args[:2])} failed ({code}); see {log}")


def train(out: Path, name: str, config: list[str], overrides: list[str]) -> Path:
    run = out / name
    if not (run / "final").exists():
        unmask(["train", *config, f"train.output_dir={run}", f"train.save_steps={EVERY}",
                "train.save_total_limit=null", "eval.generate_accuracy=false",
                "train.overwrite_output_dir=true", *overrides],
               out / f"{name}.log")  # fmt: skip
    return run


def score(run: Path) -> dict[int, float]:
    """Held-out exact match of each checkpoint-N of `run` (cached in run/scores.json)."""
    cache = run / "scores.json"
    if cache.exists():
        return {int(k): v for k, v in json.loads(cache.read_text()).items()}
    import torch

    from unmask.checkpoint.open import load_for_sampling
    from unmask.config.run import load_config
    from unmask.sampling.accuracy import heldout_accuracy
    from unmask.sampling.config import fixed_by_training
    from unmask.train.setup import objective_heldout

    torch.set_num_threads(1)
    cfg = load_config(run / "config.yaml")
    scores = {}
    for folder in sorted(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
        loaded = load_for_sampling(folder, device="cpu")
        examples = objective_heldout(cfg, loaded.tokenizer)
        accuracy, _ = heldout_accuracy(loaded.model, loaded.tokenizer, examples, cfg.eval,
                                       cfg.data.packing_length, loaded.device,
                                       fixed_by_training(cfg.diffusion))  # fmt: skip
        scores[int(folder.name.split("-")[1])] = accuracy
        print(f"{run.name} step {folder.name.split('-')[1]}: {accuracy:.1%}", flush=True)
    cache.write_text(json.dumps(scores, indent=1))
    return scores


def score_in_child(run: Path) -> dict[int, float]:
    log = run.parent / f"{run.name}.score.log"
    if run_one_thread([__file__, "--eval", run], log):
        raise SystemExit(f"scoring {run} failed; see {log}")
    return score(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "adaptation")
    parser.add_argument("--eval", type=Path, help="score one run directory and stop")
    parser.add_argument("--steps", type=int, default=1400, help="from-scratch steps")
    ns = parser.parse_args()
    if ns.eval:
        score(ns.eval)
        return
    out = ns.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    recipes = ROOT / "recipes"
    half = ns.steps // 2

    def scratch(seed: int) -> dict:
        run = train(
            out, f"scratch_s{seed}", [], [f"train.seed={seed}", f"train.max_steps={ns.steps}"]
        )
        return score_in_child(run)

    def adapt(mode: str, seed: int) -> dict:
        run = train(out, f"{mode}_s{seed}", [str(recipes / MODES[mode])],
                    [f"train.seed={seed}", f"train.max_steps={half}",
                     f"model.pretrained={out / 'ar' / 'final'}"])  # fmt: skip
        return score_in_child(run)

    with ThreadPoolExecutor(2) as pool:
        ar = pool.submit(train, out, "ar", [str(recipes / "ar_quickstart.yaml")],
                         [f"train.max_steps={ns.steps}"])  # fmt: skip
        scratch_jobs = {seed: pool.submit(scratch, seed) for seed in SEEDS}
        ar_scores = score_in_child(ar.result())
        adapt_jobs = {(m, s): pool.submit(adapt, m, s) for m in MODES for s in SEEDS}
        results = {
            "protocol": {
                "from_scratch_steps": ns.steps,
                "adaptation_steps": half,
                "seeds": list(SEEDS),
                "scored_every": EVERY,
                "held_out_prompts": 300,
                "ar_source": "ar (seed 42)",
            },
            "ar": ar_scores,
            "scratch": {s: j.result() for s, j in scratch_jobs.items()},
            "adapt": {m: {s: adapt_jobs[m, s].result() for s in SEEDS} for m in MODES},
        }
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
