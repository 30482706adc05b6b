"""A plan as text for people, the refusal line of a layout that does not fit, and the
override that would make it fit."""

from __future__ import annotations

import math
import re

from unmask.models.build import resolve_model
from unmask.plan.planner import RunPlan
from unmask.train.setup import checkpointing_choice

GIB = 1024**3


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    hours = seconds / 3600
    return f"{hours:.1f} h ({hours / 24:.1f} days)" if hours >= 24 else f"{hours:.2f} h"


def fix_for(plan: RunPlan, cfg) -> str:
    """The override that brings the worst rank under the limit, judged from its largest
    term (a suggestion: `unmask plan` again with it says whether it fits)."""
    rank = plan.peak_rank()
    m = rank.memory
    name, _ = m.largest()
    t = cfg.train
    over = m.peak - plan.memory_limit
    if m.experts and name in ("parameters", "gradients", "optimizer state", "working buffers") \
            and m.experts + m.expert_working > over:  # fmt: skip
        return expert_fix(plan, m, over)
    if name == "activations" and not resolve_model(cfg.model).shape.recompute:  # no recomputation
        return ("lower train.per_device_train_batch_size or data.packing_length (the encoder "
                "runs over the whole row; its layers do not recompute yet)")  # fmt: skip
    if name == "activations":
        if checkpointing_choice(t) is False:
            return "set train.activation_checkpointing=full"
        rows = plan.rows_per_rank
        if rows > 1:
            keep = max(1, math.floor(rows * (m.activations - over) / m.activations))
            return (f"set train.per_device_train_batch_size={keep} (and raise "
                    "train.gradient_accumulation_steps to keep the batch)")  # fmt: skip
        return f"set parallel.context_parallel={2 * cfg.parallel.context_parallel} (each rank holds half the row)"
    if name == "working buffers":
        if plan.micro_batches > 1:
            return ("set train.gradient_accumulation_steps=1 and grow the batch with ranks (FSDP2 "
                    "keeps every unit's gradients unsharded while it accumulates)")  # fmt: skip
        if not cfg.parallel.reshard_after_forward:
            return "set parallel.reshard_after_forward=true"
        return "lower train.per_device_train_batch_size or data.packing_length"
    if plan.layout["dp_replicate"] > 1:
        return "set parallel.dp_replicate=1 (shard the state over every rank)"
    state = m.parameters + m.gradients + m.optimizer
    rest = m.peak - state
    factor = 2
    while state / factor + rest > plan.memory_limit and factor < 1024:
        factor *= 2
    return (f"plan --world {plan.world_size * factor} (FSDP2 shards parameters, gradients and "
            f"optimizer state over {factor}x the ranks)")  # fmt: skip


def expert_fix(plan: RunPlan, m, over: float) -> str:
    """More expert parallelism: each doubling halves the expert stacks' state on a rank
    (a suggestion, within what the run accepts: ep divides the experts and the dp x cp
    ranks)."""
    ep, factor = plan.expert_parallel, 2
    while (m.experts + m.expert_working) * (1 - 1 / factor) < over and factor < 1024:
        factor *= 2
    ranks = plan.world_size // plan.layout["tp"] // plan.layout["pp"]
    target = ep * factor
    if plan.num_experts % target == 0 and ranks % target == 0:
        return (f"set parallel.expert_parallel={target} (each rank holds 1/{factor} of the "
                "expert stacks' parameters, gradients and optimizer state)")  # fmt: skip
    return (f"plan --world {plan.world_size * factor} parallel.expert_parallel={target} (each rank "
            f"holds 1/{factor} of the expert stacks' state)")  # fmt: skip


def refusal(plan: RunPlan, cfg) -> str:
    """One line: which rank does not fit, by how much, its largest term and the fix."""
    rank = plan.peak_rank()
    name, value = rank.memory.largest()
    return (f"the layout does not fit: rank {rank.rank} needs {gib(rank.memory.peak)} at its "
            f"peak, above the {gib(plan.memory_limit)} usable on a {plan.device}; its largest "
            f"term is {name} ({gib(value)}): {fix_for(plan, cfg)}")  # fmt: skip


def placement_words(placement: str) -> str:
    """A DTensor placement as its str() prints it, in words: S(0) "split on dim 0",
    _S(0, 8) "split on dim 0 (strided, 8 blocks)", R "whole", P(sum) "partial sums"."""
    m = re.fullmatch(r"_?S\((\d+)(?:, *(\d+))?\)", placement)
    if m:
        strided = f" (strided, {m.group(2)} blocks)" if m.group(2) else ""
        return f"split on dim {m.group(1)}{strided}"
    if placement == "R":
        return "whole"
    if placement.startswith("P"):
        return "partial sums"
    return placement


