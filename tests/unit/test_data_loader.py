"""Datasets from config, and the loader: resume equals uninterrupted, ranks disjoint."""

import pytest
from conftest import taken, value_rows

from unmask.data import (
    BatchLoader,
    DataConfig,
    build_datasets,
    build_tokenizer,
    eval_batches,
    heldout_examples,
    make_synthetic,
    split_records,
)
from unmask.data.build import eval_count
from unmask.errors import InputError


def test_epoch_is_a_permutation_and_epochs_differ():
    loader = BatchLoader(value_rows(12), batch_size=4, seed=5)
    epoch0 = [i for _ in range(3) for i in taken(next(loader))]
    assert sorted(epoch0) == list(range(12))
    assert loader.state_dict() == {"epoch": 0, "position": 3, "global_batch": 4}
    epoch1 = [i for _ in range(3) for i in taken(next(loader))]
    assert loader.state_dict() == {"epoch": 1, "position": 3, "global_batch": 4}
    assert sorted(epoch1) == list(range(12)) and epoch1 != epoch0
    batch = next(loader)
    assert {k: v.shape for k, v in batch.items()} == {k: (4, 3) for k in batch}


def test_resume_continues_with_the_same_batches():
    rows = value_rows(10)  # 3 batches of 3 per epoch, one row dropped each epoch
    straight = BatchLoader(rows, batch_size=3, seed=1)
    reference = [taken(next(straight)) for _ in range(11)]
    first = BatchLoader(rows, batch_size=3, seed=1)
    for _ in range(4):
        next(first)
    state = first.state_dict()
    assert state == {"epoch": 1, "position": 1, "global_batch": 3}
    resumed = BatchLoader(rows, batch_size=3, seed=1)
    resumed.load_state_dict(dict(state))
    assert [taken(next(resumed)) for _ in range(7)] == reference[4:]
    # Resuming at an epoch end rolls over the same way.
    at_end = BatchLoader(rows, batch_size=3, seed=1)
    at_end.load_state_dict({"epoch": 0, "position": 3})
    assert taken(next(at_end)) == reference[3]


def test_ranks_take_disjoint_slices_of_the_global_batch():
    rows = value_rows(30)
    single = BatchLoader(rows, batch_size=6, seed=2)
    ranks = [BatchLoader(rows, batch_size=2, seed=2, rank=r, world_size=3) for r in range(3)]
    for _ in range(12):  # crosses epochs
        parts = [taken(next(loader)) for loader in ranks]
        assert sum(parts, []) == taken(next(single))
        assert len(set(sum(parts, []))) == 6


def test_dataset_smaller_than_a_batch_repeats():
    loader = BatchLoader(value_rows(3), batch_size=4, seed=0, rank=1, world_size=2)
    assert loader.batches_per_epoch() == 1
    assert len(taken(next(loader))) == 4
    with pytest.raises(InputError, match="no training rows"):
        BatchLoader(value_rows(0), batch_size=4, seed=0)


def _pair(data):
    return data.train, data.eval


def test_eval_batches_in_order():
    batches = list(eval_batches(value_rows(7), batch_size=3))
    assert [taken(b) for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]


SMALL = DataConfig(synthetic_train_size=600, synthetic_eval_size=30, packing_length=64)


def test_build_datasets_synthetic():
    tok = build_tokenizer(SMALL)
    train, evals = _pair(build_datasets(SMALL, tok))
    examples, held = make_synthetic(SMALL)
    train_docs = [d for d in tok.decode(train.tensors["input_ids"].flatten()).split("<eos>") if d]
    assert train_docs == [p + a for p, a in examples]  # the rows hold the stream, in order
    eval_docs = [d for d in tok.decode(evals.tensors["input_ids"].flatten()).split("<eos>") if d]
    assert eval_docs == [p + a for p, a in held]
    assert set(train_docs).isdisjoint(eval_docs)
    assert train.tensors["maskable"].shape == (len(train), 64)
    assert heldout_examples(SMALL) == held


def test_build_datasets_padded_rows_one_per_example():
    cfg = SMALL.model_copy(update={"packing": False, "packing_length": 20})
    train, evals = _pair(build_datasets(cfg, build_tokenizer(cfg)))
    assert (len(train), len(evals)) == (600, 30)
    assert (train.tensors["input_ids"][:, -1] == 1).all()  # every row ends in EOS padding


def test_text_dataset_split_is_disjoint_and_seeded(tmp_path):
    docs = [f"document number {i}" for i in range(40)]
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(docs))
    cfg = DataConfig(dataset=str(path), eval_split=0.1, packing_length=32)
    train, held = split_records(cfg)
    assert len(held) == 4 and len(train) == 36
    assert {r["text"] for r in train}.isdisjoint(r["text"] for r in held)
    assert sorted(r["text"] for r in train + held) == sorted(docs)
    assert split_records(cfg) == (train, held)
    assert split_records(cfg.model_copy(update={"eval_split": 5}))[1].__len__() == 5
    train_rows, eval_rows = _pair(build_datasets(cfg, build_tokenizer(cfg)))
    eval_text = build_tokenizer(cfg).decode(eval_rows.tensors["input_ids"].flatten())
    assert [d for d in eval_text.split("<eos>") if d] == [r["text"] for r in held]


def test_eval_dataset_and_bad_split(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "b.txt").write_text("three\n")
    cfg = DataConfig(dataset=str(tmp_path / "a.txt"), eval_dataset=str(tmp_path / "b.txt"))
    assert split_records(cfg) == ([{"text": "one"}, {"text": "two"}], [{"text": "three"}])
    with pytest.raises(InputError, match="eval_split=2.0 holds out 2 of 2 documents"):
        split_records(DataConfig(dataset=str(tmp_path / "a.txt"), eval_split=2))


def test_eval_count():
    assert [eval_count(100, s) for s in (0, 0.05, 0.001, 1, 7.0)] == [0, 5, 1, 1, 7]


def test_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="packing_len"):
        DataConfig(packing_len=3)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"synthetic_min_digits": 5, "synthetic_max_digits": 3}, "synthetic_min_digits=5 is above"),
        ({"eval_split": 2.5}, "whole count"),
        ({"synthetic_tasks": ["mul"]}, "synthetic_tasks"),
    ],
)
def test_config_checks_values(bad, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**bad)
