"""The one exception type for bad user input (config, data, checkpoint, CLI), and the one
way a schema's validation error becomes its message.

The CLI turns an InputError into one line on stderr and exit code 2, a RunStopped into one
line and exit code 1, a NothingToTrain into one line and exit code 0; nothing else catches
them. Messages say what is wrong and how to fix it: the key, the path, the expected form.
"""

import difflib
from collections.abc import Callable, Iterable

from pydantic import ValidationError
from pydantic_core import core_schema


class InputError(Exception):
    """Bad input from the user: a config key, a path, a data file, a checkpoint."""


class RunStopped(Exception):
    """A run that cannot go on (non-finite losses, a full disk, a lost peer process): the CLI
    prints its one line, which names the last good checkpoint and what to try, and exits with
    code 1. resume: the CLI ends the line with the command that resumes the run (the user's
    own command line with train.resume_from_checkpoint=true)."""

    def __init__(self, message: str, *, resume: bool = False):
        super().__init__(message)
        self.resume = resume


class NothingToTrain(Exception):
    """A resumed run that has already done what its config asks (final/ written, the
    checkpoint at or past train.max_steps): the CLI prints its one line and exits with code
    0, and nothing in output_dir was changed."""


def did_you_mean(key: str, known: Iterable[str], prefix: str = "") -> str:
    """' (did you mean 'PREFIX+closest'?)' for a misspelled key, or ''."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""


def quoted_choices(names: Iterable[str]) -> str:
    """ "'a', 'b' or 'c'": choices as pydantic lists a Literal's."""
    quoted = [repr(str(name)) for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


class OneOf:
    """pydantic field metadata, `Annotated[str, OneOf(names)]`: the value must be one of
    `names()`, read when a config is validated, so the names a registry gains after the
    schema was defined (a plug-in's) are accepted; refused in pydantic's own words for a
    fixed choice ("Input should be 'a' or 'b'"). docs/configuration.md lists `names()`."""

    def __init__(self, names: Callable[[], Iterable[str]]):
        self.names = names

    def __get_pydantic_core_schema__(self, source, handler):
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def _check(self, value: str) -> str:
        names = tuple(self.names())
        if value not in names:
            raise ValueError(f"Input should be {quoted_choices(names)}")
        return value


def describe_validation_error(
    err: ValidationError,
    what: str = "config key",
    hint: Callable[[tuple[str, ...]], str] | None = None,
) -> str:
    """One line for the first problem of a pydantic ValidationError: an unknown key (with
    `hint(location)` appended, e.g. a did-you-mean) or a bad value and what was given."""
    first = err.errors()[0]
    loc = tuple(str(part) for part in first["loc"])
    dotted = ".".join(loc)
    if first["type"] == "extra_forbidden":
        return f"unknown {what} '{dotted}'" + (hint(loc) if hint else "")
    message = first["msg"].removeprefix("Value error, ")  # our validators' own words
    bound = next(iter(first.get("ctx", {}).values()), None)
    if first["type"] in _BOUNDS and isinstance(bound, int | float):
        shown = bound if isinstance(bound, int) else f"{bound:g}"  # a whole int, a short float
        message = f"must be {_BOUNDS[first['type']]} {shown}"  # Field(ge=1): "must be >= 1"
    if not dotted:
        return f"bad {what}s: {message}"
    got = first.get("input")
    shown = "" if isinstance(got, dict) else f" (got {got!r})"
    return f"bad value for {what} '{dotted}': {message}{shown}"


_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
           "less_than": "<"}  # fmt: skip
