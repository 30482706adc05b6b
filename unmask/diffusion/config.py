"""Configuration of the masked-diffusion forward process and training objective."""

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from unmask.diffusion.adaptation_config import AdaptationConfig, BlockSchedule
from unmask.diffusion.registry import names_that, objective_names, objective_spec
from unmask.errors import OneOf

_CART = re.compile(r"^cart(?:\[geo_p:([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\])?$")
LOSS_WEIGHTS = ("inverse_t", "scheduler", "uniform", "cart[geo_p:P]")
NORMALIZATIONS = ("auto", "token", "answer", "answer_padded")


def parse_loss_weight(text: str) -> tuple[str, float | None]:
    """'cart[geo_p:0.3]' -> ('cart', 0.3); 'cart' -> ('cart', 0.3); 'inverse_t' -> (.., None)."""
    text = text.strip()
    if text in ("inverse_t", "scheduler", "uniform"):
        return text, None
    match = _CART.match(text)
    if match is None:
        raise ValueError(f"unknown loss weight {text!r}; expected one of {', '.join(LOSS_WEIGHTS)}")
    geo_p = float(match.group(1)) if match.group(1) is not None else 0.3
    if not 0.0 < geo_p <= 1.0:
        raise ValueError(f"cart geo_p must be in (0, 1], got {geo_p}")
    return "cart", geo_p


