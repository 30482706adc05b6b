"""Mixture-of-experts training: balancing statistics per optimizer step, and expert
parallelism (`parallel.expert_parallel: N`).

Balancing (`MoETraining`): every MoE layer (models/moe.py) sums its experts' load over the
step's micro-batches (under pipeline parallelism the pipeline's, on the ranks of the layer's
stage); an optimizer pre-step hook sums it over the ranks that read different tokens (the
"dp_cp" mesh group), moves the sigmoid routers' expert bias once per step (aux-loss-free
balancing) and keeps the load and aux loss for the metrics (under pipeline parallelism
gathered from every stage when they are logged). The aux and z
losses themselves are normalized over each micro-batch of the whole group, so a run's
gradients, losses and biases do not depend on its world size or on gradient accumulation
when the micro-batches are the same.

Expert parallelism: the dp x cp ranks (D of them; under pipeline parallelism those of each
stage) form a (D / N) x N grid, rank r at (r // N, r % N). Each layer's E experts are split
over the N ranks of a row (rank r % N holds experts [(r % N) E / N, (r % N + 1) E / N)), and
the rows are replicas. Expert weights are
DTensors on that grid, placements (Replicate, Shard(0)): FSDP2 leaves them alone
(`ignored_params`), each rank computes with its whole expert matrices (so Muon orthogonalizes
each expert on the rank that owns it, with no gather), DCP saves one global (E, ., .) tensor
that a run of any other layout reads. Their gradients are partial sums over the replicas
(`Partial` on the first grid dim) until the pre-step hook all-reduces them (the gradient
norm reads them right: the DTensor norm reduces first; clipping scales the partial sums).

Tokens reach their experts by two all-to-alls per layer and direction (forward: the
per-expert counts, then the rows; the reverse all-to-all brings the outputs back); rows stay
sorted by expert, so each rank runs its experts as one grouped GEMM. Per layer and forward,
a rank sends and receives sum over the rows it routes away of H x bytes (its local tokens x
top-k x (N - 1) / N on average, under balanced routing), twice (there and back), and the
backward the same again: all-to-all bytes per step and rank =
4 x tokens x top_k x (N - 1) / N x H x bytes x MoE layers (docs/parallelism.md).

The modules expert parallelism splits ("expert blocks", `expert_blocks`) share a small
protocol: `num_experts`, an `expert_parallel` slot (None: every expert on this rank; else
the ExpertShard the module's forward hands its expert-sorted rows to, with a callable that
runs the local experts) and stacked (E, ., .) parameters split on dim 0, named by a class
attribute `expert_stacks` (paths from the module: SparseMoE's `experts.gate_proj`, ...;
DiffusionGemma's `Experts`: gate_up_proj, down_proj; the latter has no balancing
statistics, so `MoETraining` only reduces its gradients). LoRA's `experts` target
(models/lora.py) reads the same declaration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from unmask.errors import InputError
from unmask.models.families import FAMILIES
from unmask.models.moe import SparseMoE, moe_blocks
from unmask.parallel.mesh import sub_mesh

if TYPE_CHECKING:
    from unmask.models.build import ResolvedModel


def check_moe_request(resolved: ResolvedModel, expert_parallel: int, tp: int) -> None:
    """One-line InputErrors for an MoE / expert-parallel request this model cannot serve
    (before any process group): EP on a wrapped HF model or a dense one, experts not
    divisible by expert_parallel, LoRA on the expert stacks under EP, MoE with tensor
    parallelism (but for a family whose tensor-parallel plan keeps its experts whole on every
    tp rank, models/shape.py `TensorPlan.replicated_experts`, without expert parallelism).
    Whether the degree fits the ranks is the layout's check (parallel/dims.py)."""
    if resolved.wrapped:
        if expert_parallel > 1:
            moe = ", ".join(name for name, family in FAMILIES.items()
                            if family.native and family.moe)  # fmt: skip
            raise InputError(
                f"parallel.expert_parallel={expert_parallel} needs a native MoE model "
                f"({moe}); this model is wrapped from transformers: set "
                "parallel.expert_parallel: 1"
            )
        return
    if expert_parallel == 1 and tp == 1:
        return
    arch = resolved.arch  # a pretrained folder's own config.json
    experts = arch.num_experts
    if experts and tp > 1:
        plan = resolved.shape.tensor
        if plan is None or not plan.replicated_experts:
            raise InputError(
                "parallel.tensor_parallel does not split mixture-of-experts layers; use "
                "parallel.expert_parallel for the experts and set tensor_parallel: 1"
            )
        if expert_parallel > 1:
            raise InputError(
                f"parallel.tensor_parallel={tp} keeps the experts of model_type "
                f"{arch.model_type!r} whole on every tp rank and does not combine with "
                f"parallel.expert_parallel={expert_parallel}; set one of them to 1"
            )
    if expert_parallel == 1:
        return
    if experts == 0:
        raise InputError(
            f"parallel.expert_parallel={expert_parallel} needs a mixture-of-experts model; "
            f"model.model_type {arch.model_type!r} has num_experts 0: set expert_parallel: 1"
        )
    if experts % expert_parallel:
        raise InputError(
            f"model.num_experts={experts} is not divisible by parallel.expert_parallel="
            f"{expert_parallel}; pick an expert_parallel that divides the experts"
        )
    section = resolved.section
    if (
        section.lora
        and isinstance(section.lora_target_modules, list)
        and ("experts" in section.lora_target_modules)
    ):
        raise InputError(
            f"LoRA on the expert stacks (lora_target_modules holds 'experts') does not run under "
            f"parallel.expert_parallel={expert_parallel}: set expert_parallel: 1 or drop 'experts'"
        )


