"""The phases of `python benchmarks/gpu.py --profile`: each runs in a process of its own
(`gpu.py --phase NAME`) and writes its results (JSON and a Markdown table) before it ends,
so a run cut off by its time limit keeps every phase that finished.

- `env`: the machine (torch, CUDA, the GPU, its clocks from nvidia-smi) and GEMM rates:
  8192^3 in bf16, float32 and TF32; the LM head's shapes (256 x 4096 x 126,464) in bf16
  (bf16 result, float32 result through `out_dtype`) and float32; a Newton-Schulz-shaped
  product; a batch's host-to-device copy from pageable and pinned memory.
- `train-<case>`: the real Trainer on a config of configs/models/ cut to a few layers, at a
  fixed masked fraction (`diffusion.t_sampling: fixed`): step times from CUDA events
  (median, spread), the optimizer's share, model FLOPs per step (mfu.CallFlops), MFU end to
  end and model-only (the step less the optimizer), peak memory against `unmask plan`'s,
  the host syncs of one step (torch.cuda.set_sync_debug_mode and unmask's own audit, each
  with the unmask line that made it), the matmul FLOPs by dtype, graph breaks and
  recompiles, and a profiler summary (time by kernel, matmul time by dtype and shape, the
  GPU's busy share of the step, the largest idle gaps with the kernels around them).
- `sample`: the dense slice decoding 256 tokens in blocks of 32, one token per step (a
  fixed 32 forwards per block: random weights do not end rows early), batch 1 and 32, with
  no cache, the prefix cache and the dual cache: forwards/s and tokens/s.
- `serve`: `unmask serve` with that model on the GPU, 32 concurrent clients: tokens/s.
- `cuda-tests`: `pytest -m cuda` (the tests that need a GPU).

`--dry` runs every phase on the CPU with tiny shapes (CI runs it): the code paths, the
files and their format, in about a minute; no number of it means anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "configs" / "models"

_MOE = ["model.model_type=llada_moe", "model.hidden_size=2048", "model.intermediate_size=1024",
        "model.num_attention_heads=16", "model.num_key_value_heads=16",
        "model.vocab_size=157184", "model.num_experts=64", "model.num_experts_per_tok=8",
        "model.moe_intermediate_size=1024", "model.router_aux_loss_coef=0.01"]  # fmt: skip
_COMMON = ["model.num_hidden_layers=4", "train.per_device_train_batch_size=2",
           "train.torch_compile=true", "data.packing=true", "diffusion.t_sampling=fixed",
           "train.activation_checkpointing=auto", "train.save_steps=0", "train.eval_steps=0",
           "train.logging_steps=1000", "train.nonfinite_check=logging"]  # fmt: skip
#: case -> (config, overrides): 4-layer slices of the real shapes on one GPU
TRAIN_CASES = {
    "llada-8b-muon": (MODELS / "llada_8b.yaml", _COMMON),
    "llada-moe-7b-a1b-muon": (MODELS / "llada_8b.yaml", _COMMON + _MOE),
    "dream-7b-adamw": (MODELS / "dream_7b.yaml", _COMMON),
    # Muon amortized as real runs do: 8 micro-batches (65,536 tokens) per optimizer step
    "llada-8b-muon-64k": (MODELS / "llada_8b.yaml",
                          _COMMON + ["train.gradient_accumulation_steps=8"]),
    # the first case with its decoder linears in float8 (torchao)
    "llada-8b-muon-float8": (MODELS / "llada_8b.yaml", _COMMON + ["train.float8=true"]),
    # Muon's cost on the GPU (issue 47): its optimizer step against AdamW's, at 8,192 tokens
    # per optimizer step (the first case's) and at 262,144 (32 micro-batches), and with Gram
    # Newton-Schulz; each phase times its optimizer steps apart from the rest of the step
    "llada-8b-adamw": (MODELS / "llada_8b.yaml", _COMMON + ["optim.name=adamw"]),
    "llada-8b-muon-gram": (MODELS / "llada_8b.yaml", _COMMON + ["optim.ns_coefficients=gram"]),
    "llada-8b-muon-256k": (MODELS / "llada_8b.yaml",
                           _COMMON + ["train.gradient_accumulation_steps=32"]),
    "llada-8b-adamw-256k": (MODELS / "llada_8b.yaml",
                            _COMMON + ["optim.name=adamw", "train.gradient_accumulation_steps=32"]),
    # DiffusionGemma 26B-A4B's shapes (issue 45: bf16 and compile on the GPU): 6 of its 30
    # layers (five sliding, one full), 32 of its 128 experts (each expert's shape, top 8, so
    # a token's FLOPs are the real model's per layer), the uniform objective with
    # self-conditioning and the router frozen, four rows of 512 tokens and a 256-token canvas
    "diffusion-gemma-26b-a4b": (MODELS / "diffusion_gemma_26b_a4b.yaml",
                                ["model.num_hidden_layers=6", "model.num_experts=32",
                                 "parallel.expert_parallel=1", "train.per_device_train_batch_size=4",
                                 "train.torch_compile=true", "train.save_steps=0",
                                 "train.eval_steps=0", "train.logging_steps=1000",
                                 "train.nonfinite_check=logging"]),
}  # fmt: skip
#: what --dry makes of DiffusionGemma's case: its own small sizes (two sliding layers of
#: 16 features and a full one of 32)
DRY_GEMMA = ["train.torch_compile=false", "train.bf16=false", "model.hidden_size=64",
             "model.intermediate_size=128", "model.num_attention_heads=4",
             "model.num_key_value_heads=2", "model.head_dim=16", "model.num_hidden_layers=3",
             "model.vocab_size=512", "model.diffusion_gemma.global_head_dim=32",
             "model.diffusion_gemma.num_global_key_value_heads=1",
             "model.diffusion_gemma.sliding_window=16",
             "model.diffusion_gemma.layer_types=[sliding_attention,sliding_attention,full_attention]",
             "model.diffusion_gemma.canvas_length=16", "data.packing_length=48",
             "data.synthetic_train_size=512"]  # fmt: skip
#: what --dry makes of every case: a model a CPU trains in seconds, the case's own layout
DRY = ["train.float8=false", "model.hidden_size=64", "model.intermediate_size=128", "model.num_attention_heads=4",
       "model.num_key_value_heads=4", "model.num_hidden_layers=2", "model.vocab_size=512",
       "data.packing_length=64", "train.torch_compile=false", "train.bf16=false",
       "model.attn_implementation=sdpa", "data.synthetic_train_size=512"]  # fmt: skip
DRY_MOE = ["model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32"]


def _write(out: Path, name: str, result: dict, table: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / f"{name}.md").write_text("\n".join(table) + "\n")


def _device(dry: bool):
    import torch

    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu.py --profile: no CUDA device is visible; use --dry on a CPU")
    return torch.device("cuda")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


class _Timer:
    """Seconds of device work between marks: CUDA events (read once, at the end) on a GPU,
    the wall clock on a CPU."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self._event = (lambda: torch.cuda.Event(enable_timing=True)) if self.cuda else None

    def mark(self):
        if self.cuda:
            event = self._event()
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, stop) -> float:
        return start.elapsed_time(stop) / 1e3 if self.cuda else stop - start


