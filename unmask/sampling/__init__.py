"""Sampling from masked-diffusion language models: one sampler configured by one
`SamplingConfig`, likelihoods, held-out accuracy."""

from unmask.sampling.config import SamplingConfig, resolve_sampling
from unmask.sampling.decoders import BlockDecoder, WholeDecoder, register_decoder
from unmask.sampling.editing import JointThreshold  # registers decoder joint_threshold
from unmask.sampling.entropy_bound import EntropyBound  # registers decoder entropy_bound
from unmask.sampling.generate import GenerationOutput, cfg_combine, generate, left_pad, sample
from unmask.sampling.schedules import dream_schedule, num_transfer_tokens
from unmask.sampling.transfer import add_gumbel_noise, register_confidence, select_top_k

__all__ = [
    "BlockDecoder",
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
