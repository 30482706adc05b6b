"""Muon cost on CPU: Gram vs standard Newton-Schulz, MuonAdamW vs torch, Muon's step share.

(a) NS wall time for one n x m matrix (n = 512, m = 512 / 1024 / 2048, fp32): standard vs
    Gram NS with the same Polar Express schedule (both compute the same map; their relative
    difference is reported), median of several repeats, next to the FLOP model standard
    20 n^2 m + 10 n^3 vs Gram 8 n^2 m + 28 n^3 (``newton_schulz.ns_flops``).
(b) One optimizer step (random gradients): MuonAdamW vs torch.optim.Muon + torch.optim.AdamW
    with the same routing, and torch AdamW alone.
    - On the ~100M qwen3_dllm (hidden 768, intermediate 2048, vocab 32000, tied, 12 heads /
      4 KV heads) cut to ``--layers 1`` (the full embedding plus one decoder layer: the same
      matrix shapes), with fp32 NS, extrapolated to 12 layers. torch.optim.Muon always
      iterates in bf16, and a CPU without bf16 matrix units runs bf16 GEMMs pathologically
      (X @ Y with neither operand transposed at ~0.5 GFLOP/s vs ~80 for fp32 on the machine
      this was first run on; the report gives this machine's, measured: `gemm_rates`),
      which would make one torch step on this slice take ~100 s; ``--torch-100m`` runs it
      anyway.
    - torch's bf16 comparison therefore runs on the smaller model of (c).
(c) Muon's share of a whole training step (forward + backward + optimizer) vs AdamW, at two
    tokens-per-step settings, on a smaller qwen3_dllm (the 100M one is too slow on CPU),
    next to the FLOP prediction NS FLOPs / (6 * matmul params * tokens).
    Measured share = (MuonAdamW step - AdamW step) / (forward+backward + AdamW step).

Timings use one thread by default: on a shared 2-core box two OpenMP threads spin on each
other and small GEMMs get ~100x slower.

Run: python benchmarks/muon.py           (writes benchmarks/results/muon.md; ~2 minutes)
     python benchmarks/muon.py --quick   (tiny shapes, one repeat; prints, writes nothing)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from common import RESULTS, median_seconds, publish

from unmask.models import ModelConfig, build_model
from unmask.optim import MuonAdamW, route_parameters
from unmask.optim.newton_schulz import coefficient_schedule, newton_schulz, ns_flops

REPORT = RESULTS / "muon.md"


@dataclass(frozen=True)
class Sizes:
    """The shapes one mode measures (--quick: tiny ones, the same code path)."""

    ns_n: int  # (a): n x n, n x 2n, n x 4n
    big: tuple[int, int, int, int, int]  # (b): hidden, intermediate, vocab, heads, KV heads
    small: tuple[int, int, int, int, int, int]  # (b'), (c): layers, then as `big`
    share_tokens: tuple[int, ...]  # (c): tokens per step
    seq_len: int


FULL = Sizes(512, (768, 2048, 32000, 12, 4), (4, 256, 768, 8192, 4, 2), (2048, 8192), 512)
QUICK = Sizes(64, (128, 256, 1000, 2, 1), (2, 64, 128, 512, 2, 1), (256,), 64)
ADAMW = "torch AdamW (all params)"
TORCH_MUON = "torch Muon + torch AdamW (bf16 NS)"


# ------------------------------------------------------------------------------ (a) NS


def bench_ns(n: int, repeats: int) -> list[str]:
    sched = coefficient_schedule("polar_express")
    rows = []
    for m in (n, 2 * n, 4 * n):
        x = torch.randn(1, n, m)
        std = median_seconds(lambda x=x: newton_schulz(x, sched, dtype=torch.float32), repeats)
        gram = median_seconds(
            lambda x=x: newton_schulz(x, sched, dtype=torch.float32, gram=True), repeats
        )
        a = newton_schulz(x, sched, dtype=torch.float32)
        b = newton_schulz(x, sched, dtype=torch.float32, gram=True)
        diff = ((a - b).norm() / a.norm()).item()
        f_std, f_gram = ns_flops(n, m), ns_flops(n, m, gram=True)
        note = "square: Gram falls back to standard" if m == n else ""
        rows.append(
            f"| {n} x {m} | {m // n} | {std * 1e3:.1f} | {gram * 1e3:.1f} | {gram / std:.2f}x "
            f"| {f_gram / f_std:.2f}x | {f_std / std / 1e9:.0f} | {diff:.1e} | {note} |"
        )
        print(rows[-1], flush=True)
    return rows


# ------------------------------------------------------------------- optimizer builders


def _qwen(layers: int, hidden: int, inter: int, vocab: int, heads: int, kv: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=True,
    )
    return build_model(cfg)


def qwen_100m(layers: int, sizes: Sizes) -> torch.nn.Module:
    """~100M params at 12 layers (full sizes): 24.6M tied embedding + 12 x 6.3M."""
    return _qwen(layers, *sizes.big)


def small_model(sizes: Sizes) -> torch.nn.Module:
    """5.2M params (full sizes): hidden 256, 4 layers, intermediate 768, vocab 8192."""
    return _qwen(*sizes.small)


def _fill_grads(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3


def _torch_muon_adamw(model: torch.nn.Module) -> list:
    r = route_parameters(model)
    muon = torch.optim.Muon(
        [p for _, p in r.muon], lr=1e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    adamw = torch.optim.AdamW(
        [
            {"params": [p for _, p in r.adamw_decay], "weight_decay": 0.1},
            {"params": [p for _, p in r.adamw_no_decay], "weight_decay": 0.0},
        ],
        lr=1e-3,
    )
    return [muon, adamw]


def _torch_adamw(model: torch.nn.Module) -> list:
    r = route_parameters(model)
    groups = [
        {"params": [p for _, p in r.muon + r.adamw_decay], "weight_decay": 0.1},
        {"params": [p for _, p in r.adamw_no_decay], "weight_decay": 0.0},
    ]
    return [torch.optim.AdamW(groups, lr=1e-3)]


def _muon(model: torch.nn.Module, coeffs: str, dtype: str) -> list:
    opt = MuonAdamW(
        model, lr=1e-3, weight_decay=0.1, ns_coefficients=coeffs, ns_dtype=dtype, verbose=False
    )
    return [opt]


def _step_time(opts: list, repeats: int, warmup: int = 1) -> float:
    def run() -> None:
        for opt in opts:
            opt.step()

    return median_seconds(run, repeats, warmup)


def _time_optimizers(
    model: torch.nn.Module, which: dict[str, Callable[[], list]], repeats: int
) -> dict[str, float]:
    """Median step seconds per optimizer; bf16 ones get no warm-up (nothing to warm on CPU,
    and each step is long)."""
    times = {}
    for label, make in which.items():
        slow = "bf16" in label
        times[label] = _step_time(make(), 1 if slow else repeats, warmup=0 if slow else 1)
        print(f"  {label}: {times[label]:.2f} s", flush=True)
    return times


def _step_rows(times: dict[str, float], scale: float | None, ref: str) -> list[str]:
    """Table rows; with `scale`, a last column extrapolating Muon's part by that factor."""
    base = times[ADAMW]
    rows = []
    for label, t in times.items():
        rel = f"{t / times[ref]:.2f}x" if ref in times else "-"
        row = f"| {label} | {t:.2f} | {rel} |"
        if scale is not None:
            row += f" {base if label == ADAMW else base + (t - base) * scale:.2f} |"
        rows.append(row)
    return rows


