"""GRPO: advantages, the three losses and the estimators against hand computations, and the
objective's loss and rollouts on a tiny model (unmask/posttrain, docs/diffusion.md)."""

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model

from unmask.config import load_config
from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens
from unmask.errors import InputError
from unmask.posttrain.config import GRPOConfig
from unmask.posttrain.estimators import Passes, Rows, coupled, estimate, mc_times, one_step
from unmask.posttrain.grpo import (
    GRPOObjective,
    diffu_grpo_loss,
    group_advantages,
    kl_k3,
    spg_loss,
    wd1_loss,
)
from unmask.sampling.config import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def test_group_advantages_std_normalized_and_zero_std_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4, "group")
    s = math.sqrt(1 / 3)  # unbiased std of (1, 0, 0, 1)
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected)
    assert group_advantages(rewards, 4, "none").tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]


def test_diffu_grpo_loss_by_hand():
    scored = torch.tensor([[True, True, False], [True, False, False]])
    logp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    # ratio 1 (old = logp): loss = -(A_1 * 2 tokens + A_2 * 1 token) / 3, grad = -A / 3
    out, _ = diffu_grpo_loss(logp, logp.detach(), adv, scored, 0.2)
    assert float(out.loss_sum.detach()) == pytest.approx(-(2 - 1))
    assert float(out.count) == 3
    out.loss_sum.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-1, -1, 0, 1, 0, 0])
    # ratio 1.5 on every token: A > 0 clipped to 1.2, A < 0 keeps 1.5 (the min)
    old = logp.detach() - math.log(1.5)
    out, stats = diffu_grpo_loss(logp.detach(), old, adv, scored, 0.2)
    assert float(out.loss_sum) == pytest.approx(-1.2 * 2 + 1.5)
    assert float(stats["clip_fraction"]) == 2


def test_kl_k3_and_kl_term():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert float(kl_k3(logp, ref)) == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    scored = torch.tensor([[True]])
    out, stats = diffu_grpo_loss(logp[None], logp[None], torch.tensor([0.0]), scored, 0.2,
                                 0.1, ref[None])  # fmt: skip
    assert float(out.loss_sum) == pytest.approx(0.1 * (math.exp(-0.5) - 0.5))


def test_wd1_loss_by_hand():
    scored = torch.tensor([[True, True], [True, False]])
    logp = torch.tensor([[-1.0, -2.0], [-4.0, -7.0]])
    adv = torch.tensor([1.0, -1.0])
    w_plus = torch.tensor([1.0, -1.0]).softmax(0)
    w_minus = torch.tensor([-1.0, 1.0]).softmax(0)
    seq = torch.tensor([-3.0, -4.0])
    out = wd1_loss(logp, adv, scored, 2)
    assert float(out.loss_sum) == pytest.approx(float(-((w_plus - w_minus) * seq).sum()))
    assert float(out.count) == 1  # one group


def test_spg_loss_by_hand():
    # two passes with weights 0.5 each on token 0; token 1 only in pass 0 (weight 1)
    logps = torch.tensor([[[-1.0, -2.0]], [[-3.0, 0.0]]])  # (K=2, R=1, L=2)
    weights = torch.tensor([[[0.5, 1.0]], [[0.5, 0.0]]])
    passes = Passes(logps, weights)
    scored = torch.tensor([[True, True]])
    elbo = ((0.5 * -1 + 0.5 * -3) + -2.0) / 2
    out = spg_loss(passes, torch.tensor([2.0]), scored, 1.5, 0.5)
    assert float(out.loss_sum) == pytest.approx(-2.0 * elbo * 2)
    beta = 1.5
    eubo0 = math.log(0.5 * math.exp(-beta) + 0.5 * math.exp(-3 * beta)) / beta
    eubo = (eubo0 + -2.0) / 2
    out = spg_loss(passes, torch.tensor([-2.0]), scored, beta, 0.5)
    assert float(out.loss_sum) == pytest.approx(2.0 * (0.5 * eubo + 0.5 * elbo) * 2)
    assert float(out.count) == 2


