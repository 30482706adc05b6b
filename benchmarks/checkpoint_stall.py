"""Checkpoint stall on CPU: how long a save blocks the training loop, synchronous vs
train.async_checkpoint.

A qwen3_dllm of about 100M parameters (fp32) with AdamW state (exp_avg, exp_avg_sq: the
checkpoint holds ~3x the parameter bytes) is saved with unmask's Checkpointer, as the
trainer does at a save step:
  - sync:  Checkpointer.save of a one-process run (model.safetensors + optimizer.pt +
           scheduler, rng, trainer state; fsync, manifest, rename): the loop waits for all of it;
  - async: Checkpointer(async_save=True).save (DCP async_save): the loop waits while the state
           is copied to CPU memory and the small files are written; the files are written by a
           background thread and published when done.
Reported per variant: the stall (save() call to return), for async also the time until the
checkpoint is published (wait()), and how much a fixed matmul workload run right after
save() returns is slowed while the background write shares the CPU with it (on a 2-core
machine the writer competes with the training step for cores and memory bandwidth).

Variants run in interleaved rounds (order alternated); medians with min-max spread.

Run: python benchmarks/checkpoint_stall.py           (writes benchmarks/results/checkpoint_stall.md;
                                                      under 90 s here, ~2.5 GB temporary files)
     python benchmarks/checkpoint_stall.py --quick   (tiny model, one round, prints the report,
                                                      writes no results file)
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import RESULTS, machine, publish, rotated, with_spread

from unmask.checkpoint import Checkpointer
from unmask.models import ModelConfig, build_model

REPORT = RESULTS / "checkpoint_stall.md"
FULL = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8,
        "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000}  # fmt: skip
QUICK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}  # fmt: skip


def build(dims: dict):
    torch.manual_seed(0)
    model = build_model(ModelConfig(**dims))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.full_like(param, 1e-3)
    optimizer.step()  # AdamW state, as in a run
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def workload(size: int, repeats: int) -> float:
    """Seconds for a fixed matmul loop: a stand-in for training steps."""
    a = torch.randn(size, size)
    started = time.perf_counter()
    for _ in range(repeats):
        a = torch.tanh(a @ a * (1.0 / size))
    return time.perf_counter() - started


def measure(kind: str, root: Path, step: int, parts, work: tuple[int, int]) -> dict:
    model, optimizer, scheduler = parts
    out = root / kind
    checkpointer = Checkpointer(out, async_save=kind == "async", save_total_limit=1)
    state = {"loader": {}, "tokens_seen": 0}
    rng = {"torch": torch.get_rng_state()}
    started = time.perf_counter()
    checkpointer.save(step, model, optimizer, scheduler, state, rng)
    stall = time.perf_counter() - started
    during = workload(*work)  # the loop goes on while (async) the files are written
    checkpointer.wait()
    return {"stall": stall, "work": during}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, one round, no file")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dims = QUICK if args.quick else FULL
    rounds = 1 if args.quick else args.rounds
    work = (256, 20) if args.quick else (1024, 24)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    parts = build(dims)
    params = sum(p.numel() for p in parts[0].parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in parts[0].state_dict().values())
    state_bytes += sum(v.numel() * v.element_size() for s in parts[1].state.values()
                       for v in s.values() if isinstance(v, torch.Tensor))  # fmt: skip
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    alone = []
    root = Path(tempfile.mkdtemp(prefix="unmask-ckpt-stall-"))
    try:
        workload(*work)  # warm-up
        for index in range(rounds):
            for kind in rotated(
                ["sync", "async"], index
            ):  # the workload alone just before each save: its reference
                alone.append(workload(*work))
                row = measure(kind, root, index + 1, parts, work)
                results[kind].append({**row, "alone": alone[-1]})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sync_stall = [r["stall"] for r in results["sync"]]
    async_stall = [r["stall"] for r in results["async"]]
    ratios = [s / a for s, a in zip(sync_stall, async_stall)]
    lines = [
        "# Checkpoint stall: synchronous vs train.async_checkpoint (CPU)",
        "",
        f"Model: qwen3_dllm {params / 1e6:.1f}M parameters fp32 ({dims}), AdamW state; "
        f"checkpoint state {state_bytes / 2**30:.2f} GiB. Machine: {machine('torch')}, "
        f"{torch.get_num_threads()} threads. "
        f"Medians of {rounds} interleaved rounds (min-max). Command: "
        "`python benchmarks/checkpoint_stall.py`.",
        "",
        "| variant | loop stalled by save() (s) | workload right after save (s) | "
        "stall + workload slowdown (s) |",
        "|---|---|---|---|",
        f"| (workload alone) | | {with_spread(alone)} | |",
    ]
    for kind in ("sync", "async"):
        rows = results[kind]
        lines.append(
            f"| {kind} | {with_spread([r['stall'] for r in rows])} | "
            f"{with_spread([r['work'] for r in rows])} | "
            f"{with_spread([r['stall'] + r['work'] - r['alone'] for r in rows])} |"
        )
    lines += [
        "",
        f"Stall sync / async: {with_spread(ratios, '{:.1f}')}x (per round). The async stall is the "
        "copy of the state to CPU memory (DCP's staging, so the next in-place optimizer step "
        "cannot change what is written) plus the small files; the files are then written in a "
        "background thread, which on this 2-core machine slows the work running beside it: "
        "the last column is the loop's whole cost over the workload's window (the write may "
        "go on after it; the slowdown is against the workload run alone just before that "
        "save). The copy costs host memory of the checkpoint's size while it is "
        "written.",
        "",
    ]
    publish("\n".join(lines), None if args.quick else REPORT)


if __name__ == "__main__":
    main()
