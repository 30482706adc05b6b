"""The one registry of training objectives: `diffusion.objective` names -> how to build them
and what each one accepts, needs and fixes.

Every objective registers itself where it is defined (`register_objective(ObjectiveSpec(...))`
at the bottom of its module): mdlm, llada and bert in objectives.py, sft, dream and bd3lm in
recipes.py, grpo and preference in unmask.posttrain (importing `unmask.posttrain` registers
them; config/run.py does, so every RunConfig knows all of them). A package outside unmask
registers its own the same way before its config is validated. The config's accepted
choices (`DiffusionConfig.objective`, docs/configuration.md), its validators, the trainer,
the sampler's fixed options and context parallelism read each objective's facts from here,
never by comparing names.

This module is the bottom of diffusion/: it imports nothing of unmask, so every layer above
can read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ObjectiveContext:
    """What a builder may use beside its own settings. The pretraining objectives read
    `diffusion`, `mask_id` and `eos_id` only; post-training ones read their sections of the
    whole run (`run`: the RunConfig: grpo, rewards, preference, model, data)."""

    diffusion: Any
    """The `diffusion:` section (a DiffusionConfig)."""
    mask_id: int
    """The tokenizer's mask token id."""
    eos_id: int | None = None
    """The EOS id: where answers end (`loss_normalization: answer`, rollouts)."""
    run: Any = None
    """The whole RunConfig, when building for a run (None: a diffusion objective alone)."""
    tokenizer: Any = None
    """The run's tokenizer (rollouts decode completions for the rewards)."""
    starting_model: Callable[[], Any] | None = None
    """Builds another copy of the model as the run starts (same seed and init_from), for an
    objective that holds a frozen reference (preference without LoRA)."""
    notices: list[str] = field(default_factory=list)
    """Lines the objective wants shown at start-up (the trainer prints them)."""


def _nothing(*args) -> None:
    return None


def _fixes_nothing(diffusion) -> dict[str, Any]:
    return {}


def always(diffusion) -> bool:
    """A capability that holds for any settings of the `diffusion:` section."""
    return True


@dataclass(frozen=True)
class ObjectiveSpec:
    """One registered objective: its builder and what it declares. Everything but `name`
    and `build` has the default a plain masked-diffusion objective wants."""

    name: str
    """The `diffusion.objective` value."""
    build: Callable[[ObjectiveContext], Any]
    """context -> the objective (an `Objective`, objectives.py)."""
    accepts_loss_normalization: bool = False
    """Takes `diffusion.loss_normalization` other than auto (token / answer / answer_padded)."""
    accepts_logit_shift: bool = False
    """Takes `diffusion.logit_shift: true` (predict position i from the output at i - 1)."""
    logit_shift_default: bool = False
    """What `diffusion.logit_shift: null` means for it (Dream: true)."""
    accepts_cart_weights: bool = False
    """Takes Dream's CART loss weight (`diffusion.loss_weight: cart[...]`)."""
    accepts_context_parallel: bool = False
    """Trains under parallel.context_parallel > 1: each row's noise drawn on its own
    (`global_noise`) and one global token count (rows cut in slices lose per-row sums)."""
    accepts_pipeline_parallel: Callable[[Any], bool] | None = None
    """Trains under parallel.pipeline_parallel > 1 with this DiffusionConfig (-> True): its
    `count(batch)` says the normalizer before the forward, and its loss is one call of the
    model with targets, which the pipeline runs over its stages. None: never (a loss of
    several calls, or of a reference model: grpo, preference). `always` for any settings."""
    fixed_sampling: Callable[[Any], dict[str, Any]] = _fixes_nothing
    """DiffusionConfig -> the sampling options (SamplingConfig fields) a model trained with
    it must be sampled with, beside the logit shift (bd3lm: block-causal attention). Every
    checkpoint's generation_config.json carries them."""
    check_diffusion: Callable[[Any], None] = _nothing
    """DiffusionConfig -> None; ValueError (one line) for settings of the section it cannot
    take beyond the declared ones above."""
    check_run: Callable[[Any], None] = _nothing
    """RunConfig -> None; ValueError (one line) for settings of other sections it cannot
    work with (grpo: rewards, unpacked rows)."""
    check_rows: Callable[[Any, Any, Any], None] = _nothing
    """(RunConfig, tokenizer, training rows) -> None, before the run writes anything;
    InputError for input only the data shows (grpo: the rewards run on the first rows)."""
    datasets: Callable[[Any, Any, Any], Any] | None = None
    """(RunConfig, tokenizer, tokenizer as loaded) -> unmask.data.Datasets, for an objective
    that trains on rows of its own kind (preference: chosen/rejected pairs); None: the
    `data:` section's rows (unmask.data.build_datasets)."""
    accepts_adaptation: bool = False
    """Takes `diffusion.adaptation` (adaptation.py): its model called with an annealed
    mask and the shift (a masked objective that calls the model through
    `weighted_token_loss` with no mask of its own)."""
    accepts_block_schedule: bool = False
    """Takes `diffusion.block_schedule`: reads `cfg.block_size` at each call (bd3lm)."""
    accepts_edit_fraction: bool = False
    """Takes `diffusion.edit_fraction` > 0 (LLaDA2.1's editing stream: kept tokens replaced
    by random ones, every kept token in the loss; a masked objective whose noise goes through
    `MaskedDiffusionObjective.edit`)."""
    canvas_decoder: bool = False
    """Trains a prompt encoder + canvas decoder without a [MASK] token (a family whose
    models/shape.py `ModelShape.canvas_decoder` is True: DiffusionGemma) and no other family;
    False: the one-row forward of the other families, with the tokenizer's mask token. The
    trainer and `unmask plan` refuse a pairing of the two kinds in one line."""
    head_share: float | None = None
    """Share of a row's tokens its loss runs the LM head on, for `unmask plan`'s FLOPs and
    head gradients (None: a masked objective's expectation, 1/2 under t ~ U(0, 1); ar: 1,
    every token has a next-token target)."""
    explicit_mask: bool = False
    """Calls the model with an explicit (B, 1, L, L) attention mask, which runs through
    sdpa with a dense mask on every device (ar's causal mask): `unmask plan` counts the
    mask's copy each attention saves."""
    heldout_examples: Callable[[Any, Any], list[tuple[str, str]]] | None = None
    """(DataConfig, tokenizer) -> held-out (prompt, answer) pairs for eval.generate_accuracy;
    None: the data's own (unmask.data.heldout_examples)."""


