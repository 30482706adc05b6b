"""What the trainer measures beside training: the eval loss on held-out rows with fixed
noise (at eval_steps and the end) and, after the final save, the exact match of greedy
answers to held-out prompts (eval.generate_accuracy)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import torch

from unmask.data import eval_batches
from unmask.diffusion import Objective
from unmask.parallel.context import pad_rows
from unmask.parallel.pipeline import capture_call
from unmask.sampling.accuracy import heldout_accuracy
from unmask.sampling.generation_file import fixed_by_training
from unmask.train.metrics import MetricsLogger
from unmask.train.setup import objective_heldout
from unmask.train.step import autocast, to_device, with_images

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from transformers import PreTrainedTokenizerBase

    from unmask.config import RunConfig
    from unmask.data import RowStore
    from unmask.parallel.context import ContextShard
    from unmask.parallel.distributed import DistState
    from unmask.parallel.pipeline import PipelineRunner


class Evaluation:
    """The Trainer's evaluation, a part of the Trainer that reads the attributes declared
    below (tests/unit/test_trainer_parts.py)."""

    cfg: RunConfig
    dist: DistState
    device: torch.device
    context: ContextShard | None
    model: torch.nn.Module
    objective: Objective
    pipeline: PipelineRunner | None
    eval_rows: RowStore | None
    tokenizer: PreTrainedTokenizerBase
    output_dir: Path
    step: int

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
            batch = with_images(self._eval_noise(to_device(batch, self.device), index * size))
            if self.context is not None:  # this rank's slice of the rows (noise drawn)
                batch = self.context.shard_batch(pad_rows(batch, self.context.size))
            with autocast(self.device, self.cfg.train.bf16):
                if self.pipeline is not None:  # the objective's call through the stages
                    call, count = capture_call(self._eval_objective, batch, noise, False)
                    loss_sum = self.pipeline.forward_loss(call)
                else:
                    loss_sum, count = self._eval_objective(self.model, batch, noise)
            loss_sum_total += loss_sum.detach().double()  # on the device: one read at the end
            count_total += count.detach().double()
        if self.context is not None:  # the slices' sums: every cp rank gets the rows' total
            loss_sum_total, count_total = self.context.sum(loss_sum_total, count_total)
        if self.pipeline is not None:  # the last stage's sum, to every stage
            loss_sum_total = self.pipeline.sum_over_stages(loss_sum_total).double()
        self.model.train(was_training)
        return float(loss_sum_total / count_total.clamp(min=1.0))

    @property
    def _eval_objective(self) -> Objective:
        """What eval_loss measures: the objective's own `eval_objective` when it has one
        (grpo: the masked-diffusion loss of the held-out answers), else the objective."""
        return self.objective.eval_objective or self.objective

    def _eval_noise(self, batch: dict, first_row: int) -> dict:
        """The eval batch with each row's noise drawn from its own generator, seeded by the
        row's index; unchanged for objectives that draw for the whole batch."""
        objective = self._eval_objective
        if not objective.global_noise:
            return batch
        generator = torch.Generator(device=self.device)
        drawn = []
        for row in range(batch["input_ids"].shape[0]):
            generator.manual_seed(self.cfg.train.seed + 54321 + first_row + row)
            one = {k: v[row : row + 1] for k, v in batch.items()}
            drawn.append(objective.with_noise(one, generator))
        added = [k for k in drawn[0] if k not in batch]
        return {**batch, **{k: torch.cat([d[k] for d in drawn]) for k in added}}

    def _heldout_accuracy(self, logger: MetricsLogger) -> tuple[float, str]:
        """Exact match of greedy answers to held-out prompts (the objective's own, such as
        preference's pairs, or the data's); and one prompt, for the end-of-run summary's
        `unmask generate` line."""
        examples = objective_heldout(self.cfg, self.tokenizer)
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
