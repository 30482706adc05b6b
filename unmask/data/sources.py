"""Read local data into records: {"text": str} documents or {"prompt": str, "response": str} pairs.

Formats (formats.py holds the table): .txt (one document per non-empty line), .jsonl/.json,
.parquet, each text or JSON file also compressed (.gz, .zst), any format registered with
`register_format`, a folder written by `datasets` `save_to_disk` (the "train" split of a
DatasetDict), or a folder of such files. Everything here is local (hub datasets are streamed,
see streaming.py); `datasets`' cache goes to a temporary folder, never beside the user's data.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from unmask.data.formats import (
    DECOMPRESSION_ERRORS,
    DataFormat,
    accepted_files,
    compressed_files,
    format_of,
    get_format,
    is_saved_dataset,
    open_binary,
    split_compression,
)
from unmask.data.sft import check_messages
from unmask.errors import InputError

Record = dict[str, str]


def accepted() -> str:
    """What `data.dataset` accepts as a local file or folder (for messages), from the
    format table: registered formats included."""
    return (
        f"{accepted_files()}, a save_to_disk folder, or a folder of such files "
        f"({compressed_files()})"
    )


def load_records(
    path: str | Path,
    dataset_format: str = "auto",
    text_field: str = "text",
    prompt_field: str = "prompt",
    response_field: str = "response",
) -> list[Record]:
    """All records of a local dataset, in file order.

    Rows holding both `prompt_field` and `response_field` become prompt/answer pairs; other
    rows must hold `text_field`. Empty documents are skipped; zero documents is an error.
    """
    source = Path(path).expanduser()
    if not source.exists():
        raise InputError(f"data: dataset path {str(path)!r} does not exist; accepted: {accepted()}")
    rows = list(_read_rows(source, dataset_format))
    return records_of(rows, str(path), text_field, prompt_field, response_field)


def records_of(
    rows: list[dict[str, Any]],
    where: str,
    text_field: str = "text",
    prompt_field: str = "prompt",
    response_field: str = "response",
) -> list[Record]:
    """The records of raw rows (`read_rows`) as `load_records` makes them; zero documents is
    an error."""
    records = _to_records(rows, where, text_field, prompt_field, response_field)
    if not records:
        raise InputError(
            f"data: dataset {where!r} holds 0 documents; give a file with at least one "
            "non-empty document"
        )
    return records


def read_rows(path: str | Path, dataset_format: str = "auto") -> list[dict[str, Any]]:
    """The raw rows (dicts) of a local jsonl / json / parquet file or save_to_disk folder, in
    file order, for layouts other than documents and prompt/response pairs (preference
    pairs: unmask/posttrain/pairs.py)."""
    source = Path(path).expanduser()
    if not source.exists():
        raise InputError(f"data: dataset path {str(path)!r} does not exist; accepted: {accepted()}")
    return list(_read_rows(source, dataset_format))


def detect_format(path: Path) -> str:
    """The format's name ("text", "jsonl", "parquet" or a registered one), "hf_dataset" or
    "folder" (a folder of data files)."""
    if path.is_dir():
        return "hf_dataset" if is_saved_dataset(path) else "folder"
    fmt = format_of(path)
    if fmt is None:
        raise InputError(
            f"data: cannot tell the format of {str(path)!r} (extension {path.suffix!r}); "
            f"accepted: {accepted()}, or set data.dataset_format"
        )
    return fmt.name


def _read_rows(path: Path, dataset_format: str) -> Iterable[dict[str, Any]]:
    fmt = detect_format(path) if dataset_format == "auto" else dataset_format
    if path.is_dir() and fmt not in ("hf_dataset", "folder"):
        return _read_folder(path, only=fmt)
    if fmt == "folder":
        return _read_folder(path, only=None)
    if fmt == "hf_dataset":
        return _read_saved_dataset(path)
    data_format = get_format(fmt)
    if data_format is None:
        raise InputError(
            f"data.dataset_format: unknown format {dataset_format!r}; accepted: {accepted()}"
        )
    if data_format.read is not None:
        return _read_with_reader(path, data_format)
    return _read_with_builder(path, data_format.builder)


def _read_folder(folder: Path, only: str | None) -> list[dict[str, Any]]:
    """Every data file under `folder` (sorted by path), optionally of one format only."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and format_of(p) is not None)
    if only is not None:
        files = [p for p in files if format_of(p).name == only]
    if not files:
        raise InputError(
            f"data: folder {str(folder)!r} holds no data files; accepted: {accepted()}"
        )
    rows: list[dict[str, Any]] = []
    for file in files:
        rows.extend(_read_rows(file, format_of(file).name))
    return rows


