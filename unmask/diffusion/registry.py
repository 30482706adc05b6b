"""Objective names -> objective classes: the one place `diffusion.objective` is looked up.

To add an objective: write a class with the `Objective` call signature
(`objective(model, batch, generator) -> ObjectiveOutput(loss_sum, count)`, see
objectives.py; subclass `MaskedDiffusionObjective` to reuse its noise), add its name to
`OBJECTIVE_NAMES` (config.py) and to `OBJECTIVES` below, and its formula to
docs/diffusion.md.
"""

from unmask.diffusion.config import DiffusionConfig
from unmask.diffusion.objectives import MaskedDiffusionObjective, Objective
from unmask.diffusion.recipes import BlockDiffusionObjective, DreamObjective, SFTObjective

OBJECTIVES: dict[str, type[MaskedDiffusionObjective]] = {
    "mdlm": MaskedDiffusionObjective,
    "llada": MaskedDiffusionObjective,
    "bert": MaskedDiffusionObjective,  # the mdlm loss on a transformers encoder
    "sft": SFTObjective,
    "dream": DreamObjective,
    "bd3lm": BlockDiffusionObjective,
}


def build_objective(cfg: DiffusionConfig, mask_id: int, eos_id: int | None = None) -> Objective:
    """The objective named by `cfg.objective`, masking with token `mask_id`; eos_id marks
    where answers end (`loss_normalization: answer`)."""
    if cfg.objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {cfg.objective!r}; expected one of {list(OBJECTIVES)}")
    objective = OBJECTIVES[cfg.objective](cfg, mask_id)
    objective.eos_id = eos_id
    return objective
