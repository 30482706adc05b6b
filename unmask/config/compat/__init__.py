"""Seed-schema adapters: configs written for LMMs-Engine's DLLM recipe (lmms_engine.py) and
for Transformer Lab's Diffusion LLM Trainer plugin (transformer_lab.py).

`translate(tree)` turns such a YAML tree into unmask's own tree before validation, with the
start-up notices about the file: every seed field is mapped onto an unmask key, accepted
with no effect (one start-up line lists those keys and what unmask does instead) or refused
with an InputError naming it and the reason. Native sections (model/data/...) may sit
beside seed fields; where both set one key, the native value wins.

`sections_to_tree` reads LMMs-Engine's other layout, a list of sections
(`- type: trainer` + `config:`), as the sections-at-the-top tree `translate` takes.
"""

from unmask.config.compat.lmms_engine import LMMS_KEYS, from_lmms_engine, sections_to_tree
from unmask.config.compat.transformer_lab import TL_KEYS, TRAINING_METHODS, from_transformer_lab
from unmask.config.compat.tree import Translated, mapping, merge

__all__ = ["TRAINING_METHODS", "Translated", "sections_to_tree", "translate"]


def translate(tree: dict) -> Translated:
    """unmask's own tree for a tree in any accepted schema (a native tree passes unchanged,
    the same object) and the notices to print at start-up."""
    lmms = any(key in tree for key in LMMS_KEYS)
    tl = any(key in tree for key in TL_KEYS)
    if not (lmms or tl):
        return Translated(tree)
    out: dict = {}
    notices = []
    if lmms:
        native = mapping(tree.get("model"), "model")
        line = from_lmms_engine(tree, out, native).line()
        notices += [line] if line else []
    if tl:
        from_transformer_lab(tree, out)
    rest = {k: v for k, v in tree.items() if k not in LMMS_KEYS and k not in TL_KEYS}
    return Translated(merge(out, rest), notices)
