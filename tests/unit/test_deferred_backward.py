"""A backward split into an input pass and a weight pass (diffusion/backward.py): the
model's linear layers and norms, told a deferring BackwardPass (parallel/pipeline.py
`defer_weight_gradients`, as a zero-bubble stage tells its own), leave their weights'
gradients to the weight pass; input pass + weight pass give a plain backward's gradients
bit for bit, in float32 and under bf16 autocast, with biases, MoE layers and activation
checkpointing."""

import pytest
import torch
from conftest import tiny_model
from torch import nn

from unmask.diffusion.backward import BackwardPass
from unmask.models.transformer import RMSNorm
from unmask.parallel.pipeline import defer_weight_gradients

CASES = {
    "float32": ({}, False, False),
    "qkv bias": ({"qkv_bias": True}, False, False),
    "checkpointing": ({}, True, False),
    "bf16 autocast": ({"qkv_bias": True}, False, True),
    "moe": ({"model_type": "llada2_moe", "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 16, "num_shared_experts": 1}, False, False),
}  # fmt: skip


def _deferred_names(model) -> set[str]:
    """The parameters whose gradients a deferring input pass leaves to the weight pass."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, RMSNorm) or type(module) is nn.Linear:
            names |= {f"{prefix}.{n}" for n, _ in module.named_parameters(recurse=False)}
    return names


def _loss(model, ids, generator_seed: int = 1):
    g = torch.Generator().manual_seed(generator_seed)
    logits = model(ids)
    return (logits.float() * torch.randn(logits.shape, generator=g)).sum()


@pytest.mark.parametrize("case", list(CASES))
def test_input_then_weight_pass_equals_one_backward(case):
    fields, checkpointing, bf16 = CASES[case]
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    plain, split = tiny_model(**fields), tiny_model(**fields)
    holder = BackwardPass()
    deferring = defer_weight_gradients(split, holder)
    layers = split.config.num_hidden_layers
    assert deferring >= layers * 6  # q/k/v/o, norms, MLP projections per layer
    for model in (plain, split):
        model.gradient_checkpointing = checkpointing
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        _loss(plain, ids).backward()
        loss = _loss(split, ids)
    holder.deferring = True
    loss.backward()
    holder.deferring = False
    deferred = _deferred_names(split)
    got = dict(split.named_parameters())
    assert deferred and all(got[n].grad is None for n in deferred)
    assert all(p.grad is not None for n, p in got.items() if n not in deferred
               and p.requires_grad and dict(plain.named_parameters())[n].grad is not None)  # fmt: skip
    holder.take()()
    for name, p in plain.named_parameters():
        if p.grad is None:
            assert got[name].grad is None, name
            continue
        assert torch.equal(got[name].grad, p.grad), name


def test_not_deferring_is_the_plain_backward_and_no_grad_the_plain_forward():
    """A BackwardPass that is not deferring leaves every gradient to its backward, equal to
    the model without one; without gradients the forward is the plain one bit for bit."""
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    plain, split = tiny_model(qkv_bias=True), tiny_model(qkv_bias=True)
    holder = BackwardPass()
    defer_weight_gradients(split, holder)
    with torch.no_grad():
        assert torch.equal(plain(ids), split(ids))
    _loss(plain, ids).backward()
    _loss(split, ids).backward()
    assert holder.take() is not None
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        assert torch.equal(p.grad, q.grad), name
