"""`unmask plan CONFIG [overrides] --world N [--nodes K] [--device h100]`: a run's layout
priced per rank before it is launched (docs/scaling.md)."""

import argparse
import json
import sys

from unmask.cli.flags import REFERENCE
from unmask.cli.train import split_train_args


class _PlanParser(argparse.ArgumentParser):
    """`unmask plan`'s parser: section.key=value overrides after the flags too (`unmask plan
    CONFIG --world 8 parallel.expert_parallel=8`), which argparse would leave unrecognized
    (its positionals are one run of words)."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        overrides = [word for word in extra if not word.startswith("-") and "=" in word]
        ns.args = [*ns.args, *overrides]
        return ns, [word for word in extra if word not in overrides]


def add_plan(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan",
        help="memory, step time and traffic per rank of a run at cluster size, before launching",
        description="unmask plan CONFIG.yaml [section.key=value ...] --world N [--nodes K] "
        "[--device h100|a100|h200|b200|cpu]",
        epilog=REFERENCE,
    )
    plan.__class__ = _PlanParser  # overrides after the flags too
    plan.add_argument("args", nargs="*", help="a config file and/or section.key=value overrides")
    plan.add_argument("--config", help="config file (same as the positional form)")
    plan.add_argument("--world", type=int, required=True, help="number of ranks (GPUs)")
    plan.add_argument("--nodes", type=int, default=1, help="nodes the ranks are spread over")
    plan.add_argument("--device", default="h100", help="device to price the run on (default h100)")
    plan.add_argument("--mfu", type=float, default=None,
                      help="model FLOPs utilization the step time assumes (default 0.40)")  # fmt: skip
    plan.add_argument("--tokens", type=float, default=None,
                      help="token budget of the run (default: train.max_steps steps)")  # fmt: skip
    plan.add_argument("--ranks", type=int, nargs="+", default=None,
                      help="ranks to plan (default: the first and the last)")  # fmt: skip
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=cmd_plan)


def cmd_plan(ns: argparse.Namespace) -> int:
    from unmask.config import load_config
    from unmask.errors import InputError
    from unmask.plan.checkpointing import resolve_checkpointing
    from unmask.plan.devices import resolve_device
    from unmask.plan.planner import DEFAULT_MFU, make_run_plan
    from unmask.plan.report import refusal, render
    from unmask.plan.vision import plan_tower, tower_lines

    path, overrides = split_train_args(ns.args, ns.config)
    if path is None:
        raise InputError("unmask plan needs a config file: unmask plan CONFIG.yaml --world N")
    cfg = load_config(path, overrides)

    def cpu_peak(bf16: bool) -> float:
        import torch

        from unmask.train.mfu import device_peak

        return device_peak(torch.device("cpu"), "bfloat16" if bf16 else "float32").flops

    device = resolve_device(ns.device, cpu_peak)
    cfg, line = resolve_checkpointing(cfg, ns.world, device)  # train.activation_checkpointing auto
    if line:
        print(f"unmask: {line}", file=sys.stderr)
    plan = make_run_plan(cfg, ns.world, device, nodes=ns.nodes,
                         mfu=DEFAULT_MFU if ns.mfu is None else ns.mfu, tokens=ns.tokens,
                         ranks=ns.ranks)  # fmt: skip
    if not plan.fits:
        raise InputError(refusal(plan, cfg))
    tower = plan_tower(cfg, ns.world)  # DiffusionGemma's vision tower, trained or frozen
    peak = max(rank.memory.peak for rank in plan.ranks)
    if tower is not None and peak + tower.total > plan.memory_limit:
        raise InputError(f"with its vision tower ({tower.parameters / 1e9:.3f} B parameters, "
                         f"freeze_vision {cfg.model.freeze_vision!r}) a rank needs "
                         f"{(peak + tower.total) / 1e9:.1f} GB of "
                         f"{plan.memory_limit / 1e9:.1f}: freeze it (model.freeze_vision: "
                         "true), or fewer rows per rank")  # fmt: skip
    if ns.json:
        out = plan.to_json()
        if tower is not None:
            out["vision_tower"] = tower.to_json()
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        print(render(plan, path))
        if tower is not None:
            print("\n".join(["", *tower_lines(tower, peak, plan.memory_limit, plan.compute_s,
                                               plan.flops_per_step / plan.world_size)]))  # fmt: skip
    return 0
