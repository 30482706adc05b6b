"""Mixture of experts: step throughput against a dense model, expert kernels, memory under
expert parallelism, and all-to-all bytes against the formula (docs/parallelism.md).

1. Step tokens/s (forward + backward + AdamW, fp32, one process): a dense qwen3_dllm and a
   qwen3_moe_dllm with the same active parameters (8 experts of width 384, top-2 = the dense
   MLP's 768 features per token, plus the 8 x H router), same attention, batch and length.
   Target: MoE >= 0.7x the dense model's tokens/s.
2. Expert kernels, one MoE layer forward + backward on the same routed tokens: the
   tokens-sorted grouped GEMM (`torch._grouped_mm`, unmask's default), the sorted-token loop
   (one matmul per expert over contiguous rows) and a per-expert Python loop over one-hot
   masks (transformers' eager path: a mask, a gather and an index_add per expert).
   Target: grouped / sorted >= 2x the per-expert loop.
3. Parameters + optimizer state per rank (AdamW, replicated data parallel over 2 gloo
   processes) with parallel.expert_parallel 1 and 2, for an expert-dominated model (64 experts).
   Target: ep=2 <= 0.55x ep=1.
4. All-to-all payload bytes per step and rank under ep=2, measured (every all-to-all's input,
   forward and backward) against 4 x T x k x H x 4 bytes x MoE layers + the per-expert count
   exchanges (E x 8 bytes per layer and forward).

Rounds are interleaved (the variants in a rotated order per round); medians with min-max.
CPU timings on a shared machine say how the variants compare, not how fast a GPU is.

Run: python benchmarks/moe.py           (writes benchmarks/results/moe.md; ~3 min)
     python benchmarks/moe.py --quick   (1 round, small shapes; prints only)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, load_average, machine, publish, rotated, run_workers, with_spread

REPORT = RESULTS / "moe.md"
DENSE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}  # fmt: skip
MOE = {**DENSE, "model_type": "qwen3_moe_dllm", "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 384, "router_aux_loss_coef": 0.01}  # fmt: skip
EXPERT_HEAVY = {**DENSE, "model_type": "qwen3_moe_dllm", "num_experts": 64,
                "num_experts_per_tok": 4, "moe_intermediate_size": 256}  # fmt: skip


# ------------------------------------------------------------------------- 1: step tokens/s


def step_seconds(fields: dict, rows: int, length: int, steps: int) -> float:
    import torch

    from unmask.models import ModelConfig, build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(**fields)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, fields["vocab_size"], (rows, length))
    targets = torch.where(torch.rand(rows, length) < 0.5, ids, -100)

    def step():
        loss = model(ids, targets=targets).sum() / (targets != -100).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


# --------------------------------------------------------------------------- 2: kernels


def per_expert_python_loop(x, experts, weights, stacks):
    """transformers' eager MoE: one-hot masks, then per expert a gather and an index_add."""
    import torch
    import torch.nn.functional as F

    gate, up, down = stacks
    out = torch.zeros_like(x)
    mask = F.one_hot(experts, gate.shape[0]).permute(2, 1, 0)  # (E, k, T)
    for e in range(gate.shape[0]):
        slot, token = torch.where(mask[e])
        rows = x[token]
        hidden = F.silu(rows @ gate[e].T) * (rows @ up[e].T)
        out.index_add_(0, token, (hidden @ down[e].T) * weights[token, slot, None])
    return out


