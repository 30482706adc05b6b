"""Bytes one rank holds during a training step: the sharded state read from the shards
(shards.py), the activations from a formula of the native decoder's forward.

State (exact, from the shards): parameters at their stored dtype (float32 masters),
gradients of the trainable ones (FSDP2 reduces in float32 into the parameter's dtype, so a
gradient has its parameter's local shape and dtype), optimizer state by the optimizer's
rules (optim/updates.py `state_dtype`: float32, or wider): AdamW keeps exp_avg and
exp_avg_sq like the parameter plus a 0-d float32 step, Muon one momentum buffer like the
parameter.

Activations: what autograd holds saved (save_for_backward) at the end of a micro-batch's
forward, per token of one micro-batch on this rank, layer by layer, as the decoder's modules save it (models/transformer.py,
models/fused.py), with `h` the width, `q` = heads x head_dim / tp, `kv` = K/V heads x
head_dim / tp, `I` = MLP width / tp, `b` the matmul dtype's bytes, `s` the residual
stream's:

  layer:  s h (input_layernorm's input) + s h (post_attention_layernorm's input)
        + b h (the attention's normed input) + b h (the MLP's)
        + b (q + 2 kv) (attention's q, k, v after RoPE) + b q (its output, which o_proj
          reads as a view; under cp a second b q: the heads come back from the all-to-all
          in another layout and o_proj reads a merged copy; likewise under varlen over
          packed rows, which joins the documents' outputs, and under partial rotary,
          whose q and k are rebuilt by a cat, so sdpa's output is in (B, H, L, D) order)
        + b (q + kv) with per-head q/k norms (their inputs)
        + b 3 I (SwiGLU's gate and up, down's input)
        + 4 (2 + heads/tp [+ heads/tp + kv heads/tp]) (RMSNorm statistics, attention's
          log-sum-exp; float32)
        + 4 rotary_dim under bfloat16 (the RoPE tables cast per layer: by FSDP2's input
          cast; 8 rotary_dim under autocast, where q's and k's rotations cast them each)
  and per layer, not per token: rows x L x L x b with `attn_implementation: sdpa` and its
  dense document mask (its copy of the (B, 1, L, L) mask in the attention's dtype; L the
  whole row under cp); nothing with varlen (`auto` on CPU) or flex

Around the layers: the token ids (8 bytes each), the final norm's input and statistics, the
loss's mask of target rows (1 byte; `full_loss_saves` under `model.loss_implementation:
full`) and the
RoPE tables (float32, shared by the layers: saved when a layer multiplies by them in
float32 or takes them as a checkpointed layer's inputs). A checkpointed layer keeps only
its input (s h per token) and, in backward, recomputes one layer's full set at a time. Under autocast over float32 masters (one process, bf16) every linear's
bfloat16 weight copy is kept for backward as well. tests/integration/test_plan_measured.py
holds these equal to the bytes autograd saves in real runs.

An MoE layer saves `moe_mlp_bytes` per token in place of the dense MLP's b 3 I (and,
under bf16 across ranks, autocast's copies of its expert stacks); under a pipeline the
schedule's in-flight micro-batches multiply the saves (`in_flight`), the embedding and the
final norm are on the first and last stage only, and the step's ids are one storage
(`pipeline_saves`).

The LM head computes its gradients in the forward (diffusion/loss.py): a float32 gradient
of the whole head (V x h x 4: the head is replicated over tp and gathered whole by FSDP2)
and of its R rows (R = masked tokens); these are working memory, not saved tensors. Under
`model.loss_implementation: full` it computes none in the forward; the whole logits and
their gradients are working memory instead (`full_loss_working`).

Beyond the saves, the peak walk (`memory_terms`) counts the gathered FSDP2 units, the
activation gradients of each layer's kind (`activation_gradient_bytes`), Muon's step
(`muon_step_bytes`) and a pipeline's receive buffers (`pipeline_buffer_bytes`).
tests/integration/test_plan_measured.py holds the peak within 15% of torch's MemTracker.

A family whose shape declares other blocks (models/shape.py, `activation_formula` False)
gets no formula: `traced_layer_bytes` runs its forward under torch's FakeTensorMode (shapes
and dtypes, no storage, no compute) at the micro-batch's rows and length and counts the
bytes each layer's modules save for backward, as autograd's saved-tensor hooks see them,
at tp = 1 (an upper bound under tensor parallelism, which splits some of them).

This module's walk is the "decoder" memory model (`decoder_memory_terms`); which walk
prices a family's step is its shape's declaration (models/shape.py
`ModelShape.memory_model`), looked up in plan/memory_models.py (`memory_terms`,
`register_memory_model`). A canvas decoder's walk (DiffusionGemma under `uniform`) is
plan/canvas_memory.py; it reads the state, the units and Muon's step from here.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from unittest import mock

import torch

from unmask.diffusion.loss import LOSS_BLOCK, loss_block_rows
from unmask.models.build import _no_init, build_model
from unmask.models.config import ModelConfig
from unmask.models.moe import step_casts
from unmask.models.shape import recomputes
from unmask.optim.muon import NS_BATCH_NUMEL
from unmask.plan.shards import ShardedModel


@dataclass(frozen=True)
class StepShape:
    """One rank's micro-batch and how the step runs."""

    rows: int
    """Rows per micro-batch on this rank."""
    length: int
    """Tokens per row (whole rows; context parallelism splits them by cp)."""
    micro_batches: int
    bf16: bool
    checkpointing: bool | int
    """False, True (every layer) or n (every n-th layer)."""
    masked_fraction: float = 0.5
    """Share of tokens the LM head runs on (MDLM: E[1 - alpha(t)] = 1/2 for t ~ U(0, 1))."""
    loss_block: int = LOSS_BLOCK
    """Logits in a block of the fused loss (diffusion/loss.py `loss_block_elements`: the
    CPU's row_chunk x vocab_chunk, up to 2^28 on a GPU)."""
    reshard_after_forward: bool = True
    dense_mask: bool = False
    """Attention through sdpa with a dense (B, 1, L, L) mask (`attn_implementation: sdpa`;
    `auto` takes varlen on CPU, flex's block mask on GPUs, for packed rows)."""
    varlen: bool = False
    """Attention through varlen over packed rows (one sdpa call per document: `auto` on
    CPU): the documents' outputs are joined into a new tensor that o_proj reads, a second
    b q per token (as under cp, where the all-to-all makes it)."""
    full_loss: bool = False
    """`model.loss_implementation: full`: the LM head's logits for every position over the
    whole vocabulary and torch's cross-entropy (`full_loss_saves`, `full_loss_working`)."""
    ns_bytes: int = 2
    """Bytes of Muon's Newton-Schulz dtype (optim.ns_dtype as the run resolves it)."""
    ns_comm_bytes: int = 2
    """Bytes of the dtype Muon's owner all-to-all sends (float16 NS travels as float32)."""
    canvas: int = 0
    """A canvas decoder's step (models/shape.py `canvas_decoder`: DiffusionGemma under the
    `uniform` objective): its canvas length; 0 for every other family (`canvas_memory_terms`)."""
    self_condition: bool = False
    """The canvas decoder's first decoder pass (diffusion.self_conditioning_prob > 0)."""


