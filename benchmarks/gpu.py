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

`--profile` (the prepared GPU run, gpu_profile.py and gpu_train.py): one command, at most
`--budget` seconds (default 480: one 9-minute device call with the wheels' install and
start-up beside it), that runs the phases in the order the targets need them
(`PROFILE_PHASES`; `--cases` picks some, in the order given, and refuses unknown names),
each in a process group of its own with what is left of the budget. A phase writes its
JSON as it measures; after each phase the run writes `summary.md` and (with `--bundle`)
one archive of the folder. A phase cut by the budget (or by SIGTERM to the run) keeps what
it wrote, and its process group (`unmask serve`, pytest) is ended. `--profile --dry` runs
every phase on the CPU with tiny shapes. `--plan-only` prints the run's time on an H200,
estimated on the CPU from the planner's step times and the phases' fixed costs.

`--wheels` downloads into .whl/ (ignored) the Python packages unmask needs that the lent
GPU image lacks; `--check-wheels DIR` proves that set on a CPU (gpu_wheels.py;
docs/scaling.md, "The prepared GPU run", says how a run installs them).

Run: python benchmarks/gpu.py                 (GPU machine; writes benchmarks/results/gpu.md)
     python benchmarks/gpu.py --dry           (any machine, a minute on a CPU)
     python benchmarks/gpu.py --profile       (GPU machine; benchmarks/results/gpu/)
     python benchmarks/gpu.py --profile --dry (a CPU; a temporary folder unless --out)
     python benchmarks/gpu.py --profile --plan-only (a CPU; the estimate, nothing run)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
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


#: --profile's phases in the order the targets need them: the environment and GEMM rates;
#: the LLaDA slice with Muon, with AdamW (Muon's overhead), at 64k tokens per optimizer
#: step; Dream with AdamW; the MoE slice; DiffusionGemma; then sampling, serving, the CUDA
#: tests, float8 and Gram Newton-Schulz (gpu_profile.py, gpu_train.py)
PROFILE_PHASES = ["env", "train-llada-8b-muon", "train-llada-8b-adamw",
                  "train-llada-8b-muon-64k", "train-dream-7b-adamw",
                  "train-llada-moe-7b-a1b-muon", "train-diffusion-gemma-26b-a4b", "sample",
                  "serve", "cuda-tests", "train-llada-8b-muon-float8",
                  "train-llada-8b-muon-gram"]  # fmt: skip
#: the phases the targets need: --plan-only checks they fit the budget
TARGET_PHASES = PROFILE_PHASES[: PROFILE_PHASES.index("train-diffusion-gemma-26b-a4b") + 1]
#: a phase is not started with less than this left of the budget
MIN_PHASE_S = 25
#: seconds a cut phase's process group gets between SIGTERM and SIGKILL
GRACE_S = 5


def phase_names(cases: list[str]) -> list[str]:
    """--cases as given (in that order), or every phase; an unknown name is bad input."""
    unknown = [c for c in cases if c not in PROFILE_PHASES]
    if unknown:
        raise InputError(f"gpu.py --profile: unknown --cases {', '.join(unknown)}; the phases "
                         f"are {', '.join(PROFILE_PHASES)}")  # fmt: skip
    return list(dict.fromkeys(cases)) or list(PROFILE_PHASES)


class InputError(Exception):
    """Bad input: one line, exit 2, nothing written."""


def run_phase_process(command: list[str], log: Path, seconds: float, should_stop=None) -> str:
    """Run a phase in a process group of its own, its output to `log`, for at most
    `seconds` (or until `should_stop()`, polled twice a second, says so); then end the whole
    group (the phase and what it started: `unmask serve`, pytest), SIGTERM then SIGKILL.
    Returns the outcome: "ok, N s", "failed (...)" or "cut off ...". The group is ended
    after a normal exit too, so nothing a phase started outlives it."""
    started = time.monotonic()
    with open(log, "w") as handle:
        proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)  # fmt: skip
        cut = None
        while proc.poll() is None:
            if time.monotonic() - started > seconds:
                cut = f"cut off at the budget ({seconds:.0f} s)"
            elif should_stop is not None and should_stop():
                cut = "cut off: the run was stopped"
            if cut:
                _end_group(proc, GRACE_S)
                break
            time.sleep(0.5)
        _end_group(proc, 0)
    took = time.monotonic() - started
    if cut:
        return f"{cut}; kept what it wrote"
    if proc.returncode == 0:
        return f"ok, {took:.0f} s"
    return f"failed (exit {proc.returncode}, {took:.0f} s): {_last_line(log)}"


