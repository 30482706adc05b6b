"""What every command shares: the parser that turns a bad command line into one line, flag
types, the --base flag, the reference epilogs and the checks of files named by flags."""

import argparse
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from unmask import __version__
from unmask.errors import InputError, did_you_mean

REFERENCE = (
    "Every config key with its default and accepted values: docs/configuration.md "
    "(also `python -m unmask.config`); errors and what to do: docs/troubleshooting.md."
)
SAMPLING_REFERENCE = (
    "Every sampling option (the generation_config.json fields and these flags), the kinds of "
    "model folder read, and the likelihood estimator: docs/sampling.md; errors and what to "
    "do: docs/troubleshooting.md."
)


def version_line() -> str:
    """'unmask X (torch Y)', read from the installed packages' metadata (no torch import)."""
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    return f"unmask {__version__} (torch {torch_version})"


class UsageError(Exception):
    """A command line argparse refuses; main turns it into one line and exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line naming the --help to read, not the
    usage block followed by a SystemExit."""

    def error(self, message: str):
        raise UsageError(f"{choice_hint(message)}; see `{self.prog} --help`")


def choice_hint(message: str) -> str:
    """argparse's "invalid choice: 'X' (choose from ...)" with "did you mean 'Y'?" after X
    when a choice is close (a misspelled --decoder, --remasking, ...); else message."""
    found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if not found:
        return message
    choices = re.findall(r"'([^']*)'", found.group(2))
    hint = did_you_mean(found.group(1), choices)
    if not hint:
        return message
    at = found.start(1) + len(found.group(1)) + 1  # after the closing quote
    return message[:at] + hint + message[at:]


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"must be a whole number >= {least} (got {text!r})")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    return _whole_number(text, 1)


def nonnegative_int(text: str) -> int:
    """An argparse type: a whole number >= 0."""
    return _whole_number(text, 0)


def add_base_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", metavar="FOLDER", help="base model folder of an unmerged "
                        "LoRA adapter (default: the one the adapter records)")  # fmt: skip


def check_out_file(path: Path) -> None:
    """--out can be written once the samples are done (checked before the model loads)."""
    if path.is_dir():
        raise InputError(f"--out {str(path)!r} is a folder; give the path of a jsonl file")
    if not path.parent.is_dir():
        raise InputError(f"--out {str(path)!r}: folder {str(path.parent)!r} does not exist")


def read_text(path: Path, flag: str) -> str:
    """A UTF-8 text file given as `flag`; anything else is an InputError naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise InputError(
            f"{flag} {str(path)!r} is not UTF-8 text ({err.reason} at byte {err.start}); "
            "give a text file"
        ) from None
