"""The sampling flags of `unmask generate` and `unmask eval`: one per SamplingConfig field,
typed, documented and (for a choice of names) limited from the field, so the flags, the
generation_config.json entry and the lm-eval model_args are the same set
(tests/unit/test_sampling_options.py). The choices are read when the parser is built, so a
confidence score registered before (`unmask.sampling.register_confidence`) is a
`--remasking` value."""

import argparse
import types
from typing import Literal, Union, get_args, get_origin

import yaml

from unmask.sampling.config import SamplingConfig, option_choices

SAMPLING_GROUP = "sampling options (default: the model folder's generation_config.json)"

# SamplingConfig fields with no flag: the step history is data for the Python API (--show
# draws it).
NO_FLAG = ("history",)
# SamplingConfig fields that are a mapping of names to values: one repeated flag, each
# NAME=VALUE (a plug-in decoder's own options, `--decoder-option stride=2`)
MAPPING_FLAGS = {"decoder_options": "--decoder-option"}


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per SamplingConfig field (--gen-length, --cache, --shift-logits/--no-...),
    typed and documented from the field; every default is None = "not given". Hooks are
    given as --logits-hook module:function. A field whose flag the command already has for
    itself (eval's --row-length) gets no flag there."""
    group = parser.add_argument_group(SAMPLING_GROUP)
    added = []
    for name, field in SamplingConfig.model_fields.items():
        if name in NO_FLAG:
            continue
        flag = "--" + name.replace("_", "-")
        if flag in parser._option_string_actions:
            continue
        added.append(name)
        default = field.get_default()
        doc = (field.description or "").split(". ")[0].rstrip(".")
        help_text = doc if default is None else f"{doc} (built-in default: {default})"
        kind = option_choices(name) or _flag_type(field.annotation)
        if name in MAPPING_FLAGS:
            group.add_argument(MAPPING_FLAGS[name], action="append", type=_name_value,
                               dest=name, metavar="NAME=VALUE", help=help_text)  # fmt: skip
        elif kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, dest=name,
                               help=help_text)  # fmt: skip
        elif isinstance(kind, tuple):
            group.add_argument(flag, choices=kind, dest=name, help=help_text)
        else:
            group.add_argument(flag, type=kind, dest=name, help=help_text)
    parser.set_defaults(sampling_fields=tuple(added))


def _flag_type(annotation):
    """bool, a tuple of choices (Literal), or the scalar type of an `X | None` annotation."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    if get_origin(annotation) in (types.UnionType, Union):
        kinds = [a for a in get_args(annotation) if a is not type(None)]
        words = [w for a in kinds if get_origin(a) is Literal for w in get_args(a)]
        if words:  # a number or a word (--gen-length 64 / auto)
            return _number_or(kinds[0], words)
        annotation = kinds[0]
    return annotation


def _number_or(kind, words: list[str]):
    def parse(text: str):
        return text if text in words else kind(text)

    parse.__name__ = f"{kind.__name__} or {' or '.join(words)}"
    return parse


def _name_value(text: str) -> tuple[str, object]:
    """NAME=VALUE, the value read as a YAML scalar (2 -> int, 0.5 -> float, true -> bool,
    a word -> str)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        parsed = yaml.safe_load(value) if value else value
    except yaml.YAMLError:
        parsed = value
    return name, parsed if isinstance(parsed, (int, float, bool, str)) else value


def sampling_flags(ns: argparse.Namespace) -> dict:
    """The sampling options given on the command line (None = not given; a repeated
    NAME=VALUE flag as a mapping)."""
    out = {name: getattr(ns, name) for name in ns.sampling_fields}
    for name in MAPPING_FLAGS:
        if out.get(name) is not None:
            out[name] = dict(out[name])
    return out
