"""Run under torchrun (gloo, CPU, 2 processes): per-head Muon on a sharded native decoder.

For each layout given, split a fresh tiny decoder over the two ranks, give every parameter
the same seeded full gradient, take STEPS MuonAdamW(per_head=True) steps, and compare the
gathered parameters with the same optimizer on the unsplit model in this process:

* ``dp2``: FSDP2 (Shard(0) rows) on a decoder of 3 query heads and 1 key/value head of
  8 rows each, so the rank boundary (row 12 of 24) cuts a query head in two: the owner
  of a matrix holds it whole and splits it into heads there;
* ``tp2``: tensor parallelism on a decoder of 4 query and 2 key/value heads (q/k/v split
  by whole heads over the tp ranks, o_proj and down_proj by columns).

Rank 0 writes {layout: {"max_abs_diff", "bitwise", "ns_matrices", "expected_ns"}} to
OUT.json: ns_matrices counts the matrices Newton-Schulz saw in one step over both ranks
(each head once), expected_ns what one process sees.

usage: torchrun --nproc_per_node=2 muon_per_head_worker.py OUT.json dp2 tp2
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: conftest.py

from conftest import matrices_in, newton_schulz_calls, tiny_model  # noqa: E402

from unmask.models import decoder_layers  # noqa: E402
from unmask.optim import MuonAdamW  # noqa: E402
from unmask.parallel.dims import ParallelDims  # noqa: E402
from unmask.parallel.fsdp import apply_fsdp  # noqa: E402
from unmask.parallel.mesh import end_process  # noqa: E402
from unmask.parallel.tensor import apply_tensor_parallel  # noqa: E402

STEPS = 3
OPTIM = dict(lr=0.02, weight_decay=0.1, ns_dtype="float32", per_head=True, verbose=False)
LAYOUTS = {"dp2": ParallelDims(dp_shard=2), "tp2": ParallelDims(tp=2)}
MODELS = {
    "dp2": dict(hidden_size=24, num_attention_heads=3, num_key_value_heads=1),
    "tp2": dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2),
}


def make_model(layout: str):
    return tiny_model(vocab_size=64, intermediate_size=48, **MODELS[layout])


def full_grads(model, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def reference(layout: str) -> tuple[dict[str, torch.Tensor], int]:
    model = make_model(layout)
    opt = MuonAdamW(model, **OPTIM)
    with newton_schulz_calls() as calls:
        for step in range(STEPS):
            for name, p in model.named_parameters():
                p.grad = full_grads(model, step)[name]
            opt.step()
            opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, matrices_in(calls) // STEPS


def run(layout: str) -> tuple[dict[str, torch.Tensor], int]:
    mesh = LAYOUTS[layout].build_mesh(torch.device("cpu"))
    model = make_model(layout)
    if LAYOUTS[layout].tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    apply_fsdp(model, LAYOUTS[layout].fsdp_mesh(mesh), decoder_layers(model))
    opt = MuonAdamW(model, **OPTIM)
    with newton_schulz_calls() as calls:
        for step in range(STEPS):
            grads = full_grads(model, step)
            for name, p in model.named_parameters():
                whole = distribute_tensor(grads[name], p.device_mesh,
                                          [Replicate()] * p.device_mesh.ndim)  # fmt: skip
                p.grad = whole.redistribute(p.device_mesh, p.placements)
            opt.step()
            opt.zero_grad()
    total = torch.tensor([matrices_in(calls)])
    dist.all_reduce(total)
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return params, int(total.item()) // STEPS


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results = {}
    for layout in sys.argv[2:]:
        got, ns_matrices = run(layout)
        want, expected = reference(layout)
        diffs = [(got[n] - want[n]).abs().max().item() for n in want]
        results[layout] = {
            "max_abs_diff": max(diffs),
            "bitwise": all(torch.equal(got[n], want[n]) for n in want),
            "same_names": sorted(got) == sorted(want),
            "ns_matrices": ns_matrices,
            "expected_ns": expected,
        }
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process(0)
