"""Every parameter's shard on one rank, read from the run's own model and parallelize code
run at cluster size on this machine.

`shard_model(cfg, world_size, rank)` opens torch's fake process group (every collective
returns at once, nothing is sent) as rank `rank` of `world_size`, builds the run's mesh
(parallel/dims.py `ParallelDims.build_mesh`), builds the model on the meta device with the trainer's
own `build_train_model` (train/setup.py: the pipeline stages this rank holds, tensor
parallelism, activation checkpointing, expert parallelism, FSDP2, in the trainer's order;
the pipeline planned by the trainer's `pipeline_plan`) and the run's optimizer
(optim/config.py `build_optimizer`: its Muon / AdamW routing), then reads each
parameter's DTensor: global shape, local shape on this rank, mesh dims and placements. No number here comes from a second model of
the sharding: change a parallelize rule and the shards change (tests/unit/test_plan.py).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from unmask.config import RunConfig
from unmask.errors import InputError
from unmask.models.build import _no_init, build_model  # no-op initializers, whole model
from unmask.models.shape import ModelShape, decoder_layers
from unmask.optim.config import build_optimizer
from unmask.parallel.dims import ParallelDims
from unmask.parallel.pipeline_plan import PipelinePlan
from unmask.train.mfu import flop_model
from unmask.train.setup import (
    ParallelPlan,
    build_train_model,
    check_model_request,
    check_pipeline_request,
    plan_parallel,
)


@dataclass(frozen=True)
class TensorShard:
    """One parameter as one rank holds it. Shapes are element counts per dim."""

    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    """The stored (master) dtype of the parameter."""
    mesh_dims: tuple[str, ...]
    """Names of the mesh dims of its DTensor ((): a plain tensor, one process)."""
    placements: tuple[str, ...]
    optimizer: str
    """muon, adamw or frozen (the run's optimizer routing)."""
    unit: str
    """Its FSDP2 unit, from the modules fully_shard wrapped: "layer N" (a decoder layer) or
    "root" (what the root holds: embedding, final norm, head)."""
    shard_group: int
    """Ranks that hold its pieces along the FSDP2 dims (dp_shard_cp; 1: not sharded)."""

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def local_bytes(self) -> int:
        return self.local_numel * self.dtype.itemsize

    tp_size: int = 1
    """Tensor-parallel degree of its split (1: not split by TP)."""
    tp_dim: int | None = None
    """The tensor dim TP splits (0: column-parallel, 1: row-parallel), None: not split."""

    @property
    def expert_parallel(self) -> bool:
        """An expert stack on the (ep_replica, ep) grid (parallel/expert.py): whole experts
        on their rank, outside FSDP2."""
        return "ep" in self.mesh_dims

    @property
    def gathered_numel(self) -> int:
        """Elements FSDP2's all-gather makes of it on this rank: its tensor-parallel piece,
        dim 0 padded to a multiple of the shard group (torch.chunk sizes)."""
        shape = list(self.global_shape)
        if self.tp_dim is not None:
            shape[self.tp_dim] = -(-shape[self.tp_dim] // self.tp_size)
        if self.shard_group > 1:
            shape[0] = -(-shape[0] // self.shard_group) * self.shard_group
        return math.prod(shape)


@dataclass(frozen=True)
class ShardedModel:
    """What one rank holds, and the facts of the model the other terms need."""

    rank: int
    layout: ParallelDims
    """The run's layout (the trainer's `plan_parallel`)."""
    shards: list[TensorShard]
    model_config: object
    """The ModelConfig the model was built from (architecture fields)."""
    layers: int
    """Decoder layers this rank holds."""
    flops: object
    """train/mfu.py's FlopModel of the model (global counts)."""
    shape: ModelShape
    """The family's declaration (models/shape.py) of the model the run resolved
    (train/setup.py `plan_parallel`'s `ResolvedModel`): what the memory, traffic and FLOP
    terms read of the family."""
    layer_indices: tuple[int, ...] = ()
    """The whole model's indices of the decoder layers this rank holds, in order."""
    pipeline: PipelinePlan | None = None
    """The run's pipeline (parallel/pipeline_plan.py), None without pipeline parallelism."""
    pp_rank: int = 0
    parameters: int = 0
    """Parameters of the whole model (under a pipeline: of every stage, not only this
    rank's)."""

    @property
    def stages(self) -> list[int]:
        """The pipeline stages this rank holds ([0] without a pipeline)."""
        return [0] if self.pipeline is None else self.pipeline.stages_of(self.pp_rank)

    @property
    def holds_embedding(self) -> bool:
        """Whether this rank runs the embedding (the first stage)."""
        return self.pipeline is None or 0 in self.stages

    @property
    def holds_head(self) -> bool:
        """Whether this rank computes the LM head and the loss (the last stage)."""
        return self.pipeline is None or self.pipeline.num_stages - 1 in self.stages


def planned_model_config(cfg: RunConfig) -> RunConfig:
    """The run config with a pretrained folder's architecture in place of its weights: the
    planner reads config.json only (the weights are neither needed nor read). The model is
    resolved and checked by the trainer's own functions first (train/setup.py
    `check_model_request` and `check_pipeline_request`: the same line for the same problem;
    the layout's other checks follow in `plan_parallel`, which the plan runs for every
    rank); then one line for what the
    planner does not model (a 4-bit base, a wrapped encoder, a family whose ModelShape says
    `plans` False, a canvas decoder's tensor split)."""
    p = cfg.parallel
    model = check_model_request(cfg, world_size=1)  # the world's own checks: plan_parallel
    if cfg.model.load_in_4bit:
        raise InputError("model.load_in_4bit: the planner does not model 4-bit bases; plan "
                         "the run without it")  # fmt: skip
    if model.wrapped:
        raise InputError(f"model.model_type {model.family.name!r} is a wrapped transformers "
                         "encoder; the planner plans native decoders")  # fmt: skip
    if not model.shape.plans:  # models/shape.py: the family says so
        raise InputError(
            f"unmask plan does not model model_type {model.family.name!r} yet (its training "
            "step is not the one-row forward the planner traces and prices: models/shape.py); "
            "train it without a plan"
        )
    check_pipeline_request(cfg, model)  # the family's stages, in the trainer's line
    if model.shape.canvas_decoder and p.tensor_parallel > 1:
        raise InputError(f"parallel.tensor_parallel={p.tensor_parallel}: model_type "
                         f"{model.family.name!r} trains under tensor parallelism, but unmask plan "
                         "does not model its split yet; plan with "
                         "parallel.tensor_parallel=1")  # fmt: skip
    if cfg.model.pretrained is None:
        return cfg
    return cfg.model_copy(update={"model": model.planned()})


class _Vocabulary:
    """What build_train_model reads of a tokenizer: its length (the model's vocabulary:
    the planner loads no tokenizer, so no resize is planned)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """torch's fake process group as `rank` of `world_size` (nothing when world_size is 1)."""
    if world_size == 1:
        yield
        return
    if dist.is_initialized():
        raise InputError("the planner runs in a process without a process group; run "
                         "`unmask plan` outside torchrun")  # fmt: skip
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def parallel_of(cfg: RunConfig, world_size: int) -> ParallelPlan:
    """The layout the trainer would plan at `world_size` (train/setup.py `plan_parallel`:
    the same checks, so a layout the trainer refuses is refused here in the same line)."""
    if cfg.parallel.sequence_parallel:  # its activations and collectives are not the planner's
        raise InputError(
            "unmask plan does not model parallel.sequence_parallel yet "
            "(docs/scaling.md); plan the layout with parallel.sequence_parallel=false"
        )
    return plan_parallel(cfg, world_size)


def shard_model(cfg: RunConfig, world_size: int, rank: int = 0) -> ShardedModel:
    """Rank `rank`'s shards of the run's model at `world_size` (see the module docstring);
    cfg: a planned config (`planned_model_config`)."""
    parallel = parallel_of(cfg, world_size)
    layout, pipeline = parallel.dims, parallel.pipeline
    with fake_world(rank, world_size), warnings.catch_warnings():
        # torch's note on slicing the flattened dims the trainer's own code slices
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        mesh = layout.build_mesh(torch.device("cpu")) if world_size > 1 else None
        meta = torch.device("meta")
        with meta, _no_init():  # no storage to fill (and no torch._dynamo import)
            model = build_train_model(cfg, _Vocabulary(cfg.model.vocab_size), 0, meta,
                                      parallel, mesh)  # fmt: skip
            # the step's FLOPs and parameters are the whole model's (a pipeline rank holds
            # part of it)
            whole = model if pipeline is None else build_model(cfg.model)
            flops = flop_model(whole)
            parameters = sum(p.numel() for p in whole.parameters())
        pp_rank = mesh["pp"].get_local_rank() if pipeline is not None else 0
        return describe_shards(model, routing_of(build_optimizer(cfg.optim, model)), layout,
                               rank, pipeline, pp_rank, flops, parameters,
                               parallel.model.shape)  # fmt: skip


def describe_shards(model: nn.Module, routing: dict[int, str], layout: ParallelDims, rank: int,
                    pipeline, pp_rank: int, flops, parameters: int,
                    shape: ModelShape) -> ShardedModel:  # fmt: skip
    """The ShardedModel of a built model: the planner's meta build, or a trainer's own
    (its real shards: unmask/plan/checkpointing.py). routing: parameter id -> muon /
    adamw (`routing_of` the optimizer)."""
    shards = _read_shards(model, routing, layout)
    layers = decoder_layers(model)
    indices = tuple(range(len(layers)))
    if pipeline is not None:
        indices = tuple(sorted(i for stage in pipeline.stages_of(pp_rank)
                               for i in pipeline.layers[stage]))  # fmt: skip
    return ShardedModel(rank, layout, shards, model.config, len(layers), flops, shape, indices,
                        pipeline, pp_rank, parameters)  # fmt: skip


def routing_of(optimizer) -> dict[int, str]:
    """Parameter id -> muon / adamw, from an optimizer's param groups."""
    route = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            route[id(p)] = "muon" if group.get("use_muon") else "adamw"
    return route


def _unit_name(module_name: str) -> str:
    """ "layer N" for a decoder layer (model.layers.N), else the module's own name."""
    parts = module_name.replace("._orig_mod", "").split(".")
    if len(parts) >= 2 and parts[-2] == "layers":
        return f"layer {parts[-1]}"
    return module_name or "root"


def _units(model: nn.Module) -> dict[int, str]:
    """Parameter id -> its FSDP2 unit, read from the modules fully_shard wrapped (the
    innermost one wins; the root holds the rest). Without FSDP2: each decoder layer by
    its name, the rest "root"."""
    from torch.distributed.fsdp import FSDPModule

    wrapped = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not wrapped:
        wrapped = [(name, m) for name, m in model.named_modules()
                   if name.split(".")[-2:-1] == ["layers"]]  # fmt: skip
    units: dict[int, str] = {}
    for name, module in sorted(wrapped, key=lambda item: -len(item[0])):  # innermost first
        for p in module.parameters():
            units.setdefault(id(p), "root" if module is model else _unit_name(name))
    return units


def _read_shards(
    model: nn.Module, routing: dict[int, str], layout: ParallelDims
) -> list[TensorShard]:
    from torch.distributed.tensor import DTensor

    units = _units(model)
    shards = []
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            dims = tuple(p.device_mesh.mesh_dim_names or ())
            local = tuple(p.to_local().shape)
            placements = tuple(str(pl) for pl in p.placements)
            tp_split = _tp_split(dims, p.placements, layout.tp)
            group = 1  # FSDP2's shard dim (expert stacks on the ep grid have none)
            for dim_name in dims:
                if dim_name in ("dp_shard_cp", "dp_shard", "cp"):
                    group *= p.device_mesh[dim_name].size()
        else:
            dims, local, placements, group, tp_split = (), tuple(p.shape), (), 1, {}
        optimizer = routing.get(id(p), "frozen") if p.requires_grad else "frozen"
        shards.append(TensorShard(name=_clean(name), global_shape=tuple(p.shape),
                                  local_shape=local, dtype=p.dtype, mesh_dims=dims,
                                  placements=placements, optimizer=optimizer,
                                  unit=units.get(id(p), "root"), shard_group=group,
                                  **tp_split))  # fmt: skip
    return shards


def _tp_split(dims: tuple[str, ...], placements, tp: int) -> dict:
    """tp_size and tp_dim of a DTensor from its placement on the tp mesh dim."""
    if "tp" not in dims:
        return {}
    placement = placements[dims.index("tp")]
    if placement.is_shard():
        return {"tp_size": tp, "tp_dim": placement.dim}
    return {}


def _clean(name: str) -> str:
    """A parameter name without the wrappers' prefixes (torch.compile's _orig_mod)."""
    return name.replace("._orig_mod", "")
