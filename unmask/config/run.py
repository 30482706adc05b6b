"""One YAML file = one run: the schema, loading, command-line overrides, error messages.

Each component owns its section class (models.ModelConfig, data.DataConfig, ...; the
training loop's is config/train.py, the held-out generation's config/eval.py); this module
composes them, translates seed schemas (compat/), applies `section.key=value` overrides and
turns validation errors into one line that names the key and the nearest valid one.
"""

import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from unmask.config.compat import sections_to_tree, translate
from unmask.config.eval import EvalConfig, moved_key_notices
from unmask.config.foreign import FOREIGN_KEYS
from unmask.config.parallel import ParallelConfig
from unmask.config.train import TrainConfig
from unmask.data.config import DataConfig
from unmask.diffusion.config import DiffusionConfig
from unmask.diffusion.registry import RUN_CHECKS, objective_spec
from unmask.errors import InputError, OneOf, describe_validation_error, did_you_mean
from unmask.models.config import ModelConfig
from unmask.optim.config import OptimConfig
from unmask.posttrain import (  # also registers grpo, preference, distill
    DistillConfig,
    GRPOConfig,
    PreferenceConfig,
)

QUICKSTART = "quickstart.yaml"


class RunConfig(BaseModel):
    """A complete run: one section per component."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The network: architecture fields or a local pretrained folder."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Where the text comes from, the tokenizer, and how rows are built."""
    diffusion: DiffusionConfig = Field(default_factory=DiffusionConfig)
    """The forward (noising) process and the training objective."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer (AdamW or Muon + AdamW) and learning-rate schedule."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """The training loop, logging and checkpoints."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """The layout over the processes: FSDP2, data, tensor, sequence, context, expert and
    pipeline parallelism (these keys were train.* keys; written there they are still read,
    with a notice)."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Generation-based evaluation after training."""
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    """diffusion.objective grpo: rollouts, advantages, policy loss and likelihood estimator."""
    rewards: list[dict[str, Any]] = Field(default_factory=list)
    """Reward functions of a grpo run: `[{fn: exact_match}, {fn: my.module:score, weight:
    0.5}]` (built-in names or module:function; unmask.rewards)."""
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    """diffusion.objective: preference: DPO on ELBO estimates (beta, samples, noise)."""
    distill: DistillConfig = Field(default_factory=DistillConfig)
    """diffusion.objective: distill: the teacher folder and the method (certainty_forcing,
    trajectory)."""

    _notices: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _objective_fits_the_run(self) -> "RunConfig":
        """The objective's own checks of the other sections (grpo: rewards, unpacked rows)."""
        objective_spec(self.diffusion.objective).check_run(self)
        for check in RUN_CHECKS:  # settings any objective may take (diffusion.adaptation)
            check(self)
        return self

    @property
    def notices(self) -> list[str]:
        """Lines about the config file itself that the trainer prints once at start-up (a
        seed config's keys accepted with no effect, and what unmask does instead)."""
        return self._notices


def _model_at(model: type[BaseModel], path: tuple) -> type[BaseModel] | None:
    """The pydantic class that owns the key at `path` (all but its last element)."""
    for part in path[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type):
            return None
        if not issubclass(field.annotation, BaseModel):
            return None
        model = field.annotation
    return model


def _suggest(loc: tuple[str, ...]) -> str:
    """' (did you mean ...?)' for an unknown key at loc: the unmask key a name from another
    tool means (foreign.py: `optim.lr` -> `optim.learning_rate`), else the nearest key of its
    own section, else the section that has it."""
    if len(loc) <= 2 and loc[-1] in FOREIGN_KEYS:  # a section's key, or a section
        return f" (did you mean '{FOREIGN_KEYS[loc[-1]]}'?)"
    owner = _model_at(RunConfig, loc) or RunConfig
    prefix = ".".join(loc[:-1])
    hint = did_you_mean(loc[-1], owner.model_fields, prefix + "." if prefix else "")
    if hint:
        return hint
    for name, field in RunConfig.model_fields.items():
        if loc[-1] in getattr(field.annotation, "model_fields", {}):
            return f" (it belongs in section '{name}': '{name}.{loc[-1]}')"
    for name, field in RunConfig.model_fields.items():  # a sampler's: eval.sampling.temperature
        for sub, inner in getattr(field.annotation, "model_fields", {}).items():
            if loc[-1] in getattr(inner.annotation, "model_fields", {}):
                return f" (it belongs in '{name}.{sub}': '{name}.{sub}.{loc[-1]}')"
    return ""


