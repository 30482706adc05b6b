"""The LM head's memory per rank under tp=2: vocab-parallel head vs the replicated one.

Two CPU gloo processes (one tp group of 2). Each round runs, in rotated order, one forward
and backward of the masked-only loss the trainer's objectives take (`weighted_cross_entropy`:
the head's gradients computed in the forward) on the same N hidden rows, through:

* replicated: every rank holds the whole head (V x H) and computes every logit (the
  layout before the vocab-parallel head: the tp ranks repeat the same work);
* vocab-parallel: each rank holds V / 2 rows of the head as a DTensor split over the tp
  mesh (as parallel/tensor.py leaves it) and the loss assembles the log-sum-exp over the
  ranks (diffusion/loss.py).

The head's peak memory per rank = the head's weight held by the rank + the highest running
total of tensor memory torch's CPU allocator handed out during the forward and backward
(torch.profiler with profile_memory, its raw allocation records in time order: the head's
gradient, the logit blocks, the hidden rows' gradient). Max over ranks; medians over interleaved rounds,
with their spread. The losses and the hidden rows' gradients of the two are compared too.

Run: python benchmarks/vocab_parallel.py          (writes benchmarks/results/vocab_parallel.md)
     python benchmarks/vocab_parallel.py --quick  (one round, smaller vocabulary; prints)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, load_average, machine, publish, rotated, run_workers, with_spread

REPORT = RESULTS / "vocab_parallel.md"
#: Qwen3's vocabulary, a small hidden size (the head's memory is V x H either way), and the
#: masked rows of one micro-batch
VOCAB, HIDDEN, ROWS = 151_936, 256, 512
VARIANTS = ("replicated", "vocab-parallel")
#: the trainer's objectives' fused loss, and the per-token losses (eval, other objectives)
PATHS = ("weighted", "per-token")
TARGET = 0.55


def peak_allocated_bytes(prof) -> int:
    """Highest running total of the CPU allocator's allocations minus frees during the
    profile (bytes), from the profiler's raw memory records in time order. (Summing each
    op's self memory instead misplaces a free that happens in a parent op, such as a
    custom autograd Function freeing its buffers on return.)"""
    from torch.autograd import DeviceType

    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
               and e.device_type() == DeviceType.CPU]  # fmt: skip
    total = peak = 0
    for record in sorted(records, key=lambda e: e.start_ns()):
        total += record.nbytes()
        peak = max(peak, total)
    return peak


def one_pass(variant: str, path: str, mesh, vocab: int, hidden_rows, targets, coef) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from unmask.diffusion.loss import chunked_cross_entropy, weighted_cross_entropy

    gen = torch.Generator().manual_seed(5)
    full = torch.randn(vocab, HIDDEN, generator=gen) * 0.02
    if variant == "replicated":
        weight = torch.nn.Parameter(full)
        local = weight
    else:  # this rank's rows only (DTensor's split), as a DTensor parameter
        rows = -(-vocab // mesh.size())
        start = mesh.get_local_rank() * rows
        piece = full[start : start + rows].clone()
        weight = torch.nn.Parameter(DTensor.from_local(piece, mesh, [Shard(0)]))
        local = weight.to_local()
    del full
    held = local.numel() * local.element_size()
    h = hidden_rows.detach().clone().requires_grad_(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:  # fmt: skip
        started = time.perf_counter()
        if path == "weighted":
            loss = weighted_cross_entropy(h, weight, targets, coef)
        else:
            loss = (chunked_cross_entropy(h, weight, targets) * coef).sum()
        loss.backward()
        seconds = time.perf_counter() - started
    return {"held": held, "peak": peak_allocated_bytes(prof), "seconds": seconds,
            "loss": loss.item(), "grad_hidden": h.grad.clone()}  # fmt: skip


def worker(out: str, rounds: int, vocab: int) -> None:
    import torch
    import torch.distributed as dist

    from unmask.parallel.dims import ParallelDims

    dist.init_process_group("gloo")
    mesh = ParallelDims(tp=dist.get_world_size()).build_mesh(torch.device("cpu"))["tp"]
    gen = torch.Generator().manual_seed(0)  # the same rows on every rank (tp peers)
    hidden_rows = torch.randn(ROWS, HIDDEN, generator=gen)
    targets = torch.randint(0, vocab, (ROWS,), generator=gen)
    coef = torch.rand(ROWS, generator=gen)
    cases = [(v, p) for p in PATHS for v in VARIANTS]
    found = {f"{v}/{p}": [] for v, p in cases}
    grads = {}
    for r in range(rounds):
        for variant, path in rotated(cases, r):
            dist.barrier()
            result = one_pass(variant, path, mesh, vocab, hidden_rows, targets, coef)
            grads[variant, path] = result.pop("grad_hidden")
            found[f"{variant}/{path}"].append(result)
    grad_rel = {}
    for path in PATHS:
        diff = grads["vocab-parallel", path] - grads["replicated", path]
        grad_rel[path] = (diff.norm() / grads["replicated", path].norm()).item()
    mine = {"found": found, "grad_rel": grad_rel}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(every))
    dist.destroy_process_group()


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def report(ranks: list[dict], rounds: int, vocab: int) -> str:
    def per_round(case: str, key) -> list[float]:  # the max over ranks, each round
        return [max(key(rank["found"][case][r]) for rank in ranks) for r in range(rounds)]

    lines = [
        "# Vocab-parallel LM head under tp=2 (benchmarks/vocab_parallel.py)",
        "",
        f"Head {vocab:,} x {HIDDEN} (fp32), {ROWS} masked rows, one forward + backward of the "
        "masked-only loss (weighted: `weighted_cross_entropy`, the trainer's objectives' path; "
        "per-token: `chunked_cross_entropy`), 2 CPU gloo processes (one tp group); "
        f"{rounds} interleaved rounds, median (min-max) of the max over ranks. "
        f"{machine('torch')}; load average {load_average()}.",
        "",
        "| loss | head | weight held / rank (MiB) | peak of forward + backward / rank (MiB) | "
        "head peak / rank (MiB) | ratio to replicated | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    verdicts = []
    for path in PATHS:
        total = {v: per_round(f"{v}/{path}", lambda x: x["held"] + x["peak"]) for v in VARIANTS}
        ratios = [a / b for a, b in zip(total["vocab-parallel"], total["replicated"])]
        for v in VARIANTS:
            case = f"{v}/{path}"
            held = per_round(case, lambda x: x["held"])
            peak = [p / 2**20 for p in per_round(case, lambda x: x["peak"])]
            secs = per_round(case, lambda x: x["seconds"])
            ratio = "1.000" if v == "replicated" else with_spread(ratios, "{:.3f}")
            lines.append(f"| {path} | {v} | {mib(max(held))} | {with_spread(peak, '{:.1f}')} | "
                         f"{with_spread([t / 2**20 for t in total[v]], '{:.1f}')} | {ratio} | "
                         f"{with_spread(secs, '{:.2f}')} |")  # fmt: skip
        worst = max(rank["grad_rel"][path] for rank in ranks)
        losses = [rank["found"][f"{v}/{path}"][-1]["loss"] for rank in ranks for v in VARIANTS]
        spread = (max(losses) - min(losses)) / abs(losses[0])
        verdict = "met" if max(ratios) <= TARGET else "MISSED"
        verdicts.append(
            f"- {path}: {verdict} (median {statistics.median(ratios):.3f}x, worst round "
            f"{max(ratios):.3f}x); the loss sums agree to {spread:.1e} (relative, both heads "
            f"and both ranks), the hidden rows' gradients to {worst:.1e} (||diff|| / "
            "||replicated||)."
        )
    lines += ["", f"Target: head peak / rank <= {TARGET}x of the replicated head's.", "",
              *verdicts]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, vocab = (1, 32_768) if args.quick else (3, VOCAB)
    out = Path(tempfile.mkdtemp(prefix="unmask-vocab-")) / "ranks.json"
    run_workers(2, __file__, "--worker", out, rounds, vocab, timeout=1800)
    ranks = json.loads(out.read_text())
    publish(report(ranks, rounds, vocab), None if args.quick else REPORT)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
