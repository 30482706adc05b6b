"""`unmask preprocess`: raw corpora -> one token store (data/indexed.py), in parallel.

The reading process cuts the inputs into chunks (data/corpus.py); each chunk is parsed and
tokenized whole (`encode_batch`, one call per chunk) in the main process (`workers=1`, on
the tokenizer's own threads) or in a pool of worker processes (one tokenizer thread each),
and the results are written in chunk order. Chunks depend on the input only, so the store's
bytes do not depend on the worker count. At most `_IN_FLIGHT_PER_WORKER` chunks per worker
are pending at a time: memory stays bounded whatever the corpus size.
"""

from __future__ import annotations

import multiprocessing
import os
import shlex
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from unmask.data.corpus import Chunk, chunk_texts, read_chunks, resolve_inputs
from unmask.data.indexed import (
    IndexedWriter,
    check_output_prefix,
    token_dtype,
    tokenizer_fingerprint,
    vocab_size,
)
from unmask.data.tokenizer import build_char_tokenizer, load_local_tokenizer
from unmask.errors import InputError

BAD_RECORD_CHOICES = ("error", "skip")
_IN_FLIGHT_PER_WORKER = 4


@dataclass
class Encoded:
    """One chunk's documents: `ids` (T,) in the store's dtype, `lengths` (N,) tokens per
    document (EOD included); empty documents dropped and counted, bad records counted."""

    ids: np.ndarray
    lengths: np.ndarray
    empty: int
    skipped: int


@dataclass
class Summary:
    """What a preprocess run wrote."""

    documents: int
    tokens: int
    empty: int
    skipped: int
    seconds: float
    paths: tuple[Path, Path, Path]

    def line(self) -> str:
        rate = self.tokens / max(self.seconds, 1e-9)
        return (
            f"unmask: preprocess: {self.documents} documents, {self.tokens} tokens "
            f"({self.empty} empty documents and {self.skipped} bad records skipped) in "
            f"{self.seconds:.1f} s, {rate:,.0f} tokens/s -> "
            + ", ".join(str(p) for p in self.paths)
        )


class ChunkEncoder:
    """Chunk -> `Encoded`, with a `tokenizers.Tokenizer` rebuilt from its serialized form
    (cheap to send to a worker; truncation and padding off: whole documents, no pad)."""

    def __init__(self, serialized: str, key: str, skip_bad: bool, eod: int | None, dtype: np.dtype):
        self.tokenizer = Tokenizer.from_str(serialized)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        self.key, self.skip_bad, self.eod, self.dtype = key, skip_bad, eod, np.dtype(dtype)

    def __call__(self, chunk: Chunk) -> Encoded:
        texts, skipped = chunk_texts(chunk, self.key, self.skip_bad)
        nonblank = [t for t in texts if t]
        docs = [e.ids for e in self.encode(nonblank, add_special_tokens=False)]
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        total = int(lengths.sum())
        ids = np.fromiter(chain.from_iterable(docs), dtype=np.int64, count=total)
        kept = lengths[lengths > 0]
        empty = len(texts) - kept.size
        if self.eod is not None and kept.size:
            ids = np.insert(ids, np.cumsum(kept), self.eod)
            kept = kept + 1
        if ids.size and int(ids.max()) > np.iinfo(self.dtype).max:
            raise InputError(
                f"{chunk.source}: token id {int(ids.max())} does not fit {self.dtype.name}; the "
                "tokenizer's vocabulary size is wrong"
            )
        return Encoded(ids.astype(self.dtype), kept, empty, skipped)


_WORKER_ENCODER: ChunkEncoder | None = None


def _start_worker(*args) -> None:
    """Pool initializer: one tokenizer thread per worker (the workers are the parallelism)."""
    global _WORKER_ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_ENCODER = ChunkEncoder(*args)


def _encode_in_worker(chunk: Chunk) -> Encoded:
    return _WORKER_ENCODER(chunk)


