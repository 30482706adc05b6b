"""`unmask preprocess`: every input format round-trips, output bytes do not depend on the
worker count, Megatron reads the result, bad input is one line and leaves no store."""

import gzip
import json

import datasets
import numpy as np
import pytest
import zstandard
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from unmask.cli import main
from unmask.data.indexed import IndexedStore, check_store_tokenizer
from unmask.data.tokenizer import build_char_tokenizer, load_local_tokenizer

LONG = "the quick brown fox jumps over the lazy dog. " * 5000  # 225k characters
JSONL_ROWS = [
    {"text": "Hello world", "id": 1},
    {"text": ""},  # empty: skipped and counted
    {"text": "naïve café – 東京 🚀"},  # unicode (unknown to the char tokenizer: <unk>)
    {"text": None},  # null: empty
    {"text": "  "},  # two spaces are two tokens
    {"text": LONG},
]


def jsonl(rows):
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


@pytest.fixture(scope="module")
def char_tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("char_tok")
    build_char_tokenizer().save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def big_tok(tmp_path_factory):
    """A word-level tokenizer with 70003 ids: the store must hold int32."""
    folder = tmp_path_factory.mktemp("big_tok")
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(70000)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(str(folder))
    return folder


@pytest.fixture
def inputs(tmp_path):
    """Six inputs of six kinds; returns (--input arguments, the documents they hold)."""
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.jsonl").write_bytes(jsonl(JSONL_ROWS[:3]) + b"\n" + jsonl(JSONL_ROWS[3:]))
    (src / "b.jsonl.gz").write_bytes(gzip.compress(jsonl([{"text": "gz one"}, {"text": "gz 2"}])))
    zst = zstandard.ZstdCompressor().compress(jsonl([{"text": "zst doc"}]))
    (src / "c.jsonl.zst").write_bytes(
        zst + zstandard.ZstdCompressor().compress(b'{"text": "z2"}\n')
    )
    datasets.Dataset.from_dict({"text": ["pq one", "", "pq three"], "n": [1, 2, 3]}).to_parquet(
        str(src / "d.parquet")
    )
    (src / "e.txt").write_text("line one\n\n   \nline two  \r\nlast, no newline")
    train = datasets.Dataset.from_dict({"text": ["hf first", "hf second"]})
    datasets.DatasetDict({"train": train, "test": train.select([0])}).save_to_disk(
        str(src / "f_saved")
    )
    docs = ["Hello world", "naïve café – 東京 🚀", "  ", LONG, "gz one", "gz 2", "zst doc", "z2"]
    docs += ["pq one", "pq three", "line one", "line two  ", "last, no newline"]
    docs += ["hf first", "hf second"]
    args = [str(src / "*.jsonl*"), str(src / "d.parquet"), str(src / "e.txt"), str(src / "f_saved")]
    return args, docs


def expected_ids(tok_folder, docs, eod=True):
    tok = load_local_tokenizer(str(tok_folder))
    ids = tok(docs, add_special_tokens=False)["input_ids"]
    return [d + [tok.eos_token_id] if eod else d for d in ids]


def run(argv, capsys):
    capsys.readouterr()  # drop what the test's own setup printed (datasets' progress bars)
    code = main(["preprocess", *map(str, argv)])
    return code, capsys.readouterr().err.strip().splitlines()


