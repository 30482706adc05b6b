"""Per-matrix Muon and AdamW arithmetic, shared by the one-process and the DTensor paths.

Everything here works on plain tensors (whole matrices, or the local rows of a DTensor) and
on one param group's settings; nothing knows about optimizers, meshes or process groups.
One Muon step per matrix W (A x B):

1. :func:`muon_ns_input`: fp32 momentum (:func:`momentum_buffer`) and the Nesterov input;
2. :func:`orthogonalize_inputs`: batched Newton-Schulz on the inputs of one group, in the
   group's NS dtype (the only step that needs whole matrices);
3. :func:`apply_muon_update_`: ``W <- W (1 - lr wd) - lr s O`` with ``s`` from
   :func:`lr_scale`; like ``torch.optim.Muon``, weight decay uses the unscaled lr.

Per-head Muon (``optim.muon_per_head``): a query/key/value matrix (heads x head_dim, B)
goes into step 2 as its heads, (heads, head_dim, B) (:func:`heads_view`), so each head is
orthogonalized on its own, and ``s`` comes from one head's shape (:func:`ns_shape`): what
``torch.optim.Muon`` does applied to each head's rows as a matrix of its own.

:func:`adamw_update_` is the AdamW step for the parameters Muon does not take (the
operations of ``torch.optim.AdamW``'s plain path); :func:`fused_adamw_update_` is the same
step through torch's fused kernel (``torch.optim.AdamW(fused=True)``), used where
:func:`fused_adamw_ok` says it applies.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from unmask.optim.newton_schulz import (
    Coefficients,
    coefficient_schedule,
    newton_schulz,
    resolve_dtype,
)

ADJUST_LR = ("match_rms_adamw", "original", "none")
MOMENTUM_STYLES = ("sum", "ema")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512_BF16 or AMX-BF16).

    torch's public ``torch.backends.cpu.get_cpu_capability()`` names only the vector ISA
    ("AVX2", "AVX512"), which does not say whether bf16 dot products exist; the instruction
    flags come from ``torch._C._cpu._get_cpu_capability()`` (torch 2.13: a dict of cpuinfo
    flags). Without them bf16 GEMMs are emulated, and can be many times slower than float32.
    Any other CPU (or a torch without that function) counts as one without.
    """
    try:
        flags = torch._C._cpu._get_cpu_capability()
    except (AttributeError, RuntimeError):
        return False
    return bool(flags.get("avx512_bf16") or flags.get("amx_bf16"))


def auto_ns_dtype(device_type: str, native_bf16_cpu: bool) -> tuple[str, str]:
    """``ns_dtype: auto`` for parameters on ``device_type``: (dtype name, the reason).

    bfloat16 on accelerators (tensor cores), and on a CPU with native bf16 matmuls;
    float32 on a CPU without them.
    """
    if device_type != "cpu":
        return "bfloat16", f"{device_type}: bfloat16 matmuls are native"
    if native_bf16_cpu:
        return "bfloat16", "the CPU has native bfloat16 matmuls (AVX512_BF16/AMX)"
    return "float32", "the CPU has no native bfloat16 matmuls (no AVX512_BF16/AMX)"


def state_dtype(p: Tensor) -> torch.dtype:
    """Dtype of p's optimizer state: float32, or p's dtype where that is wider."""
    return torch.promote_types(p.dtype, torch.float32)


def momentum_buffer(state: dict[str, Any], p: Tensor) -> Tensor:
    """p's Muon momentum from its optimizer state, created as zeros on the first step."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(
            p, dtype=state_dtype(p), memory_format=torch.preserve_format
        )
    return state["momentum_buffer"]


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


@dataclass(frozen=True)
class NSSettings:
    """How one Muon param group runs Newton-Schulz, resolved from the group's settings."""

    schedule: list[Coefficients]
    """One (a, b, c) per iteration."""
    gram: bool
    """Gram NS (``ns_coefficients="gram"``) instead of standard NS."""
    dtype: torch.dtype
    """Iteration dtype, which is also the dtype of the updates."""


def ns_settings(group: dict[str, Any]) -> NSSettings:
    """The NS schedule, Gram flag and dtype of a Muon param group."""
    coeffs = group["ns_coefficients"]
    if isinstance(coeffs, str):
        schedule = coefficient_schedule(coeffs, group["ns_steps"])
    else:
        schedule = [tuple(coeffs)] * group["ns_steps"]
    return NSSettings(schedule, coeffs == "gram", resolve_dtype(group["ns_dtype"]))


