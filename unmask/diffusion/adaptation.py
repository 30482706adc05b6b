"""Adapting an autoregressive checkpoint into a DLM (A2D): `diffusion.adaptation` and
`diffusion.block_schedule` (docs/adaptation.md).

- `attention: instant` switches the causal model to bidirectional attention at step 0
  (RND1); `anneal` opens the causal mask over `anneal_steps` (DiffuLLaMA / DiffuGPT):
  at step s every future key is visible with probability min(1, s / anneal_steps), drawn
  per step from a generator seeded by (train.seed, s), so a resumed run draws the masks
  the uninterrupted one drew.
- `shift: true` predicts token i from the output at i - 1 (Dream, DiffuLLaMA): the AR
  model's next-token head is reused as it is, and the adapted model samples with the shift.
- `block_schedule` (LLaDA2.0's warm-up, stable, decay): the bd3lm block size as a
  function of the step: warm-up sizes growing towards the row, the whole row (one block:
  MDLM) while stable, then decay sizes down to the small block the model samples with.

Every one of them is a function of the step, so resuming anywhere in an anneal or a
schedule equals the uninterrupted run (tests/integration/test_adaptation_train.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from unmask.diffusion.adaptation_config import AdaptationConfig, BlockSchedule
from unmask.diffusion.cutoffs import document_starts
from unmask.diffusion.objectives import maskable_of
from unmask.diffusion.registry import (
    ObjectiveContext,
    register_objective_wrapper,
    register_run_check,
)


def open_fraction(step: int, anneal_steps: int) -> float:
    """The share of future keys visible at step `step` of an anneal (1 after it)."""
    return 1.0 if anneal_steps <= 0 else min(1.0, step / anneal_steps)


def annealed_mask(length: int, fraction: float, seed: int, step: int, device=None):
    """(1, 1, L, L) bool, True = may attend: the causal mask with each future key made
    visible with probability `fraction` (DiffuLLaMA's annealed mask), drawn on the CPU from
    a generator seeded by (seed, step): every rank and micro-batch of a step, and a resumed
    run, draw the same. fraction 1 is full attention (None is returned: no mask)."""
    if fraction >= 1.0:
        return None
    index = torch.arange(length)
    causal = index[None, :] <= index[:, None]
    generator = torch.Generator().manual_seed(int(seed) * 1_000_033 + int(step) + 7)
    opened = torch.rand((length, length), generator=generator) < fraction
    return (causal | opened)[None, None].to(device)


def block_causal_mask(blocks: torch.Tensor) -> torch.Tensor:
    """(B, 1, L, L) bool from block indices (B, L) (or (L,) for every row): a query sees
    keys of its own block and the blocks before ("staircase" attention)."""
    if blocks.dim() == 1:
        blocks = blocks[None]
    return (blocks[:, None, :] <= blocks[:, :, None])[:, None]


class AdaptedModel:
    """The model as an adapting objective calls it: with the step's attention mask added to
    every forward and, under the shift, targets (and weights) moved one position left so
    that output i - 1 is scored against token i (logits are moved one right)."""

    def __init__(self, model, mask: torch.Tensor | None, shift: bool):
        self.model, self.mask, self.shift = model, mask, shift
        self.accepts_target_weights = getattr(model, "accepts_target_weights", False)
        self.training = getattr(model, "training", True)

    def __call__(self, input_ids, targets=None, target_weights=None, attention_mask=None,
                 **kwargs):  # fmt: skip
        mask = self.mask
        if attention_mask is not None:
            mask = attention_mask if mask is None else attention_mask & mask
        if mask is not None:
            kwargs["attention_mask"] = mask
        if targets is not None and self.shift:
            targets = _ahead(targets, -100)
            if target_weights is not None:
                target_weights = _ahead(target_weights, 0.0)
        if targets is None:
            logits = self.model(input_ids, **kwargs)
            return torch.cat([logits[:, :1], logits[:, :-1]], dim=1) if self.shift else logits
        if target_weights is not None:
            kwargs["target_weights"] = target_weights
        out = self.model(input_ids, targets=targets, **kwargs)
        if self.shift and target_weights is None:  # per-token losses back in place
            return torch.cat([out.new_zeros(out.shape[0], 1), out[:, :-1]], dim=1)
        return out


def _ahead(values: torch.Tensor, fill) -> torch.Tensor:
    """values[:, i + 1] at column i; the last column gets fill."""
    out = torch.full_like(values, fill)
    out[:, :-1] = values[:, 1:]
    return out


class AdaptingObjective:
    """A masked-diffusion objective run on an adapting model (`diffusion.adaptation`): the
    inner objective's noise, loss and count, with the step's annealed attention mask and
    the shift (under which document starts are never masked: nothing predicts them)."""

    def __init__(self, inner, adaptation: AdaptationConfig, seed: int):
        self.inner, self.adaptation, self.seed = inner, adaptation, seed
        self.step = 0
        self.global_noise = inner.global_noise

    def __getattr__(self, name):  # every other hook: the inner objective's
        return getattr(self.inner, name)

    def begin_step(self, step: int) -> None:
        self.step = step
        self.inner.begin_step(step)

    def _batch(self, batch: dict) -> dict:
        if not self.adaptation.shift:
            return batch
        return {**batch, "maskable": maskable_of(batch) & ~document_starts(batch)}

    def count(self, batch: dict):
        return self.inner.count(self._batch(batch))

    def with_noise(self, batch: dict, generator=None, rows=None) -> dict:
        return self.inner.with_noise(self._batch(batch), generator, rows)

    def mask(self, length: int, device) -> torch.Tensor | None:
        """The step's attention mask (None: full attention)."""
        a = self.adaptation
        if a.attention == "instant":
            return None
        fraction = open_fraction(self.step, a.anneal_steps)
        return annealed_mask(length, fraction, self.seed, self.step, device)

    def __call__(self, model, batch: dict, generator=None):
        batch = self._batch(batch)
        mask = self.mask(batch["input_ids"].shape[1], batch["input_ids"].device)
        return self.inner(AdaptedModel(model, mask, self.adaptation.shift), batch, generator)


class ScheduledBlocks:
    """bd3lm under `diffusion.block_schedule`: the block size of each step from the
    schedule (the inner objective reads `cfg.block_size`; its copy of the config is
    replaced at each step)."""

    def __init__(self, inner, schedule: BlockSchedule, row_length: int):
        self.inner, self.schedule, self.row_length = inner, schedule, row_length
        self.global_noise = inner.global_noise
        self.begin_step(0)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def begin_step(self, step: int) -> None:
        size = self.schedule.block_size(step, self.row_length)
        self.inner.cfg = self.inner.cfg.model_copy(update={"block_size": size})
        self.inner.begin_step(step)

    def __call__(self, model, batch: dict, generator=None):
        return self.inner(model, batch, generator)


# -- checks of the run -------------------------------------------------------------------


def is_causal_folder(folder: str | Path) -> bool | None:
    """Whether a model folder holds a causal LM: an unmask `ar` run's folder
    (generation_config.json says autoregressive) or a transformers *ForCausalLM folder of a
    decoder family that unmask has not turned into a DLM (config.json without unmask's
    tag; Dream and LLaDA folders are DLMs). None when the folder cannot be read (the model
    loader reports that)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    generation = folder / "generation_config.json"
    if generation.is_file():
        try:
            saved = json.loads(generation.read_text()).get("unmask") or {}
        except (json.JSONDecodeError, AttributeError):
            saved = {}
        if isinstance(saved, dict) and saved.get("autoregressive"):
            return True
    if "unmask" in config:  # written by unmask and not an ar run: a DLM
        return False
    architectures = config.get("architectures") or [""]
    return config.get("model_type") in ("qwen3", "qwen2", "llama") and str(
        architectures[0]
    ).endswith("ForCausalLM")


ENCODERS = ("bert", "modernbert")


def check_adaptation_run(run) -> None:
    """ValueError (one line) for an adaptation the run cannot do: shift on an encoder
    family, no causal model.pretrained, an anneal longer than the run, a block schedule
    without bd3lm or longer than the run."""
    diffusion = run.diffusion
    adaptation, schedule = diffusion.adaptation, diffusion.block_schedule
    max_steps = run.train.max_steps
    if adaptation is not None:
        if adaptation.shift and run.model.model_type in ENCODERS:
            raise ValueError(
                f"diffusion.adaptation.shift needs a decoder family that predicts the next "
                f"token (qwen3_dllm, qwen2_dllm, llama_dllm); {run.model.model_type!r} is an "
                "encoder: set adaptation.shift=false"
            )
        if run.model.pretrained is None:
            raise ValueError(
                "diffusion.adaptation adapts a causal checkpoint: set model.pretrained to an HF "
                "Qwen3 / Qwen2 / Llama causal folder or an unmask ar run's final/"
            )
        if is_causal_folder(run.model.pretrained) is False:
            raise ValueError(
                f"diffusion.adaptation needs a causal model.pretrained; "
                f"{run.model.pretrained!r} is not one (a DLM or an encoder): give an "
                "HF *ForCausalLM folder or an unmask ar run's final/, or drop diffusion.adaptation"
            )
        if adaptation.attention == "anneal" and 0 < max_steps < adaptation.anneal_steps:
            raise ValueError(
                f"diffusion.adaptation.anneal_steps ({adaptation.anneal_steps}) is longer than "
                f"the run (train.max_steps {max_steps}); lower anneal_steps or raise max_steps"
            )
        if run.parallel.context_parallel > 1 and adaptation.attention == "anneal":
            raise ValueError("an annealed mask is an explicit one, which context parallelism "
                             "does not take: set parallel.context_parallel=1")  # fmt: skip
    if schedule is not None and 0 < max_steps <= schedule.length():
        raise ValueError(
            f"diffusion.block_schedule reaches its last block size at step {schedule.length()}, "
            f"after the run ends (train.max_steps {max_steps}); shorten the schedule"
        )


def adapted(context: ObjectiveContext, objective):
    """The registry's wrapper: the objective under the run's adaptation or block schedule
    (unchanged without either)."""
    diffusion, run = context.diffusion, context.run
    seed = run.train.seed if run is not None else 0
    if getattr(diffusion, "adaptation", None) is not None:
        objective = AdaptingObjective(objective, diffusion.adaptation, seed)
        if run is not None:
            context.notices.append(adaptation_line(run))
    if getattr(diffusion, "block_schedule", None) is not None:
        length = run.data.packing_length if run is not None else diffusion.block_size
        objective = ScheduledBlocks(objective, diffusion.block_schedule, length)
        context.notices.append(
            f"block schedule: bd3lm blocks of {diffusion.block_schedule.describe()}"
        )
    return objective


def adaptation_line(run) -> str:
    """The start-up line that names what is adapted: the causal checkpoint, how the
    attention opens and whether logits shift."""
    adaptation = run.diffusion.adaptation
    attention = adaptation.attention
    if attention == "anneal":
        attention = f"annealed over {adaptation.anneal_steps} steps"
    shift = "on" if adaptation.shift else "off"
    return (
        f"adapting {run.model.pretrained} (a causal checkpoint): attention {attention}, "
        f"logit shift {shift}"
    )


register_objective_wrapper(adapted)
register_run_check(check_adaptation_run)
