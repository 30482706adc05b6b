"""LLaDA2.1's editing stream (`diffusion.edit_fraction`, docs/diffusion.md, Token editing):
kept tokens replaced by random ones, every kept token in the loss. Each loss is checked
against the definition written out here in plain torch, on the same draws."""

import conftest
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from unmask.diffusion import DiffusionConfig, build_objective
from unmask.diffusion.noise import mask_tokens, replace_tokens, sample_t
from unmask.errors import InputError, describe_validation_error

V, MASK = 40, 2
SPECIAL = (0, 1, 2, 3)  # padding, EOS, mask, unknown (the char tokenizer's order)
CHOICES = [i for i in range(V) if i not in SPECIAL]


class Vocab:
    """What the objective's builder reads of a tokenizer: its length and special ids."""

    all_special_ids = list(SPECIAL)

    def __len__(self):
        return V


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def model(seed=0):
    return conftest.tiny_model(seed, vocab_size=V).eval()


def objective(name="mdlm", edit_fraction=0.25, **cfg):
    cfg = DiffusionConfig(objective=name, edit_fraction=edit_fraction, vocab_chunk_size=16, **cfg)
    return build_objective(cfg, MASK, 1, tokenizer=Vocab())


def rows(b=3, length=12, seed=5):
    ids = torch.randint(4, V, (b, length), generator=gen(seed))
    maskable = torch.ones(b, length, dtype=torch.bool)
    maskable[1, :4] = False  # prompts
    maskable[-1, :2] = False
    return ids, maskable


def edits_by_definition(ids, noisy, kept, fraction, generator):
    """The definition, one position at a time: u < fraction picks a kept position, v picks
    floor(v * n) among the n choices other than the original token."""
    u = torch.rand(ids.shape, generator=generator)
    v = torch.rand(ids.shape, generator=generator)
    out = noisy.clone()
    for b in range(ids.shape[0]):
        for i in range(ids.shape[1]):
            if kept[b, i] and u[b, i] < fraction:
                options = [c for c in CHOICES if c != ids[b, i]]
                out[b, i] = options[int(v[b, i] * len(options))]
    return out


def test_replace_tokens_follows_the_definition_and_is_always_wrong():
    ids = torch.randint(0, V, (4, 30), generator=gen(1))  # specials among the originals too
    kept = torch.rand(4, 30, generator=gen(2)) < 0.7
    choices = torch.tensor(CHOICES)
    noisy, replaced = replace_tokens(ids, ids, kept, 0.5, choices, gen(3))
    expected = edits_by_definition(ids, ids, kept, 0.5, gen(3))
    assert torch.equal(noisy, expected)
    assert torch.equal(replaced, noisy != ids)  # every replacement differs from the original
    assert replaced.any() and not (replaced & ~kept).any()
    assert set(noisy[replaced].tolist()) <= set(CHOICES)


def test_mdlm_loss_equals_the_definition():
    net = model()
    ids, maskable = rows()
    obj = objective("mdlm", 0.3)
    g = gen(4)
    loss_sum, count = obj(net, {"input_ids": ids, "maskable": maskable}, g)
    # the same draws by hand: t, the masks, then the edits
    h = gen(4)
    t = sample_t(3, "uniform", 1e-3, h)
    noisy, masked = mask_tokens(ids, t, maskable, MASK, h)
    kept = maskable & ~masked
    noisy = edits_by_definition(ids, noisy, kept, 0.3, h)
    assert torch.equal(g.get_state(), h.get_state())  # exactly two more draws
    assert (noisy != ids)[kept].any()
    loss = F.cross_entropy(net(noisy).transpose(1, 2), ids, reduction="none")
    expected = (loss * masked / t[:, None]).sum() + (loss * kept).sum()
    torch.testing.assert_close(loss_sum, expected, rtol=1e-5, atol=1e-5)
    assert count.item() == maskable.sum().item()  # token normalization: unchanged
    assert obj.last_stats["num_edited"].item() == ((noisy != ids) & kept).sum().item()
    grads = torch.autograd.grad(loss_sum, list(net.parameters()))
    ref = torch.autograd.grad(expected, list(net.parameters()))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_sft_loss_equals_the_definition_per_answer_length():
    net = model(1)
    ids, maskable = rows(seed=6)
    obj = objective("sft", 0.4, loss_weight="uniform")
    loss_sum, count = obj(net, {"input_ids": ids, "maskable": maskable}, gen(9))
    h = gen(9)
    t = sample_t(3, "uniform", 1e-3, h)
    noisy, masked = mask_tokens(ids, t, maskable, MASK, h)
    kept = maskable & ~masked
    noisy = edits_by_definition(ids, noisy, kept, 0.4, h)
    loss = F.cross_entropy(net(noisy).transpose(1, 2), ids, reduction="none")
    per_row = (loss * (masked | kept)).sum(1) / maskable.sum(1)  # answer_padded, weight 1
    torch.testing.assert_close(loss_sum, per_row.sum(), rtol=1e-5, atol=1e-5)
    assert count.item() == 3  # rows with an answer: unchanged


