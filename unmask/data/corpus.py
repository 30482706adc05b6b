"""Streaming reads of raw corpora for `unmask preprocess`: inputs to chunks, chunks to texts.

The reading process only splits files into `Chunk`s (raw lines, or column values) of at most
`CHUNK_DOCS` records and about `CHUNK_BYTES` bytes; `chunk_texts`, run in the tokenizing
workers, parses them. Chunk borders depend on the input only, never on the worker count,
and no file is ever held in memory whole.

Formats (formats.py holds the table): .jsonl (also .jsonl.gz, .jsonl.zst), .txt (one document
per non-empty line; also .gz, .zst), .parquet, a folder written by `datasets` `save_to_disk`
(its "train" split), and any format registered with `register_format` (its rows, read in the
reading process). `.json` is refused: it may be one JSON document, which cannot be cut into
chunks of lines.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unmask.data.formats import (
    DECOMPRESSION_ERRORS,
    accepted_files,
    compressed_files,
    format_of,
    get_format,
    is_saved_dataset,
    open_binary,
    split_compression,
)
from unmask.errors import InputError

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

CHUNK_DOCS = 1024
CHUNK_BYTES = 1 << 20
_LINE_KINDS = ("jsonl", "text")  # read as raw lines, parsed in the workers


def accepted() -> str:
    """What `--input` accepts (for messages), from the format table."""
    return (
        f"{accepted_files(line_by_line=True)}, or a folder written by datasets' save_to_disk "
        f"({compressed_files()})"
    )


@dataclass
class Chunk:
    """Consecutive records of one file: raw lines (kind "jsonl" / "text", `first` = 1-based
    line number of items[0]), values of the text column (kind "column", `first` = 0-based
    row) or row dicts of a registered format (kind "rows", `first` = 0-based row)."""

    source: str
    kind: str
    first: int
    items: list[Any]


def resolve_inputs(patterns: list[str]) -> list[tuple[Path, str]]:
    """(path, format) for each --input: a file, a save_to_disk folder or a shell-style glob
    (`**` recursive), matches in sorted order, arguments in the order given."""
    found: list[tuple[Path, str]] = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if glob.has_magic(expanded):
            matches = sorted(glob.glob(expanded, recursive=True))
            if not matches:
                raise InputError(f"--input {pattern!r} matches no file")
        elif not os.path.exists(expanded):
            raise InputError(f"--input {pattern!r} does not exist; accepted: {accepted()}")
        else:
            matches = [expanded]
        found.extend((Path(m), input_format(Path(m))) for m in matches)
    return found


def input_format(path: Path) -> str:
    """ "jsonl", "text", "parquet", a registered format's name or "hf_dataset", from the name
    (or folder markers)."""
    if path.is_dir():
        if is_saved_dataset(path):
            return "hf_dataset"
        raise InputError(
            f"--input {str(path)!r} is a folder but not a save_to_disk dataset; give its files "
            "with a glob such as DIR/*.jsonl"
        )
    fmt = format_of(path)
    if fmt is None or split_compression(path)[0] in fmt.whole_file_suffixes:
        raise InputError(f"--input {str(path)!r}: unknown file type; accepted: {accepted()}")
    return fmt.name


def read_chunks(path: Path, fmt: str, key: str) -> Iterator[Chunk]:
    """The records of one input, chunk by chunk."""
    if fmt in _LINE_KINDS:
        return _line_chunks(path, fmt)
    if fmt == "parquet":
        return _column_chunks(str(path), _parquet_values(path, key))
    if fmt == "hf_dataset":
        return _column_chunks(str(path), _saved_dataset_values(path, key))
    return _column_chunks(str(path), _registered_rows(path, fmt), kind="rows")


def _registered_rows(path: Path, fmt: str) -> Iterator[dict[str, Any]]:
    """The row dicts of a file of a registered format, through its reader."""
    try:
        with open_binary(path) as stream:
            yield from get_format(fmt).read(stream)
    except InputError:
        raise
    except Exception as exc:  # a damaged compressed file, or whatever a reader raises
        raise InputError(f"{path}: cannot read as {fmt} ({_first_line(exc)})") from None


def _line_chunks(path: Path, kind: str) -> Iterator[Chunk]:
    items: list[bytes] = []
    first, size = 1, 0
    with open_binary(path) as stream:
        try:
            for number, line in enumerate(stream, 1):
                items.append(line)
                size += len(line)
                if len(items) >= CHUNK_DOCS or size >= CHUNK_BYTES:
                    yield Chunk(str(path), kind, first, items)
                    items, first, size = [], number + 1, 0
        except DECOMPRESSION_ERRORS as exc:
            raise InputError(f"{path}: cannot read ({_first_line(exc)})") from None
    if items:
        yield Chunk(str(path), kind, first, items)


def _column_chunks(source: str, values: Iterable[Any], kind: str = "column") -> Iterator[Chunk]:
    items: list[Any] = []
    first = size = 0
    for row, value in enumerate(values):
        items.append(value)
        size += _text_size(value)
        if len(items) >= CHUNK_DOCS or size >= CHUNK_BYTES:
            yield Chunk(source, kind, first, items)
            items, first, size = [], row + 1, 0
    if items:
        yield Chunk(source, kind, first, items)


def _text_size(value: Any) -> int:
    """Characters of a column value, or of a row dict's string values."""
    if isinstance(value, dict):
        return sum(len(v) for v in value.values() if isinstance(v, str))
    return len(value) if isinstance(value, str) else 0


