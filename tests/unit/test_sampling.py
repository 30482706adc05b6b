"""LLaDA generate: quotas, Gumbel sampling, and token-for-token agreement with a
straightforward per-row re-implementation of the algorithm in docs/diffusion.md."""

import math

import numpy as np
import pytest
import torch
from conftest import tiny_model
from torch import nn

from unmask.sampling import add_gumbel_noise, cfg_combine, generate, num_transfer_tokens

V, H, MASK_ID = 23, 16, 22


pytestmark = pytest.mark.usefixtures("one_thread")


class StandIn(nn.Module):
    """Tiny random bidirectional model returning (B, L, V) logits."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, H)
        self.pos = nn.Parameter(torch.randn(64, H))
        self.mix = nn.Linear(H, H)
        self.head = nn.Linear(H, V)

    def forward(self, input_ids, doc_ids=None, position_ids=None, targets=None):
        h = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        attn = torch.softmax(h @ h.transpose(1, 2) / math.sqrt(H), dim=-1)
        return 3.0 * self.head(h + torch.tanh(self.mix(attn @ h)))


def real_model():
    """unmask's own model at a tiny size."""
    return tiny_model(vocab_size=V).eval()


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def reference_generate(model, prompt, steps, gen_length, block_length, temperature, remasking,
                       cfg_scale, generator):  # fmt: skip
    """Plain Python loops over rows and steps, following docs/diffusion.md literally."""
    with torch.no_grad():
        return _reference(model, prompt, steps, gen_length, block_length, temperature,
                          remasking, cfg_scale, generator)  # fmt: skip


