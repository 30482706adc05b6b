"""`unmask eval --tasks --preset`: how a base and an instruct model are scored.

Diffusion LMs are evaluated two ways (LLaDA's evaluation, docs/sampling.md, Evaluating on
lm-eval tasks):

- `base`: a pretrained model is scored by likelihood. Multiple-choice tasks
  (lm-eval `loglikelihood` requests) pick the choice with the highest Monte Carlo ELBO
  (`unmask.sampling.likelihood.answer_log_likelihood`) with 128 rows per choice, LLaDA's
  `mc_num=128` for its base-model tables; no chat template; greedy-match checking off (LLaDA
  runs `is_check_greedy=False`). Generation tasks run on the plain prompt.
- `instruct`: an instruction-tuned model is scored by generation with the chat template
  (lm-eval's `apply_chat_template`): greedy (temperature 0), LLaDA's low-confidence
  remasking and semi-autoregressive blocks of 32 tokens, the settings of LLaDA's instruct
  evaluation (steps: the folder's, else one token per step, steps = gen_length). Likelihood tasks are refused:
  the score of a choice after a chat template's assistant header is not what instruct
  tables report (use a task's generative variant, or `--preset base`).

Presets are defaults: a model folder's own settings that sampling must match (Dream's logit
shift, a block-causal model's block size) are kept, and every flag given on the command
line wins over the preset.
"""

from dataclasses import dataclass, field
from typing import Any

#: what each preset scores by, for messages and the results file
MODES = {"base": "likelihood", "instruct": "generation"}


@dataclass(frozen=True)
class Preset:
    """A bundle of evaluation defaults (module docstring)."""

    name: str
    chat_template: bool  # apply the tokenizer's chat template to every request
    likelihood_tasks: bool  # loglikelihood / loglikelihood_rolling requests allowed
    mc_num: int  # Monte Carlo rows per scored continuation
    mc_batch_size: int  # rows per forward pass (one independent draw)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingConfig defaults

    @property
    def mode(self) -> str:
        return MODES[self.name]


PRESETS = {
    "base": Preset("base", chat_template=False, likelihood_tasks=True, mc_num=128,
                   mc_batch_size=32, sampling={"temperature": 0.0}),
    "instruct": Preset("instruct", chat_template=True, likelihood_tasks=False, mc_num=128,
                       mc_batch_size=32,
                       sampling={"temperature": 0.0, "remasking": "low_confidence",
                                 "block_length": 32}),
}  # fmt: skip


def preset_sampling(preset: Preset, saved: dict[str, Any]) -> dict[str, Any]:
    """The preset's sampling defaults less what the model folder fixes by training: a
    block-causal (bd3lm) model keeps the block size it was trained with, and a
    uniform-canvas one (DiffusionGemma) takes none of the masked decoders' options."""
    if saved.get("uniform_canvas"):
        return {}
    options = dict(preset.sampling)
    if saved.get("block_causal"):
        options.pop("block_length", None)
    return options
