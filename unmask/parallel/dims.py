"""The run's parallel layout, owned in one place (torchtitan's ParallelDims idea): the degrees
of every dimension, their checks (one-line errors before any process group), the world mesh
with its flattened views and the expert-parallel dims unflattened from it, and the questions
the trainer and the planner ask of a layout (the ranks that read different rows, FSDP2's
mesh, where a group's ranks sit in the world).

A new parallel dimension is a field here (its degree, its check in `ParallelDims.resolve`,
its place in `MESH_DIMS`) and the module in parallel/ that applies it to the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from unmask.errors import InputError
from unmask.parallel.mesh import sub_mesh

#: the world mesh's dims, outermost first (torchtitan's order): a pipeline's stages may sit
#: on different nodes and every other dim inside one stage; tp innermost
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

#: expert parallelism's dims, unflattened from "dp_cp" (torchtitan's way: the experts split
#: over the ranks that read different rows or sequence slices, no mesh of their own): the
#: ranks that hold the same experts (ep_replica), then the ranks that split them (ep)
EXPERT_DIMS = ("ep_replica", "ep")


@dataclass(frozen=True)
class ParallelDims:
    """The degree of each parallel dimension; their product over `MESH_DIMS` is the world.

    pp: pipeline stages' ranks (each holds its own decoder layers); dp_replicate: replica
    groups (HSDP); dp_shard: ranks FSDP2 shards parameters over; cp: ranks a sequence is
    split over (context parallelism); tp: ranks a layer's matrices are split over (tensor
    parallelism); ep: ranks one MoE layer's experts are split over, a divisor of the
    dp x cp ranks (it takes no ranks of its own)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @classmethod
    def resolve(cls, world_size: int, *, dp_replicate: int = 1, dp_shard: int = -1,
                cp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, shard: bool = True,
                experts: int = 0) -> ParallelDims:  # fmt: skip
        """The layout of `world_size` processes, or a one-line InputError. dp_shard -1 =
        world_size / (pp * dp_replicate * cp * tp); `shard` False (no FSDP2): those ranks
        replicate instead (dp_replicate = the rest, dp_shard = 1). One process: the dp keys
        are ignored, the other degrees are not. experts: the model's expert count, for the
        fix an expert-parallel degree that does not fit suggests."""
        if world_size == 1:
            if tp * cp * pp > 1:
                _factor(1, 1, -1, cp, tp, pp)  # raises: pp * tp * cp does not divide 1
            dims = cls(ep=ep)
        elif shard:
            dims = cls(*_factor(world_size, dp_replicate, dp_shard, cp, tp, pp), ep=ep)
        else:
            rest = _factor(world_size, 1, -1, cp, tp, pp)[1]
            dims = cls(rest, 1, cp, tp, pp, ep)
        if ep < 1:
            raise InputError(f"parallel.expert_parallel must be >= 1, got {ep}")
        if dims.dp_cp % ep:
            dp_cp = dims.dp_cp
            fitting = math.gcd(experts, dp_cp)  # the largest ep the experts and ranks take
            raise InputError(
                f"parallel.expert_parallel={ep} does not divide the data-parallel x "
                f"context ranks ({dp_cp}); launch a multiple of {ep} of them, or "
                f"override parallel.expert_parallel={fitting} (it divides the {experts} experts "
                f"and the {dp_cp} ranks)"
            )
        return dims

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Ranks that read different rows of a batch (tp and cp peers read the same rows)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks that read different tokens (whose losses are summed; the experts' ranks)."""
        return self.dp * self.cp

    def sizes(self) -> dict[str, int]:
        """The world mesh's dims and their sizes, outermost first (`MESH_DIMS`)."""
        return {name: getattr(self, name) for name in MESH_DIMS}

    def expert_dims(self) -> dict[str, tuple[int, int]]:
        """(size, stride in world ranks) of each of `EXPERT_DIMS`: "dp_cp" (dp_replicate x
        dp_shard x cp, tp innermost) cut into (dp_cp / ep, ep), ep innermost, within one
        pipeline stage (pp stays outermost). The rank order `expert_mesh` builds."""
        return {"ep_replica": (self.dp_cp // self.ep, self.ep * self.tp),
                "ep": (self.ep, self.tp)}  # fmt: skip

    def span(self, dims: tuple[str, ...]) -> int:
        """How many consecutive world ranks a group over `dims` spans (mesh dims of the
        row-major world mesh, or one of `EXPERT_DIMS`): the stride of its innermost dim x
        the sizes."""
        if len(dims) == 1 and dims[0] in EXPERT_DIMS:
            size, stride = self.expert_dims()[dims[0]]
            return size * stride
        sizes = self.sizes()
        inner = MESH_DIMS.index(max(dims, key=MESH_DIMS.index))
        span = 1
        for name in MESH_DIMS[inner + 1 :]:
            span *= sizes[name]
        for name in dims:
            span *= sizes[name]
        return span

    def intra_node(self, dims: tuple[str, ...], nodes: int) -> bool:
        """Whether every group over `dims` lies inside one node (ranks placed node by node:
        world / nodes consecutive ranks per node)."""
        per_node = self.world_size // nodes
        span = self.span(dims)
        return span <= per_node and per_node % span == 0

    def build_mesh(self, device: torch.device) -> DeviceMesh:
        """The world mesh with all five `MESH_DIMS` (size-1 dims included, so every layout
        has the same names), plus torchtitan's flattened views: "dp" (dp_replicate,
        dp_shard: ranks that read different rows), "dp_shard_cp" (what FSDP2 shards over)
        and "dp_cp" (ranks whose losses are summed, which the experts' grid cuts)."""
        mesh = init_device_mesh(device.type, tuple(self.sizes().values()),
                                mesh_dim_names=MESH_DIMS)  # fmt: skip
        mesh["dp_replicate", "dp_shard"]._flatten("dp")
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        return mesh

    def expert_mesh(self, mesh: DeviceMesh) -> DeviceMesh | None:
        """This rank's (ep_replica, ep) grid (`expert_dims`): the world mesh's "dp_cp" dim of
        this rank's pipeline stage unflattened, so a stage's experts live on its own ranks and
        no second mesh is initialized; None without expert parallelism."""
        if self.ep == 1:
            return None
        return sub_mesh(mesh, "dp_cp")._unflatten(0, (self.dp_cp // self.ep, self.ep),
                                                  EXPERT_DIMS)  # fmt: skip

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP2 shards over: dp_shard_cp, under dp_replicate when that is > 1
        (HSDP)."""
        if self.dp_replicate > 1:
            return sub_mesh(mesh, "dp_replicate", "dp_shard_cp")
        return sub_mesh(mesh, "dp_shard_cp")

    def describe(self) -> str:
        """' x 4 processes (FSDP2 over 4)' for the start-up line; '' for one process."""
        if self.world_size == 1:
            return ""
        shard, replicate = self.dp_shard, self.dp_replicate
        if shard == 1:
            how = f"replicated {replicate}x" if replicate > 1 else ""
        elif replicate > 1:
            how = f"HSDP {replicate} x {shard}"
        else:
            how = f"FSDP2 over {shard}"
        parts = [how] if how else []
        parts += [f"{name} {size}" for name, size in (("CP", self.cp), ("TP", self.tp),
                                                     ("PP", self.pp)) if size > 1]  # fmt: skip
        return f" x {self.world_size} processes ({', '.join(parts)})"


def _factor(world_size: int, dp_replicate: int, dp_shard: int, cp: int, tp: int,
            pp: int) -> tuple[int, int, int, int, int]:  # fmt: skip
    """(dp_replicate, dp_shard, cp, tp, pp) with dp_shard -1 filled in; one-line errors for
    a degree below 1 or a product that is not the world size."""
    for key, value in (("tensor_parallel", tp), ("context_parallel", cp),
                       ("pipeline_parallel", pp)):  # fmt: skip
        if value < 1:
            raise InputError(f"parallel.{key} must be >= 1, got {value}")
    if dp_replicate < 1:
        raise InputError(f"parallel.dp_replicate must be >= 1, got {dp_replicate}")
    fixed = pp * dp_replicate * cp * tp
    if dp_shard == -1:
        if world_size % fixed:
            if fixed == dp_replicate:
                raise InputError(
                    f"parallel.dp_replicate={dp_replicate} does not divide the world size "
                    f"{world_size}; set dp_replicate to a divisor of the number of processes"
                )
            named = (("pipeline_parallel", pp), ("dp_replicate", dp_replicate),
                     ("context_parallel", cp), ("tensor_parallel", tp))  # fmt: skip
            what = " x ".join(f"parallel.{k}={v}" for k, v in named if v > 1)
            raise InputError(
                f"{what} does not divide the world size {world_size}; launch a multiple of "
                f"{fixed} processes or lower {'them' if ' x ' in what else 'it'}"
            )
        dp_shard = world_size // fixed
    if dp_shard < 1 or fixed * dp_shard != world_size:
        extra = "".join(
            f" x parallel.{k}={v}"
            for k, v in (("context_parallel", cp), ("tensor_parallel", tp))
            if v > 1
        )
        first = f"parallel.pipeline_parallel={pp} x " if pp > 1 else ""
        raise InputError(
            f"mesh {first}parallel.dp_replicate={dp_replicate} x parallel.dp_shard={dp_shard}{extra} = "
            f"{fixed * dp_shard} processes does not match the world size {world_size}; "
            "make their product the number of processes (dp_shard: -1 fills it in)"
        )
    return dp_replicate, dp_shard, cp, tp, pp