def test_round_trip_all_formats(tmp_path, inputs, char_tok, capsys):
    args, docs = inputs
    prefix = tmp_path / "out" / "store"
    prefix.parent.mkdir()
    argv = ["--input", *args, "--output-prefix", prefix, "--tokenizer", char_tok, "--append-eod"]
    code, err = run(argv, capsys)
    assert code == 0, err
    assert len(err) == 1 and "15 documents" in err[0] and "3 empty documents" in err[0]
    store = IndexedStore(prefix)
    want = expected_ids(char_tok, docs)
    assert store.dtype == np.uint16 and store.num_documents == len(docs)
    assert [store.document(i).tolist() for i in range(len(docs))] == want
    assert store.doc_offsets.tolist() == np.cumsum([0] + [len(w) for w in want]).tolist()
    assert len(store.document(3)) == len(LONG) + 1
    meta = store.meta
    assert meta["documents"] == 15 and meta["tokens"] == sum(map(len, want))
    assert meta["append_eod"] is True and meta["eod_id"] == 1 and meta["vocab_size"] == 101
    assert meta["empty_documents"] == 3 and meta["skipped_records"] == 0
    assert [p.rsplit("/", 1)[-1] for p in meta["inputs"]] == [
        "a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.parquet", "e.txt", "f_saved"
    ]  # fmt: skip
    assert meta["command"].startswith("unmask preprocess --input")
    assert check_store_tokenizer(store, load_local_tokenizer(str(char_tok))) is None

    mm = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    ds = mm.IndexedDataset(str(prefix))
    assert [ds[i].tolist() for i in range(len(ds))] == want


def test_worker_count_does_not_change_the_bytes(tmp_path, inputs, char_tok, capsys, monkeypatch):
    monkeypatch.setattr("unmask.data.corpus.CHUNK_DOCS", 2)  # many chunks for the pool to share
    args, _ = inputs
    out = {}
    for workers in (1, 2):
        prefix = tmp_path / f"w{workers}"
        argv = ["--input", *args, "--output-prefix", prefix, "--tokenizer", char_tok]
        code, err = run([*argv, "--workers", workers], capsys)
        assert code == 0, err
        meta = json.loads((tmp_path / f"w{workers}.json").read_text())
        assert meta.pop("command").endswith(f"--workers {workers}")
        out[workers] = [(tmp_path / f"w{workers}.{s}").read_bytes() for s in ("bin", "idx")]
        out[workers].append(meta)
    assert out[1] == out[2]
    assert out[1][2]["append_eod"] is False


def test_large_vocabulary_is_int32(tmp_path, big_tok, capsys):
    (tmp_path / "w.txt").write_text("w0 w69999 w65535\nw12 nope\n")
    prefix = tmp_path / "big"
    code, err = run(["--input", tmp_path / "w.txt", "--output-prefix", prefix,
                     "--tokenizer", big_tok, "--append-eod"], capsys)  # fmt: skip
    assert code == 0, err
    store = IndexedStore(prefix)
    assert store.dtype == np.int32 and store.meta["dtype"] == "int32"
    assert [store.document(i).tolist() for i in range(2)] == [[3, 70002, 65538, 1], [15, 2, 1]]


# -- bad input: exit 2, one line, no store ----------------------------------------------


@pytest.fixture
def bad_setup(tmp_path, monkeypatch):
    monkeypatch.setattr("unmask.data.corpus.CHUNK_DOCS", 2)  # chunks get written before the bad one
    (tmp_path / "out").mkdir()
    good = tmp_path / "good.jsonl"
    good.write_bytes(jsonl([{"text": f"doc {i}"} for i in range(7)]))
    return tmp_path, good


def assert_refused(code, err, *parts, out=None):
    assert code == 2 and len(err) == 1, err
    for part in parts:
        assert part in err[0], err[0]
    if out is not None:
        assert list(out.iterdir()) == [], list(out.iterdir())


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_json_line(bad_setup, char_tok, capsys, workers):
    tmp, good = bad_setup
    bad = tmp / "bad.jsonl"
    bad.write_bytes(jsonl([{"text": "a"}] * 4) + b'{"text": "oops\n' + jsonl([{"text": "b"}]))
    code, err = run(["--input", good, bad, "--output-prefix", tmp / "out" / "s",
                     "--tokenizer", char_tok, "--workers", workers], capsys)  # fmt: skip
    assert_refused(code, err, f"{bad}:5", "not valid JSON", "--on-bad-record skip", out=tmp / "out")


