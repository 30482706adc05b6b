"""Run under torchrun (gloo, CPU): one MuonAdamW step on a tensor-parallel native decoder.

For each layout given ("tp4", "dp2xtp2", "dp4"), split a fresh copy of a tiny decoder over
the mesh (TP, then FSDP2 on the data-parallel dims, as the trainer does), give every
parameter the same seeded full gradient, take STEPS optimizer steps, and compare the
gathered parameters with MuonAdamW's on the unsplit model in this process. Rank 0 writes
{layout: {"max_abs_diff", "bitwise", "ns_matrices", "muon_matrices"}} to OUT.json.

usage: torchrun --nproc_per_node=4 tp_muon_worker.py OUT.json tp4 dp2xtp2
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: conftest.py

from conftest import matrices_in, newton_schulz_calls, tiny_model  # noqa: E402

from unmask.models.transformer import decoder_layers  # noqa: E402
from unmask.optim import MuonAdamW  # noqa: E402
from unmask.parallel.fsdp import apply_fsdp  # noqa: E402
from unmask.parallel.mesh import MeshLayout, build_mesh, fsdp_mesh  # noqa: E402
from unmask.parallel.tensor import apply_tensor_parallel  # noqa: E402

STEPS = 2
OPTIM = dict(lr=0.02, weight_decay=0.1, ns_dtype="float32", verbose=False)
#: the tiny model with 64 tokens and 4 query and 4 key/value heads (tp=4 splits both)
SPLIT = {"vocab_size": 64, "num_key_value_heads": 4}
LAYOUTS = {
    "tp4": MeshLayout(tp=4),
    "dp2xtp2": MeshLayout(dp_shard=2, tp=2),
    "dp4": MeshLayout(dp_shard=4),
    "rep2xtp2": MeshLayout(dp_replicate=2, tp=2),
}


def make_model():
    """Biases on q/k/v (Qwen2 / Dream) and q/k norms (Qwen3) at once, so every kind of split
    parameter is stepped."""
    return tiny_model(**SPLIT, qkv_bias=True, qk_norm=True)


def full_grads(model, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def reference() -> dict[str, torch.Tensor]:
    model = make_model()
    opt = MuonAdamW(model, **OPTIM)
    for step in range(STEPS):
        for name, p in model.named_parameters():
            p.grad = full_grads(model, step)[name]
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run(layout: MeshLayout) -> tuple[dict[str, torch.Tensor], int, int]:
    mesh = build_mesh(torch.device("cpu"), layout)
    model = make_model()
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    apply_fsdp(model, fsdp_mesh(mesh), decoder_layers(model))
    opt = MuonAdamW(model, **OPTIM)
    with newton_schulz_calls() as calls:
        for step in range(STEPS):
            grads = full_grads(model, step)
            for name, p in model.named_parameters():
                replicated = [Replicate()] * p.device_mesh.ndim
                whole = distribute_tensor(grads[name], p.device_mesh, replicated)
                p.grad = whole.redistribute(p.device_mesh, p.placements)
            opt.step()
            opt.zero_grad()
    total = torch.tensor([matrices_in(calls)])
    dist.all_reduce(total)
    muon = sum(1 for g in opt.param_groups if g["use_muon"] for _ in g["params"])
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return params, int(total.item()) // layout.dp_replicate // STEPS, muon


def family_forward(family: str, mesh) -> float:
    """Largest relative difference, over the per-token losses and every gradient, between
    ``family``'s tiny decoder split over ``mesh`` (1-D tp) and the unsplit one."""
    plain = tiny_model(model_type=family, **SPLIT)
    split = apply_tensor_parallel(tiny_model(model_type=family, **SPLIT), mesh)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (2, 12), generator=gen)
    targets = torch.where(torch.rand(2, 12, generator=gen) < 0.5, ids, -100)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])  # packed rows keep their masks
    want, got = plain(ids, doc_ids, targets=targets), split(ids, doc_ids, targets=targets)
    want.sum().backward()
    got.sum().backward()
    worst = ((got - want).abs().max() / want.abs().max()).item()
    for p, q in zip(plain.parameters(), split.parameters()):
        grad = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
        worst = max(worst, ((grad - p.grad).norm() / p.grad.norm()).item())
    return worst


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    expected = reference()
    results = {}
    if "families" in sys.argv[2:]:
        mesh = build_mesh(torch.device("cpu"), MeshLayout(tp=dist.get_world_size()))["tp"]
        families = ("qwen3_dllm", "qwen2_dllm", "llama_dllm", "dream", "llada")
        results["families"] = {family: family_forward(family, mesh) for family in families}
    for name in [n for n in sys.argv[2:] if n != "families"]:
        params, ns_matrices, muon = run(LAYOUTS[name])
        diffs = [(params[k] - v).abs().max().item() for k, v in expected.items()]
        results[name] = {
            "max_abs_diff": max(diffs),
            "bitwise": all(torch.equal(params[k], v) for k, v in expected.items()),
            "ns_matrices": ns_matrices,
            "muon_matrices": muon,
        }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
