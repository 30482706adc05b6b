"""The sampler's swappable parts: Dream schedules, confidences, threshold / factor
transfer, KV caches, batching of ragged prompts, EOS stopping and the reported counts."""

import math

import pytest
import torch
from conftest import tiny_model

from unmask.models.attention import KVCache
from unmask.sampling import SamplingConfig, dream_schedule, left_pad, sample
from unmask.sampling.generate import canvas_blocks
from unmask.sampling.transfer import (
    filter_top_k_top_p,
    neg_entropy,
    select_factor,
    select_threshold,
    topk_margin,
)

V, MASK_ID, EOS = 29, 28, 27


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(layers: int = 2, seed: int = 0):
    # initializer_range 0.2: peaked predictions, so confidences differ visibly
    return tiny_model(seed, vocab_size=V, num_hidden_layers=layers, initializer_range=0.2).eval()


def run(model, prompts, **kw):
    """`sample` with the sampling options among kw given as a SamplingConfig."""
    call = {k: kw.pop(k) for k in ("mask_id", "eos_id", "attention_mask", "generator",
                                   "on_step") if k in kw}  # fmt: skip
    return sample(model, prompts, SamplingConfig(**kw), **call)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


PROMPT = torch.randint(0, EOS, (3, 5), generator=gen(0))


def test_dream_schedule_vectors():
    counts = dream_schedule(256, 256)
    assert counts == [0] + [1] * 254 + [2]
    counts = dream_schedule(256, 128)
    assert counts == [1] + [2] * 126 + [3]
    assert sum(dream_schedule(37, 5)) == 37


def test_confidence_and_filters_hand_values():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]], dtype=torch.float64)
    assert topk_margin(None, probs, None).item() == pytest.approx(0.2)
    h = 0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2)
    assert neg_entropy(None, probs, None).item() == pytest.approx(h)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_top_k_top_p(logits, top_p=0.7))
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.8
    kept = torch.isfinite(filter_top_k_top_p(logits, top_k=3))
    assert kept.tolist() == [[True, True, True, False]]


def test_threshold_and_factor_selection():
    inf = float("-inf")
    conf = torch.tensor([[0.95, 0.5, 0.91, inf], [0.3, 0.2, inf, inf], [inf] * 4])
    assert select_threshold(conf, 0.9).tolist() == [
        [True, False, True, False],
        [True, False, False, False],  # the top one even below the threshold
        [False] * 4,  # no masked position left
    ]
    # factor 1: rank r accepted while conf >= 1 - 1 / (r + 1): 0.5, 0.667, 0.75, ...
    conf = torch.tensor([[0.6, 0.7, 0.8, inf], [0.2, 0.1, inf, inf]])
    assert select_factor(conf, 1.0).tolist() == [
        [False, True, True, False],  # ranks: 0.8 >= .5, 0.7 >= .667, 0.6 < .75
        [True, False, False, False],
    ]


def _steps_of(**kw):
    """Outputs and the canvas after every step."""
    history = []
    out = run(tiny(), PROMPT, mask_id=MASK_ID, on_step=history.append, **kw)
    return out, history


def test_threshold_one_commits_one_token_per_step_and_equals_quota_decoding():
    out, history = _steps_of(steps=12, gen_length=12, block_length=4, threshold=1.0)
    before = torch.cat([PROMPT, torch.full((3, 12), MASK_ID)], 1)
    for canvas in history:
        newly = ((before == MASK_ID) & (canvas != MASK_ID)).sum(1)
        assert newly.max() <= 1  # confidences of a random model stay below 1.0
        before = canvas
    assert out.nfe == 12 and out.decoded == 36
    quota = run(tiny(), PROMPT, mask_id=MASK_ID, steps=12, gen_length=12, block_length=4)
    assert torch.equal(out.sequences, quota.sequences)


def test_threshold_decodes_in_fewer_forwards():
    low, _ = _steps_of(steps=16, gen_length=16, block_length=8, threshold=0.05)
    assert low.nfe < 16 and low.tokens_per_forward > 1.0
    assert not (low.sequences == MASK_ID).any()


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("shift", [False, True])
def test_cache_refreshed_every_step_equals_no_cache(cache, shift):
    kw = dict(steps=12, gen_length=12, block_length=4, shift_logits=shift, cfg_scale=0.5)
    plain = run(tiny(), PROMPT, mask_id=MASK_ID, **kw)
    cached = run(tiny(), PROMPT, mask_id=MASK_ID, cache=cache, cache_refresh=1, **kw)
    assert torch.equal(plain.sequences, cached.sequences)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("block_length", [12, 4])
def test_cache_exact_for_one_layer(cache, block_length):
    # With one layer the cached K/V depend only on tokens that do not change inside a block
    # (the prompt, finished blocks, masks after the block), so caching is exact.
    model = tiny(layers=1)
    kw = dict(steps=12, gen_length=12, block_length=block_length)
    plain = run(model, PROMPT, mask_id=MASK_ID, **kw)
    cached = run(model, PROMPT, mask_id=MASK_ID, cache=cache, **kw)
    assert torch.equal(plain.sequences, cached.sequences)


