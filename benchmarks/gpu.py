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

Run: python benchmarks/gpu.py          (GPU machine; writes benchmarks/results/gpu.md)
     python benchmarks/gpu.py --dry    (any machine, a minute on a CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
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
    parser.add_argument("--cases", nargs="*", default=[], help="run only these cases")
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "CONFIG"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.overrides, args.warmup, args.steps)
        return 0
    if args.dry:
        return dry(args.world, args.device or "h100")
    return suite(args.warmup, args.steps, args.device, args.cases)


if __name__ == "__main__":
    sys.exit(main())
