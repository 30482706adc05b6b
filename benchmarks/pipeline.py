"""Pipeline parallelism on CPU gloo processes: each schedule's bubble, and per-rank memory.

Two models, one global batch (split_batches: 16 rows of 128 tokens), trained by the real
trainer (unmask.train.Trainer) under pp=2 with each schedule, at m = 4p = 8 micro-batches of
2 rows (interleaved 1F1B and zero bubble: 2 stages per rank, so 4 stages), the layers cut by
the trainer's default split (estimated cost, parallel/pipeline_plan.py `balanced_split`):

- *equal*: 32 layers of hidden 256, a vocabulary of 128. Its LM head costs about 2% of a
  layer, so the default split gives every stage the same layers (16 | 16; 8 | 8 | 8 | 8) and
  the last stage's norm, head and loss add almost nothing to them: the stages the formulas
  assume, so what it measures is the schedule and the pipeline's own overhead. (A
  vocabulary of 512, a tenth of a layer, left the last stage 0.3-0.5% heavier than the
  others, which took interleaved 1F1B to 1.28x of its formula in a 5-round run.)
- *uneven*: 31 layers, a vocabulary of 8192. Its head (half the tokens through 6 x 256 x
  8192) costs about one layer, so the split has something to balance (16 | 15 + head;
  8 | 8 | 8 | 7 + head), and whole layers (about 3% of the model each) leave the stages a
  little unequal: what the default split gives a model that does not divide evenly.

Bubble: on every rank, the wall time of the schedule's step (torch.distributed.pipelining's
`schedule.step`, the forward and backward of all micro-batches) and the time spent inside
the stage's compute calls (`forward_one_chunk`, `backward_one_chunk`,
`backward_weight_one_chunk`: the module's forward, the loss and autograd, without the
waits for a peer's activations or gradients); *wall* idle fraction = 1 - compute / wall, the
max over ranks. *Replayed*: the order the schedule ran its actions in (the last timed step's)
replayed with each action kind's median CPU time per stage and free communication
(parallel/pipeline_plan.py `schedule_idle`), the max over ranks. The formula it is compared with
is the schedule's idle share with equal stages and free communication
(parallel/pipeline_plan.py `bubble_formula`): (p - 1) / (v m + p - 1) for gpipe, 1F1B and
interleaved 1F1B (v stages per rank), (p - 1) / (3 v m + p - 1) for zero bubble (forward,
input pass and weight pass equal); *equal stages* replays the same recorded order with
forward 1, input and weight passes 1 each (backward 2) on every stage, which must give the
formula; *leveled* replays it with each stage's measured total scaled to the stages' mean,
its forward / backward (input / weight) proportions kept: the part of the excess over the
formula that unequal stages do not explain. Zero bubble's idle also depends on what its
passes cost ((p - 1)(F + I - W) / (v m (F + I + W) + (p - 1)(F + I - W)), `bubble_formula`
with `passes`): *formula at the measured passes* is that with the run's forward, input and
weight pass (mean over stages), beside the equal-pass formula.

Memory: parameter + optimizer-state bytes held by a rank after one step (AdamW and
MuonAdamW), the max over ranks, pp=2 (1f1b) against one process.

Rounds interleave: every round runs every schedule (in a rotated order) in one launch of 2
processes; the tables give the median over rounds and the spread (min-max).

Run: python benchmarks/pipeline.py            (3 rounds; writes benchmarks/results/pipeline.md;
                                              the committed one: --rounds 5, about 20 minutes)
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
_BASE = {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
         "num_key_value_heads": 4, "tie_word_embeddings": False}  # fmt: skip
#: name -> model (the module docstring says why each)
MODELS = {"equal": {**_BASE, "num_hidden_layers": 32, "vocab_size": 128},
          "uneven": {**_BASE, "num_hidden_layers": 31, "vocab_size": 8192}}  # fmt: skip
#: the model whose parameters + optimizer state are measured
MEMORY_MODEL = "uneven"
ROWS, LENGTH, PP = 16, 128, 2
M = 4 * PP
#: schedule -> stages per rank
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2}
OPTIMS = {"adamw": {"name": "adamw"}, "muon": {"name": "muon", "ns_dtype": "float32"}}
#: the issue's bar: replayed idle within this factor of the formula
TARGET = 1.25


def config_tree(out: Path, model: dict, train: dict, optim: dict) -> dict:
    return {
        "model": model,
        "data": {"dataset": "synthetic", "packing": False, "packing_length": LENGTH,
                 "synthetic_train_size": 512, "synthetic_eval_size": 8},
        "optim": {"learning_rate": 1e-3, **optim},
        "train": {"per_device_train_batch_size": ROWS, "split_batches": True, "max_steps": 100,
                  "eval_steps": 0, "save_steps": 0, "disable_tqdm": True, "log_mfu": False,
                  "overwrite_output_dir": True,
                  "output_dir": str(out), **train},
        "eval": {"generate_accuracy": False},
    }  # fmt: skip


def formula(schedule: str, passes: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> float:
    """The schedule's idle fraction with equal stages and free communication; zero
    bubble's at the given (forward, input pass, weight pass) costs."""
    from unmask.parallel.pipeline_plan import bubble_formula

    return bubble_formula(schedule, PP, M, SCHEDULES[schedule], passes)


