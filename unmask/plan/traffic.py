"""Bytes each collective of a training step moves, per mesh dimension, and whether its group
stays inside a node.

One entry (`Collective`) per collective kind and mesh dim. `tensor_bytes` is the size of
the collective's buffers over a step on one rank (an all-gather's output, a
reduce-scatter's input, an all-reduce's tensor, an all-to-all's send buffer), what one
counts from the tensors handed to torch.distributed; `wire_bytes` is what a rank sends
over its links with ring / pairwise algorithms: (g - 1)/g of it for all-gather,
reduce-scatter and all-to-all, 2 (g - 1)/g for all-reduce (g: the group's size).

Where each dimension's collectives come from:
- FSDP2 (dp_shard x cp, the `dp_shard_cp` mesh): each unit's parameters (the root's too:
  parallel/fsdp.py passes `reshard_after_forward` explicitly) are all-gathered in the
  compute dtype before its forward and again before its backward when
  `reshard_after_forward`, on every micro-batch; gradients are reduce-scattered in float32
  once per step (parallel/fsdp.py `sync_gradients`: only on the last micro-batch).
- HSDP (dp_replicate): the sharded gradients all-reduced in float32 once per step.
- TP (tp): two activation all-reduces per layer forward (o_proj, down_proj outputs), two
  in backward (attention's and the MLP's input gradients; parallel/tensor.py), two more
  when a checkpointed layer recomputes its forward.
- CP (cp): parallel/context.py's all-to-alls (`alltoall_bytes`) around every attention,
  forward, backward and recomputation, and one all-gather of the rows' doc ids per forward.
- Muon (optim/distributed.py): two all-to-alls per step over the ranks that split a
  matrix (dp_shard_cp, x tp under TP), each carrying this rank's block of every Muon matrix
  in the Newton-Schulz dtype (rows under FSDP2; under TP the tp split's rows or columns as
  they are, no redistribute into rows: nothing else is sent). The send buffer of the
  updates' trip back holds the owned matrices' blocks for every rank; the plan counts this
  rank's own blocks for it, the same on average over the ranks.

- EP (ep, ep_replica; parallel/expert.py): per MoE layer and pass the counts and the
  routed rows' dispatch and combine all-to-alls over `ep`, and once per step the replicas'
  float32 expert-gradient all-reduce over `ep_replica` (`expert_collectives`).
- PP (pp; parallel/pipeline.py): each stage's hidden states sent to the next stage's rank
  and their gradients back, per micro-batch of the schedule (`pipeline_collectives`).

Scalars (the loss count all-reduce, the gradient-norm all-reduces, MoE balancing's load
sums) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from unmask.models.shape import recomputes
from unmask.parallel.context import alltoall_bytes
from unmask.plan.memory import StepShape
from unmask.plan.shards import ShardedModel


@dataclass(frozen=True)
class Collective:
    """One kind of collective over one mesh dim, summed over a step on one rank."""

    dim: str
    kind: str
    what: str
    calls: int
    tensor_bytes: int
    group: int
    intra_node: bool

    @property
    def wire_bytes(self) -> int:
        if self.kind == "send/recv":  # point to point: what is sent crosses the link
            return self.tensor_bytes
        share = (self.group - 1) / self.group
        factor = 2 * share if self.kind == "all-reduce" else share
        return int(self.tensor_bytes * factor)


def step_collectives(model: ShardedModel, shape: StepShape, nodes: int,
                     ns_bytes: int = 2) -> list[Collective]:  # fmt: skip
    """Every collective of one optimizer step on this rank (module docstring), by mesh dim."""
    layout = model.layout
    if layout.world_size == 1:
        return []
    out: list[Collective] = []
    b = 2 if shape.bf16 else 4
    arch = model.model_config
    micro = shape.micro_batches
    fsdp_dims = ("dp_shard", "cp")
    fsdp_group = layout.dp_shard * layout.cp
    if fsdp_group > 1:
        units: dict[str, int] = {}
        for s in model.shards:
            if not s.expert_parallel:  # FSDP2's ignored_params: never gathered
                units[s.unit] = units.get(s.unit, 0) + s.gathered_numel
        # every unit, the root too (apply_fsdp passes reshard_after_forward explicitly, so
        # FSDP2's "root stays gathered" default does not apply): gathered for the forward,
        # and again for the backward when resharded after forward
        gathers_per_unit = 2 if shape.reshard_after_forward else 1
        gathers = gathers_per_unit * sum(units.values())
        calls = micro * gathers_per_unit * len(units)
        scatters, scattered = len(units), sum(units.values())
        if shape.canvas:  # a canvas decoder's layers run once per pass (`canvas_passes`)
            gathers, calls, scatters, scattered = _canvas_fsdp(model, shape, units)
        intra = layout.intra_node(fsdp_dims, nodes)
        out.append(Collective("dp_shard_cp", "all-gather", "FSDP2 parameters", calls,
                              micro * gathers * b, fsdp_group, intra))  # fmt: skip
        out.append(Collective("dp_shard_cp", "reduce-scatter", "FSDP2 gradients (float32)",
                              scatters, scattered * 4, fsdp_group, intra))  # fmt: skip
    if layout.dp_replicate > 1:
        grads = sum(s.local_numel for s in model.shards if s.optimizer != "frozen") * 4
        out.append(Collective("dp_replicate", "all-reduce", "HSDP gradients (float32)", 1,
                              grads, layout.dp_replicate,
                              layout.intra_node(("dp_replicate",), nodes)))  # fmt: skip
    tokens = shape.rows * shape.length // layout.cp
    recomputed = _checkpointed_layers(model, shape.checkpointing)
    if layout.tp > 1:
        calls = micro * (4 * model.layers + 2 * recomputed)
        size = calls * tokens * arch.hidden_size * b
        # the vocab-parallel embedding's output, and the vocab-parallel loss (diffusion/
        # loss.py, weighted): per block of masked rows a max and a (exp-sum, target logit)
        # all-reduce, then the masked rows' hidden-state gradient, in float32
        masked = int(tokens * shape.masked_fraction)
        blocks = -(-masked // max(1, 4096 * 8192 // arch.vocab_size)) if masked else 0
        calls += micro * (1 + 2 * blocks + (1 if masked else 0))
        size += micro * (tokens * arch.hidden_size * b + masked * (3 + arch.hidden_size) * 4)
        out.append(Collective("tp", "all-reduce",
                              "TP activations (o_proj, down_proj, embedding), vocab-parallel loss",
                              calls, size, layout.tp,
                              layout.intra_node(("tp",), nodes)))  # fmt: skip
    if layout.cp > 1:
        heads, kv = arch.num_attention_heads // layout.tp, arch.num_key_value_heads // layout.tp
        whole = shape.rows * shape.length
        sent = alltoall_bytes(whole, heads, max(kv, 1), arch.resolved_head_dim,
                              model.layers, layout.cp, b)  # fmt: skip
        recompute_sent = alltoall_bytes(whole, heads, max(kv, 1), arch.resolved_head_dim,
                                        recomputed, layout.cp, b, backward=False)  # fmt: skip
        total = (sent + recompute_sent) * layout.cp // (layout.cp - 1)
        calls = micro * 4 * (2 * model.layers + recomputed)  # q, k, v, out per pass
        intra = layout.intra_node(("cp",), nodes)
        out.append(Collective("cp", "all-to-all", "CP q, k, v and attention output", calls,
                              micro * total, layout.cp, intra))  # fmt: skip
        out.append(Collective("cp", "all-gather", "CP doc ids", micro,
                              micro * shape.rows * shape.length * 8, layout.cp, intra))  # fmt: skip
    out += expert_collectives(model, shape, nodes)
    out += pipeline_collectives(model, shape, nodes)
    # Muon's owner all-to-all moves 2-D matrices; 3-D expert stacks are split on the
    # expert dim and orthogonalized where they are (optim/distributed.py)
    muon = sum(s.local_numel for s in model.shards
               if s.optimizer == "muon" and len(s.global_shape) == 2)  # fmt: skip
    owner_dims = ("dp_shard", "cp", "tp") if layout.tp > 1 else fsdp_dims
    owner_group = fsdp_group * (layout.tp if layout.tp > 1 else 1)
    if muon and owner_group > 1:
        out.append(Collective("+".join(d for d in ("dp_shard_cp", "tp") if d != "tp" or
                                       layout.tp > 1), "all-to-all",
                              "Muon NS inputs and updates", 2, 2 * muon * ns_bytes,
                              owner_group, layout.intra_node(owner_dims, nodes)))  # fmt: skip
    return out


def pipeline_collectives(model: ShardedModel, shape: StepShape,
                         nodes: int) -> list[Collective]:  # fmt: skip
    """The pipeline's point-to-point traffic (parallel/pipeline.py): per micro-batch each
    stage but the last sends its hidden states (rows x length x h, in the compute dtype) to
    the next stage's rank, and each stage but the first sends their gradient back; counted
    on the sending rank."""
    plan = model.pipeline
    if plan is None:
        return []
    last = plan.num_stages - 1
    sends = sum((stage < last) + (stage > 0) for stage in model.stages)
    if not sends:
        return []
    b = 2 if shape.bf16 else 4
    hidden = shape.rows * shape.length * model.model_config.hidden_size * b
    calls = plan.microbatches * sends
    return [Collective("pp", "send/recv", "PP hidden states and their gradients", calls,
                       calls * hidden, 2, model.layout.intra_node(("pp",), nodes))]  # fmt: skip


def moe_layers(model: ShardedModel) -> int:
    """MoE layers among the decoder layers this rank holds."""
    arch = model.model_config
    if not arch.num_experts:
        return 0
    return sum(1 for i in model.layer_indices if arch.is_moe_layer(i))


def expert_collectives(model: ShardedModel, shape: StepShape,
                       nodes: int) -> list[Collective]:  # fmt: skip
    """Expert parallelism's collectives (parallel/expert.py): per MoE layer and pass, the
    per-expert counts (E int64) and the routed rows there and their outputs back (tokens x
    k x h each, in the compute dtype: the forward runs under autocast with train.bf16, so
    the expert stacks FSDP2 leaves alone are cast too); the backward
    sends their gradients the other way; a checkpointed layer's recomputation repeats the
    forward's. Under balanced routing each rank receives what it sends (so a rank's own
    bytes vary with the routing; their sum over the ranks is exact). Once per step the
    replicas' partial expert gradients are all-reduced over ep_replica (float32 masters)."""
    layout = model.layout
    experts = [s for s in model.shards if s.expert_parallel]
    if not experts:
        return []
    arch = model.model_config
    ep = _grid_size(experts[0])
    replicas = layout.dp * layout.cp // ep
    b = 2 if shape.bf16 else 4
    width = arch.num_experts_per_tok * arch.hidden_size
    counts = arch.num_experts * 8
    if shape.canvas:  # each pass of the shared stack routes its own tokens
        passes = canvas_passes(model, shape)
    else:
        layers = moe_layers(model)
        recomputed_moe = _checkpointed_moe_layers(model, shape.checkpointing)
        tokens = shape.rows * shape.length // layout.cp
        passes = [(tokens, layers + recomputed_moe, False), (tokens, layers, None)]
    # (tokens, MoE layers, backward): a forward (False) or a backward (None) of each
    per_step = calls = 0
    for tokens, layers, _ in passes:
        per_step += layers * tokens * width * 2 * b
        calls += layers * 2
    for _, layers, kind in passes:
        if kind is False:  # a forward also sends the counts first
            per_step += layers * counts
            calls += layers
    per_step *= shape.micro_batches
    calls *= shape.micro_batches
    # the trainer's rank order (parallel/dims.py `ParallelDims.expert_dims`)
    out = [Collective("ep", "all-to-all", "EP token dispatch and combine (+ counts)", calls,
                      per_step, ep, layout.intra_node(("ep",), nodes))]  # fmt: skip
    if replicas > 1:
        grads = sum(s.local_numel for s in experts if s.optimizer != "frozen") * 4
        out.append(Collective("ep_replica", "all-reduce", "EP expert gradients (float32)", 1,
                              grads, replicas,
                              layout.intra_node(("ep_replica",), nodes)))  # fmt: skip
    return out


