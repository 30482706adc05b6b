"""The training phases of `python benchmarks/gpu.py --profile` (`train-<case>`): the real
Trainer on a config of configs/models/ cut to a few layers, at a fixed masked fraction
(`diffusion.t_sampling: fixed`, t = 0.5, pretraining's mean).

A phase builds the Trainer once (the model built on the GPU: one process, no pretrained
folder), runs its warm-up steps (the first compiles), then, for each of its data variants,
16 timed steps with Python's garbage collector off, the GPU's clocks and power read by
nvidia-smi just before and after (null on a CPU), and writes its JSON right then; after each
diagnostic that follows it writes the JSON again, so a phase cut by the budget keeps every
step it timed. Data variants:

- `packed`: the trainer's own loader, the synthetic character tasks packed into rows (about
  285 documents of 13 tokens per 4096-token row, a third of the tokens maskable): flex's
  block mask skips most of the attention, the LM head runs on a sixth of the tokens;
- `full-row` (the LLaDA, Dream and MoE cases): one document per row, every token maskable,
  token ids drawn uniformly from the vocabulary, so attention runs over the whole row, the
  head on half of the tokens (the fixed t), and the MoE router sees diverse ids (the
  packed rows' 22 distinct ids load the busiest expert 6x the mean).

Per variant: `step_s` (each step's device time, CUDA events), median and spread,
`optimizer_s`, `masked_per_step` (the rows the LM head ran on, every micro-batch),
`flops_per_step` (train/mfu.py's count: attention over whole rows), `executed_flops_per_step` (attention
over each document alone: what a document-masked kernel runs), `mfu_end_to_end`,
`mfu_model_only` (the step less the optimizer), `mfu_executed` (executed FLOPs over the
step time), each also against the GEMM rate the `env` phase measured (`*_vs_gemm`), the
MoE layers' expert load (max / mean per layer) and the clocks around the loop.

The LLaDA Muon and AdamW phases add `projection_256k`: an optimizer step of 262,144 tokens
(32 micro-batches of 8,192) projected as 32 x the measured micro-step (the step less its
optimizer) + the optimizer step timed alone (`optimizer_only_s`: Muon's and AdamW's work
does not depend on the tokens), instead of running 32 micro-batches.

Diagnostics run on the first case of each model only, on one micro-batch: torch's sync
report and unmask's sync audit (one step), the matmul audit (one eager step: its attention
call sites reported apart, since flex's eager reference runs float32 products the compiled
kernel does not), the profiler (one step), then the plan's peak memory and step time.
"""

from __future__ import annotations

import gc
import statistics
import subprocess
import time
import traceback
import warnings
from pathlib import Path

from gpu_profile import DRY, MODELS, REPO, _device, _sync, _Timer, _write

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
    # Muon's cost on the GPU (issue 47): against AdamW's at 8,192 tokens per optimizer step,
    # and with Gram Newton-Schulz; at 262,144 tokens both are projected (projection_256k)
    "llada-8b-adamw": (MODELS / "llada_8b.yaml", _COMMON + ["optim.name=adamw"]),
    "llada-8b-muon-gram": (MODELS / "llada_8b.yaml", _COMMON + ["optim.ns_coefficients=gram"]),
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
#: cases timed on the full-row data too (module docstring)
FULL_ROW = {"llada-8b-muon", "llada-8b-adamw", "llada-8b-muon-64k", "dream-7b-adamw",
            "llada-moe-7b-a1b-muon"}  # fmt: skip
#: each model's first case: the only ones with diagnostics (audits, profiler)
DIAGNOSED = {"llada-8b-muon", "dream-7b-adamw", "llada-moe-7b-a1b-muon",
             "diffusion-gemma-26b-a4b"}  # fmt: skip
#: cases whose optimizer step is projected to 262,144 tokens (micro-batches of the case's)
PROJECTED = {"llada-8b-muon": 32, "llada-8b-adamw": 32}
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
DRY_MOE = ["model.num_experts=4", "model.num_experts_per_tok=2", "model.moe_intermediate_size=32"]


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


def _plan(config: Path, overrides: list[str], device_name: str) -> dict:
    """unmask plan of the run on one device of this kind (its peak memory and step time;
    the planner once per phase), or why not."""
    from unmask.config import load_config
    from unmask.plan.devices import DEVICES, resolve_device
    from unmask.plan.planner import make_run_plan

    kind = next((k for k in DEVICES if k != "cpu" and k in device_name.lower()), None)
    if kind is None:
        return {"planned": f"no planner device matches {device_name!r}"}
    plan = make_run_plan(load_config(config, overrides), 1, resolve_device(kind), ranks=[0])
    return {"planned_peak_gib": round(plan.ranks[0].memory.peak / 2**30, 2),
            "planned_step_s": round(plan.step_s, 4)}  # fmt: skip


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


