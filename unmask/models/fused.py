"""RMSNorm and the SwiGLU product as autograd functions that save less for backward.

Plain autograd keeps, per RMSNorm, its input, the row statistics and the normalized
activations (a second tensor of the input's size), and per SwiGLU the gate, silu(gate)
and up (three tensors of the MLP's width). These functions keep only the input and the
statistics, and only gate and up, and recompute the rest in backward (elementwise work,
small next to the matmuls around it). At hidden 512 / 8 layers / 2048 tokens that is
~200 MiB less activation memory in a training step (benchmarks/train_step.py).

Numerics (tests/unit/test_fused.py): the forward pass is the plain path's own operations,
bit for bit; the SwiGLU backward is too (the same aten `silu_backward` and products); the
RMSNorm backward is the same formula in another operation order, equal to plain autograd
within float rounding (a few ulp).
"""

import torch
import torch.nn.functional as F


def _normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in float32 divided by its root mean square, the reciprocal RMS per row)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * rstd, rstd


def _scale(weight: torch.Tensor, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight * normed.to(dtype)).to(dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        normed, rstd = _normalize(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        return _scale(weight, normed, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        cast = normed.to(x.dtype)
        grad_prod = grad_out.to(torch.promote_types(weight.dtype, x.dtype))
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_prod * cast).sum_to_size(weight.shape).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_n = (grad_prod * weight).to(x.dtype).float()
            mean_gn = (grad_n * normed).mean(-1, keepdim=True)
            grad_x = ((grad_n - normed * mean_gn) * rstd).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), statistics in float32, output in x's dtype; saves x only."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return _scale(weight, _normalize(x, eps)[0], x.dtype)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(grad_out * up, gate)
        if ctx.needs_input_grad[1]:
            grad_up = grad_out * F.silu(gate)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, saving gate and up only (silu(gate) is recomputed in backward)."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SwiGLU.apply(gate, up)
    return F.silu(gate) * up
