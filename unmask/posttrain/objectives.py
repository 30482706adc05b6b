"""The post-training objectives' registry entries (diffusion/registry.py): `grpo` (rewards,
grpo.py) and `preference` (chosen/rejected pairs, preference.py and pairs.py). Importing
unmask.posttrain registers both.

Each entry says what the objective needs beside the model: grpo its rewards (checked on the
first training rows before the run writes anything) and its rollout sampler; preference its
pair data and a frozen reference model (the base under LoRA, else a copy of the starting
weights the trainer builds on request).
"""

import json
from pathlib import Path

import torch

from unmask.diffusion.registry import ObjectiveContext, ObjectiveSpec, register_objective
from unmask.models.families import FAMILIES, samples_with_logit_shift
from unmask.posttrain.grpo import GRPOObjective, build_eval_objective, prompt_answer
from unmask.posttrain.pairs import build_pair_datasets, heldout_pair_examples
from unmask.posttrain.preference import PreferenceObjective, reference_memory_note
from unmask.rewards import RewardSet, parse_rewards
from unmask.sampling.accuracy import decode_answer
from unmask.sampling.generation_file import fixed_by_training

_CHECK_ROWS = 4  # training rows whose records the rewards are tried on before the run


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


def _check_unshifted(cfg) -> None:
    """Likelihoods of completions are read position by position: no logit-shift model."""
    if _predicts_shifted(cfg.model):
        raise ValueError(
            f"diffusion.objective {cfg.diffusion.objective} does not support logit-shift "
            "models (Dream) yet: its likelihoods would be read from the wrong positions; use a "
            "model without the shift (qwen3, qwen2, llama, llada)"
        )


# -- grpo ------------------------------------------------------------------------------------


def reward_set(cfg) -> RewardSet:
    """The run's RewardSet (unmask.rewards) from its `rewards:` list."""
    return RewardSet(parse_rewards(cfg.rewards))


def check_grpo_run(cfg) -> None:
    """A grpo run's settings of other sections (cfg: a RunConfig); ValueError (the config's
    one-line error) when they cannot work together."""
    _check_unshifted(cfg)
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


def check_rewards_on_rows(cfg, tokenizer, train_rows) -> None:
    """Before the run writes anything: the rewards import, run and return numbers on the
    records of the first training rows (InputError otherwise)."""
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


def build_grpo(context: ObjectiveContext) -> GRPOObjective:
    """GRPO with the run's rewards, its rollout sampler (grpo.sampling, with what training
    fixes, filling the training row unless gen_length is set) and, under LoRA, the base
    weights as the KL reference."""
    cfg, tokenizer = context.run, context.tokenizer
    if cfg is None or tokenizer is None:
        raise ValueError("diffusion.objective grpo is built for a run: pass run= and tokenizer=")
    mask_id, eos_id = context.mask_id, context.eos_id
    sampling = cfg.grpo.sampling.updated(**fixed_by_training(cfg.diffusion))
    if "gen_length" not in cfg.grpo.sampling.model_fields_set and sampling.row_length is None:
        sampling = sampling.updated(row_length=cfg.data.packing_length)
    reference = (lambda model: model.disable_adapter()) if cfg.model.lora else None
    return GRPOObjective(
        cfg.grpo, reward_set(cfg), tokenizer, mask_id, eos_id, sampling,
        time_eps=cfg.diffusion.time_eps, vocab_chunk=cfg.diffusion.vocab_chunk_size,
        reference=reference, eval_objective=build_eval_objective(cfg.diffusion, mask_id, eos_id),
    )  # fmt: skip


# -- preference ------------------------------------------------------------------------------


def check_preference_diffusion(diffusion) -> None:
    if diffusion.random_length_prob > 0:
        raise ValueError(
            "random_length_prob needs a single-row objective; preference pairs are scored "
            "whole (set diffusion.random_length_prob: 0)"
        )


def build_preference(context: ObjectiveContext) -> PreferenceObjective:
    """DPO against the frozen starting model: the policy with its LoRA adapters off, else a
    second copy built the same way (same seed and init_from, before any resume), held
    frozen in memory."""
    cfg = context.run
    if cfg is None:
        raise ValueError("diffusion.objective preference is built for a run: pass run=")
    reference = None
    if not cfg.model.lora:
        if context.starting_model is None:
            raise ValueError("preference without model.lora needs starting_model= (the "
                             "frozen reference)")  # fmt: skip
        reference = context.starting_model()
        reference.eval()
        params = sum(p.numel() for p in reference.parameters())
        size = next(reference.parameters()).element_size()
        context.notices.append(reference_memory_note(params, size))
    return PreferenceObjective(cfg.preference, cfg.diffusion, context.mask_id, reference)


def _pair_datasets(cfg, tokenizer, as_loaded):
    return build_pair_datasets(cfg.data, tokenizer)


register_objective(ObjectiveSpec(
    "grpo", build_grpo, accepts_loss_normalization=True, check_run=check_grpo_run,
    check_rows=check_rewards_on_rows,
))  # fmt: skip
register_objective(ObjectiveSpec(
    "preference", build_preference, check_diffusion=check_preference_diffusion,
    check_run=_check_unshifted, datasets=_pair_datasets, heldout_examples=heldout_pair_examples,
))  # fmt: skip
