"""Distributed Muon on FSDP2 (gloo, CPU processes): what one optimizer step sends and computes.

Three ways to run Muon on Shard(0) DTensor parameters, on the same matrices and gradients:

(a) unmask's owner all-to-all (MuonAdamW's DTensor path): each matrix has one owner rank; one
    bf16 all-to-all brings it the rows, NS runs once there, one all-to-all returns the rows.
(b) gather every full matrix on every rank (the LlamaFactory v2 approach): all-gather the fp32
    NS input, every rank runs NS on every matrix and keeps its rows.
(c) torch.optim.Muon applied to the DTensors directly: DTensor dispatch inserts its own
    collectives inside Newton-Schulz (counted, not designed).

Per rank and step we report bytes sent to other ranks and NS FLOPs, next to the predictions
(P_M = Muon elements, W = world size): (a) 2 * 2 B * (W - 1) / W^2 * P_M ~ 4 P_M / W bytes and
1/W of the NS FLOPs; (b) (W - 1) / W * P_M * 4 B and all NS FLOPs. Bytes sent per collective:
all-to-all = everything not addressed to oneself, all-gather = (W - 1) x own shard, all-reduce =
2 (W - 1) / W x tensor (ring), reduce-scatter = (W - 1) / W x input. NS FLOPs use
``newton_schulz.ns_flops`` on the matrices each rank orthogonalizes; for (c) the matmuls run on
DTensors and are not split per rank, so only the collective count is shown.
Wall time: median optimizer step over repeats (max over ranks), ratios (a)/(b) and (a)/(c).

Matrices: the Muon matrices of a small qwen3_dllm (hidden 128, intermediate 384, 4 heads / 2 KV
heads of 32, 2 layers). bf16 NS for all three (torch.optim.Muon only has bf16).

Tensor parallelism (tp=2 on 2 processes, tp=4 on 4): the same model with 4 KV heads, split by
parallel/tensor.py and then FSDP2 (a size-1 dp_shard dim), as the trainer lays it out, with
MuonAdamW (float32 NS: this CPU has no native bf16 matmuls) against its previous path (the
private switch ``_REDISTRIBUTE_SPLIT_MATRICES``: DTensor redistributes each split matrix into
rows before the owner all-to-all, on gloo an all-gather of the whole matrix, and the update
back). Bytes moved per step: bytes sent to other ranks, summed over the ranks, from the
collectives' own tensors (each all-to-all's send buffer less the split a rank addresses to
itself; each DTensor all-gather (W - 1) x its input), split into the NS inputs' trip to the
owners, the updates' trip back and the all-gathers; the formula is (W - 1) / W of the Muon
matrices' bytes each way. Time: the whole optimizer step (AdamW's parameters included), max
over ranks, median of the steps of a round; rounds interleave the two paths (rotated order),
and the table gives the median over rounds with its min-max spread.

Run: python benchmarks/distributed_muon.py   (launches torchrun with 2 and 4 processes and
writes benchmarks/results/distributed_muon.md; ~2 minutes on 2 cores)
     python benchmarks/distributed_muon.py --quick   (2 processes, one timed step, tp=2 one
     round; prints, writes nothing)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import RESULTS, machine, rotated, run_workers, with_spread, write_report
from torch import nn

REPORT = RESULTS / "distributed_muon.md"
REPEATS = 5
LR, WD = 0.02, 0.1


def muon_shapes() -> list[torch.Size]:
    from unmask.models.config import ModelConfig
    from unmask.models.transformer import DiffusionTransformer
    from unmask.optim.routing import route_parameters

    cfg = ModelConfig(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=256,
    )
    with torch.device("meta"):
        model = DiffusionTransformer(cfg)
    return [p.shape for _, p in route_parameters(model).muon]


class Matrices(nn.Module):
    """Only hidden matrices (all routed to Muon), one FSDP unit per matrix."""

    def __init__(self, shapes):
        super().__init__()
        self.mats = nn.ModuleList(nn.Linear(s[1], s[0], bias=False) for s in shapes)


# ------------------------------------------------------------------ accounting


class Counter:
    bytes_sent = 0
    collectives = 0
    ns_flops = 0

    @classmethod
    def reset(cls):
        cls.bytes_sent = cls.collectives = cls.ns_flops = 0


def _count_ns(original):
    from unmask.optim.newton_schulz import ns_flops

    def counting(x, *args, **kwargs):
        n = x.reshape(-1, *x.shape[-2:]).shape[0]
        Counter.ns_flops += n * ns_flops(x.shape[-2], x.shape[-1])
        return original(x, *args, **kwargs)

    return counting


def _count_all_to_all(original):
    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        rank = dist.get_rank(group)
        own = (
            input_split_sizes[rank] if input_split_sizes else input.numel() // dist.get_world_size()
        )
        Counter.bytes_sent += (input.numel() - own) * input.element_size()
        Counter.collectives += 1
        return original(output, input, output_split_sizes, input_split_sizes, group=group)

    return counting


def count_functional_collectives() -> None:
    """Wrap the c10d functional collectives DTensor issues, with the byte model above."""
    import torch.distributed._functional_collectives as funcol

    def wrap(name, original):
        def counting(tensor, *args, **kwargs):
            world = dist.get_world_size()
            size = tensor.numel() * tensor.element_size()
            if name == "all_reduce":
                Counter.bytes_sent += 2 * (world - 1) * size // world
            elif name == "all_gather_tensor":
                Counter.bytes_sent += (world - 1) * size
            else:  # reduce_scatter_tensor, all_to_all_single
                Counter.bytes_sent += (world - 1) * size // world
            Counter.collectives += 1
            return original(tensor, *args, **kwargs)

        return counting

    for name in ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single"):
        setattr(funcol, name, wrap(name, getattr(funcol, name)))


# ------------------------------------------------------------------ method (b)


class GatherMuon(torch.optim.Optimizer):
    """Muon by gathering every whole matrix on every rank (fp32 all-gather, NS everywhere)."""

    def __init__(self, params):
        super().__init__(params, {"lr": LR})

    @torch.no_grad()
    def step(self):
        from unmask.optim.newton_schulz import coefficient_schedule
        from unmask.optim.updates import apply_muon_update_, lr_scale, muon_ns_input

        world, rank = dist.get_world_size(), dist.get_rank()
        for p in self.param_groups[0]["params"]:
            state = self.state[p]
            if "m" not in state:
                state["m"] = torch.zeros_like(p.to_local())
            u = muon_ns_input(state["m"], p.grad.to_local(), 0.95, True, "sum")
            rows = -(-p.shape[0] // world)
            padded = torch.zeros(rows, p.shape[1])
            padded[: u.shape[0]] = u
            full = torch.empty(rows * world, p.shape[1])
            Counter.bytes_sent += (world - 1) * padded.numel() * padded.element_size()
            Counter.collectives += 1
            dist.all_gather_into_tensor(full, padded)
            full = full[: p.shape[0]]
            schedule = coefficient_schedule("jordan", 5)
            update = NEWTON_SCHULZ(full, schedule, dtype=torch.bfloat16)
            start = min(rank * rows, p.shape[0])
            mine = update[start : start + u.shape[0]].to(p.dtype)
            apply_muon_update_([p.to_local()], [mine], LR, WD, lr_scale(p.shape, "match_rms_adamw"))


NEWTON_SCHULZ = None


# ------------------------------------------------------------------ worker


def worker(out: str, repeats: int) -> None:
    global NEWTON_SCHULZ
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    import unmask.optim.updates as muon_updates
    from unmask.optim import MuonAdamW
    from unmask.optim.newton_schulz import newton_schulz

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    shapes = muon_shapes()
    muon_updates.newton_schulz = _count_ns(newton_schulz)
    NEWTON_SCHULZ = _count_ns(newton_schulz)
    dist.all_to_all_single = _count_all_to_all(dist.all_to_all_single)
    count_functional_collectives()

    def build(kind):
        torch.manual_seed(0)
        model = Matrices(shapes)
        for m in model.mats:
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), mesh, p.placements)
        if kind == "a":
            opt = MuonAdamW(model, lr=LR, weight_decay=WD, ns_dtype="bfloat16", verbose=False)
        elif kind == "b":
            opt = GatherMuon(model.parameters())
        else:
            opt = torch.optim.Muon(
                model.parameters(), lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw"
            )
        return opt

    results = {}
    for kind in ("a", "b", "c"):
        opt = build(kind)
        opt.step()  # warm-up (state allocation, owner plan)
        Counter.reset()
        opt.step()
        counts = (Counter.bytes_sent, Counter.collectives, Counter.ns_flops)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(elapsed.item())
        gathered = [None] * world
        dist.all_gather_object(gathered, counts)
        results[kind] = {
            "bytes": [g[0] for g in gathered],
            "collectives": [g[1] for g in gathered],
            "ns_flops": [g[2] for g in gathered],
            "step_s": statistics.median(times),
        }
    if rank == 0:
        from unmask.optim.newton_schulz import ns_flops

        p_m = sum(s[0] * s[1] for s in shapes)
        total = sum(ns_flops(s[0], s[1]) for s in shapes)
        payload = {"world": world, "P_M": p_m, "ns_total": total, "methods": results}
        Path(out).write_text(json.dumps(payload))
    _tear_down()


# ------------------------------------------------------------------ tensor parallelism


def tp_model():
    """The benchmark's qwen3_dllm with 4 KV heads (tp=4 splits them), split over tp by
    parallel/tensor.py and then FSDP2, as the trainer does."""
    from unmask.models.config import ModelConfig
    from unmask.models.transformer import DiffusionTransformer

    cfg = ModelConfig(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        vocab_size=256,
    )
    torch.manual_seed(0)
    return DiffusionTransformer(cfg)


def gathered_bytes(prof) -> int:
    """Bytes this rank sent in DTensor's all-gathers: (group size - 1) x the input of each
    _c10d_functional::all_gather_into_tensor the profiler saw (the op carries the group
    size; it is what DTensor's redistribute issues)."""
    sizes = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2}
    total = 0
    for event in prof.events():
        if event.name == "_c10d_functional::all_gather_into_tensor":
            numel = 1
            for d in event.input_shapes[0]:
                numel *= d
            total += (event.concrete_inputs[1] - 1) * numel * sizes[event.input_dtypes[0]]
    return total