def encode_chunks(chunks: Iterator[Chunk], encoder_args: tuple, workers: int) -> Iterator[Encoded]:
    """The chunks encoded, in input order, in this process or in `workers` processes."""
    if workers == 1:
        # in this process, with the tokenizer's own threads (TOKENIZERS_PARALLELISM decides):
        # each chunk's encode_batch spreads over the cores while nothing else runs
        yield from map(ChunkEncoder(*encoder_args), chunks)
        return
    # forkserver where there is one: the workers fork from a server process that has
    # imported this module once (no re-import per worker) and runs no other threads. A
    # plain fork of this process copies whatever locks its other threads (a test runner's,
    # torch's, the tokenizer's) hold at that moment, and a worker can wait on one forever.
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])
    else:
        context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_start_worker, initargs=encoder_args) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= workers * _IN_FLIGHT_PER_WORKER:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def preprocess(
    inputs: list[str],
    output_prefix: str,
    tokenizer: str,
    workers: int = 1,
    json_key: str = "text",
    append_eod: bool = False,
    on_bad_record: str = "error",
    overwrite: bool = False,
    command: list[str] | None = None,
    progress: bool = True,
) -> Summary:
    """Tokenize `inputs` (files, save_to_disk folders, globs) into the store `output_prefix`
    with `tokenizer`: "char" (the built-in one) or a local tokenizer folder.

    Every check that can reject input runs before anything is written; a bad record found
    later removes the temporary files, so nothing that looks like a store is left behind.
    `command` (argv) is recorded in the sidecar; `progress` shows a bar on a terminal.
    """
    if workers < 1:
        raise InputError(f"--workers must be >= 1, got {workers}")
    if on_bad_record not in BAD_RECORD_CHOICES:
        raise InputError(f"--on-bad-record must be one of {BAD_RECORD_CHOICES}")
    files = resolve_inputs(inputs)
    if tokenizer == "char":  # the built-in character tokenizer, data.tokenizer's default
        tok = build_char_tokenizer()
    else:  # a folder: any save_pretrained one, a run's final/ or checkpoint-N/ among them
        tok = load_local_tokenizer(
            tokenizer, setting="--tokenizer", fix="save one there with tokenizer.save_pretrained"
        )
    eod = None
    if append_eod:
        if tok.eos_token_id is None:
            raise InputError(
                f"--append-eod: the tokenizer in {tokenizer!r} has no EOS token to use as EOD"
            )
        eod = int(tok.eos_token_id)
    vocab = vocab_size(tok)
    dtype = token_dtype(vocab)
    check_output_prefix(output_prefix, overwrite)
    meta = {
        "format": "Megatron MMIDIDX v1 (.idx + .bin), one sequence per document",
        "tokenizer": str(tokenizer),
        "tokenizer_fingerprint": tokenizer_fingerprint(tok),
        "vocab_size": vocab,
        "append_eod": append_eod,
        "eod_id": eod,
        "json_key": json_key,
        "inputs": [str(path) for path, _ in files],
    }
    encoder_args = (tok.backend_tokenizer.to_str(), json_key, on_bad_record == "skip", eod, dtype)
    chunks = (chunk for path, fmt in files for chunk in read_chunks(path, fmt, json_key))
    begin = time.perf_counter()
    empty = skipped = 0
    bar = tqdm(
        unit=" docs", desc="preprocess", file=sys.stderr, disable=None if progress else True,
        dynamic_ncols=True, leave=False,
    )  # fmt: skip
    with bar, IndexedWriter(output_prefix, dtype, overwrite=overwrite) as writer:
        for encoded in encode_chunks(chunks, encoder_args, workers):
            writer.add_documents(encoded.ids, encoded.lengths)
            empty += encoded.empty
            skipped += encoded.skipped
            elapsed = max(time.perf_counter() - begin, 1e-9)
            bar.update(encoded.lengths.size)
            bar.set_postfix_str(
                f"{writer.num_tokens:,} tokens, {writer.num_tokens / elapsed:,.0f} tokens/s",
                refresh=False,
            )
        if writer.num_documents == 0:
            raise InputError(
                f"--input: {len(files)} input(s) hold no non-empty document ({empty} empty, "
                f"{skipped} bad records skipped); nothing written"
            )
        meta.update(empty_documents=empty, skipped_records=skipped)
        meta["command"] = shlex.join(command) if command else None
        paths = writer.finish(meta)
    return Summary(
        writer.num_documents, writer.num_tokens, empty, skipped,
        time.perf_counter() - begin, paths,
    )  # fmt: skip
