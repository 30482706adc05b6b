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
score matrix is materialized, in forward or backward). Three row kinds:
- `full`: one document, no mask (sdpa);
- `packed`: documents of L / 8 tokens, `attn_implementation: auto`, which is varlen on CPU:
  one unmasked sdpa call per document of the whole rows (each rank holds whole rows of
  heads / cp after the all-to-all), nothing of size L x L;
- `packed-dense`: the same rows through `attn_implementation: sdpa`, a dense (1, 1, L, L)
  bool document mask that CPU sdpa turns into a float32 (L, L) matrix kept for backward in
  every layer (4 L^2 bytes: 1 GiB per layer at 16k), the same on every rank whatever cp is.
  It is slow at 16k (every query against every key), so it runs in the first round only.

Rounds: every kind is launched on its own (fresh processes, so no kind reuses memory another
freed), cp=1 and cp=2 alternately, `--rounds` times (3 by default); the table gives medians
and (min-max) over the rounds, the ratio to cp=1 taken within each round.

Run: python benchmarks/context_parallel.py   (writes benchmarks/results/context_parallel.md;
~17 minutes on 2 shared cores at load 13-15)
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
from common import RESULTS, load_average, machine, run_workers, with_spread, write_report
from saved_memory import SavedActivations, reset_peak_rss, rss_bytes
from torch.utils._python_dispatch import TorchDispatchMode