def canvas_line(plan: RunPlan) -> list[str]:
    """What a canvas decoder's step runs ([] for every other family)."""
    if not plan.canvas:
        return []
    row = plan.tokens_per_step // max(1, plan.rows_per_step)
    twice = " twice (self-conditioning's first pass without gradients)"
    return [f"canvas decoder: the encoder over rows of {row} tokens, the decoder over "
            f"canvases of {plan.canvas} tokens{twice if plan.self_condition else ''}"]  # fmt: skip


def render(plan: RunPlan, label: str) -> str:
    """The plan as text (what `unmask plan` prints)."""
    layout = plan.layout
    dims = " x ".join(f"{k} {v}" for k, v in layout.items())
    if plan.expert_parallel > 1:  # experts on their own (replica, ep) grid of the ranks
        dims += f" (ep {plan.expert_parallel}: the experts split over {plan.expert_parallel} ranks)"
    lines = [
        f"plan: {label} on {plan.world_size} x {plan.device} ({plan.nodes} node"
        f"{'s' if plan.nodes > 1 else ''}), mesh {dims}",
        f"model: {plan.parameters / 1e9:.3f} B parameters; {plan.rows_per_rank} rows per rank "
        f"per micro-batch, {plan.micro_batches} micro-batch(es) per step",
        *canvas_line(plan),
        "",
        "memory per rank" + "".join(f"{'rank ' + str(r.rank):>14}" for r in plan.ranks),
    ]
    fields = (("parameters", "parameters"), ("gradients", "gradients"),
              ("optimizer state", "optimizer"), ("activations", "activations"),
              ("working buffers", "working"), ("peak estimate", "peak"))  # fmt: skip
    for title, attr in fields:
        lines.append(f"  {title:<15}" + "".join(f"{human_bytes(getattr(r.memory, attr)):>14}"
                                                for r in plan.ranks))  # fmt: skip
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines.append(f"  limit          {human_bytes(plan.memory_limit):>14}  ({verdict})")
    lines += [
        "",
        f"shards of rank {plan.ranks[0].rank} (its first layer, and first MoE layer, stand for the others)",
    ]
    rows = plan.ranks[0].shards
    shapes = [f"{tuple(row['global'])} -> {tuple(row['local'])}" for row in rows]
    name_width = max([len(row["name"]) for row in rows] + [4])
    shape_width = max([len(shape) for shape in shapes] + [5])
    for row, shape in zip(rows, shapes):
        where = "; ".join(f"{d} {placement_words(p)}" for d, p in
                          zip(row["mesh"], row["placements"])) or "whole on every rank"  # fmt: skip
        lines.append(f"  {row['name']:<{name_width}}  {shape:<{shape_width}}  "
                     f"{row['optimizer']:<6} {where}")  # fmt: skip
    lines += [
        "",
        f"step: {plan.tokens_per_step:,} tokens, {plan.flops_per_step:.3e} model FLOPs; "
        f"compute {duration(plan.compute_s)} at {plan.mfu:.0%} MFU, exposed communication "
        f"{duration(plan.exposed_comm_s)}, step {duration(plan.step_s)}",
    ]
    if plan.optimizer_flops:
        lines.append(f"optimizer: Muon's Newton-Schulz {plan.optimizer_flops:.3e} FLOPs on the "
                     f"busiest rank, {duration(plan.optimizer_s)} at {plan.mfu:.0%} MFU "
                     "(in the step time)")  # fmt: skip
    if plan.bubble:
        lines.append(f"pipeline bubble: {plan.bubble:.1%} of the step idle (in the step time)")
    if plan.collectives:
        lines.append(
            "collectives per step (rank 0): dim, kind, calls, tensor bytes, wire bytes, link"
        )
        for c in plan.collectives:
            link = "intra-node" if c.intra_node else "inter-node"
            lines.append(f"  {c.dim:<14} {c.kind:<15} {c.calls:>6} {human_bytes(c.tensor_bytes):>11} "
                         f"{human_bytes(c.wire_bytes):>11}  {link:<10} {c.what}")  # fmt: skip
    if plan.total_steps is not None:
        lines.append(f"run: {plan.total_steps:,} steps, {plan.total_steps * plan.tokens_per_step:,} "
                     f"tokens, {duration(plan.wall_s)} of wall time")  # fmt: skip
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
