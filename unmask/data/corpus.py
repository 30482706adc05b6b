"""Streaming reads of raw corpora for `unmask preprocess`: inputs to chunks, chunks to texts.

The reading process only splits files into `Chunk`s (raw lines, or column values) of at most
`CHUNK_DOCS` records and about `CHUNK_BYTES` bytes; `chunk_texts`, run in the tokenizing
workers, parses them. Chunk borders depend on the input only, never on the worker count,
and no file is ever held in memory whole.

Formats: .jsonl (also .jsonl.gz, .jsonl.zst), .txt (one document per non-empty line; also
.gz, .zst), .parquet, and a folder written by `datasets` `save_to_disk` (its "train" split).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard

from unmask.errors import InputError

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

CHUNK_DOCS = 1024
CHUNK_BYTES = 1 << 20
_LINE_FORMATS = {".jsonl": "jsonl", ".txt": "text", ".text": "text"}
_COMPRESSED = (".gz", ".zst")
_HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
ACCEPTED = (
    ".jsonl, .jsonl.gz, .jsonl.zst, .txt (one document per line; also .gz/.zst), .parquet, "
    "or a folder written by datasets' save_to_disk"
)


@dataclass
class Chunk:
    """Consecutive records of one file: raw lines (kind "jsonl" / "text", `first` = 1-based
    line number of items[0]) or values of the text column (kind "column", `first` = 0-based
    row)."""

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
            raise InputError(f"--input {pattern!r} does not exist; accepted: {ACCEPTED}")
        else:
            matches = [expanded]
        found.extend((Path(m), input_format(Path(m))) for m in matches)
    return found


def input_format(path: Path) -> str:
    """ "jsonl", "text", "parquet" or "hf_dataset", from the name (or folder markers)."""
    if path.is_dir():
        if any((path / marker).is_file() for marker in _HF_MARKERS):
            return "hf_dataset"
        raise InputError(
            f"--input {str(path)!r} is a folder but not a save_to_disk dataset; give its files "
            "with a glob such as DIR/*.jsonl"
        )
    name = path.name.lower()
    for suffix in _COMPRESSED:
        name = name.removesuffix(suffix)
    fmt = _LINE_FORMATS.get(Path(name).suffix)
    if fmt is None and path.name.lower().endswith(".parquet"):
        fmt = "parquet"
    if fmt is None:
        raise InputError(f"--input {str(path)!r}: unknown file type; accepted: {ACCEPTED}")
    return fmt


def read_chunks(path: Path, fmt: str, key: str) -> Iterator[Chunk]:
    """The records of one input, chunk by chunk."""
    if fmt in ("jsonl", "text"):
        return _line_chunks(path, fmt)
    if fmt == "parquet":
        return _column_chunks(str(path), _parquet_values(path, key))
    return _column_chunks(str(path), _saved_dataset_values(path, key))


def _open_lines(path: Path):
    """A binary stream of the file, decompressed by its suffix (.gz, .zst)."""
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        raw = open(path, "rb")  # closed with the returned stream (closefd)
        reader = zstandard.ZstdDecompressor().stream_reader(
            raw, read_across_frames=True, closefd=True
        )
        return io.BufferedReader(reader)
    return open(path, "rb")


def _line_chunks(path: Path, kind: str) -> Iterator[Chunk]:
    items: list[bytes] = []
    first, size = 1, 0
    with _open_lines(path) as stream:
        try:
            for number, line in enumerate(stream, 1):
                items.append(line)
                size += len(line)
                if len(items) >= CHUNK_DOCS or size >= CHUNK_BYTES:
                    yield Chunk(str(path), kind, first, items)
                    items, first, size = [], number + 1, 0
        except (OSError, EOFError, zstandard.ZstdError) as exc:
            raise InputError(f"{path}: cannot read ({_first_line(exc)})") from None
    if items:
        yield Chunk(str(path), kind, first, items)


def _column_chunks(source: str, values: Iterator[Any]) -> Iterator[Chunk]:
    items: list[Any] = []
    first = size = 0
    for row, value in enumerate(values):
        items.append(value)
        size += len(value) if isinstance(value, str) else 0
        if len(items) >= CHUNK_DOCS or size >= CHUNK_BYTES:
            yield Chunk(source, "column", first, items)
            items, first, size = [], row + 1, 0
    if items:
        yield Chunk(source, "column", first, items)


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
        else:
            text, problem = _line_text(item, chunk.kind, key)
        if problem is None:
            if text is not None:
                texts.append(text)
            continue
        if not skip_bad:
            where = (
                f"{chunk.source} row {chunk.first + offset}"
                if chunk.kind == "column"
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
