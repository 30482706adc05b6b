"""Pipeline parallelism on CPU gloo processes: each schedule's bubble, and per-rank memory.

One model (8 layers, hidden 256, vocabulary 256) and one global batch (split_batches: 16
rows of 32 tokens) trained by the real trainer (unmask.train.Trainer) under pp=2 with each
schedule, at m = 4p = 8 micro-batches (interleaved 1F1B and zero bubble: 2 stages per rank,
so 4 stages of 2 layers; gpipe and 1F1B: 2 stages of 4 layers).

Bubble: on every rank, the wall time of the schedule's step (torch.distributed.pipelining's
`schedule.step`, the forward and backward of all micro-batches) and the time spent inside
the stage's compute calls (`forward_one_chunk`, `backward_one_chunk`,
`backward_weight_one_chunk`: the module's forward, the loss and autograd, without the
waits for a peer's activations or gradients); idle fraction = 1 - compute / wall, the max
over ranks. The formula it is compared with is the schedule's bubble with equal stages and
free communication: (p - 1) / (m + p - 1) for gpipe and 1F1B, (p - 1) / (v m + p - 1) for
the interleaved ones (v stages per rank; zero bubble's own is lower: its weight passes fill
part of that).

Memory: parameter + optimizer-state bytes held by a rank after one step (AdamW and
MuonAdamW), the max over ranks, pp=2 (1f1b) against one process.

Rounds interleave: every round runs every schedule (in a rotated order) in one launch of 2
processes; the table gives the median over rounds and the spread (min-max).

Run: python benchmarks/pipeline.py            (3 rounds; writes benchmarks/results/pipeline.md)
     python benchmarks/pipeline.py --quick    (1 round, 2 timed steps; prints)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import RESULTS, load_average, machine, publish, rotated, run_workers, with_spread

REPORT = RESULTS / "pipeline.md"
MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 8,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256}  # fmt: skip
ROWS, LENGTH, PP = 16, 32, 2
M = 4 * PP
#: schedule -> stages per rank
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}
OPTIMS = {"adamw": {"name": "adamw"}, "muon": {"name": "muon", "ns_dtype": "float32"}}


def config_tree(out: Path, train: dict, optim: dict) -> dict:
    return {
        "model": MODEL,
        "data": {"dataset": "synthetic", "packing": False, "packing_length": LENGTH,
                 "synthetic_train_size": 512, "synthetic_eval_size": 8},
        "optim": {"learning_rate": 1e-3, **optim},
        "train": {"per_device_train_batch_size": ROWS, "split_batches": True, "max_steps": 100,
                  "eval_steps": 0, "save_steps": 0, "disable_tqdm": True, "log_mfu": False,
                  "overwrite_output_dir": True,
                  "output_dir": str(out), **train},
        "eval": {"generate_accuracy": False},
    }  # fmt: skip


def formula(schedule: str, p: int = PP, m: int = M) -> float:
    """The schedule's idle fraction with equal stages and free communication."""
    v = SCHEDULES[schedule]
    return (p - 1) / (v * m + p - 1)


# ------------------------------------------------------------------ worker (every rank)


