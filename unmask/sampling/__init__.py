"""Sampling from masked-diffusion language models: one sampler configured by one
`SamplingConfig`, likelihoods, held-out accuracy."""

from collections.abc import Callable

import torch
from torch import nn

# The built-in decoders register themselves on import, in this order (the order of
# `decoder_names()`: the --decoder choices, the playground's list). They come before
# config.py, which composes SamplingConfig from their options models (`MaskedOptions`,
# `JointThresholdOptions`, `EntropyBoundOptions`) and imports those modules: none of
# them imports config.py but for annotations.
# isort: off
from unmask.sampling.masked import MaskedBlockDecoder
from unmask.sampling.autoregressive import LeftToRight
from unmask.sampling.blocks_from_start import BlocksFromStart
from unmask.sampling.editing import JointThreshold
from unmask.sampling.entropy_bound import EntropyBound

# isort: on
from unmask.sampling.config import SamplingConfig, resolve_sampling
from unmask.sampling.decoders import BlockDecoder, WholeDecoder, register_decoder
from unmask.sampling.generate import GenerationOutput, cfg_combine, left_pad, sample
from unmask.sampling.schedules import dream_schedule, num_transfer_tokens
from unmask.sampling.transfer import add_gumbel_noise, register_confidence, select_top_k


def generate(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    config: SamplingConfig | None = None,
    *,
    mask_id: int,
    eos_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    on_step: Callable[[torch.Tensor], None] | None = None,
    **options,
) -> torch.Tensor:
    """LLaDA-style front end: `sample` returning only the tokens (B, P + G), prompt
    unchanged, no masks left. Sampling options may be given as keywords (they update
    `config`, else SamplingConfig's defaults); steps = gen_length = block_length = 128,
    temperature 0 and low_confidence reproduce LLaDA's `generate` with its defaults."""
    config = (config or SamplingConfig()).updated(**options)
    return sample(model, prompt_ids, config, mask_id=mask_id, eos_id=eos_id,
                  attention_mask=attention_mask, generator=generator,
                  on_step=on_step).sequences  # fmt: skip


__all__ = [
    "BlockDecoder",
    "BlocksFromStart",
    "LeftToRight",
    "MaskedBlockDecoder",
    "EntropyBound",
    "GenerationOutput",
    "JointThreshold",
    "SamplingConfig",
    "add_gumbel_noise",
    "cfg_combine",
    "dream_schedule",
    "generate",
    "left_pad",
    "num_transfer_tokens",
    "register_confidence",
    "register_decoder",
    "resolve_sampling",
    "sample",
    "select_top_k",
    "WholeDecoder",
]