def _rate(fn, flops: float, device, repeats: int = 10) -> float:
    """TFLOP/s of fn (after 3 untimed calls), from the median of `repeats` timed calls."""
    timer = _Timer(device)
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = timer.mark()
        fn()
        stop = timer.mark()
        _sync(device)
        times.append(timer.seconds(start, stop))
    return flops / statistics.median(times) / 1e12


# --------------------------------------------------------------------------------- env


def phase_env(out: Path, dry: bool) -> dict:
    import torch

    device = _device(dry)
    result: dict = {"torch": torch.__version__, "cuda": torch.version.cuda,
                    "python": sys.version.split()[0],
                    "float32_matmul_precision": torch.get_float32_matmul_precision()}  # fmt: skip
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        result.update(device=props.name, multiprocessors=props.multi_processor_count,
                      memory_gib=round(props.total_memory / 2**30, 1))  # fmt: skip
        try:
            query = "name,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
            smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
                                 capture_output=True, text=True, timeout=20)  # fmt: skip
            result["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            result["nvidia_smi"] = f"not read: {err}"
    else:
        result["device"] = "cpu (dry run)"
    n, rows, hidden, vocab = (256, 16, 64, 512) if dry else (8192, 256, 4096, 126_464)
    rates = {}
    for name, dtype, precision in (("bf16", torch.bfloat16, "highest"),
                                   ("float32", torch.float32, "highest"),
                                   ("tf32", torch.float32, "high")):  # fmt: skip
        torch.set_float32_matmul_precision(precision)
        a = torch.randn(n, n, device=device, dtype=dtype)
        rates[f"{n}^3 {name}"] = _rate(lambda a=a: a @ a, 2 * n**3, device)
    torch.set_float32_matmul_precision("highest")
    h = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    w = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16)
    head = 2 * rows * hidden * vocab
    rates[f"head {rows}x{hidden}x{vocab} bf16"] = _rate(lambda: h @ w.T, head, device)
    try:
        rates[f"head {rows}x{hidden}x{vocab} bf16, float32 out"] = _rate(
            lambda: torch.mm(h, w.T, out_dtype=torch.float32), head, device)  # fmt: skip
    except (RuntimeError, TypeError) as err:
        rates[f"head {rows}x{hidden}x{vocab} bf16, float32 out"] = f"unavailable: {err}"[:120]
    hf, wf = h.float(), w.float()
    rates[f"head {rows}x{hidden}x{vocab} float32"] = _rate(lambda: hf @ wf.T, head, device)
    m, k = (64, 192) if dry else (4096, 12288)  # a Muon matrix's X X^T in Newton-Schulz
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    rates[f"NS X X^T {m}x{k} bf16"] = _rate(lambda: x @ x.T, 2 * m * m * k, device)
    result["tflops"] = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in rates.items()}
    copies = {}
    batch = torch.randint(0, 1000, (2, 64 if dry else 4096))
    for name, source in (("pageable", batch),
                         ("pinned", batch.pin_memory() if device.type == "cuda" else batch)):  # fmt: skip
        timer = _Timer(device)
        start = timer.mark()
        for _ in range(20):
            source.to(device, non_blocking=True)
        stop = timer.mark()
        _sync(device)
        copies[name] = round(timer.seconds(start, stop) / 20 * 1e6, 1)
    result["batch_copy_us"] = copies
    table = [f"# GPU profile: environment ({result['device']})", "",
             f"torch {result['torch']}, CUDA {result['cuda']}, Python {result['python']}", "",
             "| GEMM | TFLOP/s |", "| --- | --- |"]  # fmt: skip
    table += [f"| {k} | {v} |" for k, v in result["tflops"].items()]
    table += ["", f"A (2, {batch.shape[1]}) batch to the device: {copies['pageable']} us from "
              f"pageable memory, {copies['pinned']} us pinned."]  # fmt: skip
    if "nvidia_smi" in result:
        table += ["", "```", result["nvidia_smi"], "```"]
    _write(out, "env", result, table)
    return result