def test_bd3lm_loss_equals_the_definition():
    net = model(2)
    ids, maskable = rows(b=2, length=8, seed=7)
    maskable[1, :4] = False  # row 1: a 4-token prompt, then blocks of 4 from its answer
    obj = objective("bd3lm", 0.5, block_size=4)
    loss_sum, count = obj(net, {"input_ids": ids, "maskable": maskable}, gen(10))
    h = gen(10)
    t_blocks = sample_t(2 * 2, "uniform", 1e-3, h).view(2, 2)
    block = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [-1, -1, -1, -1, 0, 0, 0, 0]])
    t = t_blocks.gather(1, block.clamp(min=0))
    masked = (torch.rand(ids.shape, generator=h) < t) & maskable
    noisy = torch.where(masked, MASK, ids)
    kept = maskable & ~masked
    noisy = edits_by_definition(ids, noisy, kept, 0.5, h)
    # x_t (first 8) sees its own block and earlier x0 blocks; x0 sees x0 blocks up to its own
    q, k = block[:, :, None], block[:, None, :]
    attend = torch.cat([torch.cat([q == k, q > k], 2),
                        torch.cat([torch.zeros_like(q == k), q >= k], 2)], 1)  # fmt: skip
    positions = torch.arange(8).repeat(2)[None].expand(2, 16)
    logits = net(torch.cat([noisy, ids], 1), position_ids=positions,
                 attention_mask=attend[:, None])[:, :8]  # fmt: skip
    loss = F.cross_entropy(logits.transpose(1, 2), ids, reduction="none")
    expected = (loss * masked / t).sum() + (loss * kept).sum()
    torch.testing.assert_close(loss_sum, expected, rtol=1e-5, atol=1e-5)
    assert count.item() == maskable.sum().item()
    assert not (noisy != ids)[~maskable].any()  # the prompt is never corrupted


@pytest.mark.parametrize("name", ["mdlm", "llada", "sft", "bd3lm"])
def test_edit_fraction_zero_is_the_objective_without_it(name):
    net = model(3)
    ids, maskable = rows(b=2, length=8, seed=8)
    batch = {"input_ids": ids, "maskable": maskable}
    extra = {"block_size": 4} if name == "bd3lm" else {}
    plain = build_objective(DiffusionConfig(objective=name, vocab_chunk_size=16, **extra), MASK)
    off = objective(name, 0.0, **extra)
    g, h = gen(11), gen(11)
    a, b = plain(net, batch, g), off(net, batch, h)
    assert torch.equal(a.loss_sum, b.loss_sum) and torch.equal(a.count, b.count)
    assert torch.equal(g.get_state(), h.get_state())  # nothing more drawn
    assert "num_edited" not in off.last_stats
    if name != "bd3lm":  # and no more than the masking's draws
        k = gen(11)
        mask_tokens(ids, sample_t(2, "uniform", 1e-3, k), maskable, MASK, k)
        assert torch.equal(h.get_state(), k.get_state())


