"""Every source format gives the same records; bad input gives one clear line."""

import json

import datasets
import pytest

from unmask.data import load_records
from unmask.data.sources import detect_format
from unmask.errors import InputError

DOCS = ["first document", "second one, with  spaces", "third: 3917"]
EXPECTED = [{"text": d} for d in DOCS]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_text_file(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text(DOCS[0] + "\n\n" + DOCS[1] + "\n" + DOCS[2])  # blank line skipped, no final \n
    assert load_records(path) == EXPECTED


def test_jsonl_with_custom_field_and_no_cache_beside_data(tmp_path):
    path = _write_jsonl(tmp_path / "docs.jsonl", [{"body": d, "id": i} for i, d in enumerate(DOCS)])
    assert load_records(path, text_field="body") == EXPECTED
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]


def test_parquet(tmp_path):
    path = tmp_path / "docs.parquet"
    datasets.Dataset.from_dict({"text": DOCS}).to_parquet(str(path))
    assert load_records(path) == EXPECTED
    assert load_records(path, dataset_format="parquet") == EXPECTED


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    ds = datasets.Dataset.from_dict({"text": DOCS})
    ds.save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert detect_format(tmp_path / "dd") == "hf_dataset"
    assert load_records(tmp_path / "single") == EXPECTED
    assert load_records(tmp_path / "dd") == EXPECTED


def test_folder_of_files_in_path_order(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.txt").write_text(DOCS[0] + "\n")
    _write_jsonl(folder / "b.jsonl", [{"text": DOCS[1]}])
    datasets.Dataset.from_dict({"text": [DOCS[2]]}).to_parquet(str(folder / "c.parquet"))
    (folder / "README.md").write_text("ignored")
    assert load_records(folder) == EXPECTED


def test_prompt_response_pairs(tmp_path):
    rows = [{"q": "rev 12=", "a": "21"}, {"q": "add 1+2=", "a": "3"}]
    path = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    records = load_records(path, prompt_field="q", response_field="a")
    assert records == [
        {"prompt": "rev 12=", "response": "21"},
        {"prompt": "add 1+2=", "response": "3"},
    ]


def test_missing_path(tmp_path):
    with pytest.raises(InputError, match=r"data: dataset path .*missing.jsonl.* does not exist"):
        load_records(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("name", ["empty.txt", "empty.jsonl", "blank.txt"])
def test_empty_dataset(tmp_path, name):
    path = tmp_path / name
    path.write_text("\n  \n" if name == "blank.txt" else "")
    with pytest.raises(InputError, match="holds 0 documents"):
        load_records(path)


def test_wrong_field_names_the_fields_present(tmp_path):
    path = _write_jsonl(tmp_path / "docs.jsonl", [{"body": "x", "id": 1}])
    with pytest.raises(InputError) as err:
        load_records(path)
    msg = str(err.value)
    assert "no 'text' field (fields: body, id)" in msg
    assert "data.text_field" in msg and "\n" not in msg


def test_unknown_extension_lists_accepted_formats(tmp_path):
    path = tmp_path / "docs.csv"
    path.write_text("text\nx\n")
    with pytest.raises(InputError, match=r"extension '\.csv'.*\.jsonl/\.json, \.parquet"):
        load_records(path)


def test_dataset_dict_without_train_split(tmp_path):
    ds = datasets.Dataset.from_dict({"text": DOCS})
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match=r"no 'train' split \(splits: validation\)"):
        load_records(tmp_path / "dd")


def test_malformed_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(InputError, match="cannot read .*bad.jsonl.* as json"):
        load_records(path)