OBJECTIVES: dict[str, ObjectiveSpec] = {}
"""Every registered objective by name, in registration order (the order the config's
choices are listed in)."""


OBJECTIVE_WRAPPERS: list[Callable[[ObjectiveContext, Any], Any]] = []
"""(context, objective) -> objective, applied by `build_objective` in order: settings of
the diffusion section that act on any objective that accepts them (adaptation.py)."""

RUN_CHECKS: list[Callable[[Any], None]] = []
"""RunConfig -> None; ValueError (one line): checks of those settings against the whole
run, called by RunConfig's validation beside the objective's own `check_run`."""


def register_objective_wrapper(wrap: Callable[[ObjectiveContext, Any], Any]) -> None:
    """Add a wrapper `build_objective` applies (once per function)."""
    if wrap not in OBJECTIVE_WRAPPERS:
        OBJECTIVE_WRAPPERS.append(wrap)


def register_run_check(check: Callable[[Any], None]) -> None:
    """Add a check RunConfig's validation calls (once per function)."""
    if check not in RUN_CHECKS:
        RUN_CHECKS.append(check)


def register_objective(spec: ObjectiveSpec) -> ObjectiveSpec:
    """Add an objective (its name becomes a valid `diffusion.objective`); registering a name
    again replaces its entry (a module imported twice). Returns the spec."""
    OBJECTIVES[spec.name] = spec
    return spec


def objective_names() -> tuple[str, ...]:
    """The registered names: the choices of `diffusion.objective`."""
    return tuple(OBJECTIVES)


def objective_spec(name: str) -> ObjectiveSpec:
    """The registered objective `name`; ValueError naming the choices otherwise."""
    spec = OBJECTIVES.get(name)
    if spec is None:
        raise ValueError(f"unknown objective {name!r}; expected one of {list(OBJECTIVES)}")
    return spec


def head_share(name: str) -> float:
    """The share of a row's tokens objective `name`'s loss runs the LM head on: its
    registry entry's `head_share`, else a masked objective's expectation, 1/2."""
    share = objective_spec(name).head_share
    return 0.5 if share is None else share


def names_that(capability: str) -> str:
    """'a, b or c': the registered objectives whose spec sets `capability` (a flag field)."""
    names = [name for name, spec in OBJECTIVES.items() if getattr(spec, capability)]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def build_objective(cfg, mask_id: int, eos_id: int | None = None, **needs):
    """The objective named by `cfg.objective` (cfg: a DiffusionConfig), masking with token
    `mask_id`; eos_id marks where answers end (`loss_normalization: answer`). `needs`: the
    rest of an `ObjectiveContext` (run, tokenizer, starting_model, notices) for objectives
    that read more than the diffusion section."""
    context = ObjectiveContext(cfg, mask_id, eos_id, **needs)
    objective = objective_spec(cfg.objective).build(context)
    for wrap in OBJECTIVE_WRAPPERS:
        objective = wrap(context, objective)
    return objective
