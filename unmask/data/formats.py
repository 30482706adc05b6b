"""The local file formats every data reader knows, in one table: their suffixes, compression
and the markers of a `datasets` `save_to_disk` folder.

Three readers consult it: training data read into memory (sources.py), training data read
as a stream (streaming.py) and `unmask preprocess` (corpus.py). A format is a name (its
`data.dataset_format` value for the built-in ones), its file suffixes and how its rows are
read. Built in: text (one document per non-empty line), jsonl (one JSON object per line;
`.json` may also be one JSON document, read whole) and parquet. A file of a compressible
format may carry a compression suffix after its own (`a.jsonl.zst`, `b.txt.gz`): every
reader decompresses it as a stream.

A new format is one `register_format(name, suffixes, read)` call, from anywhere (no edit of
unmask/): `read` turns a file's decompressed bytes into row dicts (`text`, or
`prompt`/`response`, or `messages`), and files with those suffixes then train in memory, as
a stream, in blends, and go through `unmask preprocess`.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

RowReader = Callable[[BinaryIO], Iterable[dict[str, Any]]]

#: files a `save_to_disk` folder holds (any one marks the folder as a saved dataset)
SAVE_TO_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
#: names that are not file formats: `data.dataset_format` values for folders and stores
RESERVED_NAMES = ("auto", "folder", "hf_dataset", "indexed")


class _ZstdStream(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame. A file that ends inside a frame
    (cut short) raises ZstdError where zstandard's stream_reader would just end early."""

    def __init__(self, path: Path):
        self._file = open(path, "rb")
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._in_frame = False  # bytes of an unfinished frame were fed
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            if self._frame.eof:  # the next frame starts after this one's bytes
                rest = self._frame.unused_data
                self._frame = zstandard.ZstdDecompressor().decompressobj()
                self._in_frame = False
                if rest:
                    self._feed(rest)
                    continue
            chunk = self._file.read(1 << 20)
            if not chunk:
                if self._in_frame:
                    raise zstandard.ZstdError("the file ends inside a zstd frame (cut short?)")
                return 0
            self._feed(chunk)
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos : self._pos + n]
        self._pos += n
        return n

    def _feed(self, data: bytes) -> None:
        self._out, self._pos = self._frame.decompress(data), 0
        self._in_frame = not self._frame.eof or bool(self._frame.unused_data)

    def close(self) -> None:
        self._file.close()
        super().close()


def _open_zstd(path: Path) -> BinaryIO:
    return io.BufferedReader(_ZstdStream(path))


#: compression suffix -> opener of the decompressed byte stream
COMPRESSIONS: dict[str, Callable[[Path], BinaryIO]] = {
    ".gz": lambda path: gzip.open(path, "rb"),
    ".zst": _open_zstd,
}
#: what reading a damaged compressed file raises (gzip: BadGzipFile/EOFError; zstandard)
DECOMPRESSION_ERRORS = (OSError, EOFError, zstandard.ZstdError)


@dataclass(frozen=True)
class DataFormat:
    """One file format: its name, its suffixes and how its rows are read."""

    name: str
    """What the format is called in messages (and, built in, in data.dataset_format)."""

    suffixes: tuple[str, ...]
    """Lower-case file suffixes with the dot (".jsonl"); the first one names it in messages."""

    read: RowReader | None
    """Rows of one file, from its decompressed bytes: how training reads it into memory
    and how `unmask preprocess` and streams read it when they have no reader of their own
    for it. None: read into memory by `builder`."""

    builder: str | None = None
    """The `datasets` builder ("json", "parquet", "text") that streams it, and reads it
    into memory when `read` is None. None: streamed through `read`."""

    note: str = ""
    """A few words for the accepted-formats message ("one document per line")."""

    compressible: bool = True
    """Files may carry a compression suffix after the format's (.gz, .zst)."""

    whole_file_suffixes: tuple[str, ...] = ()
    """Suffixes whose files may hold one document to read whole (.json: a JSON array), not
    one record per line: `unmask preprocess`, which reads files line by line, refuses them."""


def _text_rows(stream: BinaryIO) -> Iterator[dict[str, Any]]:
    """One document per non-empty line, without its line break."""
    for line in io.TextIOWrapper(stream, encoding="utf-8"):
        if line.strip():
            yield {"text": line.rstrip("\r\n")}


