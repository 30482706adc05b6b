"""Post-training objectives: reward-based (GRPO, wd1, SPG) and preference-based.

They have the trainer's Objective signature (unmask/diffusion/objectives.py) and run in the
one training loop; what they add is a sampler in the loop (rollouts), rewards and
log-likelihood estimators (estimators.py). The trainer asks `is_posttrain(name)` and builds
them with `build_posttrain_objective(cfg, tokenizer)`; `check_posttrain` refuses bad input
(rewards that cannot be imported, raise or return non-numbers) before anything is written.
"""

import json
from pathlib import Path

import torch

from unmask.errors import InputError
from unmask.models.families import FAMILIES, samples_with_logit_shift
from unmask.posttrain.config import GRPOConfig
from unmask.posttrain.grpo import GRPOObjective, build_eval_objective, prompt_answer
from unmask.rewards import RewardSet, parse_rewards
from unmask.sampling.accuracy import decode_answer
from unmask.sampling.config import fixed_by_training

#: diffusion.objective names built here; `preference` (preference.py, pairs.py) is built by
#: the trainer, which also holds its frozen reference model and reads its pair data
POSTTRAIN_OBJECTIVES = ("grpo",)
_CHECK_ROWS = 4  # training rows whose records the rewards are tried on before the run


def is_posttrain(name: str) -> bool:
    return name in POSTTRAIN_OBJECTIVES


def check_config(cfg) -> None:
    """Config-level checks of a run (a RunConfig) with a post-training objective; ValueError
    (the config's one-line error) when settings cannot work together."""
    name = cfg.diffusion.objective
    if name not in ("grpo", "preference"):
        return
    if _predicts_shifted(cfg.model):
        raise ValueError(
            f"diffusion.objective {name} does not support logit-shift models (Dream) yet: "
            "its likelihoods would be read from the wrong positions; use a model without "
            "the shift (qwen3, qwen2, llama, llada)"
        )
    if name != "grpo":
        return
    if cfg.data.packing:
        raise ValueError(
            "diffusion.objective grpo needs one prompt per row: set data.packing: false"
        )
    if cfg.diffusion.random_length_prob > 0:
        raise ValueError("diffusion.objective grpo cannot cut rows: set "
                         "diffusion.random_length_prob: 0")  # fmt: skip
    if not cfg.rewards:
        raise ValueError("diffusion.objective grpo needs rewards: add a top-level rewards: list, "
                         "e.g. rewards: [{fn: exact_match}]")  # fmt: skip
    g = cfg.grpo
    if g.kl_beta > 0 and g.loss != "diffu_grpo":
        raise ValueError(f"grpo.kl_beta > 0 needs grpo.loss: diffu_grpo ({g.loss} has no KL term)")
    if g.kl_beta > 0 and not cfg.model.lora:
        raise ValueError(
            "grpo.kl_beta > 0 needs model.lora: true (the frozen base is the KL reference; "
            "unmask keeps no second copy of the model) or grpo.kl_beta: 0"
        )


def _predicts_shifted(model) -> bool:
    """True when the model predicts position i from the output at i - 1 (Dream's family,
    by model_type or by the config.json of its pretrained folder)."""
    folder_config = Path(model.pretrained or "") / "config.json"
    if model.pretrained is not None and folder_config.is_file():
        try:
            return samples_with_logit_shift(json.loads(folder_config.read_text()))
        except (OSError, ValueError):
            return False  # the model loader reports an unreadable folder in one line
    family = FAMILIES.get(model.model_type)
    return family is not None and family.logit_shift


def reward_set(cfg):
    """The run's RewardSet (unmask.rewards) from its `rewards:` list."""
    return RewardSet(parse_rewards(cfg.rewards))


def check_posttrain(cfg, tokenizer, train_rows) -> None:
    """Before the run writes anything: the rewards import, run and return numbers on the
    records of the first training rows (InputError otherwise)."""
    if cfg.diffusion.objective != "grpo":
        return
    rewards = reward_set(cfg)
    try:
        gather = getattr(train_rows, "gather", None)
        if gather is None or not len(train_rows):
            return
        rows = gather(torch.arange(min(_CHECK_ROWS, len(train_rows))))
        records = []
        for ids, maskable in zip(rows["input_ids"], rows["maskable"].bool()):
            prompt, answer = prompt_answer(ids, maskable, tokenizer.eos_token_id)
            text = tokenizer.decode(prompt.tolist(), skip_special_tokens=True)
            records.append({"prompt": text, "answer": decode_answer(tokenizer, answer)})
        rewards.check(records)
    finally:
        rewards.close()


def build_posttrain_objective(cfg, tokenizer):
    """The objective of a post-training run (cfg: RunConfig)."""
    name = cfg.diffusion.objective
    mask_id, eos_id = tokenizer.mask_token_id, tokenizer.eos_token_id
    if name == "grpo":
        sampling = cfg.grpo.sampling.updated(**fixed_by_training(cfg.diffusion))
        if "gen_length" not in cfg.grpo.sampling.model_fields_set and sampling.row_length is None:
            sampling = sampling.updated(row_length=cfg.data.packing_length)
        reference = (lambda model: model.disable_adapter()) if cfg.model.lora else None
        return GRPOObjective(
            cfg.grpo, reward_set(cfg), tokenizer, mask_id, eos_id, sampling,
            time_eps=cfg.diffusion.time_eps, vocab_chunk=cfg.diffusion.vocab_chunk_size,
            reference=reference, eval_objective=build_eval_objective(cfg.diffusion, mask_id,
                                                                     eos_id),
        )  # fmt: skip
    raise InputError(f"unknown post-training objective {name!r}")


__all__ = ["GRPOConfig", "POSTTRAIN_OBJECTIVES", "build_posttrain_objective", "check_config",
           "check_posttrain", "is_posttrain"]  # fmt: skip
