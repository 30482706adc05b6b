"""The `eval:` section: the held-out generation at the end of training.

Its sampler is a whole `SamplingConfig` (`eval.sampling`), as the `grpo:` section's rollouts
are: every `unmask generate` option works here too. The section lives in config/, beside
TrainConfig, because it is a piece of the run's schema, not of the sampler: sampling/ stays
free of run-config sections, and sampling.accuracy.heldout_accuracy reads it by its fields.

Before `eval.sampling`, the section had its own `temperature`, `block_length` and
`remasking`; a config that still says so is read as the `eval.sampling` key of the same
name, with a start-up notice naming the new spelling (`moved_key_notices`).
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from unmask.sampling.config import SamplingConfig

#: eval keys that moved into eval.sampling (same name, same meaning)
MOVED_TO_SAMPLING = ("temperature", "block_length", "remasking")
#: eval.sampling keys the held-out generation decides itself, and what to set instead
_ROW = "each answer fills the training row (data.packing_length minus its prompt); remove it"
_DECIDED_HERE = {
    "gen_length": _ROW,
    "row_length": _ROW,
    "steps": "the answers differ in length; remove it and set eval.steps_per_token",
}


class EvalConfig(BaseModel):
    """Held-out generation after training (prompt/answer data such as the synthetic tasks)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    generate_accuracy: bool = False
    """After training, generate answers for held-out prompts and report exact match."""
    max_examples: int = 300
    """Held-out prompts to generate for (the first N of the eval split)."""
    batch_size: int = 64
    """Prompts decoded together (grouped by prompt length)."""
    steps_per_token: float = 1.0
    """Denoising steps per generated token (1.0 = one token committed per step), rounded to
    whole steps per block of each answer length."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """The sampler: every `unmask generate` option (temperature, block_length, remasking,
    threshold, cache, ...); each answer fills the training row, so gen_length, row_length and
    steps are not set here. What training fixes (Dream's logit shift, BD3LM's blocks) wins.
    Older configs' eval.temperature, eval.block_length and eval.remasking are read as these."""

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """eval.temperature / block_length / remasking are read as eval.sampling's; both
        spellings with different values are an error."""
        if not isinstance(data, dict) or not any(key in data for key in MOVED_TO_SAMPLING):
            return data
        data = dict(data)
        sampling = data.get("sampling") or {}
        if isinstance(sampling, SamplingConfig):
            sampling = {key: getattr(sampling, key) for key in sampling.model_fields_set}
        if not isinstance(sampling, dict):
            return data  # the field's own validation names what is wrong
        sampling = dict(sampling)
        for key in MOVED_TO_SAMPLING:
            if key not in data:
                continue
            value = data.pop(key)
            if key in sampling and sampling[key] != value:
                raise ValueError(
                    f"eval.{key} ({value!r}) and eval.sampling.{key} ({sampling[key]!r}) "
                    f"disagree; keep eval.sampling.{key} only"
                )
            sampling[key] = value
        data["sampling"] = sampling
        return data

    @model_validator(mode="after")
    def _answer_lengths(self) -> "EvalConfig":
        fields = SamplingConfig.model_fields
        for key, why in _DECIDED_HERE.items():
            if getattr(self.sampling, key) != fields[key].default:
                raise ValueError(f"eval.sampling.{key} is not used: {why}")
        return self


def moved_key_notices(tree: dict) -> list[str]:
    """The start-up line for a run tree whose eval section uses keys that moved into
    eval.sampling (none when it uses none)."""
    section = tree.get("eval")
    moved = [key for key in MOVED_TO_SAMPLING if isinstance(section, dict) and key in section]
    if not moved:
        return []
    listed = ", ".join(f"eval.{key} -> eval.sampling.{key}" for key in moved)
    return [f"unmask: config keys that moved, read under their new name (write them there): "
            f"{listed}"]  # fmt: skip
