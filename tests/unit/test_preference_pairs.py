"""Preference pairs (unmask/posttrain/pairs.py): rows equal to SFT rows of the same
prompt/answer, chat rows, save_to_disk folders, synthetic pairs, refusals."""

import json

import pytest
import torch

from unmask.data import DataConfig, build_char_tokenizer, ensure_special_tokens
from unmask.data.packing import pad_examples, tokenize_records
from unmask.errors import InputError
from unmask.posttrain.pairs import (
    build_pair_datasets,
    heldout_pair_examples,
    load_pairs,
    wrong_answer,
)

ROWS = [{"prompt": "rev 12=", "chosen": "21", "rejected": "12"},
        {"prompt": "sort 31=", "chosen": "13", "rejected": "31"}]  # fmt: skip


@pytest.fixture
def tokenizer():
    tok = build_char_tokenizer()
    ensure_special_tokens(tok)
    return tok


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_pair_rows_are_the_sft_rows_of_each_completion(tmp_path, tokenizer):
    data = write_jsonl(tmp_path / "p.jsonl", ROWS)
    cfg = DataConfig(dataset=str(data), eval_split=0, packing=False, packing_length=12)
    rows = build_pair_datasets(cfg, tokenizer).train
    batch = rows.gather(torch.arange(2))
    eos = tokenizer.eos_token_id
    for key, prefix in (("chosen", ""), ("rejected", "rejected_")):
        records = [{"prompt": r["prompt"], "response": r[key]} for r in ROWS]
        sft = pad_examples(tokenize_records(records, tokenizer, eos), 12, eos, True)
        for name, value in sft.gather(torch.arange(2)).items():
            assert torch.equal(batch[prefix + name], value), (key, name)
    assert not batch["maskable"][0, :7].any() and batch["maskable"][0, 7:].all()


def test_chat_rows_and_a_saved_dataset_give_the_same_pairs(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    chat = [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in ROWS]  # fmt: skip
    from_chat = load_pairs(str(write_jsonl(tmp_path / "c.jsonl", chat)))
    assert from_chat[0]["chosen"]["messages"][-1] == {"role": "assistant", "content": "21"}
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    assert load_pairs(str(folder)) == load_pairs(str(write_jsonl(tmp_path / "p.jsonl", ROWS)))


def test_a_row_without_rejected_is_refused_by_file_row_and_key(tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", [ROWS[0], {"prompt": "x", "chosen": "y"}])
    with pytest.raises(InputError, match=r"p.jsonl'?: row 2 has no 'rejected'"):
        load_pairs(str(data))


def test_synthetic_pairs_reject_a_wrong_answer(tokenizer):
    import random

    rng = random.Random(0)
    for answer in ("12", "987", "5"):
        wrong = wrong_answer(answer, rng)
        assert len(wrong) == len(answer) and wrong != answer
    cfg = DataConfig(synthetic_train_size=16, synthetic_eval_size=4, packing=False,
                     packing_length=20)  # fmt: skip
    data = build_pair_datasets(cfg, tokenizer)
    batch = data.train.gather(torch.arange(16))
    assert len(data.train) == 16 and len(data.eval) == 4
    assert (batch["input_ids"] != batch["rejected_input_ids"]).any(1).all()
    assert torch.equal(batch["maskable"], batch["rejected_maskable"])  # same lengths
    assert len(heldout_pair_examples(cfg, tokenizer)) == 4
