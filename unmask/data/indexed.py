"""Token stores: Megatron's indexed-dataset format (PREFIX.idx + PREFIX.bin), our own code.

A store is one token stream cut into documents, readable by megatron-core's `IndexedDataset`
and by `IndexedStore` here. Layout of PREFIX.idx (all little-endian):

    9 bytes   b"MMIDIDX\\x00\\x00"
    <Q        version, 1
    <B        token dtype code (`DTYPE_CODES`)
    <Q        S, the number of sequences
    <Q        D + 1, the length of document_indices (D documents)
    int32[S]  sequence_lengths, tokens per sequence
    int64[S]  sequence_pointers, byte offset of each sequence in PREFIX.bin
    int64[D+1] document_indices: 0, then the number of sequences at the end of each document

PREFIX.bin is the raw tokens, sequences back to back. We write one sequence per document; a
Megatron store may split a document into several sequences (sentences), and document
boundaries always come from document_indices. PREFIX.json (ours only) records the tokenizer
fingerprint, vocabulary size and what made the store; `check_store_tokenizer` compares it.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from unmask.errors import InputError

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}
_FIXED = len(HEADER) + 8 + 1 + 8 + 8  # bytes before the arrays: 34
_BLOCK = 1 << 20  # sequences per block when writing the index (bounds peak memory)
MAKE_ONE = "make one with `unmask preprocess --input FILES --output-prefix PREFIX --tokenizer DIR`"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits with room to spare (vocabulary < 65500), else int32:
    Megatron's rule, so a store made by either tool for one tokenizer has the same dtype."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def store_paths(prefix: str | Path) -> tuple[Path, Path, Path]:
    """(PREFIX.bin, PREFIX.idx, PREFIX.json)."""
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx"), Path(prefix + ".json")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's serialized form (a transformers fast tokenizer or a
    `tokenizers.Tokenizer`), without its truncation and padding settings: those change when
    the tokenizer is called, not which ids a text gets. Keys are sorted so the hash does not
    depend on how the file was written."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    tree = json.loads(backend.to_str())
    tree.pop("truncation", None)
    tree.pop("padding", None)
    canonical = json.dumps(tree, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def vocab_size(tokenizer: Any) -> int:
    """Ids a tokenizer can produce, added tokens included (transformers or `tokenizers`)."""
    if hasattr(tokenizer, "__len__"):
        return len(tokenizer)
    return tokenizer.get_vocab_size(with_added_tokens=True)


class IndexedWriter:
    """Append documents to a new store; nothing looks complete until `finish`.

    Tokens go to PREFIX.bin.tmp and the index is built from the per-document lengths (int32,
    4 bytes per document in memory) at `finish`, which writes PREFIX.idx.tmp and
    PREFIX.json.tmp and renames them into place: .bin, then .json, then .idx last, so a store
    whose .idx exists is complete. A crash leaves only *.tmp files, overwritten next time.
    Use as a context manager: an exception removes the temporary files.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype | type, overwrite: bool = False):
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"token dtype {self.dtype} has no MMIDIDX code")
        self.bin_path, self.idx_path, self.meta_path = store_paths(prefix)
        check_output_prefix(prefix, overwrite)
        self._tmp = {p: p.with_name(p.name + ".tmp") for p in self.paths}
        self._bin = open(self._tmp[self.bin_path], "wb")  # closed by finish / abort
        self._lengths: list[np.ndarray] = []
        self.num_documents = 0
        self.num_tokens = 0

    @property
    def paths(self) -> tuple[Path, Path, Path]:
        return self.bin_path, self.idx_path, self.meta_path

    def add_document(self, ids) -> None:
        """One document: a sequence of token ids."""
        ids = np.asarray(ids)
        self.add_documents(ids, np.array([ids.size], dtype=np.int64))

    def add_documents(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Several documents at once: `flat` (T,) their ids back to back, `lengths` (N,) tokens
        per document (sum = T). Ids must fit the store's dtype."""
        lengths = np.asarray(lengths, dtype=np.int64)
        flat = np.asarray(flat)
        if int(lengths.sum()) != flat.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())}, flat holds {flat.size} ids")
        if lengths.size and int(lengths.max()) > np.iinfo(np.int32).max:
            raise InputError(
                f"a document of {int(lengths.max())} tokens is over the format's 2^31-1"
            )
        if flat.size and flat.dtype != self.dtype:
            info = np.iinfo(self.dtype)
            if int(flat.min()) < info.min or int(flat.max()) > info.max:
                raise InputError(
                    f"token id {int(flat.max())} does not fit the store's {self.dtype}; the "
                    "tokenizer's vocabulary size is wrong"
                )
        self._bin.write(flat.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(lengths.astype(np.int32))
        self.num_documents += int(lengths.size)
        self.num_tokens += int(flat.size)

    def finish(self, meta: dict[str, Any] | None = None) -> tuple[Path, Path, Path]:
        """Write the index and the sidecar (`meta` plus dtype and counts), rename all three
        into place; returns (bin, idx, json) paths."""
        _sync(self._bin)
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        self._lengths = []
        with open(self._tmp[self.idx_path], "wb") as out:
            _write_index(out, lengths, self.dtype)
            _sync(out)
        sidecar = dict(meta or {})
        sidecar.update(dtype=self.dtype.name, documents=self.num_documents, tokens=self.num_tokens)
        with open(self._tmp[self.meta_path], "w") as out:
            out.write(json.dumps(sidecar, indent=2) + "\n")
            _sync(out)
        self.idx_path.unlink(missing_ok=True)  # an old store's index never outlives its .bin
        for path in (self.bin_path, self.meta_path, self.idx_path):
            os.replace(self._tmp[path], path)
        return self.paths

    def abort(self) -> None:
        """Close and remove the temporary files; the user's files are untouched."""
        self._bin.close()
        for tmp in self._tmp.values():
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def _sync(stream) -> None:
    """Data on disk before a rename gives the file its final name (power loss included)."""
    stream.flush()
    os.fsync(stream.fileno())


def check_output_prefix(prefix: str | Path, overwrite: bool) -> None:
    """The folder must exist; an existing PREFIX.bin / .idx is kept unless `overwrite`."""
    bin_path, idx_path, _ = store_paths(prefix)
    folder = bin_path.parent
    if str(prefix).endswith(("/", os.sep)) or Path(prefix).is_dir():
        raise InputError(
            f"--output-prefix {str(prefix)!r} is a folder; give a file prefix inside it, "
            "e.g. FOLDER/corpus (writes corpus.bin, corpus.idx, corpus.json)"
        )
    if folder.exists() and not folder.is_dir():
        raise InputError(
            f"--output-prefix {str(prefix)!r}: {str(folder)!r} is a file, not a folder; give "
            "a prefix inside a folder"
        )
    if not folder.is_dir():
        raise InputError(
            f"--output-prefix {str(prefix)!r}: folder {str(folder)!r} does not exist; create it"
        )
    existing = [p.name for p in (bin_path, idx_path) if p.exists()]
    if existing and not overwrite:
        raise InputError(
            f"--output-prefix {str(prefix)!r}: {' and '.join(existing)} already exist; choose "
            "another prefix or pass --overwrite to replace them"
        )


def _write_index(out, lengths: np.ndarray, dtype: np.dtype) -> None:
    """The .idx bytes for one sequence per document; pointers are written block by block."""
    count = int(lengths.size)
    out.write(HEADER)
    out.write(struct.pack("<Q", VERSION))
    out.write(struct.pack("<B", _CODE_OF[dtype]))
    out.write(struct.pack("<Q", count))
    out.write(struct.pack("<Q", count + 1))
    out.write(lengths.astype("<i4", copy=False).tobytes())
    offset = 0
    for start in range(0, count, _BLOCK):
        block = lengths[start : start + _BLOCK].astype(np.int64) * dtype.itemsize
        ends = np.cumsum(block)
        out.write((ends - block + offset).astype("<i8").tobytes())
        offset += int(ends[-1])
    for start in range(0, count + 1, _BLOCK):
        out.write(np.arange(start, min(start + _BLOCK, count + 1), dtype="<i8").tobytes())


class IndexedStore:
    """A store opened for reading: only the index is read at start-up (both files are
    memory-mapped; no token is touched until asked for).

    `tokens(start, stop)` is the token stream between two token offsets; `doc_offsets` the
    (num_documents + 1,) int64 token offset of each document start, the last = num_tokens.
    Sequences are assumed back to back in .bin, as both writers make them.
    """

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        bin_path, idx_path, meta_path = store_paths(prefix)
        missing = [p.name for p in (bin_path, idx_path) if not p.is_file()]
        if missing:
            raise InputError(
                f"token store {self.prefix!r}: {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} missing; {MAKE_ONE}"
            )
        idx_size = idx_path.stat().st_size
        with open(idx_path, "rb") as f:
            head = f.read(_FIXED)
        if len(head) < len(HEADER) or head[: len(HEADER)] != HEADER:
            raise InputError(
                f"{str(idx_path)!r} is not a Megatron MMIDIDX index (header {head[:9]!r}); "
                f"{MAKE_ONE}"
            )
        if len(head) < _FIXED:
            raise InputError(f"{str(idx_path)!r} is truncated ({idx_size} bytes, header is 34)")
        version, code, seqs, docs = struct.unpack("<QBQQ", head[len(HEADER) :])
        if version != VERSION:
            raise InputError(
                f"{str(idx_path)!r}: MMIDIDX version {version} is not supported (only 1)"
            )
        if code not in DTYPE_CODES:
            raise InputError(f"{str(idx_path)!r}: unknown token dtype code {code} (known: 1..8)")
        need = _FIXED + seqs * 12 + docs * 8
        if idx_size < need:
            raise InputError(
                f"{str(idx_path)!r} is shorter than its counts claim: {seqs} sequences and "
                f"{docs} document indices need {need} bytes, the file has {idx_size}"
            )
        self.dtype = np.dtype(DTYPE_CODES[code])
        self.num_sequences = seqs
        index = np.memmap(idx_path, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(index, np.int32, seqs, _FIXED)
        self.sequence_pointers = np.frombuffer(index, np.int64, seqs, _FIXED + seqs * 4)
        self.document_indices = np.frombuffer(index, np.int64, docs, _FIXED + seqs * 12)
        if docs == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != seqs:
            raise InputError(
                f"{str(idx_path)!r}: document_indices must run from 0 to the sequence count "
                f"{seqs}; the index is corrupt"
            )
        self.num_documents = docs - 1
        expected = 0
        if seqs:
            last = seqs - 1
            expected = int(self.sequence_pointers[last])
            expected += int(self.sequence_lengths[last]) * self.dtype.itemsize
        bin_size = bin_path.stat().st_size
        if bin_size != expected:
            raise InputError(
                f"{str(bin_path)!r} holds {bin_size} bytes but {idx_path.name} describes "
                f"{expected}: the .bin is truncated or belongs to another store; {MAKE_ONE}"
            )
        self.num_tokens = expected // self.dtype.itemsize
        self._bin = (
            np.memmap(bin_path, mode="r", dtype=self.dtype)
            if bin_size
            else np.zeros(0, dtype=self.dtype)
        )
        self.meta = _read_meta(meta_path)

    def __len__(self) -> int:
        return self.num_documents

    def _start(self, doc: np.ndarray | int) -> np.ndarray:
        """Token offset where document(s) `doc` start (num_tokens past the last one)."""
        seq = np.asarray(self.document_indices[doc])
        if self.num_sequences == 0:
            return np.zeros(seq.shape, dtype=np.int64)
        inside = seq < self.num_sequences
        pointers = self.sequence_pointers[np.where(inside, seq, 0)] // self.dtype.itemsize
        return np.where(inside, pointers, self.num_tokens).astype(np.int64)

    @cached_property
    def doc_offsets(self) -> np.ndarray:
        """(num_documents + 1,) int64: where each document starts in the token stream."""
        return self._start(np.arange(self.num_documents + 1))

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream (a read-only view of the memory-mapped .bin)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens [{start}, {stop}) outside 0..{self.num_tokens}")
        return self._bin[start:stop]

    def document(self, i: int) -> np.ndarray:
        """The tokens of document `i` (all its sequences)."""
        if not -self.num_documents <= i < self.num_documents:
            raise IndexError(f"document {i} of {self.num_documents}")
        i %= self.num_documents
        start, stop = self._start(np.array([i, i + 1]))
        return self.tokens(int(start), int(stop))


def _read_meta(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{str(path)!r} is not valid JSON ({exc}); remove or rewrite it") from None
    return meta if isinstance(meta, dict) else None


def check_store_tokenizer(store: IndexedStore, tokenizer: Any) -> str | None:
    """Raise an InputError when `store` was made with another tokenizer (its sidecar's
    fingerprint or vocabulary size differ); return a notice to print when the store has no
    sidecar (e.g. made by Megatron's tools), None when they match. Check the tokenizer as
    saved, before tokens are added to it (`ensure_special_tokens` changes both)."""
    if store.meta is None or "tokenizer_fingerprint" not in store.meta:
        return (
            f"token store {store.prefix!r} has no {Path(store.prefix).name}.json sidecar; the "
            "tokenizer fingerprint check was skipped"
        )
    ours, vocab = tokenizer_fingerprint(tokenizer), vocab_size(tokenizer)
    theirs, their_vocab = store.meta["tokenizer_fingerprint"], store.meta.get("vocab_size")
    if ours != theirs or (their_vocab is not None and their_vocab != vocab):
        raise InputError(
            f"token store {store.prefix!r} was made with another tokenizer (fingerprint "
            f"{str(theirs)[:12]}, vocabulary {their_vocab}) than the one given (fingerprint "
            f"{ours[:12]}, vocabulary {vocab}); preprocess again with this tokenizer"
        )
    return None
