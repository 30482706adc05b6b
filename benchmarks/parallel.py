"""Parallel layouts on CPU gloo processes: per-rank memory, step time and collective bytes.

One model and one global batch (split_batches: 8 rows of 64 tokens) under each layout of the
device mesh (dp_replicate x dp_shard x cp x tp): 1 process; dp2 and tp2 on 2 processes; dp4,
dp2 x tp2 and tp4 on 4 processes. Each rank builds the real trainer (unmask.train.Trainer)
and runs its train_step on the loader's batches, so TP, FSDP2, the loss, clipping and the
optimizer are the code a run uses. Per layout and optimizer (AdamW, MuonAdamW), the max over
ranks of:

* parameter + optimizer-state bytes held by the rank (local shards, after one step);
* peak step memory: the highest running total of tensor memory torch's CPU allocator
  handed out during one step, above what was held before it (torch.profiler with
  profile_memory: each operation's own allocations minus frees, in start order): gathered
  FSDP units, activations, gradients and collective buffers;
* the median step time (seconds) over the timed steps;
* the payload bytes of every collective kind in one step (torch.profiler's c10d events:
  the tensor each rank hands to the collective), next to the analytic model:

  - TP: 4 all-reduces per layer per micro-batch (o and down outputs in forward, the q/k/v
    and gate/up inputs' gradients in backward) of B_r x L x H activations, plus the q/k
    norm weights' partial gradients; the vocab-parallel embedding's output (B_r x L x H)
    and the vocab-parallel loss's (the masked rows' max, exp-sum and target logit: 3 x N_m,
    and their hidden states' gradient: N_m x H, N_m = the rank's masked tokens that step);
  - FSDP2: per unit, an all-gather of its shard in forward and again in backward
    (reshard_after_forward) and a reduce-scatter of the gradient, P_unit / (dp_shard x tp)
    elements each; fp32;
  - Muon (owner all-to-all): 2 x (W - 1) / W x its matrices' local elements (under TP too:
    each rank sends its own block of a split matrix).

CPU gloo timings on a shared 2-core machine say how layouts compare, not how fast a GPU
cluster is. Context parallelism (cp > 1) is left to benchmarks of its own (the long-sequence
case); the layout table has a cp column ready for it.

Run: python benchmarks/parallel.py            (writes benchmarks/results/parallel.md; ~4 min)
     python benchmarks/parallel.py --quick    (2 processes, dp2 and tp2, one timed step; prints)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from common import RESULTS, publish, run_workers

REPORT = RESULTS / "parallel.md"
MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256}  # fmt: skip
ROWS, LENGTH = 8, 64
#: name -> (processes, train keys)
LAYOUTS = {
    "1 process": (1, {}),
    "dp2": (2, {}),
    "tp2": (2, {"tensor_parallel": 2}),
    "dp4": (4, {}),
    "dp2 x tp2": (4, {"tensor_parallel": 2}),
    "tp4": (4, {"tensor_parallel": 4}),
}
OPTIMS = {"adamw": {"name": "adamw"}, "muon": {"name": "muon", "ns_dtype": "float32"}}


def config_tree(out: Path, train: dict, optim: dict) -> dict:
    return {
        "model": MODEL,
        "data": {
            "dataset": "synthetic",
            "packing": False,
            "packing_length": LENGTH,
            "synthetic_train_size": 512,
            "synthetic_eval_size": 8,
        },  # fmt: skip
        "optim": {"learning_rate": 1e-3, **optim},
        "train": {
            "per_device_train_batch_size": ROWS,
            "split_batches": True,
            "max_steps": 100,
            "eval_steps": 0,
            "save_steps": 0,
            "disable_tqdm": True,
            "output_dir": str(out),
            **train,
        },  # fmt: skip
        "eval": {"generate_accuracy": False},
    }


# ------------------------------------------------------------------ worker (every rank)


def peak_step_bytes(prof) -> int:
    """Highest running total of the profiled step's own allocations minus frees (bytes)."""
    total = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        total += event.self_cpu_memory_usage
        peak = max(peak, total)
    return peak


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def state_bytes(trainer) -> tuple[int, int]:
    import torch

    params = _local_bytes(trainer.model.parameters())
    states = [v for s in trainer.optimizer.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.ndim > 0]  # fmt: skip
    return params, _local_bytes(states)