def tp_worker(out: str, rounds: int, steps: int) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    import unmask.optim.distributed as muon_distributed
    from unmask.models import decoder_layers
    from unmask.optim import MuonAdamW
    from unmask.parallel.dims import ParallelDims
    from unmask.parallel.fsdp import apply_fsdp
    from unmask.parallel.tensor import apply_tensor_parallel

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims(tp=world)
    mesh = dims.build_mesh(torch.device("cpu"))
    sent: list[int] = []  # per owner all-to-all: bytes to other ranks (even: out, odd: back)
    original_a2a = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                 async_op=False):  # fmt: skip
        own = input_split_sizes[dist.get_rank(group)]
        sent.append((input.numel() - own) * input.element_size())
        return original_a2a(output, input, output_split_sizes, input_split_sizes, group=group,
                            async_op=async_op)  # fmt: skip

    dist.all_to_all_single = counting

    def build():
        model = tp_model()
        apply_tensor_parallel(model, mesh["tp"])
        apply_fsdp(model, dims.fsdp_mesh(mesh), decoder_layers(model))
        gen = torch.Generator().manual_seed(1)
        for p in model.parameters():
            whole = torch.randn(p.shape, generator=gen)
            replicated = distribute_tensor(whole, p.device_mesh, [Replicate()] * p.device_mesh.ndim)
            p.grad = replicated.redistribute(p.device_mesh, p.placements)
        return MuonAdamW(model, lr=LR, weight_decay=WD, ns_dtype="float32", verbose=False)

    def step(opt, old: bool) -> float:
        muon_distributed._REDISTRIBUTE_SPLIT_MATRICES = old
        try:
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start])
        finally:
            muon_distributed._REDISTRIBUTE_SPLIT_MATRICES = False
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    opts = {"new": build(), "old": build()}
    counts = {}
    for name, opt in opts.items():
        step(opt, name == "old")  # warm-up: state, owner plan, flattened group
        sent.clear()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    record_shapes=True) as prof:  # fmt: skip
            step(opt, name == "old")
        mine = torch.tensor([sum(sent[0::2]), sum(sent[1::2]), gathered_bytes(prof)])
        dist.all_reduce(mine)
        counts[name] = [int(v) for v in mine]
    times: dict[str, list[float]] = {"new": [], "old": []}
    for r in range(rounds):
        for name in rotated(["new", "old"], r):
            times[name].append(statistics.median(step(opts[name], name == "old")
                                                 for _ in range(steps)))  # fmt: skip
    if rank == 0:
        matrices = sum(p.numel() for g in opts["new"].param_groups if g["use_muon"]
                       for p in g["params"]) * 4  # fmt: skip
        payload = {"world": world, "matrices_bytes": matrices, "bytes": counts, "times": times}
        Path(out).write_text(json.dumps(payload))
    _tear_down()


