"""Owner assignment, row blocks and batch arithmetic of the distributed path (the mesh's: test_parallel_dims.py) (no
processes needed; the real collectives are in tests/integration/test_distributed_muon.py)."""

import pytest
import torch

from unmask.errors import InputError
from unmask.models.config import ModelConfig
from unmask.models.transformer import DiffusionTransformer
from unmask.optim.distributed import OwnerPlan, assign_owners, chunk_rows, owner_loads
from unmask.optim.newton_schulz import ns_flops
from unmask.optim.routing import route_parameters
from unmask.parallel.batch import per_rank_batch_size
from unmask.parallel.mesh import launch_env


def qwen3_24_layer_muon_shapes() -> list[torch.Size]:
    """Muon matrices of a 24-layer qwen3_dllm (Qwen3-0.6B widths), built on the meta device."""
    cfg = ModelConfig(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    )
    with torch.device("meta"):
        model = DiffusionTransformer(cfg)
    return [p.shape for _, p in route_parameters(model).muon]


def test_the_24_layer_model_has_seven_muon_matrices_per_layer():
    shapes = qwen3_24_layer_muon_shapes()
    assert len(shapes) == 24 * 7
    assert {tuple(s) for s in shapes} == {
        (2048, 1024),
        (1024, 1024),
        (1024, 2048),
        (3072, 1024),
        (1024, 3072),
    }


@pytest.mark.parametrize("world", [2, 4, 8, 16])
@pytest.mark.parametrize("gram", [False, True])
def test_owner_ns_flops_are_within_10_percent_of_a_perfect_split(world, gram):
    shapes = qwen3_24_layer_muon_shapes()
    plan = OwnerPlan(shapes, world, ns_steps=5, gram=gram)
    loads = owner_loads(plan.costs, plan.owners, world)
    perfect = sum(plan.costs) / world
    assert max(loads) <= 1.10 * perfect
    assert min(loads) >= 0.90 * perfect
    # every matrix has exactly one owner, so NS runs once per matrix across the group
    assert sorted(i for r in range(world) for i in plan.owned(r)) == list(range(len(shapes)))


def test_owners_balance_flops_not_element_counts():
    # one big square matrix costs as much NS as many thin ones of the same element count
    costs = [float(ns_flops(512, 512))] + [float(ns_flops(8, 32768))] * 8
    owners = assign_owners(costs, 2)
    loads = owner_loads(costs, owners, 2)
    assert owners[0] == 0 and all(o == 1 for o in owners[1:])
    assert loads == [costs[0], 8 * costs[1]]


def test_assign_owners_is_deterministic_lpt():
    assert assign_owners([5, 3, 3, 1], 2) == [0, 1, 1, 0]
    assert assign_owners([1, 1, 1], 4) == [0, 1, 2]


@pytest.mark.parametrize(("rows", "world"), [(7, 2), (18, 4), (3, 4), (16, 4), (1, 3), (0, 2)])
def test_chunk_rows_matches_torch_chunk(rows, world):
    expected = [len(c) for c in torch.arange(rows).chunk(world)] if rows else []
    expected += [0] * (world - len(expected))
    blocks = chunk_rows(rows, world)
    assert [stop - start for start, stop in blocks] == expected
    assert blocks[0][0] == 0 and blocks[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))


def test_split_batches_divides_the_batch_or_says_why():
    assert per_rank_batch_size(8, 4, split_batches=True) == 2
    assert per_rank_batch_size(8, 4, split_batches=False) == 8
    with pytest.raises(InputError) as err:
        per_rank_batch_size(6, 4, split_batches=True)
    assert str(err.value) == (
        "train.split_batches: per_device_train_batch_size=6 does not divide by the world "
        "size 4; use a multiple of 4 or split_batches=false"
    )


def test_launch_env_reads_torchrun_then_slurm():
    assert launch_env({}).world_size == 1
    env = launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_ADDR": "n0"}
    assert launch_env(slurm) == type(env)(rank=5, world_size=8, local_rank=1)
    # srun without MASTER_ADDR cannot rendezvous: treated as one process
    assert launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}).world_size == 1


def test_seed_spellings_fsdp2_and_accelerator_config_split_batches():
    from unmask.config import validate_tree

    cfg = validate_tree({"train": {"fsdp2": True, "accelerator_config": {"split_batches": True}}})
    assert cfg.parallel.fsdp2 and cfg.train.split_batches
    with pytest.raises(InputError, match="unknown config key 'train.accelerator_config.dispatch"):
        validate_tree({"train": {"accelerator_config": {"dispatch_batches": True}}})