def mean_passes(costs: dict[str, float], num_stages: int) -> tuple[float, float, float]:
    """(forward, input pass, weight pass) of a micro-batch, the mean over stages (zero
    bubble's measured costs; (1, 1, 1) for the schedules without a split backward)."""
    if "0:I" not in costs:
        return (1.0, 1.0, 1.0)
    return tuple(sum(costs[f"{s}:{k}"] for s in range(num_stages)) / num_stages
                 for k in "FIW")  # fmt: skip


def replayed(order: dict, costs: dict[str, float]) -> float:
    """`schedule_idle` of the recorded order ({rank: [[stage, kind, mb], ...]}) with the
    measured costs ({"stage:kind": seconds})."""
    from unmask.parallel.pipeline_plan import schedule_idle

    actions = {rank: [tuple(a) for a in acts] for rank, acts in order.items()}
    by_kind = {(int(k.split(":")[0]), k.split(":")[1]): v for k, v in costs.items()}
    return schedule_idle(actions, by_kind)


def equal_stages(order: dict, num_stages: int) -> float:
    """`schedule_idle` of the recorded order with every stage's forward 1, input and
    weight pass 1 each (full backward 2)."""
    unit = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    return replayed(order, {f"{s}:{k}": c for s in range(num_stages) for k, c in unit.items()})


def leveled(costs: dict[str, float], num_stages: int) -> dict[str, float]:
    """The costs with every stage's total (all its actions) scaled to the stages' mean, each
    stage's kinds in their measured proportions: what is left of the bubble once the stages
    are equal, from the forward / backward (input / weight) shape alone."""
    per = [sum(v for k, v in costs.items() if int(k.split(":")[0]) == s)
           for s in range(num_stages)]  # fmt: skip
    mean = sum(per) / num_stages
    return {k: v * mean / per[int(k.split(":")[0])] for k, v in costs.items()}