@dataclass(frozen=True)
class MemoryTerms:
    """Bytes on one rank; `peak` is the estimate of the most live at once."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    """Saved for backward at the end of the forward (all layers)."""
    working: int
    """What is live at the peak beyond the saved activations (gathered FSDP2 units, a
    recomputed layer, activation and head gradients, unsharded gradients)."""
    peak: int
    experts: int = 0
    """Of parameters, gradients and optimizer state: the expert-parallel stacks' bytes
    (split over parallel.expert_parallel only; FSDP2 leaves them alone)."""
    expert_working: int = 0
    """Of the working buffers, when Muon's step is the peak: its buffers for the
    expert-parallel stacks (split over parallel.expert_parallel too)."""

    def largest(self) -> tuple[str, int]:
        terms = {"parameters": self.parameters, "gradients": self.gradients,
                 "optimizer state": self.optimizer, "activations": self.activations,
                 "working buffers": self.working}  # fmt: skip
        name = max(terms, key=terms.get)
        return name, terms[name]


def state_bytes(model: ShardedModel, experts_only: bool = False) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes of this rank, from its shards (of its
    expert-parallel stacks only when `experts_only`)."""
    params = grads = optim = 0
    for s in model.shards:
        if experts_only and not s.expert_parallel:
            continue
        params += s.local_bytes
        if s.optimizer == "frozen":
            continue
        grads += s.local_bytes
        state = s.local_numel * max(s.dtype.itemsize, 4)  # float32, or the wider dtype
        if s.optimizer == "muon":
            optim += state  # momentum buffer
        else:
            optim += 2 * state + 4  # exp_avg, exp_avg_sq, the step (0-d float32)
    return params, grads, optim


def moe_mlp_bytes(arch, b: int, expert_parallel: bool = False) -> int:
    """Bytes an MoE MLP (models/moe.py SparseMoE) saves per token in place of the dense
    MLP's b 3 I: its k routed copies of the token (gathered, under EP sent to the experts'
    ranks), each one's gate, up and down inputs, and the experts' output back in slot
    order, which the routing weights scale (b k (2 h + 3 I_moe); the weighted slots are
    summed, which saves nothing); the router's scores (4 E: its logits are float32, autocast
    kept off its matmul) and under bf16 the float32 copy of its input that matmul saves
    (4 h); the chosen experts' ids, the rows' token ids and the order the output goes back
    in (24 k); the routing weights of the slots (b k; what group-limited routing saves for
    the choice among groups is freed in the forward with the choice, which no gradient
    reaches); the renormalized weights and their sum (4 k + 4);
    the shared experts' SwiGLU (b 3 I_moe x shared); under expert parallelism (`expert_
    parallel`) the received rows' regrouping order and its inverse (16 k, on the experts'
    ranks)."""
    k, h, experts = arch.num_experts_per_tok, arch.hidden_size, arch.num_experts
    inner = arch.resolved_moe_intermediate_size
    shared = inner * arch.num_shared_experts
    r = 4  # the router's matmul and scores in float32 (models/moe.py float32_region)
    total = b * k * (2 * h + 3 * inner) + r * experts + 24 * k + b * k + b * 3 * shared
    if b == 2:  # x.float() of the bf16 stream, saved by the router's float32 matmul
        total += 4 * h
    if (arch.norm_topk_prob or arch.router_score == "sigmoid") and k > 1:
        total += r * k + r
    if expert_parallel:
        total += 16 * k
    return total