def collective_bytes(prof) -> dict[str, list[int]]:
    """kind -> [calls, payload bytes] on this rank: the kind from each c10d event (allreduce,
    allgather_base, reduce_scatter_base, alltoall_base), the bytes from the gloo operation
    inside it (the tensor gloo moves: an all-gather's shard, a reduce-scatter's whole input,
    which gloo runs as an all-reduce)."""
    sizes = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8}
    found: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    kind = None
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        if event.name.startswith("c10d::") and event.name != "c10d::barrier":
            kind = event.name.removeprefix("c10d::").strip("_")
            found[kind][0] += 1
        elif event.name.startswith("gloo:") and kind is not None:
            numel = 1
            for d in (event.input_shapes or [[0]])[0]:
                numel *= d
            dtype = (getattr(event, "input_dtypes", None) or ["float"])[0]
            found[kind][1] += numel * sizes.get(dtype, 4)
    return dict(found)


def measure(config_path: str, timed: int) -> dict:
    import torch
    import torch.distributed as dist

    from unmask.config import load_config
    from unmask.train.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(load_config(config_path))
    trainer.model.train()
    batches = lambda: [next(trainer.loader)]  # noqa: E731
    trainer.train_step(batches())  # warm-up: optimizer state exists after it
    params, optim = state_bytes(trainer)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True, profile_memory=True) as prof:  # fmt: skip
        trainer.train_step(batches())
    comms = collective_bytes(prof)
    peak = peak_step_bytes(prof)
    masked = int(trainer.objective.last_stats["num_masked"])  # the profiled step's
    times = []
    for _ in range(timed):
        if dist.is_initialized():
            dist.barrier()
        started = time.perf_counter()
        trainer.train_step(batches())
        times.append(time.perf_counter() - started)
    trainer.loader.close()
    return {"params": params, "optim": optim, "peak": peak, "masked": masked,
            "step_s": statistics.median(times), "comms": comms}  # fmt: skip


def worker(out: str, timed: int, configs: list[str]) -> None:
    import torch.distributed as dist

    results = {}
    for path in configs:
        mine = measure(path, timed)
        if dist.is_initialized():
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        else:
            every = [mine]
        results[Path(path).stem] = every
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(results))


# ------------------------------------------------------------------ analytic model


def analytic(world: int, tp: int, optim: str, masked: int = 0) -> dict[str, float]:
    """Payload bytes per rank and step of each collective kind (see the module docstring)."""
    from unmask.models import ModelConfig
    from unmask.models.transformer import DiffusionTransformer

    cfg = ModelConfig(**MODEL)
    model = DiffusionTransformer(cfg)
    layers = cfg.num_hidden_layers
    dp = world // tp
    rows = ROWS // dp
    tokens, hidden = rows * LENGTH, cfg.hidden_size
    # layers' 4 activation all-reduces, the embedding's output, the vocab-parallel loss's
    tp_elements = 4 * layers * tokens * hidden + tokens * hidden + masked * (3 + hidden)
    tp_bytes = tp_elements * 4 if tp > 1 else 0
    # the layers' matrices and the vocab-parallel embedding and head are split over tp
    split = sum(p.numel() for p in model.model.layers.parameters())
    split += model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    rest = sum(p.numel() for p in model.parameters()) - split
    shard = (split / tp + rest) / dp  # elements a rank holds
    fsdp_gather = 2 * shard * 4 if world > 1 else 0  # forward + backward
    fsdp_scatter = (split / tp + rest) * 4 if dp > 1 else 0  # its full gradients
    fsdp_gather = fsdp_gather if dp > 1 else 0
    muon = 0.0
    if optim == "muon" and world > 1:  # owner all-to-all: this rank's rows, out and back
        matrices = sum(p.numel() for n, p in model.model.layers.named_parameters()
                       if p.ndim == 2)  # fmt: skip
        muon = 2 * matrices / world * 4
    return {"tp_allreduce": tp_bytes, "fsdp_allgather": fsdp_gather,
            "fsdp_reduce_scatter": fsdp_scatter, "muon_alltoall": muon}  # fmt: skip


# ------------------------------------------------------------------ launcher


