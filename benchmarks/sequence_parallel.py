"""Sequence parallelism under tp=2 at 8k tokens (gloo, CPU processes): per-rank activation
memory of tp=1, tp=2 and tp=2 with parallel.sequence_parallel.

One training forward + backward of a tiny qwen3_dllm (hidden 128, intermediate 384, 4 heads /
4 K/V heads of 32, 2 layers, vocabulary 256) on one row of L tokens (default 8,192), half of
them masked, per-token losses summed (the masked-only chunked loss). tp=1 runs in one
process; tp=2 in two (torchrun, one thread each), the layers split as the trainer splits
them (parallel/tensor.py: vocab-parallel embedding and head), with and without the norms
and the residual stream sharded over the sequence. Each layout is launched once per round,
the order rotated over >= 3 rounds.

Per rank (the max over ranks), median (min-max) over the rounds:
- activations saved for backward: bytes of the distinct storages autograd keeps from the
  forward (saved_tensors_hooks, a DTensor counted by its local tensor; parameters
  excluded), the activation memory at its peak;
- peak RSS growth: the process's resident-set high-water mark during forward + backward
  (VmHWM, reset through /proc/self/clear_refs first) minus its RSS before the step;
- step time (forward + backward; 2 shared cores, indicative only).

Run: python benchmarks/sequence_parallel.py   (writes benchmarks/results/sequence_parallel.md)
     python benchmarks/sequence_parallel.py --quick   (L = 1024, one round; prints)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import RESULTS, load_average, machine, rotated, run_workers, with_spread, write_report
from saved_memory import SavedActivations, local, reset_peak_rss, rss_bytes

REPORT = RESULTS / "sequence_parallel.md"
MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, head_dim=32, vocab_size=256, attn_implementation="sdpa")  # fmt: skip
MIB = 2**20
#: name -> (processes, sequence_parallel)
LAYOUTS = {"tp=1": (1, False), "tp=2": (2, False), "tp=2 + sequence_parallel": (2, True)}
TARGET = 0.6


def make_row(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (1, length), generator=gen)
    return ids, torch.where(torch.rand(1, length, generator=gen) < 0.5, ids, -100)


def step(model, ids, targets) -> None:
    model(ids, targets=targets).sum().backward()
    model.zero_grad(set_to_none=True)


def worker(out: str, length: int, sequence_parallel: bool) -> None:
    from unmask.models import ModelConfig
    from unmask.models.transformer import DiffusionTransformer
    from unmask.parallel.dims import ParallelDims
    from unmask.parallel.tensor import apply_tensor_parallel

    torch.set_num_threads(1)
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    model = DiffusionTransformer(ModelConfig(**MODEL))
    if tp > 1:
        dist.init_process_group("gloo")
        mesh = ParallelDims(tp=tp).build_mesh(torch.device("cpu"))["tp"]
        apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    step(model, *make_row(512))  # kernels, thread pools and allocator arenas set up first
    ids, targets = make_row(length)
    if tp > 1:
        dist.barrier()
    before = rss_bytes("VmRSS")
    reset = reset_peak_rss()
    started = time.perf_counter()
    with SavedActivations(params) as saved:
        losses = model(ids, targets=targets)
    losses.sum().backward()
    seconds = time.perf_counter() - started
    peak = rss_bytes("VmHWM")
    rank = dist.get_rank() if tp > 1 else 0
    result = {"saved": saved.bytes, "rss": peak - before if reset else None,
              "seconds": seconds, "loss": losses.sum().item()}  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if tp > 1:
        dist.destroy_process_group()


def launch(name: str, root: Path, length: int, round_index: int) -> list[dict]:
    nproc, sp = LAYOUTS[name]
    out = root / f"{round_index}-{nproc}-{int(sp)}"
    out.mkdir()
    run_workers(nproc, __file__, "--worker", out, "--length", length,
                *(["--sequence-parallel"] if sp else []), timeout=1800)  # fmt: skip
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def table(length: int, rounds: list[dict[str, list[dict]]]) -> str:
    def per_round(name: str, key: str) -> list[float]:
        return [max(rank[key] or 0 for rank in found[name]) for found in rounds]

    base_saved, base_rss = per_round("tp=1", "saved"), per_round("tp=1", "rss")
    lines = [
        f"L = {length:,} tokens (one row, half masked), {MODEL['num_hidden_layers']} layers, "
        f"hidden {MODEL['hidden_size']}, intermediate {MODEL['intermediate_size']}, "
        f"{MODEL['num_attention_heads']} heads / {MODEL['num_key_value_heads']} K/V heads of "
        f"{MODEL['head_dim']}, fp32, sdpa (CPU flash); {len(rounds)} interleaved rounds, "
        f"median (min-max) of the max over ranks. {machine('torch')}; load average "
        f"{load_average()}.",
        "",
        "| layout | activations saved / rank (MiB) | ratio to tp=1 | peak RSS growth / rank "
        "(MiB) | ratio to tp=1 | step time (s) |",
        "|---|---|---|---|---|---|",
    ]
    verdicts = []
    for name in LAYOUTS:
        saved, rss = per_round(name, "saved"), per_round(name, "rss")
        ratio = [s / b for s, b in zip(saved, base_saved)]
        rss_ratio = [r / b for r, b in zip(rss, base_rss)]
        lines.append(
            f"| {name} | {with_spread([s / MIB for s in saved], '{:.1f}')} | "
            f"{with_spread(ratio, '{:.3f}')} | {with_spread([r / MIB for r in rss], '{:.1f}')} | "
            f"{with_spread(rss_ratio, '{:.3f}')} | "
            f"{with_spread(per_round(name, 'seconds'), '{:.1f}')} |"
        )
        if name == "tp=2 + sequence_parallel":
            verdict = "met" if max(ratio) <= TARGET else "MISSED"
            verdicts.append(f"activations saved / rank {max(ratio):.3f}x of tp=1 in the worst "
                            f"round: {verdict}.")  # fmt: skip
    losses = [rank["loss"] for found in rounds for ranks in found.values() for rank in ranks]
    spread = (max(losses) - min(losses)) / abs(losses[0])
    return "\n".join([*lines, "", f"Target (tp=2 + sequence_parallel): <= {TARGET}x of tp=1; "
                      + " ".join(verdicts), "", f"The loss sums of every run agree to {spread:.1e} "
                      "(relative)."])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", metavar="OUT")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.length, args.sequence_parallel)
        return
    length, count = (1024, 1) if args.quick else (args.length, 3)
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(count):
            rounds.append({name: launch(name, Path(tmp), length, r)
                           for name in rotated(list(LAYOUTS), r)})  # fmt: skip
    text = table(length, rounds)
    print(text)
    report = ("# Sequence parallelism: per-rank activation memory at 8k tokens\n\n"
              "`python benchmarks/sequence_parallel.py` (gloo, CPU processes, one thread each; "
              "see its docstring for what each column measures).\n\n" + text + "\n")  # fmt: skip
    write_report(report, None if args.quick else REPORT)


if __name__ == "__main__":
    main()