# ------------------------------------------------------------------------------- train


def _case_config(case: str, dry: bool, out: Path):
    from unmask.config import load_config

    config, overrides = TRAIN_CASES[case]
    overrides = list(overrides)
    if dry:
        # a smoke check: the same path with at most 2 micro-batches per optimizer step
        accumulation = "train.gradient_accumulation_steps="
        overrides = [f"{accumulation}{min(int(o.split('=')[1]), 2)}" if o.startswith(accumulation)
                     else o for o in overrides]  # fmt: skip
        if "gemma" in case:
            replaced = {d.split("=")[0] for d in DRY_GEMMA + DRY_MOE}
            overrides = [o for o in overrides if o.split("=")[0] not in replaced] + DRY_GEMMA
            overrides += DRY_MOE
        else:
            overrides = [o for o in overrides if not o.startswith("model.vocab_size")] + DRY
        if "moe" in case:
            replaced = {d.split("=")[0] for d in DRY_MOE}
            overrides = [o for o in overrides if o.split("=")[0] not in replaced] + DRY_MOE
    run = out / f"run-{case}"
    return load_config(config, [*overrides, f"train.output_dir={run}",
                                "train.overwrite_output_dir=true"]), config, overrides  # fmt: skip


def _plan_peak(config: Path, overrides: list[str], device_name: str) -> float | None:
    """unmask plan's peak bytes of the run on one device of this kind (None: no match)."""
    from unmask.config import load_config
    from unmask.plan.devices import DEVICES, resolve_device
    from unmask.plan.planner import make_run_plan

    kind = next((k for k in DEVICES if k != "cpu" and k in device_name.lower()), None)
    if kind is None:
        return None
    cfg = load_config(config, overrides)
    return make_run_plan(cfg, 1, resolve_device(kind), ranks=[0]).ranks[0].memory.peak