class DiffusionConfig(BaseModel):
    """The `diffusion:` section: how tokens are noised and how the loss is weighted."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    objective: Annotated[str, OneOf(objective_names)] = "mdlm"
    """Training objective: one of those registered (unmask/diffusion/registry.py; a plug-in
    registers its own). `mdlm`/`llada`: pretraining (sum of weighted masked cross-entropy
    over the number of maskable tokens). `sft`: LLaDA SFT (prompt never masked, each row
    normalized by its answer length). `dream`: logit shift + CART/scheduler weights, prompt
    cutoffs. `bert`: the mdlm loss on an encoder (model_type bert/modernbert). `bd3lm`: block
    diffusion (x_t + x0 input, block attention mask, t per block). `ar`: the autoregressive
    baseline (next-token loss, causal mask; sampled left to right). `fastdllm_v2`: Fast-dLLM
    v2's block diffusion (shift, blocks from position 0, complementary masks). `grpo`:
    reinforcement learning from rewards (the `grpo:` section and `rewards:`; docs/diffusion.md,
    Post-training). `preference`: DPO on MC ELBOs of chosen/rejected pairs against the
    frozen starting model (VRPO; section `preference:`). `uniform`: DiffusionGemma's canvas
    objective (model_type diffusion_gemma only: uniform-random token corruption of one
    canvas of each answer, no [MASK]; docs/diffusion.md, Uniform corruption)."""

    t_sampling: Literal["uniform", "antithetic", "fixed"] = "uniform"
    """How the noise level t is drawn per sequence: `uniform` i.i.d. per row, `antithetic`
    (one u, rows spaced 1/B apart; lower gradient variance), or `fixed` (every row at
    t = 0.5: for benchmarks, whose steps then mask about the same number of tokens; not for
    training a model)."""

    time_eps: float = Field(1e-3, gt=0.0, lt=1.0)
    """Lower bound on t: t = (1 - time_eps) * u + time_eps keeps the 1/t weight finite."""

    schedule: Literal["linear", "cosine"] = "linear"
    """Masking schedule: probability of masking at t is t (`linear`) or 1 - cos(pi t / 2)
    (`cosine`)."""

    loss_weight: str = "inverse_t"
    """Per-token weight of masked cross-entropy: `inverse_t` (1/t, the ELBO for the linear
    schedule), `scheduler` (-alpha'(t) / (1 - alpha(t)); equals 1/t for linear), `uniform`
    (1), or `cart[geo_p:0.3]` (Dream's CART: 0.5 * sum over clean j of p (1-p)^(|i-j|-1);
    no 1/t factor; dream objective only)."""

    min_masked: int = Field(0, ge=0, le=1)
    """1 forces at least one masked token in every row that has a maskable token, so no row
    gives zero signal (MegaDLMs); 0 masks purely at random."""

    random_length_prob: float = Field(0.0, ge=0.0, le=1.0)
    """Probability (LLaDA: 0.01) that a training step's batch is cut to a random length in
    [1, L]; drawn from (train.seed, step), so every rank and micro-batch cuts alike."""

    prompt_drop_prob: float = Field(0.0, ge=0.0, le=1.0)
    """sft: probability that a row's whole prompt is masked (and left out of the loss), for
    classifier-free guidance (SMDM uses 0.1)."""

    logit_shift: bool | None = None
    """Predict position i from the output at i-1 (Dream; reuses AR weights). None = true
    for `dream`, false otherwise. Positions starting a document carry no loss."""

    mask_prompt_loss: bool = True
    """dream: no loss on prompt positions (they are never masked). False lets prompt tokens
    be masked and trained like the answer."""

    perbatch_cutoff: bool = False
    """dream: pick one answer length from the batch and trim every answer to it (trimmed
    tokens are hidden from attention and carry no loss)."""

    resp_cutoff_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """dream: probability of chopping a random tail (1 .. shortest answer - 1 tokens) off the
    whole batch; keep it small (0.0-0.2)."""

    block_size: int = Field(32, ge=1)
    """bd3lm: tokens per diffusion block; the row length must be a multiple of it."""

    loss_normalization: Literal[NORMALIZATIONS] = "auto"
    """What the summed masked loss is divided by (docs/diffusion.md, Loss normalization):
    `token`: the batch's maskable tokens (one global count; mdlm/llada); `answer_padded`:
    each row by its maskable tokens (answer, EOS and supervised padding), then the mean over
    rows (LLaDA SFT); `answer`: each row by its answer and first EOS only, supervised
    padding left out of the divisor, then the mean over rows. `auto`: the objective's own
    (`answer_padded` for sft, `token` for the others). mdlm, llada, bert and sft only."""

    adaptation: AdaptationConfig | None = None
    """Adapt a causal checkpoint (model.pretrained: an HF Qwen3 / Qwen2 / Llama causal
    folder or an `ar` run): `{attention: instant | anneal, anneal_steps: N, shift: bool}`
    (docs/adaptation.md). mdlm, llada and sft only."""

    block_schedule: BlockSchedule | None = None
    """bd3lm: the block size per step, LLaDA2.0's warm-up, stable (the whole row), decay:
    `{warmup: [sizes], warmup_steps: N, stable_steps: N, decay: [sizes], decay_steps: N}`;
    the last decay size is the one the model samples with (docs/adaptation.md)."""

    edit_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """LLaDA2.1's editing stream (docs/diffusion.md, Token editing): the share of each row's
    kept tokens (maskable, not masked) replaced by a different token drawn uniformly from
    the tokenizer's non-special tokens; the loss then also covers every kept token, each
    with weight 1 (restore the replaced ones, keep the others), beside the masked ones with
    their `loss_weight`. 0: off (nothing more is drawn). mdlm, llada, bert, sft and bd3lm
    only; decode such a model with `decoder: joint_threshold` (docs/sampling.md)."""

    self_conditioning_prob: float = Field(0.5, ge=0.0, le=1.0)
    """uniform: the probability that a row's second decoder pass is conditioned on the first
    pass's prediction (two-pass self-conditioning, NeMo AutoModel's `self_conditioning_p`;
    docs/diffusion.md, Uniform corruption). 0: one decoder pass, no signal."""

    freeze_router: bool | None = None
    """Keep the MoE routers' parameters fixed (requires_grad False: no gradient, no
    optimizer state), as NeMo AutoModel fine-tunes DiffusionGemma. None: the objective's
    choice, which for `uniform` is frozen when fine-tuning a folder (model.pretrained) and
    trained from scratch, and for every other objective trained; true / false: any MoE
    model."""

    vocab_chunk_size: int = Field(8192, gt=0)
    """Vocabulary columns per chunk in the masked-only cross-entropy (memory vs. speed)."""

    @field_validator("loss_weight")
    @classmethod
    def _loss_weight(cls, value: str) -> str:
        parse_loss_weight(value)
        return value.strip()

    @model_validator(mode="after")
    def _fits_the_objective(self) -> "DiffusionConfig":
        """Settings the objective does not take (what each takes: its registry entry)."""
        spec = objective_spec(self.objective)
        if self.loss_weight.startswith("cart") and not spec.accepts_cart_weights:
            raise ValueError(
                f"loss_weight {self.loss_weight!r} (CART) needs objective: "
                f"{names_that('accepts_cart_weights')}, not {self.objective!r}"
            )
        spec.check_diffusion(self)
        if self.adaptation is not None and not spec.accepts_adaptation:
            raise ValueError(
                f"diffusion.adaptation needs objective {names_that('accepts_adaptation')}, not "
                f"{self.objective!r}"
            )
        if self.block_schedule is not None and not spec.accepts_block_schedule:
            raise ValueError(
                f"diffusion.block_schedule needs objective "
                f"{names_that('accepts_block_schedule')}, not {self.objective!r}"
            )
        if self.adaptation is not None and self.adaptation.shift and self.logit_shift is not None:
            raise ValueError("diffusion.adaptation.shift sets the shift; leave logit_shift unset")
        if self.edit_fraction > 0 and not spec.accepts_edit_fraction:
            raise ValueError(
                f"diffusion.edit_fraction needs objective {names_that('accepts_edit_fraction')}, "
                f"not {self.objective!r}"
            )
        if self.self_conditioning_prob != 0.5 and not spec.canvas_decoder:  # not the default
            raise ValueError(
                f"diffusion.self_conditioning_prob needs objective {names_that('canvas_decoder')}"
                f" (a canvas decoder's self-conditioning), not {self.objective!r}"
            )
        if self.loss_normalization != "auto" and not spec.accepts_loss_normalization:
            raise ValueError(
                f"loss_normalization {self.loss_normalization!r} needs objective "
                f"{names_that('accepts_loss_normalization')}; {self.objective!r} normalizes its "
                "own way (use auto)"
            )
        if self.logit_shift and not spec.accepts_logit_shift:
            raise ValueError(
                f"logit_shift: true needs objective {names_that('accepts_logit_shift')}, not "
                f"{self.objective!r}"
            )
        return self

    @property
    def shifts_logits(self) -> bool:
        """Position i is predicted from the output at i - 1: `logit_shift`, or when it is
        null the objective's default (Dream)."""
        if self.adaptation is not None and self.adaptation.shift:
            return True
        if self.logit_shift is not None:
            return self.logit_shift
        return objective_spec(self.objective).logit_shift_default