def _timed(obj, name: str, box: list, costs: dict | None = None,
           order: list | None = None) -> None:  # fmt: skip
    """Wrap obj.name so that its wall time is added to box[0] and, with `costs`, its
    thread CPU time appended to costs["stage:kind"] (kind: F, B, or I / W for zero
    bubble's split backward) and (stage, kind, micro-batch) to `order`: the order the
    schedule ran its actions in on this rank."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            box[0] += time.perf_counter() - started
            if costs is not None:
                kind = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W"}.get(name)
                if kind is None:
                    kind = "B" if kwargs.get("full_backward", True) else "I"
                key = f"{obj.stage_index}:{kind}"
                costs.setdefault(key, []).append(time.thread_time() - cpu)
                order.append((obj.stage_index, kind, args[0] if args else kwargs.get(
                    "bwd_chunk_id", kwargs.get("fwd_chunk_id"))))  # fmt: skip

    setattr(obj, name, wrapper)


def replay(order: dict, costs: dict[str, float], num_stages: int) -> float:
    """The largest idle fraction over ranks when every rank runs its actions in the
    schedule's order, each taking its measured cost, as soon as what it needs is done (a
    stage's forward: the previous stage's forward of that micro-batch; its backward: its
    forward and the next stage's backward; a weight pass: its input pass). Communication
    counts as free."""
    every = {tuple(action) for actions in order.values() for action in actions}
    done: dict[tuple, float] = {}
    clock = dict.fromkeys(order, 0.0)
    busy = dict.fromkeys(order, 0.0)
    position = dict.fromkeys(order, 0)

    def needs(stage: int, kind: str, mb: int) -> list[tuple]:
        if kind == "F":
            return [(stage - 1, "F", mb)] if stage > 0 else []
        if kind == "W":
            return [(stage, "I", mb)]
        later = [(stage + 1, k, mb) for k in ("B", "I") if (stage + 1, k, mb) in every]
        return [(stage, "F", mb), *later]

    while len(done) < len(every):
        progressed = False
        for rank, actions in order.items():
            if position[rank] == len(actions):
                continue
            action = tuple(actions[position[rank]])
            deps = needs(*action)
            if not all(d in done for d in deps):
                continue
            cost = costs[f"{action[0]}:{action[1]}"]
            done[action] = clock[rank] = max([clock[rank], *(done[d] for d in deps)]) + cost
            busy[rank] += cost
            position[rank] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"the schedule's order cannot be replayed: {order} {sorted(done)}")
    makespan = max(clock.values())
    return max(1.0 - b / makespan for b in busy.values())


def measure_bubble(config_path: str, timed: int) -> dict:
    import statistics

    import torch.distributed as dist

    from unmask.config import load_config
    from unmask.train.trainer import Trainer

    trainer = Trainer(load_config(config_path))
    trainer.model.train()
    runner = trainer.pipeline
    trainer.train_step([next(trainer.loader)])  # builds the stages and the schedule
    busy, costs, order = [0.0], {}, []
    for stage in runner.stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            _timed(stage, name, busy, costs, order)
    wall = [0.0]
    _timed(runner.schedule, "step", wall)
    fractions = []
    for _ in range(timed):
        dist.barrier()
        busy[0] = wall[0] = 0.0
        order.clear()
        trainer.train_step([next(trainer.loader)])
        fractions.append(1.0 - busy[0] / wall[0])
    trainer.loader.close()
    return {"idle": statistics.median(fractions), "wall": wall[0],
            "costs": {k: statistics.median(v) for k, v in costs.items()},
            "order": list(order),
            "stages": runner.plan.num_stages}  # fmt: skip


def state_bytes(config_path: str) -> int:
    import torch
    from torch.distributed.tensor import DTensor

    from unmask.config import load_config
    from unmask.train.trainer import Trainer

    trainer = Trainer(load_config(config_path))
    trainer.train_step([next(trainer.loader)])
    tensors = list(trainer.model.parameters())
    tensors += [v for s in trainer.optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.ndim > 0]  # fmt: skip
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    trainer.loader.close()
    return total


def worker(out: str, timed: int, kind: str, configs: list[str]) -> None:
    import torch.distributed as dist

    results = {}
    for path in configs:
        mine = measure_bubble(path, timed) if kind == "bubble" else state_bytes(path)
        every = [mine]
        if dist.is_initialized():
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        results[Path(path).stem] = every
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(results))


# ------------------------------------------------------------------ driver


def write_configs(root: Path) -> dict[str, Path]:
    paths = {}
    for schedule, per_rank in SCHEDULES.items():
        train = {"pipeline_parallel": PP, "pipeline_schedule": schedule,
                 "pipeline_stages_per_rank": per_rank, "pipeline_microbatches": M}  # fmt: skip
        paths[schedule] = root / f"{schedule}.yaml"
        paths[schedule].write_text(yaml.safe_dump(config_tree(root / schedule, train,
                                                              OPTIMS["adamw"])))  # fmt: skip
    for optim, keys in OPTIMS.items():
        for pp in (1, PP):
            name = f"mem-{optim}-pp{pp}"
            paths[name] = root / f"{name}.yaml"
            train = {"pipeline_parallel": pp} if pp > 1 else {}
            paths[name].write_text(yaml.safe_dump(config_tree(root / name, train, keys)))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 2 timed steps; prints")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timed", type=int, default=5, help="timed steps per schedule")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        out, timed, kind, *configs = args.worker
        worker(out, int(timed), kind, configs)
        return
    rounds, timed = (1, 2) if args.quick else (args.rounds, args.timed)
    env = {"OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = write_configs(root)
        idle: dict[str, list[float]] = {s: [] for s in SCHEDULES}
        walls: dict[str, list[float]] = {s: [] for s in SCHEDULES}
        replayed: dict[str, list[float]] = {s: [] for s in SCHEDULES}
        for index in range(rounds):
            order = rotated(list(SCHEDULES), index)
            out = root / f"bubble-{index}.json"
            run_workers(PP, __file__, "--worker", out, timed, "bubble",
                        *[paths[s] for s in order], timeout=1800, env=env)  # fmt: skip
            for schedule, ranks in json.loads(out.read_text()).items():
                idle[schedule].append(max(r["idle"] for r in ranks))
                walls[schedule].append(max(r["wall"] for r in ranks))
                costs = {k: v for r in ranks for k, v in r["costs"].items()}
                order = {rank: r["order"] for rank, r in enumerate(ranks)}
                replayed[schedule].append(replay(order, costs, ranks[0]["stages"]))
        memory = {}
        for pp in (1, PP):
            names = [f"mem-{optim}-pp{pp}" for optim in OPTIMS]
            out = root / f"mem-{pp}.json"
            run_workers(pp, __file__, "--worker", out, 1, "memory", *[paths[n] for n in names],
                        timeout=1800, env=env)  # fmt: skip
            memory.update({k: max(v) for k, v in json.loads(out.read_text()).items()})
    publish(report(idle, replayed, walls, memory, rounds, timed), None if args.quick else REPORT)


def report(idle, replayed, walls, memory, rounds, timed) -> str:
    lines = [
        "# Pipeline parallelism: bubble per schedule, memory per rank",
        "",
        f"Machine: {machine('torch')}; load average at the end {load_average()} (shared).",
        f"Model: {MODEL}; {ROWS} rows x {LENGTH} tokens per step (split_batches), pp={PP}, "
        f"m={M} micro-batches; {rounds} interleaved rounds x {timed} timed steps (median per "
        "round, then median (min-max) over rounds).",
        "",
        "Idle fraction, the max over ranks: *wall* = 1 - time in the stage's compute calls / "
        "the schedule step's wall time (waits for peers, gloo transfers and other processes "
        "on the shared CPU included); *replayed* = the schedule's own order replayed with "
        "each action's measured CPU time (first/last stage's embedding and head included, "
        "communication free).",
        "",
        "| schedule | stages per rank | idle, wall | idle, replayed | formula | "
        "replayed / formula | schedule step wall (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for schedule, per_rank in SCHEDULES.items():
        ratios = [value / formula(schedule) for value in replayed[schedule]]
        lines.append(
            f"| {schedule} | {per_rank} | {with_spread(idle[schedule], '{:.3f}')} | "
            f"{with_spread(replayed[schedule], '{:.3f}')} | {formula(schedule):.3f} | "
            f"{with_spread(ratios)} | {with_spread(walls[schedule], '{:.3f}')} |"
        )
    lines += ["", "| optimizer | params + optimizer state / rank, pp=1 | pp=2 (max over ranks) "
              "| ratio |", "|---|---|---|---|"]  # fmt: skip
    for optim in OPTIMS:
        one, two = memory[f"mem-{optim}-pp1"], memory[f"mem-{optim}-pp{PP}"]
        lines.append(f"| {optim} | {one / 2**20:.2f} MiB | {two / 2**20:.2f} MiB | "
                     f"{two / one:.3f}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