def test_missing_key_names_file_line_and_keys(bad_setup, char_tok, capsys):
    tmp, good = bad_setup
    bad = tmp / "bad.jsonl"
    bad.write_bytes(jsonl([{"text": "a"}, {"body": "x", "id": 3}]))
    code, err = run(["--input", good, bad, "--output-prefix", tmp / "out" / "s",
                     "--tokenizer", char_tok], capsys)  # fmt: skip
    assert_refused(code, err, f"{bad}:2", "no 'text' key", "body, id", out=tmp / "out")


def test_skip_bad_records(bad_setup, char_tok, capsys):
    tmp, good = bad_setup
    bad = tmp / "bad.txt"
    bad.write_bytes(b"fine\n\xff\xfe broken\nalso fine\n")
    other = tmp / "bad.jsonl"
    other.write_bytes(b'{"text": "x"}\n[1, 2]\n{"text": 5}\nnot json\n{"body": "y"}\n')
    prefix = tmp / "out" / "s"
    code, err = run(["--input", good, bad, other, "--output-prefix", prefix,
                     "--tokenizer", char_tok, "--on-bad-record", "skip"], capsys)  # fmt: skip
    assert code == 0 and len(err) == 1 and "5 bad records skipped" in err[0], err
    store = IndexedStore(prefix)
    docs = [f"doc {i}" for i in range(7)] + ["fine", "also fine", "x"]
    assert [store.document(i).tolist() for i in range(len(docs))] == expected_ids(
        char_tok, docs, eod=False
    )
    assert store.meta["skipped_records"] == 5


def test_not_utf8_line_without_skip(bad_setup, char_tok, capsys):
    tmp, _ = bad_setup
    bad = tmp / "bad.txt"
    bad.write_bytes(b"fine\n\xff broken\n")
    code, err = run(["--input", bad, "--output-prefix", tmp / "out" / "s",
                     "--tokenizer", char_tok], capsys)  # fmt: skip
    assert_refused(code, err, f"{bad}:2", "not UTF-8", out=tmp / "out")


def test_glob_matching_nothing(bad_setup, char_tok, capsys):
    tmp, _ = bad_setup
    pattern = str(tmp / "nothing" / "*.jsonl")
    code, err = run(["--input", pattern, "--output-prefix", tmp / "out" / "s",
                     "--tokenizer", char_tok], capsys)  # fmt: skip
    assert_refused(code, err, repr(pattern), "matches no file", out=tmp / "out")


def test_unknown_file_type(bad_setup, char_tok, capsys):
    tmp, good = bad_setup
    (tmp / "table.csv").write_text("text\nx\n")
    code, err = run(["--input", good, tmp / "table.csv", "--output-prefix", tmp / "out" / "s",
                     "--tokenizer", char_tok], capsys)  # fmt: skip
    assert_refused(code, err, "table.csv", "unknown file type", ".jsonl.zst", out=tmp / "out")


def test_missing_input_and_missing_column(bad_setup, char_tok, capsys):
    tmp, good = bad_setup
    code, err = run(["--input", tmp / "nope.jsonl", "--output-prefix", tmp / "out" / "s",
                     "--tokenizer", char_tok], capsys)  # fmt: skip
    assert_refused(code, err, "nope.jsonl", "does not exist", out=tmp / "out")
    datasets.Dataset.from_dict({"body": ["x"]}).to_parquet(str(tmp / "p.parquet"))
    code, err = run(["--input", good, tmp / "p.parquet", "--output-prefix", tmp / "out" / "s",
                     "--tokenizer", char_tok], capsys)  # fmt: skip
    assert_refused(code, err, "p.parquet", "no 'text' column", "body", out=tmp / "out")


