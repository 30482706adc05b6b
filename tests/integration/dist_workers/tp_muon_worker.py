"""Run under torchrun (gloo, CPU): one MuonAdamW step on a tensor-parallel native decoder.

For each layout given ("tp4", "dp2xtp2", "dp4"), split a fresh copy of a tiny decoder over
the mesh (TP, then FSDP2 on the data-parallel dims, as the trainer does), give every
parameter the same seeded full gradient, take STEPS optimizer steps, and compare the
gathered parameters with MuonAdamW's on the unsplit model in this process. Rank 0 writes
{layout: {"max_abs_diff", "bitwise", "ns_matrices", "muon_matrices"}} to OUT.json.

"paths-<layout>[:<ns_dtype>]" runs the layout twice, through the owner all-to-all of every
rank's own block (the default) and through the previous path (the private switch
unmask.optim.distributed._REDISTRIBUTE_SPLIT_MATRICES: DTensor redistributes each split
matrix into rows first), and counts the bytes each sends in the last step (`wire_bytes`);
it writes {"paths-...": {"equal", "bitwise", "new", "old", "formula", "matrices_bytes",
"world"}}.

usage: torchrun --nproc_per_node=4 tp_muon_worker.py OUT.json tp4 dp2xtp2 paths-tp4
"""

import contextlib
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: conftest.py

from conftest import matrices_in, newton_schulz_calls, tiny_model  # noqa: E402
from plan_worker import collective_bytes  # noqa: E402

import unmask.optim.distributed as muon_distributed  # noqa: E402
from unmask.models import decoder_layers  # noqa: E402
from unmask.optim import MuonAdamW  # noqa: E402
from unmask.parallel.dims import ParallelDims  # noqa: E402
from unmask.parallel.fsdp import apply_fsdp  # noqa: E402
from unmask.parallel.mesh import end_process  # noqa: E402
from unmask.parallel.tensor import apply_tensor_parallel  # noqa: E402

STEPS = 2
OPTIM = dict(lr=0.02, weight_decay=0.1, ns_dtype="float32", verbose=False)
#: the tiny model with 64 tokens and 4 query and 4 key/value heads (tp=4 splits both)
SPLIT = {"vocab_size": 64, "num_key_value_heads": 4}
LAYOUTS = {
    "tp2": ParallelDims(tp=2),
    "tp4": ParallelDims(tp=4),
    "dp2xtp2": ParallelDims(dp_shard=2, tp=2),
    "dp4": ParallelDims(dp_shard=4),
    "rep2xtp2": ParallelDims(dp_replicate=2, tp=2),
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


def run(layout: ParallelDims, ns_dtype: str = "float32",
        count=None) -> tuple[dict[str, torch.Tensor], int, int, MuonAdamW]:  # fmt: skip
    """STEPS steps on the split model; ``count`` (a context manager factory) wraps the
    last optimizer step."""
    mesh = layout.build_mesh(torch.device("cpu"))
    model = make_model()
    if layout.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    apply_fsdp(model, layout.fsdp_mesh(mesh), decoder_layers(model))
    opt = MuonAdamW(model, **{**OPTIM, "ns_dtype": ns_dtype})
    with newton_schulz_calls() as calls:
        for step in range(STEPS):
            grads = full_grads(model, step)
            for name, p in model.named_parameters():
                replicated = [Replicate()] * p.device_mesh.ndim
                whole = distribute_tensor(grads[name], p.device_mesh, replicated)
                p.grad = whole.redistribute(p.device_mesh, p.placements)
            with count() if count and step == STEPS - 1 else contextlib.nullcontext():
                opt.step()
            opt.zero_grad()
    total = torch.tensor([matrices_in(calls)])
    dist.all_reduce(total)
    muon = sum(1 for g in opt.param_groups if g["use_muon"] for _ in g["params"])
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return params, int(total.item()) // layout.dp_replicate // STEPS, muon, opt


class WireBytes:
    """Bytes this rank sends to other ranks inside the block, from the collectives' own
    tensors: each all_to_all_single's send buffer less the split addressed to this rank
    (recorded per call: the owner all-to-all's even calls carry NS inputs, odd ones the
    updates), and each all-gather DTensor issues, (group size - 1) x the shard it hands in
    (torch.profiler's _c10d_functional::all_gather_into_tensor events, which carry the
    group size). ``kinds``: the c10d collectives seen (plan_worker's counter)."""

    def __init__(self):
        self.all_to_all: list[int] = []
        self.gathers = 0
        self.kinds: dict[str, list[int]] = {}

    @contextlib.contextmanager
    def __call__(self):
        original = dist.all_to_all_single

        def counting(output, input, output_split_sizes=None, input_split_sizes=None,
                     group=None, async_op=False):  # fmt: skip
            own = input_split_sizes[dist.get_rank(group)]
            self.all_to_all.append((input.numel() - own) * input.element_size())
            return original(output, input, output_split_sizes, input_split_sizes,
                            group=group, async_op=async_op)  # fmt: skip

        dist.all_to_all_single = counting
        activities = [torch.profiler.ProfilerActivity.CPU]
        try:
            with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
                yield self
        finally:
            dist.all_to_all_single = original
        sizes = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2}
        for event in prof.events():
            if event.name == "_c10d_functional::all_gather_into_tensor":
                group_size = event.concrete_inputs[1]
                dtype = sizes[event.input_dtypes[0]]
                self.gathers += (group_size - 1) * math.prod(event.input_shapes[0]) * dtype
        self.kinds = collective_bytes(prof)

    def totals(self) -> dict[str, int]:
        """{"out", "back", "gathers", "total"}: summed over every rank of the world."""
        mine = torch.tensor([sum(self.all_to_all[0::2]), sum(self.all_to_all[1::2]),
                             self.gathers])  # fmt: skip
        dist.all_reduce(mine)
        out, back, gathers = (int(v) for v in mine)
        return {"out": out, "back": back, "gathers": gathers, "total": out + back + gathers}