def _reference(model, prompt, steps, gen_length, block_length, temperature, remasking,
               cfg_scale, generator):  # fmt: skip
    b, p = prompt.shape
    x = torch.cat([prompt, torch.full((b, gen_length), MASK_ID)], dim=1)
    num_blocks = gen_length // block_length
    s = steps // num_blocks
    for blk in range(num_blocks):
        lo, hi = p + blk * block_length, p + (blk + 1) * block_length
        quotas = []
        for row in range(b):
            n = int((x[row, lo:hi] == MASK_ID).sum())
            quotas.append([n // s + (1 if i < n % s else 0) for i in range(s)])
        for i in range(s):
            logits = model(x)
            if cfg_scale > 0:
                un_x = x.clone()
                un_x[:, :p] = MASK_ID
                un = model(un_x)
                logits = un + (cfg_scale + 1) * (logits - un)
            # noise is drawn for the current block only (the other positions are not used)
            noisy = logits[:, lo:hi].double().clone()
            noisy[..., MASK_ID] = float("-inf")  # the mask token is never a prediction
            if temperature > 0:
                u = torch.rand(noisy.shape, generator=generator, dtype=torch.float64)
                noisy = noisy / temperature - torch.log(-torch.log(u))
            x0 = noisy.argmax(-1)  # (b, block)
            if remasking == "random":
                conf = torch.rand(x0.shape, generator=generator, dtype=torch.float64)
            new_x = x.clone()
            for row in range(b):
                probs = torch.softmax(logits[row].double(), dim=-1)
                candidates = []
                for j in range(lo, hi):
                    if x[row, j] == MASK_ID:
                        c = (
                            conf[row, j - lo]
                            if remasking == "random"
                            else probs[j, x0[row, j - lo]]
                        )
                        candidates.append((float(c), j))
                candidates.sort(key=lambda cj: -cj[0])
                for _, j in candidates[: quotas[row][i]]:
                    new_x[row, j] = x0[row, j - lo]
            x = new_x
    return x


def test_quota_matches_hand_values():
    out = num_transfer_tokens(torch.tensor([32, 10, 3, 0]), 8)
    assert out[0].tolist() == [4] * 8
    assert out[2].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert out[3].tolist() == [0] * 8
    assert num_transfer_tokens(torch.tensor([10]), 4).tolist() == [[3, 3, 2, 2]]
    assert out.sum(1).tolist() == [32, 10, 3, 0]


def test_gumbel_noise_samples_softmax():
    assert add_gumbel_noise(torch.tensor([1.0, 2.0]), 0.0).dtype == torch.float32
    logits = torch.log(torch.tensor([0.2, 0.7, 0.1])).expand(50_000, 3)
    noisy = add_gumbel_noise(logits, 1.0, gen(1))
    assert noisy.dtype == torch.float64
    freq = torch.bincount(noisy.argmax(-1), minlength=3).double() / 50_000
    np.testing.assert_allclose(freq.numpy(), [0.2, 0.7, 0.1], atol=0.01)
    # T = 0.5 samples softmax(l / 0.5) = p^2 / sum p^2
    freq = torch.bincount(add_gumbel_noise(logits, 0.5, gen(2)).argmax(-1), minlength=3)
    p2 = np.array([0.04, 0.49, 0.01]) / 0.54
    np.testing.assert_allclose(freq.double().numpy() / 50_000, p2, atol=0.01)


PROMPT = torch.randint(0, MASK_ID, (3, 5), generator=gen(0))


@pytest.mark.parametrize(
    "steps,gen_length,block_length,temperature,remasking,cfg_scale",
    [
        (8, 8, 8, 0.0, "low_confidence", 0.0),
        (6, 12, 4, 0.0, "low_confidence", 0.0),
        (4, 10, 5, 0.0, "low_confidence", 0.0),  # 5 masks in 2 steps: quotas [3, 2]
        (6, 12, 4, 1.0, "low_confidence", 0.0),
        (6, 12, 6, 0.7, "random", 0.0),
        (4, 8, 4, 0.0, "low_confidence", 1.5),
    ],
)
def test_generate_matches_reference(steps, gen_length, block_length, temperature, remasking,
                                    cfg_scale):  # fmt: skip
    model = StandIn().eval()
    kw = dict(steps=steps, gen_length=gen_length, block_length=block_length,
              temperature=temperature, remasking=remasking, cfg_scale=cfg_scale)  # fmt: skip
    out = generate(model, PROMPT, mask_id=MASK_ID, generator=gen(5), **kw)
    ref = reference_generate(model, PROMPT, generator=gen(5), **kw)
    assert out.shape == (3, 5 + gen_length)
    assert torch.equal(out, ref)
    assert torch.equal(out[:, :5], PROMPT)
    assert not (out == MASK_ID).any()


@pytest.mark.parametrize("temperature,cfg_scale", [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0)])
def test_generate_matches_reference_with_unmask_model(temperature, cfg_scale):
    model = real_model()
    kw = dict(steps=6, gen_length=12, block_length=4, temperature=temperature,
              remasking="low_confidence", cfg_scale=cfg_scale)  # fmt: skip
    out = generate(model, PROMPT, mask_id=MASK_ID, generator=gen(3), **kw)
    assert torch.equal(out, reference_generate(model, PROMPT, generator=gen(3), **kw))
    assert torch.equal(out[:, :5], PROMPT) and not (out == MASK_ID).any()


def test_greedy_deterministic_and_seeded_sampling_reproducible():
    model = StandIn().eval()
    kw = dict(mask_id=MASK_ID, steps=8, gen_length=8, block_length=4)
    assert torch.equal(generate(model, PROMPT, **kw), generate(model, PROMPT, **kw))
    a = generate(model, PROMPT, temperature=1.0, generator=gen(9), **kw)
    b = generate(model, PROMPT, temperature=1.0, generator=gen(9), **kw)
    c = generate(model, PROMPT, temperature=1.0, generator=gen(10), **kw)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_one_step_per_token_commits_in_confidence_order():
    # With steps == gen_length every step commits exactly one token per row.
    model = StandIn().eval()
    out = generate(model, PROMPT[:1], mask_id=MASK_ID, steps=6, gen_length=6, block_length=6)
    first = model(torch.cat([PROMPT[:1], torch.full((1, 6), MASK_ID)], 1))[0, 5:]
    probs = torch.softmax(first.double(), -1)
    x0 = probs.index_fill(-1, torch.tensor([MASK_ID]), -1.0).argmax(-1)  # (6,)
    j = int(probs.gather(-1, x0[:, None]).argmax())  # the most confident position goes first
    assert out[0, 5 + j] == x0[j]


def test_cfg():
    cond, un = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    torch.testing.assert_close(cfg_combine(cond, un, 0.0), cond)
    torch.testing.assert_close(cfg_combine(cond, un, 1.0), 2 * cond - un)
    model = StandIn().eval()
    kw = dict(mask_id=MASK_ID, steps=4, gen_length=8, block_length=4)
    assert torch.equal(generate(model, PROMPT, cfg_scale=0.0, **kw), generate(model, PROMPT, **kw))
    guided = generate(model, PROMPT, cfg_scale=3.0, **kw)
    assert torch.equal(guided[:, :5], PROMPT) and not (guided == MASK_ID).any()


def test_bad_lengths_raise():
    model = StandIn()
    with pytest.raises(ValueError, match="multiple of block_length"):
        generate(model, PROMPT, mask_id=MASK_ID, steps=4, gen_length=10, block_length=4)
    with pytest.raises(ValueError, match="multiple of the number of blocks"):
        generate(model, PROMPT, mask_id=MASK_ID, steps=5, gen_length=8, block_length=4)
    with pytest.raises(ValueError, match="remasking"):
        generate(model, PROMPT, mask_id=MASK_ID, steps=4, gen_length=8, remasking="nope")
