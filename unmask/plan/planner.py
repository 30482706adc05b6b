"""`unmask plan`'s answer: a run's layout priced per rank before it is launched.

`make_run_plan(cfg, world_size, ...)` shards the run's model at `world_size` with the run's
own code (shards.py) for the ranks it plans, adds the activation and working-memory terms
(memory.py), the collectives per mesh dim (traffic.py), the step's FLOPs (train/mfu.py's
count, the one the `mfu` metric logs) and a step time from the device table
(devices.py): compute at an assumed MFU plus the communication that does not overlap it.

Step time = model FLOPs per rank / (peak x mfu) / (1 - the pipeline's bubble fraction)
          + TP, CP and Muon collectives (on the critical path: nothing overlaps them)
          + what FSDP2's all-gathers and reduce-scatters take beyond the compute they
            overlap (max(0, fsdp time - compute time)), and HSDP's all-reduce alike.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from unmask.config import RunConfig
from unmask.diffusion import objective_spec
from unmask.diffusion.loss import LOSS_BLOCK, loss_block_elements
from unmask.diffusion.registry import head_share
from unmask.errors import InputError
from unmask.models.attention import FLEX_MIN_HEAD_DIM
from unmask.optim.newton_schulz import ns_flops
from unmask.optim.updates import auto_ns_dtype, cpu_has_native_bf16
from unmask.parallel.pipeline_plan import bubble_formula, split_passes
from unmask.plan.devices import Device
from unmask.plan.memory import MemoryTerms, StepShape
from unmask.plan.memory_models import memory_terms
from unmask.plan.shards import (
    ShardedModel,
    parallel_of,
    planned_model_config,
    shard_model,
)
from unmask.plan.traffic import Collective, step_collectives
from unmask.train.setup import ParallelPlan, checkpointing_choice

#: Share of the device memory a plan may fill (CUDA context, allocator fragmentation,
#: NCCL buffers take the rest).
USABLE_MEMORY = 0.9
#: The MFU a step time assumes unless --mfu says otherwise (docs/scaling.md: torchtitan's
#: Llama 3 8B on 8 H100s and MegaDLMs' reports sit around 40%).
DEFAULT_MFU = 0.40


@dataclass
class RankPlan:
    rank: int
    memory: MemoryTerms
    shards: list = field(default_factory=list)


@dataclass
class RunPlan:
    world_size: int
    nodes: int
    device: str
    layout: dict
    parameters: int
    """Distinct parameters of the model (global)."""
    ranks: list[RankPlan]
    collectives: list[Collective]
    rows_per_rank: int
    micro_batches: int
    tokens_per_step: int
    flops_per_step: float
    mfu: float
    compute_s: float
    """The step's FLOPs on one rank at the assumed MFU."""
    bubble: float
    """Share of the step the pipeline's ranks sit idle (0 without a pipeline)."""
    optimizer_flops: float
    """Muon's Newton-Schulz FLOPs per step on the busiest planned rank (0 under AdamW)."""
    optimizer_s: float
    """optimizer_flops at the assumed MFU, in the Newton-Schulz dtype's peak."""
    exposed_comm_s: float
    step_s: float
    total_steps: int | None
    wall_s: float | None
    memory_limit: float
    fits: bool
    expert_parallel: int = 1
    num_experts: int = 0
    notes: list[str] = field(default_factory=list)
    canvas: int = 0
    """A canvas decoder's canvas length (0: another family)."""
    self_condition: bool = False
    rows_per_step: int = 0

    def peak_rank(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.memory.peak)

    def to_json(self) -> dict:
        out = asdict(self)
        for collective, entry in zip(self.collectives, out["collectives"]):
            entry["wire_bytes"] = collective.wire_bytes
        return out


def step_rows(cfg: RunConfig, parallel: ParallelPlan) -> tuple[int, int]:
    """(rows per rank and micro-batch, micro-batches per step) of the trainer's layout
    (`parallel_of`): under pipeline parallelism the step's rows cut into the schedule's
    micro-batches."""
    rows, micro, pipeline = parallel.rows, cfg.train.gradient_accumulation_steps, parallel.pipeline
    if pipeline is not None:
        rows, micro = rows * micro // pipeline.microbatches, pipeline.microbatches
    return rows, micro


