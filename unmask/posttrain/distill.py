"""Step distillation (`diffusion.objective: distill`, section `distill:`): a student learns
to decode in fewer forwards from a frozen teacher DLM's own answers.

Each step the teacher (distill.teacher, a model folder) answers the batch's prompts with
its sampler (its generation_config.json, with `history`), and the student trains on the
teacher's answers instead of the data's:

- `certainty_forcing` (dParallel): the masked-diffusion loss on the teacher's tokens
  (mask each answer token with probability t, cross-entropy weighted 1 / t) plus
  `entropy_weight` x the entropy of the student's distribution at the masked positions
  it already predicts right (argmax = the teacher's token), which pushes those to high
  confidence so a threshold sampler commits many of them in one forward;
- `trajectory` (d3LLM): the student's inputs are the teacher's own intermediate canvases:
  a step k of the teacher's decode is drawn per row and the tokens the teacher had not
  committed by then are masked; the loss is the cross-entropy on them (the teacher's
  decoding order, learned as it decoded).

loss_sum sums the terms, count = the answer tokens. The student samples with a confidence
threshold (`fixed_sampling`: STUDENT_THRESHOLD; --threshold changes it). Rows must be one prompt/answer pair each
(data.packing: false), the teacher's tokenizer must be the run's, and a teacher that
samples with the logit shift needs `diffusion.logit_shift: true` (the student is trained
and sampled shifted too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from unmask.data.tokenizer import load_local_tokenizer
from unmask.diffusion.adaptation import AdaptedModel
from unmask.diffusion.loss import IGNORE_INDEX
from unmask.diffusion.objectives import Objective, ObjectiveOutput, maskable_of
from unmask.diffusion.registry import ObjectiveContext, ObjectiveSpec, register_objective
from unmask.errors import InputError
from unmask.models import from_pretrained
from unmask.sampling.config import resolve_sampling
from unmask.sampling.generate import sample
from unmask.sampling.generation_file import saved_sampling

STUDENT_THRESHOLD = 0.9
"""The confidence threshold a distilled student samples with (dParallel, d3LLM: 0.9)."""


class DistillConfig(BaseModel):
    """`distill:`: diffusion.objective distill's teacher and method."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    teacher: str | None = None
    """The teacher: a model folder unmask samples (final/, checkpoint-N, an exported
    folder) with the run's tokenizer."""
    method: Literal["certainty_forcing", "trajectory"] = "certainty_forcing"
    """`certainty_forcing` (dParallel: teacher answers + an entropy term on the positions
    the student gets right) or `trajectory` (d3LLM: the teacher's intermediate canvases,
    masked in its decoding order)."""
    entropy_weight: float = Field(1.0, ge=0.0)
    """certainty_forcing: weight of the entropy term."""


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """(...,) float32 entropy of softmax(logits) in nats."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def commit_steps(history: list[torch.Tensor], mask_id: int, start: int) -> torch.Tensor:
    """(B, L - start) long: the teacher step (0-based) at which each answer position was
    committed, from the canvases after every step (`GenerationOutput.history`)."""
    canvases = torch.stack([h[:, start:] for h in history])  # (S, B, G)
    filled = canvases != mask_id
    never = len(history)
    first = torch.where(filled.any(0), filled.float().argmax(0), torch.full_like(
        filled[0], never, dtype=torch.long))  # fmt: skip
    return first.long()


class DistillObjective(Objective):
    """See the module doc. teacher: a frozen model; sample_answers(teacher, prompt ids) ->
    (answers (B, G), commit steps (B, G), teacher steps) for one prompt length."""

    global_noise = False

    def __init__(self, cfg: DistillConfig, teacher: nn.Module, sample_answers, mask_id: int,
                 vocab_chunk: int = 8192, shift: bool = False):  # fmt: skip
        self.cfg, self.teacher, self.sample_answers = cfg, teacher, sample_answers
        self.shift = shift
        self.mask_id, self.vocab_chunk = mask_id, vocab_chunk
        self.last_stats: dict[str, torch.Tensor] = {}

    def count(self, batch: dict) -> torch.Tensor:
        return maskable_of(batch).sum().float()

    def teacher_rows(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids with the teacher's answers in the maskable positions, the teacher
        step at which each was committed (B, L), -1 on the prompt)."""
        ids, maskable = batch["input_ids"], maskable_of(batch)
        starts = maskable.float().argmax(1)  # the first answer position of each row
        out, steps = ids.clone(), torch.full_like(ids, -1)
        for start in starts.unique().tolist():
            rows = (starts == start).nonzero().squeeze(1)
            answers, order = self.sample_answers(self.teacher, ids[rows, :start],
                                                 ids.shape[1] - start)  # fmt: skip
            out[rows, start:] = torch.where(maskable[rows, start:], answers, ids[rows, start:])
            steps[rows, start:] = order
        return out, steps

    def __call__(self, model, batch: dict, generator=None) -> ObjectiveOutput:
        maskable = maskable_of(batch)
        with torch.no_grad():
            target_ids, steps = self.teacher_rows(batch)
        b = target_ids.shape[0]
        if self.cfg.method == "trajectory":
            last = steps.masked_fill(~maskable, -1).amax(1).clamp(min=0)  # (B,)
            k = (torch.rand(b, generator=generator, device=target_ids.device) * (last + 1)).long()
            masked = maskable & (steps >= k[:, None])
            weight = torch.ones(b, device=target_ids.device)
        else:
            t = torch.rand(b, generator=generator, device=target_ids.device) * 0.999 + 1e-3
            u = torch.rand(target_ids.shape, generator=generator, device=target_ids.device)
            masked = maskable & (u < t[:, None])
            weight = 1.0 / t
        noisy = target_ids.masked_fill(masked, self.mask_id)
        # a shifted student (the teacher's form): token i read at output i - 1
        caller = AdaptedModel(model, None, shift=True) if self.shift else model
        logits = caller(noisy, doc_ids=batch.get("doc_ids"), position_ids=batch.get("position_ids"))
        ce = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), torch.where(masked, target_ids, IGNORE_INDEX).flatten(),
            reduction="none").view(masked.shape)  # fmt: skip
        loss = (ce * weight[:, None]).masked_fill(~masked, 0.0).sum()
        if self.cfg.method == "certainty_forcing" and self.cfg.entropy_weight > 0:
            right = masked & (logits.argmax(-1) == target_ids)
            loss = loss + self.cfg.entropy_weight * entropy(logits).masked_fill(~right, 0.0).sum()
        count = maskable.sum().float()
        self.last_stats = {"num_masked": masked.sum().detach().float(),
                           "num_maskable": count.detach()}  # fmt: skip
        return ObjectiveOutput(loss, count)


