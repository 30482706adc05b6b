"""Masked diffusion: forward process, objectives and the masked-only loss."""

from unmask.diffusion import adaptation  # noqa: F401  (registers its wrapper and run check)
from unmask.diffusion.autoregressive import AutoregressiveObjective  # registers ar
from unmask.diffusion.config import DiffusionConfig
from unmask.diffusion.fastdllm_v2 import FastDLLMv2Objective  # registers fastdllm_v2
from unmask.diffusion.loss import chunked_cross_entropy
from unmask.diffusion.noise import loss_weight, mask_prob, mask_tokens, sample_t
from unmask.diffusion.objectives import (
    MaskedDiffusionObjective,
    Objective,
    ObjectiveOutput,
    mdlm_loss_terms,
)
from unmask.diffusion.recipes import BlockDiffusionObjective, DreamObjective, SFTObjective
from unmask.diffusion.registry import (
    OBJECTIVES,
    ObjectiveContext,
    ObjectiveSpec,
    build_objective,
    objective_names,
    objective_spec,
    register_objective,
)
from unmask.diffusion.uniform import UniformObjective  # registers uniform

__all__ = [
    "OBJECTIVES",
    "AutoregressiveObjective",
    "BlockDiffusionObjective",
    "DiffusionConfig",
    "DreamObjective",
    "FastDLLMv2Objective",
    "MaskedDiffusionObjective",
    "Objective",
    "ObjectiveContext",
    "ObjectiveOutput",
    "ObjectiveSpec",
    "SFTObjective",
    "UniformObjective",
    "build_objective",
    "objective_names",
    "objective_spec",
    "register_objective",
    "chunked_cross_entropy",
    "loss_weight",
    "mask_prob",
    "mask_tokens",
    "mdlm_loss_terms",
    "sample_t",
]
