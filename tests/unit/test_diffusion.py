"""Forward process (noise.py) and the MDLM/LLaDA objective (objectives.py)."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_model
from pydantic import ValidationError
from torch import nn

from unmask.diffusion import (
    DiffusionConfig,
    build_objective,
    chunked_cross_entropy,
    loss_weight,
    mask_prob,
    mask_tokens,
    mdlm_loss_terms,
    sample_t,
)

V, H, MASK_ID = 37, 16, 36


class StandIn(nn.Module):
    """Tiny bidirectional model with the unmask call: logits, or per-token CE on targets."""

    def __init__(self, vocab: int = V, hidden: int = H, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(vocab_size=vocab)
        self.embed = nn.Embedding(vocab, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def hidden(self, input_ids):
        h = self.embed(input_ids)  # (B, L, H)
        attn = torch.softmax(h @ h.transpose(1, 2) / math.sqrt(h.shape[-1]), dim=-1)
        return h + torch.tanh(self.mix(attn @ h))

    def forward(self, input_ids, doc_ids=None, position_ids=None, targets=None, vocab_chunk=8):
        h = self.hidden(input_ids)
        if targets is None:
            return self.head(h)
        sel = targets != -100
        rows = chunked_cross_entropy(h[sel], self.head.weight, targets[sel], vocab_chunk)
        return torch.zeros(targets.shape, dtype=torch.float32).masked_scatter(sel, rows)


def real_model():
    """unmask's own model at a tiny size."""
    return tiny_model(vocab_size=V)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- config -------------------------------------------------------------------------------


def test_config_defaults_and_unknown_key():
    cfg = DiffusionConfig()
    assert (cfg.objective, cfg.t_sampling, cfg.time_eps) == ("mdlm", "uniform", 1e-3)
    assert (cfg.schedule, cfg.loss_weight, cfg.min_masked) == ("linear", "inverse_t", 0)
    assert cfg.vocab_chunk_size == 8192
    assert "1/t" in DiffusionConfig.model_fields["loss_weight"].description
    with pytest.raises(ValidationError, match="shedule"):
        DiffusionConfig(shedule="linear")


# ---- noise --------------------------------------------------------------------------------


def test_sample_t_uniform_range_and_reproducible():
    t = sample_t(10_000, "uniform", 1e-3, gen(1))
    assert t.shape == (10_000,)
    assert float(t.min()) >= 1e-3 and float(t.max()) < 1.0
    assert abs(float(t.mean()) - (1 + 1e-3) / 2) < 0.01
    assert torch.equal(t, sample_t(10_000, "uniform", 1e-3, gen(1)))


def test_sample_t_antithetic_spacing():
    eps, b = 1e-3, 8
    t = sample_t(b, "antithetic", eps, gen(2))
    u = (t - eps) / (1 - eps)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    # One point in each interval [j/B, (j+1)/B), consecutive rows 1/B apart mod 1.
    assert torch.equal(torch.sort(torch.floor(u * b)).values, torch.arange(b, dtype=torch.float32))
    gaps = torch.remainder(u[1:] - u[:-1], 1.0)
    torch.testing.assert_close(gaps, torch.full((b - 1,), 1 / b), atol=1e-5, rtol=0)


def test_mask_prob_and_weights():
    t = torch.tensor([0.1, 0.5, 0.9])
    torch.testing.assert_close(mask_prob(t, "linear"), t)
    torch.testing.assert_close(mask_prob(t, "cosine"), 1 - torch.cos(math.pi * t / 2))
    torch.testing.assert_close(loss_weight(t, "inverse_t"), torch.tensor([10.0, 2.0, 1 / 0.9]))
    torch.testing.assert_close(loss_weight(t, "scheduler", "linear"), 1 / t)
    torch.testing.assert_close(loss_weight(t, "uniform"), torch.ones(3))
    # cosine: -alpha'/(1 - alpha) with alpha = cos(pi t / 2), by finite differences.
    h = 1e-4
    td = t.double()
    alpha = lambda s: torch.cos(math.pi * s / 2)  # noqa: E731
    expected = -(alpha(td + h) - alpha(td - h)) / (2 * h) / (1 - alpha(td))
    torch.testing.assert_close(loss_weight(td, "scheduler", "cosine"), expected, rtol=1e-6, atol=0)


def test_mask_rate_matches_t_and_prompt_never_masked():
    b, length = 4, 5000
    ids = torch.randint(0, 30, (b, length), generator=gen(3))
    t = torch.tensor([0.1, 0.3, 0.6, 0.9])
    maskable = torch.ones(b, length, dtype=torch.bool)
    maskable[:, :1000] = False  # a prompt
    noisy, masked = mask_tokens(ids, t, maskable, MASK_ID, gen(4))
    assert not masked[:, :1000].any()
    assert torch.equal(noisy[:, :1000], ids[:, :1000])
    rate = masked[:, 1000:].float().mean(dim=1)
    torch.testing.assert_close(rate, t, atol=0.025, rtol=0)
    assert torch.equal(noisy == MASK_ID, masked)
    assert torch.equal(noisy[~masked], ids[~masked])
    _, masked_cos = mask_tokens(ids, t, maskable, MASK_ID, gen(4), schedule="cosine")
    torch.testing.assert_close(
        masked_cos[:, 1000:].float().mean(dim=1), mask_prob(t, "cosine"), atol=0.025, rtol=0
    )