def test_prefix_cache_is_approximate_for_a_bidirectional_multilayer_model():
    # Why "prefix cache with one block equals no cache" cannot hold for a bidirectional
    # model with more than one layer: the prompt's layer-2 keys/values depend on the answer
    # positions, which change inside the block, while the cache keeps those of the block
    # start. One layer: exact (test above); block-causal attention: exact (tests below).
    kw = dict(steps=12, gen_length=12, block_length=12, threshold=0.0001)
    canvases = []
    for cache in ("none", "prefix"):
        seen = []
        run(tiny(), PROMPT[:1], mask_id=MASK_ID, cache=cache, on_step=seen.append, **kw)
        canvases.append(seen)
    assert torch.equal(canvases[0][0], canvases[1][0])  # the block start is a full pass
    model = tiny()
    x = canvases[0][0]  # the canvas after the first commit
    cache = KVCache()
    with torch.no_grad():
        positions = torch.arange(x.shape[1]).expand_as(x)
        start = torch.full_like(x, MASK_ID)
        start[:, :5] = x[:, :5]
        model(start, position_ids=positions, kv_cache=cache)  # K/V at the block start
        cache.store, cache.start = False, 5
        cached = model(x[:, 5:], position_ids=positions[:, 5:], kv_cache=cache)
        full = model(x)[:, 5:]
    assert (cached - full).abs().max().item() > 1e-4


def test_canvas_blocks_hand_values():
    # prompt of 5, answer of 8 in blocks of 4: the prompt is cut from its end
    assert canvas_blocks(5, 8, 4).tolist() == [-2, -1, -1, -1, -1, 0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize("block_length", [12, 4])
@pytest.mark.parametrize("kw", [{}, {"threshold": 0.3}, {"cfg_scale": 0.5}])
def test_block_causal_caches_equal_no_cache(cache, block_length, kw):
    # Block-causal attention (block diffusion): K/V of the prompt and finished blocks never
    # depend on later positions, so prefix and dual caches are exact on a 2-layer model,
    # one block (block_length 12) included; ragged prompts with left padding too.
    prompts, valid = left_pad([[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]], pad_id=0)
    opts = dict(steps=12, gen_length=12, block_length=block_length, block_causal=True, **kw)
    model = tiny()
    plain = run(model, prompts, mask_id=MASK_ID, attention_mask=valid, **opts)
    cached = run(model, prompts, mask_id=MASK_ID, attention_mask=valid, cache=cache, **opts)
    assert torch.equal(plain.sequences, cached.sequences)
    assert cached.nfe == plain.nfe


def test_block_causal_blocks_do_not_see_later_blocks():
    model = tiny()
    opts = dict(block_length=4, block_causal=True)
    long = run(model, PROMPT, mask_id=MASK_ID, steps=12, gen_length=12, **opts)
    short = run(model, PROMPT, mask_id=MASK_ID, steps=8, gen_length=8, **opts)
    grown = run(model, PROMPT, mask_id=MASK_ID, steps=12, gen_length=12, growing_canvas=True,
                   **opts)  # fmt: skip
    assert torch.equal(long.sequences[:, :13], short.sequences)
    assert torch.equal(long.sequences, grown.sequences)
    # bidirectional attention: the masks of the third block change the first two
    both = run(model, PROMPT, mask_id=MASK_ID, steps=12, gen_length=12, block_length=4)
    cut = run(model, PROMPT, mask_id=MASK_ID, steps=8, gen_length=8, block_length=4)
    assert not torch.equal(both.sequences[:, :13], cut.sequences)


def test_block_causal_refuses_the_logit_shift():
    with pytest.raises(ValueError, match="block_causal attention cannot use the logit shift"):
        run(tiny(), PROMPT, mask_id=MASK_ID, steps=4, gen_length=4, block_causal=True,
               shift_logits=True)  # fmt: skip


def test_cached_forward_equals_full_forward():
    model = tiny()
    x = torch.randint(0, V, (2, 14), generator=gen(3))
    positions = torch.arange(14).expand(2, 14)
    with torch.no_grad():
        full = model(x)
        cache = KVCache()
        stored = model(x, position_ids=positions, kv_cache=cache)
        cache.store, cache.start = False, 6
        part = model(x[:, 6:10], position_ids=positions[:, 6:10], kv_cache=cache)
    torch.testing.assert_close(stored, full)
    torch.testing.assert_close(part, full[:, 6:10], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kw",
    [
        dict(steps=12, gen_length=12, block_length=4),
        dict(steps=12, gen_length=12, block_length=4, cfg_scale=1.0),
        dict(steps=12, gen_length=12, block_length=4, threshold=0.3, cache="dual"),
        dict(steps=8, gen_length=8, remasking="entropy", schedule="dream", cache="prefix"),
    ],
)
def test_ragged_batch_equals_one_prompt_at_a_time(kw):
    model = tiny()
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6], [5, 3, 5]]
    ids, attention_mask = left_pad(prompts, pad_id=EOS)
    assert attention_mask.sum(1).tolist() == [7, 1, 3]
    batched = run(model, ids, attention_mask=attention_mask, mask_id=MASK_ID, **kw)
    for row, prompt in enumerate(prompts):
        alone = run(model, torch.tensor([prompt]), mask_id=MASK_ID, **kw)
        assert torch.equal(batched.answers[row], alone.answers[0]), row