def test_output_folder_missing(bad_setup, char_tok, capsys):
    tmp, good = bad_setup
    code, err = run(["--input", good, "--output-prefix", tmp / "no_dir" / "s",
                     "--tokenizer", char_tok], capsys)  # fmt: skip
    assert_refused(code, err, "no_dir", "does not exist")
    assert not (tmp / "no_dir").exists()


def test_existing_store_is_kept_without_overwrite(bad_setup, char_tok, capsys):
    tmp, good = bad_setup
    prefix = tmp / "out" / "s"
    argv = ["--input", good, "--output-prefix", prefix, "--tokenizer", char_tok]
    assert run(argv, capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in (tmp / "out").iterdir()}
    other = tmp / "other.txt"
    other.write_text("something else\n")
    argv[1] = other
    code, err = run(argv, capsys)
    assert_refused(code, err, "s.bin and s.idx already exist", "--overwrite")
    assert {p.name: p.read_bytes() for p in (tmp / "out").iterdir()} == before
    assert run([*argv, "--overwrite"], capsys)[0] == 0
    assert IndexedStore(prefix).num_documents == 1


def test_tokenizer_folder_missing(bad_setup, capsys):
    tmp, good = bad_setup
    code, err = run(["--input", good, "--output-prefix", tmp / "out" / "s",
                     "--tokenizer", tmp / "no_tok"], capsys)  # fmt: skip
    assert_refused(code, err, "--tokenizer", "no_tok", "does not exist", out=tmp / "out")


def test_only_empty_documents(bad_setup, char_tok, capsys):
    tmp, _ = bad_setup
    empty = tmp / "empty.jsonl"
    empty.write_bytes(jsonl([{"text": ""}, {"text": None}]))
    code, err = run(["--input", empty, "--output-prefix", tmp / "out" / "s",
                     "--tokenizer", char_tok], capsys)  # fmt: skip
    assert_refused(code, err, "no non-empty document", "2 empty", out=tmp / "out")


def test_char_store_trains_and_a_runs_final_folder_is_a_tokenizer(tmp_path, capsys):
    """`--tokenizer char` (data.tokenizer's default) makes a store that a run with
    `data.tokenizer: char` trains from; that run's final/ is a tokenizer folder too, and
    tokenizes to the same bytes (same fingerprint)."""
    import yaml
    from conftest import TINY, deep_update, read_metrics

    docs = [f"rev {i}{i + 7}={i + 7}{i}" for i in range(40)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    code, err = run(["--input", corpus, "--output-prefix", tmp_path / "char", "--tokenizer",
                     "char", "--append-eod"], capsys)  # fmt: skip
    assert code == 0, err
    char = build_char_tokenizer()
    store = IndexedStore(tmp_path / "char")
    want = [ids + [char.eos_token_id] for ids in char(docs, add_special_tokens=False)["input_ids"]]
    assert [store.document(i).tolist() for i in range(len(docs))] == want
    assert store.meta["tokenizer"] == "char" and store.meta["vocab_size"] == 101

    tree = deep_update(TINY, {
        "data": {"dataset": str(tmp_path / "char"), "tokenizer": "char", "packing": True,
                 "eval_split": 4},
        "train": {"max_steps": 2, "eval_steps": 0, "save_steps": 0,
                  "output_dir": str(tmp_path / "run")},
    })  # fmt: skip
    for key in ("synthetic_train_size", "synthetic_eval_size"):
        tree["data"].pop(key)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tree))
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2]

    final = tmp_path / "run" / "final"
    code, err = run(["--input", corpus, "--output-prefix", tmp_path / "final", "--tokenizer",
                     final, "--append-eod"], capsys)  # fmt: skip
    assert code == 0, err
    assert (tmp_path / "final.bin").read_bytes() == (tmp_path / "char.bin").read_bytes()
    again = IndexedStore(tmp_path / "final")
    assert again.meta["tokenizer_fingerprint"] == store.meta["tokenizer_fingerprint"]
    assert check_store_tokenizer(store, load_local_tokenizer(str(final))) is None