def test_replacements_never_touch_prompt_padding_or_specials():
    # SFT rows: prompt, answer, EOS, then padding; padding supervised in row 0 only
    ids = torch.tensor([[9, 8, 7, 20, 21, 22, 1, 1, 1, 1], [9, 8, 7, 6, 30, 31, 1, 0, 0, 0]])
    maskable = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]])
    maskable = maskable.bool()
    obj = objective("sft", 0.9, prompt_drop_prob=0.5)
    hit = torch.zeros_like(maskable)
    for seed in range(200):
        batch = obj.with_noise({"input_ids": ids, "maskable": maskable}, gen(seed))
        noisy = obj.noise({"input_ids": ids, "maskable": maskable}, gen(seed))[1]
        assert torch.equal(batch["noisy_input_ids"], noisy)
        changed = (noisy != ids) & (noisy != MASK)
        assert not (changed & ~maskable).any()  # prompt and unsupervised padding: never
        assert set(noisy[changed].tolist()) <= set(CHOICES)  # no mask, EOS or padding id
        hit |= changed
    assert torch.equal(hit, maskable)  # every maskable position gets corrupted sometimes


def test_replaced_share_of_the_kept_tokens_is_the_fraction():
    obj = objective("mdlm", 0.2)
    ids = torch.randint(4, V, (128, 128), generator=gen(12))
    noisy = obj.noise({"input_ids": ids}, gen(13))[1]
    kept = noisy != MASK
    share = (noisy != ids)[kept].float().mean().item()
    assert share == pytest.approx(0.2, abs=0.02)  # 8000 kept tokens: sd 0.0045


def test_global_noise_slices_equal_the_whole_batch_draw():
    # each rank of a data-parallel run draws the whole batch and keeps its rows: the edits too
    obj = objective("mdlm", 0.3)
    ids = torch.randint(4, V, (6, 10), generator=gen(14))
    whole = obj.with_noise({"input_ids": ids}, gen(15))
    for offset, size in ((0, 2), (2, 4)):
        part = obj.with_noise({"input_ids": ids[offset : offset + size]}, gen(15),
                              rows=(offset, 6))  # fmt: skip
        for key in ("t", "noisy_input_ids", "masked"):
            assert torch.equal(part[key], whole[key][offset : offset + size]), key
    assert ((whole["noisy_input_ids"] != ids) & ~whole["masked"]).any()


def test_the_replacement_ids_come_from_the_tokenizer():
    from unmask.data.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    cfg = DiffusionConfig(edit_fraction=0.1)
    obj = build_objective(cfg, tokenizer.mask_token_id, tokenizer.eos_token_id,
                          tokenizer=tokenizer)  # fmt: skip
    assert obj.edit_ids.tolist() == list(range(4, len(tokenizer)))  # no <pad> <eos> <mask> <unk>
    alone = build_objective(cfg, MASK)  # no tokenizer: nothing to draw the replacements from
    with pytest.raises(ValueError, match="edit_fraction needs the tokens"):
        alone(model(), {"input_ids": torch.randint(4, V, (2, 6))}, gen())


@pytest.mark.parametrize("name", ["ar", "dream", "fastdllm_v2"])
def test_objectives_that_cannot_take_it_refuse_it_in_one_line(name):
    with pytest.raises(ValidationError) as err:
        DiffusionConfig(objective=name, edit_fraction=0.1)
    line = describe_validation_error(err.value)
    assert line == (f"bad config keys: diffusion.edit_fraction needs objective mdlm, llada, "
                    f"bert, sft or bd3lm, not {name!r}")  # fmt: skip


@pytest.mark.parametrize("value, words", [(1.0, "must be < 1"), (-0.1, "must be >= 0"),
                                          ("lots", "valid number")])  # fmt: skip
def test_out_of_range_values_are_refused_in_one_line(value, words):
    with pytest.raises(ValidationError) as err:
        DiffusionConfig(edit_fraction=value)
    line = describe_validation_error(err.value)
    assert "\n" not in line and "'edit_fraction'" in line and words in line


def test_the_run_config_refuses_it_in_one_line():
    from unmask.config import load_config

    with pytest.raises(InputError, match="diffusion.edit_fraction.*must be < 1") as err:
        load_config(None, ["diffusion.edit_fraction=1"])
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="edit_fraction needs objective .* not 'ar'"):
        load_config(None, ["diffusion.objective=ar", "diffusion.edit_fraction=0.1"])
    cfg = load_config(None, ["diffusion.objective=sft", "diffusion.edit_fraction=0.1"])
    assert cfg.diffusion.edit_fraction == 0.1