def _tear_down() -> None:
    """Every rank done (rank 0 has written the results) before any closes its gloo pairs.
    Without the barrier a rank aborted at the end of the first launch in 2 of 22 runs of
    --quick on the 2-core CI machine ("terminate called without an active exception",
    SIGABRT); a rank tearing down while its peer still works is the suspected cause."""
    dist.barrier()
    dist.destroy_process_group()


def tp_table(run: dict) -> list[str]:
    w, size = run["world"], run["matrices_bytes"]
    share = (w - 1) / w
    rows = [
        f"tp = {w} ({w} processes), Muon matrices {size:,} bytes (float32), "
        f"(W - 1) / W of them = {share * size:,.0f} bytes",
        "",
        "| path | to owners (x (W-1)/W matrices) | back | all-gathers | total (x (W-1)/W "
        "matrices) | step time, median (min-max) over rounds |",
        "|---|---|---|---|---|---|",
    ]
    names = {"new": "owner all-to-all of each rank's block (now)",
             "old": "redistribute into rows, then owner all-to-all (before)"}  # fmt: skip
    for name in ("new", "old"):
        out, back, gathers = run["bytes"][name]
        total = out + back + gathers
        rows.append(f"| {names[name]} | {out:,} ({out / (share * size):.2f}x) | {back:,} | "
                    f"{gathers:,} | {total:,} ({total / (share * size):.2f}x) | "
                    f"{with_spread([t * 1e3 for t in run['times'][name]], '{:.1f}')} ms |")  # fmt: skip
    ratio = [a / b for a, b in zip(run["times"]["new"], run["times"]["old"])]
    rows += ["", f"Step time now / before (per round): {with_spread(ratio)}; "
             f"{len(ratio)} rounds."]  # fmt: skip
    return rows


