"""The token store: our writer and reader, Megatron interchange both ways, bad stores refused."""

import struct
import time

import numpy as np
import pytest

from unmask.data.indexed import (
    IndexedStore,
    IndexedWriter,
    _write_index,
    check_store_tokenizer,
    token_dtype,
    tokenizer_fingerprint,
)
from unmask.data.tokenizer import build_char_tokenizer
from unmask.errors import InputError

DOCS = [[5, 6, 7], [8], list(range(3000)), [65000, 1, 2], [9, 9]]


def write_store(prefix, docs=DOCS, dtype=np.uint16, meta=None):
    with IndexedWriter(prefix, dtype) as writer:
        writer.add_document(docs[0])
        lengths = [len(d) for d in docs[1:]]
        writer.add_documents(np.concatenate([np.asarray(d) for d in docs[1:]]), lengths)
        return writer.finish(meta or {})


def megatron():
    return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def test_round_trip_offsets_and_sidecar(tmp_path):
    prefix = tmp_path / "s"
    paths = write_store(prefix, meta={"note": "x"})
    assert [p.name for p in paths] == ["s.bin", "s.idx", "s.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin", "s.idx", "s.json"]
    store = IndexedStore(prefix)
    assert store.dtype == np.uint16 and len(store) == store.num_documents == len(DOCS)
    assert store.num_tokens == sum(map(len, DOCS))
    assert store.doc_offsets.dtype == np.int64
    assert store.doc_offsets.tolist() == np.cumsum([0] + [len(d) for d in DOCS]).tolist()
    assert [store.document(i).tolist() for i in range(len(DOCS))] == DOCS
    assert store.document(-1).tolist() == DOCS[-1]
    assert store.tokens(2, 5).tolist() == [7, 8, 0]
    assert store.meta == {"note": "x", "dtype": "uint16", "documents": 5, "tokens": 3009}
    with pytest.raises(IndexError):
        store.tokens(0, store.num_tokens + 1)


def test_token_dtype_rule():
    assert token_dtype(65499) == np.uint16 and token_dtype(65500) == np.int32


def test_int32_store_and_ids_that_do_not_fit(tmp_path):
    docs = [[70000, 1], [2**31 - 1]]
    write_store(tmp_path / "big", docs, dtype=np.int32)
    store = IndexedStore(tmp_path / "big")
    assert store.dtype == np.int32 and store.document(0).tolist() == [70000, 1]
    with (
        pytest.raises(InputError, match="does not fit"),
        IndexedWriter(tmp_path / "u", np.uint16) as w,
    ):
        w.add_documents(np.array([70000], dtype=np.int64), [1])
    assert list(tmp_path.glob("u*")) == []


def test_error_inside_the_writer_leaves_nothing_and_stale_temporaries_are_replaced(tmp_path):
    prefix = tmp_path / "s"
    with pytest.raises(RuntimeError), IndexedWriter(prefix, np.uint16) as writer:
        writer.add_document([1, 2, 3])
        raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "s.bin.tmp").write_bytes(b"garbage from a killed run" * 100)
    (tmp_path / "s.idx.tmp").write_bytes(b"garbage")
    write_store(prefix)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin", "s.idx", "s.json"]
    assert IndexedStore(prefix).document(2).tolist() == DOCS[2]


def test_existing_store_needs_overwrite(tmp_path):
    write_store(tmp_path / "s")
    before = (tmp_path / "s.bin").read_bytes()
    with pytest.raises(InputError, match="s.bin and s.idx already exist.*--overwrite"):
        IndexedWriter(tmp_path / "s", np.uint16)
    assert (tmp_path / "s.bin").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin", "s.idx", "s.json"]


def test_overwrite_replaces(tmp_path):
    write_store(tmp_path / "s")
    with IndexedWriter(tmp_path / "s", np.uint16, overwrite=True) as writer:
        writer.add_document([4, 2])
        writer.finish()
    assert IndexedStore(tmp_path / "s").document(0).tolist() == [4, 2]


def test_megatron_reads_our_store(tmp_path):
    mm = megatron()
    write_store(tmp_path / "s")
    ds = mm.IndexedDataset(str(tmp_path / "s"))
    assert len(ds) == len(DOCS) and ds.document_indices.tolist() == list(range(len(DOCS) + 1))
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS
    assert ds.index.dtype == np.uint16


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # megatron's builder on numpy 2
def test_we_read_a_megatron_store_with_multi_sequence_documents(tmp_path):
    mm = megatron()
    import torch  # the builder takes tensors

    builder = mm.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.int32)
    builder.add_item(torch.tensor([1, 2, 3]))
    builder.add_item(torch.tensor([70000]))
    builder.end_document()  # document 0: two sequences
    builder.add_document(torch.tensor([5, 6, 7, 8, 9]), [2, 3])  # document 1: two sequences
    builder.end_document()  # document 2: empty
    builder.add_document(torch.tensor([4]), [1])
    builder.finalize(str(tmp_path / "m.idx"))
    store = IndexedStore(tmp_path / "m")
    assert store.dtype == np.int32 and store.meta is None
    assert store.num_documents == 4 and store.num_sequences == 5
    assert store.doc_offsets.tolist() == [0, 4, 9, 9, 10]
    docs = [store.document(i).tolist() for i in range(4)]
    assert docs == [[1, 2, 3, 70000], [5, 6, 7, 8, 9], [], [4]]
    ds = mm.IndexedDataset(str(tmp_path / "m"))
    bounds = ds.document_indices
    for i, doc in enumerate(docs):
        seqs = [ds[j].tolist() for j in range(bounds[i], bounds[i + 1])]
        assert sum(seqs, []) == doc
    notice = check_store_tokenizer(store, build_char_tokenizer())
    assert "fingerprint check was skipped" in notice


