"""RMSNorm and the SwiGLU product as autograd functions that save less for backward, and a
linear layer whose weight gradient can wait for a split backward's weight pass.

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

`linear` and `rms_norm` take a `BackwardPass` (diffusion/backward.py): while it is
deferring (a zero-bubble pipeline stage's input pass) their backward makes the input's
gradient only and hands the weight's to it; equal to the plain path's bit for bit
(tests/unit/test_deferred_backward.py).
"""

import torch
import torch.nn.functional as F

from unmask.diffusion.backward import BackwardPass, add_gradient
from unmask.dtensor import is_dtensor


def _normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in float32 divided by its root mean square, the reciprocal RMS per row)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * rstd, rstd


def _scale(weight: torch.Tensor, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight * normed.to(dtype)).to(dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, backward_pass=None):
        normed, rstd = _normalize(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.backward_pass, ctx.target = backward_pass, weight  # see _Linear
        return _scale(weight, normed, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        promoted = torch.promote_types(weight.dtype, x.dtype)

        def weight_gradient(normed: torch.Tensor, grad_prod: torch.Tensor) -> torch.Tensor:
            return (grad_prod * normed.to(x.dtype)).sum_to_size(weight.shape).to(weight.dtype)

        split = ctx.backward_pass
        defer = ctx.needs_input_grad[1] and split is not None and split.deferring
        if defer:  # recomputed in the weight pass from what the backward holds anyway
            target = ctx.target
            split.defer(lambda: add_gradient(
                target, weight_gradient(x.float() * rstd, grad_out.to(promoted))))  # fmt: skip
        normed = x.float() * rstd
        grad_prod = grad_out.to(promoted)
        grad_weight = None
        if ctx.needs_input_grad[1] and not defer:
            grad_weight = weight_gradient(normed, grad_prod)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_n = (grad_prod * weight).to(x.dtype).float()
            mean_gn = (grad_n * normed).mean(-1, keepdim=True)
            grad_x = ((grad_n - normed * mean_gn) * rstd).to(x.dtype)
        return grad_x, grad_weight, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             backward_pass: BackwardPass | None = None) -> torch.Tensor:  # fmt: skip
    """weight * x / rms(x), statistics in float32, output in x's dtype; saves x only.
    backward_pass: the weight's gradient waits for its weight pass while it defers (not
    under torch.compile, whose graphs take the plain function)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        if backward_pass is not None and torch.compiler.is_compiling():
            backward_pass = None
        return _RMSNorm.apply(x, weight, eps, backward_pass)
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


class _Linear(torch.autograd.Function):
    """x @ weight.T + bias with the backward autograd's own linear runs (the same aten
    calls: grad_x = grad @ weight, grad_weight = grad.T @ x over the flattened rows), the
    weight's and bias's gradients deferred while the pass defers."""

    @staticmethod
    def forward(ctx, x, weight, bias, backward_pass):
        ctx.save_for_backward(x, weight)
        # what the gradients go into: the tensors themselves (activation checkpointing's
        # saved tensors are detached copies)
        ctx.backward_pass, ctx.targets = backward_pass, (weight, bias)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        want_weight, want_bias = ctx.needs_input_grad[1], ctx.needs_input_grad[2]

        def weight_gradients() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            rows = grad_out.reshape(-1, grad_out.shape[-1])
            grad_weight = rows.t().mm(x.reshape(-1, x.shape[-1])) if want_weight else None
            grad_bias = rows.sum(0) if want_bias else None
            return grad_weight, grad_bias

        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        if not (want_weight or want_bias):
            return grad_x, None, None, None
        if ctx.backward_pass.deferring:
            targets = ctx.targets

            def deferred() -> None:
                for target, grad in zip(targets, weight_gradients()):
                    add_gradient(target, grad)

            ctx.backward_pass.defer(deferred)
            return grad_x, None, None, None
        return grad_x, *weight_gradients(), None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           backward_pass: BackwardPass) -> torch.Tensor:  # fmt: skip
    """F.linear(x, weight, bias) whose weight and bias gradients wait for the weight pass
    while `backward_pass` defers. Under autocast x, weight and bias are cast first, as
    autocast casts F.linear's. The plain F.linear where deferring cannot apply: no gradient
    wanted, a DTensor (tensor parallelism: its layouts are autograd's business), or a
    torch.compile graph."""
    if (not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or is_dtensor(weight) or is_dtensor(x)):  # fmt: skip
        return F.linear(x, weight, bias)
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return _Linear.apply(x, weight, bias, backward_pass)
    return _Linear.apply(x, weight, bias, backward_pass)


def deferring_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward through `linear`, told its module's `backward_pass` (bound to a
    layer by parallel/pipeline.py `defer_weight_gradients`)."""
    return linear(x, self.weight, self.bias, self.backward_pass)
