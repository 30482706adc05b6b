"""The settings of adapting a causal checkpoint into a DLM: `diffusion.adaptation` and
`diffusion.block_schedule` (what they do: adaptation.py, docs/adaptation.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class AdaptationConfig(BaseModel):
    """`diffusion.adaptation`: how a causal checkpoint (model.pretrained) becomes a DLM."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    attention: Literal["instant", "anneal"] = "instant"
    """`instant`: bidirectional from the first step (RND1). `anneal`: the causal mask opens
    linearly over `anneal_steps` (DiffuLLaMA): each future key visible with probability
    step / anneal_steps."""
    anneal_steps: int = Field(0, ge=0)
    """Steps over which the causal mask opens (attention: anneal; at most train.max_steps)."""
    shift: bool = False
    """Predict token i from the output at i - 1, as the AR model did (Dream, DiffuLLaMA);
    the adapted model samples with the shift."""

    @model_validator(mode="after")
    def _anneal_has_steps(self) -> AdaptationConfig:
        if self.attention == "anneal" and self.anneal_steps < 1:
            raise ValueError("adaptation.attention anneal needs anneal_steps >= 1")
        if self.attention == "instant" and self.anneal_steps:
            raise ValueError("adaptation.anneal_steps needs attention: anneal")
        return self


class BlockSchedule(BaseModel):
    """`diffusion.block_schedule` (bd3lm): the block size per step, as LLaDA2.0 trains:
    warm-up sizes (small to large), the whole row (stable: one block, MDLM), decay sizes
    (large to the small block it samples with; the last one kept to the end)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    warmup: list[int] = Field(default_factory=list)
    """Block sizes of the warm-up, in order (LLaDA2.0: 1, 4, 32, 64, ...)."""
    warmup_steps: int = Field(0, ge=0)
    """Steps each warm-up size trains."""
    stable_steps: int = Field(0, ge=0)
    """Steps with the whole row as one block (full attention)."""
    decay: list[int] = Field(min_length=1)
    """Block sizes after the stable phase, in order; the last one is kept to the end of the
    run and is the block size the model samples with."""
    decay_steps: int = Field(0, ge=0)
    """Steps each decay size but the last trains."""

    @model_validator(mode="after")
    def _positive_sizes(self) -> BlockSchedule:
        if any(size < 1 for size in [*self.warmup, *self.decay]):
            raise ValueError("block_schedule sizes must be >= 1")
        if self.warmup and self.warmup_steps < 1:
            raise ValueError("block_schedule.warmup needs warmup_steps >= 1")
        return self

    def length(self) -> int:
        """Steps before the last decay size starts."""
        return (len(self.warmup) * self.warmup_steps + self.stable_steps
                + (len(self.decay) - 1) * self.decay_steps)  # fmt: skip

    def block_size(self, step: int, row_length: int) -> int:
        """The block size of (0-based) optimizer step `step` for rows of row_length."""
        warm = len(self.warmup) * self.warmup_steps
        if step < warm:
            return min(self.warmup[step // self.warmup_steps], row_length)
        step -= warm
        if step < self.stable_steps:
            return row_length
        step -= self.stable_steps
        index = len(self.decay) - 1 if self.decay_steps == 0 else step // self.decay_steps
        return min(self.decay[min(index, len(self.decay) - 1)], row_length)

    @property
    def final_block(self) -> int:
        return self.decay[-1]

    def describe(self) -> str:
        """'1 to step 50, 4 to step 100, the whole row to step 200, then 4'."""
        parts, step = [], 0
        for size in self.warmup:
            step += self.warmup_steps
            parts.append(f"{size} to step {step}")
        if self.stable_steps:
            step += self.stable_steps
            parts.append(f"the whole row to step {step}")
        for size in self.decay[:-1]:
            step += self.decay_steps
            parts.append(f"{size} to step {step}")
        parts.append(f"then {self.decay[-1]}" if parts else f"{self.decay[-1]}")
        return ", ".join(parts)
