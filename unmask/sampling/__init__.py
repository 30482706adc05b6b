"""Sampling from masked-diffusion language models."""

from unmask.sampling.generate import (
    add_gumbel_noise,
    cfg_combine,
    generate,
    num_transfer_tokens,
    select_top_k,
)

__all__ = ["add_gumbel_noise", "cfg_combine", "generate", "num_transfer_tokens", "select_top_k"]
