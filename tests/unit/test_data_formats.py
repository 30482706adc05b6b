"""One format table (unmask/data/formats.py) for every reader: a compressed .jsonl / .txt /
.json file gives exactly the token rows of the plain file in memory, as a stream (resumed
too) and in a blend, and trains; a toy format registered here, outside the package, is read
by training, `unmask preprocess` and streams alike; what the table does not own is refused
with the messages it always had."""

import gzip
import json
import re
import shutil

import pytest
import torch
import zstandard
from conftest import losses

from unmask.cli import main
from unmask.data import DataConfig, IndexedStore, build_char_tokenizer, build_datasets, make_loader
from unmask.data.formats import register_format, unregister_format
from unmask.data.sources import load_records
from unmask.errors import InputError

pytestmark = pytest.mark.usefixtures("one_thread")
DOCS = [f"doc {i} " + "abcdefg"[: i % 7] + " " + "xyz" * (i % 3) for i in range(40)]
COMPRESS = {".gz": gzip.compress, ".zst": lambda data: zstandard.ZstdCompressor().compress(data)}


def _jsonl(docs) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def _txt(docs) -> bytes:
    return "".join(d + "\n" for d in docs).encode()


def _write(path, data: bytes):
    """`path`, holding `data` compressed by the path's last suffix (.gz, .zst) if any."""
    path.write_bytes(COMPRESS.get(path.suffix, lambda d: d)(data))
    return path


def _rows(dataset: str, **extra) -> dict[str, torch.Tensor]:
    cfg = DataConfig(dataset=dataset, packing_length=16, eval_split=4, **extra)
    data = build_datasets(cfg, build_char_tokenizer())
    return {"train": data.train.tensors, "eval": data.eval.tensors}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[part][key], b[part][key]) for part in a for key in a[part]
    )


@pytest.mark.parametrize("name", ["d.jsonl.gz", "d.jsonl.zst", "d.txt.gz", "d.txt.zst",
                                  "d.json.gz", "d.json.zst"])  # fmt: skip
def test_a_compressed_file_gives_the_plain_file_s_token_rows(tmp_path, name):
    plain_name = name.rsplit(".", 1)[0]
    form = _txt if ".txt" in name else _jsonl
    plain = _write(tmp_path / plain_name, form(DOCS))
    packed = _write(tmp_path / name, form(DOCS))
    assert load_records(packed) == load_records(plain) == [{"text": d} for d in DOCS]
    reference = _rows(str(plain))
    assert reference["train"]["input_ids"].shape[0] > 10
    assert _same(_rows(str(packed)), reference)
    assert _same(_rows(str(packed), packing=False), _rows(str(plain), packing=False))


def _stream_cfg(folder, **extra) -> DataConfig:
    return DataConfig(dataset=str(folder), streaming=True, packing_length=16, eval_split=3,
                      **extra)  # fmt: skip


def _streamed(cfg, batches: int, workers: int = 0) -> torch.Tensor:
    data = build_datasets(cfg, build_char_tokenizer())
    loader = make_loader(data.train, 4, 0, num_workers=workers)
    return torch.cat([next(loader)["input_ids"] for _ in range(batches)])


def _shards(folder, names, form):
    folder.mkdir()
    for s, name in enumerate(names):
        _write(folder / name, form(DOCS[s * 10 : (s + 1) * 10]))
    return folder


def test_compressed_shards_stream_the_plain_shards_rows_and_resume_exactly(tmp_path):
    plain = _shards(tmp_path / "plain", [f"p{s}.jsonl" for s in range(4)], _jsonl)
    packed = _shards(tmp_path / "packed", ["p0.jsonl.gz", "p1.jsonl.zst", "p2.jsonl.gz",
                                           "p3.jsonl"], _jsonl)  # fmt: skip
    reference = _streamed(_stream_cfg(plain), 12)
    assert torch.equal(_streamed(_stream_cfg(packed), 12), reference)
    text = _shards(tmp_path / "text", ["p0.txt.zst", "p1.txt.gz", "p2.txt", "p3.txt.zst"], _txt)
    assert torch.equal(_streamed(_stream_cfg(text), 12), reference)

    assert torch.equal(_resumed_after_5(_stream_cfg(packed), 12), reference[5 * 4 :])


