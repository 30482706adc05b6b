"""Monte Carlo likelihood: exact for one-token answers, unbiased for the ELBO computed by
enumerating every masked subset, standard error shrinking with mc_num (and unknown with
one draw), perplexity bound, and the conditional likelihood of answers (EOS tail included)
equal to LLaDA's formula evaluated by hand on the masks the estimator drew."""

import itertools
import math
import statistics

import pytest
import torch
from conftest import tiny_model
from torch import nn

from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens
from unmask.sampling.likelihood import (
    answer_log_likelihood,
    combined_stderr,
    eos_tail,
    item_generator,
    log_likelihood,
    mask_counts,
    perplexity_bound,
    standard_error,
)
from unmask.sampling.texts import SamplingModel

V, MASK_ID = 31, 30


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny():
    return tiny_model(vocab_size=V, initializer_range=0.1).eval()


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


def test_standard_error_is_unknown_with_one_draw_else_sample_std_over_sqrt_n():
    assert standard_error([]) is None and standard_error([-3.5]) is None
    draws = [-4.0, -2.5, -3.25, -5.0, -3.0]
    expected = statistics.stdev(draws) / math.sqrt(len(draws))  # n - 1 in the variance
    assert standard_error(draws) == pytest.approx(expected, rel=1e-12)
    assert standard_error([2.0, 2.0]) == 0.0
    assert combined_stderr([3.0, 4.0]) == pytest.approx(5.0)
    assert combined_stderr([3.0, None]) is None and combined_stderr([]) == 0.0


def test_one_draw_has_unknown_stderr_not_zero():
    model = tiny()
    answer = torch.tensor([2, 9, 4])
    one = log_likelihood(model, PROMPT, answer, mask_id=MASK_ID, mc_num=8, batch_size=8,
                         generator=gen())  # fmt: skip
    assert one.draws == 1 and one.samples == 8 and one.stderr is None
    # exact (one-token answer): known to be 0, whatever mc_num
    assert log_likelihood(model, PROMPT, answer[:1], mask_id=MASK_ID, mc_num=8).stderr == 0.0
    # a text of one chunk scored with one draw: unknown per-token stderr too
    bound = perplexity_bound(model, [4, 8, 15], mask_id=MASK_ID, context=8, mc_num=4,
                             batch_size=4, generator=gen())  # fmt: skip
    assert bound.stderr_per_token is None and bound.stderr is None


class Recorder(nn.Module):
    """The model, keeping every canvas it is shown (the masks the estimator drew)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.canvases = model, []

    def forward(self, x):
        self.canvases.append(x.clone())
        return self.model(x)


def llada_reference(model, canvases, prompt_len, target, mask_id):
    """LLaDA's get_log_likelihood on given masked canvases (its forward_process output):
    per batch, loss = sum over rows of CE(masked) / p_mask, / b; ll = -mean over batches.
    Returns (ll, the per-batch values)."""
    per_batch = []
    for x in canvases:
        b = x.shape[0]
        assert not (x[:, :prompt_len] == mask_id).any()  # the prompt is never masked
        answer = x[:, prompt_len:]
        masked = answer == mask_id
        assert torch.equal(answer[~masked], target.expand(b, -1)[~masked])  # the rest: clean
        with torch.no_grad():
            logp = torch.log_softmax(model(x)[:, prompt_len:].double(), -1)
        ce = -logp.gather(-1, target.expand(b, -1)[..., None])[..., 0]
        p_mask = masked.sum(1, keepdim=True).double() / target.numel()
        per_batch.append(-float((ce * masked / p_mask).sum() / b))
    return statistics.fmean(per_batch), per_batch


@pytest.mark.parametrize("end", ["none", "eos", "pad"])
def test_answer_likelihood_is_llada_formula_on_the_drawn_masks(end):
    tok = build_char_tokenizer()
    ensure_special_tokens(tok)
    model = tiny_model(seed=1, initializer_range=0.1).eval()
    recorder = Recorder(model)
    sm = SamplingModel(recorder, tok, tok.mask_token_id, tok.eos_token_id, tok.eos_token_id,
                       torch.device("cpu"), {})  # fmt: skip
    prompt = tok("rev 123=", add_special_tokens=False)["input_ids"]
    answer = tok("321", add_special_tokens=False)["input_ids"]
    tail = eos_tail(end, tok.eos_token_id, len(prompt) + len(answer), row_length=16)
    assert len(tail) == {"none": 0, "eos": 1, "pad": 16 - 11}[end]
    est = answer_log_likelihood(sm, prompt, answer + tail, mc_num=20, batch_size=5,
                                generator=item_generator(7, 3))  # fmt: skip
    target = torch.tensor(answer + tail)
    assert len(recorder.canvases) == 4 and est.draws == 4 and est.samples == 20
    for x in recorder.canvases:  # stratified counts: mask_counts(k) for some k in 1..A
        counts = (x[:, len(prompt) :] == tok.mask_token_id).sum(1)
        assert any(torch.equal(counts, mask_counts(k, len(target), 5))
                   for k in range(1, len(target) + 1))  # fmt: skip
    value, per_batch = llada_reference(model, recorder.canvases, len(prompt), target,
                                       tok.mask_token_id)  # fmt: skip
    assert est.value == pytest.approx(value, abs=1e-5)
    assert est.stderr == pytest.approx(statistics.stdev(per_batch) / 2, rel=1e-4)
    # the same seed and length draw the same masks (common random numbers)
    recorder.canvases.clear()
    wrong = tok("312", add_special_tokens=False)["input_ids"]
    answer_log_likelihood(sm, prompt, wrong + tail, mc_num=20, batch_size=5,
                          generator=item_generator(7, 3))  # fmt: skip
    masks = [x == tok.mask_token_id for x in recorder.canvases]
    assert len(masks) == 4
    recorder.canvases.clear()
    answer_log_likelihood(sm, prompt, answer + tail, mc_num=20, batch_size=5,
                          generator=item_generator(7, 3))  # fmt: skip
    assert all(torch.equal(a, x == tok.mask_token_id) for a, x in zip(masks, recorder.canvases))


def test_eos_tail():
    assert eos_tail("none", 5, 3, 16) == [] and eos_tail("eos", 5, 3) == [5]
    assert eos_tail("pad", 5, 12, 16) == [5] * 4 and eos_tail("pad", 5, 17, 16) == []
    with pytest.raises(ValueError, match="needs an EOS"):
        eos_tail("eos", None, 3)