def paths(spec: str) -> dict:
    """The default owner all-to-all against the previous path, on one layout without
    replicas (its owner group is the whole world)."""
    name, _, ns_dtype = spec.removeprefix("paths-").partition(":")
    ns_dtype = ns_dtype or "float32"
    layout = LAYOUTS[name]
    counted = {}
    params = {}
    for which, switch in (("new", False), ("old", True)):
        muon_distributed._REDISTRIBUTE_SPLIT_MATRICES = switch
        counter = WireBytes()
        try:
            params[which], ns_matrices, muon, opt = run(layout, ns_dtype, counter)
        finally:
            muon_distributed._REDISTRIBUTE_SPLIT_MATRICES = False
        counted[which] = {**counter.totals(), "kinds": counter.kinds, "ns_matrices": ns_matrices}
        if which == "new":  # the formula: OwnerPlan.wire_elements of every rank of the group
            itemsize = torch.empty(0, dtype=getattr(torch, ns_dtype)).element_size()
            formula = [0, 0]
            for plan, moved in opt.owner_plans.values():
                assert not any(moved), "a split matrix was redistributed"
                for rank in range(plan.world_size):
                    out, back = plan.wire_elements(rank)
                    formula = [formula[0] + out * itemsize, formula[1] + back * itemsize]
            matrices = sum(p.numel() for g in opt.param_groups if g["use_muon"]
                           for p in g["params"]) * itemsize  # fmt: skip
    # the one-process reference runs float32 NS (bfloat16 compares the two paths only)
    expected = reference() if ns_dtype == "float32" else {}
    return {
        "world": dist.get_world_size(),
        "equal": all(torch.equal(params["new"][k], v) for k, v in params["old"].items()),
        "bitwise": bool(expected)
        and all(torch.equal(params["new"][k], v) for k, v in expected.items()),  # fmt: skip
        "new": counted["new"],
        "old": counted["old"],
        "formula": {"out": formula[0], "back": formula[1]},
        "matrices_bytes": matrices,
        "muon_matrices": muon,
    }


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
        mesh = ParallelDims(tp=dist.get_world_size()).build_mesh(torch.device("cpu"))["tp"]
        families = ("qwen3_dllm", "qwen2_dllm", "llama_dllm", "dream", "llada")
        results["families"] = {family: family_forward(family, mesh) for family in families}
    for name in [n for n in sys.argv[2:] if n.startswith("paths-")]:
        results[name] = paths(name)
    for name in [n for n in sys.argv[2:] if n != "families" and not n.startswith("paths-")]:
        params, ns_matrices, muon, _ = run(LAYOUTS[name])
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
    end_process(0)