# ------------------------------------------------------------------- (b) optimizer step


def bench_step_100m(
    layers: int, repeats: int, with_torch: bool, sizes: Sizes
) -> tuple[list[str], str]:
    model = qwen_100m(layers, sizes)
    _fill_grads(model)
    r = route_parameters(model)
    muon_params = sum(p.numel() for _, p in r.muon)
    total = sum(p.numel() for p in model.parameters())
    per_layer = sum(p.numel() for n, p in model.named_parameters() if ".layers.0." in n)
    flops = sum(ns_flops(*p.shape) for _, p in r.muon)
    which: dict[str, Callable[[], list]] = {
        ADAMW: lambda: _torch_adamw(model),
        "MuonAdamW, jordan, fp32 NS": lambda: _muon(model, "jordan", "float32"),
        "MuonAdamW, gram, fp32 NS": lambda: _muon(model, "gram", "float32"),
    }
    if with_torch:
        which[TORCH_MUON] = lambda: _torch_muon_adamw(model)
        which["MuonAdamW, jordan, bf16 NS"] = lambda: _muon(model, "jordan", "bfloat16")
    times = _time_optimizers(model, which, repeats)
    what = (
        f"{layers} of 12 layers: {total / 1e6:.1f}M params here, {muon_params / 1e6:.1f}M in "
        f"Muon matrices, {flops / 1e9:.0f} GFLOP of NS per step; 12 layers: "
        f"{(total + per_layer * (12 - layers)) / 1e6:.0f}M params, "
        f"{muon_params * 12 / layers / 1e6:.1f}M in Muon matrices"
    )
    return _step_rows(times, 12 / layers, TORCH_MUON), what