def full_rows(rows: int, length: int, vocab: int, mask_id: int, seed: int = 0):
    """Batches of the full-row variant, endlessly: one document per row (doc_ids 0),
    positions 0..length-1, every token maskable, ids uniform over the vocabulary (the mask
    token's id moved one up)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(length).expand(rows, length).contiguous()
    while True:
        ids = torch.randint(0, vocab, (rows, length), generator=generator)
        ids[ids == mask_id] = (mask_id + 1) % vocab
        yield {"input_ids": ids, "doc_ids": torch.zeros_like(ids), "position_ids": positions,
               "maskable": torch.ones_like(ids, dtype=torch.bool)}  # fmt: skip


def gpu_clocks(device) -> dict | None:
    """The GPU's SM and memory clocks (MHz), power draw (W) and temperature from nvidia-smi,
    and torch.cuda's clock and power readings (None on a CPU; the error text where one
    cannot be read)."""
    if device.type != "cuda":
        return None
    import torch

    got: dict = {}
    query = "clocks.sm,clocks.mem,power.draw,temperature.gpu"
    try:
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)  # fmt: skip
        values = [v.strip() for v in smi.stdout.strip().splitlines()[0].split(",")]
        got.update(zip(("sm_mhz", "mem_mhz", "power_w", "temperature_c"), values))
    except (OSError, IndexError, subprocess.TimeoutExpired) as err:
        got["nvidia_smi_error"] = str(err)[:120]
    for key, read in (("torch_clock_mhz", torch.cuda.clock_rate),
                      ("torch_power_mw", torch.cuda.power_draw)):  # fmt: skip
        try:  # torch reads these through pynvml
            got[key] = read()
        except Exception as err:  # no pynvml, or a driver that does not say
            got[key] = f"unavailable: {err}"[:120]
    return got


def _measured_gemm(out: Path, dtype: str) -> float | None:
    """The env phase's 8192^3 GEMM rate (FLOP/s) for the run's matmul dtype, if measured."""
    import json

    path = out / "env.json"
    if not path.exists():
        return None
    rates = json.loads(path.read_text()).get("tflops", {})
    key = {"bfloat16": "bf16", "float32": "float32", "tf32": "tf32"}.get(dtype, dtype)
    rate = next((v for k, v in rates.items() if k.endswith(f"^3 {key}")), None)
    return rate * 1e12 if isinstance(rate, (int, float)) else None


class _ExpertLoad:
    """Each MoE layer's expert load per step (the load its balancer reads), recorded while
    `on`: max and mean over the experts, per layer, averaged over the recorded steps."""

    def __init__(self, model):
        from unmask.models.moe import moe_blocks

        self.on, self.loads = False, []
        for index, block in enumerate(moe_blocks(model)):
            block.update_expert_bias = self._wrap(index, block.update_expert_bias)

    def _wrap(self, index: int, update):
        def recorded(load):
            if self.on:
                self.loads.append((index, load.detach().clone()))
            return update(load)

        return recorded

    def summary(self) -> list[dict] | None:
        if not self.loads:
            return None
        layers: dict[int, list] = {}
        for index, load in self.loads:
            layers.setdefault(index, []).append(load.float().cpu())
        rows = []
        for index, loads in sorted(layers.items()):
            ratios = [float(x.max() / x.mean()) for x in loads if x.mean() > 0]
            rows.append({"layer": index, "max_over_mean": round(statistics.mean(ratios), 3),
                         "idle_experts": int(min(int((x == 0).sum()) for x in loads))})  # fmt: skip
        return rows


class _HeadRows:
    """The rows the LM head ran on over every training call of the model since the last
    `take` (its targets that are not -100), summed on the device: every micro-batch of a
    step, not only the last one's objective statistics. None where calls carry no
    targets."""

    def __init__(self, model):
        self.total = None
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        import torch

        targets = kwargs.get("targets")
        if module.training and torch.is_grad_enabled() and targets is not None:
            rows = (targets != -100).sum()
            self.total = rows if self.total is None else self.total + rows

    def take(self):
        value, self.total = self.total, None
        return value


def _attention_flops(trainer, batches) -> float:
    """The attention FLOPs a document mask removes from train/mfu.py's count of `batches`:
    12 n_layers d_attn (L T - sum over documents of len^2), per micro-batch."""
    from unmask.train.mfu import document_pairs

    fm = trainer.flops.flops
    removed = 0
    for batch in batches:
        doc_ids = batch["doc_ids"]
        whole = doc_ids.shape[0] * doc_ids.shape[1] ** 2
        removed += whole - document_pairs(doc_ids)
    return 12 * fm.layers * fm.attention_width * removed


def _timed(
    trainer,
    loader,
    steps: int,
    timer,
    marks: list,
    device,
    diffusion_gemma: bool,
    head_rows: _HeadRows,
):
    """`steps` optimizer steps from `loader` with the garbage collector off: each step's
    (device seconds, FLOPs counted, FLOPs executed, masked tokens), the optimizer's seconds."""
    accumulation = trainer.cfg.train.gradient_accumulation_steps
    records = []
    marks.clear()
    gc.collect()
    gc.disable()
    try:
        for _ in range(steps):
            batches = [next(loader) for _ in range(accumulation)]
            # from the host's batches, before the step moves them: no device read in the loop
            removed = 0.0 if diffusion_gemma else _attention_flops(trainer, batches)
            start = timer.mark()
            stats = trainer.train_step(batches)
            stop = timer.mark()
            masked = head_rows.take()
            trainer.step += 1
            records.append((start, stop, stats["flops"], removed, masked))
        _sync(device)
    finally:
        gc.enable()
    step_s = [timer.seconds(a, b) for a, b, *_ in records]
    optimizer_s = [timer.seconds(a, b) for a, b in marks[-steps:]]
    flops = [float(f) for _, _, f, _, _ in records]
    executed = [f - r for f, (_, _, _, r, _) in zip(flops, records)]
    masked = [None if m is None else float(m) for *_, m in records]
    return step_s, optimizer_s, flops, executed, masked


