"""The GPU suite: bf16, flex attention, torch.compile and FSDP2 on the GPUs present; step
time, MFU and peak memory next to `unmask plan`'s prediction for the same run.

Each case is a config of configs/models/ with overrides that size it for the GPUs present
(one GPU: a few layers of the model; several: FSDP2 over all of them). On a GPU machine the
suite launches one torchrun over every visible GPU per case; each rank builds the real
Trainer (bf16, `attn_implementation: auto` = flex on packed rows, per-block
torch.compile, FSDP2), runs `--warmup` steps, then times `--steps` steps and reads
torch.cuda.max_memory_allocated; rank 0 writes the medians. The plan of the same config
at the same world size on the device the GPU's name matches (`--device` overrides) is
computed in the parent process, and the report puts both side by side:
step time (measured / planned at the plan's assumed MFU), MFU (measured), peak memory
(measured / planned). Results go to benchmarks/results/gpu.md with the device named.

`--dry` (what CI runs, on a CPU): imports everything the suite uses and checks that each
case's plan is consistent with the code the run uses: the plan's FLOPs per step equal
train/mfu.py's FLOP count of the same model (built on the meta device), its tokens per
step the trainer's step plan (train/plan.py), and the plan fits the device. Nothing is
launched.

`--profile` (the prepared GPU run, gpu_profile.py): one command, at most `--budget` seconds
(default 460: it fits one 10-minute device call with room to spare), that runs the phases
in order of value (environment and GEMM rates, the LLaDA slice with Muon, the MoE slice,
the Dream slice with AdamW, sampling, the LLaDA slice with Muon at 64k tokens per
optimizer step, `unmask serve`, `pytest -m cuda`, DiffusionGemma 26B-A4B's slice with bf16
and compile, then Muon's cost against AdamW's), each in a process of its own with what is
left of the budget, and writes after each one the phase's files, a summary and (with
`--bundle`) one archive of them all; a phase that fails or runs out of time is named in the
summary and the others go on. `--profile --dry` runs every phase on the CPU with tiny shapes.

`--wheels` downloads into .whl/ (ignored) the Python packages unmask needs that the lent
GPU image lacks (docs/scaling.md, On a GPU, says how a run installs them).

Run: python benchmarks/gpu.py                 (GPU machine; writes benchmarks/results/gpu.md)
     python benchmarks/gpu.py --dry           (any machine, a minute on a CPU)
     python benchmarks/gpu.py --profile       (GPU machine; benchmarks/results/gpu/)
     python benchmarks/gpu.py --profile --dry (a CPU; a temporary folder unless --out)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "configs" / "models"
RESULTS = Path(__file__).resolve().parent / "results"

#: name -> (config, overrides): sized for one 80 GB GPU (world 1) and kept as is on more
CASES = {
    "llada-8b-4layers": (MODELS / "llada_8b.yaml",
                         ["model.num_hidden_layers=4", "train.per_device_train_batch_size=2",
                          "train.torch_compile=true", "data.packing=true"]),
    "dream-7b-4layers": (MODELS / "dream_7b.yaml",
                         ["model.num_hidden_layers=4", "train.per_device_train_batch_size=2",
                          "train.torch_compile=true", "data.packing=true"]),
    # LLaDA-MoE-7B-A1B's shape (hidden 2048, 64 experts of width 1024, top 8, OLMoE
    # layout) with 4 of its 16 layers: the grouped-GEMM expert path in bf16
    "llada-moe-7b-a1b-4layers": (MODELS / "llada_8b.yaml",
                                 ["model.model_type=llada_moe", "model.hidden_size=2048",
                                  "model.intermediate_size=1024", "model.num_attention_heads=16",
                                  "model.num_key_value_heads=16", "model.num_hidden_layers=4",
                                  "model.vocab_size=157184", "model.num_experts=64",
                                  "model.num_experts_per_tok=8", "model.moe_intermediate_size=1024",
                                  "model.router_aux_loss_coef=0.01",
                                  "train.per_device_train_batch_size=2",
                                  "train.torch_compile=true", "data.packing=true"]),
}  # fmt: skip


def plan_for(config: Path, overrides: list[str], world: int, device_name: str):
    from unmask.config import load_config
    from unmask.plan.devices import resolve_device
    from unmask.plan.planner import make_run_plan

    cfg = load_config(config, overrides)
    return cfg, make_run_plan(cfg, world, resolve_device(device_name), ranks=[0])


def dry(world: int, device_name: str) -> int:
    """Import and consistency checks, no launch (module docstring)."""
    import torch

    from unmask.models.build import _no_init
    from unmask.plan.shards import planned_model_config
    from unmask.train.mfu import flop_model
    from unmask.train.plan import make_plan
    from unmask.train.setup import build_train_model  # noqa: F401 (the suite's build path)
    from unmask.train.trainer import Trainer  # noqa: F401 (the suite's worker runs it)

    failures = []
    for name, (config, overrides) in CASES.items():
        cfg, plan = plan_for(config, overrides, world, device_name)
        planned_cfg = planned_model_config(cfg)
        with torch.device("meta"), _no_init():
            from unmask.models import build_model

            model = build_model(planned_cfg.model)
        flops = flop_model(model)
        t = cfg.train
        rows = t.per_device_train_batch_size * world
        tokens = rows * cfg.data.packing_length
        expected = t.gradient_accumulation_steps * flops.step_flops(
            tokens, cfg.data.packing_length, tokens * 0.5
        )
        steps = make_plan(cfg, None, world)
        checks = {
            "flops": abs(plan.flops_per_step - expected) <= 1e-9 * expected,
            "tokens": plan.tokens_per_step == steps.tokens_per_step,
            "fits": plan.fits,
        }
        peak = plan.ranks[0].memory.peak / 2**30
        print(f"{name}: world {world} on {device_name}: peak {peak:.1f} GiB, step "
              f"{plan.step_s * 1e3:.0f} ms planned, checks "
              f"{', '.join(k + (' ok' if v else ' FAILED') for k, v in checks.items())}")  # fmt: skip
        failures += [f"{name}: {k}" for k, ok in checks.items() if not ok]
    if failures:
        print("gpu.py --dry: inconsistent: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def device_kind(gpu_name: str) -> str:
    """The planner's device for a CUDA device name ("NVIDIA H100 80GB HBM3" -> h100)."""
    from unmask.plan.devices import DEVICES

    lowered = gpu_name.lower()
    for key in DEVICES:
        if key != "cpu" and key in lowered:
            return key
    raise SystemExit(f"gpu.py: no planner device matches {gpu_name!r}; pass --device")


