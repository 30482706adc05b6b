"""Settings for generation-based evaluation at the end of training."""

from typing import Literal

from pydantic import BaseModel, ConfigDict


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
    """Denoising steps per generated token (1.0 = one token committed per step)."""
    block_length: int | None = None
    """Semi-autoregressive block length; None = the whole answer is one block."""
    temperature: float = 0.0
    """Gumbel temperature; 0 = greedy, deterministic."""
    remasking: Literal["low_confidence", "random"] = "low_confidence"
    """Which predicted tokens to commit each step."""