def _cuda_syncs(step) -> list[str]:
    """The unmask lines of the synchronizing CUDA calls torch reports during step()."""
    import torch

    found: list[str] = []
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack() if "/unmask/" in f.filename]
            where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}" \
                if frames else "(outside unmask)"  # fmt: skip
            found.append(f"{str(message).split(':')[0][:80]} at {where}")
        else:
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = original
    return found


def _profile_summary(prof, step_seconds: float) -> dict:
    """Time by kernel, matmul time by dtype and shape, the GPU's busy share and its largest
    idle gaps, from a torch.profiler run."""
    averages = prof.key_averages(group_by_input_shape=True)

    def device_time(e) -> float:
        return getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)

    kernels = sorted(prof.key_averages(), key=lambda e: -device_time(e))[:30]
    top = [{"name": e.key[:90], "calls": e.count, "device_ms": round(device_time(e) / 1e3, 3)}
           for e in kernels if device_time(e) > 0]  # fmt: skip
    matmuls = {}
    for e in averages:
        if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm",
                     "aten::_scaled_mm", "aten::linear", "aten::matmul"):  # fmt: skip
            key = f"{e.key} {e.input_shapes}"[:140]
            cuda = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
            matmuls[key] = matmuls.get(key, 0) + cuda / 1e3
    matmul_rows = sorted(matmuls.items(), key=lambda kv: -kv[1])[:25]
    intervals = []
    for event in prof.events():
        kind = str(getattr(event, "device_type", ""))
        if "CUDA" in kind and event.time_range.elapsed_us() > 0:
            intervals.append((event.time_range.start, event.time_range.end, event.name))
    intervals.sort()
    busy, gaps, cursor, last = 0.0, [], None, None
    for start, end, name in intervals:
        if cursor is None:
            cursor, last = end, name
            busy += end - start
            continue
        if start > cursor:
            gaps.append((start - cursor, last, name))
            busy += end - start
        elif end > cursor:
            busy += end - cursor
        if end > cursor:
            cursor, last = end, name
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 0
    gaps.sort(reverse=True)
    return {
        "top_kernels": top,
        "matmul_ms_by_op_and_shape": [{"op": k, "device_ms": round(v, 3)} for k, v in matmul_rows],
        "gpu_busy_share": round(busy / span, 4) if span else None,
        "largest_idle_gaps_us": [
            {"us": round(g, 1), "after": a[:70], "before": b[:70]} for g, a, b in gaps[:10]
        ],  # fmt: skip
        "traced_span_ms": round(span / 1e3, 3),
        "step_ms": round(step_seconds * 1e3, 3),
    }


