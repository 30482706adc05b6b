"""The one training loop: batches -> objective -> (loss_sum, count) -> backward ->
global normalization -> clip -> optimizer -> schedule -> metrics and checkpoints.

Everything that can reject user input (config, tokenizer, data, output_dir, resume
path) runs before anything is written, so bad input never leaves a half-made run.
"""

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from unmask.checkpoint import Checkpointer, list_checkpoints
from unmask.checkpoint.checkpointer import check_async_request
from unmask.checkpoint.layout import newest_intact, read_trainer_state
from unmask.config import RunConfig, dump_config
from unmask.data import (
    build_datasets,
    eval_batches,
    heldout_examples,
    make_loader,
)
from unmask.data.streaming import StreamSpec
from unmask.diffusion import build_objective
from unmask.diffusion.cutoffs import random_length_cut
from unmask.errors import RunStopped
from unmask.models.lora import (
    LORA_BASE_FILE,
    base_fingerprint,
    base_record,
    check_base_fingerprint,
    check_lora_settings,
    lora_settings,
)
from unmask.models.lora import check_request as check_lora_request
from unmask.models.quant import check_4bit
from unmask.optim.config import build_optimizer
from unmask.optim.schedule import build_scheduler
from unmask.parallel.batch import per_rank_batch_size, rank_generator
from unmask.parallel.context import ContextShard, attach_context, pad_rows
from unmask.parallel.distributed import (
    all_reduce_sum,
    clip_grad_norm,
    collective_failure,
    plan_layout,
    resolve_device,
    setup,
)
from unmask.parallel.fsdp import sync_gradients
from unmask.parallel.mesh import launch_env, share_from_rank0
from unmask.parallel.tensor import check_tensor_parallel
from unmask.parallel.threads import set_threads
from unmask.posttrain import build_posttrain_objective, check_posttrain, is_posttrain
from unmask.posttrain.pairs import build_pair_datasets, heldout_pair_examples
from unmask.posttrain.preference import PreferenceObjective, reference_memory_note
from unmask.sampling.accuracy import heldout_accuracy
from unmask.sampling.config import (
    GENERATION_FILE,
    fitted_to_rows,
    fixed_by_training,
    generation_config_text,
)
from unmask.train.guard import NonFiniteGuard
from unmask.train.host_memory import trim_host_memory
from unmask.train.metrics import (
    LogWindow,
    MetricsLogger,
    SilentLogger,
    check_trackers,
    progress_postfix,
    truncate_metrics,
)
from unmask.train.mfu import device_peak, flop_model, matmul_dtype, raise_cached_peak
from unmask.train.plan import make_plan
from unmask.train.report import run_summary
from unmask.train.run_dir import (
    CONFIG_FILE,
    prepare_output_dir,
    resume_advice,
    resume_command,
    room_for_checkpoint,
    write_config,
)
from unmask.train.setup import (
    build_train_model,
    check_context_request,
    check_model_fits,
    prepare_tokenizer,
)
from unmask.train.signals import StopSignals


def cpu_share_notice(world_size: int, cores: int | None = None) -> str | None:
    """A notice when more CPU processes run than the machine has cores, else None."""
    cores = cores or os.cpu_count() or 1
    if world_size <= cores:
        return None
    return (f"{world_size} processes share {cores} CPU cores: expect each to run slower "
            "than one process would; launch at most one per core")  # fmt: skip


