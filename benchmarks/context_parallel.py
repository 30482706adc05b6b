"""Context parallelism at long sequences (gloo, CPU processes): per-rank activation memory,
all-to-all bytes and step time, cp=1 against cp=2.

One training forward + backward of a tiny qwen3_dllm (hidden 128, intermediate 384, 4 heads /
2 K/V heads of 32, 2 layers, vocabulary 256) on one row of L tokens (default 16,384), half of
them masked, per-token losses summed (the masked-only chunked loss of the trainer). cp=1 runs
in one process, cp=2 in two (torchrun, one thread each); each rank holds L / cp tokens.

Per rank we report
- activations saved for backward: bytes of the distinct tensors autograd keeps from the
  forward (saved_tensors_hooks; parameters excluded), the activation memory at its peak;
- peak RSS growth: the process's resident-set high-water mark during forward + backward
  (VmHWM, reset through /proc/self/clear_refs first) minus its RSS before the step: what
  the step really took from the machine, attention workspace and allocator slack included;
- all-to-all bytes sent per step (forward and backward, counted at the functional
  collective), next to `unmask.parallel.context.alltoall_bytes`'s analytic count
  2 x layers x (L / cp) x (2 Hq + 2 max(Hkv, cp)) x D x 4 B x (cp - 1) / cp;
- step time (forward + backward; 2 shared cores, so only indicative).

Attention: sdpa, which on CPU dispatches to its flash-attention kernel (blocked: no L x L
score matrix is materialized, in forward or backward). Two row kinds: `full` (one document,
no mask) and `packed` (documents of L / 8 tokens: a dense (1, 1, L, L) bool document mask,
L^2 bytes = 256 MiB at 16k, built whole on every rank because each rank attends over whole
rows for its heads).

Run: python benchmarks/context_parallel.py   (writes benchmarks/results/context_parallel.md;
~12 minutes on 2 shared cores)
     python benchmarks/context_parallel.py --quick   (L = 2048, prints, writes nothing)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import RESULTS, run_workers, write_report
from torch.utils._python_dispatch import TorchDispatchMode

REPORT = RESULTS / "context_parallel.md"
MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=256, attn_implementation="sdpa")  # fmt: skip
MIB = 2**20
NOTES = """`full`: one document per row, no mask: cp=2 keeps about half the activations of cp=1
per rank (each rank holds half the tokens; after the all-to-all its q, k, v for half the
heads over every token are as large as before). `packed`: the dense document mask of whole
rows, which CPU sdpa turns into a float32 (L, L) matrix kept for backward in every layer
(1 GiB per layer at 16k), is the same on every rank whatever cp is and dominates this tiny
model; on CUDA `attn_implementation: flex` keeps a sparse block mask instead. Step times
share 2 cores with other work: indicative only.
"""


class CountAllToAll(TorchDispatchMode):
    """Bytes this rank sends in functional all-to-alls (forward and autograd's backward):
    everything but the chunk addressed to itself."""

    def __init__(self, cp: int):
        super().__init__()
        self.cp, self.sent, self.calls = cp, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_to_all_single" in str(func):
            x = args[0]
            self.sent += x.numel() * x.element_size() * (self.cp - 1) // self.cp
            self.calls += 1
        return func(*args, **(kwargs or {}))


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the distinct storages autograd keeps for backward while active (parameter
    storages excluded)."""

    def __init__(self, params: set[int]):
        self.params, self.storages = params, {}
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def __enter__(self) -> SavedActivations:
        super().__enter__()
        return self

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def make_row(length: int, packed: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (1, length), generator=gen)
    targets = torch.where(torch.rand(1, length, generator=gen) < 0.5, ids, -100)
    row = {"input_ids": ids, "targets": targets}
    if packed:
        row["doc_ids"] = torch.arange(length)[None] // (length // 8)
    return row


def local_row(row: dict, shard, length: int) -> dict:
    """This rank's slice of every per-token tensor (the whole row without cp)."""
    if shard is None:
        return row
    cols = shard.local(length)
    return {k: v[:, cols] for k, v in row.items()}


def step(model, row: dict) -> None:
    """Forward (per-token losses, summed) and backward."""
    losses = model(row["input_ids"], doc_ids=row.get("doc_ids"), targets=row["targets"])
    losses.sum().backward()
    model.zero_grad(set_to_none=True)


def worker(out: str, length: int) -> None:
    from unmask.models import ModelConfig
    from unmask.models.transformer import DiffusionTransformer
    from unmask.parallel.context import ContextShard

    torch.set_num_threads(1)
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    shard = None
    if cp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        shard = ContextShard.from_mesh(init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)))
    torch.manual_seed(0)
    model = DiffusionTransformer(ModelConfig(**MODEL))
    model.context_parallel = shard
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    results = {}
    for kind in ("full", "packed"):
        # a short step first: kernels, thread pools and allocator arenas are set up before
        # the measured one
        step(model, local_row(make_row(512, kind == "packed"), shard, 512))
        row = local_row(make_row(length, kind == "packed"), shard, length)
        if shard is not None:
            dist.barrier()
        before = rss_bytes("VmRSS")
        reset = reset_peak_rss()
        counter = CountAllToAll(cp)
        started = time.perf_counter()
        with counter:
            with SavedActivations(params) as saved:
                losses = model(row["input_ids"], doc_ids=row.get("doc_ids"),
                               targets=row["targets"])  # fmt: skip
            losses.sum().backward()
        seconds = time.perf_counter() - started
        peak = rss_bytes("VmHWM")
        results[kind] = {
            "saved_bytes": saved.bytes,
            "rss_growth": peak - before if reset else None,
            "alltoall_sent": counter.sent,
            "alltoall_calls": counter.calls,
            "seconds": seconds,
        }
    rank = dist.get_rank() if shard is not None else 0
    Path(out, f"cp{cp}-rank{rank}.json").write_text(json.dumps(results))
    if shard is not None:
        dist.destroy_process_group()


