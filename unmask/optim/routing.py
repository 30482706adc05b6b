"""Which optimizer each trainable parameter gets: Muon, AdamW with decay, AdamW without.

:func:`route_parameters` decides per parameter by module role first, then by name and
shape:

* AdamW without weight decay: 1-D and scalar parameters, biases, the weights of norm layers.
* AdamW with weight decay: embeddings (``nn.Embedding`` weights and anything tied to them),
  the output head (``get_output_embeddings()``), LoRA factors, names containing ``embed``,
  ``lm_head``, ``wte``, ``wpe`` or ``lora``, and parameters with more than three dims.
  Embeddings and the head are decayed like the other matrices, as nanoGPT and the HF
  Trainer do; only norms, biases and 1-D parameters are exempt.
* AdamW with weight decay also: MoE routers (``is_moe_router`` modules, models/moe.py). A
  router's rows are one logit per expert, not a hidden transform; orthogonalizing them would
  force every expert's score direction to equal norm and tie the experts' loads to the
  update rather than to the data (torchtitan and Moonlight keep routers on AdamW). The
  sigmoid routers' expert bias is a buffer, updated by the load rule, never by an optimizer.
* Muon: the remaining 2-D matrices (and 3-D expert stacks, orthogonalized per expert).
* Frozen parameters (``requires_grad=False``) are left out of the optimizer.

``muon_include`` and then ``muon_exclude`` regexes (``re.search`` on the parameter name or
any tied alias) override the rules; the first matching pattern wins.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from unmask.errors import InputError

#: Name fragments that always mean AdamW (the LlamaFactory review list).
ADAMW_NAME_PARTS = ("embed", "lm_head", "wte", "wpe", "lora")

NamedParams = Iterable[tuple[str, nn.Parameter]]


@dataclass
class Routing:
    """Which optimizer each trainable parameter gets, with the reason, by canonical name."""

    muon: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    adamw_decay: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    adamw_no_decay: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """Tensor counts and parameter totals per group, one line each."""
        rows = [
            ("muon", self.muon),
            ("adamw (decay)", self.adamw_decay),
            ("adamw (no decay)", self.adamw_no_decay),
        ]
        lines = ["MuonAdamW parameter split:"]
        for label, named in rows:
            total = sum(p.numel() for _, p in named)
            lines.append(f"  {label:<17}{len(named):>5} tensors {_human(total):>9} params")
        if self.frozen:
            lines.append(f"  {'frozen (skipped)':<17}{len(self.frozen):>5} tensors")
        return "\n".join(lines)


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _is_norm(module: nn.Module) -> bool:
    norm_types: tuple[type, ...] = (
        nn.LayerNorm,
        nn.GroupNorm,
        nn.LocalResponseNorm,
        nn.modules.batchnorm._NormBase,
    )
    if hasattr(nn, "RMSNorm"):
        norm_types += (nn.RMSNorm,)
    return isinstance(module, norm_types) or type(module).__name__.endswith("Norm")


def _module_of(model: nn.Module, getter: str) -> nn.Module | None:
    fn = getattr(model, getter, None)
    if not callable(fn):
        return None
    try:
        module = fn()
    except (NotImplementedError, AttributeError):
        return None
    return module if isinstance(module, nn.Module) else None


def _roles(model: nn.Module) -> tuple[dict[int, set[str]], dict[int, list[str]]]:
    """Per parameter (by id): the roles of the modules owning it, and all its names."""
    roles: dict[int, set[str]] = defaultdict(set)
    aliases: dict[int, list[str]] = defaultdict(list)
    head = _module_of(model, "get_output_embeddings")
    embed = _module_of(model, "get_input_embeddings")
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for leaf, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{leaf}" if mod_name else leaf
            if full not in aliases[id(p)]:
                aliases[id(p)].append(full)
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or module is embed:
                roles[id(p)].add("embedding")
            if module is head:
                roles[id(p)].add("output head")
            if _is_norm(module):
                roles[id(p)].add("norm")
            if getattr(module, "is_moe_router", False):
                roles[id(p)].add("router")
    return roles, aliases


def _first_match(patterns: Sequence[re.Pattern[str]], names: Sequence[str]) -> str | None:
    for pat in patterns:
        if any(pat.search(n) for n in names):
            return pat.pattern
    return None


def _compile(patterns: Iterable[str], what: str) -> list[re.Pattern[str]]:
    compiled = []
    for pat in patterns:
        try:
            compiled.append(re.compile(pat))
        except re.error as err:
            raise InputError(f"{what}: {pat!r} is not a valid regex ({err})") from err
    return compiled


def _default_route(p: Tensor, names: Sequence[str], roles: set[str]) -> tuple[str, str]:
    """(destination, reason) by the rules of the module docstring; destination in muon/decay/no_decay."""
    leaf = names[0].rsplit(".", 1)[-1]
    lowered = [n.lower() for n in names]
    if p.ndim < 2:
        return "no_decay", f"{p.ndim}-D"
    if leaf == "bias" or leaf.endswith("_bias"):
        return "no_decay", "bias"
    if "norm" in roles:
        return "no_decay", "norm"
    if "embedding" in roles:
        tied = " (tied)" if len(names) > 1 else ""
        return "decay", "embedding" + tied
    if "output head" in roles:
        return "decay", "output head"
    if "router" in roles:
        return "decay", "MoE router"
    if len(names) > 1:
        return "decay", "shared by several modules (tied)"
    for part in ADAMW_NAME_PARTS:
        if any(part in n for n in lowered):
            return "decay", f"name contains {part!r}"
    if p.ndim > 3:
        return "decay", f"{p.ndim}-D tensor"
    return "muon", "hidden matrix" if p.ndim == 2 else "expert stack (3-D)"


def route_parameters(
    model_or_named_params: nn.Module | NamedParams,
    muon_include: Iterable[str] = (),
    muon_exclude: Iterable[str] = (),
) -> Routing:
    """Split trainable parameters into Muon, AdamW-with-decay and AdamW-without-decay.

    Args:
        model_or_named_params: a module (module roles are used: embeddings, norms, the
            output head, weights tied between them), or ``(name, param)`` pairs (then only
            names and shapes; pass ``named_parameters(remove_duplicate=False)`` so tied
            weights show every name).
        muon_include: regexes forcing matching 2-D/3-D parameters to Muon; checked first.
        muon_exclude: regexes forcing matching parameters to AdamW.

    Returns:
        A :class:`Routing` in parameter order, each parameter once under its first name.
    """
    include = _compile(muon_include, "muon_include")
    exclude = _compile(muon_exclude, "muon_exclude")
    if isinstance(model_or_named_params, nn.Module):
        model = model_or_named_params
        roles, aliases = _roles(model)
        named = list(model.named_parameters())
    else:
        roles, aliases = defaultdict(set), defaultdict(list)
        named = []
        for name, p in model_or_named_params:
            if not aliases[id(p)]:
                named.append((name, p))
            aliases[id(p)].append(name)
    routing = Routing()
    for name, p in named:
        names = aliases[id(p)] or [name]
        if not p.requires_grad:
            routing.frozen.append(name)
            continue
        dest, reason = _default_route(p, names, roles[id(p)])
        if (pat := _first_match(include, names)) is not None:
            if p.ndim not in (2, 3):
                raise InputError(
                    f"muon_include {pat!r} matches {name!r} of shape {tuple(p.shape)}; Muon "
                    "takes 2-D matrices (or 3-D expert stacks): narrow the pattern"
                )
            dest, reason = "muon", f"muon_include {pat!r}"
        elif (pat := _first_match(exclude, names)) is not None:
            dest = "no_decay" if dest == "no_decay" else "decay"
            reason = f"muon_exclude {pat!r}"
        target = {
            "muon": routing.muon,
            "decay": routing.adamw_decay,
            "no_decay": routing.adamw_no_decay,
        }[dest]
        target.append((name, p))
        routing.reasons[name] = reason
    return routing
