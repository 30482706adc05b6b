"""Packed and padded rows: EOS between documents, doc ids, positions, maskable."""

import pytest
import torch

from unmask.data import ROW_KEYS, build_char_tokenizer, build_rows, tokenize_records
from unmask.data.rows import segment_layout

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id


def _ids(text):
    return TOK.encode(text, add_special_tokens=False)


def _examples(records):
    return tokenize_records(records, TOK, EOS)


def test_packed_documents_exact_layout():
    rows = build_rows(_examples([{"text": t} for t in ["ab", "cde", "f"]]), 4, EOS, True, True)
    assert len(rows) == 3 and rows.row_length == 4
    t = rows.tensors
    stream = _ids("ab") + [EOS] + _ids("cde") + [EOS] + _ids("f") + [EOS]
    assert t["input_ids"].flatten()[: len(stream)].tolist() == stream  # rows concatenate back
    assert t["input_ids"].flatten()[len(stream) :].tolist() == [EOS] * 3  # fill
    assert t["doc_ids"].tolist() == [[0, 0, 0, 1], [0, 0, 0, 1], [0, 1, 1, 1]]
    # "cde" is cut by the row end: it continues in row 1 with a new id and positions from 0.
    assert t["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 0], [0, 0, 1, 2]]
    assert t["maskable"].tolist() == [[True] * 4, [True] * 4, [True, False, False, False]]
    assert {k: v.dtype for k, v in t.items()} == {
        "input_ids": torch.long,
        "doc_ids": torch.long,
        "position_ids": torch.long,
        "maskable": torch.bool,
    }


def test_packed_stream_roundtrip_many_docs():
    docs = [f"doc {i} " + "x" * (i % 7) for i in range(40)]
    rows = build_rows(_examples([{"text": d} for d in docs]), 16, EOS, True, True)
    flat = rows.tensors["input_ids"].flatten().tolist()
    stream = [t for d in docs for t in _ids(d) + [EOS]]
    assert flat[: len(stream)] == stream
    text = TOK.decode(flat[: len(stream)])
    assert text.split(TOK.eos_token)[:-1] == docs
    # Every doc start (after an EOS, or at column 0) has position 0; positions count up within.
    pos, ids = rows.tensors["position_ids"], rows.tensors["input_ids"]
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, :-1] == EOS
    in_stream = torch.arange(ids.numel()).view_as(ids) < len(stream)
    assert (pos[starts & in_stream] == 0).all()
    assert (pos[~starts & in_stream] > 0).all()


def test_pairs_prompt_not_maskable_in_packed_rows():
    records = [{"prompt": "rev 12=", "response": "21"}, {"prompt": "add 1+2=", "response": "3"}]
    rows = build_rows(_examples(records), 32, EOS, True, True)
    r = rows[0]
    expect_mask = [False] * 7 + [True] * 3 + [False] * 8 + [True] * 2
    assert r["maskable"][:20].tolist() == expect_mask
    assert not r["maskable"][20:].any()  # fill
    assert r["doc_ids"][:20].tolist() == [0] * 10 + [1] * 10
    assert TOK.decode(r["input_ids"][:20]) == "rev 12=21<eos>add 1+2=3<eos>"


@pytest.mark.parametrize("supervise", [True, False])
def test_padded_pairs(supervise):
    records = [{"prompt": "rev 12=", "response": "21"}, {"prompt": "sort 987=", "response": "789"}]
    rows = build_rows(_examples(records), 16, EOS, False, supervise)
    assert len(rows) == 2
    r = rows[0]
    assert TOK.decode(r["input_ids"]) == "rev 12=21" + "<eos>" * 7
    assert r["maskable"].tolist() == [False] * 7 + [True] * 3 + [supervise] * 6
    # a supervised EOS tail is part of the example; an unsupervised one is hidden from it
    assert r["doc_ids"].tolist() == [0] * 10 + [0 if supervise else 1] * 6
    assert r["position_ids"].tolist() == list(range(16))
    assert rows[1]["maskable"].tolist() == [False] * 9 + [True] * 4 + [supervise] * 3


def test_padded_truncates_long_examples():
    rows = build_rows(_examples([{"text": "abcdefgh"}, {"text": "xy"}]), 5, EOS, False, False)
    assert TOK.decode(rows[0]["input_ids"]) == "abcde"
    assert rows[0]["maskable"].all()
    assert TOK.decode(rows[1]["input_ids"]) == "xy<eos><eos><eos>"
    assert rows[1]["maskable"].tolist() == [True, True, True, False, False]


def test_row_store_is_stacked():
    rows = build_rows(_examples([{"text": "abc"}] * 5), 8, EOS, False, True)
    assert set(rows.tensors) == set(ROW_KEYS)
    assert all(v.shape == (5, 8) for v in rows.tensors.values())
    assert rows[2]["input_ids"].shape == (8,)


def test_segment_layout():
    owner = torch.tensor([[7, 7, 3, 3, 3, -1], [3, 3, 3, 9, 9, 9]])
    doc_ids, pos = segment_layout(owner)
    assert doc_ids.tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 1, 1, 1]]
    assert pos.tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 0, 1, 2]]


def test_empty_examples_give_zero_rows():
    for packing in (True, False):
        rows = build_rows([], 8, EOS, packing, True)
        assert len(rows) == 0 and rows.row_length == 8
