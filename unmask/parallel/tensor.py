"""Tensor parallelism (Megatron-style) with DTensor's parallelize_module, of the layers a
family's shape declares (models/shape.py `TensorPlan`; below, the native decoder's).

Each decoder layer's q/k/v and gate/up projections are column-parallel (every tp rank holds
heads / tp of the query and key/value heads, and intermediate / tp of the MLP's columns),
o and down are row-parallel (their outputs are summed over the tp ranks). Attention reshapes
its projections with ``view(B, L, -1, head_dim)``, so the forward runs on the local heads
unchanged. The norms stay replicated on the tp ranks.

The LM head and the embedding are split by vocabulary rows (vocab-parallel, as Megatron's):
the head is column-parallel (its logits, when asked for, are gathered whole), the
embedding row-parallel (each rank looks up the ids it holds, zeros elsewhere, summed over
the ranks), and a tied pair shares the one split matrix. The masked-only loss
(diffusion/loss.py) sees the head's DTensor and computes the cross-entropy on each rank's
vocabulary shard, assembling the log-sum-exp over the tp ranks: no rank holds a logit row
of the whole vocabulary (see docs/parallelism.md for the measurement).

Qwen3's q/k RMSNorm runs per head on a rank's own heads: it gets DTensor's
SequenceParallel over the head dim, so its weight is a replicated DTensor whose gradient
DTensor knows to be a partial sum over the tp ranks (FSDP2 reduces it to the weight's
placement).

A family's plan may keep the embedding and head replicated (`TensorPlan.vocab_parallel`
False) and its routers and expert stacks whole on every tp rank (`replicated_experts`):
DiffusionGemma (models/shape.py `DIFFUSION_GEMMA_TENSOR_PLAN`), whose full-attention layers
have no v_proj (a layer's plan takes the modules it has).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from unmask.errors import InputError
from unmask.models.families import FAMILIES
from unmask.models.shape import WRAPPED, TensorPlan, decoder_layers

if TYPE_CHECKING:
    from unmask.models.build import ResolvedModel
    from unmask.models.config import ModelConfig


def check_tensor_parallel(resolved: ResolvedModel, tp: int, *, lora: bool = False,
                          sequence_parallel: bool = False) -> None:  # fmt: skip
    """One-line InputError when the model cannot be split tp ways (before any process
    group work): wrapped transformers encoders, LoRA or 4-bit models, the full-logits loss
    (with a vocab-parallel head), sequence parallelism of a family that declares no
    sequence-parallel norms, or a degree that does not divide the heads, the key/value heads
    or the MLP width (the plan's `divides`). resolved: the model a run's section resolves
    to (models/build.py `resolve_model`: a pretrained folder's family is checked, not the
    section's model_type)."""
    if tp == 1:
        return
    key = f"parallel.tensor_parallel={tp}"
    section = resolved.section
    if section.pretrained is not None and resolved.shape is WRAPPED:
        raise InputError(
            f"{key} needs a native decoder; model.pretrained {section.pretrained!r} is a "
            "transformers encoder (wrapped HF model): set parallel.tensor_parallel=1"
        )
    shape = resolved.shape
    if shape.tensor is None:
        splittable = [name for name, fam in FAMILIES.items() if fam.shape.tensor is not None]
        what = "is a wrapped HF model" if shape is WRAPPED else "declares no tensor-parallel plan"
        raise InputError(
            f"{key} needs a native decoder, or a family that declares how its layers split "
            f"({', '.join(splittable)}); model.model_type {resolved.family.name!r} {what}: "
            "set parallel.tensor_parallel=1"
        )
    if lora or section.load_in_4bit:
        raise InputError(
            f"{key} does not combine with model.lora / model.load_in_4bit (adapters and "
            "4-bit layers are not split); set parallel.tensor_parallel=1"
        )
    arch, plan = resolved.arch, shape.tensor
    if arch.diffusion_gemma is not None and arch.attention_bias:
        raise InputError(
            f"{key} does not split DiffusionGemma's attention biases (its encoder keeps biases "
            "of its own beside the decoder's); set parallel.tensor_parallel=1 or "
            "model.attention_bias: false"
        )
    if plan.vocab_parallel and section.loss_implementation == "full":
        raise InputError(
            f"{key} splits the LM head by vocabulary, which model.loss_implementation=full "
            "(the whole logits on every rank) does not take; use loss_implementation chunked"
        )
    if sequence_parallel:
        check_sequence_plan(plan, arch.model_type)
    for name in plan.divides:
        value = divided_field(arch, name)
        if value is not None and value % tp:
            raise InputError(
                f"{key} does not divide model.{name}={value}; use a tensor_parallel degree "
                f"that divides it"
            )


def divided_field(arch: ModelConfig, name: str) -> int | None:
    """The value of a `TensorPlan.divides` name: a ModelConfig field, or a sub-section's
    (dotted: ``diffusion_gemma.num_global_key_value_heads``); None where it is unset."""
    value = arch
    for part in name.split("."):
        value = getattr(value, part, None)
    return value


def check_sequence_plan(plan: TensorPlan, model_type: str) -> None:
    """One line when a family's plan declares no norms for sequence parallelism to shard."""
    if not plan.sequence_norms or not plan.vocab_parallel:
        raise InputError(
            f"parallel.sequence_parallel: true: model_type {model_type!r} declares no "
            "sequence-parallel split (models/shape.py TensorPlan); set sequence_parallel: false"
        )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh,
                          layers: list[nn.Module] | None = None, *,
                          vocab_parallel: bool = True,
                          sequence_parallel: bool = False) -> nn.Module:  # fmt: skip
    """Split every decoder layer of a native model over ``tp_mesh`` (1-D), in place
    (``layers``: those of them; a pipeline stage's), and its embedding and LM head by
    vocabulary rows (``vocab_parallel``, where the family's plan allows it; False keeps
    them replicated, the reference the tests compare with). ``sequence_parallel``: the
    norms and the residual stream between the layers sharded over the sequence too
    (`sequence_plan`; needs the vocab-parallel embedding, whose output it scatters)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    # the family's declaration (models/shape.py) of the native decoder built
    tensor = FAMILIES[model.config.model_type].shape.tensor
    if sequence_parallel:
        check_sequence_plan(tensor, model.config.model_type)
    if sequence_parallel and not vocab_parallel:
        raise ValueError("sequence parallelism scatters the vocab-parallel embedding's output")
    vocab_parallel = vocab_parallel and tensor.vocab_parallel
    # each module's hidden-state input enters as one replicated DTensor, so the gradients of
    # the linears that read it (q/k/v, gate/up) are summed locally and all-reduced once per
    # module, not once per projection (4 activation all-reduces per decoder layer, not 7)
    replicated = Replicate()
    plan = {
        name: PrepareModuleInput(
            input_layouts=(replicated, *[None] * (count - 1)),
            desired_input_layouts=(replicated, *[None] * (count - 1)),
            use_local_output=False,
        )
        for name, count in tensor.inputs.items()
    }  # fmt: skip
    plan.update({name: ColwiseParallel() for name in tensor.colwise})
    plan.update({name: RowwiseParallel() for name in tensor.rowwise})
    if sequence_parallel:
        plan.update(sequence_plan(tensor))
    for layer in decoder_layers(model) if layers is None else layers:
        # the modules this layer has (DiffusionGemma's full-attention layers: no v_proj)
        layer_plan = {name: style for name, style in plan.items() if has_module(layer, name)}
        for name in tensor.per_head_norms:  # (B, L, heads, head_dim): the heads are split
            if any(True for _ in layer.get_submodule(name).parameters()):
                layer_plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(layer, tp_mesh, layer_plan)
    if vocab_parallel:
        shard_vocabulary(model, tp_mesh, sequence_parallel)
    if sequence_parallel:
        norm = model.model.norm  # the final norm's output gathered whole for the LM head
        parallelize_module(norm, tp_mesh, SequenceParallel())
        parallelize_module(norm, tp_mesh, PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate()))  # fmt: skip
        model.sequence_parallel = tp_mesh.size()
    return model


def has_module(layer: nn.Module, name: str) -> bool:
    """Whether `layer` has a submodule at the dotted path `name`."""
    try:
        layer.get_submodule(name)
    except AttributeError:
        return False
    return True


def sequence_plan(tensor: TensorPlan) -> dict:
    """Megatron's sequence parallelism in DTensor's styles (as torchtitan's llama plan):
    between the layers the residual stream is each rank's L / N tokens (a plain tensor);
    the norms the family declares (`TensorPlan.sequence_norms`) run on that shard
    (`SequenceParallel`), the modules' hidden-state inputs are all-gathered over the
    sequence (Shard(1) -> Replicate), and the row-parallel linears reduce-scatter their
    partial sums back to the shard (instead of all-reducing them)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    tokens, whole = Shard(1), Replicate()
    plan: dict = {name: SequenceParallel() for name in tensor.sequence_norms}
    for name, count in tensor.inputs.items():
        plan[name] = PrepareModuleInput(
            input_layouts=(tokens, *[None] * (count - 1)),
            desired_input_layouts=(whole, *[None] * (count - 1)),
            use_local_output=False,
        )
    plan.update({name: RowwiseParallel(output_layouts=tokens) for name in tensor.rowwise})
    return plan


def shard_vocabulary(model: nn.Module, tp_mesh: DeviceMesh,
                     sequence_parallel: bool = False) -> None:  # fmt: skip
    """The embedding and LM head (those this module holds: a pipeline stage may hold one or
    neither) split by vocabulary rows over ``tp_mesh``; a tied pair stays one Parameter.
    Under ``sequence_parallel`` the embedding's sum over the ranks is a reduce-scatter
    over the sequence (each rank keeps its L / N tokens)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    tied = embed is not None and head is not None and head.weight is embed.weight
    if embed is not None:  # ids replicated in, the looked-up rows summed over the ranks
        out = Shard(1) if sequence_parallel else Replicate()
        parallelize_module(embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(),
                                                           output_layouts=out))  # fmt: skip
    if head is not None:  # logits (targets None: sampling) gathered whole
        parallelize_module(head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
        if tied:
            head.weight = embed.weight