def test_tokenizer_check(tmp_path):
    tok = build_char_tokenizer()
    meta = {"tokenizer_fingerprint": tokenizer_fingerprint(tok), "vocab_size": len(tok)}
    write_store(tmp_path / "s", meta=meta)
    store = IndexedStore(tmp_path / "s")
    assert check_store_tokenizer(store, tok) is None
    tok.backend_tokenizer.enable_truncation(8)  # call-time settings are not the vocabulary
    assert check_store_tokenizer(store, tok) is None
    other = build_char_tokenizer()
    other.add_tokens(["<extra>"])
    with pytest.raises(InputError) as err:
        check_store_tokenizer(store, other)
    text = str(err.value)
    assert "another tokenizer" in text and "\n" not in text
    assert meta["tokenizer_fingerprint"][:12] in text and tokenizer_fingerprint(other)[:12] in text


def _one_line(exc_info, *parts):
    text = str(exc_info.value)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, text


def test_missing_files(tmp_path):
    with pytest.raises(InputError) as err:
        IndexedStore(tmp_path / "none")
    _one_line(err, "none.bin and none.idx are missing", "unmask preprocess")
    write_store(tmp_path / "s")
    (tmp_path / "s.bin").unlink()
    with pytest.raises(InputError) as err:
        IndexedStore(tmp_path / "s")
    _one_line(err, "s.bin is missing", "unmask preprocess")


def test_truncated_bin(tmp_path):
    write_store(tmp_path / "s")
    data = (tmp_path / "s.bin").read_bytes()
    (tmp_path / "s.bin").write_bytes(data[:-2])
    with pytest.raises(InputError) as err:
        IndexedStore(tmp_path / "s")
    _one_line(err, f"holds {len(data) - 2} bytes", f"describes {len(data)}", "truncated")


@pytest.mark.parametrize(
    "patch, message",
    [
        (lambda b: b"NOTANIDX\x00" + b[9:], "not a Megatron MMIDIDX index"),
        (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "version 2 is not supported"),
        (lambda b: b[:17] + bytes([9]) + b[18:], "unknown token dtype code 9"),
        (lambda b: b[:-8], "shorter than its counts claim"),
        (lambda b: b[:20], "truncated"),
    ],
)
def test_bad_index(tmp_path, patch, message):
    write_store(tmp_path / "s")
    idx = tmp_path / "s.idx"
    idx.write_bytes(patch(idx.read_bytes()))
    with pytest.raises(InputError) as err:
        IndexedStore(tmp_path / "s")
    _one_line(err, message, "s.idx")


def test_bad_sidecar_is_one_line(tmp_path):
    write_store(tmp_path / "s")
    (tmp_path / "s.json").write_text("{not json")
    with pytest.raises(InputError) as err:
        IndexedStore(tmp_path / "s")
    _one_line(err, "s.json", "not valid JSON")


def test_opening_reads_only_the_index(tmp_path):
    """A 64 GiB sparse .bin: opening and reading one document must not scan it."""
    lengths = np.full(32, 1 << 30, dtype=np.int32)  # 32 documents of 2^30 uint16 tokens
    with open(tmp_path / "huge.idx", "wb") as out:
        _write_index(out, lengths, np.dtype(np.uint16))
    with open(tmp_path / "huge.bin", "wb") as out:
        out.truncate(32 * (1 << 31))
    begin = time.perf_counter()
    store = IndexedStore(tmp_path / "huge")
    offsets = store.doc_offsets
    last = store.document(31)
    assert int(last[-1]) == 0 and int(store.tokens(5, 9).sum()) == 0
    assert time.perf_counter() - begin < 1.0
    assert store.num_tokens == 32 << 30 and offsets[-1] == store.num_tokens
    assert store.meta is None


def test_output_prefix_must_name_a_file_in_an_existing_folder(tmp_path):
    with pytest.raises(InputError, match="is a folder; give a file prefix"):
        IndexedWriter(tmp_path, np.uint16)
    with pytest.raises(InputError, match="does not exist; create it"):
        IndexedWriter(tmp_path / "missing" / "s", np.uint16)
    assert list(tmp_path.iterdir()) == []


def test_store_without_tokens(tmp_path):
    with IndexedWriter(tmp_path / "e", np.uint16) as writer:
        writer.add_documents(np.zeros(0, np.uint16), [0, 0])  # two empty documents
        writer.finish()
    store = IndexedStore(tmp_path / "e")
    assert store.num_tokens == 0 and store.doc_offsets.tolist() == [0, 0, 0]
    assert store.document(1).tolist() == [] and store.tokens(0, 0).size == 0
    with IndexedWriter(tmp_path / "z", np.uint16) as writer:
        writer.finish()  # no sequence at all
    store = IndexedStore(tmp_path / "z")
    assert len(store) == 0 and store.num_sequences == 0 and store.doc_offsets.tolist() == [0]
