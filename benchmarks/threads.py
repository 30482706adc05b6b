"""Torch threads for a tiny model on a small CPU: training steps/s and `unmask generate`'s
sampling time of the quickstart model with 1 and 2 torch threads, on the machine as found and
with one core kept busy by another process.

Why: on a 2-core machine shared with other work, a tiny model's kernels are too small to
split over threads, and a thread that waits for a descheduled peer stalls the whole op
(OpenMP's barrier). The README's "Threads" section and `train.num_threads: auto` rest on
these numbers.

Every measurement runs in its own process started with OMP_NUM_THREADS=k (torch's thread
pool is sized at start-up, as a user's run is):
  - train: the quickstart config (as shipped) built by `Trainer`, `warmup` untimed
    `train_step`s, then `steps` timed ones (fewer, at least 2, past 20 s); steps/s.
  - sizes (as found only): the same training step with wider models (hidden 256 and 512, 4
    layers, MLP 3x hidden), to see where a second thread starts to pay.
  - generate: the quickstart model (a 1-step run's final/, same size and sampling options as
    a trained one: the canvas that fills a 20-token row, one token per step) loaded with
    `load_for_sampling`, one
    prompt sampled `repeats` times after one warm-up; median seconds of `generate_texts`
    (what `unmask generate` reports).
"busy": a second process spinning in a Python loop (one core) for the whole measurement;
"as found": nothing added (other jobs on a shared machine still run: the load average is
reported).
Conditions and thread counts are interleaved over rounds; medians and min-max over rounds.

Run: python benchmarks/threads.py          (writes benchmarks/results/threads.md; 11 min
                                            idle, 20-40 min on a loaded machine)
     python benchmarks/threads.py --quick  (1 round, few steps; prints, writes no file)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, RESULTS, machine, median_seconds, publish, rotated, with_spread

REPORT = RESULTS / "threads.md"
SIZES = (128, 256, 512)  # hidden sizes of the sweep (128: the quickstart's)
LABELS = {"idle": "as found", "busy": "as found + one core kept busy"}


def worker_train(steps: int, warmup: int, out_dir: str, overrides: list[str],
                 budget_s: float = 20.0) -> dict:  # fmt: skip
    import torch

    from unmask.config import load_config
    from unmask.train.trainer import Trainer

    cfg = load_config(None, [f"train.output_dir={out_dir}", "train.overwrite_output_dir=true",
                             "train.log_mfu=false", *overrides])  # fmt: skip
    trainer = Trainer(cfg)
    params = sum(p.numel() for p in trainer.model.parameters())
    for _ in range(warmup):
        trainer.train_step([next(trainer.loader)])
    start, done = time.perf_counter(), 0
    while done < steps and (done < 2 or time.perf_counter() - start < budget_s):
        trainer.train_step([next(trainer.loader)])
        done += 1  # a very slow setting stops after `budget_s` (at least 2 steps)
    seconds = time.perf_counter() - start
    return {"threads": torch.get_num_threads(), "steps_per_second": done / seconds,
            "params": params}  # fmt: skip


def worker_generate(folder: str, repeats: int) -> dict:
    import torch

    from unmask.checkpoint import load_for_sampling
    from unmask.sampling.config import resolve_sampling
    from unmask.sampling.texts import generate_texts

    sm = load_for_sampling(folder, None, "cpu", None)
    config = resolve_sampling(sm.saved, {})
    seconds = median_seconds(lambda: generate_texts(sm, ["rev 90417="], config), repeats)
    return {"threads": torch.get_num_threads(), "seconds": seconds}


def run_worker(args: list[str], threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, __file__, "--worker", *args], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def make_model_folder(root: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    out = root / "model"
    subprocess.run([sys.executable, "-m", "unmask", "train", f"train.output_dir={out}",
                    "train.max_steps=1", "train.eval_steps=0", "train.save_steps=0",
                    "train.disable_tqdm=true"], env=env, check=True,
                   capture_output=True)  # fmt: skip
    return str(out / "final")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "train":
            result = worker_train(int(rest[0]), int(rest[1]), rest[2], rest[3:])
        else:
            result = worker_generate(rest[0], int(rest[1]))
        print(json.dumps(result))
        return
    rounds = 1 if args.quick else args.rounds
    steps, warmup, repeats = (3, 1, 2) if args.quick else (40, 5, 5)
    results: dict[tuple[str, str, int], list[float]] = {}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model_folder(Path(tmp))
        for r in range(rounds):
            for condition in rotated(["idle", "busy"], r):
                spinner = None
                if condition == "busy":
                    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                try:
                    for threads in rotated([1, 2], r):
                        loads.append(os.getloadavg()[0])
                        train = run_worker(["train", str(steps), str(warmup),
                                            str(Path(tmp) / "run")], threads)  # fmt: skip
                        gen = run_worker(["generate", folder, str(repeats)], threads)
                        assert train["threads"] == gen["threads"] == threads
                        results.setdefault(("train", condition, threads), []).append(
                            train["steps_per_second"]
                        )
                        results.setdefault(("generate", condition, threads), []).append(
                            gen["seconds"]
                        )
                        print(f"round {r} {condition} {threads} thread(s): "
                              f"{train['steps_per_second']:.2f} steps/s, generate "
                              f"{gen['seconds']:.3f} s", flush=True)  # fmt: skip
                finally:
                    if spinner is not None:
                        spinner.kill()
                        spinner.wait()
        sizes: dict[tuple[int, int], list[float]] = {}
        params: dict[int, int] = {}
        for r in range(rounds):
            for hidden in SIZES:
                for threads in rotated([1, 2], r):
                    dims = [f"model.hidden_size={hidden}", f"model.intermediate_size={3 * hidden}"]
                    train = run_worker(["train", str(steps // 2), "2", str(Path(tmp) / "run"),
                                        *dims], threads)  # fmt: skip
                    params[hidden] = train["params"]
                    sizes.setdefault((hidden, threads), []).append(train["steps_per_second"])
                    print(f"round {r} as found, hidden {hidden}, {threads} thread(s): "
                          f"{train['steps_per_second']:.2f} steps/s", flush=True)  # fmt: skip
    lines = [
        "# Torch threads for the quickstart model on this CPU",
        "",
        f"`python benchmarks/threads.py` on {machine()}, {rounds} round(s); load average "
        f"(1 min) before each measurement {min(loads):.1f}-{max(loads):.1f} (other jobs share the machine). "
        "Medians over rounds, min-max in brackets.",
        "",
        "| machine | threads | train steps/s | generate seconds (one prompt) |",
        "|---|---|---|---|",
    ]
    for condition in ("idle", "busy"):
        for threads in (1, 2):
            lines.append(
                f"| {LABELS[condition]} | {threads} | "
                f"{with_spread(results[('train', condition, threads)], '{:.2f}')} | "
                f"{with_spread(results[('generate', condition, threads)], '{:.3f}')} |"
            )
    lines += [
        "",
        "Wider models, same steps (batch 64 x 20 tokens), machine as found:",
        "",
        "| hidden | parameters | 1 thread, steps/s | 2 threads, steps/s | 2 threads / 1 |",
        "|---|---|---|---|---|",
    ]
    for hidden in SIZES:
        one, two = sizes[(hidden, 1)], sizes[(hidden, 2)]
        ratio = statistics.median(b / a for a, b in zip(one, two))
        lines.append(f"| {hidden} | {params[hidden] / 1e6:.2f}M | {with_spread(one, '{:.2f}')} | "
                     f"{with_spread(two, '{:.2f}')} | {ratio:.2f}x |")  # fmt: skip
    publish("\n".join(lines) + "\n", None if args.quick else REPORT)


if __name__ == "__main__":
    main()
