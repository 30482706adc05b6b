"""Sampling from masked-diffusion language models: one sampler configured by one
`SamplingConfig`, likelihoods, held-out accuracy."""

from unmask.sampling.config import SamplingConfig, resolve_sampling
from unmask.sampling.decoders import BlockDecoder, WholeDecoder, register_decoder
from unmask.sampling.generate import GenerationOutput, cfg_combine, generate, left_pad, sample
from unmask.sampling.schedules import dream_schedule, num_transfer_tokens
from unmask.sampling.transfer import add_gumbel_noise, register_confidence, select_top_k

# The built-in decoders register themselves on import, in this order (the order of
# `decoder_names()`: the --decoder choices, the playground's list)
# isort: off
from unmask.sampling.masked import MaskedBlockDecoder
from unmask.sampling.autoregressive import LeftToRight
from unmask.sampling.blocks_from_start import BlocksFromStart
from unmask.sampling.editing import JointThreshold
from unmask.sampling.entropy_bound import EntropyBound

# isort: on

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