def check_teacher_tokenizer(teacher_folder: str | Path, tokenizer, teacher_tokenizer) -> None:
    """InputError when the teacher's tokenizer is not the run's (the student would learn
    other ids for the same text)."""
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise InputError(
            f"distill.teacher {str(teacher_folder)!r} has a different tokenizer from the run's "
            f"({len(teacher_tokenizer)} vs {len(tokenizer)} tokens or other ids); use a teacher "
            "trained with data.tokenizer as this run's, or set data.tokenizer to the teacher's"
        )


def teacher_sampler(folder: str, row_length: int, mask_id: int, eos_id: int | None):
    """sample_answers(teacher, prompts (B, P), gen) for a teacher folder: its own sampling
    options (generation_config.json) fitted to the row, with the canvas after every step."""
    options = resolve_sampling(saved_sampling(folder)).updated(row_length=row_length,
                                                                history=True)  # fmt: skip

    def sample_answers(teacher, prompts: torch.Tensor, gen: int):
        out = sample(teacher, prompts, options, mask_id=mask_id, eos_id=eos_id)
        start = prompts.shape[1]
        answers = out.sequences[:, start : start + gen]
        return answers, commit_steps(out.history, mask_id, start)[:, :gen]

    return sample_answers


def build_distill(context: ObjectiveContext) -> DistillObjective:
    """The frozen teacher from distill.teacher, sampling as its folder says."""
    run = context.run
    if run is None:
        raise ValueError("diffusion.objective distill is built for a run: pass run=")
    cfg = run.distill
    teacher = from_pretrained(cfg.teacher).eval()
    for param in teacher.parameters():
        param.requires_grad_(False)
    sampler = teacher_sampler(cfg.teacher, run.data.packing_length, context.mask_id,
                              context.eos_id)  # fmt: skip
    return DistillObjective(cfg, teacher, sampler, context.mask_id,
                            context.diffusion.vocab_chunk_size,
                            shift=context.diffusion.shifts_logits)  # fmt: skip


def check_distill_run(run) -> None:
    """A teacher folder, one prompt/answer pair per row."""
    teacher = run.distill.teacher
    if teacher is None:
        raise ValueError("diffusion.objective distill needs distill.teacher: a model folder")
    if not (Path(teacher) / "config.json").is_file():
        raise ValueError(f"distill.teacher {teacher!r} is not a model folder (no config.json); "
                         "give a run's final/ or checkpoint-N")  # fmt: skip
    if run.data.packing:
        raise ValueError("diffusion.objective distill needs one prompt per row: set "
                         "data.packing: false")  # fmt: skip
    shifted = bool(saved_sampling(teacher).get("shift_logits"))
    if shifted != run.diffusion.shifts_logits:
        raise ValueError(
            f"distill.teacher {teacher!r} samples {'with' if shifted else 'without'} the logit "
            f"shift; train the student the same way: set diffusion.logit_shift: "
            f"{str(shifted).lower()}"
        )


def check_teacher_rows(run, tokenizer, rows) -> None:
    """Before the run writes anything: the teacher's tokenizer is the run's."""
    teacher = run.distill.teacher
    check_teacher_tokenizer(teacher, tokenizer, load_local_tokenizer(teacher, "distill.teacher"))


def _student_sampling(diffusion) -> dict:
    """A distilled student decodes by confidence threshold."""
    return {"threshold": STUDENT_THRESHOLD}


register_objective(ObjectiveSpec("distill", build_distill, fixed_sampling=_student_sampling,
                                 check_run=check_distill_run, accepts_logit_shift=True,
                                 check_rows=check_teacher_rows))  # fmt: skip