# --- balancing -----------------------------------------------------------------------------


class MoETraining:
    """Per-step load bookkeeping of a model's MoE layers (see the module docstring). Under
    pipeline parallelism (`stages`: the pp group) this rank holds its stages' MoE layers
    (maybe none): the bias update needs only those, the metrics gather every stage's."""

    def __init__(self, model: nn.Module, optimizer, group, micro_batches: int,
                 stages=None, num_experts: int = 0) -> None:  # fmt: skip
        self.blocks = moe_blocks(model)
        self.group = group
        self.stages = stages
        # each block's decoder layer (the metrics order every stage's blocks by it)
        self.layer_ids = [_layer_index(name, index) for index, name in
                          enumerate(n for n, m in model.named_modules()
                                    if isinstance(m, SparseMoE))]  # fmt: skip
        # EP: partial grads, reduced per step (every expert block's: SparseMoE and others)
        self.expert_params: list[nn.Parameter] = []
        for block in self.blocks:
            block.balance_group = group
            block.aux_loss_scale = 1.0 / micro_batches
        experts = self.blocks[0].num_experts if self.blocks else num_experts
        self.loads = torch.zeros(len(self.blocks), experts)
        self.aux = torch.zeros(())
        self.steps = 0
        optimizer.register_step_pre_hook(lambda *args: self.before_step())

    def before_step(self) -> None:
        """Sum the step's load over the ranks, move the expert biases, reset the counters;
        all-reduce the replicas' partial expert gradients (expert parallelism)."""
        self.steps += 1
        for param in self.expert_params:
            if param.grad is not None:
                param.grad = param.grad.redistribute(placements=[Replicate(), Shard(0)])
        if not self.blocks:  # a pipeline stage of dense layers only, or no balanced block
            return
        loads = torch.stack([block.load for block in self.blocks])
        stats = torch.cat([loads.reshape(-1), sum(b.aux_sum for b in self.blocks).reshape(1)])
        if self.group is not None:
            dist.all_reduce(stats, group=self.group)
        loads = stats[:-1].view_as(loads)
        for block, load in zip(self.blocks, loads):
            block.update_expert_bias(load)
            block.load.zero_()
            block.aux_sum.zero_()
        if self.loads.device != loads.device:  # summed where they are made: read when logged
            self.loads, self.aux = self.loads.to(loads.device), self.aux.to(loads.device)
        self.loads += loads
        self.aux += stats[-1]

    def _every_stage(self) -> tuple[torch.Tensor, float]:
        """(loads of every MoE layer of the model, in layer order; the aux loss summed over
        them): this rank's, or under pipeline parallelism every stage's, gathered over the
        pp group (every rank calls this at the same steps)."""
        if self.stages is None:
            return self.loads.cpu(), float(self.aux)
        mine = (self.layer_ids, self.loads.tolist(), float(self.aux))
        gathered: list = [None] * dist.get_world_size(self.stages)
        dist.all_gather_object(gathered, mine, group=self.stages)
        rows = sorted((i, row) for ids, loads, _ in gathered for i, row in zip(ids, loads))
        loads = torch.tensor([row for _, row in rows], dtype=self.loads.dtype)
        return loads, sum(aux for *_, aux in gathered)

    def take_log(self) -> dict:
        """Since the last call: the mean aux loss per step and each layer's max / mean expert
        load (1.0 = perfectly balanced), plus the largest over layers and the largest
        coefficient of variation (std / mean) of tokens per expert."""
        if not self.steps or (not self.blocks and self.stages is None):
            return {}  # nothing balanced (expert blocks without statistics: DiffusionGemma)
        loads, aux = self._every_stage()
        mean = loads.mean(dim=1).clamp(min=1e-9)
        ratio = loads.max(dim=1).values / mean
        spread = loads.std(dim=1, unbiased=False) / mean
        values = {"moe_aux_loss": aux / self.steps,
                  "moe_load_max_over_mean": float(ratio.max()),
                  "moe_tokens_per_expert_cv": float(spread.max())}  # fmt: skip
        for index, value in enumerate(ratio.tolist()):
            values[f"moe_load_max_over_mean/layer_{index}"] = value
        self.loads.zero_()
        self.aux.zero_()
        self.steps = 0
        return values


