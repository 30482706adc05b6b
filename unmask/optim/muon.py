"""MuonAdamW: Muon for 2-D hidden matrices, AdamW for everything else, in one optimizer.

Which parameters get Muon is decided by :func:`~unmask.optim.routing.route_parameters`; the
per-matrix arithmetic lives in :mod:`unmask.optim.updates`; DTensor (FSDP2/HSDP) Muon groups
go through the owner all-to-all of :mod:`unmask.optim.distributed`. This module holds the
optimizer: param groups, state, and the order of the steps.

One Muon step batches Newton-Schulz over every matrix of one shape (up to
``NS_BATCH_NUMEL`` elements per call) and casts the result back to the parameter dtype.
Configured like torch (``momentum_style="ema"``, ``ns_coefficients="jordan"``,
``ns_dtype="bfloat16"``, Nesterov) the parameters equal those of ``torch.optim.Muon`` on
the Muon matrices plus ``torch.optim.AdamW`` on the rest bit for bit on CPU (with
``fused=True``, the AdamW side through torch's fused kernel, equal to
``torch.optim.AdamW(fused=True)``): tests/unit/test_muon.py asserts ``torch.equal`` on every
parameter after five steps, for ``adjust_lr="original"`` and ``"match_rms_adamw"``, fused
and not.

Per-head Muon (``per_head=True``): the attention query/key/value matrices go into
Newton-Schulz as their heads (heads, head_dim, hidden), batched with the other matrices of
one head's shape, and take one head's update scale; configured like torch, the parameters
equal ``torch.optim.Muon`` applied to each head's rows on their own, bit for bit
(tests/unit/test_muon_per_head.py).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from unmask.errors import InputError
from unmask.optim.distributed import OwnerPlans, dtensor_muon_step
from unmask.optim.newton_schulz import NS_DTYPES, NS_METHODS, Coefficients
from unmask.optim.routing import NamedParams, route_parameters, split_heads
from unmask.optim.updates import (
    ADJUST_LR,
    MOMENTUM_STYLES,
    adamw_update_,
    apply_muon_update_,
    auto_ns_dtype,
    cpu_has_native_bf16,
    fused_adamw_ok,
    fused_adamw_update_,
    heads_view,
    lr_scale,
    momentum_buffer,
    muon_ns_input,
    ns_shape,
    orthogonalize_inputs,
    state_dtype,
)

#: where the split is logged (INFO): silent in a user's loop unless logging is configured
#: (`logging.basicConfig(level=logging.INFO)` shows it); the trainer prints it itself
logger = logging.getLogger(__name__)

#: Most matrix elements stacked into one batched NS call (bounds the transient memory: about
#: 16 bytes an element in bf16 NS, the float32 inputs, their batch, the iterates and the
#: updates; 4 GiB here). 2^28 batches five MLP matrices of an 8B model (12288 x 4096, 50M
#: elements) into one call, and all 16 attention matrices (4096 x 4096) of a 4-layer slice,
#: where 2^26 ran each MLP matrix in a call of its own (plan/memory.py reads the same bound).
NS_BATCH_NUMEL = 1 << 28


def _is_rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (elementwise math on it is exact), else t itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _with_grad(params: list[Tensor]) -> list[Tensor]:
    """The parameters that received a gradient this step (sparse gradients are refused)."""
    if any(p.grad is not None and p.grad.is_sparse for p in params):
        raise RuntimeError("MuonAdamW does not support sparse gradients")
    return [p for p in params if p.grad is not None]


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
        ns_dtype: ``bfloat16``, ``float32`` or ``float16`` NS iteration dtype, or ``auto``:
            chosen from the Muon parameters' device at construction (bfloat16 on GPUs and on
            CPUs with native bf16 matmuls, float32 on other CPUs; see ``ns_dtype_choice``).
        adjust_lr: ``match_rms_adamw`` (0.2 sqrt(max(A, B))), ``original``
            (sqrt(max(1, A/B))) or ``none``.
        momentum_style: ``sum`` (M <- mu M + G, Moonlight) or ``ema``
            (M <- lerp(M, G, 1 - mu), ``torch.optim.Muon``/Keller Jordan).
        muon_include, muon_exclude: name regexes overriding the routing (include first).
        per_head: per-head Muon: the attention query/key/value matrices (names ending in
            ``self_attn.q_proj.weight``, ``k_proj.weight``, ``v_proj.weight``) are
            orthogonalized one head at a time, (heads x head_dim, hidden) viewed as
            (heads, head_dim, hidden), and their update scale is one head's (head_dim,
            hidden): ``torch.optim.Muon`` applied to each head's rows on their own. The head
            dim comes from the model (:func:`~unmask.optim.routing.split_heads`).
        head_dim: the head dim for per-head Muon where the model does not say it (named
            parameters without ``model``); refused where it says another.
        fused: AdamW through torch's fused kernel where it applies (float32/float64
            parameters on CPU or CUDA): one pass over memory, bit-equal to
            ``torch.optim.AdamW(fused=True)``, about 1 ulp per step from the default
            per-operation path (bit-equal to ``torch.optim.AdamW``'s default). On CPU the
            kernel's vector body and scalar tail round differently, so with FSDP2 shards the
            result depends (by about 1 ulp) on where the shards cut a tensor; the default
            keeps a sharded step bit-equal to a one-process step. ``build_optimizer`` (the
            trainer) turns it on.
        verbose: log the split once at construction (rank 0 only under torch.distributed)
            through ``logging`` (logger ``unmask.optim.muon``, INFO): silent in a user's
            loop unless logging is configured (``logging.basicConfig(level=logging.INFO)``
            shows it).

    Param groups carry ``use_muon`` and ``param_names``. Attributes besides the base
    class's:

    * ``routing``: the :class:`~unmask.optim.routing.Routing` split, with a reason per
      parameter.
    * ``ns_dtype_choice``: (the NS dtype used, why), e.g. ``("float32", "the CPU has no
      native bfloat16 matmuls ...")`` for ``auto``, ``("bfloat16", "as given")`` otherwise.
    * ``head_dims``: per-head Muon's split, {parameter: rows of one head} (empty when
      ``per_head`` is off); kept by pickling and deep copies, not saved in ``state_dict()``
      (the construction's ``per_head`` decides it on a resume).
    * ``owner_plans``: the DTensor path's cache of owner plans (which rank orthogonalizes
      which matrix, and the block of it each rank holds), filled on the first step of each
      sharded Muon group and reused. A plan depends only on global shapes, placements and
      the mesh, so it is not saved in
      ``state_dict()``, and a pickled or deep-copied optimizer starts with an empty cache.
    """

    def __init__(
        self,
        model_or_named_params: nn.Module | NamedParams | Iterable[Tensor],
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
        fused: bool = False,
        verbose: bool = True,
        model: nn.Module | None = None,
        per_head: bool = False,
        head_dim: int | None = None,
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
        self.routing = route_parameters(model_or_named_params, muon_include, muon_exclude,
                                        model=model)  # fmt: skip
        self.head_dims: dict[Tensor, int] = {}
        if per_head:
            given = model_or_named_params
            heads = split_heads(self.routing, given if isinstance(given, nn.Module) else model,
                                head_dim)  # fmt: skip
            self.head_dims = {p: heads[name] for name, p in self.routing.muon if name in heads}
            self.routing.head_rows = {name: heads[name] for name, _ in self.routing.muon
                                      if name in heads}  # fmt: skip
        self.ns_dtype_choice = (ns_dtype, "as given")
        if ns_dtype == "auto":
            device = _local(self.routing.muon[0][1]).device if self.routing.muon else None
            device_type = device.type if device is not None else "cpu"
            self.ns_dtype_choice = auto_ns_dtype(device_type, cpu_has_native_bf16())
            ns_dtype = self.ns_dtype_choice[0]
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
            "fused": bool(fused),
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
        self.owner_plans: OwnerPlans = {}
        if verbose and _is_rank_zero():
            logger.info("%s", self.routing.summary())

    # ------------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step over every group; returns the closure's loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not any(p.grad is not None for group in self.param_groups for p in group["params"]):
            raise InputError(
                "MuonAdamW.step: none of its parameters has a gradient: they are not the ones "
                "the model trains with (an optimizer made before fully_shard, to(), or "
                "another change of the model's parameters); make it after (docs/muon.md)"
            )
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group_step(group)
            else:
                self._adamw_group_step(group)
        return loss

    def _muon_group_step(self, group: dict[str, Any]) -> None:
        if any(isinstance(p, DTensor) for p in group["params"]):
            # FSDP2/HSDP: the owner all-to-all
            dtensor_muon_step(group, self.state, self.owner_plans, self.head_dims)
            return
        # by the shape NS sees: a matrix's, or one head's (per-head Muon)
        buckets: dict[tuple, list[Tensor]] = defaultdict(list)
        for p in _with_grad(group["params"]):
            buckets[(*ns_shape(p.shape, self.head_dims.get(p)), p.device)].append(p)
        for (rows, cols, _), params in buckets.items():
            for chunk in _chunks(params, NS_BATCH_NUMEL):
                inputs = [
                    heads_view(
                        muon_ns_input(
                            momentum_buffer(self.state[p], p),
                            p.grad,
                            group["momentum"],
                            group["nesterov"],
                            group["momentum_style"],
                        ),
                        self.head_dims.get(p),
                    )
                    for p in chunk
                ]
                updates = orthogonalize_inputs(inputs, group)
                updates = [u.reshape(p.shape).to(p.dtype) for u, p in zip(updates, chunk)]
                scale = lr_scale((rows, cols), group["adjust_lr"])
                apply_muon_update_(chunk, updates, group["lr"], group["weight_decay"], scale)

    def _adamw_state(self, p: Tensor, step_device: torch.device) -> dict[str, Any]:
        """p's AdamW state, made on its first step; the step count (float32, 0-d) lives on
        step_device: the CPU for the per-operation path (read as a Python float), p's
        device for the fused kernel (moved there after a checkpoint from the other path)."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=step_device)
            state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype(p))
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype(p))
        elif state["step"].device != step_device:
            state["step"] = state["step"].to(step_device)
        return state

    def _adamw_group_step(self, group: dict[str, Any]) -> None:
        params = _with_grad(group["params"])
        fused = [p for p in params if group.get("fused") and fused_adamw_ok(_local(p))]
        if fused:
            states = [self._adamw_state(p, _local(p).device) for p in fused]
            fused_adamw_update_(
                [_local(p) for p in fused],
                [_local(p.grad) for p in fused],
                [_local(s["exp_avg"]) for s in states],
                [_local(s["exp_avg_sq"]) for s in states],
                [s["step"] for s in states],
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )
        fused_ids = {id(p) for p in fused}
        by_step: dict[float, list[Tensor]] = defaultdict(list)
        for p in params:
            if id(p) in fused_ids:
                continue
            state = self._adamw_state(p, torch.device("cpu"))
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

    def __getstate__(self) -> dict[str, Any]:
        """The base class's attributes plus the per-head split (keyed by the parameters, so
        a deep copy maps it onto the copied ones)."""
        return {**super().__getstate__(), "head_dims": self.head_dims}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling and ``copy.deepcopy`` restore the base class's attributes (defaults,
        state, param_groups) and the per-head split; start with an empty owner plan
        cache. (``load_state_dict`` calls this too, without a split: the optimizer keeps
        its own.)"""
        state = dict(state)
        head_dims = state.pop("head_dims", getattr(self, "head_dims", {}))
        super().__setstate__(state)
        for group in self.param_groups:  # a state_dict saved before the fused option
            group.setdefault("fused", False)
        self.head_dims = head_dims
        self.owner_plans = {}

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
    ok_dtype = ns_dtype == "auto" or ns_dtype in NS_DTYPES or ns_dtype in NS_DTYPES.values()
    choices = ["auto", *sorted(NS_DTYPES)]
    checks.append((ok_dtype, f"ns_dtype must be one of {choices}, got {ns_dtype!r}"))
    for ok, message in checks:
        if not ok:
            raise InputError(message)
