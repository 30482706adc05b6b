"""Which optimizer each trainable parameter gets: Muon, AdamW with decay, AdamW without.

:func:`route_parameters` decides per parameter by module role first, then by name and
shape:

* AdamW without weight decay: 1-D and scalar parameters, biases, the weights of norm layers.
* AdamW with weight decay: embeddings (``nn.Embedding`` weights and anything tied to them),
  the output layer, LoRA factors, names containing ``embed``, ``lm_head``, ``wte``, ``wpe``
  or ``lora``, and parameters with more than three dims. Embeddings and the head are
  decayed like the other matrices, as nanoGPT and the HF Trainer do; only norms, biases
  and 1-D parameters are exempt.
* The output layer (Muon's authors keep the first and last layers on AdamW: they map
  tokens or features in and out, not a hidden space to a hidden space): the module
  ``get_output_embeddings()`` returns; a parameter whose name has a part ``head``,
  ``classifier`` or ``score`` (``lm_head``, ``classifier.weight``, transformers'
  ``score``); and, when neither names one, the model's last ``nn.Linear`` in registration
  order (a classifier or an ``nn.Sequential``), unless the model is a stack of blocks
  (parameter names with ``.layers.``, or that linear inside an element of a list of
  blocks, ``blocks.7.proj``: there the last linear is a hidden layer).
* AdamW with weight decay also: MoE routers (the parameters of an ``is_moe_router`` module
  and of its submodules: models/moe.py's ``gate.weight``, DiffusionGemma's
  ``router.proj.weight``). A router's rows are one logit per expert, not a hidden transform;
  orthogonalizing them would force every expert's score direction to equal norm and tie the
  experts' loads to the update rather than to the data (torchtitan and Moonlight keep
  routers on AdamW). The sigmoid routers' expert bias is a buffer, updated by the load rule,
  never by an optimizer.
* Muon: the remaining 2-D matrices (and 3-D expert stacks, orthogonalized per expert).
* Frozen parameters (``requires_grad=False``) are left out of the optimizer.

``muon_include`` and then ``muon_exclude`` regexes (``re.search`` on the parameter name or
any tied alias) override the rules; the first matching pattern wins.

:func:`split_heads` (per-head Muon, ``optim.muon_per_head``) says which Muon matrices are
orthogonalized per attention head, and the rows of one head.
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
#: Whole parts of a name (split on "." and "_") that mark an output layer.
OUTPUT_NAME_PARTS = ("head", "classifier", "score")
#: Name endings of the matrices per-head Muon splits into heads: attention's query, key and
#: value projections, (heads x head_dim, hidden) each (key/value: the key/value heads).
PER_HEAD_SUFFIXES = tuple(f"self_attn.{proj}.weight" for proj in ("q_proj", "k_proj", "v_proj"))

NamedParams = Iterable[tuple[str, nn.Parameter]]


@dataclass
class Routing:
    """Which optimizer each trainable parameter gets, with the reason, by canonical name."""

    muon: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    adamw_decay: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    adamw_no_decay: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # names in parameter order
    #: per-head Muon (`split_heads`): the Muon matrices orthogonalized per head, {name: rows
    #: of one head}; empty when it is off
    head_rows: dict[str, int] = field(default_factory=dict)

    def table(self) -> str:
        """Every parameter: its name, shape, optimizer and why (the routing rules)."""
        rows = [(name, tuple(p.shape), label) for label, named in
                (("muon", self.muon), ("adamw (decay)", self.adamw_decay),
                 ("adamw (no decay)", self.adamw_no_decay)) for name, p in named]  # fmt: skip
        order = {name: i for i, name in enumerate(self.order)}
        rows.sort(key=lambda row: order.get(row[0], len(order)))
        width = max([len(name) for name, _, _ in rows] + [9])
        lines = [f"{'parameter':<{width}}  {'shape':<18} {'optimizer':<17} why"]
        for name, shape, label in rows:
            lines.append(f"{name:<{width}}  {str(shape):<18} {label:<17} {self.reasons[name]}")
        lines += [f"{name:<{width}}  {'':<18} {'frozen':<17} requires_grad False"
                  for name in self.frozen]  # fmt: skip
        return "\n".join(lines)

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
        if self.head_rows:  # per-head Muon: which matrices, heads of how many rows
            kinds = sorted({name.rsplit(".", 2)[-2] for name in self.head_rows})
            rows = sorted(set(self.head_rows.values()))
            lines.append(f"  {'muon per head':<17}{len(self.head_rows):>5} tensors "
                         f"({', '.join(kinds)}; heads of {', '.join(map(str, rows))} rows)")  # fmt: skip
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


def _output_layer(model: nn.Module) -> nn.Module | None:
    """The model's output layer (module docstring): get_output_embeddings(), else, when no
    parameter name marks one and the model is not a stack of blocks, its last nn.Linear."""
    head = _module_of(model, "get_output_embeddings")
    if head is not None:
        return head
    names = [name for name, _ in model.named_parameters()]
    if any(_names_output(name) for name in names) or any(".layers." in f".{n}" for n in names):
        return None
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        return None
    name, last = linears[-1]
    if _in_repeated_block(name):
        return None
    return last


def _in_repeated_block(module_name: str) -> bool:
    """Whether a module sits inside an element of a list of blocks: a numeric name part
    with more parts after it (`blocks.7.proj`: block 7's linear, a hidden layer), not an
    nn.Sequential's own element (`2`, `net.2`: the Sequential's last linear, its output)."""
    parts = module_name.split(".")
    return any(part.isdigit() for part in parts[:-1])


def _names_output(name: str) -> bool:
    parts = re.split(r"[._]", name.lower())
    return any(part in OUTPUT_NAME_PARTS for part in parts)


def _roles(model: nn.Module) -> tuple[dict[int, set[str]], dict[int, list[str]]]:
    """Per parameter (by id): the roles of the modules owning it, and all its names."""
    roles: dict[int, set[str]] = defaultdict(set)
    aliases: dict[int, list[str]] = defaultdict(list)
    head = _output_layer(model)
    embed = _module_of(model, "get_input_embeddings")
    routers = {name for name, m in model.named_modules(remove_duplicate=False)
               if getattr(m, "is_moe_router", False)}  # fmt: skip
    for mod_name, module in model.named_modules(remove_duplicate=False):
        # a router's own parameters, and those of its submodules (DiffusionGemma's
        # router.proj, an nn.Linear inside the router)
        in_router = bool(routers) and _inside(mod_name, routers)
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
            if in_router:
                roles[id(p)].add("router")
    return roles, aliases


def _inside(module_name: str, prefixes: set[str]) -> bool:
    """Whether the module is one of ``prefixes`` (module names) or inside one of them."""
    parts = module_name.split(".") if module_name else []
    return "" in prefixes or any(".".join(parts[:i]) in prefixes
                                 for i in range(1, len(parts) + 1))  # fmt: skip


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


def _default_route(p: Tensor, names: Sequence[str], roles: set[str],
                   output_by_name: bool = True) -> tuple[str, str]:  # fmt: skip
    """(destination, reason) by the rules of the module docstring; destination in
    muon/decay/no_decay. output_by_name: names mark the output layer (not where the model
    says which it is, get_output_embeddings)."""
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
        return "decay", "output layer"
    if "router" in roles:
        return "decay", "MoE router"
    if len(names) > 1:
        return "decay", "shared by several modules (tied)"
    for part in ADAMW_NAME_PARTS:
        if any(part in n for n in lowered):
            return "decay", f"name contains {part!r}"
    if output_by_name and any(_names_output(n) for n in names):
        return "decay", "output layer (by name)"
    if p.ndim > 3:
        return "decay", f"{p.ndim}-D tensor"
    return "muon", "hidden matrix" if p.ndim == 2 else "expert stack (3-D)"


def route_parameters(
    model_or_named_params: nn.Module | NamedParams | Iterable[Tensor],
    muon_include: Iterable[str] = (),
    muon_exclude: Iterable[str] = (),
    model: nn.Module | None = None,
) -> Routing:
    """Split trainable parameters into Muon, AdamW-with-decay and AdamW-without-decay.

    Args:
        model_or_named_params: a module (module roles are used: embeddings, norms, the
            output layer, weights tied between them); ``(name, param)`` pairs (then only
            names and shapes, unless ``model`` is given; pass
            ``named_parameters(remove_duplicate=False)`` so tied weights show every name);
            or bare parameters (``model.parameters()``, torch's habit) with ``model`` given
            to name them. Bare parameters without a model are refused in one line: the
            rules need names.
        muon_include: regexes forcing matching 2-D/3-D parameters to Muon; checked first.
        muon_exclude: regexes forcing matching parameters to AdamW.
        model: the module the parameters belong to (their names and roles come from it).

    Returns:
        A :class:`Routing` in parameter order, each parameter once under its first name.
    """
    include = _compile(muon_include, "muon_include")
    exclude = _compile(muon_exclude, "muon_exclude")
    if isinstance(model_or_named_params, nn.Module):
        model, items = model_or_named_params, None
    else:
        items = list(model_or_named_params)
    output_by_name = model is None or _module_of(model, "get_output_embeddings") is None
    roles, aliases = (_roles(model) if model is not None
                      else (defaultdict(set), defaultdict(list)))  # fmt: skip
    if items is None:
        named = list(model.named_parameters())
    elif all(isinstance(item, Tensor) for item in items):
        if model is None:
            raise InputError(
                "MuonAdamW routes parameters by name and module (embeddings and the output "
                "layer to AdamW, hidden matrices to Muon) and got bare tensors: pass the model, "
                "model.named_parameters(), or model=model beside the parameters"
            )
        named = []
        for p in items:
            names = aliases.get(id(p))
            if not names:
                raise InputError(f"MuonAdamW got a parameter of shape {tuple(p.shape)} that "
                                 "is not one of model's; pass that model's parameters")  # fmt: skip
            named.append((names[0], p))
    elif all(isinstance(item, tuple) and len(item) == 2 for item in items):
        named, seen = [], set()
        for name, p in items:
            if model is None:
                if not aliases[id(p)]:
                    named.append((name, p))
                aliases[id(p)].append(name)
            elif id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
    else:
        kind = type(next(i for i in items if not isinstance(i, (Tensor, tuple)))).__name__
        raise InputError(
            f"MuonAdamW takes a model, model.named_parameters() or model.parameters() with "
            f"model=model; got {kind} items (param groups: one MuonAdamW per group, or "
            "muon_include / muon_exclude to route)"
        )
    routing = Routing()
    for name, p in named:
        names = aliases[id(p)] or [name]
        if not p.requires_grad:
            routing.frozen.append(name)
            continue
        dest, reason = _default_route(p, names, roles[id(p)], output_by_name)
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
        routing.order.append(name)
    return routing


def _config_head_dim(model: nn.Module | None) -> int | None:
    """The model config's head dim: ``resolved_head_dim`` (unmask's ModelConfig),
    ``head_dim`` (transformers), or hidden_size // num_attention_heads; None without one."""
    cfg = getattr(model, "config", None)
    for key in ("resolved_head_dim", "head_dim"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    hidden, heads = getattr(cfg, "hidden_size", None), getattr(cfg, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None


def split_heads(
    routing: Routing, model: nn.Module | None = None, head_dim: int | None = None
) -> dict[str, int]:
    """Per-head Muon: the rows of one head of each Muon matrix orthogonalized per head.

    A Muon matrix whose name ends in ``self_attn.q_proj.weight``, ``k_proj.weight`` or
    ``v_proj.weight`` (:data:`PER_HEAD_SUFFIXES`; shape (heads x head_dim, hidden), key and
    value with the key/value heads under GQA) is split into its heads. The head dim comes
    from the model: the attention module's own ``head_dim`` (unmask's attention, transformers'
    attention classes; DiffusionGemma's full-attention layers have their own), else the
    model config's (``resolved_head_dim``, ``head_dim``, or hidden_size /
    num_attention_heads), else ``head_dim``. A ``head_dim`` given where the model says
    another, or a head dim that does not divide a matrix's rows, is refused. The routing's
    reasons say each split matrix's heads.

    Returns:
        {parameter name: rows of one head}, for the split matrices only.
    """
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 1):
        raise InputError(f"head_dim must be a positive int, got {head_dim!r}")
    from_config = _config_head_dim(model)
    out: dict[str, int] = {}
    for name, p in routing.muon:
        if not name.endswith(PER_HEAD_SUFFIXES) or p.ndim != 2:
            continue
        said, where = None, ""
        if model is not None:
            attention_name = name.rsplit(".", 2)[0]
            try:
                attention = model.get_submodule(attention_name)
            except AttributeError:
                attention = None
            said = getattr(attention, "head_dim", None)
            where = f"{attention_name}.head_dim"
            if not isinstance(said, int) or said < 1:
                said, where = from_config, "the model config's head dim"
        if said is not None and head_dim is not None and said != head_dim:
            raise InputError(f"per-head Muon: head_dim={head_dim} was given, but {where} is "
                             f"{said} (for {name}); leave head_dim out")  # fmt: skip
        dim = said if said is not None else head_dim
        if dim is None:
            raise InputError(
                f"per-head Muon needs the head dim of {name}: pass the model (its attention "
                "modules or config say it) or head_dim="
            )
        rows, cols = p.shape
        if rows % dim:
            raise InputError(f"per-head Muon: head dim {dim} does not divide the {rows} rows "
                             f"of {name} {tuple(p.shape)}")  # fmt: skip
        out[name] = dim
        routing.reasons[name] += f", per head ({rows // dim} x {dim} x {cols})"
    return out
