"""Hand-computed checks of the SFT, Dream (CART, logit shift, cutoffs), BD3LM and
random-length pieces (formulas in docs/diffusion.md)."""

import conftest
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from unmask.data.packing import TokenizedExample, pad_examples
from unmask.diffusion import DiffusionConfig, build_objective
from unmask.diffusion.config import parse_loss_weight
from unmask.diffusion.cutoffs import (
    perbatch_cutoff,
    prompt_positions,
    random_length_cut,
    resp_cutoff,
)
from unmask.diffusion.noise import sample_t
from unmask.diffusion.recipes import (
    bd3lm_attention_mask,
    bd3lm_block_mask,
    bd3lm_blocks,
    cart_weights,
    shift_logits,
)

MASK = 1


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


class PositionCE(torch.nn.Module):
    """CE = position + 1 wherever a target is given; records every call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, ids, doc_ids=None, position_ids=None, targets=None, vocab_chunk=0, **kw):
        self.calls.append({"ids": ids.clone(), "targets": targets.clone(), **kw})
        pos = torch.arange(ids.shape[1], dtype=torch.float32).expand(ids.shape) + 1
        return torch.where(targets != -100, pos, 0.0)


def tiny_model(seed=0):
    return conftest.tiny_model(seed, vocab_size=40, intermediate_size=48, num_attention_heads=2,
                                num_key_value_heads=1).eval()  # fmt: skip


# ---- config --------------------------------------------------------------------------------


def test_loss_weight_type_parsing():
    assert parse_loss_weight("cart[geo_p:0.3]") == ("cart", 0.3)
    assert parse_loss_weight("cart[geo_p:0.05]") == ("cart", 0.05)
    assert parse_loss_weight("scheduler") == ("scheduler", None)
    with pytest.raises(ValueError, match="unknown loss weight 'cart\\[p:0.3\\]'"):
        parse_loss_weight("cart[p:0.3]")
    with pytest.raises(ValidationError, match="needs objective: dream"):
        DiffusionConfig(objective="mdlm", loss_weight="cart[geo_p:0.3]")
    assert DiffusionConfig(objective="dream", loss_weight="cart[geo_p:0.3]").loss_weight
    with pytest.raises(ValidationError, match="logit_shift: true needs objective sft.* dream"):
        DiffusionConfig(objective="mdlm", logit_shift=True)


# ---- hand-computed formulas ----------------------------------------------------------------


def test_cart_weights_six_tokens_geo_p_03():
    masked = torch.tensor([[False, True, True, False, True, False]])
    w = cart_weights(masked, 0.3)
    # clean j = {0, 3, 5}; w_i = 0.5 * sum_j 0.3 * 0.7^(|i-j|-1)
    # i=1: 0.3 + 0.21 + 0.1029 ; i=2: 0.21 + 0.3 + 0.147 ; i=4: 0.1029 + 0.3 + 0.3
    expected = {1: 0.5 * 0.6129, 2: 0.5 * 0.657, 4: 0.5 * 0.7029}
    for i, value in expected.items():
        assert w[0, i].item() == pytest.approx(value, abs=1e-6)


def test_cart_weights_respect_documents():
    masked = torch.tensor([[False, True, False, True]])
    docs = torch.tensor([[0, 0, 1, 1]])
    w = cart_weights(masked, 0.3, docs)
    assert w[0, 1].item() == pytest.approx(0.5 * 0.3)  # only j=0 is in its document
    assert w[0, 3].item() == pytest.approx(0.5 * 0.3)  # only j=2


def test_logit_shift_hand_values():
    logits = torch.arange(12.0).view(1, 4, 3)
    shifted = shift_logits(logits)
    expected = torch.tensor([[[0, 1, 2], [0, 1, 2], [3, 4, 5], [6, 7, 8.0]]])
    assert torch.equal(shifted, expected)


def test_dream_shifted_loss_equals_ce_of_shifted_logits():
    model = tiny_model()
    ids = torch.randint(3, 40, (2, 7), generator=gen(1))
    masked = torch.zeros(2, 7, dtype=torch.bool)
    masked[0, [1, 4]] = True
    masked[1, [2, 3, 6]] = True
    noisy = torch.where(masked, MASK, ids)
    t = torch.tensor([0.4, 0.7])
    batch = {"input_ids": ids, "t": t, "noisy_input_ids": noisy, "masked": masked}
    cfg = DiffusionConfig(objective="dream", loss_weight="uniform")
    with torch.no_grad():
        out = build_objective(cfg, MASK)(model, batch)
        ref_logits = shift_logits(model(noisy))
    ce = F.cross_entropy(ref_logits.transpose(1, 2), ids, reduction="none")
    assert out.loss_sum.item() == pytest.approx(ce[masked].sum().item(), rel=1e-5)
    assert out.count.item() == 2 * 7 - 2  # position 0 of each row has no previous output


def test_sft_normalization_two_rows_different_answer_lengths():
    ids = torch.randint(3, 40, (2, 6), generator=gen(2))
    maskable = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    masked = torch.tensor([[0, 0, 1, 0, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    batch = {
        "input_ids": ids,
        "maskable": maskable,
        "t": torch.tensor([0.5, 0.25]),
        "noisy_input_ids": torch.where(masked, MASK, ids),
        "masked": masked,
    }
    out = build_objective(DiffusionConfig(objective="sft"), MASK)(PositionCE(), batch)
    # row 0: CE 3 + 5 at positions 2, 4, / t=0.5, / answer_len 4 -> 4
    # row 1: CE 6 at position 5, / t=0.25, / answer_len 3 -> 8
    assert out.loss_sum.item() == pytest.approx(4 + 8)
    assert out.count.item() == 2
    assert (out.loss_sum / out.count).item() == pytest.approx(6.0)


def test_inverse_t_equals_scheduler_for_linear_schedule():
    model = tiny_model()
    ids = torch.randint(3, 40, (4, 9), generator=gen(3))
    outs = []
    for kind in ("inverse_t", "scheduler"):
        for objective in ("mdlm", "sft", "bd3lm"):
            cfg = DiffusionConfig(objective=objective, loss_weight=kind, block_size=3)
            with torch.no_grad():
                outs.append(build_objective(cfg, MASK)(model, {"input_ids": ids}, gen(4)))
    for a, b in zip(outs[:3], outs[3:]):
        assert a.loss_sum.item() == b.loss_sum.item() and a.count.item() == b.count.item()


def test_antithetic_t_for_batch_of_four():
    u = torch.rand(1, generator=gen(0)).item()
    assert u == pytest.approx(0.49626, abs=1e-5)
    t = sample_t(4, "antithetic", 1e-3, gen(0))
    expected = [0.999 * v + 1e-3 for v in (u, u + 0.25, (u + 0.5) % 1, (u + 0.75) % 1)]
    assert t.tolist() == pytest.approx(expected, abs=1e-6)
    assert t.tolist() == pytest.approx([0.496770, 0.746520, 0.996270, 0.247020], abs=1e-5)


def test_bd3lm_attention_mask_l8_block2():
    rows = [
        # x_t half: own block (diagonal), x0 blocks before it
        "1100000000000000",
        "1100000000000000",
        "0011000011000000",
        "0011000011000000",
        "0000110011110000",
        "0000110011110000",
        "0000001111111100",
        "0000001111111100",
        # x0 half: block-causal on x0 only
        "0000000011000000",
        "0000000011000000",
        "0000000011110000",
        "0000000011110000",
        "0000000011111100",
        "0000000011111100",
        "0000000011111111",
        "0000000011111111",
    ]
    expected = torch.tensor([[c == "1" for c in r] for r in rows])
    assert torch.equal(bd3lm_attention_mask(8, 2), expected)


def test_bd3lm_block_zero_does_not_see_later_clean_blocks():
    model = tiny_model()
    ids = torch.randint(3, 40, (1, 8), generator=gen(5))
    cfg = DiffusionConfig(objective="bd3lm", block_size=4, loss_weight="uniform")
    objective = build_objective(cfg, MASK)
    keep = torch.zeros(1, 8, dtype=torch.bool)
    keep[:, :4] = True
    with torch.no_grad():
        a = objective(model, {"input_ids": ids, "maskable": keep}, gen(6))
        changed = ids.clone()
        changed[:, 4:] = (changed[:, 4:] + 1) % 40
        b = objective(model, {"input_ids": changed, "maskable": keep}, gen(6))
    assert a.loss_sum.item() > 0
    assert a.loss_sum.item() == pytest.approx(b.loss_sum.item(), rel=1e-6)
    assert a.count.item() == 4


def test_bd3lm_blocks_start_at_each_answer_and_match_the_sampler():
    from unmask.sampling.generate import Canvas, canvas_blocks

    # two packed documents: prompt 6 + answer 8, then a plain 5-token document
    maskable = torch.tensor([[False] * 6 + [True] * 8 + [True] * 5])
    position_ids = torch.tensor([list(range(14)) + list(range(5))])
    doc_ids = torch.tensor([[0] * 14 + [1] * 5])
    blocks = bd3lm_blocks(position_ids, maskable, doc_ids, 4)
    assert blocks.tolist() == [[-2, -2, -1, -1, -1, -1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1]]
    assert torch.equal(blocks[0, :14], canvas_blocks(6, 8, 4))
    # the training forward (x_t + x0 under the block mask) gives the sampler's logits for
    # the block being decoded: answer block 0 final, block 1 with two masks left
    model = tiny_model().eval()
    x0 = torch.randint(3, 40, (1, 14), generator=gen(7))
    state = x0.clone()
    state[0, [10, 12]] = MASK
    noisy = state.clone()
    noisy[0, 6:10] = MASK  # x_t of block 0: block 1 reads block 0 from x0, not from x_t
    positions = torch.arange(14)[None]
    attn = bd3lm_block_mask(bd3lm_blocks(positions, maskable[:, :14], None, 4))[:, None]
    valid = torch.ones(1, 14, dtype=torch.bool)
    canvas = Canvas(state, valid, valid & (positions < 6), MASK, 0.0, "none",
                     canvas_blocks(6, 8, 4))  # fmt: skip
    with torch.no_grad():
        training = model(torch.cat([noisy, x0], 1), position_ids=positions.repeat(1, 2),
                         attention_mask=attn)[:, 10:14]  # fmt: skip
        sampling = canvas.forward(model, 0, 14, False, 14)[:, 10:14]
    assert (training - sampling).abs().max().item() < 1e-5


# ---- prompts, padding, cutoffs -------------------------------------------------------------


def _sft_rows(supervise_padding):
    examples = [
        TokenizedExample([5, 6, 7, 8, 9, 2], [False, False, False, True, True, True]),
        TokenizedExample([5, 6, 10, 2], [False, False, True, True]),
        TokenizedExample([7, 11, 12, 13, 2], [False, True, True, True, True]),
    ]
    return pad_examples(examples, 10, eos_id=2, supervise_padding=supervise_padding)


@pytest.mark.parametrize("objective", ["sft", "dream"])
def test_prompt_never_masked_over_many_seeds(objective):
    rows = _sft_rows(True)
    batch = rows.gather(torch.arange(3))
    prompt = prompt_positions(batch["maskable"], batch["doc_ids"])
    assert prompt.sum().item() == 3 + 2 + 1
    cfg = DiffusionConfig(objective=objective, resp_cutoff_ratio=0.5, perbatch_cutoff=True)
    obj = build_objective(cfg, MASK)
    model = PositionCE().train()
    for seed in range(300):
        obj(model, batch, gen(seed))
        call = model.calls[-1]
        width = call["ids"].shape[1]
        p = prompt[:, :width]
        assert torch.equal(call["ids"][p], batch["input_ids"][:, :width][p])
        targets = call["targets"]
        if objective == "dream":  # output i - 1 carries the target of position i
            targets = torch.cat([torch.full_like(targets[:, :1], -100), targets[:, :-1]], 1)
        assert (targets[p] == -100).all()


def test_supervise_padding_false_never_trains_padding():
    rows = _sft_rows(False)
    batch = rows.gather(torch.arange(3))
    obj = build_objective(DiffusionConfig(objective="sft"), MASK)
    model = PositionCE()
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[0, 6:], pad[1, 4:], pad[2, 5:] = True, True, True
    for seed in range(100):
        obj(model, batch, gen(seed))
        assert (model.calls[-1]["targets"][pad] == -100).all()
        assert (model.calls[-1]["ids"][pad] == 2).all()
    with_pad = build_objective(DiffusionConfig(objective="sft"), MASK)
    rows_true = _sft_rows(True).gather(torch.arange(3))
    masked_pad = 0
    for seed in range(20):
        with_pad(model, rows_true, gen(seed))
        masked_pad += int((model.calls[-1]["targets"][pad] != -100).sum())
    assert masked_pad > 0


def test_prompt_drop_masks_whole_prompt_without_loss():
    batch = _sft_rows(True).gather(torch.arange(3))
    prompt = prompt_positions(batch["maskable"], batch["doc_ids"])
    obj = build_objective(DiffusionConfig(objective="sft", prompt_drop_prob=1.0), MASK)
    model = PositionCE()
    obj(model, batch, gen(0))
    assert (model.calls[-1]["ids"][prompt] == MASK).all()
    assert (model.calls[-1]["targets"][prompt] == -100).all()


def test_perbatch_cutoff_trims_answers_to_one_length():
    batch = _sft_rows(False).gather(torch.arange(3))
    lengths = batch["maskable"].sum(1).tolist()
    assert lengths == [3, 2, 4]
    seen = set()
    for seed in range(30):
        out = perbatch_cutoff(batch, gen(seed))
        kept = out["maskable"].sum(1)
        k = int(kept.max())
        seen.add(k)
        assert kept.tolist() == [min(n, k) for n in lengths]
        trimmed = batch["maskable"][:, : out["maskable"].shape[1]] & ~out["maskable"]
        # trimmed tokens sit in their own document, invisible to the kept ones
        width = out["maskable"].shape[1]
        assert (out["doc_ids"][trimmed] != 0).all()
        assert torch.equal(out["doc_ids"][~trimmed], batch["doc_ids"][:, :width][~trimmed])
    assert seen == {2, 3, 4}


def test_resp_cutoff_chops_a_tail_shorter_than_the_shortest_answer():
    batch = _sft_rows(True).gather(torch.arange(3))
    shortest = int(batch["maskable"].sum(1).min())
    widths = {resp_cutoff(batch, 1.0, gen(s))["input_ids"].shape[1] for s in range(50)}
    assert widths == set(range(10 - shortest + 1, 10))
    assert resp_cutoff(batch, 0.0, gen(0)) is batch


def test_random_length_cut_is_a_function_of_seed_and_step():
    batch = {"input_ids": torch.zeros(2, 50, dtype=torch.long), "t": torch.ones(2)}
    lengths = [random_length_cut(batch, 0.3, 7, step)["input_ids"].shape[1] for step in range(200)]
    again = [random_length_cut(batch, 0.3, 7, step)["input_ids"].shape[1] for step in range(200)]
    assert lengths == again
    cut = [n for n in lengths if n != 50]
    assert 35 <= len(cut) <= 85 and all(1 <= n <= 50 for n in cut)
    assert random_length_cut(batch, 0.0, 7, 3) is batch


@pytest.mark.parametrize(
    "settings",
    [
        {"objective": "mdlm"},
        {"objective": "llada"},
        {"objective": "sft"},
        {"objective": "sft", "logit_shift": True},
        {"objective": "dream"},
        {"objective": "dream", "logit_shift": False, "mask_prompt_loss": False},
        {"objective": "bd3lm", "block_size": 4},
    ],
)
@pytest.mark.parametrize("supervise_padding", [True, False])
def test_count_before_the_forward_equals_the_calls_count(settings, supervise_padding):
    """`count(batch)`, which the trainer reads before the forward to scale the loss, is the
    count the call returns, for every objective (rows with prompts, padding, a packed
    second document)."""
    batch = _sft_rows(supervise_padding).gather(torch.arange(3))
    batch["doc_ids"][2, 7:] = 1  # a second document in row 2
    batch["position_ids"][2, 7:] = torch.arange(3)
    obj = build_objective(DiffusionConfig(**settings), MASK)
    model = tiny_model().train()
    for seed in range(3):
        before = obj.count(batch)
        out = obj(model, batch, gen(seed))
        assert before.dtype == out.count.dtype == torch.float32
        assert before.item() == out.count.item() > 0


def test_dream_cutoffs_leave_the_count_to_the_forward():
    for cutoff in ({"perbatch_cutoff": True}, {"resp_cutoff_ratio": 0.5}):
        obj = build_objective(DiffusionConfig(objective="dream", **cutoff), MASK)
        assert obj.count(_sft_rows(True).gather(torch.arange(3))) is None


def test_every_objective_name_has_one_class():
    import unmask.posttrain  # noqa: F401  (registers grpo and preference)
    from unmask.diffusion import (
        AutoregressiveObjective,
        BlockDiffusionObjective,
        DreamObjective,
        FastDLLMv2Objective,
        MaskedDiffusionObjective,
        SFTObjective,
        UniformObjective,
        objective_names,
    )

    classes = {"mdlm": MaskedDiffusionObjective, "llada": MaskedDiffusionObjective,
               "bert": MaskedDiffusionObjective, "sft": SFTObjective, "dream": DreamObjective,
               "bd3lm": BlockDiffusionObjective, "ar": AutoregressiveObjective,
               "fastdllm_v2": FastDLLMv2Objective, "uniform": UniformObjective}  # fmt: skip
    names = objective_names()  # the config's choices
    # the post-training objectives are built from a whole run (unmask.posttrain: rewards,
    # pairs and the frozen reference, the teacher)
    assert set(names) - set(classes) == {"grpo", "preference", "distill"}
    assert set(classes) < set(names)
    for name in classes:
        objective = build_objective(DiffusionConfig(objective=name), MASK, eos_id=1)
        assert type(objective) is classes[name]
