"""Pipeline schedules by name: `ScheduleSpec` (what the trainer, `unmask plan` and the
memory model read of a schedule) and the registry parallel.pipeline_schedule is validated
against (config/parallel.py reads it without importing the pipeline's runtime,
parallel/pipeline.py). A plug-in adds a schedule with `register_schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass

from unmask.errors import InputError


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule: everything the trainer, `unmask plan` and the memory model read
    of it, so a schedule is one object (`register_schedule` adds one from outside).

    torch_class: the torch.distributed.pipelining schedule (a class, or its name there).
    multi_stage: several stages per rank (looped: stage s on pp rank s mod pp), so
    parallel.pipeline_stages_per_rank >= 2; else exactly 1.
    head_loss: how the last stage's loss makes the LM head's gradients: "fused" in the
    forward (diffusion/loss.py weighted_cross_entropy: 3 passes over the head, the gradients
    held until the micro-batch's backward, which on the last stage of 1F1B, interleaved 1F1B
    and zero bubble comes right after its forward; zero bubble's input pass hands both over,
    its weight pass has none of the head's work); "chunked" in the backward (the logits
    recomputed there: 4 passes, nothing held), for GPipe, whose forwards all run before its
    backwards, so a forward that makes the head's gradients paces the forward half with work
    of the backward half, and every micro-batch's gradients would wait at once.
    split_backward: the backward runs as an input pass and a weight pass (torch's
    `dw_builder`; zero bubble), which changes the bubble (`bubble_formula`) and keeps FSDP2
    from resharding after the forward.
    forwards_first: every micro-batch's forward runs before any backward (GPipe), so all
    their activations are live at once (`in_flight`)."""

    name: str
    torch_class: str | type
    multi_stage: bool = False
    head_loss: str = "fused"
    split_backward: bool = False
    forwards_first: bool = False

    def schedule_class(self) -> type:
        if isinstance(self.torch_class, str):
            from torch.distributed import pipelining  # lazily, as the stage does

            return getattr(pipelining, self.torch_class)
        return self.torch_class

    def in_flight(self, microbatches: int, degree: int, stages_per_rank: int, rank: int) -> float:
        """Micro-batches whose saved activations are live at once on pp rank `rank`, in
        units of one micro-batch through all of the rank's layers: every forward first (m),
        one stage per rank min(m, p - r) (1F1B's warm-up), several min(m v, (v - 1) p +
        2 (p - 1 - r) + 1) stage-micro-batches of 1/v of the rank's layers each
        (torch.distributed.pipelining's interleaved warm-up counts)."""
        m, p, v, r = microbatches, degree, stages_per_rank, rank
        if self.forwards_first:
            return float(m)
        if v == 1:
            return float(min(m, p - r))
        return min(m * v, (v - 1) * p + 2 * (p - 1 - r) + 1) / v


#: parallel.pipeline_schedule values, by name
PIPELINE_SCHEDULES: dict[str, ScheduleSpec] = {}


def register_schedule(spec: ScheduleSpec) -> None:
    """Add `spec` as a parallel.pipeline_schedule value (ValueError when its name is taken or
    its head_loss is neither "fused" nor "chunked")."""
    if spec.name in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline schedule {spec.name!r} is already registered")
    if spec.head_loss not in HEAD_PASSES:
        raise ValueError(f"pipeline schedule {spec.name!r}: head_loss must be one of "
                         f"{sorted(HEAD_PASSES)}, not {spec.head_loss!r}")  # fmt: skip
    PIPELINE_SCHEDULES[spec.name] = spec


def schedule_spec(name: str) -> ScheduleSpec:
    """The registered schedule `name`; InputError naming the registered ones."""
    spec = PIPELINE_SCHEDULES.get(name)
    if spec is None:
        raise InputError(f"unknown parallel.pipeline_schedule {name!r}; expected one of "
                         f"{list(PIPELINE_SCHEDULES)}")  # fmt: skip
    return spec


#: passes over the head's (rows x vocab) logits per micro-batch, by ScheduleSpec.head_loss
HEAD_PASSES = {"fused": 3, "chunked": 4}

for _spec in (
    ScheduleSpec("gpipe", "ScheduleGPipe", head_loss="chunked", forwards_first=True),
    ScheduleSpec("1f1b", "Schedule1F1B"),
    ScheduleSpec("interleaved_1f1b", "ScheduleInterleaved1F1B", multi_stage=True),
    ScheduleSpec(
        "zero_bubble", "ScheduleInterleavedZeroBubble", multi_stage=True, split_backward=True
    ),  # fmt: skip
):
    register_schedule(_spec)
