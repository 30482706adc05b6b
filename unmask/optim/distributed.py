"""Muon for DTensor (FSDP2 / HSDP) parameters: the owner all-to-all (docs/distributed.md).

Exact: the result is bit-identical to MuonAdamW on the unsharded module (asserted with
``torch.equal`` by tests/integration/test_distributed_muon.py, float32 and bfloat16 NS).

FSDP2 keeps every parameter, gradient and momentum buffer as a ``Shard(0)`` DTensor: each rank
of the shard group holds a block of rows (``torch.chunk`` sizes, so the last ranks may hold
fewer rows or none). Newton-Schulz needs the whole matrix, so one step of a Muon group is:

1. momentum and the Nesterov input on the local rows (elementwise, exact);
2. each matrix gets one owner rank, by longest-processing-time on NS FLOPs (:func:`assign_owners`);
3. one ``all_to_all_single``: every rank sends its block of matrix i to owner(i), in the NS
   dtype (NS casts to it first, so nothing is lost; float16 NS normalizes in float32 first, so
   its input travels as float32);
4. each owner runs NS once per owned matrix, batched by shape, with the call the
   one-process step makes (:func:`~unmask.optim.updates.orthogonalize_inputs`); under
   per-head Muon an owned q/k/v matrix goes in as its heads (the owner holds it whole,
   wherever FSDP2's rows or TP's heads cut it), and the scale of step 6 is one head's;
5. a second ``all_to_all_single`` returns each rank its block of every update;
6. weight decay and the update, scaled by the *global* shape, on the local block.

Bytes moved per step: what the ranks of the group send to *other* ranks, summed over the
group, in the NS dtype (:meth:`OwnerPlan.wire_elements`). Each direction moves every block
except the owner's own, sum_i (A_i B_i - owner's block of i): (W - 1) / W of the Muon
matrices' bytes when the blocks are even, so 2 (W - 1) / W of them out and back (per rank
about 2 (W - 1) / W^2 P_M elements); NS FLOPs per rank are 1/W of the total. Under HSDP the
all-to-all stays inside the shard group; replicas compute the same result without talking.

Under tensor parallelism a matrix is split over the tp ranks too: by rows for
column-parallel weights, by columns for row-parallel ones, and with FSDP2 on top by row
blocks of the tp blocks (FSDP2's _StridedShard) or row x column blocks. The owner all-to-all
then runs over every rank that holds a piece (dp_shard x tp, so W counts them all), and each
rank sends its own block as it is (:func:`split_blocks`, from DTensor's shard arithmetic):
the owner writes the blocks into the whole matrix, runs NS and sends every rank its block
of the update, the same (W - 1) / W each way. Nothing is all-gathered. (The previous path,
kept behind the test switch ``_REDISTRIBUTE_SPLIT_MATRICES`` and as the fallback for a split
whose pieces are not rectangles, first redistributed each split matrix into rows with
DTensor: on gloo an all-gather of the whole matrix, out and back.) Exact as well:
tests/integration/test_tensor_parallel.py compares both paths and one process bit for bit,
and counts the bytes. 3-D expert stacks sharded on the expert dim hold whole experts
locally and need no communication.

Not done yet: overlapping the collectives of one shape group with the NS of another.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from unmask.optim.newton_schulz import ns_flops
from unmask.optim.updates import (
    apply_muon_update_,
    heads_view,
    lr_scale,
    momentum_buffer,
    muon_ns_input,
    ns_settings,
    ns_shape,
    orthogonalize_inputs,
)


def assign_owners(costs: Sequence[float], world_size: int) -> list[int]:
    """Owner rank of each item by greedy LPT: largest cost first, onto the least-loaded rank.

    Deterministic (ties broken by item index, then by rank), so every rank computes the same
    assignment without talking.
    """
    loads = [0.0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


def owner_loads(costs: Sequence[float], owners: Sequence[int], world_size: int) -> list[float]:
    """Total cost per rank for an assignment."""
    loads = [0.0] * world_size
    for cost, owner in zip(costs, owners):
        loads[owner] += cost
    return loads


def chunk_rows(rows: int, world_size: int) -> list[tuple[int, int]]:
    """(start, stop) rows of each rank under ``torch.chunk`` (FSDP2's Shard(0) layout)."""
    size = -(-rows // world_size) if rows else 0
    out = []
    for rank in range(world_size):
        start = min(rank * size, rows)
        out.append((start, min(start + size, rows)))
    return out


def nested_chunk_rows(rows: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(start, stop) rows of each rank of a row-major mesh of ``sizes`` under DTensor's
    Shard(0) on every one of its dims: rows are chunked over the first dim, each block over
    the next, and so on. One dim: :func:`chunk_rows`."""
    blocks = [(0, rows)]
    for size in sizes:
        blocks = [(start + a, start + b) for start, stop in blocks
                  for a, b in chunk_rows(stop - start, size)]  # fmt: skip
    return blocks


def comm_dtype(ns_dtype: torch.dtype) -> torch.dtype:
    """The dtype NS inputs travel in: NS casts to ns_dtype first, except float16 (see module)."""
    return torch.float32 if ns_dtype == torch.float16 else ns_dtype


#: One rank's piece of a matrix: rows [r0, r1) x columns [c0, c1) of the global matrix.
Block = tuple[int, int, int, int]


class OwnerPlan:
    """Who owns which matrix of one Muon group, and the block of it every rank holds.

    Built from global shapes and placements only, so every rank of the group builds the
    same plan. ``blocks[i][r]`` is rank r's (r0, r1, c0, c1) of matrix i: by default the
    row blocks of DTensor's Shard(0) over ``group_sizes`` (FSDP2), or the blocks a
    tensor-parallel layout gives (:func:`split_blocks`: column blocks for row-parallel
    weights, row blocks for column-parallel ones, row x column blocks under FSDP2 x TP).
    ``heads[i]``: the rows of one head of matrix i under per-head Muon (its owner
    orthogonalizes it head by head; its cost is that of its heads), None for a whole matrix.
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        world_size: int,
        ns_steps: int,
        gram: bool,
        group_sizes: Sequence[int] | None = None,
        blocks: Sequence[Sequence[Block] | None] | None = None,
        heads: Sequence[int | None] | None = None,
    ):
        self.shapes = [tuple(s) for s in shapes]
        self.world_size = world_size
        self.heads = list(heads) if heads is not None else [None] * len(self.shapes)
        self.costs = [
            float(s[-2] // ns_shape(s, h)[0] * ns_flops(*ns_shape(s, h), ns_steps, gram=gram))
            for s, h in zip(self.shapes, self.heads)
        ]
        self.owners = assign_owners(self.costs, world_size)
        sizes = group_sizes or (world_size,)
        given = list(blocks) if blocks is not None else [None] * len(self.shapes)
        self.blocks: list[list[Block]] = [
            list(b) if b is not None else
            [(start, stop, 0, s[1]) for start, stop in nested_chunk_rows(s[0], sizes)]
            for s, b in zip(self.shapes, given)
        ]  # fmt: skip

    def numel(self, index: int, rank: int) -> int:
        r0, r1, c0, c1 = self.blocks[index][rank]
        return (r1 - r0) * (c1 - c0)

    def owned(self, rank: int) -> list[int]:
        return [i for i, owner in enumerate(self.owners) if owner == rank]

    def wire_elements(self, rank: int) -> tuple[int, int]:
        """Elements this rank sends to other ranks in one step: (NS inputs to the owners,
        updates back from the matrices it owns). Its own block of a matrix it owns never
        leaves it. Summed over the group each direction is sum_i (A_i B_i - owner's block
        of i): (W - 1) / W of the matrices' elements when the blocks are even."""
        out = sum(self.numel(i, rank) for i, o in enumerate(self.owners) if o != rank)
        back = sum(self.numel(i, r) for i in self.owned(rank)
                   for r in range(self.world_size) if r != rank)  # fmt: skip
        return out, back


def owner_all_to_all(
    local_inputs: list[Tensor], plan: OwnerPlan, group: dict[str, Any], pg, rank: int
) -> list[Tensor]:
    """This rank's block of each full NS update, given its block of each NS input.

    local_inputs[i]: this rank's block of matrix i (``plan.blocks[i][rank]``, rows x
    columns), any float dtype. Returns the same blocks of the updates, in the NS dtype.
    Exactly one NS per matrix across the group (on its owner); each block travels once to
    the owner and once back, and an owner's own block never leaves it.
    """
    world = plan.world_size
    ns_dtype = ns_settings(group).dtype
    send_dtype = comm_dtype(ns_dtype)
    device = local_inputs[0].device if local_inputs else torch.device("cpu")
    # 1. my block of every matrix, grouped by owner (owner-major, matrix order inside)
    send_parts = [[] for _ in range(world)]
    for i, u in enumerate(local_inputs):
        send_parts[plan.owners[i]].append(u.reshape(-1).to(send_dtype))
    send_sizes = [sum(t.numel() for t in parts) for parts in send_parts]
    mine = plan.owned(rank)
    recv_sizes = [sum(plan.numel(i, src) for i in mine) for src in range(world)]
    send = torch.cat([t for parts in send_parts for t in parts]) if sum(send_sizes) else None
    send = send if send is not None else torch.empty(0, dtype=send_dtype, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=send_dtype, device=device)
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=pg)
    # 2. assemble my owned matrices (source-major in the buffer) and orthogonalize them
    full = {i: torch.empty(plan.shapes[i], dtype=send_dtype, device=device) for i in mine}
    offset = 0
    for src in range(world):
        for i in mine:
            r0, r1, c0, c1 = plan.blocks[i][src]
            n = plan.numel(i, src)
            full[i][r0:r1, c0:c1] = recv[offset : offset + n].view(r1 - r0, c1 - c0)
            offset += n
    # (per-head Muon: a matrix goes in as its heads, and its update comes back whole)
    updates = orthogonalize_inputs([heads_view(full[i], plan.heads[i]) for i in mine], group)
    updates = [u.reshape(plan.shapes[i]) for i, u in zip(mine, updates)]
    # 3. send every rank its block of my updates; receive my blocks from every owner
    back_parts = []
    for dst in range(world):
        for i, update in zip(mine, updates):
            r0, r1, c0, c1 = plan.blocks[i][dst]
            back_parts.append(update[r0:r1, c0:c1].reshape(-1).to(send_dtype))
    back = torch.cat(back_parts) if back_parts else torch.empty(0, dtype=send_dtype, device=device)
    got = torch.empty(sum(send_sizes), dtype=send_dtype, device=device)
    dist.all_to_all_single(got, back, send_sizes, recv_sizes, group=pg)
    # 4. unpack: owner-major, matrix order inside, exactly as sent in step 1
    out: list[Tensor | None] = [None] * len(local_inputs)
    offset = 0
    for owner in range(world):
        for i, u in enumerate(local_inputs):
            if plan.owners[i] != owner:
                continue
            n = u.numel()
            out[i] = got[offset : offset + n].view(u.shape).to(ns_dtype)
            offset += n
    return out  # type: ignore[return-value]


#: Owner plans of the DTensor Muon groups, by (mesh, owner mesh dims, ids of the
#: parameters, the test switch), each with which of its matrices are redistributed first.
OwnerPlans = dict[tuple, tuple[OwnerPlan, list[bool]]]


def owner_dims(p: DTensor) -> tuple[int, ...]:
    """Mesh dims over which p is split (FSDP2's dp_shard, TP's tp); replicas are not."""
    return tuple(i for i, placement in enumerate(p.placements) if not placement.is_replicate())


def rows_layout(p: DTensor) -> tuple[Placement, ...]:
    """Shard(0) on every dim p is split over, Replicate elsewhere: FSDP2's own layout, whose
    blocks are rows. A split matrix in another layout is sent as it is (:func:`split_blocks`);
    only the test switch or a split whose pieces do not tile redistributes it into this
    one first (DTensor's redistribute: data movement only, exact)."""
    dims = owner_dims(p)
    return tuple(Shard(0) if i in dims else Replicate() for i in range(p.device_mesh.ndim))


#: Test-only switch back to the previous path: every matrix whose layout is not Shard(0)
#: rows is first redistributed into rows by DTensor (on gloo an all-gather of the whole
#: matrix), then goes through the owner all-to-all. tests/integration/test_tensor_parallel.py
#: compares the two paths bit for bit and counts their bytes.
_REDISTRIBUTE_SPLIT_MATRICES = False


def split_blocks(p: DTensor, dims: tuple[int, ...], sizes: tuple[int, ...]) -> list[Block] | None:
    """Every rank's block of the 2-D DTensor p, in the order of the flattened group over the
    mesh ``dims`` (row-major, sizes ``sizes``), from DTensor's own shard arithmetic
    (Shard, and FSDP2's _StridedShard over a tensor-parallel Shard(0)). None when the pieces
    are not rectangles that tile the matrix (a strided split whose rows are not contiguous):
    such a parameter is redistributed into rows first."""
    mesh_shape = tuple(p.device_mesh.shape)
    rows, cols = p.shape
    blocks: list[Block] = []
    for flat in range(math.prod(sizes)):
        coordinate = [0] * len(mesh_shape)
        rest = flat
        for dim, size in reversed(tuple(zip(dims, sizes))):
            coordinate[dim], rest = rest % size, rest // size
        (h, w), (r0, c0) = _compute_local_shape_and_global_offset(
            p.shape, mesh_shape, coordinate, p.placements
        )
        blocks.append((r0, r0 + h, c0, c0 + w))
    if sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in blocks) != rows * cols:
        return None
    nonempty = [b for b in blocks if b[1] > b[0] and b[3] > b[2]]
    for i, (a0, a1, b0, b1) in enumerate(nonempty):
        if a0 < 0 or b0 < 0 or a1 > rows or b1 > cols:
            return None
        for r0, r1, c0, c1 in nonempty[i + 1 :]:
            if a0 < r1 and r0 < a1 and b0 < c1 and c0 < b1:  # overlap
                return None
    return blocks


def _plan_for(layout_params: list[DTensor], group: dict[str, Any], dims: tuple[int, ...],
              sizes: tuple[int, ...], rank: int,
              heads: Sequence[int | None]) -> tuple[OwnerPlan, list[bool]]:  # fmt: skip
    """The owner plan of one layout's matrices (``heads``: per-head Muon's rows of one head
    of each, or None), and which of them are redistributed into rows first (only a layout
    whose blocks do not tile, or the test switch)."""
    blocks, moved = [], []
    for p in layout_params:
        rows = rows_layout(p) == tuple(p.placements)
        split = None if rows or _REDISTRIBUTE_SPLIT_MATRICES else split_blocks(p, dims, sizes)
        blocks.append(split)
        moved.append(not rows and split is None)
    plan = OwnerPlan([p.shape for p in layout_params], math.prod(sizes), group["ns_steps"],
                     ns_settings(group).gram, group_sizes=sizes, blocks=blocks,
                     heads=heads)  # fmt: skip
    for index, p in enumerate(layout_params):
        r0, r1, c0, c1 = plan.blocks[index][rank]
        if not moved[index] and tuple(p.to_local().shape) != (r1 - r0, c1 - c0):
            raise RuntimeError(
                f"MuonAdamW: the local shard {tuple(p.to_local().shape)} of a {tuple(p.shape)} "
                f"matrix ({p.placements}) is not the block {plan.blocks[index][rank]} the "
                "owner plan computed"
            )
    return plan, moved


def _owner_group(mesh, dims: tuple[int, ...]):
    """(process group, this rank's index in it, sizes) of the mesh dims ``dims`` taken
    together, row-major: one dim's own group, or a flattened view of several."""
    sizes = tuple(mesh.size(d) for d in dims)
    if len(dims) == 1:
        return mesh.get_group(dims[0]), mesh.get_local_rank(dims[0]), sizes
    key = (mesh, dims)  # equal meshes (one per FSDP2 unit and TP style) share a group
    if key not in _FLAT_GROUPS:
        names = tuple(mesh.mesh_dim_names[d] for d in dims)
        with warnings.catch_warnings():  # slicing dims FSDP2 made from flattened ones
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            _FLAT_GROUPS[key] = mesh[names]._flatten("_".join(names) + "_muon")
    flat = _FLAT_GROUPS[key]
    return flat.get_group(), flat.get_local_rank(), sizes


_FLAT_GROUPS: dict[tuple, Any] = {}


def dtensor_muon_step(
    group: dict[str, Any],
    state: defaultdict[Tensor, dict[str, Any]],
    owner_plans: OwnerPlans,
    head_dims: Mapping[Tensor, int] | None = None,
) -> None:
    """One Muon step for a param group of DTensor parameters (called by MuonAdamW.step).

    FSDP2 / HSDP parameters (Shard(0) on one mesh dim) go straight to the owner all-to-all
    over that dim. Parameters split over several dims (FSDP2 x TP, or TP alone, which the
    trainer lays on a mesh with a size-1 dp_shard dim) go to the owner all-to-all over all
    of them (the dp_shard x tp ranks together), each rank sending its own block: every
    matrix is orthogonalized whole, once, and the work is balanced over every rank that
    holds a piece of it.

    Args:
        group: the Muon param group (its params, lr, weight decay and NS settings).
        state: per-parameter optimizer state (``Optimizer.state``: a parameter seen for
            the first time gets an empty dict); momentum buffers are created in it on the
            first step.
        owner_plans: cache of :class:`OwnerPlan` (with which matrices are redistributed
            first); a plan is built on the first step of a group and reused (it depends
            only on global shapes, placements and the mesh).
        head_dims: per-head Muon, {parameter: rows of one head}: the owner (which holds the
            matrix whole, however FSDP2 and TP cut it) orthogonalizes such a matrix head by
            head, and the update scale is one head's.
    """
    head_dims = head_dims or {}
    params = [p for p in group["params"] if p.grad is not None]
    if not params:
        return
    by_layout: dict[tuple, list[DTensor]] = defaultdict(list)
    for p in params:
        if not isinstance(p, DTensor):
            raise TypeError("MuonAdamW: a Muon group mixes DTensor and plain parameters")
        dims = () if p.ndim == 3 else owner_dims(p)  # expert stacks: split on the expert dim
        by_layout[(p.device_mesh, dims)].append(p)
    for (_, dims), layout_params in by_layout.items():
        inputs = [
            muon_ns_input(
                momentum_buffer(state[p], p).to_local(),
                p.grad.to_local(),
                group["momentum"],
                group["nesterov"],
                group["momentum_style"],
            )
            for p in layout_params
        ]
        if not dims:
            # replicated (every rank holds whole matrices) or expert stacks sharded on the
            # expert dim: NS on what is here, one input at a time, no communication.
            updates = [
                orthogonalize_inputs([heads_view(u, head_dims.get(p))], group)[0].reshape(u.shape)
                if u.numel() else u
                for u, p in zip(inputs, layout_params)
            ]  # fmt: skip
        else:
            mesh = layout_params[0].device_mesh
            pg, rank, sizes = _owner_group(mesh, dims)
            key = (mesh, dims, tuple(id(p) for p in layout_params),
                   _REDISTRIBUTE_SPLIT_MATRICES)  # fmt: skip
            if key not in owner_plans:
                heads = [head_dims.get(p) for p in layout_params]
                owner_plans[key] = _plan_for(layout_params, group, dims, sizes, rank, heads)
            plan, moved = owner_plans[key]
            inputs = [
                _redistributed(u, p, rows_layout(p)) if move else u
                for u, p, move in zip(inputs, layout_params, moved)
            ]
            updates = owner_all_to_all(inputs, plan, group, pg, rank)
            updates = [
                _redistributed(u, p, rows_layout(p), back=True) if move else u
                for u, p, move in zip(updates, layout_params, moved)
            ]
        by_shape: dict[tuple, list[int]] = defaultdict(list)  # the shape NS saw (global)
        for index, p in enumerate(layout_params):
            by_shape[ns_shape(p.shape, head_dims.get(p))].append(index)
        for shape, indices in by_shape.items():
            local = [layout_params[i].to_local() for i in indices]
            ups = [updates[i].to(t.dtype) for i, t in zip(indices, local)]
            scale = lr_scale(shape, group["adjust_lr"])
            apply_muon_update_(local, ups, group["lr"], group["weight_decay"], scale)


def _redistributed(local: Tensor, p: DTensor, rows: tuple, back: bool = False) -> Tensor:
    """The local piece of ``local`` (laid out as p, or as ``rows`` when ``back``) in the
    other layout."""
    source, target = (rows, tuple(p.placements)) if back else (tuple(p.placements), rows)
    whole = DTensor.from_local(
        local, p.device_mesh, source, run_check=False, shape=p.shape, stride=p.stride()
    )
    with quiet_dtensor_notes():
        return whole.redistribute(p.device_mesh, target).to_local()


#: Loggers whose notes on every run are about DTensor's choices, not the user's input: a
#: strided split redistributed in two all-gathers, gloo's all-to-all done as an all-gather.
_NOISY = ("torch.distributed.tensor._redistribute", "torch.distributed._functional_collectives",
          "torch.distributed.tensor._collective_utils", "torch._logging._internal")  # fmt: skip


@contextlib.contextmanager
def quiet_dtensor_notes():
    """Raise the loggers in _NOISY to ERROR for the duration."""
    loggers = [logging.getLogger(name) for name in _NOISY]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)
