"""Muon for DTensor (FSDP2 / HSDP) parameters: the owner all-to-all (docs/distributed.md).

Exact: the result is bit-identical to MuonAdamW on the unsharded module (asserted with
``torch.equal`` by tests/integration/test_distributed_muon.py, float32 and bfloat16 NS).

FSDP2 keeps every parameter, gradient and momentum buffer as a ``Shard(0)`` DTensor: each rank
of the shard group holds a block of rows (``torch.chunk`` sizes, so the last ranks may hold
fewer rows or none). Newton-Schulz needs the whole matrix, so one step of a Muon group is:

1. momentum and the Nesterov input on the local rows (elementwise, exact);
2. each matrix gets one owner rank, by longest-processing-time on NS FLOPs (:func:`assign_owners`);
3. one ``all_to_all_single``: every rank sends its rows of matrix i to owner(i), in the NS
   dtype (NS casts to it first, so nothing is lost; float16 NS normalizes in float32 first, so
   its input travels as float32);
4. each owner runs NS once per owned matrix, batched by shape, with the call the
   one-process step makes (:func:`~unmask.optim.updates.orthogonalize_inputs`);
5. a second ``all_to_all_single`` returns each rank its rows of every update;
6. weight decay and the update, scaled by the *global* shape, on the local rows.

Per rank and step that sends about 2 * 2 (W - 1) / W^2 * P_M bytes in bf16 (P_M = Muon
elements) and runs 1/W of the NS FLOPs. Under HSDP the all-to-all stays inside the shard
group; replicas compute the same result without talking. Under tensor parallelism a matrix is
split over the tp ranks too (column-parallel: rows; row-parallel: columns; with FSDP2 on
top, a strided row split): its NS input is first laid out by DTensor's redistribute as rows
over every dim it is split on (:func:`rows_layout`), and the owner all-to-all runs over all
those ranks together (dp_shard x tp), so W counts them all; the update goes back the same
way. Exact as well: tests/integration/test_tensor_parallel.py compares bit for bit. 3-D expert stacks sharded on the
expert dim hold whole experts locally and need no communication.

Not done yet: overlapping the collectives of one shape group with the NS of another.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from unmask.optim.newton_schulz import ns_flops
from unmask.optim.updates import (
    apply_muon_update_,
    lr_scale,
    momentum_buffer,
    muon_ns_input,
    ns_settings,
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


class OwnerPlan:
    """Who owns which matrix of one Muon group, and the row blocks every rank holds.

    Built from global shapes only, so every rank of the shard group builds the same plan.
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        world_size: int,
        ns_steps: int,
        gram: bool,
        group_sizes: Sequence[int] | None = None,
    ):
        self.shapes = [tuple(s) for s in shapes]
        self.world_size = world_size
        self.costs = [float(ns_flops(s[-2], s[-1], ns_steps, gram=gram)) for s in self.shapes]
        self.owners = assign_owners(self.costs, world_size)
        sizes = group_sizes or (world_size,)
        self.rows = [nested_chunk_rows(s[0], sizes) for s in self.shapes]

    def numel(self, index: int, rank: int) -> int:
        start, stop = self.rows[index][rank]
        return (stop - start) * self.shapes[index][1]

    def owned(self, rank: int) -> list[int]:
        return [i for i, owner in enumerate(self.owners) if owner == rank]


def owner_all_to_all(
    local_inputs: list[Tensor], plan: OwnerPlan, group: dict[str, Any], pg, rank: int
) -> list[Tensor]:
    """Rows of each full NS update for this rank, given this rank's rows of each NS input.

    local_inputs[i]: (rows_i, B) on this rank, any float dtype. Returns (rows_i, B) in the
    NS dtype. Exactly one NS per matrix across the group (on its owner).
    """
    world = plan.world_size
    ns_dtype = ns_settings(group).dtype
    send_dtype = comm_dtype(ns_dtype)
    device = local_inputs[0].device if local_inputs else torch.device("cpu")
    # 1. my rows of every matrix, grouped by owner (owner-major, matrix order inside)
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
    pieces: dict[int, list[Tensor]] = {i: [] for i in mine}
    offset = 0
    for src in range(world):
        for i in mine:
            n = plan.numel(i, src)
            pieces[i].append(recv[offset : offset + n].view(-1, plan.shapes[i][1]))
            offset += n
    full = [torch.cat(pieces[i]) for i in mine]
    updates = orthogonalize_inputs(full, group) if full else []
    # 3. send every rank its rows of my updates; receive my rows from every owner
    back_parts = []
    for dst in range(world):
        for i, update in zip(mine, updates):
            start, stop = plan.rows[i][dst]
            back_parts.append(update[start:stop].reshape(-1).to(send_dtype))
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


