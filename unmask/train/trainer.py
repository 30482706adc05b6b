"""The one training loop: batches -> objective -> (loss_sum, count) -> backward ->
global normalization -> clip -> optimizer -> schedule -> metrics and checkpoints.

Everything that can reject user input (config, tokenizer, data, output_dir, resume
path) runs before anything is written, so bad input never leaves a half-made run.
"""

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from unmask.checkpoint import Checkpointer, list_checkpoints
from unmask.checkpoint.checkpointer import check_async_request
from unmask.checkpoint.layout import newest_intact
from unmask.config import RunConfig, dump_config
from unmask.data import make_loader
from unmask.data.images import processor_files
from unmask.data.streaming import StreamSpec
from unmask.device import resolve_device
from unmask.diffusion import objective_spec
from unmask.errors import RunStopped
from unmask.models.float8 import check_float8
from unmask.models.quant import check_4bit
from unmask.optim.config import build_optimizer
from unmask.optim.schedule import build_scheduler
from unmask.parallel.context import ContextShard, attach_context
from unmask.parallel.distributed import collective_failure, setup
from unmask.parallel.expert import attach_moe_training
from unmask.parallel.mesh import launch_env, share_from_rank0
from unmask.parallel.pipeline import PipelineRunner
from unmask.parallel.pipeline_plan import balancing_notice
from unmask.parallel.threads import set_threads
from unmask.runs.heartbeat import Heartbeat, mark_running
from unmask.runs.report import run_summary
from unmask.sampling.generation_file import (
    GENERATION_FILE,
    fitted_to_rows,
    fixed_by_training,
    generation_config_text,
)
from unmask.train.evaluation import Evaluation
from unmask.train.guard import DeferredFlags, NonFiniteGuard
from unmask.train.host_memory import trim_host_memory
from unmask.train.metrics import (
    LogWindow,
    MetricsLogger,
    SilentLogger,
    check_trackers,
    progress_postfix,
    truncate_metrics,
)
from unmask.train.mfu import (
    CallFlops,
    DeviceTimer,
    device_peak,
    flop_model,
    matmul_dtype,
    raise_cached_peak,
)
from unmask.train.plan import make_plan
from unmask.train.qk_clip import build_qk_clip
from unmask.train.run_dir import (
    CONFIG_FILE,
    prepare_output_dir,
    resume_advice,
    resume_command,
    write_config,
)
from unmask.train.setup import (
    build_run_objective,
    build_train_model,
    checkpointing_is_auto,
    objective_datasets,
    plan_parallel,
    prepare_tokenizer,
    set_checkpointing,
)
from unmask.train.signals import StopSignals
from unmask.train.state import CheckpointedState, LoraRecord, Progress, resumed_thread_count
from unmask.train.step import TrainStep


def cpu_share_notice(world_size: int, cores: int | None = None) -> str | None:
    """A notice when more CPU processes run than the machine has cores, else None."""
    cores = cores or os.cpu_count() or 1
    if world_size <= cores:
        return None
    return (f"{world_size} processes share {cores} CPU cores: expect each to run slower "
            "than one process would; launch at most one per core")  # fmt: skip


#: the start-up line of a Trainer built with activation_checkpointing auto and no decider
UNDECIDED_CHECKPOINTING = (
    "activation checkpointing: none (auto is decided by the planner: pass "
    "decide_checkpointing=unmask.plan.checkpointing.choose_for_trainer to Trainer, as "
    "`unmask train` does)"
)