REPORT = RESULTS / "context_parallel.md"
MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=256)  # fmt: skip
#: row kind -> (documents of L / 8 tokens, attn_implementation)
KINDS = {"full": (False, "auto"), "packed": (True, "auto"), "packed-dense": (True, "sdpa")}
MIB = 2**20
NOTES = """`full`: one document per row, no mask: cp=2 keeps about half the activations of cp=1
per rank (each rank holds half the tokens; after the all-to-all its q, k, v for half the
heads over every token are as large as before). `packed` (varlen, `auto` on CPU): one sdpa
call per document, on views of the gathered rows' q, k, v: autograd keeps what it keeps for
`full` (q, k, v, the outputs, the log-sum-exp) and no mask, so cp=2 halves it too.
`packed-dense` (`attn_implementation: sdpa`, the path `auto` took on CPU before): the
whole rows' float32 (L, L) copy of the dense document mask, kept for backward in every
layer, is the same on every rank whatever cp is and dominates this tiny model: its saved
bytes exceed `full`'s by layers x 4 L^2 (2 x 1,024 MiB at 16k: 87% of cp=1's total, 93% of
cp=2's), hence 0.94x. varlen at cp=1 keeps 16 MiB more than `full` (layers x L x Hq x D x
4 B): o_proj reads the documents' outputs joined into a new tensor, a copy cp=2's
all-to-all makes anyway. Saved bytes are exact and the same every round; RSS growth and
step times share 2 cores with other work (load average 12-15 during the run): indicative
only.
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


def worker(out: str, length: int, kinds: list[str]) -> None:
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
    results = {}
    for kind in kinds:
        packed, backend = KINDS[kind]
        torch.manual_seed(0)  # the same weights for every kind
        model = DiffusionTransformer(ModelConfig(**MODEL, attn_implementation=backend))
        model.context_parallel = shard
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        # a short step first: kernels, thread pools and allocator arenas are set up before
        # the measured one
        step(model, local_row(make_row(512, packed), shard, 512))
        row = local_row(make_row(length, packed), shard, length)
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
        del model, losses, row
    rank = dist.get_rank() if shard is not None else 0
    Path(out, f"cp{cp}-rank{rank}.json").write_text(json.dumps(results))
    if shard is not None:
        dist.destroy_process_group()


def launch(cp: int, out: Path, length: int, kinds: list[str]) -> dict[str, dict]:
    """One launch of `cp` processes: per kind, the largest value over the ranks of each
    measure (the rank that needs the most)."""
    for old in out.glob("cp*-rank*.json"):
        old.unlink()
    run_workers(cp, __file__, "--worker", out, "--length", length, "--kinds", ",".join(kinds),
                timeout=3600)  # fmt: skip
    ranks = [json.loads((out / f"cp{cp}-rank{r}.json").read_text()) for r in range(cp)]
    return {kind: {key: max(r[kind][key] or 0 for r in ranks) for key in ranks[0][kind]}
            for kind in kinds}  # fmt: skip


def table(length: int, rounds: list[dict[int, dict[str, dict]]]) -> str:
    """rounds[i][cp][kind]: one launch's maxima over the ranks."""
    from unmask.parallel.context import alltoall_bytes

    cfg = MODEL
    lines = [
        f"L = {length:,} tokens (one row), {cfg['num_hidden_layers']} layers, hidden "
        f"{cfg['hidden_size']}, {cfg['num_attention_heads']} heads / "
        f"{cfg['num_key_value_heads']} K/V heads of {cfg['head_dim']}, fp32, CPU sdpa "
        f"(flash); medians (min-max) over {len(rounds)} rounds, max over the ranks of a round",
        "",
        "| rows | attention | rounds | cp | activations saved / rank | ratio to cp=1 | peak RSS "
        "growth / rank | ratio to cp=1 | all-to-all sent / rank | analytic | step time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        runs = [r for r in rounds if kind in r[1]]
        if not runs:
            continue
        attention = {"full": "sdpa, no mask", "packed": "varlen (auto)",
                     "packed-dense": "sdpa, dense mask"}[kind]  # fmt: skip
        for cp in (1, 2):
            got = [r[cp][kind] for r in runs]
            saved = [g["saved_bytes"] / MIB for g in got]
            rss = [g["rss_growth"] / MIB for g in got]
            saved_ratio = [r[cp][kind]["saved_bytes"] / r[1][kind]["saved_bytes"] for r in runs]
            rss_ratio = [r[cp][kind]["rss_growth"] / r[1][kind]["rss_growth"] for r in runs]
            sent = max(g["alltoall_sent"] for g in got)
            predicted = alltoall_bytes(length, cfg["num_attention_heads"],
                                       cfg["num_key_value_heads"], cfg["head_dim"],
                                       cfg["num_hidden_layers"], cp)  # fmt: skip
            lines.append(
                f"| {kind} | {attention} | {len(runs)} | {cp} | "
                f"{with_spread(saved, '{:,.1f}')} MiB | {with_spread(saved_ratio)} | "
                f"{with_spread(rss, '{:,.1f}')} MiB | {with_spread(rss_ratio)} | "
                f"{sent / MIB:,.2f} MiB | {predicted / MIB:,.2f} MiB | "
                f"{with_spread([g['seconds'] for g in got], '{:.1f}')} s |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", metavar="OUT")
    parser.add_argument("--length", type=int, default=16384)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.length, args.kinds.split(","))
        return
    length = 2048 if args.quick else args.length
    import tempfile

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            # packed-dense attends every query to every key: first round only
            kinds = list(KINDS) if index == 0 else [k for k in KINDS if k != "packed-dense"]
            order = (1, 2) if index % 2 == 0 else (2, 1)
            got: dict[int, dict[str, dict]] = {1: {}, 2: {}}
            for kind in kinds:  # a fresh launch per kind and cp: RSS growth starts clean
                for cp in order:
                    got[cp].update(launch(cp, Path(tmp), length, [kind]))
            rounds.append(got)
            print(f"round {index + 1}/{args.rounds} done (load {load_average()})", flush=True)
    text = table(length, rounds)
    print(text)
    report = (
        "# Context parallelism: per-rank activation memory and all-to-all bytes\n\n"
        "`python benchmarks/context_parallel.py` (gloo, CPU processes, one thread each; "
        "see its docstring for what each column measures).\n\n"
        f"Machine: {machine('torch')}; load average at the end {load_average()}.\n\n"
        + text
        + "\n\n"
        + NOTES
    )
    write_report(report, None if args.quick else REPORT)


if __name__ == "__main__":
    main()