def layer_activation_bytes(arch, rows: int, length: int, tp: int, bf16: bool,
                           stream_bytes: int, autocast_casts: bool,
                           moe: bool = False, expert_parallel: bool = False) -> int:  # fmt: skip
    """Bytes one decoder layer saves over `rows` rows of `length` tokens on this rank
    (module docstring); `length` is this rank's part of a row (L / cp); `moe`: its MLP is
    a mixture of experts (`moe_mlp_bytes`)."""
    tokens = rows * length
    b = 2 if bf16 else 4
    h = arch.hidden_size
    head_dim = arch.resolved_head_dim
    heads = arch.num_attention_heads // tp
    kv_heads = max(arch.num_key_value_heads // tp, 1)
    q, kv = heads * head_dim, kv_heads * head_dim
    inter = arch.intermediate_size // tp
    # the stream is in the matmul dtype (models/transformer.py embed: autocast's under bf16),
    # so q/k/v and gate/up read one saved input each, no copy made by autocast
    per_token = 2 * stream_bytes * h + b * h * 2
    per_token += b * (q + 2 * kv) + b * q  # attention in and out
    per_token += moe_mlp_bytes(arch, b, expert_parallel) if moe else b * 3 * inter  # the MLP
    per_token += 4 * (2 + heads)  # RMSNorm statistics, log-sum-exp
    if arch.qk_norm:
        per_token += b * (q + kv) + 4 * (heads + kv_heads)
    if bf16:  # FSDP2 casts the layer's tables once; autocast's rotary casts them for q, k
        per_token += 2 * 2 * arch.rotary_dim * (2 if autocast_casts else 1)
    return tokens * per_token


@functools.lru_cache(maxsize=32)
def traced_layer_bytes(arch_json: str, rows: int, length: int, bf16: bool,
                       autocast: bool) -> tuple[int, ...]:  # fmt: skip
    """Bytes each layer of the model `arch_json` (a ModelConfig's JSON) saves for backward
    over `rows` rows of `length` tokens: its forward run under FakeTensorMode (no storage)
    with saved-tensor hooks, each saved storage counted once, on the layer that saved it
    first, parameters left out (an MoE layer's too: a family of its own with mixture-of-experts
    layers). bf16: bfloat16 compute, by autocast over float32 weights
    (`autocast`: one process, whose saves include autocast's weight copies) or with the
    weights themselves in bfloat16 (FSDP2's mixed precision)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    arch = ModelConfig.model_validate_json(arch_json)
    with FakeTensorMode(), _no_init():
        model = build_model(arch)
        if bf16 and not autocast:
            model = model.to(torch.bfloat16)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        layers = list(model.model.layers)
        totals = [0] * len(layers)
        seen: set[int] = set()
        current: list[int | None] = [None]

        def enter(index: int):
            return lambda module, args: current.__setitem__(0, index)

        handles = [layer.register_forward_pre_hook(enter(i)) for i, layer in enumerate(layers)]
        handles += [layer.register_forward_hook(lambda *a: current.__setitem__(0, None))
                    for layer in layers]  # fmt: skip

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = t.untyped_storage()._cdata
            if current[0] is not None and key not in params and key not in seen:
                seen.add(key)
                totals[current[0]] += t.untyped_storage().nbytes()
            return t

        cast = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16 and autocast
                else contextlib.nullcontext())  # fmt: skip
        ids = torch.zeros(rows, length, dtype=torch.long)
        # an MoE layer's grouped GEMM as its shapes (`GroupedMatmulShapes`), its expert
        # stacks' copies made once for the step (train/step.py `step_casts`)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast, \
                mock.patch.object(torch, "_grouped_mm", GroupedMatmulShapes.apply), \
                step_casts():  # fmt: skip
            model.hidden_states(ids)
        for handle in handles:
            handle.remove()
    return tuple(totals)


def expert_stack_numel(model: ShardedModel) -> int:
    """Elements of one MoE layer's expert stacks (gate, up, down) this rank computes with."""
    arch = model.model_config
    return local_experts(model) * 3 * arch.resolved_moe_intermediate_size * arch.hidden_size


def local_experts(model: ShardedModel) -> int:
    """Experts of an MoE layer this rank computes (E / ep under expert parallelism)."""
    for s in model.shards:
        if s.name.endswith(("experts.gate_proj", "experts.gate_up_proj")):
            return s.local_shape[0] if s.expert_parallel else s.global_shape[0]
    return 0


def layer_saves(model: ShardedModel, shape: StepShape) -> tuple[list[int], list[int], float]:
    """(bytes each layer keeps through the forward, bytes each layer holds while its
    backward runs, bytes saved around the layers) for one micro-batch on this rank. A
    checkpointed layer keeps its input and holds it plus its recomputed set in backward."""
    arch, layout = model.model_config, model.layout
    length = shape.length // layout.cp
    tokens = shape.rows * length
    sharded = model.layout.world_size > 1
    stream = 2 if shape.bf16 else 4  # the residual stream in the compute dtype everywhere
    casts = shape.bf16 and not sharded  # float32 masters: autocast casts each weight
    # under cp, attention runs on whole rows of heads / cp: the same bytes as L / cp tokens
    # of all heads, but the dense mask is over whole rows
    extra = 0
    if shape.dense_mask:  # sdpa's copy of the mask in the attention's dtype
        extra += shape.rows * shape.length * shape.length * (2 if shape.bf16 else 4)
    # the heads come back from the all-to-all as (B, H, L/cp, D) under cp, the documents'
    # outputs are joined under varlen, or under partial rotary (q and k rebuilt by a cat)
    # sdpa writes its output in (B, H, L, D) order: o_proj
    if layout.cp > 1 or shape.varlen or arch.rotary_dim < arch.resolved_head_dim:
        extra += (
            tokens
            * arch.num_attention_heads
            // layout.tp
            * arch.resolved_head_dim
            * (2 if shape.bf16 else 4)
        )  # reads a merged copy of them
    ep = any(s.expert_parallel for s in model.shards)
    by_kind = {
        moe: extra
        + layer_activation_bytes(
            arch, shape.rows, length, layout.tp, shape.bf16, stream, casts, moe, ep
        )  # fmt: skip
        for moe in (False, True)
    }
    by_kind[True] += 4 * local_experts(model)  # the grouped GEMM's int32 offsets
    if shape.bf16 and sharded:  # the float32 copy of the router's bf16 weight (FSDP2's)
        by_kind[True] += 4 * arch.num_experts * arch.hidden_size
    if shape.bf16 and sharded:  # autocast's bfloat16 copies of the expert stacks (FSDP2
        by_kind[True] += 2 * expert_stack_numel(model)  # leaves them at float32)
    kept_input = tokens * arch.hidden_size * stream
    # autocast's bfloat16 copy of each linear weight of a layer that is not checkpointed
    weight_copies = 2 * model.flops.matmul_params // model.layers if casts else 0
    traced = None
    if not model.shape.activation_formula:  # a family without the decoder's formula
        traced = traced_layer_bytes(arch.model_dump_json(), shape.rows, length, shape.bf16,
                                    autocast=casts)  # fmt: skip
        weight_copies = 0  # the trace saw autocast's copies
    kept, held, any_checkpointed = [], [], False
    for index in model.layer_indices:
        if traced is not None:
            full = traced[index]
        else:
            full = by_kind[bool(arch.num_experts) and arch.is_moe_layer(index)]
        checkpointed = recomputes(shape.checkpointing, index)  # the model's own rule
        kept.append(kept_input if checkpointed else full + weight_copies)
        held.append(kept_input + full if checkpointed else full + weight_copies)
        any_checkpointed |= checkpointed
    around = head_saves(model, shape)
    if model.pipeline is None:  # the ids (a cp slice keeps the whole rows)
        around += shape.rows * shape.length * 8
    if any_checkpointed or not shape.bf16:  # the float32 RoPE tables: a checkpointed
        around += 2 * tokens * arch.rotary_dim * 4  # layer's inputs, or float32's
    return kept, held, around


def head_saves(model: ShardedModel, shape: StepShape) -> float:
    """Bytes saved after the layers on this rank, for one micro-batch, which the head's and
    the final norm's backward free before the layers' backward: the final norm's input and
    statistics and the loss's row mask (or `full_loss_saves`), and for the chunked loss
    (parallel/schedules.py ScheduleSpec.head_loss) what its backward recomputes from; 0 on a pipeline
    rank without the last stage."""
    if not model.holds_head:
        return 0
    arch, layout = model.model_config, model.layout
    tokens = shape.rows * shape.length // layout.cp
    stream = 2 if shape.bf16 else 4
    out = tokens * (arch.hidden_size * stream + 4)
    if shape.full_loss:
        return out + full_loss_saves(model, shape)
    out += tokens  # the target rows' mask (diffusion/loss.py SelectedRows)
    if model.pipeline is not None and model.pipeline.spec.head_loss != "fused":
        # the chunked loss's backward recomputes the logits from the masked rows' hidden
        # states, their targets (int64) and log-sum-exps, and scales by their weights
        # (their expected number, not rounded: the micro-batches in flight multiply it)
        out += tokens * shape.masked_fraction * (arch.hidden_size * stream + 8 + 4 + 4)
    return out


def full_loss_saves(model: ShardedModel, shape: StepShape) -> int:
    """Bytes `model.loss_implementation: full` saves per micro-batch (diffusion/loss.py
    `full_cross_entropy`), over every position of this rank (T of them) and the V ids:
    the head's input in the compute dtype (T h b; under autocast also the head's bfloat16
    copy, V h 2), the float32 log-softmax (T V 4), the targets and the weights (T x (8 +
    4): under a pipeline slices of the step's, in `pipeline_saves`), the cross-entropy's
    0-d total weight."""
    arch, layout = model.model_config, model.layout
    tokens = shape.rows * shape.length // layout.cp
    b = 2 if shape.bf16 else 4
    casts = shape.bf16 and layout.world_size == 1
    out = tokens * (arch.hidden_size * b + arch.vocab_size * 4) + 4
    if casts:
        out += arch.vocab_size * arch.hidden_size * 2
    if model.pipeline is None:
        out += tokens * (8 + 4)
    return out


def full_loss_working(model: ShardedModel, shape: StepShape) -> tuple[int, int]:
    """(forward, backward): what `model.loss_implementation: full` holds beyond its saves
    while it runs, T positions x V ids: the logits in the compute dtype and their float32
    copy (one tensor in float32) as the log-softmax is made; in backward, beside the saved
    log-softmax, the gradients of its output and of its input (float32; the input's copy
    in the compute dtype is made after the other two are freed)."""
    arch, layout = model.model_config, model.layout
    logits = shape.rows * shape.length // layout.cp * arch.vocab_size
    b = 2 if shape.bf16 else 4
    forward = logits * (b + (4 if b < 4 else 0))
    return forward, logits * (4 + 4)


def activation_bytes(model: ShardedModel, shape: StepShape) -> int:
    """Bytes saved for backward at the end of one micro-batch's forward on this rank
    (under a pipeline, beside `pipeline_saves`)."""
    kept, _, around = layer_saves(model, shape)
    return round(sum(kept) + around)


def pipeline_saves(model: ShardedModel, shape: StepShape) -> int:
    """Bytes saved once per step under a pipeline, however many micro-batches are in
    flight: the first stage's embedding saves its micro-batch's slice of the step's ids,
    one storage of every micro-batch's rows (8 bytes a token), and the last stage's loss
    multiplies every micro-batch by one 0-d float32 scale (parallel/pipeline.py). 0
    without a pipeline (the ids are a micro-batch's own, in `layer_saves`)."""
    if model.pipeline is None:
        return 0
    out = 0
    if model.holds_embedding:
        out += shape.micro_batches * shape.rows * shape.length * 8
    if model.holds_head:
        out += 4
        if shape.full_loss:  # the full logits' loss saves the step's targets and weights
            out += shape.micro_batches * shape.rows * shape.length * (8 + 4)
    return out


def loss_block_bytes(model: ShardedModel, shape: StepShape) -> int:
    """The fused loss's block while it runs (diffusion/loss.py `_WeightedCrossEntropy`):
    its rows (the R masked rows, at most `loss_block_rows`) x this rank's V / tp ids of
    float32 logits, and under bf16 their bfloat16 copy the gradient GEMMs read; none under
    `loss_implementation: full`."""
    if shape.full_loss:
        return 0
    arch, layout = model.model_config, model.layout
    masked = int(shape.rows * shape.length // layout.cp * shape.masked_fraction)
    rows = min(masked, loss_block_rows(arch.vocab_size, shape.loss_block))
    return rows * -(-arch.vocab_size // layout.tp) * (6 if shape.bf16 else 4)


def head_gradient_bytes(model: ShardedModel, shape: StepShape) -> int:
    """The LM head's float32 gradients (diffusion/loss.py), made in the forward by the fused
    loss, in the backward by the chunked one (a GPipe last stage, parallel/pipeline.py
    ScheduleSpec.head_loss): the head (V x h; this rank's ceil(V / tp) rows under TP, the vocab-parallel
    head) and the R masked rows' hidden states; none under `loss_implementation: full`."""
    if shape.full_loss:
        return 0
    arch, layout = model.model_config, model.layout
    tokens = shape.rows * shape.length // layout.cp
    masked = int(tokens * shape.masked_fraction)
    return (-(-arch.vocab_size // layout.tp) + masked) * arch.hidden_size * 4


def activation_gradient_bytes(model: ShardedModel, shape: StepShape, moe: bool = False) -> int:
    """Gradients of activations alive at once in one layer's backward, per token of this
    rank, in the matmul dtype: the residual's (h) and, for a dense MLP, its gate, up, their
    product and silu recomputed (4 x I wide); for an MoE MLP (`moe`; models/moe.py,
    parallel/expert.py) the widest of its steps: the k routed copies' (k x max(3 h,
    h + 4 I_moe): the gradient of the expert outputs with the gradients of the rows'
    gather, all-to-all and order, or of gate and up's inputs and their sum; or the expert
    output's gradient beside its SwiGLU's 4 x I_moe), or the shared experts' SwiGLU before
    them (4 x I_shared; autograd runs it first, and frees it)."""
    arch, layout = model.model_config, model.layout
    tokens = shape.rows * shape.length // layout.cp
    b = 2 if shape.bf16 else 4
    h = arch.hidden_size
    if moe:
        k, inner = arch.num_experts_per_tok, arch.resolved_moe_intermediate_size
        width = max(k * max(3 * h, h + 4 * inner), 4 * inner * arch.num_shared_experts)
    else:
        width = 4 * (arch.intermediate_size // layout.tp)
    return tokens * (width + h) * b


def gathered_units(model: ShardedModel, shape: StepShape) -> dict[str, int]:
    """Each FSDP2 unit ("root", "layer N") gathered whole, in the compute dtype: what its
    all-gather holds ({} without sharding; expert-parallel stacks are not gathered)."""
    if model.layout.world_size == 1 or all(s.shard_group == 1 for s in model.shards):
        return {}
    b = 2 if shape.bf16 else 4
    units: dict[str, int] = {}
    for s in model.shards:
        if not s.expert_parallel:  # FSDP2 leaves expert-parallel stacks alone
            units[s.unit] = units.get(s.unit, 0) + s.gathered_numel * b
    return units


def _newton_schulz_bytes(numel: int, count: float, smaller: int, b: int) -> int:
    """Newton-Schulz's temporaries on `count` matrices of `numel` elements in all (optim/
    newton_schulz.py): the normalized X and the next X, and the two `smaller` x `smaller`
    products of each matrix (X X^T and the polynomial), the previous step's still bound as
    the next step's are made, in the NS dtype (b bytes)."""
    return int(b * (2 * numel + 4 * count * smaller * smaller))


def muon_step_bytes(model: ShardedModel, shape: StepShape, experts: bool = True) -> int:
    """Bytes Muon's step holds at its peak beyond the parameters, gradients and optimizer
    state (optim/muon.py, optim/distributed.py), 0 without Muon. bn, bc: the NS and the
    all-to-all dtypes' bytes; M: this rank's elements of the Muon matrices.

    - FSDP2 / TP matrices (the owner all-to-all, one call over all of them): the float32 NS
      inputs (4 M), the sent blocks in bc (cast when bc is not 4, then joined), the owned
      matrices received and assembled (2 bc M_o), their updates (bn M_o), the blocks sent
      back (bc M_o, and a copy of each block of a tall matrix, whose update is a
      transposed view) and received (bc M): the largest of that end and the NS of the
      largest shape group (its copy when several are batched, `_newton_schulz_bytes`).
      M_o, the elements of the matrices this rank owns, is taken as M: the owners are
      balanced by NS FLOPs (exact on one rank);
    - whole matrices on this rank (expert stacks, replicated ones): all their float32 NS
      inputs, the updates as they are made, one stack's NS, then a float32 copy of the
      updates of one shape (`experts` False: without the expert-parallel stacks);
    - one process (plain tensors): per shape, in runs of at most NS_BATCH_NUMEL elements,
      the float32 NS inputs, their batch, the NS, the updates and their float32 copies,
      beside the previous run's float32 updates; the largest run.
    """
    bn, bc = shape.ns_bytes, shape.ns_comm_bytes
    owner: list = []
    local: list = []
    plain: list = []
    for s in model.shards:
        if s.optimizer != "muon" or (s.expert_parallel and not experts):
            continue
        if not s.mesh_dims:
            plain.append(s)
        elif len(s.global_shape) == 3 or all(pl == "R" for pl in s.placements):
            local.append(s)
        else:
            owner.append(s)

    def by_shape(shards) -> dict[tuple, tuple[int, float]]:
        """(rows, cols) -> (this rank's elements, matrices' worth of them)."""
        groups: dict[tuple, tuple[int, float]] = {}
        for s in shards:
            key = tuple(s.global_shape[-2:])
            total, count = groups.get(key, (0, 0.0))
            groups[key] = (total + s.local_numel, count + s.local_numel / (key[0] * key[1]))
        return groups

    peak = 0
    left = 0  # what the owner call leaves referenced while the next layout starts
    if owner:
        m = sum(s.local_numel for s in owner)
        tall = sum(s.local_numel for s in owner if s.global_shape[0] > s.global_shape[1])
        sent = (bc * m if bc != 4 else 0) + bc * m
        base = 4 * m + sent + 2 * bc * m
        end = base + bn * m + bc * m + bc * tall + bc * m + (bn * m if bn != bc else 0)
        ns = max(_newton_schulz_bytes(total, count, min(key), bn)
                 + (bc * total if count > 1 else 0)
                 for key, (total, count) in by_shape(owner).items())  # fmt: skip
        peak = max(end, base + bn * m + ns)
        left = 4 * m + bc * m
    if local:
        m = sum(s.local_numel for s in local)
        groups = by_shape(local)
        ns = max(_newton_schulz_bytes(s.local_numel, s.local_numel / math.prod(s.global_shape[-2:]),
                                      min(s.global_shape[-2:]), bn) for s in local)  # fmt: skip
        apply = 4 * max(total for total, _ in groups.values())
        peak = max(peak, left + 4 * m + bn * m + ns, 4 * m + bn * m + apply)
    buckets: dict[tuple, list] = {}  # one process: by (rows, cols), in parameter order,
    for s in plain:  # cut into runs of at most NS_BATCH_NUMEL elements (optim/muon.py)
        buckets.setdefault(tuple(s.global_shape[-2:]), []).append(s)
    before = 0  # the previous run's float32 updates, referenced until the next are made
    for key, shards in buckets.items():
        for run in _runs([s.local_numel for s in shards], NS_BATCH_NUMEL):
            total, count = sum(run), sum(run) / (key[0] * key[1])
            batch = 4 * total if len(run) > 1 else 0  # the float32 inputs joined
            ns = _newton_schulz_bytes(total, count, min(key), bn)
            updates = bn * total + (4 * total if bn != 4 else 0)  # and their float32 copies
            peak = max(peak, before + 4 * total + batch + ns, before + 4 * total + updates)
            before = 4 * total
    return peak


def _runs(sizes: list[int], most: int) -> list[list[int]]:
    """Consecutive sizes cut into runs of at most `most` in all (one size at least), as
    MuonAdamW batches same-shape matrices."""
    runs: list[list[int]] = [[]]
    for size in sizes:
        if runs[-1] and sum(runs[-1]) + size > most:
            runs.append([])
        runs[-1].append(size)
    return runs if runs[-1] else []


def pipeline_buffer_bytes(model: ShardedModel, shape: StepShape) -> int:
    """Bytes of the pipeline schedule's receive buffers on this rank beyond the saved
    activations (torch.distributed.pipelining's stages make one per micro-batch in the
    first step and keep them): every stage but the first receives each micro-batch's
    hidden states (those of the micro-batches in flight are saved by its first layer, so
    counted there), every stage but the last their gradients; rows x length x h in the
    residual stream's dtype each. 0 without a pipeline."""
    plan = model.pipeline
    if plan is None:
        return 0
    sharded = model.layout.world_size > 1
    one = shape.rows * shape.length // model.layout.cp * model.model_config.hidden_size
    one *= 2 if (shape.bf16 and sharded) else 4
    held = model.stages
    receiving = sum(1 for stage in held if stage > 0)
    sending = sum(1 for stage in held if stage < plan.num_stages - 1)
    hidden = receiving * (shape.micro_batches - in_flight(model))
    return int(one * (hidden + sending * shape.micro_batches))


def in_flight(model: ShardedModel) -> float:
    """Micro-batches whose saved activations are live at once on this rank, in units of
    one micro-batch through all of its layers: 1 without a pipeline; under one (m
    micro-batches, p ranks, v stages per rank, this rank r) the schedule's warm-up depth:
    GPipe runs every forward first (m), 1F1B min(m, p - r), the interleaved schedules
    min(m v, (v - 1) p + 2 (p - 1 - r) + 1) stage-micro-batches of 1/v of the rank's
    layers each (torch.distributed.pipelining's warm-up counts)."""
    plan = model.pipeline
    if plan is None:
        return 1.0
    return plan.spec.in_flight(plan.microbatches, plan.degree, plan.stages_per_rank, model.pp_rank)


def decoder_memory_terms(model: ShardedModel, shape: StepShape) -> MemoryTerms:
    """Every term of this rank and the peak estimate, in a step after the first (the
    optimizer state exists). The peak is the most live at any point of a walk through the
    step, on top of the parameters and the optimizer state:

    - the forward's end: every saved activation, the head's gradients, the root gathered
      (under `loss_implementation: full` and the loss's logits, `full_loss_working`);
    - the backward of layer i (last to first): what layers below i saved, what layer i
      holds (recomputed when checkpointed), the activation gradients, the root gathered
      with its unsharded gradient (the head's, made first, reduced last), this layer
      gathered with its unsharded float32 gradient and the gradients of its expert stacks,
      the next layer (i - 1) gathered ahead (FSDP2's prefetch), the sharded gradients of
      the layers above i; the activation gradients are the layer's kind's (dense or MoE);
    - the optimizer step: every gradient and Muon's working buffers (`muon_step_bytes`).

    Under a pipeline the schedule's receive buffers are live throughout
    (`pipeline_buffer_bytes`).

    Without FSDP2 the gradients go straight to the parameters' .grad (float32). Under
    gradient accumulation FSDP2 keeps every unit's unsharded float32 gradient until the
    last micro-batch's reduce-scatter. Under a pipeline the micro-batches are the
    schedule's, `in_flight` of them hold their saved activations at the peak, and only the
    rank that holds the last stage computes the head.
    """
    params, grads, optim = state_bytes(model)
    kept, held, around = layer_saves(model, shape)
    one = sum(kept) + around
    # other micro-batches' saves, and the step's own (the ids' storage, the loss scale)
    waiting = int((in_flight(model) - 1) * one) + pipeline_saves(model, shape)
    saved = one + waiting
    # the head's gradients: one micro-batch's at a time. The fused loss makes them in the
    # forward, and on a pipeline's last stage (1F1B, interleaved 1F1B, zero bubble) that
    # micro-batch's backward runs next and takes them (tests/unit/test_pipeline_plan.py
    # checks torch's orders); GPipe's chunked loss makes them in the backward
    head = head_gradient_bytes(model, shape) if model.holds_head else 0
    head += loss_block_bytes(model, shape) if model.holds_head else 0  # made with them
    arch = model.model_config
    names = [f"layer {index}" for index in model.layer_indices]
    act_grads = [activation_gradient_bytes(model, shape, moe=bool(arch.num_experts)
                                           and arch.is_moe_layer(index))
                 for index in model.layer_indices]  # fmt: skip
    gathered = gathered_units(model, shape)
    root = gathered.pop("root", 0)
    fsdp = bool(gathered)
    b = 2 if shape.bf16 else 4
    layer_grad = grad_bytes_by_unit(model)
    expert_grad = grad_bytes_by_unit(model, experts_only=True)
    accumulated = 0
    if shape.micro_batches > 1 and fsdp:
        accumulated = (sum(gathered.values()) + root) // b * 4
    buffers = pipeline_buffer_bytes(model, shape)
    forward_end = waiting + one + head + root + accumulated + buffers
    if shape.full_loss and model.holds_head:  # the whole logits as the loss is made; in
        # its backward the root gathered again and the last layer prefetched
        forward, backward = full_loss_working(model, shape)
        last = gathered.get(names[-1], 0) if names else 0
        forward_end = max(forward_end + forward, forward_end + backward + last)
    layers_around = around - head_saves(model, shape)  # what the layers' backward still sees
    worst_backward = 0
    for i in range(model.layers - 1, -1, -1):
        below = sum(kept[:i]) + layers_around + waiting
        above = sum(layer_grad.get(name, 0) for name in names[i + 1 :])
        if fsdp:  # this layer gathered, its unsharded float32 gradient (under
            # accumulation that is `accumulated`'s, as the root's: in bfloat16 the layer's
            # gradients are made first, then added into it), its expert stacks' gradients
            # (outside FSDP2), the next layer (i - 1) prefetched
            this = gathered.get(names[i], 0)
            prefetched = gathered.get(names[i - 1], 0) if i > 0 else 0
            fresh = (this if b < 4 else 0) if accumulated else this // b * 4
            live = below + held[i] + act_grads[i] + root + (0 if accumulated else root)
            live += this + prefetched + fresh + expert_grad.get(names[i], 0) + above
            live += accumulated
        else:  # .grad of the head (the root's, first) and of every layer done so far
            live = below + held[i] + act_grads[i] + layer_grad.get("root", 0) + above
            live += layer_grad.get(names[i], 0)
        worst_backward = max(worst_backward, live + buffers)
    muon = muon_step_bytes(model, shape)
    optimizer_step = grads + muon + buffers
    live_peak = max(forward_end, worst_backward, optimizer_step)
    working = live_peak - min(saved, live_peak) if live_peak > saved else 0
    peak = params + optim + live_peak
    experts = sum(state_bytes(model, experts_only=True))
    expert_working = 0
    if optimizer_step == live_peak:  # Muon's buffers for the expert stacks shrink with ep
        expert_working = muon - muon_step_bytes(model, shape, experts=False)
    return MemoryTerms(params, grads, optim, round(saved), round(working), round(peak), experts,
                       expert_working)  # fmt: skip


def grad_bytes_by_unit(model: ShardedModel, experts_only: bool = False) -> dict[str, int]:
    """Sharded gradient bytes of each FSDP2 unit (root, layer N) on this rank (of its
    expert-parallel stacks only when `experts_only`)."""
    out: dict[str, int] = {}
    for s in model.shards:
        if experts_only and not s.expert_parallel:
            continue
        if s.optimizer != "frozen":
            out[s.unit] = out.get(s.unit, 0) + s.local_bytes
    return out


class GroupedMatmulShapes(torch.autograd.Function):
    """torch._grouped_mm(a (M, K), b (E, K, N), offs) as the trace sees it: an (M, N) output
    of a's dtype, a, b and the offsets saved for backward (what the op's autograd saves).
    torch's meta kernel takes bfloat16 only (its CUDA check), where the CPU runs float32
    too."""

    @staticmethod
    def forward(ctx, a, b, offs=None):
        ctx.save_for_backward(a, b, offs)
        return a.new_empty((a.shape[0], b.shape[-1]))

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the trace runs no backward
        raise RuntimeError("a shape-only stand-in for the planner's forward trace")