def phase_train(out: Path, case: str, dry: bool) -> dict:
    import torch

    import unmask.plan.checkpointing  # noqa: F401 (activation_checkpointing auto decides)
    from unmask.train.mfu import device_peak, matmul_dtype
    from unmask.train.trainer import Trainer

    device = _device(dry)
    cfg, config, overrides = _case_config(case, dry, out)
    warmup, steps = (1, 2) if dry else (3, 16)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    started = time.perf_counter()
    trainer = Trainer(cfg)
    build_s = time.perf_counter() - started
    # activation_checkpointing auto, as `unmask train` decides it (the planner's memory walk)
    checkpointing = next((n for n in trainer.notices if n.startswith("activation checkpointing")),
                         f"activation checkpointing: {cfg.train.activation_checkpointing}")  # fmt: skip
    chosen = checkpointing.split(":", 1)[1].split("(")[0].strip()
    timer = _Timer(device)
    optimizer_step = trainer.optimizer.step
    marks: list = []

    def timed_optimizer_step(*args, **kwargs):
        start = timer.mark()
        got = optimizer_step(*args, **kwargs)
        marks.append((start, timer.mark()))
        return got

    trainer.optimizer.step = timed_optimizer_step
    load, head_rows = _ExpertLoad(trainer.model), _HeadRows(trainer.model)
    dtype = matmul_dtype(device.type, cfg.train.bf16)
    peak_flops = device_peak(device, dtype).flops
    gemm = _measured_gemm(out, dtype)
    rows, length = cfg.train.per_device_train_batch_size, cfg.data.packing_length
    variants = {"packed": trainer.loader}
    if case in FULL_ROW:
        variants["full-row"] = full_rows(rows, length, cfg.model.vocab_size,
                                         trainer.tokenizer.mask_token_id)  # fmt: skip
    result: dict = {
        "case": case, "device": name, "config": str(config.relative_to(REPO)),
        "overrides": overrides, "tokens_per_step": trainer.plan.tokens_per_step,
        "activation_checkpointing": checkpointing, "build_s": round(build_s, 1),
        "peak_flops": peak_flops, "measured_gemm_flops": gemm, "data": {},
    }  # fmt: skip

    def save(stage: str) -> None:
        result["stage"] = stage
        _write(out, f"train-{case}", result, _table(result))

    def one_step(loader) -> dict:
        batches = [next(loader) for _ in range(cfg.train.gradient_accumulation_steps)]
        stats = trainer.train_step(batches)
        trainer.step += 1
        return stats

    import torch._dynamo.utils as dynamo_utils

    compile_started = time.perf_counter()
    for _ in range(warmup):
        one_step(trainer.loader)
    _sync(device)
    result["warmup_s"] = round(time.perf_counter() - compile_started, 1)
    result["dynamo_after_warmup"] = {k: dict(v) for k, v in dynamo_utils.counters.items() if v}
    save("warm")
    gemma = cfg.model.model_type == "diffusion_gemma"
    for variant, loader in variants.items():
        if variant != "packed":
            one_step(loader)  # its own warm-up: another mask layout
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        before = gpu_clocks(device)
        load.on, load.loads = True, []
        head_rows.take()
        step_s, optimizer_s, flops, executed, masked = _timed(
            trainer, loader, steps, timer, marks, device, gemma, head_rows
        )
        load.on = False
        after = gpu_clocks(device)
        total = sum(step_s)
        model_s = total - sum(optimizer_s)
        mfu = {"mfu_end_to_end": sum(flops) / total, "mfu_model_only": sum(flops) / model_s,
               "mfu_executed": None if gemma else sum(executed) / total,
               "mfu_executed_model_only": None if gemma else sum(executed) / model_s}  # fmt: skip
        measured = {k: round(v / peak_flops, 4) for k, v in mfu.items() if v is not None}
        measured.update({f"{k}_vs_gemm": round(v / gemm, 4) for k, v in mfu.items()
                         if v is not None and gemm})  # fmt: skip
        result["data"][variant] = {
            "step_s": [round(s, 4) for s in step_s],
            "step_s_median": round(statistics.median(step_s), 4),
            "step_spread": round((max(step_s) - min(step_s)) / statistics.median(step_s), 4),
            "optimizer_s": [round(s, 4) for s in optimizer_s],
            "masked_per_step": masked, "flops_per_step": flops,
            "executed_flops_per_step": None if gemma else executed, **measured,
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if device.type == "cuda" else None,
            "expert_load": load.summary(), "clocks_before": before, "clocks_after": after,
        }  # fmt: skip
        save(f"timed {variant}")
    result["dynamo_after_timed_steps"] = {k: dict(v) for k, v in dynamo_utils.counters.items()
                                          if v}  # fmt: skip
    if case in PROJECTED:
        result["projection_256k"] = _projection(trainer, timer, device, result, PROJECTED[case])
        save("projected")
    if case in DIAGNOSED:
        _diagnose(trainer, one_step, device, result, save)
    result.update(_plan(config, [*overrides, f"train.activation_checkpointing={chosen}"], name))
    trainer.loader.close()
    save("done")
    return result


