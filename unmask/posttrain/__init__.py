"""Post-training objectives: reward-based (GRPO, wd1, SPG) and preference-based (DPO on ELBOs).

They are `Objective`s (unmask/diffusion/objectives.py) and run in the one training loop;
what they add is a sampler in the loop (rollouts), rewards, log-likelihood estimators
(estimators.py), pair data (pairs.py) and a frozen reference model. Importing this package
registers `grpo`, `preference` and `distill` (distill.py) in the objective registry (objectives.py), with the
checks that refuse bad input before anything is written.
"""

from unmask.posttrain.config import GRPOConfig
from unmask.posttrain.distill import DistillConfig  # registers distill
from unmask.posttrain.objectives import reward_set
from unmask.posttrain.preference import PreferenceConfig

__all__ = ["DistillConfig", "GRPOConfig", "PreferenceConfig", "reward_set"]
