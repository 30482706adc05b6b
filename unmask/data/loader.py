"""Resumable training batches from map-style row sources, each rank reading only its rows.

Both loaders define a run's batches as a pure function of (seed, global batch size, number
of the micro-batch): global micro-batch k is G = batch_size * world_size rows, rank r takes
rows [r * batch_size, (r + 1) * batch_size) of it and reads nothing else. So resuming at a
micro-batch is starting there (no replay of earlier data), a 1-process run and an N-process
run with the same global batch see the same rows, and DataLoader worker processes can
compute micro-batches ahead of the training step (`num_workers`) without any of them
needing to know what the others did.

- `BatchLoader`: one source, a fresh seeded permutation each epoch.
- `MixedLoader`: several sources blended with weights (mixing.py decides which source each
  row comes from), each source in its own seeded permutation.

Resuming with another global batch size (another world size without split_batches)
re-shards deterministically: the next micro-batch starts at the first row not yet used.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from functools import lru_cache

import torch
from torch.utils.data import DataLoader, Dataset

from unmask.data.build import Blend
from unmask.data.mixing import BlockMixer
from unmask.data.rows import RowSource
from unmask.data.streaming import StreamLoader, StreamSpec
from unmask.errors import InputError

Batch = dict[str, torch.Tensor]


class _MicroBatches(Dataset):
    """Micro-batch number -> this rank's rows: what a DataLoader worker computes."""

    def __init__(self, fetch: Callable[[int], Batch]):
        self.fetch = fetch

    def __len__(self) -> int:
        return 2**62

    def __getitem__(self, k: int) -> Batch:
        return self.fetch(k)


def _one_thread(_: int) -> None:
    torch.set_num_threads(1)  # workers gather rows; the training step owns the cores


class Prefetcher:
    """Micro-batches k = next, next + 1, ... from `batch_at(k)`, computed in `num_workers`
    DataLoader processes ahead of use (0 = in this process, when asked). `restart` forgets
    what was computed ahead (after a jump: a loader's load_state_dict)."""

    def __init__(self, batch_at: Callable[[int], Batch], num_workers: int, pin_memory: bool):
        self.batch_at, self.num_workers, self.pin_memory = batch_at, num_workers, pin_memory
        self._stream: Iterator[Batch] | None = None

    def fetch(self, k: int) -> Batch:
        """Micro-batch k; consecutive calls must ask for k, k + 1, ... unless restarted.
        With pin_memory (training on CUDA) its tensors are in pinned memory, as a
        DataLoader's workers pin theirs: the step's copy to the GPU is then asynchronous,
        where one from pageable memory may wait for the stream."""
        if self.num_workers == 0:
            batch = self.batch_at(k)
            if self.pin_memory:
                batch = {key: value.pin_memory() for key, value in batch.items()}
            return batch
        if self._stream is None:
            loader = DataLoader(
                _MicroBatches(self.batch_at), batch_size=None, sampler=range(k, 2**62),
                num_workers=self.num_workers, pin_memory=self.pin_memory,
                worker_init_fn=_one_thread,
            )  # fmt: skip
            self._stream = iter(loader)
        return next(self._stream)

    def restart(self) -> None:
        self._stream = None