def _projection(trainer, timer, device, result: dict, micro_batches: int) -> dict:
    """An optimizer step of `micro_batches` micro-batches: the measured micro-step (the
    packed data's median step less its median optimizer step, per micro-batch) times
    micro_batches, plus the optimizer step timed alone (5 calls on zero gradients)."""
    packed = result["data"]["packed"]
    accumulation = trainer.cfg.train.gradient_accumulation_steps
    optimizer = statistics.median(packed["optimizer_s"]) if packed["optimizer_s"] else 0.0
    micro = (packed["step_s_median"] - optimizer) / accumulation
    import torch

    params = [p for p in trainer.model.parameters() if p.requires_grad]
    for param in params:  # a step leaves no gradient: zeros cost the optimizer the same
        param.grad = torch.zeros_like(param)
    alone = []
    for _ in range(2 if device.type == "cpu" else 5):
        start = timer.mark()
        trainer.optimizer.step()
        stop = timer.mark()
        _sync(device)
        alone.append(timer.seconds(start, stop))
    for param in params:
        param.grad = None
    optimizer_only = statistics.median(alone)
    step = micro_batches * micro + optimizer_only
    flops = statistics.median(packed["flops_per_step"]) / accumulation * micro_batches
    return {"micro_batches": micro_batches,
            "tokens": micro_batches * result["tokens_per_step"] // accumulation,
            "micro_step_s": round(micro, 4), "optimizer_only_s": [round(s, 4) for s in alone],
            "step_s": round(step, 4), "optimizer_share": round(optimizer_only / step, 4),
            "mfu_end_to_end": round(flops / step / result["peak_flops"], 4)}  # fmt: skip


