"""The layout's one owner (parallel/dims.py `ParallelDims`): degrees -> mesh dims and sizes,
the refusals, the experts' grid unflattened from the data-parallel x context ranks, and
where a group's ranks sit. Meshes are built under torch's fake process group (no
processes; the real collectives run in tests/integration)."""

import pytest
import torch

from unmask.errors import InputError
from unmask.parallel.dims import EXPERT_DIMS, MESH_DIMS, ParallelDims
from unmask.plan.shards import fake_world


def test_degrees_resolve_to_the_mesh_sizes():
    def dp(world, replicate, shard):
        dims = ParallelDims.resolve(world, dp_replicate=replicate, dp_shard=shard)
        return dims.dp_replicate, dims.dp_shard

    assert dp(4, 1, -1) == (1, 4)
    assert dp(4, 2, -1) == (2, 2)
    assert dp(4, 2, 2) == (2, 2)
    assert ParallelDims.resolve(8, tp=2) == ParallelDims(1, 4, 1, 2)
    assert ParallelDims.resolve(8, dp_replicate=2, cp=2, tp=2) == ParallelDims(2, 1, 2, 2)
    assert ParallelDims.resolve(4, dp_shard=2, tp=2).dp == 2
    dims = ParallelDims.resolve(16, pp=2, cp=2, tp=2, ep=2)
    assert dims.sizes() == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}
    assert list(dims.sizes()) == list(MESH_DIMS)
    assert (dims.world_size, dims.dp, dims.dp_cp, dims.ep) == (16, 2, 4, 2)
    # no FSDP2: the data-parallel ranks replicate
    assert ParallelDims.resolve(8, tp=2, shard=False) == ParallelDims(4, 1, 1, 2)
    # one process: the dp keys are ignored, the others are not
    assert ParallelDims.resolve(1, dp_replicate=4, dp_shard=8) == ParallelDims()


def test_refusals_are_the_trainers_lines():
    def refusal(world, **degrees):
        with pytest.raises(InputError) as err:
            ParallelDims.resolve(world, **degrees)
        return str(err.value)

    assert "dp_replicate=2 x parallel.dp_shard=4 = 8 processes " in refusal(4, dp_replicate=2,
                                                                          dp_shard=4)  # fmt: skip
    assert refusal(4, dp_replicate=3) == (
        "parallel.dp_replicate=3 does not divide the world size 4; set dp_replicate to a "
        "divisor of the number of processes"
    )
    assert refusal(6, tp=4) == (
        "parallel.tensor_parallel=4 does not divide the world size 6; launch a multiple of 4 "
        "processes or lower it"
    )
    assert refusal(4, dp_shard=4, tp=2) == (
        "mesh parallel.dp_replicate=1 x parallel.dp_shard=4 x parallel.tensor_parallel=2 = 8 "
        "processes does not match the world size 4; make their product the number of processes "
        "(dp_shard: -1 fills it in)"
    )
    assert refusal(1, pp=2) == (
        "parallel.pipeline_parallel=2 does not divide the world size 1; launch a multiple of 2 "
        "processes or lower it"
    )
    assert refusal(4, cp=0) == "parallel.context_parallel must be >= 1, got 0"
    # ep takes no ranks of its own: it must divide the dp x cp ranks (tp and pp excluded)
    assert refusal(4, pp=2, ep=4, experts=8) == (
        "parallel.expert_parallel=4 does not divide the data-parallel x context ranks (2); "
        "launch a multiple of 4 of them, or override parallel.expert_parallel=2 (it divides "
        "the 8 experts and the 2 ranks)"
    )
    assert refusal(1, ep=2, experts=4).startswith(
        "parallel.expert_parallel=2 does not divide the data-parallel x context ranks (1)"
    )


def test_group_spans_and_nodes():
    dims = ParallelDims(dp_replicate=1, dp_shard=8, cp=1, tp=8)  # 64 ranks
    assert dims.span(("tp",)) == 8
    assert dims.span(("dp_shard", "cp")) == 64
    assert dims.intra_node(("tp",), nodes=8)
    assert not dims.intra_node(("dp_shard", "cp"), nodes=8)
    assert dims.intra_node(("dp_shard", "cp"), nodes=1)
    # experts: ep 4 of dp_shard 8, tp 2 innermost: an ep group spans 4 x 2 ranks, a
    # replica group every 8th rank of the stage's 16
    experts = ParallelDims(dp_shard=8, tp=2, ep=4)
    assert experts.expert_dims() == {"ep_replica": (2, 8), "ep": (4, 2)}
    assert (experts.span(("ep",)), experts.span(("ep_replica",))) == (8, 16)
    assert experts.intra_node(("ep",), nodes=2) and not experts.intra_node(("ep_replica",), 2)


def test_the_world_mesh_and_the_experts_grid_rank_by_rank():
    # pp 2 x dp_shard 4 at world 8, ep 2: stage 1 is ranks 4-7; the planner's rank order
    # (expert_dims) is the grid the trainer shards the experts on (expert_mesh), and both
    # come from the world mesh's dp_cp dim unflattened (no second mesh)
    dims = ParallelDims.resolve(8, pp=2, ep=2)
    assert dims == ParallelDims(1, 4, 1, 1, 2, 2)
    assert dims.expert_dims() == {"ep_replica": (2, 2), "ep": (2, 1)}
    expected = {0: {"ep": [0, 1], "ep_replica": [0, 2]}, 5: {"ep": [4, 5], "ep_replica": [5, 7]}}
    for rank, groups in expected.items():
        with fake_world(rank, 8):
            mesh = dims.build_mesh(torch.device("cpu"))
            assert mesh.mesh_dim_names == MESH_DIMS
            assert tuple(mesh.mesh.shape) == tuple(dims.sizes().values())
            assert [mesh[name].size() for name in ("dp", "dp_shard_cp", "dp_cp")] == [4, 4, 4]
            assert dims.fsdp_mesh(mesh).mesh_dim_names == ("dp_shard_cp",)
            grid = dims.expert_mesh(mesh)
            assert grid.mesh_dim_names == EXPERT_DIMS
            for name, (size, stride) in dims.expert_dims().items():
                ranks = grid[name].mesh.tolist()
                assert ranks == groups[name]
                assert ranks == list(range(ranks[0], ranks[0] + size * stride, stride))
    hsdp = ParallelDims(dp_replicate=2, dp_shard=2)
    with fake_world(0, 4):
        mesh = hsdp.build_mesh(torch.device("cpu"))
        assert hsdp.fsdp_mesh(mesh).mesh_dim_names == ("dp_replicate", "dp_shard_cp")
        assert hsdp.expert_mesh(mesh) is None  # ep 1: no grid


def test_the_start_up_line_describes_the_layout():
    assert ParallelDims().describe() == ""
    assert ParallelDims(dp_shard=4).describe() == " x 4 processes (FSDP2 over 4)"
    assert ParallelDims(2, 2, 1, 2).describe() == " x 8 processes (HSDP 2 x 2, TP 2)"
    assert ParallelDims(4, 1, pp=2).describe() == " x 8 processes (replicated 4x, PP 2)"