def worker(out: str, config: str, overrides: list[str], warmup: int, steps: int) -> None:
    """One rank of a case (run under torchrun): the real Trainer, timed steps, peak memory."""
    import torch

    from unmask.config import load_config
    from unmask.train.trainer import Trainer

    cfg = load_config(config, [*overrides, f"train.output_dir={out}/run"])
    trainer = Trainer(cfg)
    accum = cfg.train.gradient_accumulation_steps
    times, flops = [], 0.0
    for index in range(warmup + steps):
        batches = [next(trainer.loader) for _ in range(accum)]
        if index == warmup:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        stats = trainer.train_step(batches)
        torch.cuda.synchronize()
        took = time.perf_counter() - start
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"gpu.py: step {index + 1}/{warmup + steps}: {took:.3f} s"
                  f"{' (warm-up)' if index < warmup else ''}", flush=True)  # fmt: skip
        if index >= warmup:
            times.append(took)
            flops = float(stats.get("flops", 0.0))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out, "measured.json").write_text(json.dumps({
            "step_s": statistics.median(times), "flops_per_rank": flops,
            "peak_bytes": torch.cuda.max_memory_allocated(),
            "gpu": torch.cuda.get_device_name(),
        }))  # fmt: skip
    trainer.loader.close()


def suite(warmup: int, steps: int, device_name: str | None, only: list[str]) -> int:
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit("gpu.py: no CUDA device is visible; use --dry on a CPU")
    gpu = torch.cuda.get_device_name(0)
    kind = device_name or device_kind(gpu)
    lines = [f"# GPU suite: {gpus} x {gpu} (planned as {kind})", "",
             f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; {warmup} warm-up steps "
             f"(the first compiles), then the median of {steps} timed steps", "",
             "| case | step s (measured / planned) | MFU measured | peak GiB (measured / planned) |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    failed = []
    for name, (config, overrides) in CASES.items():
        if only and name not in only:
            continue
        cfg, plan = plan_for(config, overrides, gpus, kind)
        out = RESULTS / f"gpu-{name}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "measured.json").unlink(missing_ok=True)
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc_per_node={gpus}", __file__, "--worker", str(out),
                              str(config), "--warmup", str(warmup), "--steps", str(steps), "--",
                              *overrides])  # fmt: skip
        peak = plan.ranks[0].memory.peak
        if run.returncode != 0 or not (out / "measured.json").exists():
            failed.append(name)
            lines.append(f"| {name} | failed (exit {run.returncode}) / {plan.step_s:.3f} | - | "
                         f"- / {peak / 2**30:.1f} |")  # fmt: skip
        else:
            got = json.loads((out / "measured.json").read_text())
            mfu = got["flops_per_rank"] / got["step_s"] / plan_peak(cfg, kind)
            lines.append(f"| {name} | {got['step_s']:.3f} / {plan.step_s:.3f} | {mfu:.1%} | "
                         f"{got['peak_bytes'] / 2**30:.1f} / {peak / 2**30:.1f} |")  # fmt: skip
        # written after every case, so a case that fails or a run cut short keeps the others
        (RESULTS / "gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


#: --profile's phases in order of value (gpu_profile.py)
PROFILE_PHASES = ["env", "train-llada-8b-muon", "train-llada-moe-7b-a1b-muon",
                  "train-dream-7b-adamw", "sample", "train-llada-8b-muon-64k", "serve",
                  "train-llada-8b-muon-float8", "cuda-tests",
                  "train-diffusion-gemma-26b-a4b", "train-llada-8b-adamw",
                  "train-llada-8b-muon-gram", "train-llada-8b-muon-256k",
                  "train-llada-8b-adamw-256k"]  # fmt: skip
#: a phase is not started with less than this left of the budget
MIN_PHASE_S = 25


def profile(out: Path, dry: bool, budget: float, bundle: Path | None, only: list[str]) -> int:
    """The prepared GPU run (module docstring): phases in subprocesses within the budget."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    status: dict[str, str] = {}
    for name in PROFILE_PHASES:
        if only and name not in only:
            continue
        left = budget - (time.monotonic() - started)
        if left < MIN_PHASE_S:
            status[name] = f"not run ({left:.0f} s of the budget left)"
            continue
        phase_started = time.monotonic()
        command = [sys.executable, __file__, "--phase", name, "--out", str(out)]
        command += ["--dry"] if dry else []
        log = out / f"log-{name}.txt"
        print(f"gpu.py --profile: {name} ({left:.0f} s left)", flush=True)
        try:
            with open(log, "w") as handle:
                proc = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT,
                                      timeout=left, cwd=REPO)  # fmt: skip
            took = time.monotonic() - phase_started
            status[name] = f"ok, {took:.0f} s" if proc.returncode == 0 else (
                f"failed (exit {proc.returncode}, {took:.0f} s): {_last_line(log)}")  # fmt: skip
        except subprocess.TimeoutExpired:
            status[name] = f"cut off at the budget ({left:.0f} s)"
        print(f"gpu.py --profile: {name}: {status[name]}", flush=True)
        _summary(out, status, dry)
        if bundle is not None:
            _bundle(out, bundle)
    _summary(out, status, dry)
    if bundle is not None:
        _bundle(out, bundle)
    print((out / "summary.md").read_text())
    return 0 if all(v.startswith("ok") for v in status.values()) else 1


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def _bundle(out: Path, bundle: Path) -> None:
    """One gzipped tar of the results folder (the device tool returns few files), replaced
    whole after each phase."""
    partial = bundle.with_name(bundle.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(out, arcname=out.name)
    partial.replace(bundle)


def _summary(out: Path, status: dict[str, str], dry: bool) -> None:
    """summary.md: each phase's outcome and headline numbers, from its JSON."""

    def read(name: str) -> dict | None:
        path = out / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    env = read("env") or {}
    lines = [f"# GPU profile: {env.get('device', 'device unknown')}"
             + (" (DRY RUN on a CPU: no number here means anything)" if dry else ""), "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}; {time.strftime('%Y-%m-%d')}; "
             "`python benchmarks/gpu.py --profile` (benchmarks/gpu_profile.py)", "",
             "| phase | outcome |", "| --- | --- |"]  # fmt: skip
    lines += [f"| {name} | {outcome} |" for name, outcome in status.items()]
    rates = env.get("tflops", {})
    if rates:
        lines += ["", "GEMM TFLOP/s: " + "; ".join(f"{k} {v}" for k, v in rates.items())]
    train = [(n, read(n)) for n in PROFILE_PHASES if n.startswith("train-")]
    rows = [(n, r) for n, r in train if r]
    if rows:
        lines += ["", "| case | tokens/step | step s (spread) | optimizer s | MFU e2e | "
                  "MFU model-only | GPU busy | syncs/step | float32 matmul share | peak GiB "
                  "(plan) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for _, r in rows:
            flops = r["matmul_flops_by_dtype"]
            share = flops.get("torch.float32", 0) / max(1, sum(flops.values()))
            syncs = r["cuda_syncs"]
            opt = statistics.median(r["optimizer_s"]) if r["optimizer_s"] else 0.0
            lines.append(
                f"| {r['case']} | {r['tokens_per_step']} | {r['step_s_median']} "
                f"({r['step_spread']:.1%}) | {opt:.4f} | {r['mfu_end_to_end']:.1%} | "
                f"{r['mfu_model_only']:.1%} | {r['profile']['gpu_busy_share']} | "
                f"{len(syncs) if isinstance(syncs, list) else '-'} | {share:.2%} | "
                f"{r['peak_gib']} ({r['planned_peak_gib']}) |")  # fmt: skip
    sample = read("sample")
    if sample:
        lines += ["", "Sampling (the dense slice, tokens/s): " + "; ".join(
            f"batch {r['batch']} {r['cache']} {r['tokens_per_s']}" for r in sample["rows"])]  # fmt: skip
    serve = read("serve")
    if serve:
        lines += ["", f"unmask serve: {serve['clients']} concurrent requests, "
                  f"{serve['concurrent_tokens_per_s']} tokens/s"]  # fmt: skip
    (out / "summary.md").write_text("\n".join(lines) + "\n")


#: what unmask needs that the lent GPU image (Python 3.12, torch 2.11) lacks: name==version
GPU_WHEELS = ["pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
              "typing-inspection==0.4.5", "datasets==5.2.0", "dill==0.4.1",
              "multiprocess==0.70.19", "torchdata==0.11.0", "zstandard==0.25.0",
              "starlette==1.10.0", "uvicorn==0.54.0", "openai==3.57.0", "distro==1.9.0",
              "jiter==0.19.0", "sniffio==1.3.1", "torchao==0.18.0"]  # fmt: skip


def wheels(folder: Path) -> int:
    """Download GPU_WHEELS for CPython 3.12 on x86-64 Linux into folder (README of the
    device tool: the lent machine reaches no registry)."""
    folder.mkdir(exist_ok=True)
    platforms = []
    for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                "manylinux2014_x86_64", "manylinux1_x86_64"):  # fmt: skip
        platforms += ["--platform", tag]
    for spec in GPU_WHEELS:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                               "--only-binary=:all:", "--python-version", "3.12",
                               "--implementation", "cp", *platforms, "-d", str(folder), spec])  # fmt: skip
        if proc.returncode != 0:
            print(f"gpu.py --wheels: {spec} could not be downloaded", file=sys.stderr)
            return 1
    print(f"gpu.py --wheels: {len(GPU_WHEELS)} wheels in {folder}")
    return 0