def kernel_seconds(variant: str, tokens: int, repeats: int, fields: dict) -> float:
    import torch

    from unmask.models import ModelConfig
    from unmask.models.moe import SparseMoE

    torch.manual_seed(0)
    cfg = ModelConfig(**{**fields, "moe_implementation": "loop" if variant == "sorted" else
                         "grouped_mm"})  # fmt: skip
    block = SparseMoE(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    x = torch.randn(tokens, cfg.hidden_size, requires_grad=True)

    def run():
        if variant == "python_loop":
            experts, weights, _ = block.gate(x)
            stacks = (block.experts.gate_proj, block.experts.up_proj, block.experts.down_proj)
            y = per_expert_python_loop(x, experts, weights, stacks)
        else:
            y = block(x[None])[0]
        y.square().sum().backward()

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


# -------------------------------------------------------------- 3, 4: workers (gloo ranks)


def worker(out: str, ep: int, rows: int, length: int) -> None:
    """One rank: the real trainer with expert_parallel=ep (replicated data parallel), one
    step; params + optimizer bytes and the all-to-all payloads of that step."""
    import os

    import torch
    import yaml

    import unmask.parallel.expert as expert
    from unmask.config import load_config
    from unmask.train.trainer import Trainer

    rank = int(os.environ.get("RANK", "0"))
    payload = {"forward": 0, "backward": 0, "counts": 0}
    a2a = expert.all_to_all_single_autograd

    class Recorded(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):  # the payload the backward all-to-all hands over
            payload["backward"] += grad.numel() * grad.element_size()
            return grad

    def counted(t, *args):
        payload["forward"] += t.numel() * t.element_size()
        return a2a(Recorded.apply(t), *args)

    expert.all_to_all_single_autograd = counted
    plain = torch.distributed.all_to_all_single

    def counts(output, inputs, *args, **kwargs):
        payload["counts"] += inputs.numel() * inputs.element_size()
        return plain(output, inputs, *args, **kwargs)

    expert.dist.all_to_all_single = counts
    tree = {"model": EXPERT_HEAVY,
            "diffusion": {"random_length_prob": 0.0},
            "data": {"dataset": "synthetic", "packing": False, "packing_length": length,
                     "synthetic_train_size": 256, "synthetic_eval_size": 8},
            "optim": {"name": "adamw"},
            "train": {"per_device_train_batch_size": rows, "split_batches": True,
                      "max_steps": 10, "eval_steps": 0, "save_steps": 0, "fsdp2": False,
                      "disable_tqdm": True, "expert_parallel": ep, "log_mfu": False,
                      "output_dir": f"{out}/run-ep{ep}"},
            "eval": {"generate_accuracy": False}}  # fmt: skip
    path = Path(out) / f"ep{ep}.yaml"
    if rank == 0:
        path.write_text(yaml.safe_dump(tree))
    torch.distributed.init_process_group("gloo")
    torch.distributed.barrier()
    trainer = Trainer(load_config(path))
    batches = [next(trainer.loader)]
    trainer.train_step(batches)
    tokens = int(batches[0]["input_ids"].numel())
    params = sum(_local(p).numel() * p.element_size() for p in trainer.model.parameters())
    state = sum(_local(v).numel() * v.element_size() for s in trainer.optimizer.state.values()
                for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0)  # fmt: skip
    result = {"params": params, "state": state, "tokens": tokens, **payload}
    Path(out, f"ep{ep}-rank{rank}.json").write_text(json.dumps(result))


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


# --------------------------------------------------------------------------------- main


def main(quick: bool) -> None:
    rounds = 1 if quick else 3
    rows, length, steps = (4, 64, 2) if quick else (8, 128, 4)
    throughput: dict[str, list[float]] = {"dense": [], "moe": []}
    kernels: dict[str, list[float]] = {"grouped": [], "sorted": [], "python_loop": []}
    kernel_fields = {**MOE, "num_experts": 64, "num_experts_per_tok": 8,
                     "moe_intermediate_size": 128}  # fmt: skip
    kernel_tokens = 512 if quick else 2048
    for r in range(rounds):
        for name in rotated(["dense", "moe"], r):
            fields = DENSE if name == "dense" else MOE
            throughput[name].append(rows * length / step_seconds(fields, rows, length, steps))
        for name in rotated(list(kernels), r):
            kernels[name].append(kernel_seconds(name, kernel_tokens, 2 if quick else 5,
                                                kernel_fields))  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix="unmask-moe-bench-"))  # the workers' runs and files
    ranks = {}
    for ep in (1, 2):
        run_workers(2, __file__, "--worker", out, ep, rows, length, timeout=900)
        ranks[ep] = [json.loads((out / f"ep{ep}-rank{r}.json").read_text()) for r in (0, 1)]
    report = render(throughput, kernels, ranks, rounds, rows, length, kernel_tokens)
    publish(report, None if quick else REPORT)


