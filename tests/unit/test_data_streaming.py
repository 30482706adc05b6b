"""Streaming: rows packed on the fly from local jsonl shards equal the in-memory packing of
the same documents, a resumed stream continues with exactly the uninterrupted run's batches
(with and without worker processes), ranks read disjoint shares whose union is the whole
stream, and a hub id offline is one clear line."""

import json

import pytest
import torch

from unmask.data import DataConfig, build_char_tokenizer, build_datasets, make_loader
from unmask.data.packing import build_rows, tokenize_records
from unmask.data.streaming import StreamLoader
from unmask.errors import InputError

DOCS = [[f"shard {s} doc {i} " + "x" * (i % 7) for i in range(30)] for s in range(4)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    for s, docs in enumerate(DOCS):
        with open(folder / f"part-{s:02d}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    return folder


def _tokenizer():
    return build_char_tokenizer()


def _cfg(shards, **extra) -> DataConfig:
    return DataConfig(dataset=str(shards), streaming=True, packing_length=24, eval_split=0,
                      **extra)  # fmt: skip


def _loader(cfg, batch_size=4, rank=0, world=1, workers=0):
    data = build_datasets(cfg, _tokenizer())
    return make_loader(data.train, batch_size, cfg.seed, rank, world, workers)


def test_stream_rows_equal_in_memory_packing(shards):
    loader = _loader(_cfg(shards))
    assert isinstance(loader, StreamLoader)
    streamed = torch.cat([next(loader)["input_ids"] for _ in range(10)])
    tok = _tokenizer()
    records = [{"text": d} for docs in DOCS for d in docs]
    examples = tokenize_records(records, tok, tok.eos_token_id)
    packed = build_rows(examples, 24, tok.eos_token_id, packing=True, supervise_padding=True)
    assert torch.equal(streamed, packed.tensors["input_ids"][:40])


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_exactly(shards, workers):
    cfg = _cfg(shards)
    straight = _loader(cfg, workers=workers)
    reference = [next(straight)["input_ids"] for _ in range(14)]
    first = _loader(cfg, workers=workers)
    for _ in range(5):
        next(first)
    state = first.state_dict()
    resumed = _loader(cfg, workers=workers)
    resumed.load_state_dict(state)
    for expected in reference[5:]:
        assert torch.equal(next(resumed)["input_ids"], expected)


def test_ranks_read_disjoint_shares_whose_union_is_the_stream(shards):
    cfg = _cfg(shards, packing=False)  # one document per row: rows name their documents
    tok = _tokenizer()

    def documents(loader, batches):
        rows = torch.cat([next(loader)["input_ids"] for _ in range(batches)])
        return {tok.decode(r[r != tok.eos_token_id]) for r in rows}

    whole = documents(_loader(cfg, batch_size=4), 30)  # 120 documents: one epoch
    parts = [documents(_loader(cfg, batch_size=4, rank=r, world=2), 15) for r in range(2)]
    assert parts[0].isdisjoint(parts[1])
    assert parts[0] | parts[1] == whole == {d for docs in DOCS for d in docs}


def test_held_out_documents_are_not_streamed_on_any_rank(shards):
    cfg = _cfg(shards, packing=False).model_copy(update={"eval_split": 3})
    data = build_datasets(cfg, _tokenizer())
    assert len(data.eval) == 3
    tok = _tokenizer()
    first = next(make_loader(data.train, 2, 0))["input_ids"][0]
    assert tok.decode(first[first != tok.eos_token_id]) == DOCS[0][3]
    seen = set()
    for rank in range(2):
        loader = make_loader(data.train, 3, 0, rank, 2)
        rows = torch.cat([next(loader)["input_ids"] for _ in range(20)])  # an epoch or more
        seen |= {tok.decode(r[r != tok.eos_token_id]) for r in rows}
    everything = {d for docs in DOCS for d in docs}
    assert seen == everything - set(DOCS[0][:3])


def test_hub_id_without_a_hub_is_one_line(tmp_path):
    cfg = DataConfig(dataset="someone/no-such-dataset", streaming=True, eval_split=0)
    with pytest.raises(InputError, match="not a local path and the Hugging Face hub cannot be"):
        _loader(cfg)


def test_streaming_needs_max_steps():
    from unmask.config import validate_tree
    from unmask.train.plan import make_plan

    cfg = validate_tree({"data": {"dataset": "x", "streaming": True}})
    with pytest.raises(InputError, match="set train.max_steps"):
        make_plan(cfg, None)