#: Owner plans of the DTensor Muon groups, by (mesh, owner mesh dims, ids of the parameters).
OwnerPlans = dict[tuple, OwnerPlan]


def owner_dims(p: DTensor) -> tuple[int, ...]:
    """Mesh dims over which p is split (FSDP2's dp_shard, TP's tp); replicas are not."""
    return tuple(i for i, placement in enumerate(p.placements) if not placement.is_replicate())


def rows_layout(p: DTensor) -> tuple[Placement, ...]:
    """The placements the owner all-to-all reads: Shard(0) on every dim p is split over,
    Replicate elsewhere. FSDP2 alone already has it; under TP (column-parallel: a strided
    row split; row-parallel: a column split) the NS input is moved into it and the update
    back out of it by DTensor's redistribute (data movement only: exact)."""
    dims = owner_dims(p)
    return tuple(Shard(0) if i in dims else Replicate() for i in range(p.device_mesh.ndim))


def _owner_group(mesh, dims: tuple[int, ...]):
    """(process group, this rank's index in it, sizes) of the mesh dims ``dims`` taken
    together, row-major: one dim's own group, or a flattened view of several."""
    sizes = tuple(mesh.size(d) for d in dims)
    if len(dims) == 1:
        return mesh.get_group(dims[0]), mesh.get_local_rank(dims[0]), sizes
    key = (id(mesh), dims)
    if key not in _FLAT_GROUPS:
        names = tuple(mesh.mesh_dim_names[d] for d in dims)
        with warnings.catch_warnings():  # slicing dims FSDP2 made from flattened ones
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            _FLAT_GROUPS[key] = mesh[names]._flatten("_".join(names) + "_muon")
    flat = _FLAT_GROUPS[key]
    return flat.get_group(), flat.get_local_rank(), sizes


_FLAT_GROUPS: dict[tuple, Any] = {}


def dtensor_muon_step(
    group: dict[str, Any], state: defaultdict[Tensor, dict[str, Any]], owner_plans: OwnerPlans
) -> None:
    """One Muon step for a param group of DTensor parameters (called by MuonAdamW.step).

    FSDP2 / HSDP parameters (Shard(0) on one mesh dim) go straight to the owner all-to-all
    over that dim. Parameters split over several dims (FSDP2 x TP) are first laid out as
    rows over all of them (:func:`rows_layout`), so the owner all-to-all runs over the
    dp_shard x tp ranks together: every matrix is orthogonalized whole, once, and the work
    is balanced over every rank that holds a piece of it.

    Args:
        group: the Muon param group (its params, lr, weight decay and NS settings).
        state: per-parameter optimizer state (``Optimizer.state``: a parameter seen for
            the first time gets an empty dict); momentum buffers are created in it on the
            first step.
        owner_plans: cache of :class:`OwnerPlan`; a plan is built on the first step of a
            group and reused (it depends only on global shapes and the mesh).
    """
    params = [p for p in group["params"] if p.grad is not None]
    if not params:
        return
    by_layout: dict[tuple, list[DTensor]] = defaultdict(list)
    for p in params:
        if not isinstance(p, DTensor):
            raise TypeError("MuonAdamW: a Muon group mixes DTensor and plain parameters")
        dims = () if p.ndim == 3 else owner_dims(p)  # expert stacks: split on the expert dim
        by_layout[(id(p.device_mesh), dims)].append(p)
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
            updates = [orthogonalize_inputs([u], group)[0] if u.numel() else u for u in inputs]
        else:
            mesh = layout_params[0].device_mesh
            moved = [rows_layout(p) != tuple(p.placements) for p in layout_params]
            inputs = [
                _redistributed(u, p, rows_layout(p)) if move else u
                for u, p, move in zip(inputs, layout_params, moved)
            ]
            key = (id(mesh), dims, tuple(id(p) for p in layout_params))
            pg, rank, sizes = _owner_group(mesh, dims)
            plan = owner_plans.get(key)
            if plan is None:
                shapes = [p.shape for p in layout_params]
                gram = ns_settings(group).gram
                world = 1
                for size in sizes:
                    world *= size
                plan = OwnerPlan(shapes, world, group["ns_steps"], gram, group_sizes=sizes)
                owner_plans[key] = plan
            updates = owner_all_to_all(inputs, plan, group, pg, rank)
            updates = [
                _redistributed(u, p, rows_layout(p), back=True) if move else u
                for u, p, move in zip(updates, layout_params, moved)
            ]
        by_shape: dict[tuple, list[int]] = defaultdict(list)
        for index, p in enumerate(layout_params):
            by_shape[tuple(p.shape)].append(index)
        for shape, indices in by_shape.items():
            local = [layout_params[i].to_local() for i in indices]
            ups = [updates[i].to(local[0].dtype) for i in indices]
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
