"""Wrap a model for FSDP2: activation checkpointing, then optional per-block torch.compile,
then fully_shard per block and root.

Activation checkpointing is the model's own ``gradient_checkpointing`` flag (applied inside
its forward, per decoder layer), so it composes with FSDP2 without wrappers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks (``model.model.layers``), or none for other models."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return list(layers) if layers is not None else []


def compile_blocks(model: nn.Module) -> int:
    """torch.compile each transformer block in place (one graph per block, reused by every
    layer of the same shape); returns how many blocks were compiled. Per-block rather than
    whole-model compilation keeps compile time flat in depth and composes with FSDP2."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    bf16: bool = False,
    reshard_after_forward: bool = True,
    gradient_checkpointing: bool = False,
    torch_compile: bool = False,
) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` (1-D: FSDP2; 2-D replicate x shard: HSDP).

    Each decoder layer (``model.model.layers``) is one FSDP unit, the root holds the
    embedding, final norm and head. ``bf16``: parameters are cast to bfloat16 for compute,
    gradients are reduced in float32 (the sharded master weights stay float32).
    ``reshard_after_forward``: True frees each layer's gathered weights after its forward
    (ZeRO-3-like, least memory); False keeps them until backward (ZeRO-2-like, one
    all-gather fewer per layer). Gradients are summed over ranks (no averaging): the
    trainer normalizes by the global token count itself.
    """
    if gradient_checkpointing:
        model.gradient_checkpointing = True
    if torch_compile:
        compile_blocks(model)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    for module in model.modules():  # per FSDP unit (these setters do not recurse)
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
    return model