def canvas_passes(model: ShardedModel, shape: StepShape) -> list[tuple[int, int, bool | None]]:
    """A canvas decoder's MoE passes over one micro-batch on this rank as (tokens, MoE
    layers, False for a forward / None for a backward): its shape's `passes` (the encoder
    over the row, the first decoder pass without gradients, the decoder with them), each
    with gradients run backward too."""
    arch = model.model_config
    out: list[tuple[int, int, bool | None]] = []
    for length, layers, grad in model.shape.passes(arch, shape.length, shape.self_condition):
        out.append((shape.rows * length, layers, False))
        if grad:
            out.append((shape.rows * length, layers, None))
    return out


def _canvas_fsdp(model: ShardedModel, shape: StepShape,
                 units: dict[str, int]) -> tuple[int, int, int, int]:  # fmt: skip
    """(elements gathered, all-gather calls, reduce-scatter calls, elements reduce-scattered)
    of a canvas decoder's step: each layer gathered before each pass's use of it (the
    encoder's, the first decoder pass's, the second's) and again before each backward use
    when resharded after forward (else gathered once in the forward and again before each
    backward use but the first: FSDP2's post-backward reshards after every backward use),
    and reduce-scattered after each backward use
    (the encoder's and the decoder's: FSDP2's post-backward runs once per use); the root
    as any unit's."""
    arch = model.model_config
    passes = model.shape.passes(arch, shape.length, shape.self_condition)
    uses = len(passes)
    backward = sum(1 for *_, grad in passes if grad)
    per_layer = uses + backward if shape.reshard_after_forward else max(backward, 1)
    per_root = 2 if shape.reshard_after_forward else 1
    root = units.get("root", 0)
    layers = sum(units.values()) - root
    count = len(units) - (1 if "root" in units else 0)
    gathers = per_layer * layers + per_root * root
    calls = shape.micro_batches * (per_layer * count + per_root * ("root" in units))
    return gathers, calls, backward * count + ("root" in units), backward * layers + root


def _grid_size(shard) -> int:
    """The ep size of an expert stack: its global expert count over its local one."""
    return shard.global_shape[0] // shard.local_shape[0]


def _checkpointed_moe_layers(model: ShardedModel, flag: bool | int) -> int:
    """MoE layers this rank recomputes in backward (activation checkpointing)."""
    arch = model.model_config
    return sum(1 for index in model.layer_indices
               if arch.is_moe_layer(index) and recomputes(flag, index))  # fmt: skip


def _checkpointed_layers(model: ShardedModel, flag: bool | int) -> int:
    """Decoder layers this rank recomputes in backward (the model's rule, by global index)."""
    return sum(1 for index in model.layer_indices if recomputes(flag, index))
