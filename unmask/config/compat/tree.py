"""What both seed-schema adapters share: the translated tree and its start-up notices,
writing one unmask key, merging, and the one-line refusals."""

from dataclasses import dataclass, field
from typing import Any

from unmask.errors import InputError, did_you_mean


@dataclass
class Translated:
    """unmask's own tree for a config file, and the lines to print once at start-up about
    the file itself (seed keys accepted with no effect and what unmask does instead)."""

    tree: dict
    notices: list[str] = field(default_factory=list)


@dataclass
class NoEffect:
    """Seed keys accepted with no effect, each with what unmask does instead, in file order."""

    entries: dict[str, str] = field(default_factory=dict)

    def add(self, key: str, instead: str) -> None:
        self.entries.setdefault(key, instead)

    def line(self) -> str | None:
        """The one start-up line naming every such key, or None when there is none."""
        if not self.entries:
            return None
        listed = "; ".join(f"{key} ({instead})" for key, instead in self.entries.items())
        return (
            f"unmask: seed config keys accepted with no effect (what unmask does instead): {listed}"
        )


def put(out: dict, section: str, key: str, value: Any) -> None:
    """Set unmask key `section.key` in the translated tree."""
    out.setdefault(section, {})[key] = value


def merge(base: dict, top: dict) -> dict:
    """base updated by top, recursively (top wins)."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def mapping(value: Any, where: str) -> dict:
    """A seed section's mapping (None = empty); anything else is one line naming it."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InputError(f"seed config field '{where}' must be a mapping, got {value!r}")
    return value


def unsupported(where: str, key: str, known=()) -> InputError:
    """A seed key unmask does not know: one line naming it and the nearest known key."""
    hint = did_you_mean(key, known)
    return InputError(f"seed config field '{where}{key}' is not supported by unmask{hint}")


def refused(key: str, value: Any, reason: str) -> InputError:
    """A seed key unmask knows but cannot do with this value: one line with the reason."""
    return InputError(f"seed config field '{key}: {value}' is not supported: {reason}")