def phase_train(out: Path, case: str, dry: bool, warmup: int = 3, steps: int = 8) -> dict:
    import torch

    import unmask.plan.checkpointing  # noqa: F401 (activation_checkpointing auto decides)
    from unmask.train.audit import MatmulAudit, SyncAudit
    from unmask.train.mfu import device_peak, matmul_dtype
    from unmask.train.trainer import Trainer

    device = _device(dry)
    cfg, config, overrides = _case_config(case, dry, out)
    if dry:
        warmup, steps = 1, 2
    started = time.perf_counter()
    trainer = Trainer(cfg)
    build_s = time.perf_counter() - started
    # activation_checkpointing auto, as `unmask train` decides it (the planner's memory walk)
    checkpointing = next((n for n in trainer.notices if n.startswith("activation checkpointing")),
                         f"activation checkpointing: {cfg.train.activation_checkpointing}")  # fmt: skip
    chosen = checkpointing.split(":", 1)[1].split("(")[0].strip()
    accumulation = cfg.train.gradient_accumulation_steps
    timer = _Timer(device)
    optimizer_step = trainer.optimizer.step
    marks: list = []

    def timed_optimizer_step(*args, **kwargs):
        start = timer.mark()
        result = optimizer_step(*args, **kwargs)
        marks.append((start, timer.mark()))
        return result

    trainer.optimizer.step = timed_optimizer_step

    def one_step() -> dict:
        batches = [next(trainer.loader) for _ in range(accumulation)]
        stats = trainer.train_step(batches)
        trainer.step += 1
        return stats

    import torch._dynamo.utils as dynamo_utils

    compile_started = time.perf_counter()
    for _ in range(warmup):
        one_step()
    _sync(device)
    warmup_s = time.perf_counter() - compile_started
    compiled = {k: dict(v) for k, v in dynamo_utils.counters.items() if v}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    marks.clear()
    records = []
    for _ in range(steps):
        start = timer.mark()
        stats = one_step()
        stop = timer.mark()
        masked = trainer.objective.last_stats.get("num_masked")
        records.append((start, stop, stats["flops"], masked))
    _sync(device)
    step_s = [timer.seconds(a, b) for a, b, _, _ in records]
    optimizer_s = [timer.seconds(a, b) for a, b in marks[-steps:]]
    flops = [float(f) for _, _, f, _ in records]
    masked = [float(m) if m is not None else None for _, _, _, m in records]
    after = {k: dict(v) for k, v in dynamo_utils.counters.items() if v}
    peak_bytes = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    dtype = matmul_dtype(device.type, cfg.train.bf16)
    peak_flops = device_peak(device, dtype).flops
    e2e = sum(flops) / sum(step_s) / peak_flops
    model_only = sum(flops) / (sum(step_s) - sum(optimizer_s)) / peak_flops
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    try:
        resolved = f"train.activation_checkpointing={chosen}"
        planned = _plan_peak(config, [*overrides, resolved], name)
    except Exception as err:  # the plan is a comparison, not the measurement
        planned = f"not planned: {err}"[:160]
    # one step each: torch's sync report, unmask's audits (eager: a dispatch mode and
    # compiled graphs do not mix), the profiler
    syncs = _cuda_syncs(one_step) if device.type == "cuda" else "no CUDA (dry run)"
    with torch.compiler.set_stance("force_eager"):
        with MatmulAudit() as matmul_audit, SyncAudit() as sync_audit:
            one_step()
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(2):
            one_step()
        _sync(device)
    summary = _profile_summary(prof, statistics.median(step_s))
    trainer.loader.close()
    result = {
        "case": case, "device": name, "config": str(config.relative_to(REPO)),
        "overrides": overrides, "tokens_per_step": trainer.plan.tokens_per_step,
        "activation_checkpointing": checkpointing,
        "build_s": round(build_s, 1), "warmup_s": round(warmup_s, 1),
        "step_s": [round(s, 4) for s in step_s],
        "step_s_median": round(statistics.median(step_s), 4),
        "step_spread": round((max(step_s) - min(step_s)) / statistics.median(step_s), 4),
        "optimizer_s": [round(s, 4) for s in optimizer_s],
        "masked_per_step": masked, "flops_per_step": flops,
        "peak_flops": peak_flops, "mfu_end_to_end": round(e2e, 4),
        "mfu_model_only": round(model_only, 4),
        "peak_gib": None if peak_bytes is None else round(peak_bytes / 2**30, 2),
        "planned_peak_gib": planned if not isinstance(planned, float) else round(planned / 2**30, 2),
        "cuda_syncs": syncs, "audit_syncs": sync_audit.found,
        "matmul_flops_by_dtype": {str(k): v for k, v in matmul_audit.flops_by_dtype().items()},
        "float32_matmuls": [[r.op, r.shapes, r.flops] for r in matmul_audit.largest(torch.float32)],
        "dynamo_after_warmup": compiled, "dynamo_after_timed_steps": after,
        "profile": summary,
    }  # fmt: skip
    graph_breaks = sum(after.get("graph_break", {}).values())
    recompiles = after.get("stats", {}).get("unique_graphs", 0) - compiled.get(
        "stats", {}).get("unique_graphs", 0)  # fmt: skip
    fp32 = result["matmul_flops_by_dtype"].get("torch.float32", 0)
    total = max(1, sum(result["matmul_flops_by_dtype"].values()))
    table = [f"# GPU profile: {case} ({name})", "",
             f"{result['config']} with {' '.join(overrides)}; {result['tokens_per_step']} tokens "
             f"per optimizer step; build {result['build_s']} s, {warmup} warm-up steps "
             f"{result['warmup_s']} s (the first compiles); "
             f"{result['activation_checkpointing']}", "",
             "| step s (median, spread) | optimizer s | MFU end to end | MFU model-only | "
             "GPU busy | syncs/step | float32 matmul FLOPs | graph breaks / new graphs after warm-up | "
             "peak GiB (plan) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
             f"| {result['step_s_median']} ({result['step_spread']:.1%}) | "
             f"{statistics.median(optimizer_s) if optimizer_s else '-':.4} | {e2e:.1%} | "
             f"{model_only:.1%} | {summary['gpu_busy_share']} | "
             f"{len(syncs) if isinstance(syncs, list) else '-'} (audit {len(sync_audit.found)}) | "
             f"{fp32 / total:.2%} | {graph_breaks} / {recompiles} | "
             f"{result['peak_gib']} ({result['planned_peak_gib']}) |", "",
             "Syncs (torch): " + (", ".join(syncs) if isinstance(syncs, list) and syncs else
                                  str(syncs) if not isinstance(syncs, list) else "none"),
             "", "Top kernels by device time:", "",
             "| kernel | calls | device ms |", "| --- | --- | --- |"]  # fmt: skip
    table += [
        f"| {k['name']} | {k['calls']} | {k['device_ms']} |" for k in summary["top_kernels"][:15]
    ]
    table += ["", "Largest GPU idle gaps:", "", "| us | after | before |", "| --- | --- | --- |"]
    table += [f"| {g['us']} | {g['after']} | {g['before']} |"
              for g in summary["largest_idle_gaps_us"]]  # fmt: skip
    _write(out, f"train-{case}", result, table)
    return result


