"""Rewards for post-training: built-in ones (exact_match, numeric_match, format, code) and
user functions `module:function` named in the config's `rewards:` list (docs/rewards.md).

User code (user functions, and the code reward's completions and tests) runs only in worker
processes (unmask/rewards/worker.py), never in the training process.
"""

from unmask.rewards.builtin import REFERENCE_KEYS, extract_number
from unmask.rewards.rewardset import RewardScores, RewardSet
from unmask.rewards.spec import BUILTINS, RewardSpec, parse_rewards

__all__ = [
    "BUILTINS",
    "REFERENCE_KEYS",
    "RewardScores",
    "RewardSet",
    "RewardSpec",
    "extract_number",
    "parse_rewards",
]
