"""Streaming: documents read as they are needed from a datasets IterableDataset (local
parquet / jsonl shard folders, or a hub id where the hub is reachable), tokenized and packed
into rows on the fly, in DataLoader worker processes.

Sharding: `split_dataset_by_node` gives each rank its share (whole shards when the shard
count divides by the world size, else every world_size-th document), and datasets gives
each worker of a rank its own shards. Resume: torchdata's StatefulDataLoader keeps, per
worker, the datasets stream's `state_dict` (its position in its shards) plus the packer's
carried-over tokens, so a resumed run continues with exactly the rows an uninterrupted run
would see, without reading the earlier data again. Documents come in file order (a
shuffle buffer could not be restored exactly). The global batch then depends on the world
size and the number of workers; resume with the same ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from unmask.data.formats import (
    accepted_files,
    compressed_files,
    format_names,
    format_of,
    get_format,
    open_binary,
)
from unmask.data.images import picture_row
from unmask.data.mixing import BlockMixer
from unmask.data.packing import tokenize_records
from unmask.data.rows import segment_layout
from unmask.data.sources import Record, detect_format, to_record
from unmask.errors import InputError

# torchdata 0.11 calls a torch API that torch deprecated; nothing for users to act on
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")


def open_stream(path: str, dataset_format: str = "auto"):
    """A datasets IterableDataset over a local file or folder of shards, or a hub id.

    Built-in formats stream through their `datasets` builder (which decompresses .gz/.zst
    shards itself); a registered format through its reader, one shard per file."""
    import datasets  # at call time: importing datasets costs a second of start-up

    local = Path(path).expanduser()
    try:
        if local.exists():
            files = sorted(p for p in local.rglob("*") if p.is_file() and format_of(p) is not None)
            files = [local] if local.is_file() else files
            if not files:
                raise InputError(
                    f"data: folder {path!r} holds no data files to stream; shards accepted: "
                    f"{accepted_files()} ({compressed_files()})"
                )
            fmt = dataset_format if dataset_format != "auto" else detect_format(files[0])
            data_format = get_format(fmt)
            if data_format is None:
                raise InputError(f"data.streaming reads {format_names()} shards, not {fmt}")
            names = [str(f) for f in files]
            if data_format.builder is None:
                return datasets.IterableDataset.from_generator(
                    _registered_rows, gen_kwargs={"files": names, "fmt": fmt}
                )
            return datasets.load_dataset(data_format.builder, data_files=names,
                                         split="train", streaming=True)  # fmt: skip
        _check_hub_reachable()
        return datasets.load_dataset(path, split="train", streaming=True)
    except InputError:
        raise
    except Exception as exc:  # datasets raises many types for an unreachable or bad source
        if local.exists():
            raise InputError(f"data: cannot stream {path!r}: {_first_line(exc)}") from None
        raise InputError(
            f"data.dataset {path!r} is not a local path and the Hugging Face hub cannot be "
            f"reached from here ({_first_line(exc)}); download its parquet or jsonl shards and "
            "set data.dataset to that local folder (data.streaming: true reads it as it is)"
        ) from None


def _registered_rows(files: list[str], fmt: str) -> Iterator[dict[str, Any]]:
    """The rows of a registered format's files, in order (datasets gives each rank and
    worker its own share of `files`: one shard per file)."""
    read = get_format(fmt).read
    for file in files:
        try:
            with open_binary(Path(file)) as stream:
                yield from read(stream)
        except InputError:
            raise
        except Exception as exc:  # a damaged compressed file, or whatever a reader raises
            raise InputError(f"data: cannot stream {file!r} as {fmt}: {_first_line(exc)}") from exc


def _check_hub_reachable(timeout_s: float = 5.0) -> None:
    """Fail at once, rather than after datasets' retries, where the hub cannot be reached:
    offline mode set, or no answer from HF_ENDPOINT within timeout_s."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            raise ConnectionError(f"{name} is set")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s)
    except urllib.error.HTTPError:
        return  # the endpoint answered
    except OSError as exc:
        raise ConnectionError(f"no answer from {endpoint}: {exc}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


class PackedStream(IterableDataset):
    """Rows of length L from a stream of documents (see the module docstring).

    Packed: examples (tokens + EOS) are concatenated and cut into rows; a document cut by a
    row end continues in the next row under a new doc id. Padded (packing=False): one
    example per row, truncated, filled with EOS. `state_dict` / `load_state_dict` hold the
    stream's position and the tokens carried over to the next row.
    """

    def __init__(
        self, make_stream, tokenizer, fields: dict[str, str], row_length: int, eos_id: int,
        packing: bool = True, supervise_padding: bool = True, chat_template: bool = True,
        rank: int = 0, world_size: int = 1, held_out: frozenset[str] = frozenset(),
        pictures: tuple[str, bool] | None = None,
    ):  # fmt: skip
        from datasets.distributed import split_dataset_by_node  # with datasets, at call time

        self.stream = split_dataset_by_node(make_stream(), rank=rank, world_size=world_size)
        self.held_out = held_out  # record_key of the eval documents: never trained on
        self.tokenizer, self.fields, self.eos_id = tokenizer, fields, eos_id
        self.row_length, self.packing = row_length, packing
        self.supervise_padding, self.chat_template = supervise_padding, chat_template
        self.pictures = pictures  # (data.image_field, the model has a vision tower)
        self._carry: list[tuple[int, bool, int]] = []  # (token, maskable, document)
        self._documents = 0

    def _examples(self) -> Iterator[tuple[list[int], list[bool]]]:
        for index, row in enumerate(self.stream):
            refuse_pictures(row, f"the stream's row {index}", self.pictures)
            record = to_record(row, "stream", **self.fields)
            if record is None or (self.held_out and record_key(record) in self.held_out):
                continue
            example = tokenize_records([record], self.tokenizer, self.eos_id,
                                       self.chat_template)[0]  # fmt: skip
            yield example.ids, example.maskable

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        length = self.row_length
        for ids, maskable in self._examples():
            self._documents += 1
            if not self.packing:
                yield self._padded(ids, maskable)
                continue
            self._carry.extend(zip(ids, maskable, [self._documents] * len(ids)))
            while len(self._carry) >= length:
                row, self._carry = self._carry[:length], self._carry[length:]
                yield _packed_row(row)

    def _padded(self, ids: list[int], maskable: list[bool]) -> dict[str, torch.Tensor]:
        length = self.row_length
        kept = min(len(ids), length)
        out = np.full(length, self.eos_id, dtype=np.int64)
        out[:kept] = ids[:kept]
        mask = np.full(length, self.supervise_padding, dtype=bool)
        mask[:kept] = maskable[:kept]
        doc_ids = torch.zeros(length, dtype=torch.long)
        if not self.supervise_padding:  # unsupervised fill: hidden (pad_policy single_eos)
            doc_ids[kept:] = 1
        return {"input_ids": torch.from_numpy(out), "doc_ids": doc_ids,
                "position_ids": torch.arange(length), "maskable": torch.from_numpy(mask)}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict(), "carry": list(self._carry),
                "documents": self._documents}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])
        self._carry = [tuple(t) for t in state["carry"]]
        self._documents = int(state["documents"])