@pytest.mark.parametrize(("rows", "sizes"), [(32, (2, 2)), (7, (2, 2)), (3, (2, 4)), (18, (3,))])
def test_nested_chunk_rows_match_torch_chunk_twice(rows, sizes):
    """DTensor's Shard(0) on two mesh dims: torch.chunk over the first, then each block."""
    from unmask.optim.distributed import nested_chunk_rows

    blocks = nested_chunk_rows(rows, sizes)
    index = torch.arange(rows)
    expected = []
    outer = list(index.chunk(sizes[0])) + [index[:0]] * (sizes[0] - len(index.chunk(sizes[0])))
    for piece in outer:
        if len(sizes) == 1:
            expected.append(piece)
            continue
        inner = list(piece.chunk(sizes[1])) if len(piece) else []
        expected += inner + [index[:0]] * (sizes[1] - len(inner))
    assert len(blocks) == len(expected)
    for (start, stop), want in zip(blocks, expected):
        assert torch.equal(index[start:stop], want), (blocks, expected)


def test_wire_elements_are_every_block_but_the_owners_each_way():
    """Column blocks (a row-parallel weight under tp=4) and row x column blocks (FSDP2 x TP,
    2 x 2): each direction sends (W - 1) / W of the matrices; an owner keeps its own block."""
    shapes = [(32, 64), (64, 32), (16, 16)]
    columns = [[(0, a, c * b // 4, (c + 1) * b // 4) for c in range(4)] for a, b in shapes]
    grid = [[(r * a // 2, (r + 1) * a // 2, c * b // 2, (c + 1) * b // 2)
             for r in range(2) for c in range(2)] for a, b in shapes]  # fmt: skip
    for blocks in (columns, grid):
        plan = OwnerPlan(shapes, 4, ns_steps=5, gram=False, blocks=blocks)
        sent = [plan.wire_elements(rank) for rank in range(4)]
        total = sum(a * b for a, b in shapes)
        assert sum(out for out, _ in sent) == sum(back for _, back in sent) == total * 3 // 4
        for rank, (out, back) in enumerate(sent):
            owned = plan.owned(rank)
            assert out == sum(plan.numel(i, rank) for i in range(3) if i not in owned)
            assert back == sum(a * b * 3 // 4 for i, (a, b) in enumerate(shapes) if i in owned)
    # without blocks: FSDP2's Shard(0) rows (torch.chunk), uneven ones included
    plan = OwnerPlan([(7, 12)], 2, ns_steps=5, gram=False)
    assert plan.blocks == [[(0, 4, 0, 12), (4, 7, 0, 12)]]
    assert plan.wire_elements(plan.owners[0]) == (0, 12 * (3 if plan.owners[0] == 0 else 4))


def _dtensor(mesh, shape, placements):
    """A DTensor of global `shape` laid out by `placements` (zeros: only the layout matters)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
    return DTensor.from_local(torch.zeros(local), mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=torch.empty(shape).stride())  # fmt: skip


@pytest.mark.parametrize("rank", range(4))
def test_split_blocks_are_the_blocks_dtensor_gives_every_rank(rank):
    """A 2 x 2 (dp_shard, tp) mesh under torch's fake process group: FSDP2 over a
    column-parallel weight (_StridedShard rows of tp row blocks, uneven 18 = 9 + 9 ->
    5 + 4 too), over a row-parallel one (row x column blocks), and a strided split whose
    rows are not contiguous (no rectangles: None, redistributed into rows first)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    from unmask.optim.distributed import split_blocks
    from unmask.plan.shards import fake_world

    with fake_world(rank, 4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        colwise = (_StridedShard(0, split_factor=2), Shard(0))
        cases = {
            ((32, 16), colwise): [(0, 8, 0, 16), (16, 24, 0, 16), (8, 16, 0, 16), (24, 32, 0, 16)],
            ((18, 4), colwise): [(0, 5, 0, 4), (9, 14, 0, 4), (5, 9, 0, 4), (14, 18, 0, 4)],
            ((32, 16), (Shard(0), Shard(1))): [(0, 16, 0, 8), (0, 16, 8, 16), (16, 32, 0, 8),
                                                (16, 32, 8, 16)],
        }  # fmt: skip
        for (shape, placements), want in cases.items():
            p = _dtensor(mesh, shape, placements)
            assert split_blocks(p, (0, 1), (2, 2)) == want, placements
            (h, w), (r0, c0) = compute_local_shape_and_global_offset(shape, mesh, placements)
            assert want[rank] == (r0, r0 + h, c0, c0 + w)
        # one dim: the rows of every other tp block (0-7 and 16-23 on dp_shard rank 0)
        strided = _dtensor(mesh, (32, 16), (_StridedShard(0, split_factor=2), Replicate()))
        assert split_blocks(strided, (0,), (2,)) is None