def _end_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to proc's process group, SIGKILL to what is left after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
        if not _group_alive(proc.pid):
            break


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def profile(out: Path, dry: bool, budget: float, bundle: Path | None, names: list[str]) -> int:
    """The prepared GPU run (module docstring): phases in subprocesses within the budget,
    the summary and the bundle rewritten after each. SIGTERM (a time limit around the whole
    command) cuts the running phase the same way and still writes both."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    stopped: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    status: dict[str, str] = {}
    for name in names:
        left = budget - (time.monotonic() - started)
        if stopped or left < MIN_PHASE_S:
            status[name] = "not run (stopped)" if stopped else (
                f"not run ({left:.0f} s of the budget left)")  # fmt: skip
            continue
        command = [sys.executable, __file__, "--phase", name, "--out", str(out)]
        command += ["--dry"] if dry else []
        print(f"gpu.py --profile: {name} ({left:.0f} s left)", flush=True)
        status[name] = run_phase_process(command, out / f"log-{name}.txt", left,
                                         lambda: bool(stopped))  # fmt: skip
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
    """One gzipped tar of the results folder (few files come back from a GPU machine),
    replaced whole after each phase; the bundle itself is left out when it lies inside."""
    partial = bundle.with_name(bundle.name + ".partial")
    skip = {bundle.resolve(), partial.resolve()}

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if (out.parent / info.name).resolve() in skip else info

    with tarfile.open(partial, "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=keep)
    partial.replace(bundle)


def _summary(out: Path, status: dict[str, str], dry: bool) -> None:
    """summary.md: each phase's outcome and headline numbers, from its JSON."""

    def read(name: str) -> dict | None:
        path = out / f"{name}.json"
        try:
            return json.loads(path.read_text()) if path.exists() else None
        except ValueError:
            return None

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
    rows = [r for r in (read(n) for n in status if n.startswith("train-")) if r]
    if rows:
        lines += ["", "| case | data | tokens/step | step s (spread) | optimizer s | MFU e2e | "
                  "model-only | executed | e2e vs GEMM | expert load max/mean | peak GiB "
                  "(plan) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in rows:
            for variant, d in r.get("data", {}).items():
                opt = statistics.median(d["optimizer_s"]) if d["optimizer_s"] else 0.0
                load = d.get("expert_load")
                lines.append(
                    f"| {r['case']} | {variant} | {r['tokens_per_step']} | {d['step_s_median']} "
                    f"({d['step_spread']:.1%}) | {opt:.4f} | {d['mfu_end_to_end']:.1%} | "
                    f"{d['mfu_model_only']:.1%} | {_percent(d.get('mfu_executed'))} | "
                    f"{_percent(d.get('mfu_end_to_end_vs_gemm'))} | "
                    f"{max(x['max_over_mean'] for x in load) if load else '-'} | "
                    f"{d['peak_gib']} ({r.get('planned_peak_gib', '-')}) |")  # fmt: skip
        for r in rows:
            p = r.get("projection_256k")
            if p:
                lines.append(f"\n{r['case']} at {p['tokens']} tokens per optimizer step "
                             f"(projected): {p['step_s']} s, optimizer {p['optimizer_share']:.1%} "
                             f"of it, MFU {p['mfu_end_to_end']:.1%}")  # fmt: skip
    sample = read("sample")
    if sample:
        lines += ["", "Sampling (the dense slice, tokens/s): " + "; ".join(
            f"batch {r['batch']} {r['cache']} {r['tokens_per_s']}" for r in sample["rows"])]  # fmt: skip
    serve = read("serve")
    if serve:
        lines += ["", f"unmask serve: {serve['clients']} concurrent requests, "
                  f"{serve['concurrent_tokens_per_s']} tokens/s"]  # fmt: skip
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def _percent(value) -> str:
    return f"{value:.1%}" if isinstance(value, (int, float)) else "-"


# ---------------------------------------------------------------------- --plan-only

#: fixed costs of a phase on the H200, seconds: a process's start (Python, torch and
#: unmask's imports, the synthetic data, the Trainer with its model built on the GPU), the
#: compile of the first step (17-26 s per case on the H200 run, docs/scaling.md: the
#: largest taken), the planner once; the non-training phases whole
FIXED_S = {"start": 15.0, "compile": 26.0, "plan": 3.0, "profiler": 10.0}
OTHER_PHASES_S = {"env": 30.0, "sample": 45.0, "serve": 45.0, "cuda-tests": 60.0}
#: the training phases' steps: warm-up, timed per data variant, diagnostics' steps
#: (a sync report, an eager audit counted as 5 steps, a profiled step), the projection's
#: optimizer-only calls
STEPS = {"warmup": 3, "timed": 16, "diagnostics": 7, "optimizer_only": 5}


def plan_only(names: list[str], budget: float, device_name: str = "h200") -> int:
    """The run's time on an H200, estimated on the CPU: each training phase's planned step
    (unmask plan's step time at its assumed MFU, the optimizer included) times its steps,
    plus the fixed costs above; the other phases at their fixed estimates. Prints one row
    per phase, the running total, and whether the target phases fit the budget."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_train import DIAGNOSED, FULL_ROW, PROJECTED, TRAIN_CASES

    total, lines, fits_at = 0.0, [], None
    print(f"gpu.py --plan-only: the phases on one {device_name} (planned step times at the "
          f"planner's assumed MFU, plus fixed costs), budget {budget:.0f} s")  # fmt: skip
    print(f"{'phase':<34} {'step s':>8} {'phase s':>8} {'total s':>8}")
    for name in names:
        if name.startswith("train-"):
            case = name.removeprefix("train-")
            config, overrides = TRAIN_CASES[case]
            _, plan = plan_for(config, overrides, 1, device_name)
            step = plan.step_s
            variants = 2 if case in FULL_ROW else 1
            steps = STEPS["warmup"] + variants * STEPS["timed"] + (variants - 1)
            seconds = FIXED_S["start"] + FIXED_S["compile"] + FIXED_S["plan"] + steps * step
            if case in DIAGNOSED:
                seconds += STEPS["diagnostics"] * step + FIXED_S["profiler"]
            if case in PROJECTED:
                seconds += STEPS["optimizer_only"] * plan.optimizer_s
            shown = f"{step:8.3f}"
        else:
            seconds, shown = OTHER_PHASES_S[name], f"{'-':>8}"
        total += seconds
        lines.append((name, total))
        print(f"{name:<34} {shown} {seconds:8.0f} {total:8.0f}")
        if name == TARGET_PHASES[-1]:
            fits_at = total
    if fits_at is None:
        print("gpu.py --plan-only: the target phases are not all in --cases")
        return 0
    verdict = "fit" if fits_at <= budget else "do NOT fit"
    print(f"gpu.py --plan-only: the phases through {TARGET_PHASES[-1]} {verdict} in "
          f"{budget:.0f} s ({fits_at:.0f} s estimated)")  # fmt: skip
    return 0 if fits_at <= budget else 1


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
                        "(--profile: these phases, in the order given)")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="the prepared GPU run "
                        "(gpu_profile.py); with --dry on the CPU, tiny")  # fmt: skip
    parser.add_argument("--plan-only", action="store_true", help="--profile's time on an "
                        "H200, estimated on the CPU; runs nothing")  # fmt: skip
    parser.add_argument("--out", help="--profile: results folder, any (default "
                        "benchmarks/results/gpu; --dry: a temporary one)")  # fmt: skip
    parser.add_argument("--budget", type=float, default=480.0,
                        help="--profile: seconds for all phases (default 480)")  # fmt: skip
    parser.add_argument("--bundle", help="--profile: also keep one .tar.gz of the results "
                        "at this path (a folder, or not a .tar.gz name: gpu-profile.tar.gz in it), updated after "
                        "each phase")  # fmt: skip
    parser.add_argument("--wheels", nargs="?", const=str(REPO / ".whl"), metavar="DIR",
                        help="download the packages the GPU image lacks (default .whl/)")  # fmt: skip
    parser.add_argument("--check-wheels", metavar="DIR", help="download the wheels into DIR "
                        "and prove them on this CPU: a fresh environment from them alone, "
                        "offline, runs the dry profile (gpu_wheels.py)")  # fmt: skip
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.overrides, args.warmup, args.steps)
        return 0
    if args.wheels or args.check_wheels:
        from gpu_wheels import check, download

        return check(Path(args.check_wheels)) if args.check_wheels else download(Path(args.wheels))
    if args.phase:
        from gpu_profile import run_phase

        run_phase(args.phase, Path(args.out), args.dry)
        return 0
    if args.profile or args.plan_only:
        try:
            names = phase_names(args.cases)
        except InputError as err:
            print(err, file=sys.stderr)
            return 2
        if args.plan_only:
            return plan_only(names, args.budget, args.device or "h200")
        out = Path(args.out) if args.out else None
        if out is None:
            out = Path(tempfile.mkdtemp(prefix="gpu-profile-")) if args.dry else RESULTS / "gpu"
        bundle = Path(args.bundle) if args.bundle else None
        if bundle is not None and (
            bundle.resolve() == out.resolve()
            or bundle.is_dir()
            or not bundle.name.endswith((".tar.gz", ".tgz"))
        ):
            bundle = bundle / "gpu-profile.tar.gz"  # a folder: the archive in it
        if bundle is not None:
            bundle.parent.mkdir(parents=True, exist_ok=True)
        return profile(out, args.dry, args.budget, bundle, names)
    if args.dry:
        return dry(args.world, args.device or "h100")
    return suite(args.warmup, args.steps, args.device, args.cases)


if __name__ == "__main__":
    sys.exit(main())
