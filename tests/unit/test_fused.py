"""The memory-saving RMSNorm and SwiGLU functions against the plain autograd path."""

import pytest
import torch
import torch.nn.functional as F

from unmask.models.fused import rms_norm, swiglu


def plain_rms_norm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).to(x.dtype)


def plain_swiglu(gate, up):
    return F.silu(gate) * up


def saved_bytes(fn, *args) -> int:
    """Bytes of the tensors autograd keeps for backward (parameters and inputs excluded)."""
    inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in inputs:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def grads(fn, *args, grad_out):
    leaves = [a.detach().clone().requires_grad_(True) for a in args[:2]]
    out = fn(*leaves, *args[2:])
    out.backward(grad_out)
    return out, [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rms_norm_equals_plain_path(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=gen) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(
        torch.promote_types(dtype, torch.float32)
    )
    grad_out = torch.randn(3, 5, 64, generator=gen).to(dtype)
    out, (gx, gw) = grads(rms_norm, x, weight, 1e-6, grad_out=grad_out)
    ref, (rx, rw) = grads(plain_rms_norm, x, weight, 1e-6, grad_out=grad_out)
    assert torch.equal(out, ref)  # the forward is the plain path's operations
    assert gx.dtype == rx.dtype and gw.dtype == rw.dtype
    # the statistics are float32 for every input dtype (as the plain path): float32 rounding
    tol = {torch.float64: 1e-6, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(gx, rx, rtol=tol, atol=tol)
    torch.testing.assert_close(gw, rw, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_plain_path_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(1)
    gate, up, grad_out = (torch.randn(4, 7, 96, generator=gen).to(dtype) for _ in range(3))
    out, (gg, gu) = grads(swiglu, gate, up, grad_out=grad_out)
    ref, (rg, ru) = grads(plain_swiglu, gate, up, grad_out=grad_out)
    assert torch.equal(out, ref) and torch.equal(gg, rg) and torch.equal(gu, ru)


def test_they_save_less_for_backward():
    x = torch.randn(64, 256, requires_grad=True)
    weight = torch.ones(256, requires_grad=True)
    block = 64 * 256 * 4
    # plain RMSNorm keeps the normalized activations too; the function only x and the stats
    assert saved_bytes(plain_rms_norm, x, weight, 1e-6) == block + 64 * 4
    assert saved_bytes(rms_norm, x, weight, 1e-6) == 64 * 4
    gate, up = torch.randn(64, 256, requires_grad=True), torch.randn(64, 256, requires_grad=True)
    assert saved_bytes(plain_swiglu, gate, up) == block  # silu(gate)
    assert saved_bytes(swiglu, gate, up) == 0


def test_no_graph_without_grad():
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert rms_norm(x, torch.ones(8, requires_grad=True), 1e-6).grad_fn is None
    assert swiglu(x, x).grad_fn is None
    assert torch.equal(rms_norm(x, torch.ones(8), 1e-6), plain_rms_norm(x, torch.ones(8), 1e-6))
