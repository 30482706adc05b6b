"""Monte Carlo likelihood: exact for one-token answers, unbiased for the ELBO computed by
enumerating every masked subset, standard error shrinking with mc_num, perplexity bound."""

import itertools
import math

import pytest
import torch

from unmask.models import ModelConfig, build_model
from unmask.sampling.likelihood import log_likelihood, mask_counts, perplexity_bound

V, MASK_ID = 31, 30


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      initializer_range=0.1)  # fmt: skip
    return build_model(cfg).eval()


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


PROMPT = torch.tensor([3, 1, 4, 1, 5])


def exact_logprob(model, prompt, token, cfg_scale=0.0):
    x = torch.cat([prompt, torch.tensor([MASK_ID])])[None]
    with torch.no_grad():
        logits = model(x)[0, -1]
        if cfg_scale:
            un = x.clone()
            un[:, : len(prompt)] = MASK_ID
            u = model(un)[0, -1]
            logits = u + (cfg_scale + 1) * (logits - u)
    return torch.log_softmax(logits.double(), -1)[token].item()


@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
def test_one_token_answer_is_exact(cfg_scale):
    model = tiny()
    for token in (0, 7, 29):
        est = log_likelihood(model, PROMPT, torch.tensor([token]), mask_id=MASK_ID,
                             cfg_scale=cfg_scale, generator=gen())  # fmt: skip
        assert est.value == pytest.approx(exact_logprob(model, PROMPT, token, cfg_scale), abs=1e-5)
        assert est.stderr == 0.0


def test_mask_counts_cover_one_to_length():
    assert mask_counts(3, 4, 4).tolist() == [3, 4, 1, 2]
    assert mask_counts(1, 8, 4).tolist() == [1, 3, 5, 7]
    assert mask_counts(5, 3, 1).tolist() == [2]


def exact_elbo(model, prompt, answer):
    """E over m ~ U{1..L} and a uniform m-subset S: -sum_{i in S} CE_i * L / m."""
    length, total = len(answer), 0.0
    for m in range(1, length + 1):
        subsets = list(itertools.combinations(range(length), m))
        acc = 0.0
        for subset in subsets:
            x = torch.cat([prompt, answer]).clone()
            x[[len(prompt) + i for i in subset]] = MASK_ID
            with torch.no_grad():
                logp = torch.log_softmax(model(x[None])[0].double(), -1)
            acc += sum(logp[len(prompt) + i, answer[i]].item() for i in subset) * length / m
        total += acc / len(subsets) / length
    return total


def test_estimate_is_unbiased_and_stderr_falls_with_mc_num():
    model = tiny()
    answer = torch.tensor([2, 9, 4])
    exact = exact_elbo(model, PROMPT, answer)
    small = log_likelihood(model, PROMPT, answer, mask_id=MASK_ID, mc_num=16, batch_size=4,
                           generator=gen(1))  # fmt: skip
    large = log_likelihood(model, PROMPT, answer, mask_id=MASK_ID, mc_num=256, batch_size=4,
                           generator=gen(2))  # fmt: skip
    assert large.samples == 256
    assert large.stderr < small.stderr / 2  # 16x the batches: about 4x smaller
    assert abs(large.value - exact) < 4 * large.stderr + 1e-6
    assert abs(small.value - exact) < 4 * small.stderr + 1e-6


def test_perplexity_bound_of_single_token_chunks_is_exact():
    model = tiny()
    tokens = [4, 8, 15, 16, 23]
    bound = perplexity_bound(model, tokens, mask_id=MASK_ID, context=1, generator=gen())
    empty = torch.tensor([], dtype=torch.long)
    nll = -sum(exact_logprob(model, empty, t) for t in tokens) / len(tokens)
    assert bound.nll_per_token == pytest.approx(nll, abs=1e-5)
    assert bound.perplexity == pytest.approx(math.exp(nll), rel=1e-5)
    assert bound.tokens == 5 and bound.chunks == 5


def test_logit_shift_one_token_answer_reads_the_output_before_it():
    # Dream: the answer token at position P is predicted by the output at P - 1
    model = tiny()
    x = torch.cat([PROMPT, torch.tensor([MASK_ID])])[None]
    with torch.no_grad():
        expected = torch.log_softmax(model(x)[0, -2].double(), -1)
    for token in (0, 7, 29):
        est = log_likelihood(model, PROMPT, torch.tensor([token]), mask_id=MASK_ID,
                             shift_logits=True, generator=gen())  # fmt: skip
        assert est.value == pytest.approx(expected[token].item(), abs=1e-5)
    with pytest.raises(ValueError, match="needs a prompt token before the answer"):
        log_likelihood(model, PROMPT[:0], torch.tensor([1]), mask_id=MASK_ID, shift_logits=True)
    # perplexity: each token is read from the one before it (the text's first is not
    # scored); context 2 = one token before + one scored: every chunk is exact
    tokens = [4, 8, 15, 16]
    bound = perplexity_bound(model, tokens, mask_id=MASK_ID, context=2,
                             shift_logits=True, generator=gen())  # fmt: skip
    assert bound.tokens == 3 and bound.chunks == 3
    nll = 0.0
    for before, after in zip(tokens, tokens[1:]):
        with torch.no_grad():
            logits = model(torch.tensor([[before, MASK_ID]]))[0, 0]
        nll -= torch.log_softmax(logits.double(), -1)[after].item()
    assert bound.nll_per_token == pytest.approx(nll / 3, abs=1e-5)