def step_shape(cfg: RunConfig, world_size: int) -> StepShape:
    """This rank's micro-batch and the step's settings, as the trainer sizes them."""
    t = cfg.train
    parallel = parallel_of(cfg, world_size)  # the trainer's plan: its rows per rank
    rows, micro = step_rows(cfg, parallel)
    arch = cfg.model
    canvas = parallel.model.shape.canvas_length(arch)  # a canvas decoder's (0: none)
    return StepShape(rows=rows, length=cfg.data.packing_length,
                     micro_batches=micro, bf16=t.bf16,
                     checkpointing=checkpointing_choice(t),
                     reshard_after_forward=parallel.reshard_after_forward,
                     canvas=canvas,
                     self_condition=bool(canvas) and cfg.diffusion.self_conditioning_prob > 0)  # fmt: skip


def run_shape(cfg: RunConfig, world_size: int, device: Device,
              masked_fraction: float) -> StepShape:  # fmt: skip
    """`step_shape` with what the run's settings and the device decide: the LM head's share
    of tokens, the attention's mask kind, the loss implementation, Newton-Schulz's bytes."""
    spec = objective_spec(cfg.diffusion.objective)
    shape = step_shape(cfg, world_size)
    # sdpa keeps a dense document mask (under attn_implementation sdpa, and for an objective
    # that passes its own mask, ar's causal one, on every device); flex (CUDA, heads of 16
    # features or more) a block mask; varlen (`auto` elsewhere) none: one call per document
    attn = cfg.model.attn_implementation
    dense_mask = attn == "sdpa" or spec.explicit_mask
    flex = device.name != "cpu" and cfg.model.resolved_head_dim >= FLEX_MIN_HEAD_DIM
    varlen = (cfg.data.packing and not spec.explicit_mask
              and (attn == "varlen" or (attn == "auto" and not flex)))  # fmt: skip
    block = loss_block_elements("cpu" if device.name == "cpu" else "cuda", LOSS_BLOCK,
                                free_bytes=int(device.memory_bytes))  # fmt: skip
    return StepShape(**{**asdict(shape), "masked_fraction": masked_fraction,
                        "loss_block": block, "dense_mask": dense_mask, "varlen": varlen,
                        "full_loss": cfg.model.loss_implementation == "full",
                        "ns_bytes": ns_dtype_bytes(cfg, device),
                        "ns_comm_bytes": ns_bytes(cfg, device)})  # fmt: skip


def ns_dtype_bytes(cfg: RunConfig, device: Device) -> int:
    """Bytes of Muon's Newton-Schulz dtype (optim/updates.py's `auto` rule on the planned
    device)."""
    name = cfg.optim.ns_dtype
    if name == "auto":
        name = auto_ns_dtype("cpu" if device.name == "cpu" else "cuda", cpu_has_native_bf16())[0]
    return 4 if name == "float32" else 2


def planned_ranks(world_size: int, ranks: list[int] | None) -> list[int]:
    """The ranks asked for, else the first and the last (torch.chunk shards: the first
    ranks hold the largest pieces, the last the smallest)."""
    if ranks is not None:
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise InputError(f"--ranks {bad[0]} is not a rank of a world of {world_size}; "
                             f"use 0..{world_size - 1}")  # fmt: skip
        return sorted(set(ranks))
    return [0] if world_size == 1 else [0, world_size - 1]


def ns_bytes(cfg: RunConfig, device: Device) -> int:
    """Bytes per element of Muon's all-to-alls: the Newton-Schulz dtype (optim/updates.py's
    `auto` rule on the planned device; float16 travels as float32)."""
    name = cfg.optim.ns_dtype
    if name == "auto":
        name = auto_ns_dtype("cpu" if device.name == "cpu" else "cuda", cpu_has_native_bf16())[0]
    return 2 if name == "bfloat16" else 4