def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.max_steps=10' -> (['train', 'max_steps'], 10); values are YAML scalars."""
    if "=" not in text:
        raise InputError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise InputError(f"override {text!r} has an empty key part; write section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_override(tree: dict, parts: list[str], value: Any) -> None:
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise InputError(f"cannot set '{'.'.join(parts)}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"config file {str(path)!r} does not exist; pass a YAML file path")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise InputError(f"config file {str(path)!r} is not valid YAML{where}") from None
    if data is None:  # an empty file (or only comments) is a mistake, not the defaults
        raise InputError(
            f"config file {str(path)!r} is empty; write the run's sections into it (model:, "
            "data:, train:, ...; see configs/), or run `unmask train` without a file for the "
            "quickstart"
        )
    if isinstance(data, list) and data and all(isinstance(e, dict) for e in data):
        # LMMs-Engine's list of sections (- type: trainer)
        return sections_to_tree(data, repr(str(path)))
    if not isinstance(data, dict):
        raise InputError(f"config file {str(path)!r} must hold a mapping of sections")
    return data


def quickstart_yaml() -> str:
    return resources.files("unmask.config").joinpath(QUICKSTART).read_text()


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (the packaged quickstart when `path` is None), apply overrides, validate."""
    tree = read_yaml(path) if path is not None else yaml.safe_load(quickstart_yaml())
    moved = move_parallel_keys(tree)  # the file's train.* layout keys
    for text in overrides or []:
        apply_override(tree, *parse_override(text))
        # an override of a moved key wins over the file's value, in either spelling
        moved += [key for key in move_parallel_keys(tree, overwrite=True) if key not in moved]
    translated = translate(tree)  # seed schemas (LMMs-Engine, Transformer Lab)
    train = translated.tree.get("train")
    if path is not None and (train is None or isinstance(train, dict)):
        # each config file gets its own run directory unless it names one
        translated.tree.setdefault("train", {}).setdefault("output_dir", default_output_dir(path))
    return validate_tree(translated.tree, [*translated.notices, *moved_notice(moved)])


def default_output_dir(path: str | Path) -> str:
    """runs/<the config file's name without its extension>."""
    return f"runs/{Path(path).stem}"


def validate_tree(tree: dict, notices: list[str] | tuple = ()) -> RunConfig:
    """The RunConfig of unmask's own tree; `notices` become its start-up lines (with those
    of keys that moved: config/eval.py's, and the train.* keys now in `parallel:`)."""
    moved = moved_notice(move_parallel_keys(tree))
    try:
        cfg = RunConfig.model_validate(tree)
    except ValidationError as err:
        raise InputError(describe_validation_error(err, "config key", _suggest)) from None
    cfg._notices = [*notices, *moved_key_notices(tree), *moved]
    return cfg


def move_parallel_keys(tree: dict, overwrite: bool = False) -> list[str]:
    """Keys of the `parallel:` section written under `train:` (where they were before the
    section existed) moved there, in place; returns their names. A key given in both
    places: InputError (one file saying two things), or with `overwrite` (a command-line
    override of the old spelling, which is newer than the file) the train one wins."""
    train, parallel = tree.get("train"), tree.get("parallel")
    if not isinstance(train, dict):
        return []
    moved = [key for key in ParallelConfig.model_fields if key in train]
    if not moved:
        return []
    if parallel is None:
        parallel = tree["parallel"] = {}
    if not isinstance(parallel, dict):
        return []  # validation names the bad section
    for key in moved:
        if key in parallel and not overwrite:
            raise InputError(f"train.{key} and parallel.{key} are both given; the key moved to "
                             f"parallel.{key}: keep that one")  # fmt: skip
        parallel[key] = train.pop(key)
    return moved


def moved_notice(keys: list[str]) -> list[str]:
    """The start-up line naming the layout keys read from `train:` (none for none)."""
    if not keys:
        return []
    listed = ", ".join(f"train.{key} -> parallel.{key}" for key in keys)
    return [f"unmask: config keys that moved, read under their new name (write them there): "
            f"{listed}"]  # fmt: skip


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML, readable back by load_config."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


_BOUND_SIGNS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def accepted_values(field) -> str:
    """What a key accepts, from its annotation and constraints: the names of a choice key
    (`a`, `b`), true/false, or the type with its bounds (int >= 1); `null` when optional."""
    annotation = field.annotation
    args = typing.get_args(annotation)
    optional = type(None) in args
    kinds = [a for a in args if a is not type(None)] if optional else [annotation]
    parts = [_kind_text(kind) for kind in kinds]
    for item in field.metadata:  # a choice read from a registry (diffusion.objective)
        if isinstance(item, OneOf):
            parts = [", ".join(f"`{choice}`" for choice in item.names())]
    bounds = [
        f"{sign} {getattr(item, attr):g}"
        for item in field.metadata
        for attr, sign in _BOUND_SIGNS.items()
        if isinstance(getattr(item, attr, None), int | float)
    ]
    text = ", ".join(parts)
    if bounds:
        text += " " + ", ".join(bounds)
    if optional:
        text += ", `null`"
    return text.replace("|", "\\|")


def _kind_text(kind) -> str:
    if typing.get_origin(kind) is Literal:
        return ", ".join(f"`{choice}`" for choice in typing.get_args(kind))
    if kind is bool:
        return "`true`, `false`"
    if typing.get_origin(kind) is list:
        (inner,) = typing.get_args(kind) or (Any,)
        return f"list of {_kind_text(inner)}" if inner is not Any else "list"
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return ", ".join(_kind_text(k) for k in typing.get_args(kind))
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


def reference_markdown() -> str:
    """docs/configuration.md's key tables, generated from the field docstrings."""
    lines = [
        "# Configuration reference",
        "",
        "One YAML file describes one run. Every key below can be overridden on the command",
        "line as `section.key=value` (values are YAML scalars: `train.bf16=true`,",
        "`optim.learning_rate=3e-4`). An unknown key is an error naming the nearest valid",
        "key. The resolved config is written to `output_dir/config.yaml`.",
        "",
        "This page is generated from the code (`python -m unmask.config > docs/configuration.md`);",
        "a test keeps it in sync.",
        "",
    ]
    for name, field in RunConfig.model_fields.items():
        section = field.annotation
        lines += [f"## `{name}`", "", field.description or "", ""]
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            lines += [f"Accepted: {accepted_values(field)}; default `[]`.", ""]
            continue  # a top-level list (rewards)
        lines += ["| key | default | accepted | meaning |", "| --- | --- | --- | --- |"]
        for key, sub in section.model_fields.items():
            default = sub.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):  # a nested section: its own keys
                default = default.model_dump(mode="json", exclude_defaults=True)
            shown = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...")
            meaning = (sub.description or "").replace("\n", " ").replace("|", "\\|")
            lines.append(f"| `{key}` | `{shown.strip()}` | {accepted_values(sub)} | {meaning} |")
        lines.append("")
    return "\n".join(lines)