def plan_peak(cfg, kind: str) -> float:
    from unmask.plan.devices import resolve_device

    return resolve_device(kind).peak(cfg.train.bf16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU: imports and plan checks only")
    parser.add_argument("--world", type=int, default=8, help="--dry: world size to plan at")
    parser.add_argument("--device", default=None, help="planner device (default: from the GPU)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cases", nargs="*", default=[], help="run only these cases "
                        "(--profile: these phases)")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="the prepared GPU run "
                        "(gpu_profile.py); with --dry on the CPU, tiny")  # fmt: skip
    parser.add_argument("--out", help="--profile: results folder (default "
                        "benchmarks/results/gpu; --dry: a temporary one)")  # fmt: skip
    parser.add_argument("--budget", type=float, default=460.0,
                        help="--profile: seconds for all phases (default 460)")  # fmt: skip
    parser.add_argument("--bundle", help="--profile: also keep one .tar.gz of the results "
                        "here, updated after each phase")  # fmt: skip
    parser.add_argument("--wheels", nargs="?", const=str(REPO / ".whl"), metavar="DIR",
                        help="download the packages the GPU image lacks (default .whl/)")  # fmt: skip
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.overrides, args.warmup, args.steps)
        return 0
    if args.wheels:
        return wheels(Path(args.wheels))
    if args.phase:
        from gpu_profile import run_phase

        run_phase(args.phase, Path(args.out), args.dry)
        return 0
    if args.profile:
        out = Path(args.out) if args.out else None
        if out is None:
            out = Path(tempfile.mkdtemp(prefix="gpu-profile-")) if args.dry else RESULTS / "gpu"
        bundle = Path(args.bundle) if args.bundle else None
        return profile(out, args.dry, args.budget, bundle, args.cases)
    if args.dry:
        return dry(args.world, args.device or "h100")
    return suite(args.warmup, args.steps, args.device, args.cases)


if __name__ == "__main__":
    sys.exit(main())
