"""Configuration of the masked-diffusion forward process and training objective."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DiffusionConfig(BaseModel):
    """The `diffusion:` section: how tokens are noised and how the loss is weighted."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    objective: Literal["mdlm", "llada"] = "mdlm"
    """Training objective. `llada` is the same pretraining loss as `mdlm` (sum of weighted
    masked cross-entropy over the number of maskable tokens)."""

    t_sampling: Literal["uniform", "antithetic"] = "uniform"
    """How the noise level t is drawn per sequence: `uniform` i.i.d. per row, or
    `antithetic` (one u, rows spaced 1/B apart; lower gradient variance)."""

    time_eps: float = Field(1e-3, gt=0.0, lt=1.0)
    """Lower bound on t: t = (1 - time_eps) * u + time_eps keeps the 1/t weight finite."""

    schedule: Literal["linear", "cosine"] = "linear"
    """Masking schedule: probability of masking at t is t (`linear`) or 1 - cos(pi t / 2)
    (`cosine`)."""

    loss_weight: Literal["inverse_t", "scheduler", "uniform"] = "inverse_t"
    """Per-token weight of masked cross-entropy: `inverse_t` (1/t, the ELBO for the linear
    schedule), `scheduler` (-alpha'(t) / (1 - alpha(t)); equals 1/t for linear), or
    `uniform` (1)."""

    min_masked: int = Field(0, ge=0, le=1)
    """1 forces at least one masked token in every row that has a maskable token, so no row
    gives zero signal (MegaDLMs); 0 masks purely at random."""

    vocab_chunk_size: int = Field(8192, gt=0)
    """Vocabulary columns per chunk in the masked-only cross-entropy (memory vs. speed)."""