def _read_with_reader(path: Path, fmt: DataFormat) -> list[dict[str, Any]]:
    """The rows of one file through its format's reader, decompressed on the way."""
    try:
        with open_binary(path) as stream:
            return list(fmt.read(stream))
    except UnicodeDecodeError as exc:
        raise InputError(
            f"data: {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start}); give a "
            "text file, or the prefix of a token store (PREFIX.bin + PREFIX.idx)"
        ) from None
    except InputError:
        raise
    except Exception as exc:  # a damaged compressed file, or whatever a reader raises
        raise InputError(
            f"data: cannot read {str(path)!r} as {fmt.name}: {_first_line(exc)}"
        ) from exc


def _read_with_builder(path: Path, builder: str) -> list[dict[str, Any]]:
    """jsonl/json/parquet through `datasets`, cached in a temporary folder, kept in memory.
    A compressed file is decompressed into that folder first (by formats.py: a file cut
    short is an error, never a silently shorter dataset)."""
    import datasets  # at call time: importing datasets costs a second of start-up

    with tempfile.TemporaryDirectory(prefix="unmask-datasets-") as cache, _quiet_datasets():
        try:
            plain = _decompressed(path, Path(cache))
        except DECOMPRESSION_ERRORS as exc:
            raise InputError(
                f"data: cannot read {str(path)!r} as {builder}: {_first_line(exc)}"
            ) from None
        if plain.stat().st_size == 0:
            return []
        try:
            ds = datasets.load_dataset(
                builder,
                data_files=str(plain),
                split="train",
                cache_dir=cache,
                keep_in_memory=True,
            )
        except Exception as exc:  # datasets raises many types for a malformed file
            form = "one JSON object per line" if builder == "json" else "a parquet file"
            jsonl = split_compression(path)[0] == ".jsonl"
            problem = _bad_json_line(plain) if jsonl else None
            raise InputError(
                f"data: cannot read {str(path)!r} as {builder}: "
                f"{problem or _first_line(_root(exc))}; give {form}, or set data.dataset_format"
            ) from exc
        return ds.to_list()


def _decompressed(path: Path, folder: Path) -> Path:
    """`path` itself, or for a compressed file its decompressed copy in `folder`."""
    suffix, compression = split_compression(path)
    if not compression:
        return path
    plain = folder / f"decompressed{suffix}"
    with open_binary(path) as source, open(plain, "wb") as target:
        shutil.copyfileobj(source, target, 1 << 20)
    return plain


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bar and no log lines from `datasets` while it reads a local file: a file
    it cannot parse becomes our one-line error, not its log record and traceback."""
    from datasets.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity(logging.CRITICAL)
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def _read_saved_dataset(path: Path) -> list[dict[str, Any]]:
    import datasets  # at call time: importing datasets costs a second of start-up

    try:
        ds = datasets.load_from_disk(str(path), keep_in_memory=True)
    except Exception as exc:
        raise InputError(
            f"data: cannot load dataset folder {str(path)!r}: {_first_line(exc)}"
        ) from exc
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise InputError(
                f"data: dataset folder {str(path)!r} has no 'train' split "
                f"(splits: {', '.join(ds)}); save the training split as 'train'"
            )
        ds = ds["train"]
    return ds.to_list()


def _to_records(
    rows: list[dict[str, Any]], where: str, text_field: str, prompt_field: str, response_field: str
) -> list[Record]:
    records = [to_record(row, where, text_field, prompt_field, response_field) for row in rows]
    return [r for r in records if r is not None]


def to_record(
    row: dict[str, Any],
    where: str,
    text_field: str = "text",
    prompt_field: str = "prompt",
    response_field: str = "response",
) -> Record | None:
    """One data row as a record: a chat (`messages`), a prompt/response pair, or a
    document (`text_field`); None for an empty document."""
    if row.get("messages") is not None:  # a chat: prompt/answer split in data/sft.py
        return {"messages": check_messages(row["messages"], where)}
    prompt, response = row.get(prompt_field), row.get(response_field)
    if prompt is not None and response is not None:
        return {"prompt": str(prompt), "response": str(response)}
    if text_field not in row:
        raise InputError(
            f"data: rows of {where!r} have no {text_field!r} field (fields: "
            f"{', '.join(map(str, row))}); set data.text_field, or data.prompt_field and "
            "data.response_field"
        )
    text = row[text_field]
    return {"text": str(text)} if text is not None and str(text) != "" else None


def _bad_json_line(path: Path) -> str | None:
    """'line N ...' for the first line of a jsonl file that is not a JSON object (read only
    after `datasets` failed on the file, to say where)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                return f"line {number} is not UTF-8 text ({exc.reason})"
            except json.JSONDecodeError as exc:
                return f"line {number} is not valid JSON ({exc.msg} at column {exc.colno})"
            if not isinstance(row, dict):
                return f"line {number} is not a JSON object"
    return None


def _root(exc: BaseException) -> BaseException:
    """The innermost exception of a chain (datasets wraps the parser's own, which says
    which row or byte is wrong)."""
    while (inner := exc.__cause__ or exc.__context__) is not None:
        exc = inner
    return exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