def newton_schulz_flops(model: ShardedModel, cfg: RunConfig) -> float:
    """Muon's Newton-Schulz FLOPs per step on this rank: optim/newton_schulz.py's ns_flops of
    each Muon matrix (an expert stack: of each expert), times this rank's share of it (local
    over global elements). The FSDP2 / TP owners are balanced by these FLOPs, an expert stack's
    experts are whole on their rank, and each replica (dp_replicate) repeats its group's."""
    optim = cfg.optim
    if optim.name != "muon":
        return 0.0
    gram = optim.ns_coefficients == "gram" and optim.ns_steps == 5
    total = 0.0
    for s in model.shards:
        if s.optimizer != "muon" or len(s.global_shape) < 2:
            continue
        *stack, rows, cols = s.global_shape
        whole = ns_flops(rows, cols, optim.ns_steps, gram=gram) * math.prod(stack)
        total += whole * s.local_numel / math.prod(s.global_shape)
    return total


def bubble_fraction(model: ShardedModel, length: int) -> float:
    """Share of a step a pipeline rank idles (parallel/pipeline_plan.py `bubble_formula`):
    (p - 1) / (m v + p - 1) for GPipe, 1F1B and interleaved 1F1B (m micro-batches, p ranks,
    v stages per rank: the warm-up and drain of p - 1 stage steps against m v of work);
    for zero bubble (p - 1)(F + I - W) / (m v (F + I + W) + (p - 1)(F + I - W)), ZB-H1's,
    at the passes' estimated FLOPs on rows of `length` tokens (`split_passes`: the
    attention's backward makes the input pass longer than the weight pass). 0 without a
    pipeline."""
    plan = model.pipeline
    if plan is None:
        return 0.0
    passes = (1.0, 1.0, 1.0)
    if plan.spec.split_backward:
        passes = split_passes(model.model_config, length)
    return bubble_formula(plan.schedule, plan.degree, plan.microbatches, plan.stages_per_rank,
                          passes)  # fmt: skip


def step_flops(model: ShardedModel, shape: StepShape, dp: int, masked_fraction: float) -> float:
    """Model FLOPs of one micro-batch over the dp ranks (train/mfu.py's count, the one the
    `mfu` metric logs): the decoder's over rows of `shape.length` tokens with the LM head
    on `masked_fraction` of them; a canvas decoder's (`shape.canvas`) its shape's
    `call_flops` of the objective's call (models/shape.py)."""
    rows = shape.rows * dp
    if shape.canvas:
        arch = model.model_config
        with torch.device("meta"):
            args, kwargs = model.shape.training_call(arch, rows, shape.length,
                                                     shape.self_condition)  # fmt: skip
        return float(model.shape.call_flops(model.flops, arch, args, kwargs))
    tokens = rows * shape.length
    return float(model.flops.step_flops(tokens, shape.length, masked_fraction * tokens))


def link_seconds(collective: Collective, device: Device) -> float:
    bandwidth = device.nvlink if collective.intra_node else device.network
    return collective.wire_bytes / bandwidth