class Trainer(TrainStep, Evaluation, CheckpointedState):
    """Builds every component from its config section and runs the loop. Its seams live in
    their own modules: setup.py (building the parts), step.py (`train_step`: normalization
    and the non-finite flag), evaluation.py (`evaluate`, held-out accuracy) and state.py
    (`save` and restoring: the parts' checkpoint state)."""

    def __init__(self, cfg: RunConfig, decide_checkpointing=None):
        """decide_checkpointing: trainer -> (the model's checkpointing flag, the start-up
        line), which decides `train.activation_checkpointing: auto` from the built model's
        planned memory (unmask.plan.checkpointing `choose_for_trainer`: the planner sits a
        layer above the trainer, so the caller passes it, as `unmask train` does). None with
        auto: no checkpointing, and the start-up log says auto was not decided."""
        self.cfg = cfg
        self.decide_checkpointing = decide_checkpointing
        self._connect(cfg)  # every check of the layout, then the process group and mesh
        added_tokens = self._read_data(cfg)  # tokenizer, rows, step plan, run folder
        torch.manual_seed(cfg.train.seed)
        self._build_model(cfg, added_tokens)  # model, pipeline, objective, FLOP count
        self._build_optimization(cfg)  # optimizer, MoE training, checkpointing, schedule
        self._loop_state(cfg)  # loader, noise, step, guards
        self._checkpoints(cfg)  # the checkpointer; a resume; config.yaml
        if self.dist.is_main:  # alive from here on, with the run folder (runs/heartbeat.py)
            mark_running(self.output_dir)

    def _connect(self, cfg: RunConfig) -> None:
        """The checks that need nothing built (LoRA, async checkpoints, trackers, the layout:
        the planner makes the same), then the process group, mesh and device."""
        t = cfg.train
        env = launch_env()
        # every check of the model (LoRA first: a missing peft is named before what needs
        # it) and of the layout, then the mesh's sizes, the rows per rank and the pipeline's
        # stages, before any process group work (the planner runs the same)
        self.parallel = plan_parallel(cfg, env.world_size)
        check_async_request(t.async_checkpoint, cfg.model.lora)
        check_trackers(t.report_to)
        self.local_batch_size = self.parallel.rows
        self.pipeline_plan = self.parallel.pipeline
        self.dist = setup(resolve_device(t.device), timeout_s=t.ddp_timeout, env=env,
                          dims=self.parallel.dims)  # fmt: skip
        self.device = self.dist.device
        self.sharded = self.dist.mesh is not None  # world size 1: no process group, no mesh
        self.context = ContextShard.from_mesh(self.dist.mesh)  # None: whole rows per rank
        check_4bit(cfg.model, self.device, self.dist.world_size)
        check_float8(t.float8, t.bf16, self.device)

    def _read_data(self, cfg: RunConfig) -> int:
        """The tokenizer, the rows and their checks, the step plan and the run folder; returns
        the tokens added to the vocabulary."""
        t = cfg.train
        self.tokenizer, saved_tokenizer, added_tokens = prepare_tokenizer(cfg)
        data = objective_datasets(cfg, self.tokenizer, saved_tokenizer)
        self.train_rows, self.eval_rows = data.train, data.eval
        # the objective's input checks on the rows (grpo: the rewards import and score)
        objective_spec(cfg.diffusion.objective).check_rows(cfg, self.tokenizer, data.train)
        self.notices = [*cfg.notices, *data.notices]  # the config file's, then the data's
        self.num_rows = None if isinstance(data.train, StreamSpec) else len(data.train)
        batch_ranks = 1 if t.split_batches else self.parallel.dims.dp
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

        return added_tokens

    def _build_model(self, cfg: RunConfig, added_tokens: int) -> None:
        """The model (this rank's share of it), the pipeline runner, threads, the objective and
        the FLOP count."""
        t = cfg.train
        self.model = build_train_model(cfg, self.tokenizer, added_tokens, self.device,
                                       self.parallel, self.dist.mesh)  # fmt: skip
        self.pipeline = None  # PipelineRunner: this rank's stages and the schedule
        if self.pipeline_plan is not None:
            hidden_dtype = torch.bfloat16 if t.bf16 else torch.float32
            self.pipeline = PipelineRunner(self.model, self.dist.mesh["pp"].get_group(),
                                           self.device, hidden_dtype)  # fmt: skip
            self.notices.append(self.pipeline_plan.describe())
            balancing = balancing_notice(self.pipeline_plan, self.model.config,
                                         t.gradient_accumulation_steps)  # fmt: skip
            if balancing:
                self.notices.append(balancing)
        attach_context(self.model, self.context)
        params = sum(p.numel() for p in self.model.parameters())
        # a resumed run keeps the thread count it was trained with: another count changes
        # the CPU kernels' summation order, and the resume would not be exact
        resumed = resumed_thread_count(self.resume_path)
        if line := set_threads(t.num_threads, params, self.device.type, resumed):
            self.notices.append(line)
        self.objective = build_run_objective(cfg, self.tokenizer, added_tokens, self.device,
                                             self.parallel, self.dist.mesh,
                                             self.notices)  # fmt: skip
        # mfu.py: the FLOP count (of the whole model: not under PP, where a rank holds part)
        self.timer = DeviceTimer(self.device)  # the optimizer's share of a step
        self.flops = None
        if t.log_mfu and self.pipeline is None:
            context = self.context.size if self.context is not None else 1
            self.flops = CallFlops(self.model, flop_model(self.model), context)

    def _build_optimization(self, cfg: RunConfig) -> None:
        """The optimizer, the MoE training hooks, automatic activation checkpointing and the
        learning-rate schedule."""
        t = cfg.train
        self.optimizer = build_optimizer(cfg.optim, self.model)
        # QK-clip: the per-head max logit captured in the forwards, the clip after the step
        self.qk_clip = build_qk_clip(cfg.optim, self.model, self.device, self.dist,
                                     lora=cfg.model.lora)  # fmt: skip
        if self.qk_clip is not None and self.qk_clip.normed:
            self.notices.append(
                "optim.qk_clip_threshold with model.qk_norm: the q/k norms come after the "
                "projections QK-clip scales and undo most of the scale (megatron-core's "
                "behaviour too); its qk_max_logit is logged, its clip barely lowers it"
            )
        # MoE: the step's expert load over micro-batches and ranks, the expert-bias update
        # (under PP: the forwards of a step are the pipeline's micro-batches, and the
        # metrics gather every stage's layers)
        forwards = (t.gradient_accumulation_steps if self.pipeline is None
                    else self.pipeline_plan.microbatches)  # fmt: skip
        stages = None if self.pipeline is None else self.pipeline.group
        self.moe = attach_moe_training(self.model, self.optimizer, self.dist, forwards,
                                       stages)  # fmt: skip
        if checkpointing_is_auto(t) and self.decide_checkpointing is not None:
            flag, line = self.decide_checkpointing(self)  # the built model's planned memory
            set_checkpointing(self.model, flag)
            self.notices.append(line)
        elif checkpointing_is_auto(t):
            self.notices.append(UNDECIDED_CHECKPOINTING)
        self.scheduler = build_scheduler(
            self.optimizer,
            cfg.optim.lr_scheduler_type,
            self.plan.total_steps,
            self.plan.warmup_steps,
            cfg.optim.min_lr_ratio,
        )
        self._unscaled_base_lrs = list(self.scheduler.base_lrs)  # the config's peak lrs

    def _loop_state(self, cfg: RunConfig) -> None:
        """The loader, the noise generator, the step and the loop's guards and records."""
        t = cfg.train
        # each rank reads only its rows of every global micro-batch, in worker processes
        # ahead of the step when asked
        self.loader = make_loader(
            self.train_rows, self.local_batch_size, t.seed, self.dist.dp_rank,
            self.dist.dp_size, t.dataloader_num_workers, self.device.type == "cuda",
        )  # fmt: skip
        self.noise = torch.Generator(device=self.device)
        self.noise.manual_seed(t.seed + 1)
        self.step = 0
        self.progress = Progress()  # tokens_seen, the last eval loss
        self.guard = NonFiniteGuard(t.max_bad_steps, t.nan_rollback, t.lr_backoff)
        self.deferred = DeferredFlags()  # nonfinite_check logging: the flags not read yet
        self.deferred_stop = False  # a stop signal the last read of them carried
        self.stopped_by = ""  # the signal that stopped the run, if one did
        self._stop_signals: StopSignals | None = None  # while train() runs
        self.exit_code = 0
        self.logger: MetricsLogger | SilentLogger | None = None  # while train() runs
        self.lora = LoraRecord(cfg.model, self.model, t.seed, self.sharded)

    def _checkpoints(self, cfg: RunConfig) -> None:
        """The checkpointer, a resume (before config.yaml: a mismatch changes nothing) and the
        run's config.yaml."""
        t = cfg.train
        # generation_config.json: how this model must be sampled (Dream's shift, BD3LM's
        # block-causal attention; only what the objective fixes), so `unmask generate`,
        # export and lm-eval need no flags
        fixed = {**fixed_by_training(cfg.diffusion), **fitted_to_rows(cfg.data)}
        sampling = generation_config_text(self.tokenizer, fixed, complete=False)
        self.checkpointer = Checkpointer(
            self.output_dir,
            sharded=self.sharded,
            tokenizer=self.tokenizer,
            # the folder's image processor: a run from a folder with a tower gives folders
            # that take pictures (unmask generate --image, serve) as it does
            files={
                GENERATION_FILE: sampling,
                **self.lora.files(),
                **processor_files(cfg.model.pretrained),
            },
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
        window = LogWindow(timer=self.timer)
        if self.flops is not None and self.dist.is_main:  # only rank 0 logs
            peak = device_peak(self.device, matmul_dtype(self.device.type, cfg.train.bf16))
            window.peak_flops = peak.flops
            logger.print(peak.describe())
        routing = getattr(self.optimizer, "routing", None)
        if routing is not None:
            logger.print(routing.summary())
            if cfg.train.log_level == "debug":  # each parameter, its optimizer and why
                logger.print(routing.table())
        ns_choice = getattr(self.optimizer, "ns_dtype_choice", None)
        if ns_choice is not None and routing is not None and routing.muon:
            dtype, why = ns_choice
            source = "optim.ns_dtype" if why == "as given" else f"optim.ns_dtype auto: {why}"
            logger.print(f"Muon Newton-Schulz in {dtype} ({source})")
        self.model.train()
        started = time.perf_counter()
        window.restart()
        last: dict = {}
        # rank 0 says the run is alive (`unmask runs`, the page: runs/heartbeat.py)
        heartbeat = Heartbeat(self.output_dir) if self.dist.is_main else None
        ending = "failed"  # what the heartbeat says if train() leaves by an error
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
                    self.progress.tokens_seen += plan.tokens_per_step
                    if heartbeat is not None:
                        heartbeat.beat(self.step)
                    if not self._guard_step(stats, logger):
                        continue
                    window.add(stats, plan.tokens_per_step)  # on the device: no sync
                    at_end = self.step == plan.total_steps
                    if self.deferred.pending and (at_end or any(
                            every and self.step % every == 0 for every in
                            (plan.logging_every, plan.eval_every, plan.save_every))):  # fmt: skip
                        if not self._read_deferred(logger):  # rolled back
                            continue
                    values: dict = {}
                    if self.step % plan.logging_every == 0 or at_end:  # the window is read
                        values.update(
                            window.values(stats),
                            tokens_seen=self.progress.tokens_seen,
                            elapsed_seconds=round(time.perf_counter() - started, 3),
                        )
                        if self.guard.state.skipped_steps:
                            values["skipped_steps"] = self.guard.state.skipped_steps
                        values.update(self.objective.take_log())  # grpo's rollouts
                        if self.moe is not None:  # aux loss, expert load per layer
                            values.update(self.moe.take_log())
                        if window.peak_raised:
                            window.peak_raised = False
                            dtype = matmul_dtype(self.device.type, cfg.train.bf16)
                            logger.print(raise_cached_peak(self.device, dtype, window.peak_flops))
                    logger.advance(self.step, progress_postfix(values))
                    if (plan.eval_every and self.step % plan.eval_every == 0) or at_end:
                        if len(self.eval_rows):
                            values["eval_loss"] = self.progress.eval_loss = self.evaluate()
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
                        ending = "stopped"
                        return last
            with self._lost_peer_stops():  # both gather the sharded model
                self.model = self.checkpointer.save_final(self.model, cfg.model)
                prompt = "..."
                if cfg.eval.generate_accuracy:
                    last["heldout_exact_match"], prompt = self._heldout_accuracy(logger)
            if self.dist.is_main:  # steps, tokens, time, losses, checkpoints, what next
                logger.print(run_summary(self.output_dir, prompt=prompt,
                                         wall_seconds=time.perf_counter() - started))  # fmt: skip
            ending = "finished"
        finally:
            if heartbeat is not None:
                heartbeat.end(ending)
            self._stop_signals = None
            self.objective.close()  # grpo: the rewards' worker processes
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
        checkpoint or stop (guard.py). train.nonfinite_check `logging`: the step's flags are
        kept on the device (`deferred`) and the step counts."""
        if stats["finite"] is None:
            self.deferred.add(self.step, stats["flags"])
            return True
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
        streak = f"steps {state.first_bad_step}-{self.step}"
        why = f"{self.cfg.train.max_bad_steps} in a row, train.max_bad_steps"
        return self._rollback_or_stop(action == "rollback", streak, why, logger)

    def _read_deferred(self, logger) -> bool:
        """train.nonfinite_check `logging`: read the flags of the steps since the last read
        (one sync). A non-finite step among them has updated the weights: roll back to the
        last checkpoint (nan_rollback) or stop. Returns False after a rollback."""
        bad, first, stop = self.deferred.read()
        self.deferred_stop = stop
        if not bad:
            return True
        self.guard.state.first_bad_step = first
        streak = f"{bad} of steps {first}-{self.step}"
        why = ("train.nonfinite_check logging reads the flag after the updates: set it to "
               "step to skip such steps")  # fmt: skip
        return self._rollback_or_stop(self.cfg.train.nan_rollback, streak, why, logger)

    def _rollback_or_stop(self, rollback: bool, streak: str, why: str, logger) -> bool:
        """Back to the last checkpoint with the learning rate times lr_backoff (False), or
        RunStopped naming it."""
        self.checkpointer.wait()  # an async checkpoint in flight is published first
        newest = newest_intact(self.output_dir)[0] if self.dist.is_main else None
        newest = share_from_rank0(lambda: newest)
        if rollback and newest is not None:
            scale = self.guard.rolled_back()
            self._restore(newest)
            self.guard.state.lr_scale = scale  # the restore brought back the older scale
            self._scale_lr(scale)
            logger.rewind(self.step)
            logger.print(f"{streak} were non-finite: back to {newest.name}, learning rate "
                         f"x {scale:g} (train.lr_backoff)")  # fmt: skip
            return False
        raise RunStopped(
            f"{streak} had a non-finite loss or gradient norm ({why}); the last good "
            f"checkpoint is {newest or 'none (no checkpoint yet)'}: resume from it with a "
            "lower optim.learning_rate, or set train.nan_rollback=true"
        )

    def _stop_requested(self, stop: StopSignals, stats: dict) -> bool:
        """A stop signal reached any rank (every rank decides the same, at the same step).
        Several processes: the flag train_step summed over ranks with the loss and read with
        the guard's, so asking costs no collective and no sync of its own."""
        if not self.sharded:
            return stop.requested
        if stats["finite"] is None:  # nonfinite_check logging: at the flags' read only
            requested, self.deferred_stop = self.deferred_stop, False
            return requested
        return stats["stop"]

    def _stop(self, stop: StopSignals, logger, saved: bool) -> None:
        if self.deferred.pending:  # nonfinite_check logging: no checkpoint of a bad update
            bad, first, _ = self.deferred.read()
            if bad:
                self._rollback_or_stop(False, f"{bad} of steps {first}-{self.step}",
                                       "read as the run stopped", logger)  # fmt: skip
        if not saved:
            self.save()
        self.stopped_by = stop.name or "a signal on another rank"
        self.exit_code = stop.exit_code
        logger.print(
            f"stopped by {self.stopped_by} at step {self.step}; checkpoint-{self.step} is saved. "
            f"{_sentence(resume_advice(self.resume_command))}"
        )

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
            f"{self.plan.total_steps} steps on {self.device}{self.dist.dims.describe()} | {start} | "
            f"output_dir {self.output_dir}"
        )


def _millions(count: int) -> str:
    """A parameter count in millions: two decimals, or two significant digits below 0.01M."""
    return f"{count / 1e6:.2f}M" if count >= 10_000 else f"{count / 1e6:.2g}M"


def _sentence(text: str) -> str:
    """text with its first letter in upper case (the rest unchanged)."""
    return text[:1].upper() + text[1:]