def _resumed_after_5(cfg, batches: int) -> torch.Tensor:
    """Batches 5 .. batches-1 of a stream resumed from the state after batch 4."""
    data = build_datasets(cfg, build_char_tokenizer())
    first = make_loader(data.train, 4, 0)
    for _ in range(5):
        next(first)
    resumed = make_loader(data.train, 4, 0)
    resumed.load_state_dict(first.state_dict())
    return torch.cat([next(resumed)["input_ids"] for _ in range(batches - 5)])


def test_a_blend_of_compressed_sources_draws_the_plain_blend_s_rows(tmp_path):
    def blend(a, b) -> torch.Tensor:
        cfg = DataConfig(sources=[{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}],
                         packing_length=16, eval_split=2)  # fmt: skip
        data = build_datasets(cfg, build_char_tokenizer())
        loader = make_loader(data.train, 4, 0)
        return torch.cat([next(loader)["input_ids"] for _ in range(8)])

    plain = blend(_write(tmp_path / "a.jsonl", _jsonl(DOCS[:20])),
                  _write(tmp_path / "b.txt", _txt(DOCS[20:])))  # fmt: skip
    packed = blend(_write(tmp_path / "a.jsonl.zst", _jsonl(DOCS[:20])),
                   _write(tmp_path / "b.txt.gz", _txt(DOCS[20:])))  # fmt: skip
    assert torch.equal(packed, plain)


def _train(tiny_config, tmp_path, name: str, data: dict) -> dict[int, float]:
    out = tmp_path / name
    extra = {"data": {**data, "packing": True, "packing_length": 16, "eval_split": 4},
             "train": {"max_steps": 2, "eval_steps": 0, "save_steps": 0, "output_dir": str(out)}}  # fmt: skip
    assert main(["train", str(tiny_config(extra, name=f"{name}.yaml"))]) == 0
    return losses(out)


def test_a_compressed_jsonl_file_trains_like_the_plain_file(tiny_config, tmp_path):
    plain = _write(tmp_path / "d.jsonl", _jsonl(DOCS))
    packed = _write(tmp_path / "d.jsonl.zst", _jsonl(DOCS))
    reference = _train(tiny_config, tmp_path, "plain", {"dataset": str(plain)})
    assert sorted(reference) == [1, 2]
    assert _train(tiny_config, tmp_path, "packed", {"dataset": str(packed)}) == reference


# -- a data format registered from outside the package --------------------------------------


def read_reversed_lines(stream):
    """The toy format: one document per line, each line stored reversed."""
    for line in stream.read().decode("utf-8").splitlines():
        if line:
            yield {"text": line[::-1]}


@pytest.fixture
def rev_format():
    fmt = register_format("reversed", [".rev"], read_reversed_lines, note="lines reversed")
    yield fmt
    unregister_format("reversed")


def _rev(docs) -> bytes:
    return "".join(d[::-1] + "\n" for d in docs).encode()


def test_a_toy_format_registered_from_outside_is_read_by_training_preprocess_and_streaming(
    rev_format, tiny_config, tmp_path, capsys
):
    toy = _write(tmp_path / "d.rev", _rev(DOCS))
    plain = _write(tmp_path / "d.txt", _txt(DOCS))
    # training: in memory (rows, and a couple of steps), compressed too, and in a blend
    assert _same(_rows(str(toy)), _rows(str(plain)))
    assert _same(_rows(str(_write(tmp_path / "z.rev.zst", _rev(DOCS)))), _rows(str(plain)))
    reference = _train(tiny_config, tmp_path, "plain", {"dataset": str(plain)})
    assert _train(tiny_config, tmp_path, "toy", {"dataset": str(toy)}) == reference
    mixed = {"sources": [{"path": str(toy), "weight": 1}, {"path": str(plain), "weight": 1}]}
    twice = {"sources": [{"path": str(plain), "weight": 1}, {"path": str(plain), "weight": 1}]}
    assert _train(tiny_config, tmp_path, "mixed", mixed) == _train(
        tiny_config, tmp_path, "twice", twice
    )

    # unmask preprocess: the store holds the plain file's documents
    def store(path, prefix, workers=1):
        args = ["preprocess", "--input", str(path), "--output-prefix", str(tmp_path / prefix),
                "--tokenizer", "char", "--append-eod", "--workers", str(workers)]  # fmt: skip
        assert main(args) == 0
        s = IndexedStore(tmp_path / prefix)
        return [s.document(i).tolist() for i in range(s.num_documents)]

    capsys.readouterr()
    toy_docs = store(tmp_path / "z.rev.zst", "toy_store")
    assert len(toy_docs) == len(DOCS) and toy_docs == store(plain, "plain_store")
    assert store(toy, "toy_store_2", workers=2) == toy_docs

    # streaming: shards of the toy format (one compressed) stream the text shards' rows
    text = _shards(tmp_path / "text_shards", [f"p{s}.txt" for s in range(4)], _txt)
    shards = _shards(tmp_path / "toy_shards", ["p0.rev", "p1.rev.gz", "p2.rev", "p3.rev"], _rev)
    streamed = _streamed(_stream_cfg(shards), 12)
    assert torch.equal(streamed, _streamed(_stream_cfg(text), 12))
    assert torch.equal(_streamed(_stream_cfg(shards), 12, workers=2),
                       _streamed(_stream_cfg(text), 12, workers=2))  # fmt: skip
    assert torch.equal(_resumed_after_5(_stream_cfg(shards), 12), streamed[5 * 4 :])

    # the accepted-formats messages list it while it is registered
    with pytest.raises(InputError, match=r"\.parquet, \.rev \(lines reversed\).*\.rev\.zst"):
        load_records(_write(tmp_path / "d.csv", b"a\n"))


