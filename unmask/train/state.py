"""The trainer's state in its checkpoints: each part that has state says what it saves and how
it loads it (unmask.checkpoint.state), and `CheckpointedState` collects them for the
Checkpointer at every save and restore.

trainer_state.json: the data loader's position ("loader"), `Progress` (tokens_seen,
eval_loss), `ThreadCount` (num_threads), the non-finite guard ("guard"), `LoraRecord` (a
LoRA run's settings and base fingerprint); rng_state.pt: `RngStates` (torch's global
generator and the noise generator); rank_state/rank-R.pt: `ObjectiveRankState` (the
objective's own state of this rank, with the rows it belongs to). The Checkpointer adds the
step (and the world size of a DCP checkpoint).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from unmask.checkpoint import RunState, Under
from unmask.checkpoint.layout import read_trainer_state
from unmask.diffusion import Objective
from unmask.models import ModelConfig
from unmask.models.lora import (
    LORA_BASE_FILE,
    base_fingerprint,
    base_record,
    check_base_fingerprint,
    check_lora_settings,
    lora_settings,
)
from unmask.train.run_dir import room_for_checkpoint

if TYPE_CHECKING:  # pragma: no cover
    from unmask.checkpoint import Checkpointer
    from unmask.config import RunConfig
    from unmask.parallel.distributed import DistState
    from unmask.train.guard import NonFiniteGuard
    from unmask.train.metrics import MetricsLogger


class Progress:
    """What the loop counts beside the step: tokens trained on, and the last eval loss
    (train.keep_best reads it from each checkpoint's trainer_state.json)."""

    def __init__(self) -> None:
        self.tokens_seen = 0
        self.eval_loss: float | None = None

    def state_dict(self) -> dict:
        return {"tokens_seen": self.tokens_seen, "eval_loss": self.eval_loss}

    def load_state_dict(self, state: dict) -> None:
        self.tokens_seen = state.get("tokens_seen", 0)
        self.eval_loss = state.get("eval_loss")


class ThreadCount:
    """torch's CPU thread count: another count sums in another order, so a resumed run keeps
    the one it was trained with (read at start-up, before the model is built:
    `resumed_thread_count`; loading changes nothing)."""

    def state_dict(self) -> dict:
        return {"num_threads": torch.get_num_threads()}

    def load_state_dict(self, state: dict) -> None:
        return None


def resumed_thread_count(path: Path | None) -> int | None:
    """The thread count checkpoint `path` was trained with (None: no resume, or not saved)."""
    return None if path is None else read_trainer_state(path).get("num_threads")


class RngStates:
    """torch's global generator (dropout, the start-up draws) and the trainer's noise
    generator (masks and noise levels)."""

    def __init__(self, noise: torch.Generator):
        self.noise = noise

    def state_dict(self) -> dict:
        return {"torch": torch.get_rng_state(), "noise": self.noise.get_state()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        self.noise.set_state(state["noise"])


class LoraRecord:
    """A LoRA run's records: its settings (trainer_state.json "lora": a resume with other
    settings is refused) and the fingerprint of the frozen base its adapters need
    ("lora_base_fingerprint" of one-process checkpoints, and lora_base.json in every
    checkpoint, final/ and the adapter folder: models/lora.py). Nothing for other runs,
    but a resume of a LoRA checkpoint without model.lora is refused."""

    def __init__(self, model_cfg: ModelConfig, model: torch.nn.Module, seed: int, sharded: bool):
        self.cfg, self.model, self.seed, self.sharded = model_cfg, model, seed, sharded
        self._fingerprint: list[float] | None = None

    def fingerprint(self) -> list[float] | None:
        """The base weights' fingerprint (one process: computed once, the base is frozen;
        sharded: None, each rank holds a shard)."""
        if self.cfg.lora and not self.sharded and self._fingerprint is None:
            self._fingerprint = base_fingerprint(self.model)
        return self._fingerprint

    def files(self) -> dict[str, str]:
        """lora_base.json for the Checkpointer's run files ({} without LoRA)."""
        if not self.cfg.lora:
            return {}
        record = base_record(self.cfg, self.seed, self.model.config.vocab_size,
                             self.fingerprint())  # fmt: skip
        return {LORA_BASE_FILE: json.dumps(record, indent=2)}

    def state_dict(self) -> dict:
        if not self.cfg.lora:
            return {}
        state = {"lora": lora_settings(self.cfg)}
        if not self.sharded:  # adapter-only checkpoints
            state["lora_base_fingerprint"] = self.fingerprint()
        return state

    def check(self, saved: dict, path: Path) -> None:
        """Before any tensor is read: the same LoRA settings, on the same base."""
        check_lora_settings(saved.get("lora"), self.cfg, path)
        check_base_fingerprint(saved.get("lora_base_fingerprint"), self.model, path)

    def load_state_dict(self, state: dict) -> None:
        return None  # settings, not state: `check` compared them


class ObjectiveRankState:
    """The objective's state of this rank (grpo: its cached rollouts inside a cycle of inner
    iterations) with the layout it belongs to: which rows of which micro-batches the rank
    holds. Restored only into a run that holds the same rows, and that the objective
    accepts; otherwise `say` tells why and the objective starts without it."""

    _NAMES = {"world_size": "processes", "micro_batches": "micro-batches per step",
              "rows": "rows per micro-batch and process"}  # fmt: skip

    def __init__(self, objective: Objective, layout: dict, say: Callable[[str], None],
                 source: Path | None = None):  # fmt: skip
        self.objective, self.layout, self.say, self.source = objective, layout, say, source

    def state_dict(self) -> dict:
        state = self.objective.rank_state()
        return {**self.layout, "objective": state} if state else {}

    def load_state_dict(self, saved: dict) -> None:
        if not saved:  # none written: the objective forgets any (a rollback)
            self.objective.load_rank_state({})
            return
        changed = [
            f"{saved.get(key)} {name} there, {self.layout[key]} here"
            for key, name in self._NAMES.items()
            if saved.get(key) != self.layout[key]
        ]
        why = "; ".join(changed) if changed else self.objective.load_rank_state(saved["objective"])
        if why is None:
            return
        self.objective.load_rank_state({})
        where = Path(self.source).name if self.source is not None else "the checkpoint"
        self.say(f"{where} holds cached rollouts this run cannot reuse ({why}): the next step "
                 "draws fresh ones, so the run differs from an uninterrupted one; resume with "
                 "the settings it was written with to reuse them")  # fmt: skip


class CheckpointedState:
    """The Trainer's saving and restoring, a part of the Trainer that reads the attributes
    declared below (and sets `step` when it resumes; tests/unit/test_trainer_parts.py)."""

    cfg: RunConfig
    dist: DistState
    device: torch.device
    local_batch_size: int
    model: torch.nn.Module
    objective: Objective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    _unscaled_base_lrs: list[float]
    """The schedule's peak learning rates from the config (before a non-finite backoff)."""
    loader: object
    """The training batches (data.make_loader): Stateful, so checkpoints hold its place."""
    noise: torch.Generator
    progress: Progress
    guard: NonFiniteGuard
    lora: LoraRecord
    checkpointer: Checkpointer
    logger: MetricsLogger | None
    notices: list[str]
    step: int

    def _run_state(self, source: Path | None = None) -> RunState:
        """The parts with state, as they are now (a test may swap the loader or objective)."""
        layout = {"world_size": self.dist.world_size, "rank": self.dist.rank,
                  "micro_batches": self.cfg.train.gradient_accumulation_steps,
                  "rows": self.local_batch_size}  # fmt: skip
        return RunState(
            trainer=[
                Under("loader", self.loader),
                self.progress,
                ThreadCount(),
                Under("guard", self.guard, required=False),
                self.lora,
            ],  # fmt: skip
            rng=[RngStates(self.noise)],
            rank=[ObjectiveRankState(self.objective, layout, self._say, source)],
            checks=[self.lora.check],
        )

    def _restore(self, path: Path) -> None:
        self.step = self.checkpointer.restore(path, self.model, self.optimizer, self.scheduler,
                                              self._run_state(path), self.device)  # fmt: skip
        self._scale_lr(self.guard.state.lr_scale)

    def save(self) -> Path | None:
        """checkpoint-{step}; None when the disk cannot hold it and train.on_disk_full is
        continue (else RunStopped)."""
        notice = room_for_checkpoint(self.checkpointer, self.model, self.optimizer,
                                     self.cfg.train.on_disk_full, self.step)  # fmt: skip
        if notice:
            if self.logger is not None:
                self.logger.print(notice)
            return None
        return self.checkpointer.save_state(self.step, self.model, self.optimizer,
                                            self.scheduler, self._run_state())  # fmt: skip

    def _scale_lr(self, scale: float) -> None:
        """Learning rates = the schedule's times `scale` (the non-finite guard's backoff)."""
        sched = self.scheduler  # a LambdaLR: lr = base_lr * lambda(step)
        sched.base_lrs = [lr * scale for lr in self._unscaled_base_lrs]
        for group, lr, factor in zip(self.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = lr * factor(sched.last_epoch)

    def _say(self, line: str) -> None:
        """A line during train() (a rollback) on the log; before it, a start-up notice."""
        if self.logger is not None:
            self.logger.print(line)
        else:
            self.notices.append(line)