def _missing_column(path: Path, key: str, columns: list[str]) -> InputError:
    return InputError(f"{path}: no {key!r} column (columns: {', '.join(columns)}); set --json-key")


def _parquet_values(path: Path, key: str) -> Iterator[Any]:
    import pyarrow  # at call time: only parquet inputs need it (installed with datasets)
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        if key not in file.schema_arrow.names:
            raise _missing_column(path, key, file.schema_arrow.names)
        for batch in file.iter_batches(batch_size=CHUNK_DOCS, columns=[key]):
            yield from batch.column(0).to_pylist()
    except (OSError, pyarrow.ArrowException) as exc:
        raise InputError(f"{path}: cannot read as parquet ({_first_line(exc)})") from None


def _saved_dataset_values(path: Path, key: str) -> Iterator[Any]:
    import datasets  # at call time: importing datasets costs a second of start-up

    try:
        ds = datasets.load_from_disk(str(path))  # memory-mapped, not loaded
    except Exception as exc:  # datasets raises many types for a malformed folder
        raise InputError(f"{path}: cannot load the dataset ({_first_line(exc)})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise InputError(
                f"{path}: the dataset has no 'train' split (splits: {', '.join(ds)}); save the "
                "split to preprocess as 'train'"
            )
        ds = ds["train"]
    if key not in ds.column_names:
        raise _missing_column(path, key, ds.column_names)
    for batch in ds.select_columns([key]).iter(batch_size=CHUNK_DOCS):
        yield from batch[key]


def chunk_texts(chunk: Chunk, key: str, skip_bad: bool) -> tuple[list[str], int]:
    """(texts, bad records skipped) of a chunk. Blank lines are no records; "" and null texts
    are kept as "" (empty documents, counted by the caller). A bad record (not UTF-8, not
    JSON, not an object, no `key`, not a string) raises an InputError naming the file and
    line, or is skipped and counted when `skip_bad`."""
    texts: list[str] = []
    skipped = 0
    for offset, item in enumerate(chunk.items):
        if chunk.kind == "column":
            text, problem = _column_text(item, key)
        elif chunk.kind == "rows":
            text, problem = _record_text(item, key)
        else:
            text, problem = _line_text(item, chunk.kind, key)
        if problem is None:
            if text is not None:
                texts.append(text)
            continue
        if not skip_bad:
            where = (
                f"{chunk.source} row {chunk.first + offset}"
                if chunk.kind in ("column", "rows")
                else f"{chunk.source}:{chunk.first + offset}"
            )
            raise InputError(f"{where}: {problem}; fix it or pass --on-bad-record skip")
        skipped += 1
    return texts, skipped


def _line_text(line: bytes, kind: str, key: str) -> tuple[str | None, str | None]:
    """(text or None for a blank line, problem or None)."""
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8 ({exc.reason} at byte {exc.start})"
    if not decoded.strip():
        return None, None
    if kind == "text":
        return decoded.rstrip("\r\n"), None
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as exc:
        return "", f"not valid JSON ({exc.msg} at column {exc.colno})"
    return _record_text(record, key)


def _record_text(record: Any, key: str) -> tuple[str, str | None]:
    """(text, problem or None) of one parsed record (a JSON line, a registered format's row)."""
    if not isinstance(record, dict):
        return "", f"expected a JSON object, got {type(record).__name__}"
    if key not in record:
        keys = ", ".join(map(str, record)) or "none"
        return "", f"no {key!r} key (the record has: {keys}); set --json-key"
    return _column_text(record[key], key)


def _column_text(value: Any, key: str) -> tuple[str, str | None]:
    if value is None:
        return "", None
    if not isinstance(value, str):
        return "", f"{key!r} holds {type(value).__name__}, not a string"
    return value, None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
