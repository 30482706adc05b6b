"""Issue 16's sampling options, each against a reference: temperature before top_p / top_k
(transformers' own warpers, Dream's order), LLaDA's EOS / EoT options, the EOS/PAD penalty,
Dream's confidence_threshold, hooks and step history, Fast-dLLM v2 sub-blocks. With every
new option off, the sampler gives the tokens it gave before them (GOLDEN, recorded from the
sampler at commit f964ca3 on a model made of fixed random tables)."""

import pytest
import torch
from conftest import tiny_model
from torch import nn

from unmask.errors import InputError
from unmask.sampling import SamplingConfig, resolve_sampling, sample
from unmask.sampling.generate import canvas_blocks, end_of_turn_id
from unmask.sampling.hooks import import_hook
from unmask.sampling.transfer import filtered_logits, sampling_probs

pytestmark = pytest.mark.usefixtures("one_thread")

V, MASK_ID, EOS, PAD, EOT = 19, 18, 17, 16, 15
PROMPTS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
NEW_OPTIONS_OFF = dict(eos_penalty=0.0, logits_eos_inf=False, confidence_eos_eot_inf=False,
                       sub_block_length=None, logits_hook=None, tokens_hook=None)  # fmt: skip


class TableModel(nn.Module):
    """Logits from fixed random tables: each position's own token, its position, and the
    mean of the whole canvas (so every position sees every other). No weights to init."""

    def __init__(self, seed: int = 0, eos_boost: float = 0.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tok = torch.randn(V, V, generator=g, dtype=torch.float64) * 2.0
        self.pos = torch.randn(64, V, generator=g, dtype=torch.float64) * 2.0
        self.ctx = torch.randn(V, V, generator=g, dtype=torch.float64) * 4.0
        self.tok[:, EOS] += eos_boost

    def forward(self, input_ids, **kwargs):
        onehot = torch.nn.functional.one_hot(input_ids, V).to(torch.float64)
        ctx = onehot.mean(1, keepdim=True) @ self.ctx
        return (onehot @ self.tok + self.pos[: input_ids.shape[1]] + ctx).to(torch.float32)


class Shifted(nn.Module):
    """model's logits with `delta` (V,) added at every position."""

    def __init__(self, model, delta):
        super().__init__()
        self.model, self.delta = model, delta

    def forward(self, input_ids, **kwargs):
        return self.model(input_ids, **kwargs) + self.delta


def gen(seed):
    return None if seed is None else torch.Generator().manual_seed(seed)


def run(kw, model=None, prompts=PROMPTS, **extra):
    kw = dict(kw)
    seed, eos = kw.pop("seed", None), kw.pop("eos", False)
    model = model or TableModel(eos_boost=kw.pop("eos_boost", 0.0))
    kw.pop("eos_boost", None)
    ids = {k: extra.pop(k) for k in ("pad_id", "eot_id") if k in extra}
    return sample(model, prompts, SamplingConfig(**kw, **extra), mask_id=MASK_ID,
                  generator=gen(seed), eos_id=EOS if eos else None, **ids)  # fmt: skip


# (config, answers, nfe) from the sampler before issue 16
GOLDEN = [
    (dict(gen_length=8, steps=8, block_length=4),
     [[8, 11, 11, 0, 0, 13, 13, 13], [8, 8, 11, 5, 11, 13, 13, 13]], 8),
    (dict(gen_length=8, steps=4, temperature=1.0, seed=1),
     [[8, 13, 0, 0, 11, 11, 11, 5], [8, 8, 0, 8, 11, 11, 11, 8]], 4),
    (dict(gen_length=8, steps=8, remasking="maskgit_plus", schedule="dream", temperature=0.5,
          seed=2),
     [[8, 13, 0, 5, 0, 11, 11, 13], [8, 8, 0, 5, 0, 11, 11, 13]], 8),
    (dict(gen_length=8, steps=8, remasking="topk_margin", top_k=5, top_p=0.9),
     [[8, 13, 0, 5, 0, 11, 11, 13], [8, 8, 0, 13, 0, 11, 11, 13]], 8),
    (dict(gen_length=8, steps=8, remasking="entropy", alg_temp=0.5, seed=3),
     [[11, 8, 0, 5, 11, 13, 11, 13], [13, 8, 2, 8, 11, 13, 11, 11]], 8),
    (dict(gen_length=8, threshold=0.5, block_length=4),
     [[11, 11, 11, 5, 0, 11, 11, 13], [8, 8, 11, 5, 11, 13, 13, 13]], 6),
    (dict(gen_length=8, factor=1.0),
     [[8, 13, 0, 5, 11, 11, 11, 13], [8, 8, 0, 17, 11, 11, 11, 13]], 6),
    (dict(gen_length=8, steps=6, remasking="origin", temperature=1.0, seed=4),
     [[11, 13, 0, 5, 0, 13, 11, 11], [8, 8, 11, 5, 11, 11, 6, 8]], 6),
    (dict(gen_length=8, steps=8, remasking="random", temperature=0.8, seed=5, block_length=4,
          eos=True),
     [[8, 3, 11, 5, 0, 11, 13, 5], [8, 8, 11, 5, 0, 11, 6, 10]], 8),
    (dict(gen_length=8, steps=8, shift_logits=True, cfg_scale=0.5),
     [[1, 13, 13, 0, 12, 0, 11, 11], [8, 8, 13, 16, 13, 12, 13, 13]], 8),
    (dict(gen_length=8, steps=8, block_length=2, eos=True, eos_boost=4.0, temperature=0.7,
          seed=6),
     [[8, 11, 0, 17, 17, 17, 17, 17], [11, 8, 8, 17, 17, 17, 17, 17]], 4),
]  # fmt: skip


def identity_logits(step, x, logits):
    return logits


def identity_tokens(step, x, logits):
    return x


@pytest.mark.parametrize("kw,answers,nfe", GOLDEN)
def test_new_options_off_give_the_tokens_of_the_sampler_before_them(kw, answers, nfe):
    out = run(kw, **NEW_OPTIONS_OFF, pad_id=PAD, eot_id=EOT)
    assert out.answers.tolist() == answers and out.nfe == nfe
    # hooks that return what they get, and keeping the history, change nothing either
    seen = run(kw, logits_hook=identity_logits, tokens_hook=identity_tokens, history=True)
    assert seen.answers.tolist() == answers and seen.nfe == nfe
    assert len(seen.history) == seen.steps >= nfe


# ------------------------------------------------------------- filtering order


def _warpers():
    transformers = pytest.importorskip("transformers")
    return (transformers.TemperatureLogitsWarper, transformers.TopKLogitsWarper,
            transformers.TopPLogitsWarper)  # fmt: skip


def _kept_and_probs(logits, temperature, top_k=None, top_p=None):
    filtered = filtered_logits(logits, temperature, top_k, top_p)
    return torch.isfinite(filtered), sampling_probs(filtered, temperature)


@pytest.mark.parametrize("temperature", [0.2, 0.7, 1.5])
@pytest.mark.parametrize("top_k,top_p", [(None, 0.95), (None, 0.6), (7, None), (7, 0.95), (3, 0.5)])
def test_filtering_equals_transformers_warpers_in_dreams_order(temperature, top_k, top_p):
    Temperature, TopK, TopP = _warpers()
    logits = torch.randn(64, 50, generator=gen(0), dtype=torch.float64) * 3
    ids = torch.zeros(64, 1, dtype=torch.long)
    warped = Temperature(temperature)(ids, logits.clone())
    if top_p is not None:  # Dream: nucleus first, then top-k
        warped = TopP(top_p)(ids, warped)
    if top_k is not None:
        warped = TopK(top_k)(ids, warped)
    kept, probs = _kept_and_probs(logits, temperature, top_k, top_p)
    assert torch.equal(kept, torch.isfinite(warped))
    torch.testing.assert_close(probs, torch.softmax(warped, -1), rtol=1e-12, atol=1e-12)


def dream_filter(logits, temperature, top_p, top_k):
    """Dream's sample_tokens order, written out: temper, nucleus (drop a token once the
    mass before it exceeds top_p), top-k; returns the probabilities."""
    logits = logits / temperature if temperature > 0 else logits
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(-1, descending=True)
        cum = torch.softmax(ordered, -1).cumsum(-1)
        drop = torch.zeros_like(cum, dtype=torch.bool)
        drop[..., 1:] = cum[..., :-1] > top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -torch.inf)
    if top_k is not None:
        kth = logits.topk(top_k, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    return torch.softmax(logits, -1)


def test_filtering_follows_dreams_documented_order_not_transformers_generate():
    Temperature, TopK, TopP = _warpers()
    logits = torch.randn(256, 40, generator=gen(1), dtype=torch.float64) * 2
    ids = torch.zeros(256, 1, dtype=torch.long)
    for temperature, top_p, top_k in [(0.2, 0.95, None), (1.0, 0.8, 5), (0.5, 0.9, 3)]:
        kept, probs = _kept_and_probs(logits, temperature, top_k, top_p)
        torch.testing.assert_close(probs, dream_filter(logits, temperature, top_p, top_k))
        assert torch.equal(kept, dream_filter(logits, temperature, top_p, top_k) > 0)
    # transformers' generate runs top-k before top-p: a different set when both are given
    hf = TopP(0.8)(ids, TopK(5)(ids, Temperature(1.0)(ids, logits.clone())))
    kept, _ = _kept_and_probs(logits, 1.0, 5, 0.8)
    assert not torch.equal(kept, torch.isfinite(hf))
    # and the nucleus is taken after the temperature: Dream's T=0.2, top_p=0.95 keeps fewer
    # tokens than filtering the raw logits did
    tempered, _ = _kept_and_probs(logits, 0.2, None, 0.95)
    raw, _ = _kept_and_probs(logits, 1.0, None, 0.95)
    assert tempered.sum() < raw.sum() and not (tempered & ~raw).any()


def test_sampler_draws_from_the_tempered_nucleus():
    # T=0.2, top_p=0.95 (Dream's recommendation): every proposal lies in Dream's kept set
    model = TableModel(seed=3)
    kw = dict(gen_length=8, steps=8, temperature=0.2, top_p=0.95, remasking="maskgit_plus")
    seen = []

    def record(step, x, logits):
        seen.append(dream_filter(logits.to(torch.float64), 0.2, 0.95, None) > 0)
        return logits

    for seed in range(5):
        seen.clear()
        history = run({**kw, "seed": seed}, model=model, logits_hook=record, history=True)
        before = torch.cat([PROMPTS, torch.full((2, 8), MASK_ID)], 1)
        for kept, after in zip(seen, history.history):
            new = (before == MASK_ID) & (after != MASK_ID)
            tokens = after[:, 4:][new[:, 4:]]
            assert kept[new[:, 4:]].gather(-1, tokens[:, None]).all()
            before = after


# ------------------------------------------------------------- EOS options


def test_eos_penalty_lowers_exactly_the_eos_and_pad_logits():
    delta = torch.zeros(V)
    delta[[EOS, PAD]] = -2.5
    for kw in [dict(gen_length=8, steps=8, temperature=0.9, seed=7, eos_boost=4.0, eos=True),
               dict(gen_length=8, steps=8, remasking="maskgit_plus", eos_boost=4.0, eos=True)]:  # fmt: skip
        model = TableModel(eos_boost=kw["eos_boost"])
        penalized = run(kw, model=model, eos_penalty=2.5, pad_id=PAD)
        shifted = run(kw, model=Shifted(model, delta))
        plain = run(kw, model=model)
        assert torch.equal(penalized.sequences, shifted.sequences)
        assert (penalized.answers == EOS).sum() < (plain.answers == EOS).sum()
    huge = run(dict(gen_length=8, steps=8, eos_boost=4.0, eos=True), eos_penalty=1e9,
               pad_id=PAD)  # fmt: skip
    assert not ((huge.answers == EOS) | (huge.answers == PAD)).any()


def test_logits_eos_inf_forbids_eos_and_equals_an_eos_free_model():
    delta = torch.zeros(V)
    delta[EOS] = -torch.inf
    kw = dict(
        gen_length=8, steps=8, block_length=2, eos=True, eos_boost=4.0, temperature=0.7, seed=6
    )  # GOLDEN's EOS case: both rows stop early without it
    model = TableModel(eos_boost=4.0)
    out = run(kw, model=model, logits_eos_inf=True)
    assert torch.equal(out.sequences, run(kw, model=Shifted(model, delta)).sequences)
    assert not (out.answers == EOS).any() and out.tokens == 16


def llada_reference(model, prompt, steps, gen_length, temperature, eos_id, eot_id, gumbel):
    """LLaDA's generate (one block, low_confidence) with logits_eos_inf off and
    confidence_eos_eot_inf on, as its code does it at temperature 0 (the chained
    assignment then reaches EOS and EoT): x0 from the logits, confidence
    softmax(logits with EOS and EoT at -inf)[x0]."""
    x = torch.cat([prompt, torch.full((1, gen_length), MASK_ID)], 1)
    quota = [gen_length // steps + (i < gen_length % steps) for i in range(steps)]
    for k in quota:
        logits = model(x).to(torch.float64)
        logits[..., MASK_ID] = -torch.inf
        x0 = gumbel(logits, temperature).argmax(-1)
        blocked = logits.clone()
        blocked[..., [eos_id, eot_id]] = -torch.inf
        p = torch.softmax(blocked, -1).gather(-1, x0[..., None]).squeeze(-1)
        conf = torch.where(x == MASK_ID, p, -torch.inf)
        chosen = conf[0].topk(k).indices
        x[0, chosen] = x0[0, chosen]
    return x


def test_confidence_eos_eot_inf_matches_llada_and_commits_eos_later():
    model = TableModel(seed=1, eos_boost=3.0)
    model.tok[:, EOT] += 3.0
    prompt = PROMPTS[:1]
    ref = llada_reference(model, prompt, 8, 8, 0.0, EOS, EOT, lambda lg, t: lg)
    kw = dict(gen_length=8, steps=8, eos=True)
    out = run(kw, model=model, prompts=prompt, confidence_eos_eot_inf=True, eot_id=EOT,
              history=True)  # fmt: skip
    assert torch.equal(out.history[-1], ref)  # the canvas before the fill after EOS
    plain = run(kw, model=model, prompts=prompt, history=True)
    assert not torch.equal(plain.history[-1], out.history[-1])

    # EOS / EoT proposals are committed last: later than without the option
    def first_step_with_eos(history):
        return next(i for i, h in enumerate(history) if ((h == EOS) | (h == EOT)).any())

    assert first_step_with_eos(out.history) > first_step_with_eos(plain.history)


def test_end_of_turn_id_comes_from_the_tokenizer():
    from unmask.data.tokenizer import build_char_tokenizer, ensure_special_tokens

    tok = build_char_tokenizer()
    ensure_special_tokens(tok)
    assert end_of_turn_id(tok) is None
    tok.add_special_tokens({"additional_special_tokens": ["<|eot_id|>"]})
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|eot_id|>")


def test_eos_options_refuse_a_missing_id():
    with pytest.raises(InputError, match="logits_eos_inf needs the tokenizer's EOS token id"):
        run(dict(gen_length=4), logits_eos_inf=True)
    with pytest.raises(InputError, match="eos_penalty needs the tokenizer's EOS token id"):
        run(dict(gen_length=4), eos_penalty=1.0)


# ------------------------------------------------------------- Dream confidence_threshold


def dream_confidence_threshold(model, prompt, gen_length, steps, threshold):
    """Dream's `confidence_threshold` loop (batch 1, temperature 0, the logit shift): a
    quota of gen_length / steps per step plus what earlier steps left; the top proposal
    always, the rest of the quota only at confidence >= threshold; past the last step only
    what is left, until nothing is."""
    x = torch.cat([prompt, torch.full((1, gen_length), MASK_ID)], 1)
    per_step, left, i, forwards = gen_length // steps, 0, 0, 0
    while (x == MASK_ID).any():
        logits = model(x).to(torch.float64)
        forwards += 1
        logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)
        logits[..., MASK_ID] = -torch.inf
        probs = torch.softmax(logits, -1)
        conf, x0 = probs.max(-1)
        conf = torch.where(x == MASK_ID, conf, -torch.inf)
        n = min((per_step if i < steps else 0) + left, int((x == MASK_ID).sum()))
        values, order = conf[0].topk(n)
        take = [order[0]] + [order[r] for r in range(1, n) if values[r] >= threshold]
        left = n - len(take)
        for pos in take:
            x[0, pos] = x0[0, pos]
        i += 1
    return x, forwards


@pytest.mark.parametrize("threshold,steps", [(0.9, 4), (0.5, 2), (0.99, 8), (0.0, 2)])
def test_confidence_threshold_matches_dream(threshold, steps):
    model = TableModel(seed=2)
    for row in range(2):
        prompt = PROMPTS[row : row + 1]
        ref, forwards = dream_confidence_threshold(model, prompt, 8, steps, threshold)
        out = run(dict(gen_length=8, steps=steps, remasking="confidence_threshold",
                       threshold=threshold, shift_logits=True), model=model, prompts=prompt)  # fmt: skip
        assert torch.equal(out.sequences, ref) and out.nfe == forwards


def test_confidence_threshold_steps_are_the_quota_when_every_proposal_is_kept():
    out = run(dict(gen_length=8, steps=4, remasking="confidence_threshold", threshold=0.0))
    assert out.nfe == 4
    strict = run(dict(gen_length=8, steps=4, remasking="confidence_threshold", threshold=1.0))
    assert strict.nfe == 8  # one commit a step: every other one is carried


# ------------------------------------------------------------- hooks and history


def test_hooks_see_each_step_and_what_they_return_is_used():
    calls = []

    def logits_hook(step, x, logits):
        calls.append(("logits", step, tuple(x.shape), tuple(logits.shape)))
        boosted = logits.clone()
        boosted[..., 9] += 100.0  # the model now always proposes 9
        return boosted

    def tokens_hook(step, x, logits):
        calls.append(("tokens", step, tuple(x.shape), None if logits is None else logits.shape))
        if step is None:  # Dream's infilling: fix a token before the first step
            x = x.clone()
            x[:, 6] = 3
        return x

    out = run(dict(gen_length=8, steps=4, block_length=4), logits_hook=logits_hook,
              tokens_hook=tokens_hook)  # fmt: skip
    assert out.answers.tolist() == [[9, 9, 3, 9, 9, 9, 9, 9]] * 2
    assert calls[0] == ("tokens", None, (2, 12), None)
    assert [c[:2] for c in calls[1:]] == [(k, s) for s in range(4) for k in ("logits", "tokens")]
    assert calls[1][2:] == ((2, 12), (2, 4, V))


def test_history_is_the_canvas_after_every_step():
    frames = []
    out = run(dict(gen_length=8, steps=4, block_length=4), history=True)
    run(dict(gen_length=8, steps=4, block_length=4), history=False)
    sample(TableModel(), PROMPTS, SamplingConfig(gen_length=8, steps=4, block_length=4),
           mask_id=MASK_ID, on_step=frames.append)  # fmt: skip
    assert len(out.history) == 4 and all(torch.equal(a, b) for a, b in zip(out.history, frames))
    assert [int((h == MASK_ID).sum()) for h in out.history] == [12, 8, 4, 0]
    assert torch.equal(out.history[-1], out.sequences)
    assert run(dict(gen_length=8, steps=4)).history is None


def boom(step, x, logits):
    raise RuntimeError("no")


def test_a_hook_that_raises_or_returns_the_wrong_thing_is_one_line():
    with pytest.raises(InputError, match=r"^logits_hook test_sampling_fidelity:boom raised "
                                         r"at step 0: RuntimeError: no$"):  # fmt: skip
        run(dict(gen_length=4), logits_hook=boom)
    with pytest.raises(InputError, match="tokens_hook .*:boom raised before the first step"):
        run(dict(gen_length=4), tokens_hook=boom)
    with pytest.raises(InputError, match=r"logits_hook .* returned NoneType at step 0; "
                                         r"return the logits, a tensor of shape \(2, 4, 19\)"):  # fmt: skip
        run(dict(gen_length=4), logits_hook=lambda s, x, lg: None)


def test_hooks_by_name():
    assert SamplingConfig(logits_hook="json:dumps").logits_hook is __import__("json").dumps
    assert import_hook("os.path:join") is __import__("os").path.join
    for spec, message in [("json", "expected module:function"),
                          ("no_such_module_x:f", "cannot import module 'no_such_module_x'"),
                          ("json:nope", "module 'json' has no 'nope'"),
                          ("json:__doc__", "is not callable")]:  # fmt: skip
        with pytest.raises(InputError, match=f"bad value for sampling option 'logits_hook': "
                                             f".*{message}"):  # fmt: skip
            resolve_sampling({"logits_hook": spec})


# ------------------------------------------------------------- Fast-dLLM v2 sub-blocks


def block_causal_tiny():
    return tiny_model(vocab_size=V, initializer_range=0.2).eval()


def fast_dllm_v2_reference(model, prompt, gen_length, block, sub, threshold):
    """Fast-dLLM v2's decoding of one row (block-causal attention, temperature 0): blocks
    left to right, inside each its sub-blocks left to right; every step one forward, then
    the sub-block's masked proposals with p > threshold, and the most likely one, are
    committed, until the sub-block has no mask."""
    p = prompt.shape[1]
    x = torch.cat([prompt, torch.full((1, gen_length), MASK_ID)], 1)
    blocks = canvas_blocks(p, gen_length, block)
    allowed = (blocks[None, :] <= blocks[:, None])[None, None]
    forwards = 0
    for start in range(p, p + gen_length, sub):
        while (x[0, start : start + sub] == MASK_ID).any():
            logits = model(x, attention_mask=allowed).to(torch.float64)[0, start : start + sub]
            forwards += 1
            logits[..., MASK_ID] = -torch.inf
            conf, x0 = torch.softmax(logits, -1).max(-1)
            conf = torch.where(x[0, start : start + sub] == MASK_ID, conf, -torch.inf)
            take = conf > threshold
            take[conf.argmax()] = True
            x[0, start : start + sub][take] = x0[take]
    return x, forwards


@pytest.mark.parametrize("threshold", [0.3, 0.6, 0.95])
@pytest.mark.parametrize("sub", [2, 4])
def test_sub_blocks_match_fast_dllm_v2_on_a_block_causal_model(threshold, sub):
    model = block_causal_tiny()
    kw = dict(gen_length=16, block_length=8, block_causal=True, threshold=threshold,
              remasking="maskgit_plus", sub_block_length=sub)  # fmt: skip
    rows = []
    for row in range(2):
        prompt = PROMPTS[row : row + 1]
        ref, forwards = fast_dllm_v2_reference(model, prompt, 16, 8, sub, threshold)
        out = run(kw, model=model, prompts=prompt)
        assert torch.equal(out.sequences, ref) and out.nfe == forwards
        rows.append(out.sequences)
    # in a batch each row moves to its next sub-block on its own: the same tokens
    assert torch.equal(run(kw, model=model).sequences, torch.cat(rows))


def test_sub_blocks_change_the_decoding_order_only():
    model = block_causal_tiny()
    kw = dict(gen_length=16, block_length=8, block_causal=True, threshold=0.6)
    whole = run(kw, model=model, history=True)
    subs = run(kw, model=model, sub_block_length=8, history=True)  # one sub-block = off
    assert torch.equal(whole.sequences, subs.sequences) and whole.nfe == subs.nfe
    ordered = run(kw, model=model, sub_block_length=2, history=True)
    for frame in ordered.history:  # a later sub-block waits until the earlier one is full
        answer = (frame[:, 4:] == MASK_ID).view(2, 8, 2).any(-1)  # (B, sub-blocks)
        assert not (answer[:, :-1] & ~answer[:, 1:]).any()


# ------------------------------------------------------------- bad values


@pytest.mark.parametrize("options,message", [
    ({"top_p": 0}, "bad value for sampling option 'top_p': must be > 0 (got 0)"),
    ({"top_p": 1.5}, "bad value for sampling option 'top_p': must be <= 1 (got 1.5)"),
    ({"eos_penalty": -1}, "bad value for sampling option 'eos_penalty': must be >= 0 (got -1)"),
    ({"remasking": "confidence_threshold"}, "needs a threshold"),
    ({"sub_block_length": 2}, "sub_block_length decodes with threshold or factor"),
    ({"confidence_eos_eot_inf": True, "remasking": "random"}, "uses none"),
])  # fmt: skip
def test_bad_values_are_one_line(options, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_sampling(options)


def test_sub_block_must_divide_the_block():
    config = SamplingConfig(gen_length=8, threshold=0.5, sub_block_length=3)
    with pytest.raises(ValueError, match=r"block_length \(8\) must be a multiple of "
                                         r"sub_block_length \(3\)"):  # fmt: skip
        config.check_lengths()


# ------------------------------------------------------------- the command line


def test_cli_takes_hooks_by_name_and_the_eos_options(tmp_path, monkeypatch, capsys):
    import json

    from conftest import save_tiny_model

    from unmask.cli import main
    from unmask.data.tokenizer import build_char_tokenizer

    folder = save_tiny_model(tmp_path / "model")
    x_id = build_char_tokenizer().convert_tokens_to_ids("x")
    eos_id = build_char_tokenizer().eos_token_id
    (tmp_path / "clihooks.py").write_text(
        "def only_x(step, x, logits):\n"
        f"    logits = logits.clone()\n    logits[..., {x_id}] += 1000.0\n    return logits\n"
        "def eos_first(step, x, logits):\n"
        f"    logits = logits.clone()\n    logits[..., {eos_id}] += 50.0\n    return logits\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("sys.dont_write_bytecode", True)
    base = ["generate", "--model", str(folder), "--prompt", "ab", "--gen-length", "6", "--jsonl"]

    def record(*flags):
        assert main([*base, *flags]) == 0
        return json.loads(capsys.readouterr().out)

    assert record("--logits-hook", "clihooks:only_x")["completion"] == "xxxxxx"
    # the tokenizer's EOS reaches the sampler: a hook that makes every proposal EOS ends
    # the answer at once; with EOS forbidden, or penalized out of reach, it cannot
    eos = ["--logits-hook", "clihooks:eos_first"]
    assert record(*eos)["tokens"] == 0
    assert record(*eos, "--logits-eos-inf")["tokens"] == 6
    assert record(*eos, "--eos-penalty", "1e9")["tokens"] == 6