def _check_shape(batch_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad batch_size={batch_size}, rank={rank}, world_size={world_size}")


def _resharded(position: int, old_global: int, new_global: int) -> int:
    """The first micro-batch (of new_global rows) after position micro-batches of old_global."""
    return math.ceil(position * old_global / new_global)


class BatchLoader:
    """Endless batches of rows: a fresh seeded shuffle each epoch, a disjoint slice per rank.

    The permutation of epoch e comes from a generator seeded with seed + e, so the order
    depends only on (seed, epoch, position), and `state_dict` / `load_state_dict` resume
    exactly. Each epoch drops its last partial global batch; a dataset smaller than one
    global batch repeats its permutation to fill one. Yields dicts of (batch_size, L)
    tensors.
    """

    def __init__(
        self, rows: RowSource, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
        num_workers: int = 0, pin_memory: bool = False,
    ):  # fmt: skip
        if len(rows) == 0:
            raise InputError("data: no training rows; give a dataset with at least one document")
        _check_shape(batch_size, rank, world_size)
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0
        self.prefetcher = Prefetcher(self.batch_at, num_workers, pin_memory)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @lru_cache(maxsize=2)  # noqa: B019 - the loader lives as long as the run
    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Row indices of one epoch, a multiple of the global batch size long. (E,)"""
        gen = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(len(self.rows), generator=gen)
        if len(order) < self.global_batch_size:
            order = order.repeat(-(-self.global_batch_size // len(order)))
        usable = len(order) - len(order) % self.global_batch_size
        return order[:usable]

    def batches_per_epoch(self) -> int:
        return max(len(self.rows), self.global_batch_size) // self.global_batch_size

    def batch_at(self, k: int) -> Batch:
        """This rank's rows of global micro-batch k of the run."""
        epoch, position = divmod(k, self.batches_per_epoch())
        start = position * self.global_batch_size + self.rank * self.batch_size
        return self.rows.gather(self.epoch_order(epoch)[start : start + self.batch_size])

    def __next__(self) -> Batch:
        if self.position >= self.batches_per_epoch():
            self.epoch, self.position = self.epoch + 1, 0
        batch = self.prefetcher.fetch(self.epoch * self.batches_per_epoch() + self.position)
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[Batch]:
        return self

    def close(self) -> None:
        self.prefetcher.restart()

    def state_dict(self) -> dict[str, int]:
        """Where the next batch comes from: {"epoch", "position"} (global batches done in
        the epoch) and the global batch size they counted."""
        return {"epoch": self.epoch, "position": self.position,
                "global_batch": self.global_batch_size}  # fmt: skip

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        old = int(state.get("global_batch", self.global_batch_size))
        if old != self.global_batch_size:
            self.position = _resharded(self.position, old, self.global_batch_size)
        self.prefetcher.restart()


class MixedLoader:
    """Endless batches blended from several row sources with the given weights.

    Row p of the run (p = 0, 1, ... over global micro-batches) comes from the source the
    mixer assigns to p, and is that source's next row in its own seeded permutation
    (epochs of the whole source, seed + 7919 * source + epoch). Rank r reads its slice of
    each global micro-batch, as in BatchLoader. State: rows of the run done.
    """

    def __init__(
        self, sources: list[RowSource], weights: list[float], batch_size: int, seed: int,
        rank: int = 0, world_size: int = 1, num_workers: int = 0, pin_memory: bool = False,
    ):  # fmt: skip
        for index, rows in enumerate(sources):
            if len(rows) == 0:
                raise InputError(f"data.sources[{index}]: no rows; give it at least one document")
        _check_shape(batch_size, rank, world_size)
        self.sources, self.seed = sources, seed
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.mixer = BlockMixer(weights, seed)
        self.batches = 0
        self.prefetcher = Prefetcher(self.batch_at, num_workers, pin_memory)

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @lru_cache(maxsize=64)  # noqa: B019 - the loader lives as long as the run
    def source_order(self, source: int, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed + 7919 * source + epoch)
        return torch.randperm(len(self.sources[source]), generator=gen)

    def batch_at(self, k: int) -> Batch:
        """This rank's rows of global micro-batch k of the run."""
        start = k * self.global_batch_size + self.rank * self.batch_size
        positions = torch.arange(start, start + self.batch_size)
        source_of, count_of = self.mixer.assign(positions)
        parts, where = [], []
        for source in sorted(set(source_of.tolist())):
            picked = (source_of == source).nonzero().squeeze(1)
            size = len(self.sources[source])
            counts = count_of[picked]
            rows = torch.stack([self.source_order(source, int(c) // size)[int(c) % size]
                                for c in counts])  # fmt: skip
            parts.append(self.sources[source].gather(rows))
            where.append(picked)
        order = torch.cat(where).argsort()  # back to position order
        return {key: torch.cat([p[key] for p in parts])[order] for key in parts[0]}

    def __next__(self) -> Batch:
        batch = self.prefetcher.fetch(self.batches)
        self.batches += 1
        return batch

    def __iter__(self) -> Iterator[Batch]:
        return self

    def close(self) -> None:
        self.prefetcher.restart()

    def state_dict(self) -> dict[str, int]:
        return {"rows": self.batches * self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches = math.ceil(int(state["rows"]) / self.global_batch_size)
        self.prefetcher.restart()


def eval_batches(rows: RowSource, batch_size: int) -> Iterator[Batch]:
    """All rows in order, `batch_size` at a time (the last batch may be smaller)."""
    for start in range(0, len(rows), batch_size):
        yield rows.gather(torch.arange(start, min(start + batch_size, len(rows))))


def make_loader(
    train: RowSource | Blend | StreamSpec,
    batch_size: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> BatchLoader | MixedLoader | StreamLoader:
    """The loader for a run's training rows: BatchLoader for one source, MixedLoader for a
    blend (this rank's batch_size rows of every global micro-batch), StreamLoader for a
    stream (this rank's share of the stream)."""
    if isinstance(train, StreamSpec):
        return StreamLoader(lambda: train.dataset(rank, world_size), batch_size, num_workers,
                            pin_memory)  # fmt: skip
    if isinstance(train, Blend):
        return MixedLoader(train.sources, train.weights, batch_size, seed, rank, world_size,
                           num_workers, pin_memory)  # fmt: skip
    return BatchLoader(train, batch_size, seed, rank, world_size, num_workers, pin_memory)
