"""Preference optimization (unmask/posttrain/preference.py): the DPO-on-ELBO loss against a
hand computation, log 2 at init with shared noise, and what the variance reduction buys."""

import copy
import math

import pytest
import torch
from conftest import tiny_model

from unmask.diffusion.config import DiffusionConfig
from unmask.posttrain.preference import (
    NOISE_KEYS,
    PreferenceConfig,
    PreferenceObjective,
    draw_levels,
)

pytestmark = pytest.mark.usefixtures("one_thread")
MASK = 127


def tiny(seed: int = 0):
    return tiny_model(seed, num_attention_heads=2, num_key_value_heads=1,
                      initializer_range=0.2).eval()  # fmt: skip


def pair_batch(pairs: int = 3, length: int = 10, prompt: int = 4, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    batch = {}
    for prefix in ("", "rejected_"):
        ids = torch.randint(0, 100, (pairs, length), generator=gen)
        maskable = torch.zeros(pairs, length, dtype=torch.bool)
        maskable[:, prompt:] = True
        ids[:, :prompt] = batch["input_ids"][:, :prompt] if prefix else ids[:, :prompt]
        batch[prefix + "input_ids"], batch[prefix + "maskable"] = ids, maskable
        batch[prefix + "doc_ids"] = torch.zeros_like(ids)
        batch[prefix + "position_ids"] = torch.arange(length).expand(pairs, length).clone()
    return batch


def perturbed(model, scale: float = 0.05, seed: int = 3):
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return other


def objective(reference, **cfg) -> PreferenceObjective:
    return PreferenceObjective(PreferenceConfig(**cfg), DiffusionConfig(), MASK, reference)


def hand_elbo(model, ids, t, masked) -> float:
    """One completion's ELBO from full logits: mean over draws of -(1/t) sum log p."""
    total = 0.0
    for k in range(t.numel()):
        noisy = torch.where(masked[k], MASK, ids)
        logp = torch.log_softmax(model(noisy[None]).double()[0], -1)
        picked = logp.gather(1, ids[:, None])[:, 0]
        total += float(picked[masked[k]].sum().detach()) / float(t[k])
    return total / t.numel()


def test_loss_matches_a_hand_computation_with_fixed_noise():
    policy, ref = tiny(), perturbed(tiny())
    obj = objective(ref, beta=0.5, num_samples=3)
    batch = obj.with_noise(pair_batch(), torch.Generator().manual_seed(0))
    loss, count = obj(policy, batch)
    expected = 0.0
    for p in range(3):
        t = batch["pref_t"][p]
        s = []
        for side, key in (("", NOISE_KEYS[1]), ("rejected_", NOISE_KEYS[2])):
            ids, masked = batch[side + "input_ids"][p], batch[key][p]
            s.append(hand_elbo(policy, ids, t, masked) - hand_elbo(ref, ids, t, masked))
        score = 0.5 * (s[0] - s[1])
        expected += math.log1p(math.exp(-score))
    assert float(count) == 3.0
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-4)


def test_shared_noise_gives_exactly_log_2_at_init_for_every_draw():
    model = tiny()
    obj = objective(copy.deepcopy(model), num_samples=4)
    for seed in range(5):
        loss, count = obj(model, pair_batch(), torch.Generator().manual_seed(seed))
        assert float(loss) == pytest.approx(3 * math.log(2), abs=1e-6)  # float32 sum
        assert float(obj.step_sums["reward_margin"]) == 0.0  # every pair's score exactly 0
        assert float(obj.step_sums["reward_chosen"]) == float(obj.step_sums["reward_rejected"]) == 0
    independent = objective(copy.deepcopy(model), num_samples=4, shared_noise=False)
    values = {float(independent(model, pair_batch(), torch.Generator().manual_seed(s))[0])
              for s in range(5)}  # fmt: skip
    assert len(values) == 5 and all(abs(v - 3 * math.log(2)) > 1e-4 for v in values)


def loss_spread(policy, ref, draws: int = 40, **cfg) -> float:
    obj = objective(ref, num_samples=4, **cfg)
    batch = pair_batch(pairs=4)
    with torch.no_grad():
        losses = [float(obj(policy, batch, torch.Generator().manual_seed(s))[0])
                  for s in range(draws)]  # fmt: skip
    return float(torch.tensor(losses, dtype=torch.float64).var())


def test_shared_noise_and_spread_levels_lower_the_loss_variance():
    policy, ref = perturbed(tiny(), 0.03), tiny()
    independent = loss_spread(policy, ref, shared_noise=False, t_sampling="uniform")
    shared = loss_spread(policy, ref, shared_noise=True, t_sampling="uniform")
    stratified = loss_spread(policy, ref, shared_noise=True, t_sampling="stratified")
    antithetic = loss_spread(policy, ref, shared_noise=True, t_sampling="antithetic")
    # measured with these seeds: 13.0, 0.16, 0.030, 0.051
    assert shared < independent / 10
    assert stratified < shared / 2 and antithetic < shared


def test_levels_cover_the_strata():
    t = draw_levels(5, 4, "stratified", 1e-3, torch.Generator().manual_seed(0), "cpu", None)
    strata = ((t - 1e-3) / (1 - 1e-3) * 4).floor()
    assert torch.equal(strata, torch.arange(4.0).expand(5, 4))
    a = draw_levels(5, 4, "antithetic", 0.0, torch.Generator().manual_seed(0), "cpu", None)
    assert torch.allclose(a[:, :2] + a[:, 2:], torch.ones(5, 2))


def test_a_slice_of_the_global_draw_is_the_rank_s_noise():
    obj = objective(None, num_samples=3)
    batch = pair_batch(pairs=4)
    whole = obj.with_noise(batch, torch.Generator().manual_seed(0))
    half = {k: v[2:] for k, v in batch.items()}
    part = obj.with_noise(half, torch.Generator().manual_seed(0), rows=(2, 4))
    for key in NOISE_KEYS:
        assert torch.equal(part[key], whole[key][2:])


def test_chosen_nll_weight_adds_the_chosen_negative_elbo_per_token():
    policy, ref = tiny(), perturbed(tiny())
    plain = objective(ref, num_samples=3)
    batch = plain.with_noise(pair_batch(), torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = float(plain(policy, batch)[0])
        chosen = plain.elbos(policy, batch, NOISE_KEYS)[:, 0]
        rpo = float(objective(ref, num_samples=3, chosen_nll_weight=0.5)(policy, batch)[0])
    tokens = batch["maskable"].sum(1).float()  # 6 answer tokens per row
    assert rpo == pytest.approx(base + 0.5 * float((-chosen / tokens).sum()), rel=1e-5)
