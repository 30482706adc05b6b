"""The non-finite guard: a step whose loss or gradient norm is NaN or infinite is skipped
(parameters, optimizer state and learning-rate schedule unchanged), logged and counted;
after `max_bad_steps` such steps in a row the run stops, or, with `nan_rollback`, goes back
to its last checkpoint with the learning rate scaled by `lr_backoff` (LLaDA's own run was
saved that way at 1.2T tokens). Every rank sees the same loss sum and gradient norm (both
are reduced over ranks), so every rank takes the same decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GuardState:
    """What the guard has seen, saved in every checkpoint's trainer_state.json."""

    skipped_steps: int = 0  # in the whole run
    in_a_row: int = 0
    first_bad_step: int = 0  # of the current streak
    lr_scale: float = 1.0  # the product of lr_backoff over rollbacks

    def to_dict(self) -> dict:
        return dict(vars(self))


class NonFiniteGuard:
    """Decides, after each step, whether it counted, and what to do after bad ones."""

    def __init__(self, max_bad_steps: int, nan_rollback: bool, lr_backoff: float):
        self.max_bad_steps, self.nan_rollback = max_bad_steps, nan_rollback
        self.lr_backoff = lr_backoff
        self.state = GuardState()

    def state_dict(self) -> dict:
        """What it has seen (every checkpoint's trainer_state.json "guard")."""
        return self.state.to_dict()

    def load_state_dict(self, saved: dict | None) -> None:
        """A checkpoint's state; None (a checkpoint from before the guard): a fresh one."""
        self.state = GuardState(**(saved or {}))

    def record(self, step: int, finite: bool) -> str:
        """'ok', 'skip' (this step did not count), or, after max_bad_steps bad steps in a
        row, 'rollback' (nan_rollback) or 'stop'."""
        if finite:
            self.state.in_a_row = 0
            return "ok"
        self.state.skipped_steps += 1
        if self.state.in_a_row == 0:
            self.state.first_bad_step = step
        self.state.in_a_row += 1
        if self.state.in_a_row < self.max_bad_steps:
            return "skip"
        return "rollback" if self.nan_rollback else "stop"

    def rolled_back(self) -> float:
        """After a rollback: the streak ends and the learning rate scales by lr_backoff;
        returns the new total scale."""
        self.state.in_a_row = 0
        self.state.lr_scale *= self.lr_backoff
        return self.state.lr_scale


class DeferredFlags:
    """train.nonfinite_check `logging`: each step's flags (finite, and under several
    processes a stop signal on some rank) kept on the device and read together, once, at
    the trainer's next log line, evaluation or checkpoint."""

    def __init__(self) -> None:
        self.bad: torch.Tensor | None = None  # non-finite steps since the last read
        self.first: torch.Tensor | None = None  # the first of them (0: none)
        self.stop: torch.Tensor | None = None
        self.since = 0  # the first step since the last read

    @property
    def pending(self) -> bool:
        return self.bad is not None

    def add(self, step: int, flags: torch.Tensor) -> None:
        """A step's flags: [finite] or [finite, stop] (0-d bools, on the device)."""
        bad = (~flags[0]).to(torch.int64)
        stop = flags[1] if flags.numel() > 1 else torch.zeros_like(flags[0])
        if self.bad is None:
            self.bad, self.first, self.stop, self.since = bad, bad * step, stop, step
            return
        self.first = torch.where((self.first == 0) & (bad > 0), bad * step, self.first)
        self.bad = self.bad + bad
        self.stop = self.stop | stop

    def read(self) -> tuple[int, int, bool]:
        """(non-finite steps, the first of them, stop) since the last read: the one sync."""
        bad, first, stop = torch.stack([self.bad, self.first, self.stop.to(torch.int64)]).tolist()
        self.bad = self.first = self.stop = None
        return bad, first, bool(stop)
