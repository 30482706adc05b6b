"""MuonAdamW: Muon for 2-D hidden matrices, AdamW for everything else, in one optimizer.

Routing (``route_parameters``) decides per parameter by module role first, then by name and
shape, following MUON.md:

* AdamW without weight decay: 1-D and scalar parameters, biases, the weights of norm layers.
* AdamW with weight decay: embeddings (``nn.Embedding`` weights and anything tied to them),
  the output head (``get_output_embeddings()``), LoRA factors, names containing ``embed``,
  ``lm_head``, ``wte``, ``wpe`` or ``lora``, and parameters with more than three dims.
  Embeddings and the head are decayed like the other matrices, as nanoGPT and the HF
  Trainer do; only norms, biases and 1-D parameters are exempt.
* Muon: the remaining 2-D matrices (and 3-D expert stacks, orthogonalized per expert).
* Frozen parameters (``requires_grad=False``) are left out of the optimizer.

``muon_include`` and then ``muon_exclude`` regexes (``re.search`` on the parameter name or
any tied alias) override the rules; the first matching pattern wins.

One Muon step per matrix W (A x B), see :func:`muon_ns_input` and
:func:`apply_muon_update_`: fp32 momentum, Nesterov input, batched Newton-Schulz on every
matrix of one shape, result cast back to the parameter dtype, then
``W <- W (1 - lr wd) - lr s O`` with ``s`` from ``adjust_lr``. Like ``torch.optim.Muon``,
weight decay uses the unscaled lr. Configured like torch (``momentum_style="ema"``, jordan,
bf16) the result equals ``torch.optim.Muon`` bit for bit on CPU.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from unmask.errors import InputError
from unmask.optim.newton_schulz import (
    NS_DTYPES,
    NS_METHODS,
    Coefficients,
    coefficient_schedule,
    newton_schulz,
    resolve_dtype,
)

ADJUST_LR = ("match_rms_adamw", "original", "none")
MOMENTUM_STYLES = ("sum", "ema")
#: Name fragments that always mean AdamW (the LlamaFactory review list).
ADAMW_NAME_PARTS = ("embed", "lm_head", "wte", "wpe", "lora")
#: Most matrix elements stacked into one batched NS call (bounds the transient memory).
NS_BATCH_NUMEL = 1 << 26

NamedParams = Iterable[tuple[str, nn.Parameter]]


# ----------------------------------------------------------------------------- routing


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


def _is_rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


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
    """(destination, reason) by the MUON.md rules; destination in muon/decay/no_decay."""
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


# ------------------------------------------------------------------ per-matrix pieces


def lr_scale(shape: Sequence[int], adjust_lr: str) -> float:
    """Muon update scale s for a matrix of global shape (..., A, B).

    ``match_rms_adamw``: 0.2 sqrt(max(A, B)) (Moonlight; reuse AdamW's lr and wd);
    ``original``: sqrt(max(1, A / B)) (Keller Jordan); ``none``: 1. Written with the same
    float operations as ``torch.optim.Muon`` so the adjusted lr agrees to the last bit.
    """
    a, b = shape[-2], shape[-1]
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    if adjust_lr == "original":
        return math.sqrt(max(1, a / b))
    if adjust_lr == "none":
        return 1.0
    raise ValueError(f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}")


def muon_ns_input(buf: Tensor, grad: Tensor, momentum: float, nesterov: bool, style: str) -> Tensor:
    """Update the fp32 momentum ``buf`` in place and return the NS input (same shape, fp32).

    ``sum``: M <- mu M + G; input G + mu M (Nesterov) or M.
    ``ema``: M <- lerp(M, G, 1 - mu); input lerp(G, M, mu) or M (``torch.optim.Muon``).
    The two differ by the factor (1 - mu), which NS normalizes away.
    """
    g = grad.to(buf.dtype)
    if style == "ema":
        buf.lerp_(g, 1 - momentum)
        return g.lerp(buf, momentum) if nesterov else buf
    if style == "sum":
        buf.mul_(momentum).add_(g)
        return g.add(buf, alpha=momentum) if nesterov else buf
    raise ValueError(f"momentum_style must be one of {MOMENTUM_STYLES}, got {style!r}")


def apply_muon_update_(
    params: list[Tensor], updates: list[Tensor], lr: float, weight_decay: float, scale: float
) -> None:
    """W <- W (1 - lr wd) - lr s O for same-shape params (decay with the unscaled lr)."""
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, updates, alpha=-(lr * scale))


def adamw_update_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: float,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step for params sharing a step count (the count after this step).

    Same operations as ``torch.optim.AdamW`` (single-tensor path): decoupled decay, lerp
    for the first moment, bias corrections in Python floats.
    """
    beta1, beta2 = betas
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    step_size = lr / (1 - beta1**step)
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-step_size)


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (elementwise math on it is exact), else t itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _state_dtype(p: Tensor) -> torch.dtype:
    return torch.promote_types(p.dtype, torch.float32)