# ------------------------------------------------------------------------------ sample


def _slice_model(dry: bool, device):
    import torch

    from unmask.config import load_config
    from unmask.models import build_model

    overrides = ["model.num_hidden_layers=4"] + (DRY if dry else [])
    cfg = load_config(MODELS / "llada_8b.yaml", overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(cfg.model)
    dtype = torch.float32 if dry else torch.bfloat16
    return model.to(dtype).eval(), cfg


def phase_sample(out: Path, dry: bool) -> dict:
    import torch

    from unmask.sampling import SamplingConfig, sample

    device = _device(dry)
    model, cfg = _slice_model(dry, device)
    gen, block, prompt = (32, 8, 16) if dry else (256, 32, 64)
    rows = []
    for batch in (1, 32):
        ids = torch.randint(10, 1000 if not dry else 500, (batch, prompt), device=device)
        for cache in ("none", "prefix", "dual"):
            config = SamplingConfig(gen_length=gen, block_length=block, steps=gen, cache=cache)
            with torch.inference_mode():
                sample(model, ids, config, mask_id=cfg.model.vocab_size - 1)  # warm-up
                _sync(device)
                started = time.perf_counter()
                got = sample(model, ids, config, mask_id=cfg.model.vocab_size - 1)
                _sync(device)
            seconds = time.perf_counter() - started
            rows.append({"batch": batch, "cache": cache, "forwards": got.nfe,
                         "seconds": round(seconds, 4), "forwards_per_s": round(got.nfe / seconds, 1),
                         "tokens_per_s": round(batch * gen / seconds, 1)})  # fmt: skip
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = {"device": name, "gen_length": gen, "block_length": block, "prompt": prompt,
              "rows": rows}  # fmt: skip
    table = [f"# GPU profile: sampling, the dense slice ({name})", "",
             f"4-layer LLaDA-8B shape, random weights, {prompt}-token prompts, {gen} tokens in "
             f"blocks of {block}, one token per step (no early stop)", "",
             "| batch | cache | forwards | s | forwards/s | tokens/s |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    table += [f"| {r['batch']} | {r['cache']} | {r['forwards']} | {r['seconds']} | "
              f"{r['forwards_per_s']} | {r['tokens_per_s']} |" for r in rows]  # fmt: skip
    _write(out, "sample", result, table)
    return result


# ------------------------------------------------------------------------------- serve


def phase_serve(out: Path, dry: bool) -> dict:
    import threading

    import httpx
    import torch

    from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens

    device = _device(dry)
    model, _ = _slice_model(dry, "cpu")
    tokenizer = build_char_tokenizer()
    ensure_special_tokens(tokenizer)
    gen, block, clients = (16, 8, 4) if dry else (256, 32, 32)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        model.float().save_pretrained(str(folder))
        tokenizer.save_pretrained(str(folder))
        port = _free_port()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        proc = subprocess.Popen([sys.executable, "-m", "unmask", "serve", "--model", str(folder),
                                 "--port", str(port), "--device", device.type, "--max-batch",
                                 str(clients), "--model-name", "slice"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 120
            while True:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"unmask serve did not start: {proc.stdout.read()[-2000:]}")
                try:
                    if httpx.get(base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.3)
            body = {"model": "slice", "prompt": "rev 90417=", "max_tokens": gen,
                    "unmask": {"block_length": block}}  # fmt: skip
            httpx.post(base + "/v1/completions", json=body, timeout=300)  # warm-up
            tokens = [0]
            lock = threading.Lock()

            def ask() -> None:
                got = httpx.post(base + "/v1/completions", json=body, timeout=300).json()
                with lock:
                    tokens[0] += got["usage"]["completion_tokens"]

            started = time.perf_counter()
            threads = [threading.Thread(target=ask) for _ in range(clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            concurrent_s = time.perf_counter() - started
            started = time.perf_counter()
            ask()
            alone_s = time.perf_counter() - started
        finally:
            proc.terminate()
            proc.wait(60)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = {"device": name, "clients": clients, "gen_length": gen, "block_length": block,
              "concurrent_tokens_per_s": round(tokens[0] / concurrent_s, 1),
              "one_request_s": round(alone_s, 3)}  # fmt: skip
    table = [f"# GPU profile: unmask serve, the dense slice ({name})", "",
             f"{clients} concurrent requests of {gen} tokens in blocks of {block} (one token per "
             f"step): {result['concurrent_tokens_per_s']} tokens/s; one request alone "
             f"{result['one_request_s']} s"]  # fmt: skip
    _write(out, "serve", result, table)
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -------------------------------------------------------------------------- cuda tests


def phase_cuda_tests(out: Path, dry: bool) -> dict:
    """`pytest -m cuda` (on a CPU every such test skips: --dry checks they are collected)."""
    args = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
            str(REPO / "tests")]  # fmt: skip
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc = subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=REPO)
        tail = (proc.stdout + proc.stderr)[-3000:]
        result = {"returncode": proc.returncode, "tail": tail}
        _write(out, "cuda-tests", result, ["# GPU profile: pytest -m cuda", "", "```", tail, "```"])
        return result
    result = {"returncode": None, "tail": "timed out after 240 s"}
    _write(out, "cuda-tests", result, ["# GPU profile: pytest -m cuda", "", "timed out"])
    return result


PHASES = {"env": phase_env, "sample": phase_sample, "serve": phase_serve,
          "cuda-tests": phase_cuda_tests}  # fmt: skip


def run_phase(name: str, out: Path, dry: bool) -> dict:
    if name.startswith("train-"):
        return phase_train(out, name.removeprefix("train-"), dry)
    return PHASES[name](out, dry)
