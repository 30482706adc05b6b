"""The `grpo:` section: group rollouts, advantages, the policy loss and its estimator.

Formulas and sources: docs/diffusion.md, Post-training.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from unmask.sampling.config import SamplingConfig

LOSSES = ("diffu_grpo", "wd1", "spg")
ESTIMATORS = ("one_step", "coupled", "mc")


def rollout_sampling() -> SamplingConfig:
    """Rollouts are sampled (temperature 1), not greedy: a group of identical greedy
    completions has zero advantage."""
    return SamplingConfig(temperature=1.0)


class GRPOConfig(BaseModel):
    """`diffusion.objective: grpo`: each row's prompt gets `group_size` completions from the
    sampler, scored by the run's `rewards:`; the policy loss uses a log-likelihood
    estimator of each completion (docs/diffusion.md, Post-training). The prompts of a
    step are its micro-batch rows (`train.per_device_train_batch_size` per rank)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    group_size: int = Field(4, ge=2)
    """G: completions sampled per prompt; advantages compare completions of one prompt, so
    at least 2."""
    loss: Literal[LOSSES] = "diffu_grpo"
    """`diffu_grpo` (d1: clipped per-token ratio surrogate, optional KL), `wd1` (ratio-free
    weighted log-likelihood: softmax(A) pushes up, softmax(-A) pushes down), `spg`
    (sandwiched: ELBO for positive advantages, EUBO/ELBO mix for negative ones)."""
    estimator: Literal[ESTIMATORS] = "one_step"
    """Log-likelihood of a completion: `one_step` (d1: the whole completion masked, prompt
    tokens masked with prompt_mask_prob; 1 forward), `coupled` (DiffuCoder: a full-mask pass
    plus two complementary masks at t ~ U(0.2, 0.8); 3 forwards), `mc` (mc_samples ELBO
    terms at antithetic / stratified t, as in VRPO; mc_samples forwards)."""
    mc_samples: int = Field(2, ge=1)
    """mc: ELBO samples (forwards) per completion."""
    mc_time: Literal["antithetic", "stratified", "uniform"] = "antithetic"
    """mc: how the samples' t are drawn: `antithetic` (pairs t, 1 - t), `stratified` (one t
    in each of mc_samples equal strata), `uniform` (independent)."""
    prompt_mask_prob: float = Field(0.3, ge=0.0, lt=1.0)
    """one_step: probability that a prompt token is masked in the likelihood pass (d1's
    public code: 0.3)."""
    scale_rewards: Literal["group", "none"] = "group"
    """Advantages: reward minus its group's mean, divided by the group's std (`group`; a group
    whose rewards are all equal gets advantage 0) or not divided (`none`: Dr. GRPO, SPG)."""
    clip_epsilon: float = Field(0.2, gt=0.0)
    """diffu_grpo: the ratio is clipped to [1 - eps, 1 + eps]."""
    kl_beta: float = Field(0.0, ge=0.0)
    """diffu_grpo: weight of the per-token KL (k3) to the frozen reference = the base
    weights under model.lora (adapters disabled); needs model.lora when > 0."""
    inner_iterations: int = Field(1, ge=1)
    """mu: optimizer steps that reuse one set of rollouts (the ratio's old log-likelihoods
    are taken when they are drawn); 1 = fresh rollouts every step."""
    spg_beta: float = Field(1.5, gt=0.0)
    """spg: the EUBO's beta (SPG's public configs use 1.0-2.0)."""
    spg_mix: float = Field(0.5, ge=0.0, le=1.0)
    """spg: weight of the EUBO in the negative-advantage bound (1 = EUBO only, 0 = ELBO)."""
    sampling: SamplingConfig = Field(default_factory=rollout_sampling)
    """The rollout sampler: every `unmask generate` option (threshold, cache, block_length,
    ...). Without gen_length, each completion fills the training row
    (row_length = data.packing_length)."""
    shuffle_rewards: bool = False
    """A control run: each group's rewards are permuted among its completions (seeded by the
    prompt), so advantages no longer say which completion was better; a recipe's baseline."""
    log_samples: int = Field(2, ge=0)
    """Completions written to metrics.jsonl (prompt, completion, reward) at each logged step."""

    @field_validator("sampling", mode="before")
    @classmethod
    def _sampled(cls, value):
        """A sampling section that leaves temperature out keeps rollouts sampled (1.0)."""
        if isinstance(value, dict):
            return {"temperature": 1.0, **value}
        return value