def stage_shares(costs: dict[str, float], num_stages: int) -> list[float]:
    """Each stage's share of the measured CPU time of one micro-batch (all its actions)."""
    per = [sum(v for k, v in costs.items() if int(k.split(":")[0]) == s)
           for s in range(num_stages)]  # fmt: skip
    return [c / sum(per) for c in per]


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
            "order": list(order), "stages": runner.plan.num_stages,
            "layers": [len(held) for held in runner.plan.layers],
            "shares": list(runner.plan.shares)}  # fmt: skip


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
    """Every run's config: "<model>-<schedule>" (bubble) and "mem-<optim>-pp<N>"."""
    paths = {}
    for model, fields in MODELS.items():
        for schedule, per_rank in SCHEDULES.items():
            train = {"pipeline_parallel": PP, "pipeline_schedule": schedule,
                     "pipeline_stages_per_rank": per_rank, "pipeline_microbatches": M}  # fmt: skip
            name = f"{model}-{schedule}"
            paths[name] = root / f"{name}.yaml"
            paths[name].write_text(yaml.safe_dump(config_tree(root / name, fields, train,
                                                              OPTIMS["adamw"])))  # fmt: skip
    for optim, keys in OPTIMS.items():
        for pp in (1, PP):
            name = f"mem-{optim}-pp{pp}"
            paths[name] = root / f"{name}.yaml"
            train = {"pipeline_parallel": pp} if pp > 1 else {}
            tree = config_tree(root / name, MODELS[MEMORY_MODEL], train, keys)
            paths[name].write_text(yaml.safe_dump(tree))
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
        keys = ("idle", "wall", "replayed", "equal", "leveled", "shares", "costs", "at_passes")
        runs = [f"{model}-{schedule}" for model in MODELS for schedule in SCHEDULES]
        found: dict[str, dict[str, list]] = {r: {k: [] for k in keys} for r in runs}
        plans: dict[str, dict] = {}
        for index in range(rounds):
            order = rotated(runs, index)
            out = root / f"bubble-{index}.json"
            run_workers(PP, __file__, "--worker", out, timed, "bubble",
                        *[paths[r] for r in order], timeout=3600, env=env)  # fmt: skip
            for run, ranks in json.loads(out.read_text()).items():
                got, stages = found[run], ranks[0]["stages"]
                got["idle"].append(max(r["idle"] for r in ranks))
                got["wall"].append(max(r["wall"] for r in ranks))
                costs = {k: v for r in ranks for k, v in r["costs"].items()}
                order = {rank: r["order"] for rank, r in enumerate(ranks)}
                got["replayed"].append(replayed(order, costs))
                got["equal"].append(equal_stages(order, stages))
                got["leveled"].append(replayed(order, leveled(costs, stages)))
                got["shares"].append(stage_shares(costs, stages))
                got["costs"].append(costs)
                got["at_passes"].append(formula(run.split("-", 1)[1], mean_passes(costs, stages)))
                plans[run] = {"layers": ranks[0]["layers"], "shares": ranks[0]["shares"]}
        memory = {}
        for pp in (1, PP):
            names = [f"mem-{optim}-pp{pp}" for optim in OPTIMS]
            out = root / f"mem-{pp}.json"
            run_workers(pp, __file__, "--worker", out, 1, "memory", *[paths[n] for n in names],
                        timeout=1800, env=env)  # fmt: skip
            memory.update({k: max(v) for k, v in json.loads(out.read_text()).items()})
    publish(report(found, plans, memory, rounds, timed), None if args.quick else REPORT)