# ------------------------------------------------------------------ report


def table(run: dict) -> list[str]:
    w, p_m, total = run["world"], run["P_M"], run["ns_total"]
    predicted = {"a": (4 * (w - 1) / w**2 * p_m, total / w), "b": ((w - 1) / w * p_m * 4, total)}
    names = {
        "a": "(a) unmask owner all-to-all",
        "b": "(b) gather full matrices (LlamaFactory v2)",
        "c": "(c) torch.optim.Muon on DTensors",
    }
    rows = [
        f"W = {w} processes, P_M = {p_m:,} Muon elements, NS total {total / 1e6:.1f} MFLOP/step",
        "",
        "| method | bytes sent / rank (max) | predicted | NS MFLOP / rank (max) | predicted "
        "| collectives / rank | step time | time (a) / this |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ta = run["methods"]["a"]["step_s"]
    for kind, m in run["methods"].items():
        pb, pf = predicted.get(kind, (None, None))
        flops = f"{max(m['ns_flops']) / 1e6:.1f}" if kind != "c" else "n/a (DTensor)"
        rows.append(
            f"| {names[kind]} | {max(m['bytes']):,} | {f'{pb:,.0f}' if pb else '-'} | {flops} | "
            f"{f'{pf / 1e6:.1f}' if pf else '-'} | {max(m['collectives'])} | "
            f"{m['step_s'] * 1e3:.1f} ms | {ta / m['step_s']:.2f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tp-worker", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (tp)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round (tp)")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed steps per method")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 processes, 1 timed step; prints, writes no file")  # fmt: skip
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.repeats)
        return
    if args.tp_worker:
        tp_worker(args.tp_worker, args.rounds, args.steps)
        return
    if args.quick:
        args.worlds, args.repeats, args.rounds, args.steps = "2", 1, 1, 1
    lines = [
        "# Distributed Muon: bytes, NS FLOPs and step time per rank",
        "",
        "`python benchmarks/distributed_muon.py` (gloo, CPU processes, one thread each).",
        "",
    ]
    for w in (int(v) for v in args.worlds.split(",")):
        out = RESULTS / f".distributed_muon_{w}.json"
        run_workers(w, __file__, "--worker", out, "--repeats", args.repeats, timeout=1800,
                    env={"OMP_NUM_THREADS": "1"})  # fmt: skip
        lines += table(json.loads(out.read_text())) + [""]
        out.unlink()
    lines += ["## Under tensor parallelism: bytes moved per step and step time", "",
              f"Machine: {machine('torch')}.", ""]  # fmt: skip
    for w in (int(v) for v in args.worlds.split(",")):
        out = RESULTS / f".distributed_muon_tp{w}.json"
        run_workers(w, __file__, "--tp-worker", out, "--rounds", args.rounds, "--steps",
                    args.steps, timeout=1800, env={"OMP_NUM_THREADS": "1"})  # fmt: skip
        lines += tp_table(json.loads(out.read_text())) + [""]
        out.unlink()
    text = "\n".join(lines)
    write_report(text, None if args.quick else REPORT)
    print(text)


if __name__ == "__main__":
    main()