def launch(nproc: int, out: Path, timed: int, configs: list[Path]) -> dict:
    run_workers(nproc, __file__, "--worker", out, timed, *configs, timeout=1800)
    return json.loads(out.read_text())


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    import tempfile

    import yaml

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    layouts = {k: LAYOUTS[k] for k in ("dp2", "tp2")} if args.quick else LAYOUTS
    timed = 1 if args.quick else 3
    optims = {"adamw": OPTIMS["adamw"]} if args.quick else OPTIMS
    root = Path(tempfile.mkdtemp(prefix="unmask-parallel-"))
    by_world: dict[int, list[Path]] = defaultdict(list)
    names = {}
    for layout, (nproc, train) in layouts.items():
        for optim, keys in optims.items():
            stem = f"{layout.replace(' ', '')}-{optim}"
            path = root / f"{stem}.yaml"
            path.write_text(yaml.safe_dump(config_tree(root / stem, train, keys)))
            by_world[nproc].append(path)
            names[stem] = (layout, optim, nproc, train.get("tensor_parallel", 1))
    measured = {}
    for nproc, configs in sorted(by_world.items()):
        measured.update(launch(nproc, root / f"results-{nproc}.json", timed, configs))
    publish("\n".join(report(measured, names)) + "\n", None if args.quick else REPORT)


NOTES = [
    "",
    "## Reading it",
    "",
    "- Parameters + optimizer state per rank under tp=2 (2 processes): the layers' matrices,",
    "  the embedding and the LM head (vocab-parallel) are halved, only the norms (replicated",
    "  over tp) are not. Under dp2 x tp2 FSDP2 shards those too.",
    "- Collective payloads match the analytic model where one exists: TP's activation",
    "  all-reduces (4 per layer and micro-batch, the embedding's output, the vocab-parallel",
    "  loss's per-row terms and masked rows' gradient), FSDP2's all-gathers and",
    "  reduce-scatters, the Muon owner all-to-all, which under TP sends each rank's own block",
    "  of a split matrix (no DTensor redistribute into rows, which on gloo all-gathered the",
    "  whole matrix).",
    "- Step times come from 2 shared CPU cores with other jobs running (the 1-process rows",
    "  ran while another benchmark and a test suite competed for them): compare layouts only",
    "  loosely; they say nothing about GPU clusters.",
]


def report(measured: dict, names: dict) -> list[str]:
    from unmask.models import ModelConfig

    cfg = ModelConfig(**MODEL)
    lines = [
        "# Parallel layouts (benchmarks/parallel.py)",
        "",
        f"Model: hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
        f"{cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads / "
        f"{cfg.num_key_value_heads} KV heads, vocab {cfg.vocab_size}; global batch {ROWS} rows "
        f"x {LENGTH} tokens, fp32, CPU gloo processes on a shared 2-core machine. Max over "
        "ranks. Memory in MiB.",
        "",
        "| layout | optimizer | processes | params / rank | optimizer state / rank | "
        "params + state vs 1 process | peak step memory / rank | step time (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    single = {}
    for stem, ranks in measured.items():
        layout, optim, nproc, tp = names[stem]
        if nproc == 1:
            single[optim] = ranks[0]["params"] + ranks[0]["optim"]
    for stem, ranks in measured.items():
        layout, optim, nproc, tp = names[stem]
        params = max(r["params"] for r in ranks)
        state = max(r["optim"] for r in ranks)
        held = max(r["params"] + r["optim"] for r in ranks)
        ratio = f"{held / single[optim]:.3f}x" if optim in single else "-"
        peak = max(r["peak"] for r in ranks)
        step = max(r["step_s"] for r in ranks)
        lines.append(f"| {layout} | {optim} | {nproc} | {mib(params)} | {mib(state)} | {ratio} "
                     f"| {mib(peak)} | {step:.3f} |")  # fmt: skip
    lines += [
        "",
        "## Collective payload per rank and step (rank 0; MiB), measured vs analytic",
        "",
        "| layout | optimizer | kind | calls | measured | analytic |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for stem, ranks in measured.items():
        layout, optim, nproc, tp = names[stem]
        model = analytic(nproc, tp, optim, ranks[0]["masked"])
        for kind, (calls, size) in sorted(ranks[0]["comms"].items()):
            guess = {"allreduce": model["tp_allreduce"], "allgather_base": model["fsdp_allgather"],
                     "reduce_scatter_base": model["fsdp_reduce_scatter"],
                     "alltoall_base": model["muon_alltoall"]}.get(kind)  # fmt: skip
            shown = mib(guess) if guess is not None else "-"
            lines.append(f"| {layout} | {optim} | {kind} | {calls} | {mib(size)} | {shown} |")
    return lines + NOTES


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    else:
        main()