def make_run_plan(cfg: RunConfig, world_size: int, device: Device, *, nodes: int = 1,
                  mfu: float = DEFAULT_MFU, tokens: float | None = None,
                  ranks: list[int] | None = None,
                  masked_fraction: float | None = None) -> RunPlan:  # fmt: skip
    """The plan of `cfg` at `world_size` ranks on `nodes` nodes of `device`;
    masked_fraction: the share of tokens the LM head runs on (default: the objective's
    registry entry says, `head_share`, else 1/2)."""
    if masked_fraction is None:
        masked_fraction = head_share(cfg.diffusion.objective)
    if world_size < 1:
        raise InputError(f"--world must be >= 1, got {world_size}")
    if nodes < 1 or world_size % nodes:
        raise InputError(f"--nodes {nodes} does not divide --world {world_size}; give a node "
                         "count that splits the ranks evenly")  # fmt: skip
    if not 0 < mfu <= 1:
        raise InputError(f"--mfu must be in (0, 1], got {mfu}")
    cfg = planned_model_config(cfg)
    layout = parallel_of(cfg, world_size).dims  # a one-line InputError for a bad layout
    shape = run_shape(cfg, world_size, device, masked_fraction)
    plans, first, ns_work = [], None, 0.0
    for rank in planned_ranks(world_size, ranks):
        sharded = shard_model(cfg, world_size, rank)
        first = first or sharded
        plans.append(RankPlan(rank, memory_terms(sharded, shape), shard_rows(sharded)))
        ns_work = max(ns_work, newton_schulz_flops(sharded, cfg))
    collectives = step_collectives(first, shape, nodes, ns_bytes=ns_bytes(cfg, device))
    total_params = (sum(math.prod(s.global_shape) for s in first.shards)
                    if first.pipeline is None else first.parameters)  # fmt: skip
    dp = layout.dp
    batch_ranks = 1 if cfg.train.split_batches else dp
    rows_per_step = (cfg.train.per_device_train_batch_size * cfg.train.gradient_accumulation_steps
                     * batch_ranks)  # fmt: skip
    tokens_per_step = rows_per_step * cfg.data.packing_length
    flops = shape.micro_batches * step_flops(first, shape, dp, masked_fraction)
    peak = device.peak(cfg.train.bf16)
    compute = flops / world_size / (peak * mfu)
    overlapped = sum(link_seconds(c, device) for c in collectives
                     if c.dim in ("dp_shard_cp", "dp_replicate"))  # fmt: skip
    exposed = sum(link_seconds(c, device) for c in collectives
                  if c.dim not in ("dp_shard_cp", "dp_replicate"))  # fmt: skip
    exposed += max(0.0, overlapped - compute)
    bubble = bubble_fraction(first, shape.length)
    compute_with_bubble = compute / (1 - bubble)
    # the optimizer runs after the backward, outside the overlap; Newton-Schulz in its dtype
    optimizer_s = ns_work / (device.peak(ns_bytes(cfg, device) == 2) * mfu)
    step = compute_with_bubble + optimizer_s + exposed
    if tokens is not None:
        total_steps = math.ceil(tokens / tokens_per_step)
    elif cfg.train.max_steps > 0:
        total_steps = cfg.train.max_steps
    else:
        total_steps = None
    limit = device.memory_bytes * USABLE_MEMORY
    worst = max(p.memory.peak for p in plans)
    notes = []
    if total_steps is None:
        notes.append("the run's length comes from its data (num_train_epochs): give --tokens "
                     "or train.max_steps for a wall time")  # fmt: skip
    if first.pipeline is not None and first.pipeline.spec.split_backward:
        notes.append("zero bubble: each linear layer and norm holds its input and output "
                     "gradient from a micro-batch's input pass to its weight pass; the "
                     "memory estimate leaves them out (about one micro-batch's saved "
                     "activations of the stage per weight pass not yet run)")  # fmt: skip
    return RunPlan(world_size=world_size, nodes=nodes, device=device.name,
                   layout={k: v for k, v in asdict(layout).items() if k != "ep"},  # mesh dims
                   parameters=total_params, ranks=plans,
                   collectives=collectives, rows_per_rank=shape.rows,
                   micro_batches=shape.micro_batches, tokens_per_step=tokens_per_step,
                   flops_per_step=flops, mfu=mfu, compute_s=compute, bubble=bubble,
                   optimizer_flops=ns_work, optimizer_s=optimizer_s,
                   exposed_comm_s=exposed,
                   step_s=step, total_steps=total_steps,
                   wall_s=None if total_steps is None else total_steps * step,
                   memory_limit=limit, fits=worst <= limit, notes=notes,
                   expert_parallel=layout.ep,
                   num_experts=first.model_config.num_experts, canvas=shape.canvas,
                   self_condition=shape.self_condition,
                   rows_per_step=rows_per_step)  # fmt: skip


def shard_rows(model: ShardedModel) -> list[dict]:
    """One row per distinct parameter of a layer (the first this rank holds stands for all,
    and its first MoE layer for the MoE ones) and the root's:
    name, global shape, local shape, placements, optimizer."""
    rows = []
    indices = model.layer_indices or (0,)
    arch = model.model_config
    moe = [i for i in indices if arch.num_experts and arch.is_moe_layer(i)]
    shown = {"root", f"layer {indices[0]}", *(f"layer {i}" for i in moe[:1])}
    for s in model.shards:
        if s.unit not in shown:
            continue
        rows.append({"name": s.name, "global": list(s.global_shape), "local": list(s.local_shape),
                     "mesh": list(s.mesh_dims), "placements": list(s.placements),
                     "optimizer": s.optimizer})  # fmt: skip
    return rows