_BUILT_IN = (
    DataFormat("text", (".txt", ".text"), _text_rows, "text", "one document per line"),
    DataFormat("jsonl", (".jsonl", ".json"), None, "json", whole_file_suffixes=(".json",)),
    DataFormat("parquet", (".parquet",), None, "parquet", compressible=False),
)
_FORMATS: dict[str, DataFormat] = {fmt.name: fmt for fmt in _BUILT_IN}


def register_format(
    name: str,
    suffixes: Iterable[str],
    read: RowReader,
    note: str = "",
    compressible: bool = True,
) -> DataFormat:
    """Make files ending in `suffixes` readable by every data reader: `read(stream)` gets the
    file's decompressed bytes (a binary stream) and yields one dict per row. A row holding
    `text` (data.text_field) is a document, `prompt` + `response` a pair, `messages` a chat.
    Files are recognised by suffix (data.dataset_format: auto); a suffix or name already
    taken is a ValueError."""
    fmt = DataFormat(name, tuple(s.lower() for s in suffixes), read, None, note, compressible)
    if name in _FORMATS or name in RESERVED_NAMES:
        raise ValueError(f"data format {name!r} is already taken")
    if not fmt.suffixes or not all(s.startswith(".") and len(s) > 1 for s in fmt.suffixes):
        raise ValueError(f"data format {name!r}: give suffixes such as '.ext', not {suffixes!r}")
    for suffix in fmt.suffixes:
        owner = format_for_suffix(suffix)
        if owner is not None or suffix in COMPRESSIONS:
            taken = owner.name if owner is not None else "compression"
            raise ValueError(f"data format {name!r}: suffix {suffix!r} is taken by {taken!r}")
    _FORMATS[name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Forget a format added with `register_format` (built-in ones stay)."""
    if any(f.name == name for f in _BUILT_IN):
        raise ValueError(f"data format {name!r} is built in")
    _FORMATS.pop(name, None)


def get_format(name: str) -> DataFormat | None:
    return _FORMATS.get(name)


def format_for_suffix(suffix: str) -> DataFormat | None:
    """The format that owns a (lower-case) suffix such as ".jsonl"."""
    return next((f for f in _FORMATS.values() if suffix in f.suffixes), None)


def split_compression(path: Path) -> tuple[str, str]:
    """(data suffix, compression suffix or "") of a file name: "a.jsonl.zst" ->
    (".jsonl", ".zst"), "a.txt" -> (".txt", "")."""
    name = path.name.lower()
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), "")
    return Path(name.removesuffix(compression)).suffix, compression


def format_of(path: Path) -> DataFormat | None:
    """The format of a file from its name (a compression suffix read through), or None
    when no format owns it (a compressed file of a format that is not compressible
    included)."""
    suffix, compression = split_compression(path)
    fmt = format_for_suffix(suffix)
    if fmt is None or (compression and not fmt.compressible):
        return None
    return fmt


def is_saved_dataset(folder: Path) -> bool:
    """Whether `folder` was written by `datasets`' save_to_disk (a Dataset or DatasetDict)."""
    return any((folder / marker).is_file() for marker in SAVE_TO_DISK_MARKERS)


def open_binary(path: Path) -> BinaryIO:
    """The file's bytes as a binary stream, decompressed by its suffix (.gz, .zst)."""
    _, compression = split_compression(path)
    if compression:
        return COMPRESSIONS[compression](path)
    return open(path, "rb")


def accepted_files(line_by_line: bool = False) -> str:
    """The accepted file kinds for messages, from the table: ".txt/.text (one document per
    line), .jsonl/.json, .parquet" and the registered ones. `line_by_line`: only what
    `unmask preprocess` reads (no whole-file suffixes)."""
    parts = []
    for fmt in _FORMATS.values():
        suffixes = [s for s in fmt.suffixes if not (line_by_line and s in fmt.whole_file_suffixes)]
        parts.append("/".join(suffixes) + (f" ({fmt.note})" if fmt.note else ""))
    return ", ".join(parts)


def compressed_files() -> str:
    """ "compressed too: .txt.gz, .txt.zst, .jsonl.gz, .jsonl.zst" (each compressible
    format's first suffix), for messages."""
    names = [f.suffixes[0] + c for f in _FORMATS.values() if f.compressible for c in COMPRESSIONS]
    return "compressed too: " + ", ".join(names)


def format_names() -> str:
    """ "text, jsonl or parquet" (and the registered ones), for messages."""
    names = list(_FORMATS)
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