def launch(cp: int, out: Path, length: int) -> list[dict]:
    run_workers(cp, __file__, "--worker", out, "--length", length, timeout=1200)
    return [json.loads((out / f"cp{cp}-rank{r}.json").read_text()) for r in range(cp)]


def table(length: int, runs: dict[int, list[dict]]) -> str:
    from unmask.parallel.context import alltoall_bytes

    cfg = MODEL
    lines = [
        f"L = {length:,} tokens (one row), {cfg['num_hidden_layers']} layers, hidden "
        f"{cfg['hidden_size']}, {cfg['num_attention_heads']} heads / "
        f"{cfg['num_key_value_heads']} K/V heads of {cfg['head_dim']}, fp32, sdpa (CPU flash)",
        "",
        "| rows | cp | activations saved / rank (max) | ratio to cp=1 | peak RSS growth / rank "
        "(max) | ratio to cp=1 | all-to-all sent / rank | analytic | step time (max) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in ("full", "packed"):
        base = max(r[kind]["saved_bytes"] for r in runs[1])
        base_rss = max(r[kind]["rss_growth"] or 0 for r in runs[1])
        for cp, ranks in runs.items():
            saved = max(r[kind]["saved_bytes"] for r in ranks)
            rss = max(r[kind]["rss_growth"] or 0 for r in ranks)
            sent = max(r[kind]["alltoall_sent"] for r in ranks)
            predicted = alltoall_bytes(length, cfg["num_attention_heads"],
                                       cfg["num_key_value_heads"], cfg["head_dim"],
                                       cfg["num_hidden_layers"], cp)  # fmt: skip
            seconds = max(r[kind]["seconds"] for r in ranks)
            lines.append(
                f"| {kind} | {cp} | {saved / MIB:,.1f} MiB | {saved / base:.2f} | "
                f"{rss / MIB:,.1f} MiB | {rss / base_rss:.2f} | {sent / MIB:,.2f} MiB | "
                f"{predicted / MIB:,.2f} MiB | {seconds:.1f} s |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", metavar="OUT")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.length)
        return
    length = 2048 if args.quick else args.length
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        runs = {cp: launch(cp, Path(tmp), length) for cp in (1, 2)}
    text = table(length, runs)
    print(text)
    report = (
        "# Context parallelism: per-rank activation memory and all-to-all bytes\n\n"
        "`python benchmarks/context_parallel.py` (gloo, CPU processes, one thread each; "
        "see its docstring for what each column measures).\n\n" + text + "\n\n" + NOTES
    )
    write_report(report, None if args.quick else REPORT)


if __name__ == "__main__":
    main()
