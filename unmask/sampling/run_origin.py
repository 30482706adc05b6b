"""What the run that made a model folder trained with, where sampling depends on it: token
edits (decoder joint_threshold) need a model trained with LLaDA2.1's editing stream
(`diffusion.edit_fraction` > 0, docs/diffusion.md, Token editing). On a model trained
without it, edits turn right answers wrong (docs/sampling.md measures 100% -> 24% exact
match on the quickstart tasks), so `unmask generate` (a stderr line) and `unmask serve`
(the response's `notices`) warn once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from unmask.sampling.config import SamplingConfig
from unmask.sampling.decoders import decoder_class, implied

RUN_CONFIG = "config.yaml"  # a run directory's resolved config (train.output_dir)


def run_tree(model_dir: str | Path) -> dict[str, Any] | None:
    """The resolved config of the run that made a model folder: its own config.yaml (a run's
    output_dir) or its parent's (final/, checkpoint-N/); None when neither holds a readable
    one (an exported or a downloaded folder)."""
    folder = Path(model_dir)
    for candidate in (folder / RUN_CONFIG, folder.parent / RUN_CONFIG):
        try:
            tree = yaml.safe_load(candidate.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        if isinstance(tree, dict):
            return tree
    return None


def trained_edit_fraction(model_dir: str | Path) -> float | None:
    """diffusion.edit_fraction of the run that made the folder (0.0 when its config leaves
    it out: the default), or None when no run config is found."""
    tree = run_tree(model_dir)
    if tree is None:
        return None
    section = tree.get("diffusion")
    value = section.get("edit_fraction", 0.0) if isinstance(section, dict) else 0.0
    return float(value) if isinstance(value, int | float) else None


def editing_notice(config: SamplingConfig, edit_fraction: float | None) -> str | None:
    """The warning for a decoder that edits tokens on a model whose run trained with
    edit_fraction 0, else None (no edits, a model trained for them, or unknown)."""
    if edit_fraction is None or edit_fraction > 0 or not decoder_class(config).edits(config):
        return None  # no edits (joint_threshold's edit_threshold 1 turns them off)
    return (
        f"decoder {implied(config)} edits tokens it committed, but this model's run trained "
        "with diffusion.edit_fraction 0 (it never learned to edit): its edits can turn right "
        "answers wrong (docs/sampling.md measures 100% -> 24% exact match); decode with "
        "the masked decoder, or train with diffusion.edit_fraction > 0"
    )


__all__ = ["editing_notice", "run_tree", "trained_edit_fraction"]