def orthogonalize_inputs(inputs: Sequence[Tensor], group: dict[str, Any]) -> list[Tensor]:
    """Newton-Schulz for NS inputs of one Muon group: one update per input, in the NS dtype.

    Inputs (..., A, B) that share (A, B) and device run as one batched call, in input order:
    a single input goes in as it is (a 2-D matrix stays 2-D, as ``torch.optim.Muon`` passes
    it, which keeps the memory layout after the transpose of a tall matrix, and with it the
    GEMM kernel), several are concatenated along one leading batch dim. Each update has its
    input's shape. The one-process step and the owners of the DTensor path both call this,
    so every matrix gets the same NS call, and the same bits, either way.
    """
    settings = ns_settings(group)
    out: list[Tensor | None] = [None] * len(inputs)
    by_shape: dict[tuple, list[int]] = defaultdict(list)
    for index, u in enumerate(inputs):
        by_shape[(*u.shape[-2:], u.device)].append(index)
    for indices in by_shape.values():
        updates = _batched_newton_schulz([inputs[i] for i in indices], settings)
        for i, update in zip(indices, updates):
            out[i] = update
    return out  # type: ignore[return-value]


def _batched_newton_schulz(inputs: list[Tensor], settings: NSSettings) -> list[Tensor]:
    """One NS call on inputs that share their last two dims; one update per input."""
    a, b = inputs[0].shape[-2:]
    batch = torch.cat([u.reshape(-1, a, b) for u in inputs]) if len(inputs) > 1 else inputs[0]
    out = newton_schulz(
        batch,
        settings.schedule,
        dtype=settings.dtype,
        gram=settings.gram,
        out_dtype=settings.dtype,
    )
    if len(inputs) == 1:
        return [out]
    sizes = [u.numel() // (a * b) for u in inputs]
    return [o.reshape(u.shape) for o, u in zip(out.split(sizes), inputs)]


def ns_shape(shape: Sequence[int], head_dim: int | None = None) -> tuple[int, int]:
    """The (A, B) Newton-Schulz orthogonalizes for a matrix of global shape (..., A, B):
    (head_dim, B) for a matrix split into heads (per-head Muon), else (A, B). The update
    scale (:func:`lr_scale`) reads this shape too."""
    return (head_dim, shape[-1]) if head_dim else (shape[-2], shape[-1])


def heads_view(u: Tensor, head_dim: int | None = None) -> Tensor:
    """An NS input (A, B) viewed as its heads (A / head_dim, head_dim, B): the batch of
    matrices NS orthogonalizes one by one (per-head Muon); u itself without a split."""
    return u.view(-1, head_dim, u.shape[-1]) if head_dim else u


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


#: Device types with a fused AdamW kernel in torch (torch.optim.AdamW(fused=True)).
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def fused_adamw_ok(p: Tensor) -> bool:
    """Whether p (a plain tensor or a DTensor's local shard) can take the fused AdamW kernel
    with unmask's state: a fused device, and a dtype the fp32-or-wider state shares (float32
    or float64; a bf16 parameter keeps fp32 state, which the kernel cannot mix)."""
    return p.device.type in FUSED_ADAMW_DEVICES and p.dtype == state_dtype(p)


def fused_adamw_update_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step through torch's fused kernel, as ``torch.optim.AdamW(fused=True)``
    makes it: each step count (a float32 0-d tensor on its parameter's device) goes up by
    one, then one ``torch._fused_adamw_`` call per (device, dtype). One pass over the
    memory instead of one per operation; about 1 ulp from :func:`adamw_update_`."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for index, p in enumerate(params):
        groups[(p.device, p.dtype)].append(index)
    for indices in groups.values():
        step_counts = [steps[i] for i in indices]
        torch._foreach_add_(step_counts, 1)
        torch._fused_adamw_(
            [params[i] for i in indices],
            [grads[i] for i in indices],
            [exp_avgs[i] for i in indices],
            [exp_avg_sqs[i] for i in indices],
            [],  # max_exp_avg_sqs: no amsgrad
            step_counts,
            amsgrad=False,
            lr=lr,
            beta1=betas[0],
            beta2=betas[1],
            weight_decay=weight_decay,
            eps=eps,
            maximize=False,
            grad_scale=None,
            found_inf=None,
        )