def record_key(record: Record) -> str:
    """A short content hash of a record: how held-out eval documents are recognised in a
    stream, whichever rank and worker reads them."""
    return hashlib.sha1(json.dumps(record, sort_keys=True).encode()).hexdigest()[:20]


def _packed_row(row: list[tuple[int, bool, int]]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([t for t, _, _ in row], dtype=torch.long)
    maskable = torch.tensor([m for _, m, _ in row], dtype=torch.bool)
    owner = torch.tensor([d for _, _, d in row], dtype=torch.long)[None]
    doc_ids, position_ids = segment_layout(owner)
    return {"input_ids": ids, "doc_ids": doc_ids[0], "position_ids": position_ids[0],
            "maskable": maskable}  # fmt: skip


class BlendedStream(IterableDataset):
    """Rows drawn from several PackedStreams with weights: row p comes from the stream the
    mixer assigns to p (mixing.py); each stream keeps its own position."""

    def __init__(self, streams: list[PackedStream], weights: list[float], seed: int):
        self.streams, self.mixer = streams, BlockMixer(weights, seed)
        self._rows = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        iterators = [iter(s) for s in self.streams]
        while True:
            source, _ = self.mixer.assign(torch.tensor([self._rows]))
            try:
                row = next(iterators[int(source)])
            except StopIteration:
                return  # the epoch ends with the first exhausted source
            self._rows += 1
            yield row

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self._rows, "streams": [s.state_dict() for s in self.streams]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rows = int(state["rows"])
        for stream, saved in zip(self.streams, state["streams"]):
            stream.load_state_dict(saved)


def _stack(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


@dataclass
class StreamSpec:
    """How to build a run's training stream on any rank: one or several sources (path,
    dataset_format, text_field), their weights and the row layout. Documents whose
    record_key is in `held_out` (the eval hold-out) are skipped."""

    sources: list[tuple[str, str, str]]
    weights: list[float]
    held_out: frozenset[str]
    tokenizer: Any
    fields: dict[str, str]
    row_length: int
    eos_id: int
    packing: bool
    supervise_padding: bool
    chat_template: bool
    seed: int
    pictures: tuple[str, bool] | None = None
    """(data.image_field, the model has a vision tower): rows with pictures are refused."""

    def dataset(self, rank: int = 0, world_size: int = 1) -> IterableDataset:
        fields = [{**self.fields, "text_field": field} for _, _, field in self.sources]
        streams = [
            PackedStream(
                _opener(path, fmt),
                self.tokenizer,
                own_fields,
                self.row_length,
                self.eos_id,
                self.packing,
                self.supervise_padding,
                self.chat_template,
                rank,
                world_size,
                self.held_out,
                self.pictures,
            )  # fmt: skip
            for (path, fmt, _), own_fields in zip(self.sources, fields)
        ]
        if len(streams) == 1:
            return streams[0]
        return BlendedStream(streams, self.weights, self.seed)


def _opener(path: str, fmt: str) -> Callable[[], Any]:
    return lambda: open_stream(path, fmt)


def refuse_pictures(row: dict[str, Any], where: str, pictures: tuple[str, bool] | None) -> None:
    """One line for a row with pictures (images.py picture_row; `pictures`: (data.image_field,
    the model has a vision tower); None: no check), wherever it is in the stream: a stream
    trains text only, and would train them as text with `<image>` kept as a word."""
    if pictures is not None and picture_row(row, *pictures):
        raise InputError(f"data.streaming does not read pictures yet ({where} has "
                         f"{pictures[0]!r} or 'conversations'); set data.streaming: "
                         "false")  # fmt: skip


def first_records(path: str, fmt: str, count: int, fields: dict[str, str],
                  pictures: tuple[str, bool] | None = None) -> list[Record]:  # fmt: skip
    """The first `count` documents of a stream (the eval hold-out), as records; one line
    for a row with pictures (`refuse_pictures`)."""
    records = []
    for index, row in enumerate(open_stream(path, fmt).take(count)):
        refuse_pictures(row, f"{path!r} row {index}", pictures)
        record = to_record(row, path, **fields)
        if record is not None:
            records.append(record)
    return records


class StreamLoader:
    """Endless micro-batches of batch_size rows from a stream, in num_workers processes.

    `make_dataset()` builds the stream afresh (PackedStream or BlendedStream); when it ends,
    the next epoch starts a new one. State: the epoch and StatefulDataLoader's state (each
    worker's stream position and carried tokens)."""

    def __init__(
        self, make_dataset, batch_size: int, num_workers: int = 0, pin_memory: bool = False
    ):
        self.make_dataset, self.batch_size = make_dataset, batch_size
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.epoch = 0
        self._loader = self._new_loader()
        self._iter: Iterator | None = None

    def _new_loader(self) -> StatefulDataLoader:
        return StatefulDataLoader(self.make_dataset(), batch_size=self.batch_size,
                                  num_workers=self.num_workers, collate_fn=_stack,
                                  pin_memory=self.pin_memory, drop_last=True)  # fmt: skip

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        for _ in range(2):
            if self._iter is None:
                self._iter = iter(self._loader)
            try:
                return next(self._iter)
            except StopIteration:
                self.epoch += 1
                self._iter = None
                self._loader = self._new_loader()
        raise InputError("data: the stream yields no rows of a whole batch; give it more documents")

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "loader": self._loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["loader"].get("_snapshot", {}).get("_main_snapshot", {})
        workers = int(saved.get("_num_workers", 0))
        if workers != self.num_workers:
            raise InputError(
                f"the checkpoint's data stream was read by {workers} worker processes (each "
                "holds its own position in the stream); resume with "
                f"train.dataloader_num_workers={workers}"
            )
        self.epoch = int(state["epoch"])
        self._loader = self._new_loader()
        self._loader.load_state_dict(state["loader"])
        self._iter = None

    def close(self) -> None:
        self._iter = None