def render(throughput, kernels, ranks, rounds, rows, length, kernel_tokens) -> str:
    ratio = [m / d for m, d in zip(throughput["moe"], throughput["dense"])]
    speed = {k: [p / g for p, g in zip(kernels["python_loop"], v)] for k, v in kernels.items()}
    mem = {ep: max(r["params"] + r["state"] for r in ranks[ep]) for ep in (1, 2)}
    ep2 = ranks[2][0]

    def mean(key: str) -> float:
        return (ranks[2][0][key] + ranks[2][1][key]) / 2

    layers, k, hidden = EXPERT_HEAVY["num_hidden_layers"], EXPERT_HEAVY["num_experts_per_tok"], \
        EXPERT_HEAVY["hidden_size"]  # fmt: skip
    local_tokens = ep2["tokens"]  # this rank's rows x length
    formula = 2 * local_tokens * k * hidden * 4 * layers
    counts = EXPERT_HEAVY["num_experts"] * 8 * layers
    lines = [
        "# Mixture of experts (benchmarks/moe.py)",
        "",
        f"Machine: {machine('torch')}; load average {load_average()}. {rounds} interleaved "
        "rounds; median (min-max).",
        "",
        f"## Step tokens/s, MoE vs dense at equal active parameters ({rows} x {length} tokens, "
        "fp32, AdamW, 1 process)",
        "",
        "| model | tokens/s | MoE / dense |",
        "| --- | --- | --- |",
        f"| dense qwen3_dllm (MLP 768) | {with_spread(throughput['dense'], '{:.0f}')} | |",
        f"| qwen3_moe_dllm (8 x 384, top-2) | {with_spread(throughput['moe'], '{:.0f}')} | "
        f"{with_spread(ratio)} (target >= 0.7) |",
        "",
        f"## Expert kernels: one MoE layer forward + backward ({kernel_tokens} tokens, 64 "
        "experts of width 128, top-8, hidden 256)",
        "",
        "| kernel | seconds | speed-up over the per-expert Python loop |",
        "| --- | --- | --- |",
        *(
            f"| {k} | {with_spread(v, '{:.4f}')} | {with_spread(speed[k])} |"
            for k, v in kernels.items()
        ),
        "",
        "Target: grouped (or sorted) >= 2x the per-expert loop.",
        "",
        "## Parameters + AdamW state per rank, 2 processes (replicated), 64 experts top-4",
        "",
        "| expert_parallel | bytes per rank (max over ranks) | vs ep=1 |",
        "| --- | --- | --- |",
        f"| 1 | {mem[1]:,} | 1.00 |",
        f"| 2 | {mem[2]:,} | {mem[2] / mem[1]:.3f} (target <= 0.55) |",
        "",
        "## All-to-all bytes per step and rank (ep=2, one micro-batch)",
        "",
        "| payload | measured, mean over the 2 ranks (rank 0, rank 1) | formula |",
        "| --- | --- | --- |",
        *(
            f"| {label} | {mean(key):,.0f} ({ranks[2][0][key]:,}, {ranks[2][1][key]:,}) | {want} |"
            for label, key, want in (
                (
                    "token rows, forward (dispatch + combine)",
                    "forward",
                    f"2 T k H 4 x layers = {formula:,}",
                ),
                ("gradients, backward", "backward", f"{formula:,}"),
                ("per-expert counts", "counts", f"E x 8 x layers = {counts:,}"),
            )
        ),
        "",
        f"T = {local_tokens} tokens per rank, k = {k}, H = {hidden} (fp32: 4 bytes), {layers} "
        "MoE layers. A rank dispatches exactly T k rows per layer; what it gets back to "
        "combine depends on where the other ranks' tokens went, so one rank's bytes move with "
        "the routing and their mean is the formula. The formula counts every payload handed "
        "to all_to_all_single, the rank's own share included; (N - 1) / N of it crosses the "
        "network under balanced routing.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--quick", action="store_true", help="1 round, small; prints only")
        main(parser.parse_args().quick)