def report(found, plans, memory, rounds, timed) -> str:
    import statistics

    models = "; ".join(
        f"*{name}*: {f['num_hidden_layers']} layers, vocabulary {f['vocab_size']}"
        for name, f in MODELS.items()
    )
    lines = [
        "# Pipeline parallelism: bubble per schedule, memory per rank",
        "",
        f"Machine: {machine('torch')}; load average at the end {load_average()} (shared).",
        f"Models: {models} (both {_BASE}); {ROWS} rows x {LENGTH} tokens per step "
        f"(split_batches), pp={PP}, m={M} micro-batches; {rounds} interleaved rounds x "
        f"{timed} timed steps (median per round, then median (min-max) over rounds).",
        "",
        "Idle fraction, the max over ranks: *wall* = 1 - time in the stage's compute calls / "
        "the schedule step's wall time (waits for peers, gloo transfers and other processes "
        "on the shared CPU included); *replayed* = the schedule's own order replayed with "
        "each action's measured CPU time (first/last stage's embedding and head included, "
        "communication free); *equal stages* = the same order replayed with forward 1 and "
        "backward 2 (input + weight pass 1 + 1) on every stage: the formula, checked against "
        "the order the schedule ran (one value: the order is the same every round); "
        "*leveled* = replayed with each stage's measured total scaled to the stages' mean (its "
        "forward / backward proportions kept): what the forward / backward shape alone leaves.",
        "",
        "*Formula at the measured passes*: zero bubble's idle depends on what its passes "
        "cost (parallel/pipeline_plan.py `bubble_formula`: (p-1)(F+I-W) / (vm(F+I+W) + "
        "(p-1)(F+I-W)), ZB-H1's (p-1)(T_F+T_B-T_W)); *formula* takes them equal, as the "
        "zero-bubble paper's T_F = T_B = T_W; this one takes the run's forward, input and "
        "weight pass (each the mean over stages of its median CPU time): what the same "
        "schedule idles with equal stages at this machine's pass costs. The other "
        "schedules' formulas do not depend on what their passes cost.",
        "",
        "| model | schedule | stages per rank | idle, wall | wall / formula | idle, replayed | "
        f"formula | equal stages | replayed / formula | within {TARGET}x (replayed) | "
        "leveled / formula | formula at the measured passes | replayed / it | "
        f"within {TARGET}x of it | schedule step wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        for schedule, per_rank in SCHEDULES.items():
            got, bound = found[f"{model}-{schedule}"], formula(schedule)
            ratios = [value / bound for value in got["replayed"]]
            verdict = "yes" if statistics.median(ratios) <= TARGET else "**no**"
            equal = (f"{got['equal'][0]:.4f}" if len(set(got["equal"])) == 1
                     else with_spread(got["equal"], "{:.4f}"))  # fmt: skip
            at_passes = [r / f for r, f in zip(got["replayed"], got["at_passes"])]
            verdict_passes = "yes" if statistics.median(at_passes) <= TARGET else "**no**"
            lines.append(
                f"| {model} | {schedule} | {per_rank} | {with_spread(got['idle'], '{:.3f}')} | "
                f"{with_spread([v / bound for v in got['idle']])} | "
                f"{with_spread(got['replayed'], '{:.3f}')} | {bound:.4f} | {equal} | "
                f"{with_spread(ratios)} | {verdict} | "
                f"{with_spread([v / bound for v in got['leveled']])} | "
                f"{with_spread(got['at_passes'], '{:.4f}')} | {with_spread(at_passes)} | "
                f"{verdict_passes} | {with_spread(got['wall'], '{:.3f}')} |"
            )
    lines += [
        "",
        "Each stage's layers (the default split) and its share of the cost: *estimated* (the "
        "split's FLOPs per token) and *measured* (the stage's median CPU time of a "
        "micro-batch's forward and backward, median over rounds); and each stage's median "
        "CPU milliseconds per micro-batch, forward / backward (zero bubble: forward / input "
        "pass / weight pass), median over rounds.",
        "",
        "| model | schedule | layers per stage | estimated share | measured share | ms per stage |",
        "|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        for schedule in SCHEDULES:
            plan, got = plans[f"{model}-{schedule}"], found[f"{model}-{schedule}"]
            stages = range(len(plan["layers"]))
            measured = [statistics.median(r[s] for r in got["shares"]) for s in stages]
            kinds = "FIW" if schedule == "zero_bubble" else "FB"
            ms = "; ".join(
                " / ".join(f"{1e3 * statistics.median(c[f'{s}:{k}'] for c in got['costs']):.1f}"
                           for k in kinds)
                for s in stages
            )  # fmt: skip
            pct = lambda xs: " / ".join(f"{100 * x:.1f}%" for x in xs)  # noqa: E731
            lines.append(f"| {model} | {schedule} | {' / '.join(map(str, plan['layers']))} | "
                         f"{pct(plan['shares'])} | {pct(measured)} | {ms} |")  # fmt: skip
    lines += ["", f"Parameters + optimizer state per rank, the *{MEMORY_MODEL}* model:", "",
              "| optimizer | params + optimizer state / rank, pp=1 | pp=2 (max over ranks) "
              "| ratio |", "|---|---|---|---|"]  # fmt: skip
    for optim in OPTIMS:
        one, two = memory[f"mem-{optim}-pp1"], memory[f"mem-{optim}-pp{PP}"]
        lines.append(f"| {optim} | {one / 2**20:.2f} MiB | {two / 2**20:.2f} MiB | "
                     f"{two / one:.3f}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
