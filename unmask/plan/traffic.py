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
  matrix (dp_shard_cp, x tp under TP), each carrying this rank's rows of every Muon matrix
  in the Newton-Schulz dtype.

Scalars (the loss count all-reduce, the gradient-norm all-reduces) are left out.

Hooks for the dimensions to come: expert parallelism adds a row for the token dispatch and
combine all-to-alls over `ep` (2 per MoE layer forward, 2 backward, tokens x top-k x h x b
each) in `step_collectives`; pipeline parallelism adds the stage-boundary send/recv over
`pp` (micro-batches x rows x length x h x b per boundary, forward and backward).
"""

from __future__ import annotations

from dataclasses import dataclass

from unmask.parallel.context import alltoall_bytes
from unmask.parallel.mesh import MESH_DIMS, MeshLayout
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
        share = (self.group - 1) / self.group
        factor = 2 * share if self.kind == "all-reduce" else share
        return int(self.tensor_bytes * factor)


def group_span(layout: MeshLayout, dims: tuple[str, ...]) -> int:
    """How many consecutive ranks a group over `dims` spans in the row-major world mesh
    (pp, dp_replicate, dp_shard, cp, tp: tp innermost): stride of its innermost dim x sizes."""
    sizes = {name: getattr(layout, name) for name in MESH_DIMS}
    inner = MESH_DIMS.index(max(dims, key=MESH_DIMS.index))
    stride = 1
    for name in MESH_DIMS[inner + 1 :]:
        stride *= sizes[name]
    span = stride
    for name in dims:
        span *= sizes[name]
    return span


def is_intra_node(layout: MeshLayout, dims: tuple[str, ...], nodes: int) -> bool:
    """True when every group over `dims` lies inside one node (ranks placed node by node:
    world / nodes consecutive ranks per node)."""
    per_node = layout.world_size // nodes
    span = group_span(layout, dims)
    return span <= per_node and per_node % span == 0


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
            units[s.unit] = units.get(s.unit, 0) + s.gathered_numel
        # every unit, the root too (apply_fsdp passes reshard_after_forward explicitly, so
        # FSDP2's "root stays gathered" default does not apply): gathered for the forward,
        # and again for the backward when resharded after forward
        gathers_per_unit = 2 if shape.reshard_after_forward else 1
        gathers = gathers_per_unit * sum(units.values())
        calls = micro * gathers_per_unit * len(units)
        intra = is_intra_node(layout, fsdp_dims, nodes)
        out.append(Collective("dp_shard_cp", "all-gather", "FSDP2 parameters", calls,
                              micro * gathers * b, fsdp_group, intra))  # fmt: skip
        out.append(Collective("dp_shard_cp", "reduce-scatter", "FSDP2 gradients (float32)",
                              len(units), sum(units.values()) * 4, fsdp_group, intra))  # fmt: skip
    if layout.dp_replicate > 1:
        grads = sum(s.local_numel for s in model.shards if s.optimizer != "frozen") * 4
        out.append(Collective("dp_replicate", "all-reduce", "HSDP gradients (float32)", 1,
                              grads, layout.dp_replicate,
                              is_intra_node(layout, ("dp_replicate",), nodes)))  # fmt: skip
    tokens = shape.rows * shape.length // layout.cp
    recomputed = _checkpointed_layers(model.layers, shape.checkpointing)
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
                              is_intra_node(layout, ("tp",), nodes)))  # fmt: skip
    if layout.cp > 1:
        heads, kv = arch.num_attention_heads // layout.tp, arch.num_key_value_heads // layout.tp
        whole = shape.rows * shape.length
        sent = alltoall_bytes(whole, heads, max(kv, 1), arch.resolved_head_dim,
                              model.layers, layout.cp, b)  # fmt: skip
        recompute_sent = alltoall_bytes(whole, heads, max(kv, 1), arch.resolved_head_dim,
                                        recomputed, layout.cp, b, backward=False)  # fmt: skip
        total = (sent + recompute_sent) * layout.cp // (layout.cp - 1)
        calls = micro * 4 * (2 * model.layers + recomputed)  # q, k, v, out per pass
        intra = is_intra_node(layout, ("cp",), nodes)
        out.append(Collective("cp", "all-to-all", "CP q, k, v and attention output", calls,
                              micro * total, layout.cp, intra))  # fmt: skip
        out.append(Collective("cp", "all-gather", "CP doc ids", micro,
                              micro * shape.rows * shape.length * 8, layout.cp, intra))  # fmt: skip
    muon = sum(s.local_numel for s in model.shards if s.optimizer == "muon")
    owner_dims = ("dp_shard", "cp", "tp") if layout.tp > 1 else fsdp_dims
    owner_group = fsdp_group * (layout.tp if layout.tp > 1 else 1)
    if muon and owner_group > 1:
        out.append(Collective("+".join(d for d in ("dp_shard_cp", "tp") if d != "tp" or
                                       layout.tp > 1), "all-to-all",
                              "Muon NS inputs and updates", 2, 2 * muon * ns_bytes,
                              owner_group, is_intra_node(layout, owner_dims, nodes)))  # fmt: skip
    return out


def _checkpointed_layers(layers: int, flag: bool | int) -> int:
    if isinstance(flag, bool):
        return layers if flag else 0
    return sum(1 for i in range(layers) if flag > 0 and i % flag == 0)
