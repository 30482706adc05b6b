"""Faults the reliability tests inject into a real Trainer, and the oracles they are
compared with."""

from unmask.diffusion import Objective
from unmask.train.trainer import Trainer


class NonFiniteAt(Objective):
    """The objective, with a NaN loss at the given steps (the trainer's step counter); with
    once=True only the first time a step is computed (a rollback computes it again); with
    rank=r only on that rank."""

    def __init__(
        self, trainer: Trainer, steps: set[int], once: bool = False, rank: int | None = None
    ):
        self.trainer, self.inner, self.steps = trainer, trainer.objective, set(steps)
        self.once = once
        if rank is not None and rank != trainer.dist.rank:  # only that rank goes bad
            self.steps = set()
        self.global_noise = self.inner.global_noise

    def __call__(self, model, batch, generator=None):
        loss_sum, count = self.inner(model, batch, generator)
        step = self.trainer.step + 1  # the step being computed
        if step in self.steps:
            loss_sum = loss_sum * float("nan")
            if self.once:
                self.steps.discard(step)
        return loss_sum, count

    def with_noise(self, *args, **kwargs):
        return self.inner.with_noise(*args, **kwargs)

    def count(self, batch):
        return self.inner.count(batch)


def skipping_reference(trainer: Trainer, steps: set[int]) -> None:
    """The oracle: a run whose optimizer and schedule do not move at `steps` (the batches
    and the noise are drawn as usual)."""
    real = trainer.train_step

    def train_step(batches):
        if trainer.step + 1 not in steps:
            return real(batches)
        trainer.optimizer.step = trainer.scheduler.step = lambda *args, **kwargs: None
        try:
            return real(batches)
        finally:
            del trainer.optimizer.step, trainer.scheduler.step

    trainer.train_step = train_step