def bench_step_small(repeats: int, sizes: Sizes) -> tuple[list[str], dict[str, float]]:
    model = small_model(sizes)
    _fill_grads(model)
    which: dict[str, Callable[[], list]] = {
        ADAMW: lambda: _torch_adamw(model),
        TORCH_MUON: lambda: _torch_muon_adamw(model),
        "MuonAdamW, jordan, bf16 NS": lambda: _muon(model, "jordan", "bfloat16"),
        "MuonAdamW, jordan, fp32 NS": lambda: _muon(model, "jordan", "float32"),
        "MuonAdamW, gram, fp32 NS": lambda: _muon(model, "gram", "float32"),
    }
    times = _time_optimizers(model, which, repeats)
    return _step_rows(times, None, TORCH_MUON), times


# ---------------------------------------------------------------------- (c) step share


def bench_share(
    tokens_list: tuple[int, ...],
    seq_len: int,
    repeats: int,
    steps: dict[str, float],
    sizes: Sizes,
) -> tuple[list[str], str]:
    model = small_model(sizes)
    vocab = model.config.vocab_size
    r = route_parameters(model)
    matmul_params = sum(p.numel() for _, p in r.muon) + model.lm_head.weight.numel()
    ns = sum(ns_flops(*p.shape) for _, p in r.muon)
    t_adamw = steps[ADAMW]
    t32, t16 = steps["MuonAdamW, jordan, fp32 NS"], steps["MuonAdamW, jordan, bf16 NS"]
    rows = []
    for tokens in tokens_list:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (tokens // seq_len, seq_len), generator=g)
        targets = torch.randint(0, vocab, ids.shape, generator=g)

        def fwd_bwd(ids=ids, targets=targets) -> None:
            model.zero_grad(set_to_none=True)
            model(ids, targets=targets).mean().backward()

        t_fb = median_seconds(fwd_bwd, repeats)
        whole = t_fb + t_adamw
        predicted = ns / (6 * matmul_params * tokens)
        rows.append(
            f"| {tokens} | {t_fb:.2f} | {6 * matmul_params * tokens / t_fb / 1e9:.0f} "
            f"| {(t32 - t_adamw) / whole:.1%} | {(t16 - t_adamw) / whole:.0%} | {predicted:.1%} |"
        )
        print(rows[-1], flush=True)
    total = sum(p.numel() for p in model.parameters())
    c = model.config
    what = (
        f"qwen3_dllm hidden {c.hidden_size}, {c.num_hidden_layers} layers, intermediate "
        f"{c.intermediate_size}, vocab {c.vocab_size}, tied: {total / 1e6:.1f}M "
        f"params, {matmul_params / 1e6:.1f}M in matmuls, {ns / 1e9:.1f} GFLOP of NS per step; "
        f"rows of {seq_len} tokens, every position a target"
    )
    return rows, what


# ------------------------------------------------------------------------------- main


def gemm_rates(n: int = 512, repeats: int = 3) -> dict[str, float]:
    """GFLOP/s of one n x n x n GEMM on this CPU (best of `repeats`): fp32, and bf16 with
    the second operand transposed (X @ Y^T) and not (X @ Y), the two forms NS runs."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    forms = {"fp32": (x, y), "bf16 X @ Y^T": (x.bfloat16(), y.bfloat16().t()),
             "bf16 X @ Y": (x.bfloat16(), y.bfloat16())}  # fmt: skip
    rates = {}
    for name, (a, b) in forms.items():
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - started)
        rates[name] = 2 * n**3 / best / 1e9
    return rates


def _report(env: str, ns_rows, big_rows, big_what, small_rows, share_rows, share_what,
            rates: dict[str, float]) -> str:  # fmt: skip
    gemm = ", ".join(f"{name} {rate:.1f}" for name, rate in rates.items())
    return "\n".join(
        [
            "# Muon on CPU: Newton-Schulz variants, optimizer step, share of a training step",
            "",
            f"Written by `benchmarks/muon.py` ({env}). Medians. CPU numbers, not GPU ones: "
            f"torch's 512 x 512 GEMM on this CPU, measured (GFLOP/s): {gemm}. On a GPU bf16 "
            "runs on tensor cores at many times fp32's rate; on a CPU without bf16 matrix "
            "units it can be the reverse (0.5 GFLOP/s for bf16 X @ Y against 80 for fp32 on "
            "the machine these benchmarks were first run on).",
            "",
            "## (a) Gram vs standard Newton-Schulz (one matrix, fp32, Polar Express schedule)",
            "",
            "| n x m | aspect | standard ms | Gram ms | measured Gram/std | FLOP model Gram/std "
            "| std GFLOP/s | rel. diff | |",
            "|---|---|---|---|---|---|---|---|---|",
            *ns_rows,
            "",
            "FLOP model (dense GEMMs): standard 20 n^2 m + 10 n^3, Gram 8 n^2 m + 28 n^3; at "
            'aspect 4 that is 60 vs 90 n^3 = 0.67x, not the 0.42x ("58% fewer") in MUON.md. '
            "0.42x compares Gram *with* symmetric kernels (6 n^2 m + 14 n^3 = 38 n^3) against "
            "standard *without* them (90 n^3); with symmetric kernels on both sides it is "
            "38/65 = 0.58x. CPU torch has no symmetric GEMM, so 0.67x is the prediction here.",
            "",
            f"## (b) One optimizer step, ~100M qwen3_dllm ({big_what})",
            "",
            "| optimizer | step s | vs torch Muon+AdamW | 12-layer estimate s |",
            "|---|---|---|---|",
            *big_rows,
            "",
            "12-layer estimate = AdamW time + (time - AdamW time) x 12 / layers: Muon's cost is "
            "per matrix and scales with the layer count; the embedding's AdamW does not.",
            "",
            "### (b') Against torch.optim.Muon (bf16 NS), on the small model of (c)",
            "",
            "| optimizer | step s | vs torch Muon+AdamW |",
            "|---|---|---|",
            *small_rows,
            "",
            "bf16 rows: one step, no warm-up (each is seconds long and CPU GEMMs need none).",
            "",
            f"## (c) Muon share of a training step ({share_what})",
            "",
            "| tokens/step | fwd+bwd s | fwd+bwd GFLOP/s (6PT) | Muon share, fp32 NS "
            "| Muon share, bf16 NS | FLOP prediction |",
            "|---|---|---|---|---|---|",
            *share_rows,
            "",
            "share = (MuonAdamW step - AdamW step) / (fwd+bwd + AdamW step), step times from "
            "(b'); FLOP prediction = sum over Muon matrices of (20 n^2 m + 10 n^3) / (6 x "
            "matmul params x tokens). The model runs in fp32, so the fp32-NS column is the "
            "like-for-like one here; the NS GEMMs run nearer peak than the forward/backward, "
            "so the measured share sits below the FLOP prediction.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="NS timing repeats")
    parser.add_argument("--layers", type=int, default=1, help="layers of the 100M model in (b)")
    parser.add_argument("--step-repeats", type=int, default=2)
    parser.add_argument("--torch-100m", action="store_true", help="bf16 rows on the 100M slice")
    parser.add_argument("--out", type=Path, default=REPORT)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny shapes, 1 repeat; prints, writes no file")  # fmt: skip
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.quick:
        args.repeats = args.step_repeats = 1
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    print("(a) Newton-Schulz, fp32", flush=True)
    ns_rows = bench_ns(sizes.ns_n, args.repeats)
    print("(b) optimizer step, 100M config", flush=True)
    big_rows, big_what = bench_step_100m(args.layers, args.step_repeats, args.torch_100m, sizes)
    print("(b') optimizer step, small model", flush=True)
    small_rows, small_times = bench_step_small(args.step_repeats, sizes)
    print("(c) Muon share of a training step", flush=True)
    share_rows, share_what = bench_share(
        sizes.share_tokens, sizes.seq_len, args.step_repeats, small_times, sizes
    )

    env = (
        f"torch {torch.__version__}, {args.threads} CPU thread(s), "
        f"{time.perf_counter() - start:.0f} s in all"
    )
    text = _report(env, ns_rows, big_rows, big_what, small_rows, share_rows, share_what,
                   gemm_rates())  # fmt: skip
    publish(text, None if args.quick else args.out)


if __name__ == "__main__":
    main()
