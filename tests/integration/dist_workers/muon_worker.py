"""Run under torchrun (gloo, CPU): MuonAdamW on FSDP2/HSDP-sharded parameters.

For each mesh shape given, shard a fresh copy of the reference module, feed the same
seeded full gradients for STEPS steps, and save the gathered parameters plus the number of
matrices Newton-Schulz saw (summed over ranks) to OUT/<spec>.pt from rank 0. A spec is a
mesh shape ("4", "2x2"), optionally with ":<ns_dtype>" ("2:bfloat16"; default float32).

usage: torchrun --nproc_per_node=W muon_worker.py OUT 4 2x2 4:bfloat16 ...
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: conftest.py

from conftest import matrices_in, newton_schulz_calls  # noqa: E402

from unmask.optim import MuonAdamW  # noqa: E402
from unmask.parallel.mesh import end_process  # noqa: E402

STEPS = 5
#: (rows, cols): rows below the world size leave ranks with zero rows; 7 and 18 are uneven;
#: three 16 x 16 matrices share a shape (batched NS), 5 x 12 is wide, 20 x 6 tall.
SHAPES = [(16, 16), (3, 8), (7, 12), (18, 10), (16, 16), (5, 12), (20, 6), (16, 16)]
#: a 3-D expert stack (Muon per expert); 3 experts leave a rank of 4 with none
EXPERTS = (3, 6, 10)
OPTIM = dict(lr=0.02, weight_decay=0.1, ns_dtype="float32", verbose=False)


class Block(nn.Module):
    def __init__(self, rows: int, cols: int):
        super().__init__()
        self.proj = nn.Linear(cols, rows, bias=True)
        self.norm = nn.RMSNorm(rows)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(Block(r, c) for r, c in SHAPES)
        self.experts = nn.Module()
        self.experts.w = nn.Parameter(torch.randn(EXPERTS) * 0.1)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def full_grads(net: nn.Module, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in net.named_parameters()}


def run(mesh_shape: tuple[int, ...], ns_dtype: str) -> tuple[dict[str, torch.Tensor], int]:
    names = ("dp_replicate", "dp_shard") if len(mesh_shape) == 2 else ("dp_shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    net = make_net()
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = MuonAdamW(net, **{**OPTIM, "ns_dtype": ns_dtype})
    with newton_schulz_calls() as calls:
        for step in range(STEPS):
            grads = full_grads(net, step)
            for name, p in net.named_parameters():
                p.grad = distribute_tensor(grads[name], p.device_mesh, p.placements)
            opt.step()
            opt.zero_grad()
    # NS calls inside one shard group; replicas repeat them without talking
    total = torch.tensor([matrices_in(calls)])
    dist.all_reduce(total)
    replicas = mesh_shape[0] if len(mesh_shape) == 2 else 1
    params = {n: p.full_tensor() for n, p in net.named_parameters()}
    return params, int(total.item()) // replicas


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    for spec in sys.argv[2:]:
        mesh_spec, _, ns_dtype = spec.partition(":")
        shape = tuple(int(v) for v in mesh_spec.split("x"))
        params, ns_matrices = run(shape, ns_dtype or "float32")
        if dist.get_rank() == 0:
            torch.save({"params": params, "ns_matrices": ns_matrices}, f"{out}/{spec}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process(0)