def test_a_registered_toy_format_is_gone_once_unregistered(tmp_path):
    register_format("reversed", [".rev"], read_reversed_lines)
    unregister_format("reversed")
    with pytest.raises(InputError, match=r"cannot tell the format of .*d\.rev"):
        load_records(_write(tmp_path / "d.rev", _rev(DOCS)))


@pytest.mark.parametrize(
    ("name", "suffixes", "message"),
    [
        ("mine", [".jsonl"], "suffix '.jsonl' is taken by 'jsonl'"),
        ("mine", [".gz"], "suffix '.gz' is taken by 'compression'"),
        ("mine", ["rev"], "give suffixes such as '.ext'"),
        ("jsonl", [".mine"], "data format 'jsonl' is already taken"),
        ("auto", [".mine"], "data format 'auto' is already taken"),
    ],
)
def test_a_taken_name_or_suffix_is_refused(name, suffixes, message):
    with pytest.raises(ValueError, match=message):
        register_format(name, suffixes, read_reversed_lines)


# -- what the table does not own ---------------------------------------------------------------


def test_compressed_parquet_and_preprocessed_json_are_refused_as_before(tmp_path, capsys):
    with pytest.raises(InputError, match=r"cannot tell the format of .*d\.parquet\.gz"):
        load_records(_write(tmp_path / "d.parquet.gz", b"PAR1"))
    json_file = _write(tmp_path / "d.json", json.dumps([{"text": "a"}]).encode())
    assert load_records(json_file) == [{"text": "a"}]  # a JSON array, read whole
    code = main(["preprocess", "--input", str(json_file), "--output-prefix",
                 str(tmp_path / "s"), "--tokenizer", "char"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "unknown file type" in err[-1]
    assert ".jsonl, .parquet" in err[-1] and ".jsonl.zst" in err[-1]
    assert not (tmp_path / "s.bin").exists()


@pytest.mark.parametrize("name", ["d.txt.gz", "d.txt.zst", "d.jsonl.gz", "d.jsonl.zst"])
def test_a_compressed_file_cut_short_is_one_line_naming_it_never_fewer_rows(tmp_path, name, capsys):
    whole = COMPRESS[name[name.rindex(".") :]]((_txt if ".txt" in name else _jsonl)(DOCS * 100))
    (tmp_path / name).write_bytes(whole[: len(whole) // 2])
    with pytest.raises(InputError, match=rf"cannot read '.*{re.escape(name)}' as ") as err:
        load_records(tmp_path / name)
    assert "\n" not in str(err.value)
    code = main(["preprocess", "--input", str(tmp_path / name), "--output-prefix",
                 str(tmp_path / "s"), "--tokenizer", "char"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"{name}: cannot read (" in err[0], err
    assert not (tmp_path / "s.bin").exists()


def test_folder_of_plain_and_compressed_files_reads_each_once_in_path_order(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    _write(folder / "a.txt.gz", _txt(DOCS[:2]))
    _write(folder / "b.jsonl.zst", _jsonl(DOCS[2:4]))
    _write(folder / "c.json", _jsonl(DOCS[4:6]))
    shutil.copy(folder / "a.txt.gz", folder / "notes.md.gz")  # not a data file: ignored
    assert load_records(folder) == [{"text": d} for d in DOCS[:6]]
    assert load_records(folder, dataset_format="text") == [{"text": d} for d in DOCS[:2]]
