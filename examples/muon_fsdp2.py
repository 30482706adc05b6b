"""MuonAdamW in your own training loop under torchrun: FSDP2 (`--layout fsdp2`, the default)
or tensor parallelism (`--layout tp`) over the launched processes, a toy MLP regressor, 30
steps; each process prints its loss, rank 0 checks that it fell. docs/muon.md.

    torchrun --standalone --nproc_per_node=2 examples/muon_fsdp2.py
    torchrun --standalone --nproc_per_node=2 examples/muon_fsdp2.py --layout tp

`--optimizer-first` makes the optimizer before fully_shard, the mistake MuonAdamW refuses
at the first step (fully_shard replaces the model's parameters with sharded ones: an
optimizer made before holds the old ones, which never get a gradient).
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from unmask.errors import InputError
from unmask.optim import MuonAdamW
from unmask.parallel.mesh import end_process


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 64)  # the input layer: AdamW
        self.up = nn.Linear(64, 256)  # hidden matrices: Muon
        self.down = nn.Linear(256, 64)
        self.head = nn.Linear(64, 4)  # the output layer: AdamW

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(torch.relu(self.embed(x))))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["fsdp2", "tp"], default="fsdp2")
    parser.add_argument("--optimizer-first", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same weights on every process
    model = MLP()
    if args.optimizer_first:  # the mistake: the parameters it holds will not train
        optimizer = MuonAdamW(model, lr=0.02, verbose=False)
    if args.layout == "tp":  # up split by output rows, down by input columns
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    else:
        fully_shard(model, mesh=mesh)
    if not args.optimizer_first:  # after fully_shard: it holds the parameters that train
        optimizer = MuonAdamW(model, lr=0.02, verbose=dist.get_rank() == 0)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=data)
    y = torch.randn(64, 4, generator=data)
    losses = []
    for _ in range(30):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    line = f"rank {dist.get_rank()} ({args.layout}): loss {losses[0]:.3f} -> {losses[-1]:.3f}\n"
    sys.stdout.write(line)  # one write: the two processes' lines do not interleave
    sys.stdout.flush()
    if dist.get_rank() == 0:
        assert losses[-1] < 0.7 * losses[0], losses


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        main()
    except InputError as err:  # unmask's refusals: one line, exit 2
        raise SystemExit(f"error: {err}") from None
    # destroy the process group and leave without interpreter finalization, where gloo's
    # threads can abort a run that succeeded (pytorch/pytorch#179291)
    end_process(0)
