"""data.pad_policy (how an answer ends in its rows), the variable-length synthetic task, and
diffusion.loss_normalization against hand-computed values (docs/diffusion.md)."""

import pytest
import torch
from pydantic import ValidationError

from unmask.data import build_char_tokenizer, build_rows, tokenize_records
from unmask.data.config import DataConfig
from unmask.data.synthetic import answer_for, make_synthetic
from unmask.diffusion.config import DiffusionConfig
from unmask.diffusion.objectives import answer_lengths
from unmask.diffusion.registry import build_objective

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id
MASK = TOK.mask_token_id
PAIRS = [{"prompt": "rep 2x1=", "response": "11"}, {"prompt": "rep 1x7=", "response": "7"}]


def _rows(policy: str, length: int = 12):
    cfg = DataConfig(pad_policy=policy)
    examples = tokenize_records(PAIRS, TOK, EOS)
    return build_rows(examples, length, EOS, cfg.packing, cfg.supervise_padding).tensors


def _ids(text):
    return TOK.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("policy", "packing", "supervise"),
    [("eos", False, True), ("single_eos", False, False), ("packed", True, True)],
)
def test_each_policy_sets_the_row_layout(policy, packing, supervise):
    cfg = DataConfig(pad_policy=policy)
    assert (cfg.packing, cfg.supervise_padding) == (packing, supervise)


def test_a_policy_contradicting_an_explicit_setting_is_refused():
    with pytest.raises(ValidationError, match="pad_policy 'eos' means packing: false"):
        DataConfig(pad_policy="eos", packing=True)
    with pytest.raises(ValidationError, match="pad_policy 'single_eos' means supervise_padding"):
        DataConfig(pad_policy="single_eos", supervise_padding=True)
    with pytest.raises(ValidationError, match="'eos', 'single_eos' or 'packed'"):
        DataConfig(pad_policy="eoss")
    assert DataConfig().pad_policy is None and DataConfig().packing  # unset: as before


def test_eos_policy_pads_with_supervised_eos():
    t = _rows("eos")
    prompt = _ids("rep 2x1=")
    assert t["input_ids"][0].tolist() == prompt + _ids("11") + [EOS] * 2
    assert t["maskable"][0].tolist() == [False] * 8 + [True] * 4  # answer, EOS, padding


def test_single_eos_policy_trains_one_eos_and_not_the_padding():
    t = _rows("single_eos")
    assert t["input_ids"][1].tolist() == _ids("rep 1x7=") + _ids("7") + [EOS] * 3
    assert t["maskable"][1].tolist() == [False] * 8 + [True, True, False, False]
    assert t["doc_ids"][1].tolist() == [0] * 10 + [1, 1]  # the padding is hidden from it


def test_packed_policy_puts_answers_back_to_back():
    t = _rows("packed", length=22)
    stream = _ids("rep 2x1=11") + [EOS] + _ids("rep 1x7=7") + [EOS]
    assert t["input_ids"][0, :21].tolist() == stream
    assert t["doc_ids"][0].tolist() == [0] * 11 + [1] * 10 + [2]
    assert t["maskable"][0, :21].tolist() == [False] * 8 + [True] * 3 + [False] * 8 + [True] * 2


def test_repeat_task_answers_and_lengths():
    assert answer_for("rep 3x41=") == "414141"
    assert answer_for("rep 1x0=") == "0"
    cfg = DataConfig(synthetic_tasks=["repeat"], synthetic_min_digits=1, synthetic_max_digits=4,
                     synthetic_train_size=400, synthetic_eval_size=100)  # fmt: skip
    train, held = make_synthetic(cfg)
    assert not {p for p, _ in held} & {p for p, _ in train}
    assert all(answer_for(p) == a for p, a in train + held)
    lengths = {len(a) for _, a in held}
    assert lengths == {1, 2, 3, 4, 6, 8, 9, 12}
    # the answer length is not a function of the prompt length
    by_prompt = {}
    for p, a in held:
        by_prompt.setdefault(len(p), set()).add(len(a))
    assert all(len(v) == 3 for v in by_prompt.values())


# ---- loss normalization ----------------------------------------------------------------------


class ConstantCE(torch.nn.Module):
    """CE = 1 + the target token id / 100 at every target; 0 elsewhere."""

    def forward(self, ids, targets=None, **_):
        return torch.where(targets != -100, 1.0 + targets.float() / 100, 0.0)


def _batch():
    """Two eos-policy rows: answers of 2 and 1 tokens + EOS, supervised padding after."""
    t = _rows("eos")
    masked = t["maskable"].clone()  # every maskable token masked (t = 1: weight 1)
    noisy = t["input_ids"].masked_fill(masked, MASK)
    return {**t, "t": torch.ones(2), "noisy_input_ids": noisy, "masked": masked}


@pytest.mark.parametrize("objective", ["mdlm", "sft"])
@pytest.mark.parametrize("mode", ["token", "answer", "answer_padded"])
def test_normalizations_match_their_formulas(objective, mode):
    batch = _batch()
    ids, maskable = batch["input_ids"], batch["maskable"]
    ce = torch.where(maskable, 1.0 + ids.float() / 100, 0.0)  # weight 1/t = 1
    row_sums = ce.sum(1)
    if mode == "token":
        expected = row_sums.sum() / maskable.sum()
    elif mode == "answer_padded":
        expected = (row_sums / maskable.sum(1)).mean()
    else:  # answer + its EOS: 3 and 2 tokens
        expected = (row_sums / torch.tensor([3.0, 2.0])).mean()
    cfg = DiffusionConfig(objective=objective, loss_normalization=mode)
    obj = build_objective(cfg, MASK, EOS)
    loss_sum, count = obj(ConstantCE(), batch)
    assert (loss_sum / count).item() == pytest.approx(expected.item())
    assert obj.count(batch).item() == count.item()


def test_auto_is_token_for_mdlm_and_answer_padded_for_sft():
    batch = _batch()
    for objective, mode in (("mdlm", "token"), ("sft", "answer_padded")):
        auto = build_objective(DiffusionConfig(objective=objective), MASK, EOS)(ConstantCE(), batch)
        named = build_objective(DiffusionConfig(objective=objective, loss_normalization=mode),
                                MASK, EOS)(ConstantCE(), batch)  # fmt: skip
        assert torch.equal(auto.loss_sum, named.loss_sum) and torch.equal(auto.count, named.count)


def test_answer_lengths_stop_at_the_first_maskable_eos():
    ids = torch.tensor([[7, 8, 9, EOS, EOS, EOS], [7, 9, 9, 9, 9, 9]])
    maskable = torch.tensor([[False, True, True, True, True, True], [False] + [True] * 5])
    assert answer_lengths(ids, maskable, EOS).tolist() == [3.0, 5.0]


def test_dream_takes_no_other_normalization():
    with pytest.raises(ValidationError, match="'dream' normalizes its own way"):
        DiffusionConfig(objective="dream", loss_normalization="answer")