class _Echo(torch.nn.Module):
    """log p(target) = -(position + 1) / 10 for every target: the estimators' weights show."""

    def forward(self, ids, doc_ids=None, position_ids=None, targets=None, vocab_chunk=0):
        self.last = ids.clone()
        pos = torch.arange(ids.shape[1], dtype=torch.float32).expand(ids.shape) + 1
        return torch.where(targets != -100, pos / 10, 0.0)


def _rows():
    ids = torch.tensor([[5, 6, 7, 8, 9, 2]] * 2)
    prompt = torch.tensor([[True, True, False, False, False, False]] * 2)
    canvas = ~prompt
    scored = canvas & torch.tensor([[True] * 5 + [False]] * 2)  # the last is EOS fill
    return Rows(ids, prompt, canvas, scored)


def _rand(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return lambda shape: torch.rand((2, *shape), generator=gen)


def test_one_step_masks_the_whole_completion():
    model, rows = _Echo(), _rows()
    passes = one_step(model, rows, _rand(), 99, 8, prompt_mask_prob=0.0)
    assert (model.last[:, 2:] == 99).all() and (model.last[:, :2] != 99).all()
    assert passes.forwards == 1
    assert passes.token_estimates()[0].tolist() == pytest.approx([0, 0, -0.3, -0.4, -0.5, 0])
    passes = one_step(model, rows, _rand(), 99, 8, prompt_mask_prob=0.999)
    assert (model.last == 99).all()  # the prompt masked too, never scored
    assert passes.token_estimates()[0, :2].tolist() == [0, 0]


def test_coupled_masks_are_complementary_and_weighted():
    model, rows = _Echo(), _rows()
    passes = coupled(model, rows, _rand(3), 99, 8)
    assert passes.forwards == 3
    w = passes.weights
    first, second = w[1] > 0, w[2] > 0
    assert not (first & second).any() and ((first | second) == rows.scored).all()
    for row in range(2):  # each row its own t: w = 1 / (2 t) on M, 1 / (2 (1 - t)) off it
        on, off = w[1, row][first[row]], w[2, row][second[row]]
        t = 1 / (2 * on[0]) if on.numel() else 1 - 1 / (2 * off[0])
        assert 0.2 <= float(t) <= 0.8
        assert on.tolist() == pytest.approx([float(1 / (2 * t))] * on.numel())
        assert off.tolist() == pytest.approx([float(1 / (2 * (1 - t)))] * off.numel())
    assert (w[0][rows.scored] == 0.5).all()


def test_mc_times_antithetic_and_stratified():
    t = mc_times(_rand(), 4, "antithetic", 0.0)
    assert (t[0] + t[1]).tolist() == pytest.approx([1, 1])
    assert (t[2] + t[3]).tolist() == pytest.approx([1, 1])
    t = mc_times(_rand(), 4, "stratified", 0.0)
    for k in range(4):
        assert ((t[k] >= k / 4) & (t[k] < (k + 1) / 4)).all()


def test_mc_estimate_is_unbiased_for_a_constant_model():
    """With log p fixed per token, E[m / t] = 1: the K-sample mean is the exact sum."""
    rows, total = _rows(), 0.0
    for seed in range(400):
        passes = estimate("mc", _Echo(), rows, _rand(seed), 99, 8, samples=2, time_eps=1e-3)
        total += float(passes.token_estimates()[0].sum())
    assert total / 400 == pytest.approx(-(0.3 + 0.4 + 0.5), rel=0.1)


# ---- the objective on a tiny model -------------------------------------------------------

L = 12


@pytest.fixture(scope="module")
def setup():
    tok = build_char_tokenizer()
    ensure_special_tokens(tok)
    model = tiny_model(num_attention_heads=2, num_key_value_heads=1)
    return tok, model


def _batch(tok, pairs):
    ids, maskable = [], []
    for p, a in pairs:
        pi = tok(p, add_special_tokens=False)["input_ids"]
        ai = tok(a, add_special_tokens=False)["input_ids"]
        ids.append(pi + ai + [tok.eos_token_id] * (L - len(pi) - len(ai)))
        maskable.append([False] * len(pi) + [True] * (L - len(pi)))
    return {"input_ids": torch.tensor(ids), "maskable": torch.tensor(maskable)}


class _Rewards:
    def __init__(self):
        self.seen = []

    def __call__(self, prompts, completions, records):
        self.seen.append((prompts, completions, records))
        total = torch.tensor([float(len(c)) for c in completions])
        return SimpleNamespace(total=total, per_reward={"length": total}, failures={"length": 1},
                               failure_lines=["length: completion 3 timed out"])  # fmt: skip


def _objective(tok, rewards, **cfg):
    return GRPOObjective(GRPOConfig(**cfg), rewards, tok, tok.mask_token_id, tok.eos_token_id,
                         SamplingConfig(temperature=1.0, row_length=L))  # fmt: skip


def test_objective_loss_matches_a_hand_computation(setup):
    tok, model = setup
    batch = _batch(tok, [("rev 12=", "21"), ("sort 931=", "139")])
    rewards = _Rewards()
    obj = _objective(tok, rewards, group_size=3)
    out = obj(model, obj.with_noise(batch, torch.Generator().manual_seed(1)))
    prompts, completions, records = rewards.seen[0]
    assert prompts == ["rev 12="] * 3 + ["sort 931="] * 3
    assert [r["answer"] for r in records] == ["21"] * 3 + ["139"] * 3
    lengths = torch.tensor([float(len(c)) for c in completions])
    adv = group_advantages(lengths, 3, "group")
    scored_tokens = torch.tensor([min(len(c) + 1, L - len(p)) for p, c in
                                  zip(prompts, completions)], dtype=torch.float32)  # fmt: skip
    # ratio 1: loss = -sum_i A_i |o_i| (scored tokens: answer and its EOS) / sum |o_i|
    assert float(out.count) == float(scored_tokens.sum())
    assert float(out.loss_sum.detach()) == pytest.approx(
        float(-(adv * scored_tokens).sum()), abs=1e-5
    )
    log = obj.take_log()
    assert log["reward_mean"] == pytest.approx(float(lengths.mean()), abs=1e-5)
    assert log["reward/length_mean"] == pytest.approx(float(lengths.mean()), abs=1e-5)
    assert len(log["samples"]) == 2 and log["generations_per_second"] > 0
    assert log["reward_failures/length"] == 1
    assert log["reward_failure_lines"] == ["length: completion 3 timed out"]
    assert obj.take_log() == {}  # taken: the next window starts empty


def test_rollouts_do_not_depend_on_batching(setup):
    """Each prompt's group is sampled and masked from its own seed: a batch of two rows gives
    the sum of the two rows' losses alone (what makes 2 ranks match 1)."""
    tok, model = setup
    batch = _batch(tok, [("rev 12=", "21"), ("sort 931=", "139")])
    obj = _objective(tok, _Rewards(), group_size=2, estimator="mc", loss="spg")
    both = obj.with_noise(batch, torch.Generator().manual_seed(5))
    whole = obj(model, both)
    parts = [obj(model, {k: v[i : i + 1] for k, v in both.items()}) for i in range(2)]
    assert float(whole.loss_sum) == pytest.approx(sum(float(p.loss_sum) for p in parts),
                                                  abs=1e-5)  # fmt: skip
    assert float(whole.count) == sum(float(p.count) for p in parts)


def test_inner_iterations_reuse_rollouts_with_old_logps(setup):
    tok, model = setup
    batch = _batch(tok, [("rev 12=", "21")])
    rewards = _Rewards()
    obj = _objective(tok, rewards, group_size=3, inner_iterations=2, estimator="coupled")
    obj.begin_step(0)
    first = obj(model, obj.with_noise(batch, torch.Generator().manual_seed(2)))
    obj.begin_step(1)
    second = obj(model, obj.with_noise(batch, torch.Generator().manual_seed(3)))
    assert len(rewards.seen) == 1  # step 1 reused step 0's rollouts
    # unchanged weights: ratio 1 at both iterations (old log-likelihoods per iteration noise)
    assert float(first.count) == float(second.count)
    assert float(first.loss_sum) == pytest.approx(float(second.loss_sum), abs=1e-5)
    obj.begin_step(2)
    obj(model, obj.with_noise(batch, torch.Generator().manual_seed(4)))
    assert len(rewards.seen) == 2


def test_cached_rollouts_round_trip_through_a_weights_only_file(setup, tmp_path):
    """rank_state mid-cycle: the cached rollouts, saved and loaded with weights_only=True,
    give a fresh objective the same loss at the next inner iteration without a rollout;
    at a cycle's last step there is nothing to carry; other mu / group size: refused."""
    tok, model = setup
    batch = _batch(tok, [("rev 12=", "21"), ("sort 931=", "139")])
    obj = _objective(tok, _Rewards(), group_size=2, inner_iterations=3, estimator="coupled")
    obj.begin_step(3)
    obj(model, obj.with_noise(batch, torch.Generator().manual_seed(2)))
    torch.save(obj.rank_state(), tmp_path / "rank.pt")
    state = torch.load(tmp_path / "rank.pt", weights_only=True)
    assert (state["cycle_start"], state["inner_iterations"], state["group_size"]) == (3, 3, 2)
    assert [r["micro"] for r in state["rollouts"]] == [0]
    assert state["rollouts"][0]["old_logps"].shape[:2] == (3, 4)  # (mu, B * G, L)
    obj.begin_step(4)
    expected = obj(model, batch)
    assert obj.rank_state() != {}  # step 5 still needs them
    obj.begin_step(5)
    assert obj.rank_state() == {}  # step 6 draws fresh ones

    rewards = _Rewards()
    again = _objective(tok, rewards, group_size=2, inner_iterations=3, estimator="coupled")
    assert again.load_rank_state(state) is None
    again.begin_step(4)
    got = again(model, batch)
    assert rewards.seen == []  # no rollout: the saved ones
    assert float(got.loss_sum) == float(expected.loss_sum)
    assert float(got.count) == float(expected.count)
    again.begin_step(6)  # the next cycle: fresh rollouts
    again(model, again.with_noise(batch, torch.Generator().manual_seed(7)))
    assert len(rewards.seen) == 1

    other_mu = _objective(tok, _Rewards(), group_size=2, inner_iterations=2)
    assert other_mu.load_rank_state(state) == (
        "they were drawn with grpo.inner_iterations 3, this run has 2"
    )
    other_g = _objective(tok, _Rewards(), group_size=4, inner_iterations=3)
    assert (
        other_g.load_rank_state(state) == "they were drawn with grpo.group_size 2, this run has 4"
    )
    assert other_g._cache == {}


def test_row_without_prompt_is_refused(setup):
    tok, model = setup
    batch = {"input_ids": torch.tensor([[5, 6, 7]]), "maskable": torch.ones(1, 3, dtype=torch.bool)}
    with pytest.raises(InputError, match="needs prompt/answer rows"):
        _objective(tok, _Rewards())(model, batch)


def test_kl_without_reference_is_refused(setup):
    tok, _ = setup
    with pytest.raises(InputError, match="grpo.kl_beta > 0 needs a frozen reference"):
        _objective(tok, _Rewards(), kl_beta=0.1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["grpo.group_size=1"], "grpo.group_size"),
        ([], "needs rewards"),
        (["grpo.kl_beta=0.1"], "grpo.kl_beta > 0 needs model.lora: true"),
        (["data.packing=true"], "set data.packing: false"),
    ],
)
def test_config_refusals(overrides, message):
    base = ["diffusion.objective=grpo", "data.packing=false"]
    if message != "needs rewards":
        base.append("rewards=[{fn: exact_match}]")
    with pytest.raises(InputError, match=message):
        load_config(None, base + overrides)


def test_rollout_sampling_stays_sampled():
    assert GRPOConfig.model_validate({"sampling": {"threshold": 0.9}}).sampling.temperature == 1


def test_the_recipe_config_validates_and_its_base_recipe_makes_its_model():
    from pathlib import Path

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    cfg = load_config(recipes / "grpo_reverse.yaml")
    assert cfg.diffusion.objective == "grpo" and cfg.grpo.group_size == 8
    assert cfg.rewards == [{"fn": "exact_match"}] and cfg.grpo.sampling.temperature == 1.0
    # `unmask train recipes/grpo_reverse_base.yaml` writes the folder the recipe starts from,
    # trained on the same task and rows
    base = load_config(recipes / "grpo_reverse_base.yaml")
    assert base.diffusion.objective == "mdlm"
    assert f"{base.train.output_dir}/final" == cfg.model.pretrained
    assert base.data == cfg.data