def _chunks(items: list[Tensor], max_numel: int) -> list[list[Tensor]]:
    """Split same-shape tensors into runs of at most max_numel elements (at least one)."""
    out: list[list[Tensor]] = [[]]
    total = 0
    for t in items:
        if out[-1] and total + t.numel() > max_numel:
            out.append([])
            total = 0
        out[-1].append(t)
        total += t.numel()
    return out


# -------------------------------------------------------------------------- optimizer


class MuonAdamW(torch.optim.Optimizer):
    """Muon on 2-D hidden matrices and AdamW on the rest, routed from a model.

    Args:
        model_or_named_params: the model (preferred: routing uses module roles), or
            ``(name, param)`` pairs.
        lr: AdamW learning rate, and Muon's unless ``muon_lr`` is given.
        weight_decay: decoupled weight decay for Muon matrices and AdamW matrices
            (embeddings and head included); norms, biases and 1-D params get none.
        betas, eps: AdamW.
        muon_lr: separate base lr for the Muon group (both follow an LR scheduler).
        momentum: Muon momentum mu (kept in fp32).
        nesterov: feed G + mu M instead of M to Newton-Schulz.
        ns_steps: Newton-Schulz iterations.
        ns_coefficients: ``jordan``, ``you``, ``polar_express`` or ``gram`` (Gram NS with the
            Polar Express schedule), or one (a, b, c) used at every step.
        ns_dtype: ``bfloat16``, ``float32`` or ``float16`` NS iteration dtype.
        adjust_lr: ``match_rms_adamw`` (0.2 sqrt(max(A, B))), ``original``
            (sqrt(max(1, A/B))) or ``none``.
        momentum_style: ``sum`` (M <- mu M + G, MUON.md/Moonlight) or ``ema``
            (M <- lerp(M, G, 1 - mu), ``torch.optim.Muon``/Keller Jordan).
        muon_include, muon_exclude: name regexes overriding the routing (include first).
        verbose: print the split once at construction (rank 0 only under torch.distributed).

    Param groups carry ``use_muon`` and ``param_names``; ``self.routing`` keeps the split
    with a reason per parameter.
    """

    def __init__(
        self,
        model_or_named_params: nn.Module | NamedParams,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        muon_lr: float | None = None,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: str | Coefficients = "jordan",
        ns_dtype: str | torch.dtype = "bfloat16",
        adjust_lr: str = "match_rms_adamw",
        momentum_style: str = "sum",
        muon_include: Iterable[str] = (),
        muon_exclude: Iterable[str] = (),
        verbose: bool = True,
    ) -> None:
        _validate(
            lr=lr,
            weight_decay=weight_decay,
            betas=betas,
            eps=eps,
            muon_lr=muon_lr,
            momentum=momentum,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_dtype=ns_dtype,
            adjust_lr=adjust_lr,
            momentum_style=momentum_style,
        )
        if isinstance(ns_dtype, torch.dtype):
            ns_dtype = str(ns_dtype).removeprefix("torch.")
        if not isinstance(ns_coefficients, str):
            ns_coefficients = tuple(float(v) for v in ns_coefficients)
        self.routing = route_parameters(model_or_named_params, muon_include, muon_exclude)
        defaults: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "betas": tuple(betas),
            "eps": eps,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_steps": ns_steps,
            "ns_coefficients": ns_coefficients,
            "ns_dtype": ns_dtype,
            "adjust_lr": adjust_lr,
            "momentum_style": momentum_style,
            "use_muon": False,
        }
        groups: list[dict[str, Any]] = []
        if self.routing.muon:
            muon_group_lr = lr if muon_lr is None else muon_lr
            groups.append({"params": self.routing.muon, "use_muon": True, "lr": muon_group_lr})
        if self.routing.adamw_decay:
            groups.append({"params": self.routing.adamw_decay})
        if self.routing.adamw_no_decay:
            groups.append({"params": self.routing.adamw_no_decay, "weight_decay": 0.0})
        if not groups:
            raise InputError("MuonAdamW got no trainable parameters (all frozen or none given)")
        super().__init__(groups, defaults)
        if verbose and _is_rank_zero():
            print(self.routing.summary(), flush=True)

    # ------------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step over every group; returns the closure's loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group_step(group)
            else:
                self._adamw_group_step(group)
        return loss

    def _muon_group_step(self, group: dict[str, Any]) -> None:
        if any(isinstance(p, DTensor) for p in group["params"]):
            from unmask.optim.distributed import dtensor_muon_step

            dtensor_muon_step(self, group)  # FSDP2/HSDP: the owner all-to-all
            return
        buckets: dict[tuple, list[Tensor]] = defaultdict(list)
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("MuonAdamW does not support sparse gradients")
            buckets[(p.shape[-2], p.shape[-1], p.device)].append(p)
        for params in buckets.values():
            for chunk in _chunks(params, NS_BATCH_NUMEL):
                inputs = [self._ns_input(p, group) for p in chunk]
                updates = self._orthogonalize(inputs, group)
                updates = [u.to(p.dtype) for u, p in zip(updates, chunk)]
                scale = lr_scale(chunk[0].shape, group["adjust_lr"])
                apply_muon_update_(chunk, updates, group["lr"], group["weight_decay"], scale)

    def _ns_input(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(
                p, dtype=_state_dtype(p), memory_format=torch.preserve_format
            )
        return muon_ns_input(
            state["momentum_buffer"],
            p.grad,
            group["momentum"],
            group["nesterov"],
            group["momentum_style"],
        )

    def _orthogonalize(self, inputs: list[Tensor], group: dict[str, Any]) -> list[Tensor]:
        """Batched NS on same-shape (..., A, B) inputs; returns one update per input.

        The seam for a sharded implementation: everything before is elementwise on the
        local shard, everything after needs only the update for that shard.
        """
        a, b = inputs[0].shape[-2:]
        batch = torch.cat([u.reshape(-1, a, b) for u in inputs]) if len(inputs) > 1 else inputs[0]
        coeffs = group["ns_coefficients"]
        if isinstance(coeffs, str):
            schedule = coefficient_schedule(coeffs, group["ns_steps"])
        else:
            schedule = [tuple(coeffs)] * group["ns_steps"]
        out = newton_schulz(
            batch,
            schedule,
            dtype=resolve_dtype(group["ns_dtype"]),
            gram=coeffs == "gram",
            out_dtype=resolve_dtype(group["ns_dtype"]),
        )
        if len(inputs) == 1:
            return [out]
        sizes = [u.numel() // (a * b) for u in inputs]
        return [o.reshape(u.shape) for o, u in zip(out.split(sizes), inputs)]

    def _adamw_group_step(self, group: dict[str, Any]) -> None:
        by_step: dict[float, list[Tensor]] = defaultdict(list)
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("MuonAdamW does not support sparse gradients")
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=_state_dtype(p))
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=_state_dtype(p))
            state["step"] += 1
            by_step[state["step"].item()].append(p)
        for step, params in by_step.items():
            states = [self.state[p] for p in params]
            adamw_update_(
                [_local(p) for p in params],
                [_local(p.grad).to(s["exp_avg"].dtype) for p, s in zip(params, states)],
                [_local(s["exp_avg"]) for s in states],
                [_local(s["exp_avg_sq"]) for s in states],
                step=step,
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )

    # ------------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Like ``Optimizer.load_state_dict``, but fp32 state of low-precision params stays
        fp32 (the base class would cast it to the param dtype)."""
        super().load_state_dict(state_dict)
        saved_groups = state_dict["param_groups"]
        for saved, group in zip(saved_groups, self.param_groups):
            for pid, p in zip(saved["params"], group["params"]):
                for key, value in state_dict["state"].get(pid, {}).items():
                    current = self.state[p].get(key)
                    if (
                        isinstance(value, Tensor)
                        and isinstance(current, Tensor)
                        and value.dtype != current.dtype
                    ):
                        self.state[p][key] = value.to(device=p.device, copy=True)


def _validate(
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    muon_lr: float | None,
    momentum: float,
    ns_steps: int,
    ns_coefficients: str | Coefficients,
    ns_dtype: str | torch.dtype,
    adjust_lr: str,
    momentum_style: str,
) -> None:
    """Raise InputError naming the argument for any out-of-range setting."""
    checks = [
        (lr >= 0, f"lr must be >= 0, got {lr}"),
        (muon_lr is None or muon_lr >= 0, f"muon_lr must be >= 0 or None, got {muon_lr}"),
        (weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}"),
        (len(betas) == 2 and all(0 <= b < 1 for b in betas), f"betas must be in [0, 1): {betas}"),
        (eps >= 0, f"eps must be >= 0, got {eps}"),
        (0 <= momentum < 1, f"momentum must be in [0, 1), got {momentum}"),
        (isinstance(ns_steps, int) and 1 <= ns_steps < 100, f"ns_steps must be 1..99: {ns_steps}"),
        (adjust_lr in ADJUST_LR, f"adjust_lr must be one of {ADJUST_LR}, got {adjust_lr!r}"),
        (
            momentum_style in MOMENTUM_STYLES,
            f"momentum_style must be one of {MOMENTUM_STYLES}, got {momentum_style!r}",
        ),
    ]
    if isinstance(ns_coefficients, str):
        ok = ns_coefficients in NS_METHODS
        checks.append((ok, f"ns_coefficients must be one of {NS_METHODS}, got {ns_coefficients!r}"))
    else:
        ok = len(tuple(ns_coefficients)) == 3
        checks.append((ok, f"ns_coefficients as numbers must be (a, b, c): {ns_coefficients}"))
    ok_dtype = ns_dtype in NS_DTYPES or ns_dtype in NS_DTYPES.values()
    checks.append((ok_dtype, f"ns_dtype must be one of {sorted(NS_DTYPES)}, got {ns_dtype!r}"))
    for ok, message in checks:
        if not ok:
            raise InputError(message)