def test_min_masked_forces_one_per_row():
    b, length = 64, 6
    ids = torch.randint(0, 30, (b, length), generator=gen(5))
    t = torch.full((b,), 1e-3)
    maskable = torch.ones(b, length, dtype=torch.bool)
    maskable[:, :2] = False
    maskable[0] = False  # a row with nothing maskable stays unmasked
    _, plain = mask_tokens(ids, t, maskable, MASK_ID, gen(6))
    assert (plain.sum(1) == 0).sum() > 50  # without the option most rows get nothing
    _, masked = mask_tokens(ids, t, maskable, MASK_ID, gen(6), min_masked=1)
    assert masked[0].sum() == 0
    assert (masked[1:].sum(1) >= 1).all()
    assert not (masked & ~maskable).any()
    # the forced pick is spread over the maskable positions
    assert set(masked[1:].float().argmax(1).tolist()) == {2, 3, 4, 5}


# ---- objective ----------------------------------------------------------------------------


def naive_mdlm_loss(model, input_ids, noisy, masked, t):
    logits = model(noisy)  # (B, L, V) full logits
    ce = F.cross_entropy(logits.transpose(1, 2), input_ids, reduction="none")
    return (ce * masked / t[:, None]).sum()


@pytest.mark.parametrize("which", ["stand_in", "unmask_model"])
def test_objective_matches_full_logits_reference_and_counts_maskable(which):
    model = StandIn() if which == "stand_in" else real_model()
    ids = torch.randint(0, 30, (3, 12), generator=gen(7))
    maskable = torch.ones(3, 12, dtype=torch.bool)
    maskable[1, :4] = False
    objective = build_objective(DiffusionConfig(vocab_chunk_size=8), MASK_ID)
    batch = {"input_ids": ids, "maskable": maskable}
    loss_sum, count = objective(model, batch, gen(8))
    assert count.item() == 32 and count.dtype == torch.float32 and count.dim() == 0
    assert loss_sum.dim() == 0 and loss_sum.requires_grad
    # Same draws, done by hand.
    g = gen(8)
    t = sample_t(3, "uniform", 1e-3, g)
    noisy, masked = mask_tokens(ids, t, maskable, MASK_ID, g)
    assert masked.any() and not masked[1, :4].any()
    expected = naive_mdlm_loss(model, ids, noisy, masked, t)
    torch.testing.assert_close(loss_sum, expected, rtol=1e-5, atol=1e-5)
    stats = objective.last_stats
    torch.testing.assert_close(stats["mean_t"], t.mean())
    assert stats["num_masked"].item() == masked.sum().item()
    # Gradients agree too.
    grads = torch.autograd.grad(loss_sum, list(model.parameters()))
    ref = torch.autograd.grad(expected, list(model.parameters()))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_precomputed_noise_is_used_and_splits_add_up():
    model = StandIn()
    ids = torch.randint(0, 30, (4, 10), generator=gen(9))
    t = torch.tensor([0.2, 0.5, 0.7, 0.95])
    noisy, masked = mask_tokens(ids, t, torch.ones_like(ids, dtype=torch.bool), MASK_ID, gen(10))
    objective = build_objective(DiffusionConfig(objective="llada"), MASK_ID)
    full = {"input_ids": ids, "t": t, "noisy_input_ids": noisy, "masked": masked}
    # The generator is ignored when noise is given: two different seeds, one answer.
    a = objective(model, full, gen(0))
    b = objective(model, full, gen(123))
    assert torch.equal(a.loss_sum, b.loss_sum)
    torch.testing.assert_close(a.loss_sum, naive_mdlm_loss(model, ids, noisy, masked, t))
    assert a.count.item() == 40
    # Two micro-batches sum to the full batch (the trainer divides after summing).
    halves = [{k: v[s] for k, v in full.items()} for s in (slice(0, 1), slice(1, 4))]
    parts = [objective(model, h) for h in halves]
    torch.testing.assert_close(sum(p.loss_sum for p in parts), a.loss_sum, rtol=1e-5, atol=1e-5)
    assert sum(p.count for p in parts).item() == 40
    with pytest.raises(ValueError, match="missing"):
        objective(model, {"input_ids": ids, "t": t})


def test_mdlm_loss_terms_weights():
    ce = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    masked = torch.tensor([[True, False, True], [False, False, True]])
    maskable = torch.tensor([[True, True, True], [False, True, True]])
    weight = loss_weight(torch.tensor([0.5, 0.25]), "inverse_t")
    loss_sum, count = mdlm_loss_terms(ce, masked, weight, maskable)
    assert loss_sum.item() == pytest.approx((1 + 3) * 2 + 6 * 4)
    assert count.item() == 5  # maskable tokens, not masked tokens (3)


def test_objective_weight_options():
    model = StandIn()
    ids = torch.randint(0, 30, (2, 8), generator=gen(11))
    t = torch.tensor([0.25, 0.5])
    noisy, masked = mask_tokens(ids, t, torch.ones_like(ids, dtype=torch.bool), MASK_ID, gen(12))
    batch = {"input_ids": ids, "t": t, "noisy_input_ids": noisy, "masked": masked}
    inv = build_objective(DiffusionConfig(loss_weight="inverse_t"), MASK_ID)(model, batch)
    uni = build_objective(DiffusionConfig(loss_weight="uniform"), MASK_ID)(model, batch)
    ce = model(noisy, targets=torch.where(masked, ids, -100))
    assert uni.loss_sum.item() == pytest.approx(ce.sum().item(), rel=1e-6)
    expected = (ce * torch.tensor([4.0, 2.0])[:, None]).sum()
    assert inv.loss_sum.item() == pytest.approx(expected.item(), rel=1e-6)
