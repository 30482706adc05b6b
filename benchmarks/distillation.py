"""Step distillation of the quickstart DLM, the issue's measurement: the teacher (a
quickstart run's final/, e.g. benchmarks/adaptation.py's scratch_s42) and its student
(recipes/distill_quickstart.yaml started from the teacher) answer the 300 held-out prompts
at several sampler settings; each setting's exact match and tokens per forward (canvas
positions committed over forward calls times rows: 1.0 = one token a step), and d3LLM's AUP
over them, to benchmarks/results/distillation.json and .md (`--name` for another file).

    python benchmarks/distillation.py --teacher runs/adaptation/scratch_s42/final \
        --out runs/distillation [--steps 200] [--seeds 42]
"""

import argparse
import json
from pathlib import Path

from common import run_one_thread

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# (label, what changes in the run's eval sampler; it wins over what the folder records, such
# as a student's threshold 0.9)
SETTINGS = [("one token per step", {"threshold": None}), ("threshold 0.9", {"threshold": 0.9}),
            ("threshold 0.7", {"threshold": 0.7}), ("threshold 0.5", {"threshold": 0.5}),
            ("threshold 0.3", {"threshold": 0.3})]  # fmt: skip


def train(teacher: Path, out: Path, name: str, seed: int, steps: int, extra: list[str]) -> Path:
    """A run of recipes/distill_quickstart.yaml started from the teacher, `extra` overriding."""
    run = out / name
    if (run / "final").exists():
        return run
    args = ["-m", "unmask", "train", str(ROOT / "recipes" / "distill_quickstart.yaml"),
            f"model.pretrained={teacher}", f"distill.teacher={teacher}", f"train.seed={seed}",
            f"train.max_steps={steps}", f"train.save_steps={steps}", f"train.output_dir={run}",
            "eval.generate_accuracy=false", "train.overwrite_output_dir=true", *extra]  # fmt: skip
    code = run_one_thread(args, out / f"{name}.log")
    if code:
        raise SystemExit(f"the run {name} failed ({code}); see {out / f'{name}.log'}")
    return run


def measure(folder: Path, config_from: Path) -> list[dict]:
    """Exact match and tokens per forward of the model in `folder` at each setting, with the
    held-out prompts and eval section of the run config in `config_from`."""
    import torch

    from unmask.checkpoint.open import load_for_sampling
    from unmask.config.run import load_config
    from unmask.sampling.accuracy import heldout_accuracy
    from unmask.sampling.config import fixed_by_training
    from unmask.train.setup import objective_heldout

    cfg = load_config(config_from)
    loaded = load_for_sampling(folder, device="cpu")
    examples = objective_heldout(cfg, loaded.tokenizer)[: cfg.eval.max_examples]
    row_forwards = [0]

    def count(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        row_forwards[0] += int(ids.shape[0])

    hook = loaded.model.register_forward_pre_hook(count, with_kwargs=True)
    committed = sum(cfg.data.packing_length
                    - len(loaded.tokenizer(p, add_special_tokens=False)["input_ids"])
                    for p, _ in examples)  # fmt: skip
    points = []
    for label, change in SETTINGS:
        row_forwards[0] = 0
        settings = cfg.eval.model_copy(update={"sampling": cfg.eval.sampling.updated(**change)})
        with torch.no_grad():
            accuracy, _ = heldout_accuracy(loaded.model, loaded.tokenizer, examples, settings,
                                           cfg.data.packing_length, loaded.device,
                                           {**fixed_by_training(cfg.diffusion), **change})  # fmt: skip
        tpf = committed / max(1, row_forwards[0])
        points.append({"setting": label, "accuracy": 100 * accuracy, "tokens_per_forward": tpf})
        print(f"{folder}: {label}: {accuracy:.1%}, {tpf:.2f} tokens/forward", flush=True)
    hook.remove()
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "distillation")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--name", default="distillation", help="results file name")
    ns = parser.parse_args()
    import torch

    from unmask.config.run import load_config
    from unmask.eval.aup import aup

    torch.set_num_threads(1)
    ns.out.mkdir(parents=True, exist_ok=True)
    teacher = ns.teacher.resolve()
    teacher_run = teacher.parent
    result = {"teacher": str(ns.teacher), "steps": ns.steps,
              "teacher_points": measure(teacher, teacher_run / "config.yaml"), "students": {}}  # fmt: skip
    for seed in ns.seeds:
        run = train(teacher, ns.out.resolve(), f"student_s{seed}", seed, ns.steps, [])
        result["students"][seed] = measure(run / "final", run / "config.yaml")
    # the control: the teacher trained on for as many steps with its own objective on the
    # data (same optimizer and schedule), so the student's gain is not just more training
    own = load_config(teacher_run / "config.yaml").diffusion
    run = train(
        teacher,
        ns.out.resolve(),
        "control",
        ns.seeds[0],
        ns.steps,
        [f"diffusion.objective={own.objective}", f"diffusion.t_sampling={own.t_sampling}"],
    )
    result["control_points"] = measure(run / "final", run / "config.yaml")
    columns = [("teacher", result["teacher_points"])]
    columns += [(f"student (seed {s})", p) for s, p in result["students"].items()]
    columns += [
        (f"control: teacher + {ns.steps} steps of {own.objective}", result["control_points"])
    ]
    best = max(p["accuracy"] for _, points in columns for p in points)
    result["aup_y_max"] = best
    result["aup"] = {name: aup([(p["tokens_per_forward"], p["accuracy"]) for p in points],
                               best=best)
                     for name, points in columns}  # fmt: skip
    (RESULTS / f"{ns.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| setting | " + " | ".join(f"{n} accuracy | tokens/forward" for n, _ in columns)
             + " |", "|---|" + "---|---|" * len(columns)]  # fmt: skip
    for i, (label, _) in enumerate(SETTINGS):
        lines.append(
            f"| {label} |"
            + "".join(
                f" {p[i]['accuracy']:.1f}% | {p[i]['tokens_per_forward']:.2f} |" for _, p in columns
            )
        )
    lines.append(f"| AUP (y_max {best:.1f}) |"
                 + "".join(f" {result['aup'][n]:.1f} | |" for n, _ in columns))  # fmt: skip
    (RESULTS / f"{ns.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