class EosAfter(torch.nn.Module):
    """Predicts token 1 everywhere, except EOS at canvas positions >= 5 in rows whose prompt
    starts with token 3 (decided from the input, so rows may leave the batch)."""

    def forward(self, input_ids, position_ids=None, attention_mask=None, kv_cache=None):
        b, length = input_ids.shape
        eos_from = torch.where(input_ids[:, 0] == 3, 5, 100)  # (B,)
        logits = torch.zeros(b, length, V)
        logits[..., 1] = 5.0
        late = torch.arange(length)[None, :] >= eos_from[:, None]
        logits[late] = 0.0
        logits[..., EOS] = torch.where(late, 5.0, 0.0)
        return logits


def test_rows_stop_at_eos_after_their_block():
    prompt = torch.tensor([[3, 0], [0, 0]])
    model = EosAfter()  # row 0: EOS from canvas position 5 (answer index 3)
    out = run(model, prompt, mask_id=MASK_ID, steps=16, gen_length=16, block_length=4,
                 eos_id=EOS)  # fmt: skip
    assert out.answers[0].tolist() == [1, 1, 1] + [EOS] * 13
    assert out.answers[1].tolist() == [1] * 16
    assert out.tokens == 3 + 16
    # row 0 (EOS at answer index 3, block 0) left the batch after block 0: 4 steps of
    # 2 rows, then 12 steps of 1 row
    assert out.nfe == 16 and out.row_forwards == 2 * 4 + 1 * 12
    assert out.decoded == 2 * 4 + 12


def test_origin_ddpm_cache_skips_forwards_without_changing_tokens():
    kw = dict(steps=24, gen_length=8, remasking="origin", temperature=1.0)
    plain = run(tiny(), PROMPT, mask_id=MASK_ID, generator=gen(4), **kw)
    cached = run(tiny(), PROMPT, mask_id=MASK_ID, generator=gen(4), ddpm_cache=True, **kw)
    assert torch.equal(plain.sequences, cached.sequences)
    assert not (plain.sequences == MASK_ID).any()
    assert plain.nfe == 24 and cached.nfe < 24


@pytest.mark.parametrize("remasking", ["maskgit_plus", "topk_margin", "entropy", "random"])
def test_dream_schedule_and_confidences_fill_every_mask(remasking):
    out = run(tiny(), PROMPT, mask_id=MASK_ID, steps=8, gen_length=8, schedule="dream",
                 remasking=remasking, alg_temp=0.5 if remasking == "entropy" else None,
                 temperature=0.5, top_p=0.9, top_k=10, generator=gen(1))  # fmt: skip
    assert not (out.sequences == MASK_ID).any() and out.nfe == 8
    assert torch.equal(out.sequences[:, :5], PROMPT)


def test_bad_options_raise():
    with pytest.raises(ValueError, match="unknown cache"):
        run(tiny(), PROMPT, mask_id=MASK_ID, steps=4, gen_length=4, cache="full")
    with pytest.raises(ValueError, match="ddpm_cache needs"):
        run(tiny(), PROMPT, mask_id=MASK_ID, steps=4, gen_length=4, ddpm_cache=True)


class LengthProbe(torch.nn.Module):
    """Records the canvas length of every call; logits from a fixed random table."""

    def __init__(self):
        super().__init__()
        self.lengths = []
        self.table = torch.randn(64, V, generator=gen(7))

    def forward(self, input_ids, position_ids=None, attention_mask=None, kv_cache=None):
        self.lengths.append(input_ids.shape[1])
        return self.table[: input_ids.shape[1]].expand(input_ids.shape[0], -1, -1) + 0.1 * (
            input_ids[..., None] == torch.arange(V)
        )


def test_growing_canvas_shows_only_finished_and_current_blocks():
    probe = LengthProbe()
    out = run(probe, PROMPT, mask_id=MASK_ID, steps=6, gen_length=12, block_length=4,
                 growing_canvas=True)  # fmt: skip
    assert probe.lengths == [9, 9, 13, 13, 17, 17]
    assert not (out.sequences == MASK_ID).any()
    # with one block the growing canvas is the whole canvas: identical tokens
    model = tiny()
    kw = dict(steps=8, gen_length=8, block_length=8)
    assert torch.equal(
        run(model, PROMPT, mask_id=MASK_ID, growing_canvas=True, **kw).sequences,
        run(model, PROMPT, mask_id=MASK_ID, **kw).sequences,
    )