class Trainer:
    """Builds every component from its config section and runs the loop."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        t = cfg.train
        check_lora_request(cfg.model)
        check_async_request(t.async_checkpoint, cfg.model.lora)
        check_trackers(t.report_to)
        check_model_fits(cfg)
        env = launch_env()
        check_tensor_parallel(cfg.model, t.tensor_parallel, lora=cfg.model.lora)
        check_context_request(cfg, env.world_size)
        # the mesh's sizes, checked before any process group work; tp and cp peers read the
        # same rows, so batches are split over the data-parallel ranks only
        layout = plan_layout(env.world_size, t.fsdp2, t.dp_replicate, t.dp_shard,
                             t.tensor_parallel, t.context_parallel)  # fmt: skip
        dp = layout.dp if env.world_size > 1 else 1
        what = "the world size" if dp == env.world_size else "the data-parallel size"
        # rows per micro-batch on this rank; the global batch grows with the world size
        # unless split_batches (then per_device_train_batch_size is the global batch)
        self.local_batch_size = per_rank_batch_size(
            t.per_device_train_batch_size, dp, t.split_batches, what
        )
        batch_ranks = 1 if t.split_batches else dp
        self.dist = setup(resolve_device(t.device), shard=t.fsdp2, dp_replicate=t.dp_replicate,
                          dp_shard=t.dp_shard, tensor_parallel=t.tensor_parallel,
                          context_parallel=t.context_parallel, timeout_s=t.ddp_timeout,
                          env=env)  # fmt: skip
        self.device = self.dist.device
        self.sharded = self.dist.mesh is not None  # world size 1: no process group, no mesh
        self.context = ContextShard.from_mesh(self.dist.mesh)  # None: whole rows per rank
        check_4bit(cfg.model, self.device, self.dist.world_size)
        self.tokenizer, saved_tokenizer, added_tokens = prepare_tokenizer(cfg)
        self.preference = cfg.diffusion.objective == "preference"
        if self.preference:  # chosen/rejected pairs (posttrain/pairs.py)
            data = build_pair_datasets(cfg.data, self.tokenizer)
        else:
            data = build_datasets(cfg.data, self.tokenizer, saved_tokenizer)
        self.train_rows, self.eval_rows = data.train, data.eval
        check_posttrain(cfg, self.tokenizer, data.train)  # rewards import and score, or exit 2
        self.notices = [*cfg.notices, *data.notices]  # the config file's, then the data's
        self.num_rows = None if isinstance(data.train, StreamSpec) else len(data.train)
        self.plan = make_plan(cfg, self.num_rows, batch_ranks)
        if self.device.type == "cpu" and (notice := cpu_share_notice(self.dist.world_size)):
            self.notices.append(notice)
        if self.device.type == "cpu" and cfg.train.trim_host_memory:
            trim_host_memory()
        if self.plan.warmup_steps >= self.plan.total_steps:
            self.notices.append(
                f"warmup takes {self.plan.warmup_steps} steps of the run's "
                f"{self.plan.total_steps}: the learning rate never reaches "
                f"optim.learning_rate; lower optim.warmup_steps or raise train.max_steps"
            )
        self.output_dir = Path(t.output_dir)
        self.resume_path, run_notices = share_from_rank0(
            lambda: prepare_output_dir(self.output_dir, cfg, self.plan.total_steps)
        )
        self.notices += run_notices
        # printed when a signal stops the run; the CLI sets the command the user typed
        self.resume_command = resume_command(self.output_dir, str(self.output_dir / CONFIG_FILE))

        torch.manual_seed(t.seed)
        self.model = build_train_model(cfg, self.tokenizer, added_tokens, self.device,
                                       self.dist.mesh)  # fmt: skip
        attach_context(self.model, self.context)
        params = sum(p.numel() for p in self.model.parameters())
        # a resumed run keeps the thread count it was trained with: another count changes
        # the CPU kernels' summation order, and the resume would not be exact
        resumed = None
        if self.resume_path is not None:
            resumed = read_trainer_state(self.resume_path).get("num_threads")
        if line := set_threads(t.num_threads, params, self.device.type, resumed):
            self.notices.append(line)
        if self.preference:  # chosen/rejected pairs against a frozen reference
            self.objective = self._preference_objective(added_tokens)
        elif is_posttrain(cfg.diffusion.objective):  # grpo: unmask.posttrain
            self.objective = build_posttrain_objective(cfg, self.tokenizer)
        else:
            self.objective = build_objective(cfg.diffusion, self.tokenizer.mask_token_id,
                                             self.tokenizer.eos_token_id)  # fmt: skip
        self.flops = flop_model(self.model) if t.log_mfu else None  # mfu.py: the FLOP count
        self.optimizer = build_optimizer(cfg.optim, self.model)
        self.scheduler = build_scheduler(
            self.optimizer,
            cfg.optim.lr_scheduler_type,
            self.plan.total_steps,
            self.plan.warmup_steps,
            cfg.optim.min_lr_ratio,
        )
        self._unscaled_base_lrs = list(self.scheduler.base_lrs)  # the config's peak lrs
        # each rank reads only its rows of every global micro-batch, in worker processes
        # ahead of the step when asked
        self.loader = make_loader(
            self.train_rows, self.local_batch_size, t.seed, self.dist.dp_rank,
            self.dist.dp_size, t.dataloader_num_workers, self.device.type == "cuda",
        )  # fmt: skip
        self.noise = torch.Generator(device=self.device)
        self.noise.manual_seed(t.seed + 1)
        self.step = 0
        self.tokens_seen = 0
        self.last_eval_loss: float | None = None
        self.guard = NonFiniteGuard(t.max_bad_steps, t.nan_rollback, t.lr_backoff)
        self.stopped_by = ""  # the signal that stopped the run, if one did
        self._stop_signals: StopSignals | None = None  # while train() runs
        self.exit_code = 0
        self.logger: MetricsLogger | SilentLogger | None = None  # while train() runs
        self._lora_base: list[float] | None = None
        # generation_config.json: how this model must be sampled (Dream's shift, BD3LM's
        # block-causal attention; only what the objective fixes), so `unmask generate`,
        # export and lm-eval need no flags
        fixed = {**fixed_by_training(cfg.diffusion), **fitted_to_rows(cfg.data)}
        sampling = generation_config_text(self.tokenizer, fixed, complete=False)
        self.checkpointer = Checkpointer(
            self.output_dir,
            sharded=self.sharded,
            tokenizer=self.tokenizer,
            files={GENERATION_FILE: sampling, **self._lora_files()},
            save_total_limit=t.save_total_limit,
            keep_best=t.keep_best,
            async_save=t.async_checkpoint,
            timeout_s=t.ddp_timeout,
        )

        if self.resume_path is not None:  # before config.yaml: a mismatch changes nothing
            self._restore(self.resume_path)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.is_main:
            changes = write_config(self.output_dir, dump_config(cfg), self.step)
            if changes:
                self.notices.append(
                    f"resuming with changed settings (the previous config.yaml is kept in "
                    f"config_history/): {'; '.join(changes)}"
                )
            if self.resume_path is not None:  # the steps after the checkpoint: logged again
                truncate_metrics(self.output_dir, self.step)

    def _preference_objective(self, added_tokens: int) -> PreferenceObjective:
        """DPO against the frozen starting model: the policy with its LoRA adapters off, else
        a second copy built the same way (same seed and init_from, before any resume), held
        frozen in memory."""
        reference = None
        if not self.cfg.model.lora:
            torch.manual_seed(self.cfg.train.seed)  # the policy's initial weights
            reference = build_train_model(self.cfg, self.tokenizer, added_tokens, self.device,
                                          self.dist.mesh)  # fmt: skip
            reference.eval()
            params = sum(p.numel() for p in reference.parameters())
            size = next(reference.parameters()).element_size()
            self.notices.append(reference_memory_note(params, size))
        return PreferenceObjective(self.cfg.preference, self.cfg.diffusion,
                                   self.tokenizer.mask_token_id, reference)  # fmt: skip

    # -- state ---------------------------------------------------------------------------
    def _rng_state(self) -> dict:
        return {"torch": torch.get_rng_state(), "noise": self.noise.get_state()}

    def _restore(self, path: Path) -> None:
        saved = read_trainer_state(path)  # settings first, then tensors
        check_lora_settings(saved.get("lora"), self.cfg.model, path)
        state, rng = self.checkpointer.load(path, self.model, self.optimizer, self.scheduler)
        check_base_fingerprint(state.get("lora_base_fingerprint"), self.model, path)
        self.step = state["step"]
        self.tokens_seen = state.get("tokens_seen", 0)
        self.last_eval_loss = state.get("eval_loss")
        self.loader.load_state_dict(state["loader"])
        self.guard.load(state.get("guard"))
        self._scale_lr(self.guard.state.lr_scale)
        torch.set_rng_state(rng["torch"])
        self.noise.set_state(rng["noise"])
        if hasattr(self.objective, "load_rank_state"):  # also {}: a rollback forgets
            self._restore_rank_state(path)

    def _rank_layout(self) -> dict:
        """What a rank's own state depends on: which rows of which micro-batches it holds."""
        return {"world_size": self.dist.world_size, "rank": self.dist.rank,
                "micro_batches": self.cfg.train.gradient_accumulation_steps,
                "rows": self.local_batch_size}  # fmt: skip

    def _rank_state(self) -> dict | None:
        """This rank's state for the checkpoint (grpo: its cached rollouts mid-cycle), with
        the layout it belongs to; None when the objective has none."""
        state = getattr(self.objective, "rank_state", dict)()
        return {**self._rank_layout(), "objective": state} if state else None

    def _restore_rank_state(self, path: Path) -> None:
        """The objective's state of this rank from checkpoint `path` when the run holds
        the same rows as the run that wrote it; otherwise (another world size, batch size
        or accumulation, or settings the objective cannot take) a notice, and the objective
        starts without it (grpo: fresh rollouts)."""
        saved = self.checkpointer.load_rank_state(path, self.device)
        if saved is None:
            self.objective.load_rank_state({})
            return
        layout = self._rank_layout()
        names = {"world_size": "processes", "micro_batches": "micro-batches per step",
                 "rows": "rows per micro-batch and process"}  # fmt: skip
        changed = [f"{saved.get(key)} {name} there, {layout[key]} here"
                   for key, name in names.items() if saved.get(key) != layout[key]]  # fmt: skip
        why = "; ".join(changed) if changed else self.objective.load_rank_state(saved["objective"])
        if why is None:
            return
        self.objective.load_rank_state({})
        line = (f"{Path(path).name} holds cached rollouts this run cannot reuse ({why}): the "
                "next step draws fresh ones, so the run differs from an uninterrupted one; "
                "resume with the settings it was written with to reuse them")  # fmt: skip
        if self.logger is not None:  # a rollback during train()
            self.logger.print(line)
        else:
            self.notices.append(line)

    def _scale_lr(self, scale: float) -> None:
        """Learning rates = the schedule's times `scale` (the non-finite guard's backoff)."""
        sched = self.scheduler  # a LambdaLR: lr = base_lr * lambda(step)
        sched.base_lrs = [lr * scale for lr in self._unscaled_base_lrs]
        for group, lr, factor in zip(self.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = lr * factor(sched.last_epoch)

    def _lora_files(self) -> dict[str, str]:
        """A LoRA run's lora_base.json (the base its adapters need, see models/lora.py),
        written into every checkpoint, final/ and the adapter folder."""
        if not self.cfg.model.lora:
            return {}
        if not self.sharded:  # the base is frozen: its fingerprint never changes
            self._lora_base = base_fingerprint(self.model)
        record = base_record(self.cfg.model, self.cfg.train.seed, self.model.config.vocab_size,
                             self._lora_base)  # fmt: skip
        return {LORA_BASE_FILE: json.dumps(record, indent=2)}

    def _trainer_state(self) -> dict:
        state = {"loader": self.loader.state_dict(), "tokens_seen": self.tokens_seen,
                 "num_threads": torch.get_num_threads(),
                 "guard": self.guard.state.to_dict(), "eval_loss": self.last_eval_loss}  # fmt: skip
        if self.cfg.model.lora:
            state["lora"] = lora_settings(self.cfg.model)
        if self.cfg.model.lora and not self.sharded:  # adapter-only checkpoints
            if self._lora_base is None:
                self._lora_base = base_fingerprint(self.model)
            state["lora_base_fingerprint"] = self._lora_base
        return state

    def save(self) -> Path | None:
        """checkpoint-{step}; None when the disk cannot hold it and train.on_disk_full is
        continue (else RunStopped)."""
        notice = room_for_checkpoint(self.checkpointer, self.model, self.optimizer,
                                     self.cfg.train.on_disk_full, self.step)  # fmt: skip
        if notice:
            if self.logger is not None:
                self.logger.print(notice)
            return None
        return self.checkpointer.save(self.step, self.model, self.optimizer, self.scheduler,
                                      self._trainer_state(), self._rng_state(),
                                      self._rank_state())  # fmt: skip

    # -- one step ------------------------------------------------------------------------
    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.train.bf16)

    def _rank_noise(self, batch: dict, where: tuple[int, int]) -> tuple[dict, torch.Generator]:
        """This rank's micro-batch with the noise its objective uses, and the generator.
        An objective with `global_noise` draws the randomness of the whole global batch
        from the generator every rank holds in the same state and keeps this rank's rows:
        a row gets the noise it would get in a one-process run of the same global batch,
        so losses do not depend on the world size. Other objectives draw on their own rows
        from a generator seeded by (seed, where = (step, micro-batch), rank)."""
        if getattr(self.objective, "global_noise", False):
            b = self.local_batch_size
            rows = (self.dist.dp_rank * b, self.dist.dp_size * b)
            return self.objective.with_noise(batch, self.noise, rows), self.noise
        return batch, rank_generator(self.noise, where, self.dist.dp_rank)

    def _context_slice(self, batch: dict) -> dict:
        """Context parallelism: the micro-batch's noise drawn for whole rows as in
        `_rank_noise` (so it does not depend on the cp degree), then this rank's slice of
        every row (a row cut to a random length is padded to a multiple of cp first)."""
        b = self.local_batch_size
        rows = (self.dist.dp_rank * b, self.dist.dp_size * b)
        batch = self.objective.with_noise(batch, self.noise, rows)
        return self.context.shard_batch(pad_rows(batch, self.context.size))

    def _once(self, value: torch.Tensor) -> torch.Tensor:
        """value on tp rank 0, zero on its tp peers: they computed the same loss and count
        from the same rows, which a sum over all ranks must count once."""
        return value if self.dist.tp_rank == 0 else torch.zeros_like(value)

    def _prepared(self, batch: dict) -> dict:
        """A micro-batch on the device, cut to LLaDA's random length (seeded by the step, so
        every rank and micro-batch cuts alike)."""
        batch = self._to_device(batch)
        return random_length_cut(
            batch, self.cfg.diffusion.random_length_prob, self.cfg.train.seed, self.step
        )

    def _count_before_forward(self, batches: list[dict]) -> torch.Tensor | None:
        """The step's normalizer (the objective's count summed over micro-batches and ranks)
        before any forward, when the objective can say it from the batches alone
        (`count(batch)`; Dream's cutoffs cannot); else None."""
        count_of = getattr(self.objective, "count", None)
        counts = [count_of(batch) for batch in batches] if count_of is not None else [None]
        if any(count is None for count in counts):
            return None
        total = torch.zeros((), device=self.device)
        for count in counts:
            total += count.float()
        if self.sharded:
            (total,) = all_reduce_sum(self._once(total))
        return total

    def train_step(self, batches: list[dict]) -> dict:
        """One optimizer step over micro-batches; the loss is normalized once, globally, by
        the count summed over micro-batches and ranks. When that count is known before the
        forward, each micro-batch's loss is scaled by 1 / count before its backward (no pass
        over the gradients); otherwise the gradients are scaled after the last backward.

        Returns `loss` and (when clipping) `grad_norm` as 0-d tensors left on the device,
        `learning_rate`, `flops` (train.log_mfu: this device's model FLOPs, mfu.py; a 0-d
        tensor) and `finite` (bool): the step's one host-device sync, the flag the non-finite
        guard needs to skip the update. In a multi-process run the same read carries `stop`
        (a stop signal reached some rank), summed in the loss's all-reduce."""
        batches = [self._prepared(batch) for batch in batches]
        if self.context is not None:
            batches = [self._context_slice(batch) for batch in batches]
        if hasattr(self.objective, "begin_step"):  # grpo: inner iterations reuse rollouts
            self.objective.begin_step(self.step)
        # a stop signal on any rank: reduced with the loss, read with the guard's flag
        requested = self._stop_signals is not None and self._stop_signals.requested
        stop = torch.full((), float(requested), device=self.device)
        count_total = self._count_before_forward(batches)
        scale = None if count_total is None else 1.0 / count_total.clamp(min=1.0)
        loss_sum_total = torch.zeros((), device=self.device)
        counted = torch.zeros((), device=self.device)
        flops = 0.0
        sums: dict[str, torch.Tensor] = {}  # the objective's `step_sums` (preference)
        for index, batch in enumerate(batches):
            noise = self.noise
            if self.sharded:
                batch, noise = self._rank_noise(batch, (self.step, index))
                sync_gradients(self.model, index == len(batches) - 1)
            with self._autocast():
                loss_sum, count = self.objective(self.model, batch, noise)
            (loss_sum if scale is None else loss_sum * scale).backward()
            for key, value in getattr(self.objective, "step_sums", {}).items():
                sums[key] = sums.get(key, 0.0) + value
            loss_sum_total += loss_sum.detach().float()
            counted += count.detach().float()
            if self.flops is not None:
                flops = flops + self._micro_batch_flops(batch)
        if scale is None:  # the count came with the forward: scale the gradients now
            if self.sharded:  # sum over ranks: the normalization stays global
                loss_sum_total, counted, stop = all_reduce_sum(
                    self._once(loss_sum_total), self._once(counted), stop
                )
            scale = 1.0 / counted.clamp(min=1.0)
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.mul_(scale.to(param.grad.dtype))
        elif self.sharded:
            loss_sum_total, stop = all_reduce_sum(self._once(loss_sum_total), stop)
        # the global gradient norm (clipped to max_grad_norm when set): also the guard's
        max_norm = self.cfg.optim.max_grad_norm if self.cfg.optim.max_grad_norm > 0 else math.inf
        grad_norm = clip_grad_norm(self.model.parameters(), max_norm)
        loss = loss_sum_total * scale
        learning_rate = self.optimizer.param_groups[0]["lr"]  # the lr this step uses
        stats = {"loss": loss, "learning_rate": learning_rate}
        if sums:  # means over the step's count (preference: reward margin, accuracy)
            stats["objective"] = self._step_means(sums, scale)
        if self.flops is not None:
            stats["flops"] = flops
        if self.cfg.optim.max_grad_norm > 0:
            stats["grad_norm"] = grad_norm.detach()
        flags = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if self.sharded:
            flags = torch.stack([flags, stop > 0])
        read = flags.reshape(-1).tolist()  # the one sync of a step: the guard needs it now
        stats["finite"] = read[0]
        if self.sharded:
            stats["stop"] = read[1]
        if stats["finite"]:  # a non-finite step changes nothing: no update, same schedule
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stats

    def _step_means(self, sums: dict, scale: torch.Tensor) -> dict:
        """The objective's per-step sums over micro-batches (and ranks) times 1 / count."""
        stacked = torch.stack([torch.as_tensor(v, device=self.device).float()
                               for v in sums.values()])  # fmt: skip
        if self.sharded:
            (stacked,) = all_reduce_sum(stacked)
        return dict(zip(sums, stacked * scale))

    def _micro_batch_flops(self, batch: dict):
        """Model FLOPs of the micro-batch just computed (mfu.py), with the LM head on the
        rows the objective masked (its `last_stats`; every token when it has none). Under
        context parallelism the batch is this rank's slice; its tokens attend over whole
        rows."""
        rows, length = batch["input_ids"].shape
        whole = length * (self.context.size if self.context is not None else 1)
        masked = getattr(self.objective, "last_stats", {}).get("num_masked")
        head_rows = rows * length if masked is None else masked.double()
        return self.flops.step_flops(rows * length, whole, head_rows)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Eval loss on held-out rows with fixed noise, so evaluations are comparable. An
        objective that draws each row's noise on its own (`global_noise`) gets row i's from
        a generator seeded by (seed, i): the loss does not depend on
        train.per_device_eval_batch_size (only on the rows: eval_max_batches counts
        batches)."""
        was_training = self.model.training
        self.model.eval()
        noise = torch.Generator(device=self.device)
        noise.manual_seed(self.cfg.train.seed + 12345)
        loss_sum_total = torch.zeros((), device=self.device, dtype=torch.float64)
        count_total = torch.zeros((), device=self.device, dtype=torch.float64)
        size = self.cfg.train.per_device_eval_batch_size
        for index, batch in enumerate(eval_batches(self.eval_rows, size)):
            if self.cfg.train.eval_max_batches is not None:
                if index >= self.cfg.train.eval_max_batches:
                    break
            batch = self._eval_noise(self._to_device(batch), index * size)
            if self.context is not None:  # this rank's slice of the rows (noise drawn)
                batch = self.context.shard_batch(pad_rows(batch, self.context.size))
            with self._autocast():
                loss_sum, count = self._eval_objective(self.model, batch, noise)
            loss_sum_total += loss_sum.detach().double()  # on the device: one read at the end
            count_total += count.detach().double()
        if self.context is not None:  # the slices' sums: every cp rank gets the rows' total
            loss_sum_total, count_total = self.context.sum(loss_sum_total, count_total)
        self.model.train(was_training)
        return float(loss_sum_total / count_total.clamp(min=1.0))

    @property
    def _eval_objective(self):
        """What eval_loss measures: the objective's own `eval_objective` when it has one
        (grpo: the masked-diffusion loss of the held-out answers), else the objective."""
        return getattr(self.objective, "eval_objective", None) or self.objective

    def _eval_noise(self, batch: dict, first_row: int) -> dict:
        """The eval batch with each row's noise drawn from its own generator, seeded by the
        row's index; unchanged for objectives that draw for the whole batch."""
        if not getattr(self._eval_objective, "global_noise", False):
            return batch
        generator = torch.Generator(device=self.device)
        drawn = []
        for row in range(batch["input_ids"].shape[0]):
            generator.manual_seed(self.cfg.train.seed + 54321 + first_row + row)
            one = {k: v[row : row + 1] for k, v in batch.items()}
            drawn.append(self._eval_objective.with_noise(one, generator))
        added = [k for k in drawn[0] if k not in batch]
        return {**batch, **{k: torch.cat([d[k] for d in drawn]) for k in added}}

    # -- the loop ------------------------------------------------------------------------
    def train(self) -> dict:
        """Run to train.max_steps (or until a stop signal: see signals.py); returns the last
        logged values."""
        cfg, plan = self.cfg, self.plan
        logger = (MetricsLogger if self.dist.is_main else SilentLogger)(
            self.output_dir,
            plan.total_steps,
            start_step=self.step,
            report_to=tuple(cfg.train.report_to),
            run_name=cfg.train.run_name,
            show_progress=not cfg.train.disable_tqdm,
            config=cfg.model_dump(mode="json"),
        )
        self.logger = logger
        logger.print(self._summary())
        for notice in self.notices:
            logger.print(notice)
        window = LogWindow()
        if self.flops is not None and self.dist.is_main:  # only rank 0 logs
            peak = device_peak(self.device, matmul_dtype(self.device.type, cfg.train.bf16))
            window.peak_flops = peak.flops
            logger.print(peak.describe())
        routing = getattr(self.optimizer, "routing", None)
        if routing is not None:
            logger.print(routing.summary())
        ns_choice = getattr(self.optimizer, "ns_dtype_choice", None)
        if ns_choice is not None and routing is not None and routing.muon:
            dtype, why = ns_choice
            source = "optim.ns_dtype" if why == "as given" else f"optim.ns_dtype auto: {why}"
            logger.print(f"Muon Newton-Schulz in {dtype} ({source})")
        self.model.train()
        started = time.perf_counter()
        window.restart()
        last: dict = {}
        try:
            with StopSignals() as stop, self._lost_peer_stops():
                self._stop_signals = stop
                while self.step < plan.total_steps:
                    batches = [
                        next(self.loader) for _ in range(cfg.train.gradient_accumulation_steps)
                    ]
                    stats = self.train_step(batches)
                    self.checkpointer.poll()  # a finished async write is published now
                    self.step += 1
                    self.tokens_seen += plan.tokens_per_step
                    if not self._guard_step(stats, logger):
                        continue
                    window.add(stats, plan.tokens_per_step)  # on the device: no sync
                    at_end = self.step == plan.total_steps
                    values: dict = {}
                    if self.step % plan.logging_every == 0 or at_end:  # the window is read
                        values.update(
                            window.values(stats),
                            tokens_seen=self.tokens_seen,
                            elapsed_seconds=round(time.perf_counter() - started, 3),
                        )
                        if self.guard.state.skipped_steps:
                            values["skipped_steps"] = self.guard.state.skipped_steps
                        if hasattr(self.objective, "take_log"):  # grpo's rollout metrics
                            values.update(self.objective.take_log())
                        if window.peak_raised:
                            window.peak_raised = False
                            dtype = matmul_dtype(self.device.type, cfg.train.bf16)
                            logger.print(raise_cached_peak(self.device, dtype, window.peak_flops))
                    logger.advance(self.step, progress_postfix(values))
                    if (plan.eval_every and self.step % plan.eval_every == 0) or at_end:
                        if len(self.eval_rows):
                            values["eval_loss"] = self.last_eval_loss = self.evaluate()
                    if values:  # logged before the save: a kill after the checkpoint must
                        logger.log(self.step, values)  # not lose this step's line
                        last.update(values)
                    saved = (plan.save_every and self.step % plan.save_every == 0) or at_end
                    if saved:  # the loop's stall: all of a sync save, the copy of an async one
                        save_started = time.perf_counter()
                        self.save()
                        stall = round(time.perf_counter() - save_started, 4)
                        logger.log(self.step, {"save_stall_seconds": stall}, show=False)
                        last["save_stall_seconds"] = stall
                    if self._stop_requested(stop, stats):
                        self._stop(stop, logger, saved)
                        return last
            with self._lost_peer_stops():  # both gather the sharded model
                self.model = self.checkpointer.save_final(self.model, cfg.model)
                prompt = "..."
                if cfg.eval.generate_accuracy:
                    last["heldout_exact_match"], prompt = self._heldout_accuracy(logger)
            if self.dist.is_main:  # steps, tokens, time, losses, checkpoints, what next
                logger.print(run_summary(self.output_dir, prompt=prompt,
                                         wall_seconds=time.perf_counter() - started))  # fmt: skip
        finally:
            self._stop_signals = None
            if hasattr(self.objective, "close"):  # grpo: the rewards' worker processes
                self.objective.close()
            self._finish_checkpoint()
            logger.close()
            self.logger = None
            self.loader.close()
        return last

    @contextmanager
    def _lost_peer_stops(self):
        """A collective that fails because another process is lost (killed, its node gone,
        or silent past train.ddp_timeout: see collective_failure) stops the run with one
        line on every surviving rank: the step, the newest complete checkpoint and (added by
        the CLI) the resume command, exit code 1. Any other error keeps its traceback.
        Entered after StopSignals, so a launcher's SIGTERM that follows the lost peer only
        sets the stop flag while the line is made."""
        try:
            yield
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            failure = collective_failure(err) if self.sharded else None
            if failure is None:
                raise
            try:  # an async write the lost peer was part of fails too (within ddp_timeout)
                self.checkpointer.wait()
            except Exception:  # it stays unpublished: the line names the older one
                pass
            saved = list_checkpoints(self.output_dir)
            newest = saved[-1] if saved else "none (no checkpoint yet)"
            how = (f"it did not answer within train.ddp_timeout ({self.cfg.train.ddp_timeout} s: "
                   f"{failure.detail})" if failure.timed_out
                   else f"its connection closed ({failure.detail})")  # fmt: skip
            raise RunStopped(
                f"a peer process was lost after step {self.step}: {how}; the newest complete "
                f"checkpoint is {newest}",
                resume=True,
            ) from err

    def _finish_checkpoint(self) -> None:
        """The end of train(), also by a signal or an error: an async checkpoint in flight
        is written and published before the process goes on (its own error is raised only
        when no other one is on its way out)."""
        leaving = sys.exc_info()[1]  # the error train() is stopping for, if any
        try:
            self.checkpointer.wait()
        except Exception as err:
            if leaving is None:
                raise
            if self.logger is not None:
                self.logger.print(f"the checkpoint being written failed too: {err}")

    def _guard_step(self, stats: dict, logger) -> bool:
        """True when the step counted; for a non-finite one: skip it, roll back to the last
        checkpoint or stop (guard.py)."""
        action = self.guard.record(self.step, stats["finite"])
        if action == "ok":
            return True
        state = self.guard.state
        logger.log(self.step, {"skipped_steps": state.skipped_steps,
                               "skipped_in_a_row": state.in_a_row})  # fmt: skip
        logger.print(
            f"step {self.step}: non-finite loss or gradient norm (loss {float(stats['loss'])}); the "
            f"step was skipped ({state.in_a_row} in a row, {state.skipped_steps} in all)"
        )
        if action == "skip":
            return False
        self.checkpointer.wait()  # an async checkpoint in flight is published first
        newest = newest_intact(self.output_dir)[0] if self.dist.is_main else None
        newest = share_from_rank0(lambda: newest)
        streak = f"steps {state.first_bad_step}-{self.step}"
        if action == "rollback" and newest is not None:
            scale = self.guard.rolled_back()
            self._restore(newest)
            self.guard.state.lr_scale = scale  # the restore brought back the older scale
            self._scale_lr(scale)
            logger.rewind(self.step)
            logger.print(f"{streak} were non-finite: back to {newest.name}, learning rate "
                         f"x {scale:g} (train.lr_backoff)")  # fmt: skip
            return False
        raise RunStopped(
            f"{streak} had a non-finite loss or gradient norm ({self.cfg.train.max_bad_steps} in "
            f"a row, train.max_bad_steps); the last good checkpoint is "
            f"{newest or 'none (no checkpoint yet)'}: resume from it with a lower "
            "optim.learning_rate, or set train.nan_rollback=true"
        )

    def _stop_requested(self, stop: StopSignals, stats: dict) -> bool:
        """A stop signal reached any rank (every rank decides the same, at the same step).
        Several processes: the flag train_step summed over ranks with the loss and read with
        the guard's, so asking costs no collective and no sync of its own."""
        if not self.sharded:
            return stop.requested
        return stats["stop"]

    def _stop(self, stop: StopSignals, logger, saved: bool) -> None:
        if not saved:
            self.save()
        self.stopped_by = stop.name or "a signal on another rank"
        self.exit_code = stop.exit_code
        logger.print(
            f"stopped by {self.stopped_by} at step {self.step}; checkpoint-{self.step} is saved. "
            f"{_sentence(resume_advice(self.resume_command))}"
        )

    def _heldout_accuracy(self, logger: MetricsLogger) -> tuple[float, str]:
        """Exact match of greedy answers to held-out prompts; and one prompt, for the
        end-of-run summary's `unmask generate` line."""
        if self.preference:  # prompts and chosen answers of the held-out pairs
            examples = heldout_pair_examples(self.cfg.data, self.tokenizer)
        else:
            examples = heldout_examples(self.cfg.data)
        started = time.perf_counter()
        shown = [0]  # quarters of the pass printed so far

        def progress(done: int, total: int) -> None:
            quarter = 4 * done // max(total, 1)
            if quarter > shown[0] and done < total:
                shown[0] = quarter
                logger.print(f"held-out generation: {done}/{total} prompts "
                             f"({time.perf_counter() - started:.0f}s)")  # fmt: skip

        accuracy, rows = heldout_accuracy(
            self.model,
            self.tokenizer,
            examples,
            self.cfg.eval,
            self.cfg.data.packing_length,
            self.device,
            fixed_by_training(self.cfg.diffusion),
            on_progress=progress,
        )
        for prompt, expected, got in rows[:5]:
            mark = "ok " if expected == got else "bad"
            logger.print(f"  [{mark}] {prompt}{got}   (expected {expected})")
        logger.print(
            f"held-out exact match: {accuracy:.1%} on {len(rows)} prompts "
            f"({time.perf_counter() - started:.0f}s)"
        )
        result = {"heldout_exact_match": accuracy, "num_examples": len(rows), "step": self.step}
        if self.dist.is_main:
            (self.output_dir / "eval_results.json").write_text(json.dumps(result, indent=2))
        logger.log(self.step, {"heldout_exact_match": accuracy})
        return accuracy, (rows[0][0] if rows else "...")

    def _summary(self) -> str:
        params = list(self.model.parameters())
        total = sum(p.numel() for p in params)
        size = f"{total / 1e6:.2f}M parameters"
        if self.cfg.model.lora:  # only the adapters train
            trainable = sum(p.numel() for p in params if p.requires_grad)
            size = f"{_millions(trainable)} trainable of {size}"
        rows = "streamed" if self.num_rows is None else self.num_rows
        start = f"resuming from {self.resume_path} at step {self.step}" if self.step else "fresh"
        if not self.step and self.cfg.train.resume_from_checkpoint is True:
            start = "fresh: nothing to resume"
        return (
            f"unmask: {size} | {rows} train rows, "
            f"{len(self.eval_rows)} eval rows of {self.cfg.data.packing_length} tokens | "
            f"{self.plan.total_steps} steps on {self.device}{self.dist.describe()} | {start} | "
            f"output_dir {self.output_dir}"
        )


def _millions(count: int) -> str:
    """A parameter count in millions: two decimals, or two significant digits below 0.01M."""
    return f"{count / 1e6:.2f}M" if count >= 10_000 else f"{count / 1e6:.2g}M"


def _sentence(text: str) -> str:
    """text with its first letter in upper case (the rest unchanged)."""
    return text[:1].upper() + text[1:]
