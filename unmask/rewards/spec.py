"""The `rewards:` list of a run config: which reward functions score a completion, with what
weight and under which limits (docs/rewards.md).

Parsing never imports a user module: that happens in a worker process (RewardSet.check).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from unmask.errors import InputError, describe_validation_error, did_you_mean


class ExactMatchOptions(BaseModel):
    """Options of the `exact_match` reward."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    answer_key: str | None = None
    """Record key of the reference answer (None = the first of answer, target, response,
    completion, solution that the record has)."""
    ignore_case: bool = False
    """Compare case-insensitively."""


class NumericMatchOptions(BaseModel):
    """Options of the `numeric_match` reward."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    answer_key: str | None = None
    """Record key of the reference answer (None = as exact_match); its number is extracted
    the same way as the completion's (so a GSM8K answer ending in `#### 72` works)."""
    tolerance: float = Field(0.0, ge=0)
    """Largest absolute difference that still matches (0 = exact, compared as fractions)."""


class FormatOptions(BaseModel):
    """Options of the `format` reward."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    pattern: str
    """Regular expression (Python `re` syntax) the stripped completion must match."""
    match: Literal["fullmatch", "search"] = "fullmatch"
    """fullmatch: the whole stripped completion; search: anywhere in it."""
    dotall: bool = True
    """`.` also matches newlines (re.DOTALL)."""

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as err:
            raise ValueError(f"not a valid regular expression ({err})") from None
        return v


class CodeOptions(BaseModel):
    """Options of the `code` reward."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    tests_key: str = "tests"
    """Record key of the tests: Python source with asserts, or a list of such sources (one
    test each)."""
    entry_key: str = "entry"
    """Record key of the entry point's name (optional in a record): when the record has it,
    the tests' `check(candidate)` is called with that function (HumanEval's layout)."""
    partial: bool = False
    """Score the fraction of tests that pass instead of 1.0 only when all pass (each list
    item, or each top-level assert of a source, is one test)."""
    test_timeout_s: float | None = Field(None, gt=0)
    """Time limit of each test (partial scoring); the call's timeout_s still bounds the
    whole call."""
    extract_code: bool = True
    """Run the first ``` fenced block of the completion when it has one, else all of it."""


#: built-in rewards and their options; exact_match, numeric_match and format run in the
#: training process (they run no user code), code runs in a worker process
BUILTINS: dict[str, type[BaseModel]] = {
    "exact_match": ExactMatchOptions,
    "numeric_match": NumericMatchOptions,
    "format": FormatOptions,
    "code": CodeOptions,
}
_USER_FN = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class RewardSpec(BaseModel):
    """One reward: a built-in or a user function `fn(prompt, completion, record) -> float`."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    fn: str
    """A built-in reward (exact_match, numeric_match, format, code) or `module:function`,
    imported in a worker process from the directory unmask runs in or PYTHONPATH."""
    weight: float = 1.0
    """Weight of this reward in the total (negative = a penalty)."""
    name: str | None = None
    """Name in logs and metrics (None = the built-in's name, or the function's name)."""
    timeout_s: float = Field(5.0, gt=0)
    """Wall-clock limit of one call (user functions and code): a call that runs longer is
    stopped and scored 0."""
    memory_mb: int = Field(1024, ge=32)
    """Memory limit of the worker process that makes the calls (its private writable memory,
    interpreter and imports included): a call that needs more is stopped and scored 0."""
    parallel_calls: int = Field(4, ge=1)
    """Calls of this reward that run at once, each in its own process."""
    options: dict[str, Any] = {}
    """Options of a built-in reward (docs/rewards.md lists them); user functions take none."""
    network: bool = False
    """Let the reward's calls use the network (a judge behind an API). Off: the worker has
    no network at all, 127.0.0.1 included, where the kernel allows it."""
    env: list[str] = []
    """Names of environment variables the worker gets from the training process besides the
    allow-list (an API key for a judge); no other variable reaches it."""

    @field_validator("weight")
    @classmethod
    def _finite(cls, v: float) -> float:
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError("must be a finite number")
        return v

    @property
    def builtin(self) -> bool:
        return self.fn in BUILTINS

    @property
    def runs_user_code(self) -> bool:
        """User functions and the code reward run in a worker process, never in this one."""
        return not self.builtin or self.fn == "code"

    @property
    def label(self) -> str:
        return self.name or (self.fn if self.builtin else self.fn.rsplit(":", 1)[1].split(".")[-1])


def _located(err: ValidationError, where: str, fields) -> str:
    """describe_validation_error's line with the key written as `where.key`, and a
    did-you-mean among `fields` for an unknown key."""
    dotted = ".".join(str(part) for part in err.errors()[0]["loc"])
    line = describe_validation_error(err, hint=lambda loc: did_you_mean(loc[0], fields))
    return line.replace(f"'{dotted}'", f"'{where}.{dotted}'", 1)


def parse_rewards(raw: Any) -> list[RewardSpec]:
    """The config's `rewards:` list as RewardSpecs; each item a mapping with at least `fn`,
    or a bare string as shorthand for `{fn: STRING}`. Raises InputError naming
    `rewards[i].key` and how to fix it."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InputError(
            f"rewards must be a list like [{{fn: numeric_match}}, {{fn: module:function}}], "
            f"got {type(raw).__name__} {raw!r}"
        )
    specs = []
    for i, item in enumerate(raw):
        where = f"rewards[{i}]"
        if isinstance(item, str):
            item = {"fn": item}
        if not isinstance(item, dict):
            raise InputError(
                f"{where} must be a mapping like {{fn: numeric_match, weight: 1.0}}, "
                f"got {type(item).__name__} {item!r}"
            )
        try:
            spec = RewardSpec(**item)
        except ValidationError as err:
            raise InputError(_located(err, where, RewardSpec.model_fields)) from None
        _check_fn(spec, where)
        specs.append(spec)
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if spec.label in seen:
            raise InputError(
                f"rewards[{i}] and rewards[{seen[spec.label]}] are both named "
                f"'{spec.label}': give one of them a `name:`"
            )
        seen[spec.label] = i
    return specs


def _check_fn(spec: RewardSpec, where: str) -> None:
    if spec.builtin:
        try:
            spec.options = BUILTINS[spec.fn](**spec.options).model_dump()
        except ValidationError as err:
            fields = BUILTINS[spec.fn].model_fields
            raise InputError(_located(err, f"{where}.options", fields)) from None
        return
    if not _USER_FN.fullmatch(spec.fn):
        raise InputError(
            f"{where}.fn: '{spec.fn}' is neither a built-in reward ({', '.join(BUILTINS)})"
            f"{did_you_mean(spec.fn, BUILTINS)} nor module:function (e.g. my_rewards:score)"
        )
    if spec.options:
        raise InputError(
            f"{where}.options: options are for built-in rewards; a user function is called "
            f"as fn(prompt, completion, record): remove options or read them from the record"
        )