def _diagnose(trainer, one_step, device, result: dict, save) -> None:
    """One micro-batch each: torch's sync report (CUDA), unmask's audits (one eager step:
    a dispatch mode and compiled graphs do not mix), the profiler; the JSON after each."""
    import torch

    from unmask.train.audit import MatmulAudit, SyncAudit

    loader = trainer.loader  # the diagnosed cases step on one micro-batch
    result["cuda_syncs"] = (_cuda_syncs(lambda: one_step(loader)) if device.type == "cuda"
                            else "no CUDA (dry run)")  # fmt: skip
    save("syncs")
    with torch.compiler.set_stance("force_eager"):
        with MatmulAudit(sites=True) as matmuls, SyncAudit() as syncs:
            one_step(loader)
    attention = [r for r in matmuls.records if "attention" in r.site]
    rest = [r for r in matmuls.records if "attention" not in r.site]

    def by_dtype(records) -> dict[str, int]:
        got: dict[str, int] = {}
        for r in records:
            got[str(r.dtype)] = got.get(str(r.dtype), 0) + r.flops
        return got

    result["audit_syncs"] = syncs.found
    result["matmul_flops_by_dtype"] = by_dtype(rest)
    result["attention_matmul_flops_by_dtype"] = by_dtype(attention)
    result["float32_matmuls"] = [[r.op, r.shapes, r.flops, r.site]
                                 for r in sorted(rest, key=lambda r: -r.flops)
                                 if r.dtype == torch.float32][:5]  # fmt: skip
    save("audit")
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        one_step(loader)
        _sync(device)
    result["profile"] = _profile_summary(prof, result["data"]["packed"]["step_s_median"])
    save("profiled")


def _table(result: dict) -> list[str]:
    """The phase's Markdown: one row per data variant, then the diagnostics found so far."""
    lines = [f"# GPU profile: {result['case']} ({result['device']})", "",
             f"{result['config']} with {' '.join(result['overrides'])}; "
             f"{result['tokens_per_step']} tokens per optimizer step; build "
             f"{result['build_s']} s, warm-up {result.get('warmup_s')} s (the first step "
             f"compiles); {result['activation_checkpointing']}; stage: {result.get('stage')}",
             "", "| data | step s (median, spread) | optimizer s | MFU e2e | model-only | "
             "executed | e2e vs measured GEMM | expert load max/mean | peak GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for variant, d in result["data"].items():
        opt = statistics.median(d["optimizer_s"]) if d["optimizer_s"] else 0.0
        load = d["expert_load"]
        lines.append(
            f"| {variant} | {d['step_s_median']} ({d['step_spread']:.1%}) | {opt:.4f} | "
            f"{d['mfu_end_to_end']:.1%} | {d['mfu_model_only']:.1%} | "
            f"{_percent(d.get('mfu_executed'))} | {_percent(d.get('mfu_end_to_end_vs_gemm'))} | "
            f"{', '.join(str(x['max_over_mean']) for x in load) if load else '-'} | "
            f"{d['peak_gib']} |")  # fmt: skip
    projection = result.get("projection_256k")
    if projection:
        alone = statistics.median(projection["optimizer_only_s"])
        lines += ["", f"{projection['tokens']} tokens per optimizer step, projected: "
                  f"{projection['step_s']} s ({projection['micro_batches']} x "
                  f"{projection['micro_step_s']} s + the optimizer alone {alone:.4f} s), MFU "
                  f"{projection['mfu_end_to_end']:.1%}"]  # fmt: skip
    if "matmul_flops_by_dtype" in result:
        flops = result["matmul_flops_by_dtype"]
        share = flops.get("torch.float32", 0) / max(1, sum(flops.values()))
        lines += ["", f"Matmul FLOPs outside attention in float32 (eager audit step): {share:.2%}; "
                  f"attention call sites apart: {result['attention_matmul_flops_by_dtype']}",
                  f"Syncs: torch {result.get('cuda_syncs')}; audit {result.get('audit_syncs')}"]  # fmt: skip
    summary = result.get("profile")
    if summary:
        lines += ["", f"GPU busy share of the traced step: {summary['gpu_busy_share']}", "",
                  "| kernel | calls | device ms |", "| --- | --- | --- |"]  # fmt: skip
        lines += [f"| {k['name']} | {k['calls']} | {k['device_ms']} |"
                  for k in summary["top_kernels"][:15]]  # fmt: skip
        lines += ["", "| idle us | after | before |", "| --- | --- | --- |"]
        lines += [f"| {g['us']} | {g['after']} | {g['before']} |"
                  for g in summary["largest_idle_gaps_us"]]  # fmt: skip
    return lines


def _percent(value) -> str:
    return f"{value:.1%}" if isinstance(value, (int, float)) else "-"
