"""One optimizer step: micro-batches -> the objective -> (loss_sum, count) -> backward ->
global normalization -> clip -> the non-finite flag -> optimizer and schedule.

The loss is normalized once, globally: by the objective's count summed over micro-batches
and ranks (docs/architecture.md, Contracts: Objective). A multi-process run draws the noise
an objective asks for (`global_noise`) for the whole global batch and keeps its rows, so
losses do not depend on the world size.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from unmask.data.images import IMAGE_KEYS
from unmask.diffusion.cutoffs import random_length_cut
from unmask.models.diffusion_gemma_vision import Images
from unmask.models.moe import step_casts
from unmask.parallel.batch import rank_generator
from unmask.parallel.context import pad_rows
from unmask.parallel.distributed import all_reduce_sum, clip_grad_norm
from unmask.parallel.fsdp import sync_gradients
from unmask.parallel.pipeline import capture_call

if TYPE_CHECKING:  # pragma: no cover
    from unmask.config import RunConfig
    from unmask.diffusion import Objective
    from unmask.parallel.context import ContextShard
    from unmask.parallel.distributed import DistState
    from unmask.parallel.pipeline import PipelineRunner
    from unmask.train.mfu import CallFlops, DeviceTimer
    from unmask.train.qk_clip import QKClip
    from unmask.train.signals import StopSignals


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def with_images(batch: dict) -> dict:
    """A gathered batch with its rows' pictures (data/images.py `image_pixels`,
    `image_positions`) turned into the model's `images`: every picture of the batch in row
    order (none: no `images`). Other batches unchanged."""
    if IMAGE_KEYS[0] not in batch:
        return batch
    out = {k: v for k, v in batch.items() if k not in IMAGE_KEYS}
    pixels, positions = batch["image_pixels"], batch["image_positions"]
    real = (positions != -1).any(dim=-1).any(dim=-1)  # (B, M) slots holding a picture
    if bool(real.any()):
        out["images"] = Images(pixels[real], positions[real])
    return out


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast of the forward when train.bf16 (a no-op context otherwise)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


class TrainStep:
    """The Trainer's step, a part of the Trainer that reads the attributes declared below
    (the Trainer sets each in its constructor; tests/unit/test_trainer_parts.py checks
    that nothing else is read and that a built Trainer has them all)."""

    cfg: RunConfig
    dist: DistState
    device: torch.device
    context: ContextShard | None
    """Context parallelism: this rank's slice of each row (None: whole rows)."""
    sharded: bool
    """Several processes (FSDP2 / a mesh)."""
    local_batch_size: int
    noise: torch.Generator
    objective: Objective
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    pipeline: PipelineRunner | None
    qk_clip: QKClip | None
    """optim.qk_clip_threshold: the capture and the clip after the optimizer step."""
    flops: CallFlops | None
    timer: DeviceTimer
    step: int
    _stop_signals: StopSignals | None

    def _rank_noise(self, batch: dict, where: tuple[int, int]) -> tuple[dict, torch.Generator]:
        """This rank's micro-batch with the noise its objective uses, and the generator.
        An objective with `global_noise` draws the randomness of the whole global batch
        from the generator every rank holds in the same state and keeps this rank's rows:
        a row gets the noise it would get in a one-process run of the same global batch,
        so losses do not depend on the world size. Other objectives draw on their own rows
        from a generator seeded by (seed, where = (step, micro-batch), rank)."""
        if self.objective.global_noise:
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

    def _once(self, value: torch.Tensor, pp_rank: int = 0) -> torch.Tensor:
        """value on tp rank 0 of pipeline rank `pp_rank`, zero on its tp and pp peers: they
        computed the same count from the same rows (the loss: only the last stage has it),
        which a sum over all ranks must count once."""
        once = self.dist.tp_rank == 0 and self.dist.pp_rank == pp_rank
        return value if once else torch.zeros_like(value)

    def _prepared(self, batch: dict) -> dict:
        """A micro-batch on the device, cut to LLaDA's random length (seeded by the step, so
        every rank and micro-batch cuts alike); its rows' pictures (data/images.py) as the
        model's `images`."""
        batch = with_images(to_device(batch, self.device))
        return random_length_cut(
            batch, self.cfg.diffusion.random_length_prob, self.cfg.train.seed, self.step
        )

    def _count_before_forward(self, batches: list[dict]) -> torch.Tensor | None:
        """The step's normalizer (the objective's count summed over micro-batches and ranks)
        before any forward, when the objective can say it from the batches alone
        (`count(batch)`; Dream's cutoffs cannot); else None."""
        counts = [self.objective.count(batch) for batch in batches]
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
        `learning_rate`, `qk_max_logit` and `qk_clipped_heads` (optim.qk_clip_threshold),
        `flops` (train.log_mfu: this device's model FLOPs, mfu.py; a 0-d
        tensor) and `finite` (bool): the step's one host-device sync, the flag the non-finite
        guard needs to skip the update. In a multi-process run the same read carries `stop`
        (a stop signal reached some rank), summed in the loss's all-reduce. With
        train.nonfinite_check `logging` nothing is read: `finite` is None, `flags` the device
        tensor of both (the trainer reads them with the log window) and the update runs."""
        batches = [self._prepared(batch) for batch in batches]
        if self.context is not None:
            batches = [self._context_slice(batch) for batch in batches]
        self.objective.begin_step(self.step)  # grpo: inner iterations reuse rollouts
        # a stop signal on any rank: reduced with the loss, read with the guard's flag
        requested = self._stop_signals is not None and self._stop_signals.requested
        stop = torch.full((), float(requested), device=self.device)
        count_total = self._count_before_forward(batches)
        scale = None if count_total is None else 1.0 / count_total.clamp(min=1.0)
        loss_sum_total = torch.zeros((), device=self.device)
        counted = torch.zeros((), device=self.device)
        flops = 0.0
        sums: dict[str, torch.Tensor] = {}  # the objective's `step_sums` (preference)
        loss_holder = 0  # the pipeline rank whose loss counts (under PP: the last stage's)
        with step_casts():  # autocast's copies of the expert stacks: once for the step
            if self.pipeline is not None:  # the objective's calls, run through the stages
                loss_sum_total = self._pipeline_micro_batches(batches, scale)
                loss_holder = self.pipeline.plan.degree - 1
                batches = []
            for index, batch in enumerate(batches):
                noise = self.noise
                if self.sharded:
                    batch, noise = self._rank_noise(batch, (self.step, index))
                    sync_gradients(self.model, index == len(batches) - 1)
                with autocast(self.device, self.cfg.train.bf16):
                    loss_sum, count = self.objective(self.model, batch, noise)
                (loss_sum if scale is None else loss_sum * scale).backward()
                for key, value in self.objective.step_sums.items():
                    sums[key] = sums.get(key, 0.0) + value
                loss_sum_total += loss_sum.detach().float()
                counted += count.detach().float()
                if self.flops is not None:  # of the forwards the objective ran (CallFlops)
                    flops = flops + self.flops.take()
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
            loss_sum_total, stop = all_reduce_sum(self._once(loss_sum_total, loss_holder), stop)
        # the global gradient norm (clipped to max_grad_norm when set): also the guard's
        max_norm = self.cfg.optim.max_grad_norm if self.cfg.optim.max_grad_norm > 0 else math.inf
        stages = None if self.pipeline is None else self.pipeline.group  # norms of every stage
        grad_norm = clip_grad_norm(self.model.parameters(), max_norm, across=stages)
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
        if self.cfg.train.nonfinite_check == "logging":  # read later, with the log window
            stats["flags"] = flags.reshape(-1)
            stats["finite"] = None
        else:
            read = flags.reshape(-1).tolist()  # the one sync of a step: the guard needs it
            stats["finite"] = read[0]
            if self.sharded:
                stats["stop"] = read[1]
        if stats["finite"] is not False:  # a non-finite step changes nothing: no update
            started = self.timer.mark()
            self.optimizer.step()
            self.scheduler.step()
            stats["optimizer_marks"] = (started, self.timer.mark())  # model-only MFU
        if self.qk_clip is not None:  # QK-clip: after the update (the capture reset if none)
            stats.update(self.qk_clip.after_step(update=stats["finite"] is not False))
        self.optimizer.zero_grad(set_to_none=True)
        return stats

    def _pipeline_micro_batches(self, batches: list[dict], scale: torch.Tensor | None):
        """Pipeline parallelism: each micro-batch's noise drawn as in `_rank_noise`, the
        objective's model call recorded (parallel/pipeline.py: capture_call), and the step's
        calls run through the stages with each loss times `scale` (1 / the step's global
        count, known before the forward: the objectives PP accepts say it). Returns the
        weighted loss sum on the last stage's ranks (0 elsewhere)."""
        if scale is None:  # refused at start-up (check_pipeline_request)
            raise RuntimeError("pipeline parallelism needs the count before the forward")
        calls = []
        for index, batch in enumerate(batches):
            batch, noise = self._rank_noise(batch, (self.step, index))
            call, _ = capture_call(self.objective, batch, noise, training=True)
            calls.append(call)
        with autocast(self.device, self.cfg.train.bf16):
            return self.pipeline.train_step(calls, scale)

    def _step_means(self, sums: dict, scale: torch.Tensor) -> dict:
        """The objective's per-step sums over micro-batches (and ranks) times 1 / count."""
        stacked = torch.stack([torch.as_tensor(v, device=self.device).float()
                               for v in sums.values()])  # fmt: skip
        if self.sharded:
            (stacked,) = all_reduce_sum(stacked)
        return dict(zip(sums, stacked * scale))
