"""Tensor parallelism (Megatron-style) of the native decoder with DTensor's parallelize_module.

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
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from unmask.errors import InputError
from unmask.models.build import is_encoder_folder
from unmask.models.config import ModelConfig
from unmask.models.families import FAMILIES, native_families
from unmask.models.hf import architecture

#: Column-parallel (output features split) and row-parallel (input features split) linears.
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
           "mlp.up_proj")  # fmt: skip
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
#: Per-head norms whose weights see only a rank's own heads.
PER_HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


def check_tensor_parallel(model: ModelConfig, tp: int, *, lora: bool = False) -> None:
    """One-line InputError when the model cannot be split tp ways (before any process
    group work): wrapped transformers encoders, LoRA or 4-bit models, the full-logits loss,
    or a degree that does not divide the heads, the key/value heads or the MLP width."""
    if tp == 1:
        return
    key = f"train.tensor_parallel={tp}"
    if model.pretrained is not None and is_encoder_folder(model.pretrained):
        raise InputError(
            f"{key} needs a native decoder; model.pretrained {model.pretrained!r} is a "
            "transformers encoder (wrapped HF model): set train.tensor_parallel=1"
        )
    if not FAMILIES[model.model_type].native:
        raise InputError(
            f"{key} needs a native decoder ({', '.join(native_families())}); "
            f"model.model_type {model.model_type!r} is a wrapped HF model: set "
            "train.tensor_parallel=1"
        )
    if lora or model.load_in_4bit:
        raise InputError(
            f"{key} does not combine with model.lora / model.load_in_4bit (adapters and "
            "4-bit layers are not split); set train.tensor_parallel=1"
        )
    if model.loss_implementation == "full":
        raise InputError(
            f"{key} splits the LM head by vocabulary, which model.loss_implementation=full "
            "(the whole logits on every rank) does not take; use loss_implementation chunked"
        )
    arch = architecture(model)
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(arch, name)
        if value % tp:
            raise InputError(
                f"{key} does not divide model.{name}={value}; use a tensor_parallel degree "
                f"that divides it"
            )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh,
                          layers: list[nn.Module] | None = None, *,
                          vocab_parallel: bool = True,
                          sequence_parallel: bool = False) -> nn.Module:  # fmt: skip
    """Split every decoder layer of a native model over ``tp_mesh`` (1-D), in place
    (``layers``: those of them; a pipeline stage's), and its embedding and LM head by
    vocabulary rows (``vocab_parallel``; False keeps them replicated, the reference the
    tests compare with). ``sequence_parallel``: the norms and the residual stream between
    the layers sharded over the sequence too (`sequence_plan`; needs the vocab-parallel
    embedding, whose output it scatters)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if sequence_parallel and not vocab_parallel:
        raise ValueError("sequence parallelism scatters the vocab-parallel embedding's output")
    # the attention and MLP inputs enter as one replicated DTensor, so the gradients of the
    # q/k/v (gate/up) inputs are summed locally and all-reduced once per module, not once
    # per projection (4 activation all-reduces per layer instead of 7)
    replicated = Replicate()
    plan = {
        "self_attn": PrepareModuleInput(
            input_layouts=(replicated, None, None, None, None),
            desired_input_layouts=(replicated, None, None, None, None),
            use_local_output=False,
        ),
        "mlp": PrepareModuleInput(
            input_layouts=(replicated,), desired_input_layouts=(replicated,),
            use_local_output=False,
        ),
    }  # fmt: skip
    plan.update({name: ColwiseParallel() for name in COLWISE})
    plan.update({name: RowwiseParallel() for name in ROWWISE})
    if sequence_parallel:
        plan.update(sequence_plan())
    for layer in model.model.layers if layers is None else layers:
        layer_plan = dict(plan)
        for name in PER_HEAD_NORMS:  # (B, L, heads, head_dim): the heads are split
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


def sequence_plan() -> dict:
    """Megatron's sequence parallelism in DTensor's styles (as torchtitan's llama plan):
    between the layers the residual stream is each rank's L / N tokens (a plain tensor);
    the pre-attention and pre-MLP norms run on that shard (`SequenceParallel`), the
    attention and MLP inputs are all-gathered over the sequence (Shard(1) -> Replicate),
    and the o and down projections reduce-scatter their partial sums back to the shard
    (instead of all-reducing them)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    tokens, whole = Shard(1), Replicate()
    return {
        "input_layernorm": SequenceParallel(),
        "post_attention_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_layouts=(tokens, None, None, None, None),
            desired_input_layouts=(whole, None, None, None, None),
            use_local_output=False,
        ),
        "mlp": PrepareModuleInput(
            input_layouts=(tokens,), desired_input_layouts=(whole,), use_local_output=False,
        ),
        "self_attn.o_proj": RowwiseParallel(output_layouts=tokens),
        "mlp.down_proj": RowwiseParallel(output_layouts=tokens),
    }  # fmt: skip


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
