"""One whole training step on CPU, fp32: unmask's qwen3_dllm against the loop users would
otherwise run (a transformers model, full-vocabulary logits, F.cross_entropy, AdamW).

A step on both sides: forward, the MDLM loss (cross-entropy on the masked positions weighted
1 / t, summed and divided by the batch's B x L tokens), backward, gradient clipping to norm
1, optimizer step.

- unmask: `Trainer.train_step`, the loop users run (objective -> model(targets=) -> the
  masked-only chunked loss -> global normalization -> clip -> optimizer), on a `Trainer`
  built from a run config with these dims (qwen3_dllm, untied head, `optim.name` adamw or
  muon with fp32 Newton-Schulz: what `ns_dtype: auto` picks on a CPU without bf16 matrix
  units, `train.torch_compile`, `train.gradient_checkpointing`). Its batches carry their
  noise (`t`, `masked`, `noisy_input_ids`), so both sides see the same masks.
- reference: transformers' `Qwen3ForCausalLM` (sdpa) called with a 4-D all-True boolean
  mask (B, 1, L, L) (transformers uses a 4-D mask as it is: full bidirectional attention),
  full-vocabulary logits, `F.cross_entropy` on the masked positions weighted 1 / t,
  `torch.optim.AdamW` with its defaults, `clip_grad_norm_`, in a plain loop (the dllm /
  LMMs-Engine recipe), eager.
Same dims (head_dim 64, hidden / 64 query heads, half as many KV heads, intermediate 3 x
hidden), same weights (filled by parameter name from one seeded function: the names are
the same), same batch (random ids, t = (i + 1/2) / B for row i, each position masked with
probability t); the first step's losses must agree (`loss rel. diff`).

Every measurement runs in its own process, forked from the benchmark after it has imported
torch, transformers and unmask (and before any tensor work, so each child starts torch's
thread pool with `--threads`): no import time in any measurement, and memory of its own.
Peak memory is the child's peak RSS from the OS (VmHWM of /proc/self/status; it starts at
the RSS of the imports, the same for both sides, ~300 MB). Each child runs `warmup` untimed
steps, then times `steps` steps (median). Measurements are interleaved over rounds (order
rotated each round); tables give the median over rounds with the min-max spread, and
ratios are taken per round against the reference measured in the same round.

FLOPs executed per step, counted by formula (matmuls only; T = B x L tokens, M = masked
tokens, P = weights of the decoder layers' matmuls, n = layers, A = query heads x head_dim,
H = hidden, V = vocabulary):
  decoder layers        6 P T               (forward 2 P T, backward 4 P T)
  attention scores      12 n B L^2 A        (Q K^T and P V: forward 4, backward 8)
  LM head, unmask       6 M H V             (all in the forward: logits 2, grad of the
                                             hidden states 2, of the head 2; the backward
                                             only scales them: diffusion/loss.py)
  LM head, reference    6 T H V             (every position; logits kept for backward)
  checkpointing         + 2 P T + 4 n B L^2 A (the forward once more)
  Muon                  + Newton-Schulz FLOPs of every Muon matrix (`ns_flops`)
Elementwise work (norms, softmax, RoPE, AdamW) is not counted. Hardware FLOPs utilization
(HFU) = executed FLOPs / step seconds / peak, the peak being the best fp32 GEMM rate of a
probe (2048^3, 1024 x 4096 x 1024 and 512 x 16384 x 512 products, best of 5 each) run in
its own child in every round with the same thread count.

Run: python benchmarks/train_step.py          (writes benchmarks/results/train_step.md;
                                              about 15 minutes on 2 idle cores; torch
                                              threads: every core, --threads to change)
     python benchmarks/train_step.py --quick  (tiny sizes, 1 round, the same code path;
                                              prints the report, writes no file)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import traceback
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from common import REPO, load_average, machine, publish, rotated, with_spread

_STARTED = time.perf_counter()
RESULTS = REPO / "benchmarks" / "results" / "train_step.md"
#: the packages whose versions the report names
PACKAGES = ("torch", "transformers")
HEAD_DIM = 64


@dataclass(frozen=True)
class Case:
    """One measured configuration."""

    impl: str  # "unmask" | "reference"
    vocab: int
    seq: int
    batch: int
    hidden: int
    layers: int
    optim: str = "adamw"  # "adamw" | "muon" (unmask only)
    compile: bool = False
    checkpointing: bool = False  # unmask only
    trim: bool = True  # glibc trim threshold 0 (unmask's train.trim_host_memory default)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def reference(self) -> Case:
        """The reference this case is compared with: the same shape, AdamW, eager."""
        return replace(self, impl="reference", optim="adamw", compile=False, checkpointing=False,
                       trim=False)  # fmt: skip

    def label(self) -> str:
        return (
            f"V {self.vocab:,}, {self.batch} x {self.seq}, hidden {self.hidden} / "
            f"{self.layers} layers"
        )


@dataclass(frozen=True)
class Grid:
    """What one mode measures."""

    big_vocab: int
    small_vocab: int
    seq: int  # the short sequence, 4 rows
    long_seq: int  # 1 row: the same tokens per step at seq 512 / 2048
    sizes: tuple[tuple[int, int], tuple[int, int]]  # (hidden, layers): small, large
    muon_rows: tuple[int, ...]  # rows of `seq` tokens in the Muon sweep
    rounds: int
    warmup: int
    steps: int


FULL = Grid(151_936, 32_000, 512, 2048, ((256, 4), (512, 8)), (1, 4, 8), 3, 1, 1)
QUICK = Grid(4096, 1024, 64, 256, ((128, 2), (256, 2)), (1, 4), 1, 1, 1)

DROPPED = (
    "Measured, of the grid vocab {32,000, 151,936} x sequence {512, 2048} x {hidden 256 / 4 "
    "layers, 512 / 8} x {AdamW, MuonAdamW} x compile {off, on}: the reference pairs at vocab "
    "151,936 (4 x 512 at both sizes, 1 x 2048 at hidden 256) and at vocab 32,000 (4 x 512, "
    "hidden 256); at that last shape also compile on, MuonAdamW and activation "
    "checkpointing, and the Muon sweep over tokens per step; the reference with unmask's host "
    "memory trim and unmask without it, both at hidden 256. Left out so that the full "
    "run stays under 20 minutes on a 2-core machine (each is one line in `cases()`): vocab "
    "32,000 at sequence 2048 and at hidden 512; hidden 512 at sequence 2048 (its reference "
    "step alone is ~40 s at one thread); MuonAdamW and compile at vocab 151,936 (Muon's "
    "share there is smaller than at 32,000: the head is AdamW's); the reference compiled "
    "(the compile row compares with the eager reference; a cold inductor compile of the "
    "whole transformers model takes ~1 minute per process here)."
)


def cases(grid: Grid) -> list[Case]:
    """unmask (AdamW) and the reference on each shape; then unmask alone, compiled, with
    MuonAdamW and with activation checkpointing; the Muon sweep over tokens per step."""
    big, small, seq, long = grid.big_vocab, grid.small_vocab, grid.seq, grid.long_seq
    (h1, n1), (h2, n2) = grid.sizes
    shapes = [
        Case("unmask", big, seq, 4, h1, n1),
        Case("unmask", big, seq, 4, h2, n2),
        Case("unmask", big, long, 1, h1, n1),
        Case("unmask", small, seq, 4, h1, n1),
    ]
    todo = [c for shape in shapes for c in (shape, shape.reference())]
    # the allocator setting on the other side too (like for like), and off on unmask's
    todo += [replace(shapes[0].reference(), trim=True), replace(shapes[0], trim=False)]
    last = shapes[-1]
    todo += [replace(last, compile=True), replace(last, checkpointing=True)]
    for rows in grid.muon_rows:
        todo += [replace(last, batch=rows, optim=o) for o in ("adamw", "muon")]
    return list(dict.fromkeys(todo))  # each case once, in this order


# ------------------------------------------------------------------------------ helpers


def proc_status_kib(field: str) -> int:
    """VmHWM (peak RSS) or VmRSS of this process in KiB (the kernel's numbers)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def preload() -> None:
    """Import what the children use, once, before the first fork (no tensor work: torch's
    thread pool must start in the children, with their thread count)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401

    import unmask.train.trainer  # noqa: F401


def in_child(fn, spec: dict) -> dict:
    """fn(spec) in a forked copy of this process, which holds only the imports: its own
    memory (its VmHWM starts at its RSS when forked, the imports), no import time."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, send the JSON result, leave without cleanup handlers
        os.close(read)
        code = 0
        try:
            out = {"result": fn(spec)}
        except BaseException:  # noqa: BLE001 - reported by the parent
            out, code = {"error": traceback.format_exc()}, 1
        with os.fdopen(write, "w") as pipe:
            pipe.write(json.dumps(out))
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    _, status = os.waitpid(pid, 0)
    out = json.loads(text) if text else {"error": f"no result (wait status {status})"}
    if "error" in out:
        raise RuntimeError(f"{fn.__name__} {spec} failed:\n{out['error'][-3000:]}")
    return out["result"]


# ------------------------------------------------------------------------------- FLOPs


def shape_of(case: Case) -> dict:
    """Heads, KV heads, intermediate size: the dims both sides are built with."""
    heads = max(1, case.hidden // HEAD_DIM)
    return {"heads": heads, "kv_heads": max(1, heads // 2), "intermediate": 3 * case.hidden}


def layer_matmul_params(case: Case) -> int:
    """P: weights of every decoder layer's matmuls (q, k, v, o, gate, up, down)."""
    s, h = shape_of(case), case.hidden
    attention = 2 * h * s["heads"] * HEAD_DIM + 2 * h * s["kv_heads"] * HEAD_DIM
    return case.layers * (attention + 3 * h * s["intermediate"])


def step_flops(case: Case, masked: int, ns_flops: int) -> dict[str, float]:
    """Executed matmul FLOPs of one step by the formulas in the module docstring."""
    tokens, p = case.tokens, layer_matmul_params(case)
    scores = case.layers * case.batch * case.seq**2 * shape_of(case)["heads"] * HEAD_DIM
    head = case.hidden * case.vocab
    parts = {"layers": 6 * p * tokens, "attention": 12 * scores}
    if case.impl == "unmask":
        parts["lm_head"] = 6 * masked * head
    else:
        parts["lm_head"] = 6 * tokens * head
    if case.checkpointing:
        parts["recompute"] = 2 * p * tokens + 4 * scores
    parts["newton_schulz"] = ns_flops
    parts["total"] = sum(parts.values())
    return parts


# ------------------------------------------------------------------------------ children


def fill_weights(model, seed: int) -> None:
    """Every parameter from its name alone: normal(0, 0.02) matrices, unit norm weights.
    unmask's parameter names equal transformers' Qwen3 keys, so both get the same values."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.fill_(1.0)
            else:
                gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
                param.normal_(0.0, 0.02, generator=gen)


def make_batch(case: Case, seed: int) -> dict:
    """Random ids; t = (i + 1/2) / B for row i (stratified: half the tokens masked on
    average, as with t ~ U(0, 1), whatever the batch size); each position masked with
    probability t; the mask id is the last id of the vocabulary."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, case.vocab - 1, (case.batch, case.seq), generator=gen)
    t = (torch.arange(case.batch, dtype=torch.float32) + 0.5) / case.batch
    masked = torch.rand(case.batch, case.seq, generator=gen) < t[:, None]
    noisy = torch.where(masked, torch.full_like(ids, case.vocab - 1), ids)
    return {"input_ids": ids, "t": t, "masked": masked, "noisy_input_ids": noisy}


def _timed_steps(step, warmup: int, steps: int) -> tuple[float, list[float], float]:
    """(first step's loss, seconds of each timed step, seconds of the warm-up steps)."""
    started = time.perf_counter()
    first = float(step())  # the trainer returns the loss as a tensor
    for _ in range(warmup - 1):
        step()
    warm = time.perf_counter() - started
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return first, times, warm


def unmask_config(case: Case, output_dir: str) -> dict:
    """A run config tree with the case's dims (the quickstart's data: never read here)."""
    import yaml

    from unmask.config import quickstart_yaml

    s = shape_of(case)
    tree = yaml.safe_load(quickstart_yaml())
    tree["model"] = {
        "model_type": "qwen3_dllm",
        "vocab_size": case.vocab,
        "hidden_size": case.hidden,
        "intermediate_size": s["intermediate"],
        "num_hidden_layers": case.layers,
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "head_dim": HEAD_DIM,
        "max_position_embeddings": max(4096, case.seq),
        "tie_word_embeddings": False,
    }
    tree["data"].update(synthetic_train_size=64, synthetic_eval_size=8)
    tree["diffusion"] = {"objective": "mdlm"}
    tree["optim"] = {"name": case.optim, "learning_rate": 1e-3, "weight_decay": 0.01,
                     "lr_scheduler_type": "constant", "warmup_steps": 0, "max_grad_norm": 1.0}  # fmt: skip
    if case.optim == "muon":
        tree["optim"]["ns_dtype"] = "float32"
    tree["train"] = {"output_dir": output_dir, "max_steps": 10**6, "device": "cpu",
                     "per_device_train_batch_size": case.batch, "save_steps": 0,
                     "logging_steps": 10**6, "eval_steps": 0, "disable_tqdm": True, "seed": 0,
                     "torch_compile": case.compile,
                     "gradient_checkpointing": case.checkpointing,
                     "trim_host_memory": case.trim}  # fmt: skip
    tree["eval"] = {"generate_accuracy": False}
    return tree


def child_unmask(case: Case, spec: dict) -> tuple:
    from unmask.config import validate_tree
    from unmask.train.trainer import Trainer

    with tempfile.TemporaryDirectory(prefix="unmask-train-step-") as folder:
        return _unmask_steps(case, spec, Trainer(validate_tree(unmask_config(case, folder))))


def _unmask_steps(case: Case, spec: dict, trainer) -> tuple:
    from unmask.optim.newton_schulz import ns_flops
    from unmask.optim.routing import route_parameters

    fill_weights(trainer.model, spec["seed"])
    batch = make_batch(case, spec["seed"])
    ns = 0
    if case.optim == "muon":
        ns = sum(ns_flops(*p.shape) for _, p in route_parameters(trainer.model).muon)
    rss = proc_status_kib("VmRSS")
    result = _timed_steps(lambda: trainer.train_step([batch])["loss"], spec["warmup"],
                          spec["steps"])  # fmt: skip
    trainer.loader.close()
    return (*result, int(batch["masked"].sum()), ns, rss)


def child_reference(case: Case, spec: dict) -> tuple:
    import torch
    import torch.nn.functional as F
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from unmask.train.host_memory import trim_host_memory

    if case.trim:
        trim_host_memory()
    s = shape_of(case)
    config = Qwen3Config(
        vocab_size=case.vocab,
        hidden_size=case.hidden,
        intermediate_size=s["intermediate"],
        num_hidden_layers=case.layers,
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=HEAD_DIM,
        max_position_embeddings=max(4096, case.seq),
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(spec["seed"])
    model = Qwen3ForCausalLM(config)
    model.train()
    fill_weights(model, spec["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    batch = make_batch(case, spec["seed"])
    ids, masked, noisy = batch["input_ids"], batch["masked"], batch["noisy_input_ids"]
    weight = (1.0 / batch["t"])[:, None].expand_as(masked)[masked]
    full = torch.ones(case.batch, 1, case.seq, case.seq, dtype=torch.bool)

    def step() -> float:
        logits = model(input_ids=noisy, attention_mask=full).logits  # (B, L, V)
        ce = F.cross_entropy(logits[masked], ids[masked], reduction="none")
        loss = (ce * weight).sum() / masked.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    rss = proc_status_kib("VmRSS")
    return (*_timed_steps(step, spec["warmup"], spec["steps"]), int(masked.sum()), 0, rss)


def child_step(spec: dict) -> dict:
    """One case: warm-up, timed steps, peak RSS, what the FLOP count needs."""
    import torch

    torch.set_num_threads(spec["threads"])
    case = Case(**spec["case"])
    run = child_unmask if case.impl == "unmask" else child_reference
    first, times, warm, masked, ns, rss = run(case, spec)
    return {"loss": first, "seconds": statistics.median(times), "warmup_seconds": warm,
            "masked": masked, "ns_flops": ns, "rss_before_kib": rss,
            "peak_rss_kib": proc_status_kib("VmHWM")}  # fmt: skip


def child_probe(spec: dict) -> dict:
    """Best fp32 GEMM rate (FLOP/s) over a few large shapes."""
    import torch

    torch.set_num_threads(spec["threads"])
    best = 0.0
    for m, k, n in ((2048, 2048, 2048), (1024, 4096, 1024), (512, 16384, 512)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        torch.mm(a, b, out=out)
        for _ in range(spec["repeats"]):
            started = time.perf_counter()
            torch.mm(a, b, out=out)
            best = max(best, 2 * m * k * n / (time.perf_counter() - started))
    return {"flops_per_s": best}


# ------------------------------------------------------------------------------ report


def collect(grid: Grid, threads: int, seed: int) -> tuple[dict[Case, list[dict]], list[float]]:
    """Every case once per round, in a rotated order, plus one GEMM probe per round."""
    todo = cases(grid)
    results: dict[Case, list[dict]] = {c: [] for c in todo}
    peaks: list[float] = []
    for r in range(grid.rounds):
        peaks.append(in_child(child_probe, {"threads": threads, "repeats": 5})["flops_per_s"])
        print(f"round {r + 1}: GEMM peak {peaks[-1] / 1e9:.1f} GFLOP/s", flush=True)
        for case in rotated(todo, r):
            spec = {"case": asdict(case), "threads": threads, "seed": seed,
                    "warmup": grid.warmup, "steps": grid.steps}  # fmt: skip
            started = time.perf_counter()
            out = in_child(child_step, spec)
            out["wall"] = time.perf_counter() - started
            out["flops"] = step_flops(case, out["masked"], out["ns_flops"])
            out["hfu"] = out["flops"]["total"] / out["seconds"] / peaks[-1]
            results[case].append(out)
            print(f"  {case.impl:9s} {case.optim:5s} {case.label()}"
                  f"{' compile' if case.compile else ''}"
                  f"{' checkpointing' if case.checkpointing else ''}: {out['seconds']:.2f} s/step, "
                  f"peak {out['peak_rss_kib'] / 1024:.0f} MiB, HFU {out['hfu']:.0%}, "
                  f"{out['wall']:.0f} s in all", flush=True)  # fmt: skip
    return results, peaks


def per_round(results: dict, a: Case, b: Case, key) -> list[float]:
    """key(result of a) / key(result of b), round by round."""
    return [key(x) / key(y) for x, y in zip(results[a], results[b])]


def tokens_per_s(case: Case):
    return lambda r: case.tokens / r["seconds"]


def peak_mib(r: dict) -> float:
    return r["peak_rss_kib"] / 1024


def comparison_table(results: dict) -> list[str]:
    rows = [
        "| shape | optimizer | compile | host memory trim (unmask / reference) | unmask tokens/s "
        "| reference tokens/s | tokens/s ratio "
        "| unmask peak RSS MiB | reference peak RSS MiB | memory ratio | unmask HFU "
        "| reference HFU | loss rel. diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    pairs = [(case, ref) for case in results if case.impl == "unmask" and not case.checkpointing
             for ref in (case.reference(), replace(case.reference(), trim=True))
             if ref in results]  # fmt: skip
    for case, ref in pairs:
        speed = per_round(results, case, ref, lambda r: 1 / r["seconds"])
        memory = per_round(results, case, ref, peak_mib)
        loss = [abs(x["loss"] - y["loss"]) / abs(y["loss"])
                for x, y in zip(results[case], results[ref])]  # fmt: skip
        rows.append(
            f"| {case.label()} | {case.optim} | {'on' if case.compile else 'off'} | "
            f"{on_off(case.trim)} / {on_off(ref.trim)} | "
            f"{with_spread([case.tokens / r['seconds'] for r in results[case]], '{:.0f}')} | "
            f"{with_spread([ref.tokens / r['seconds'] for r in results[ref]], '{:.0f}')} | "
            f"{with_spread(speed)}x | "
            f"{with_spread([peak_mib(r) for r in results[case]], '{:.0f}')} | "
            f"{with_spread([peak_mib(r) for r in results[ref]], '{:.0f}')} | "
            f"{with_spread(memory)}x | "
            f"{with_spread([r['hfu'] * 100 for r in results[case]], '{:.0f}')}% | "
            f"{with_spread([r['hfu'] * 100 for r in results[ref]], '{:.0f}')}% | "
            f"{max(loss):.1e} |"
        )
    return rows


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


def gflop(flops: float) -> str:
    """GFLOP with three significant digits."""
    return f"{flops / 1e9:.3g}"


def detail_table(results: dict) -> list[str]:
    rows = [
        "| side | shape | optimizer | compile | checkpointing | trim | step s | warm-up s "
        "| RSS before step MiB | peak RSS MiB | masked tokens | GFLOP/step (layers + attention "
        "+ head + NS) | HFU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, runs in results.items():
        f = runs[0]["flops"]
        parts = " + ".join(gflop(f[k]) for k in ("layers", "attention", "lm_head", "newton_schulz"))
        if case.checkpointing:
            parts += f" + {gflop(f['recompute'])} recompute"
        rows.append(
            f"| {case.impl} | {case.label()} | {case.optim} | {'on' if case.compile else 'off'} | "
            f"{'full' if case.checkpointing else 'none'} | {on_off(case.trim)} | "
            f"{with_spread([r['seconds'] for r in runs])} | "
            f"{with_spread([r['warmup_seconds'] for r in runs], '{:.1f}')} | "
            f"{with_spread([r['rss_before_kib'] / 1024 for r in runs], '{:.0f}')} | "
            f"{with_spread([peak_mib(r) for r in runs], '{:.0f}')} | {runs[0]['masked']} | "
            f"{gflop(f['total'])} = {parts} | "
            f"{with_spread([r['hfu'] * 100 for r in runs], '{:.0f}')}% |"
        )
    return rows


def muon_table(results: dict, grid: Grid) -> list[str]:
    rows = [
        "| shape | tokens/step | AdamW step s | MuonAdamW step s | measured Muon cost "
        "| FLOP model (NS / step FLOPs) | measured / model |",
        "|---|---|---|---|---|---|---|",
    ]
    sweep = [c for c in results if c.optim == "muon" and c.impl == "unmask"]
    for muon in sorted(sweep, key=lambda c: (c.vocab, c.hidden, c.tokens)):
        adamw = replace(muon, optim="adamw")
        if adamw not in results:
            continue
        cost = [x - 1 for x in per_round(results, muon, adamw, lambda r: r["seconds"])]
        model = [m["flops"]["newton_schulz"] / a["flops"]["total"]
                 for m, a in zip(results[muon], results[adamw])]  # fmt: skip
        ratio = [c / m for c, m in zip(cost, model)]
        rows.append(
            f"| {muon.label()} | {muon.tokens} | "
            f"{with_spread([r['seconds'] for r in results[adamw]])} | "
            f"{with_spread([r['seconds'] for r in results[muon]])} | "
            f"{with_spread([c * 100 for c in cost], '{:+.1f}')}% | "
            f"{statistics.median(model):.1%} | {with_spread(ratio)}x |"
        )
    return rows


def levers_table(results: dict) -> list[str]:
    rows = [
        "| shape | lever | step s | tokens/s | peak RSS MiB | vs default: time "
        "| vs default: peak RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in results:
        if case.impl != "unmask" or not (case.checkpointing or not case.trim):
            continue
        base = replace(case, checkpointing=False, trim=True)
        for c in (base, case):
            t = per_round(results, c, base, lambda r: r["seconds"])
            m = per_round(results, c, base, peak_mib)
            rows.append(
                f"| {c.label()} | {lever(c)} | "
                f"{with_spread([r['seconds'] for r in results[c]])} | "
                f"{with_spread([c.tokens / r['seconds'] for r in results[c]], '{:.0f}')} | "
                f"{with_spread([peak_mib(r) for r in results[c]], '{:.0f}')} | "
                f"{with_spread(t)}x | {with_spread(m)}x |"
            )
    return rows


def lever(case: Case) -> str:
    if case.checkpointing:
        return "activation checkpointing: full"
    return "default (trim on)" if case.trim else "host memory trim off"


def report(results: dict, peaks: list[float], grid: Grid, args, load_before: str) -> str:
    wall = time.perf_counter() - _STARTED
    mode = " --quick" if args.quick else ""
    return "\n".join(
        [
            "# One training step: unmask vs transformers + F.cross_entropy + AdamW (CPU, fp32)",
            "",
            f"Written by `benchmarks/train_step.py{mode}` on {machine(*PACKAGES)}; "
            f"{args.threads} torch thread(s); {grid.rounds} interleaved round(s) of every case, "
            f"each in its own process ({grid.warmup} warm-up step(s), then the median of {grid.steps} timed "
            f"step(s)); {wall / 60:.1f} minutes in all; load average {load_before} before, "
            f"{load_average()} after. fp32 GEMM peak (probe): "
            f"{with_spread([p / 1e9 for p in peaks], '{:.1f}')} GFLOP/s. Medians with the "
            "min-max spread over rounds; ratios are per round (unmask / reference: above 1 is "
            "faster for tokens/s, below 1 is smaller for memory).",
            "",
            "What is measured and how FLOPs are counted: the module docstring of "
            "benchmarks/train_step.py.",
            "",
            "## unmask vs the reference",
            "",
            *comparison_table(results),
            "",
            "The reference is eager and AdamW in every row: a Muon row compares MuonAdamW's "
            "whole step with the reference's AdamW step, the compile row unmask's compiled "
            "blocks (`train.torch_compile`) with the eager reference. unmask's CPU trainer "
            "sets glibc's malloc trim threshold to 0 (`train.trim_host_memory`, on by default): "
            "freed activations go back to the OS instead of staying resident; the row with "
            "trim on / on gives the reference the same setting (like for like), so the part "
            "of the memory ratio that is the allocator setting and the part that is the "
            "model and loss code can be told apart. Batch: 4 rows of the "
            "short sequence, 1 row of the long one (the same tokens per step). Acceptance "
            "(issue 15): at vocab 151,936, 4 x 512, AdamW: >= 2.0x tokens/s and <= 0.45x peak "
            "memory at hidden 256, >= 1.6x and <= 0.6x at hidden 512; HFU >= 55% at hidden 512.",
            "",
            "## Muon's cost in the whole step",
            "",
            *muon_table(results, grid),
            "",
            "Measured cost = MuonAdamW step / AdamW step - 1 (unmask both, same round); FLOP "
            "model = Newton-Schulz FLOPs (fp32, 5 steps, 20 n^2 m + 10 n^3 per n x m matrix) "
            "over the AdamW step's executed FLOPs. Elementwise work the model leaves out "
            "(momentum, the update, Muon's per-matrix overhead) shows most at few tokens.",
            "",
            "## Memory levers",
            "",
            *levers_table(results),
            "",
            "Host memory trim off is `train.trim_host_memory: false` (glibc's defaults). "
            "Activation checkpointing is `train.activation_checkpointing: full` (every decoder "
            "layer recomputed in backward; `selective`, every n-th layer, is not measured "
            "here). The masked-only chunked loss "
            "against full-vocabulary logits, on its own, is in masked_loss_memory.md; in a "
            "whole step the reference rows above are its other side (with transformers' model "
            "code). bf16 parameters with fp32 master state are not measured (an fp32 CPU run).",
            "",
            "## Every case",
            "",
            *detail_table(results),
            "",
            DROPPED,
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 round (smoke)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (3)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per child (default: every core; 1 with --quick)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=None,
                        help=f"report path (default {RESULTS.relative_to(REPO)}; none with "
                        "--quick)")  # fmt: skip
    args = parser.parse_args()
    preload()
    grid = QUICK if args.quick else FULL
    if args.threads is None:
        args.threads = 1 if args.quick else os.cpu_count() or 1
    if args.rounds:
        grid = replace(grid, rounds=args.rounds)
    load_before = load_average()
    print(f"{machine(*PACKAGES)}; {grid.rounds} round(s), {len(cases(grid))} cases", flush=True)
    results, peaks = collect(grid, args.threads, args.seed)
    text = report(results, peaks, grid, args, load_before)
    publish(text, args.results or (None if args.quick else RESULTS))


if __name__ == "__main__":
    main()
