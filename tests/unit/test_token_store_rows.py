"""Rows cut from a token store equal the in-memory packing of the same documents (packed and
padded), a run over a store holds out its last documents for eval, checks the store's
tokenizer, and resumes exactly."""

import json

import numpy as np
import pytest
import torch

from unmask.data import (
    BatchLoader,
    DataConfig,
    IndexedStore,
    IndexedWriter,
    build_char_tokenizer,
    build_datasets,
    eval_batches,
)
from unmask.data.indexed import tokenizer_fingerprint, vocab_size
from unmask.data.packing import TokenizedExample, build_rows
from unmask.errors import InputError

TEXTS = ["alpha beta", "", "gamma", "a much longer document " * 4, "é unicode ü", "x"] * 5


def _store(tmp_path, tokenizer, texts=TEXTS, eod=True, sidecar=True):
    prefix = tmp_path / "corpus"
    docs = []
    with IndexedWriter(prefix, np.uint16) as writer:
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = ids + [tokenizer.eos_token_id] if eod else ids
            if ids:
                writer.add_document(ids)
                docs.append(ids)
        meta = {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
                "vocab_size": vocab_size(tokenizer)} if sidecar else None  # fmt: skip
        writer.finish(meta)
    if not sidecar:
        (tmp_path / "corpus.json").unlink(missing_ok=True)
    return str(prefix), docs


@pytest.mark.parametrize("packing", [True, False])
def test_rows_equal_in_memory_rows_of_the_same_documents(tmp_path, packing):
    tok = build_char_tokenizer()
    prefix, docs = _store(tmp_path, tok)
    cfg = DataConfig(dataset=prefix, packing_length=16, packing=packing, eval_split=0)
    data = build_datasets(cfg, tok)
    examples = [TokenizedExample(d, [True] * len(d)) for d in docs]
    expected = build_rows(examples, 16, tok.eos_token_id, packing, supervise_padding=True)
    assert len(data.train) == len(expected)
    got = data.train.gather(torch.arange(len(expected)))
    for key, tensor in expected.tensors.items():
        assert torch.equal(got[key], tensor), key


def test_last_documents_are_held_out_for_eval(tmp_path):
    tok = build_char_tokenizer()
    prefix, docs = _store(tmp_path, tok)
    data = build_datasets(DataConfig(dataset=prefix, packing=False, eval_split=4), tok)
    assert (len(data.train), len(data.eval)) == (len(docs) - 4, 4)
    rows = next(eval_batches(data.eval, 8))["input_ids"]
    for row, doc in zip(rows, docs[-4:]):
        assert row[: len(doc)].tolist() == doc


def test_store_made_with_another_tokenizer_is_refused_and_no_sidecar_is_a_notice(tmp_path):
    tok = build_char_tokenizer()
    prefix, _ = _store(tmp_path, tok)
    meta = json.loads((tmp_path / "corpus.json").read_text())
    meta["tokenizer_fingerprint"] = "0" * 64
    (tmp_path / "corpus.json").write_text(json.dumps(meta))
    with pytest.raises(InputError, match="was made with another tokenizer"):
        build_datasets(DataConfig(dataset=prefix), tok)
    (tmp_path / "corpus.json").unlink()
    data = build_datasets(DataConfig(dataset=prefix, eval_split=1), tok)
    assert len(data.notices) == 1 and "fingerprint check was skipped" in data.notices[0]


def test_added_tokens_do_not_fail_the_check(tmp_path):
    # the trainer checks the tokenizer as saved, before a mask token is added to it
    tok = build_char_tokenizer()
    prefix, _ = _store(tmp_path, tok)
    grown = build_char_tokenizer()
    grown.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    build_datasets(DataConfig(dataset=prefix, eval_split=1), grown, saved_tokenizer=tok)


def test_resume_over_a_store_continues_exactly(tmp_path):
    tok = build_char_tokenizer()
    prefix, _ = _store(tmp_path, tok)
    rows = build_datasets(DataConfig(dataset=prefix, packing_length=8, eval_split=1), tok).train
    straight = BatchLoader(rows, 3, seed=2)
    reference = [next(straight)["input_ids"] for _ in range(9)]
    first = BatchLoader(rows, 3, seed=2)
    for _ in range(4):
        next(first)
    resumed = BatchLoader(rows, 3, seed=2, num_workers=1)
    resumed.load_state_dict(first.state_dict())
    for expected in reference[4:]:
        assert torch.equal(next(resumed)["input_ids"], expected)
    resumed.close()


def test_store_prefix_forms(tmp_path):
    tok = build_char_tokenizer()
    prefix, _ = _store(tmp_path, tok)
    for form in (prefix, prefix + ".bin", prefix + ".idx"):
        data = build_datasets(DataConfig(dataset=form, eval_split=1), tok)
        assert data.train.store.num_documents == IndexedStore(prefix).num_documents
