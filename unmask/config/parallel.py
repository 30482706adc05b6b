"""The `parallel:` section: how a run is laid out over its processes (data, tensor,
sequence, context, expert and pipeline parallelism; FSDP2). One section so the layout has
one owner: train/setup.py `plan_parallel` turns it and the world size into the run's
`ParallelPlan`, which the trainer, the model builders and `unmask plan` all read.

These keys were `train.*` keys before; a config that still writes them there is read as the
`parallel.*` key of the same name, with a start-up notice naming the new spelling
(`moved_key_notices` in config/run.py).
"""

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from unmask.errors import OneOf
from unmask.parallel.schedules import PIPELINE_SCHEDULES


def _schedule_names() -> list[str]:
    """parallel.pipeline_schedule's values: the schedules registered when a config is
    validated (parallel/schedules.py; a plug-in's too)."""
    return list(PIPELINE_SCHEDULES)


class ParallelConfig(BaseModel):
    """The run's layout over its processes (docs/parallelism.md)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    fsdp2: bool = True
    """With several processes: shard params, grads and optimizer state with FSDP2 (false = replicate them on every rank: dp_replicate = world size)."""
    dp_replicate: int = Field(1, ge=1)
    """Replica groups of the device mesh (HSDP when both dp_replicate and dp_shard > 1)."""
    dp_shard: int = -1
    """Ranks each parameter is sharded over; -1 = world size / (dp_replicate x context_parallel x tensor_parallel)."""
    tensor_parallel: int = Field(1, ge=1)
    """Ranks each decoder layer's matrices are split over (Megatron-style TP: heads / N and MLP columns / N per rank; native decoders only; docs/parallelism.md). Must divide the attention heads, key/value heads and intermediate_size."""
    sequence_parallel: bool = False
    """Under tensor_parallel > 1: the norms and the residual stream between the decoder layers sharded over the sequence on the tp ranks (Megatron's sequence parallelism: each layer's input all-gathered, its output reduce-scattered; activations of those parts / N per rank; docs/parallelism.md). Not with context_parallel or pipeline_parallel."""
    context_parallel: int = Field(1, ge=1)
    """Ranks each sequence is split over (context parallelism, docs/parallelism.md)."""
    expert_parallel: int = Field(1, ge=1)
    """Ranks each MoE layer's experts are split over (expert parallelism: tokens reach their experts by all-to-all; docs/parallelism.md). Carved out of the data-parallel x context ranks, which it must divide; must divide model.num_experts."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline stages' ranks: the decoder layers are split into consecutive stages, embeddings with the first, the final norm and LM head with the last (torch.distributed.pipelining; native decoders; docs/parallelism.md). The outermost mesh dim."""
    pipeline_schedule: Annotated[str, OneOf(_schedule_names)] = "1f1b"
    """How micro-batches flow through the stages: gpipe, 1f1b, interleaved_1f1b, zero_bubble (torch's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble), or a schedule added with `unmask.parallel.schedules.register_schedule`; the interleaved ones take pipeline_stages_per_rank >= 2. The last stage's loss makes the LM head's gradients in the forward under 1f1b, interleaved_1f1b and zero_bubble, in the backward under gpipe (docs/parallelism.md). Every schedule runs under bf16."""
    pipeline_stages_per_rank: int = Field(1, ge=1)
    """Stages each pipeline rank holds (interleaved_1f1b, zero_bubble: >= 2, stage s on pipeline rank s mod pipeline_parallel)."""
    pipeline_microbatches: int | None = Field(None, ge=1)
    """Pipeline micro-batches per optimizer step; null = one per row of the step on a data-parallel rank (rows x gradient_accumulation_steps). Must divide those rows, and be >= pipeline_parallel."""
    pipeline_split: list[int] | None = None
    """Decoder layers per stage, first stage first (e.g. [3, 5]); null = cut by estimated cost: each stage's forward + backward FLOPs per token (its layers, the embedding on the first stage, the norm, LM head and loss on the last) as equal as whole layers allow (docs/parallelism.md)."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered layer weights after forward (ZeRO-3-like); false keeps them until backward (ZeRO-2-like)."""

    @field_validator("dp_shard")
    @classmethod
    def _dp_shard(cls, value: int) -> int:
        if value < 1 and value != -1:
            raise ValueError("must be >= 1, or -1 for world size / dp_replicate")
        return value