def _layer_index(name: str, fallback: int) -> int:
    """The decoder layer of an MoE block named like `model.layers.5.mlp` (its position
    among the blocks when the name has none)."""
    parts = name.split(".")
    for before, after in zip(parts, parts[1:]):
        if before == "layers" and after.isdigit():
            return int(after)
    return fallback


def attach_moe_training(model, optimizer, dist_state, micro_batches: int,
                        stages=None) -> MoETraining | None:  # fmt: skip
    """MoETraining for a model with MoE layers (None for a dense one); balancing spans the
    "dp_cp" ranks (tokens differ across them). micro_batches: the forwards per optimizer
    step (gradient accumulation steps, or the pipeline's micro-batches); stages: the pp
    process group under pipeline parallelism (this rank may hold no MoE layer)."""
    num_experts = getattr(getattr(model, "config", None), "num_experts", 0) or 0
    sharded = [b for b in expert_blocks(model) if b.expert_parallel is not None]
    if not moe_blocks(model) and not (stages is not None and num_experts) and not sharded:
        return None  # dense, or expert blocks without statistics on their own ranks
    group = None
    if dist_state.mesh is not None:
        group = sub_mesh(dist_state.mesh, "dp_cp").get_group()
    training = MoETraining(model, optimizer, group, micro_batches, stages, num_experts)
    training.expert_params = [p for block in sharded for p in expert_stacks(block).values()]
    return training


# --- expert parallelism --------------------------------------------------------------------


class ExpertShard:
    """A layer's experts split over the "ep" ranks; `run` sends rows to their experts' ranks."""

    def __init__(self, mesh: DeviceMesh, num_experts: int) -> None:
        self.mesh = mesh
        self.group = mesh.get_group("ep")
        self.size = mesh.size(1)
        self.num_local = num_experts // self.size

    def run(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (N, H) sorted by global expert, counts (E,) -> the rows' expert outputs,
        in the same order. The split sizes are host integers read from the counts, so an
        expert block that runs this is left out of torch.compile (`shard_experts`)."""
        size, local = self.size, self.num_local
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # (source, local expert)
        send = counts.view(size, local).sum(dim=1).tolist()
        matrix = received.view(size, local)
        recv = matrix.sum(dim=1).tolist()
        there = all_to_all_single_autograd(rows.contiguous(), recv, send, self.group)
        # received rows are grouped by (source rank, local expert): regroup by expert
        order = _regroup(matrix)
        result = experts(there[order], matrix.sum(dim=0))
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        back = result[inverse]
        return all_to_all_single_autograd(back, send, recv, self.group)


def _regroup(matrix: torch.Tensor) -> torch.Tensor:
    """Row indices that turn blocks ordered (source, expert) into (expert, source) order;
    matrix[s, e] = rows from source s for local expert e."""
    sizes = matrix.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes  # start of block (s, e) in received order
    transposed = starts.view_as(matrix).T.reshape(-1), matrix.T.reshape(-1)
    pieces = [torch.arange(int(a), int(a) + int(n)) for a, n in zip(*transposed) if n]
    return torch.cat(pieces) if pieces else sizes.new_zeros(0)


def shard_experts(model: nn.Module, mesh: DeviceMesh) -> list[nn.Parameter]:
    """Turn every expert block's stacks into DTensors on `mesh` (Replicate, Shard(0)) and
    give the block its ExpertShard; returns the new expert parameters (for FSDP2's
    ignored_params)."""
    params: list[nn.Parameter] = []
    for block in expert_blocks(model):
        block.expert_parallel = ExpertShard(mesh, block.num_experts)
        # run eagerly inside a compiled layer (train.torch_compile): its dispatch reads the
        # per-expert counts to the host and receives a data-dependent number of rows
        block.forward = torch.compiler.disable(block.forward)
        for owner, name in _stack_owners(block):
            whole = getattr(owner, name).detach()
            shard = distribute_tensor(whole, mesh, [Replicate(), Shard(0)])
            param = nn.Parameter(shard)
            setattr(owner, name, param)
            params.append(param)
    return params


# --- the expert blocks (the protocol of the module docstring) ------------------------------


def _is_expert_block(module: nn.Module) -> bool:
    # the class's attribute, not the instance's: a wrapper that forwards attribute look-ups
    # to the module it wraps (peft's) is not a second block
    return bool(getattr(type(module), "expert_stacks", None))


def expert_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules whose experts expert parallelism splits, in module order ([] for a dense
    model): those whose class names its `expert_stacks`."""
    return [m for m in model.modules() if _is_expert_block(m)]


def _stack_owners(block: nn.Module) -> list[tuple[nn.Module, str]]:
    """(the module holding it, its attribute name) of each of an expert block's stacks."""
    pairs = []
    for path in type(block).expert_stacks:
        owner, _, name = path.rpartition(".")
        pairs.append((block.get_submodule(owner) if owner else block, name))
    return pairs


def expert_stacks(block: nn.Module) -> dict[str, nn.Parameter]:
    """An expert block's stacked expert parameters by attribute name."""
    return {name: getattr(owner, name) for owner, name in _stack_owners(block)}
