"""FSDP2 on given modules: per-block torch.compile, fully_shard per block and root, gradient
sync across micro-batches, and the full (gathered) state dict.

Activation checkpointing is the model's own concern (a flag its forward reads per block), so
it composes with FSDP2 without wrappers; the caller sets it before compiling and sharding
(torchtitan's order: activation checkpointing, then compile, then FSDP2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh


def compile_blocks(blocks: list[nn.Module], fullgraph: bool = True) -> int:
    """torch.compile each block in place (one graph per block, reused by every block of the
    same shape); returns how many. Per-block rather than whole-model compilation keeps
    compile time flat in depth and composes with FSDP2. fullgraph: a graph break is an
    error, not a silent split of the block into pieces with Python between them (a dense
    or MoE block is one graph, two for an MoE block under activation checkpointing: its
    forward and its recomputation; tests/unit/test_compile_blocks.py); False where the
    attention backend cannot be traced whole (varlen reads its document runs to the host)."""
    for block in blocks:
        block.compile(fullgraph=fullgraph)
    return len(blocks)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    blocks: list[nn.Module],
    *,
    bf16: bool = False,
    reshard_after_forward: bool = True,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` (1-D: FSDP2; 2-D replicate x shard: HSDP).

    Each of ``blocks`` (the transformer layers), and each module whose class sets
    ``fsdp_unit = True``, is one FSDP unit; the root holds the rest
    (embedding, final norm, head). ``bf16``: parameters are cast to bfloat16 for compute,
    gradients are reduced in float32 (the sharded master weights stay float32).
    ``reshard_after_forward``: True frees each block's gathered weights after its forward
    (ZeRO-3-like, least memory); False keeps them until backward (ZeRO-2-like, one
    all-gather fewer per block). Gradients are summed over ranks (no averaging): the caller
    normalizes by the global token count itself. ``ignored_params``: parameters FSDP2 leaves
    alone (expert-parallel expert stacks, DTensors on their own grid: parallel/expert.py).
    """
    # torch.distributed.fsdp imports DTensor, with sympy under it: half a second that every
    # reader of a checkpoint (this module's full_model_state: `unmask generate`, `eval`,
    # `export`) would pay at start-up though only the trainer shards
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )
    options = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": reshard_after_forward}
    if ignored_params:
        options["ignored_params"] = ignored_params
    # and the modules that declare themselves a unit (`fsdp_unit`: a trained vision tower's
    # layers, models/diffusion_gemma_vision.py), before the root that holds the rest
    own = [m for m in model.modules() if getattr(type(m), "fsdp_unit", False)]
    for block in [*blocks, *(m for m in own if not any(m is b for b in blocks))]:
        fully_shard(block, **options)
    fully_shard(model, **options)
    for module in model.modules():  # per FSDP unit (these setters do not recurse)
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model


def sync_gradients(model: nn.Module, sync: bool) -> None:
    """Reduce-scatter gradients only on the last micro-batch of a step (FSDP2 models)."""
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(sync)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gather the full (unsharded) state dict to CPU; collective, every rank calls it. A
    pipeline stage's model (its `pipeline_group` set) also gathers the other stages'
    entries from its pipeline's ranks: the first one gets the whole model's."""
    # here, not at the top: the readers of checkpoints import this module (see apply_fsdp)
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    group = getattr(model, "pipeline_group", None)
    if group is None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)
    # every stage's first rank needs its entries (get_model_state_dict keeps them on global
    # rank 0 only): each DTensor gathered over its own mesh, in the same order on its ranks
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
             for k, v in model.state_dict().items()}  # fmt: skip
    first = dist.get_rank(group) == 0
    parts: list | None = [None] * dist.get_world_size(group) if first else None
    dist.gather_object(state, parts, group=group, group_dst=0)
    return {k: v for part in parts for k, v in part.items()} if first else state
