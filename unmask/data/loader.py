"""Datasets of rows and the deterministic, rank-sharded, resumable batch loader."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from unmask.data.config import DataConfig
from unmask.data.packing import RowStore, build_rows, tokenize_records
from unmask.data.sources import Record, load_records
from unmask.data.synthetic import Example, make_synthetic, make_synthetic_heldout
from unmask.errors import InputError


def split_records(cfg: DataConfig) -> tuple[list[Record], list[Record]]:
    """(train, eval) records; documents are never in both.

    Synthetic: the task set's own held-out split. Otherwise `eval_dataset` when given, else a
    seeded hold-out of `eval_split` documents (a fraction < 1, or a count >= 1).
    """
    if cfg.dataset == "synthetic":
        train, held_out = make_synthetic(cfg)
        return _pair_records(train), _pair_records(held_out)
    train = _load(cfg, cfg.dataset)
    if cfg.eval_dataset is not None:
        return train, _load(cfg, cfg.eval_dataset)
    return _hold_out(train, cfg.eval_split, cfg.seed)


def _load(cfg: DataConfig, path: str) -> list[Record]:
    return load_records(
        path, cfg.dataset_format, cfg.text_field, cfg.prompt_field, cfg.response_field
    )


def _pair_records(examples: list[Example]) -> list[Record]:
    return [{"prompt": p, "response": a} for p, a in examples]


def eval_count(n_docs: int, eval_split: float) -> int:
    """Documents to hold out: a fraction < 1 (at least one when > 0), or a count >= 1."""
    if eval_split <= 0:
        return 0
    if eval_split >= 1:
        return int(eval_split)
    return max(1, round(eval_split * n_docs))


def _hold_out(records: list[Record], eval_split: float, seed: int) -> tuple[list, list]:
    k = eval_count(len(records), eval_split)
    if k >= len(records):
        raise InputError(
            f"data.eval_split={eval_split} holds out {k} of {len(records)} documents, leaving "
            "none to train on; lower data.eval_split or set data.eval_dataset"
        )
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed))
    held = set(order[:k].tolist())
    train = [r for i, r in enumerate(records) if i not in held]
    evals = [r for i, r in enumerate(records) if i in held]
    return train, evals


def build_datasets(cfg: DataConfig, tokenizer) -> tuple[RowStore, RowStore]:
    """(train_rows, eval_rows): every row a dict of (packing_length,) tensors.

    The tokenizer needs an EOS token (call `ensure_special_tokens` first).
    """
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise InputError(
            "the tokenizer has no EOS token; call unmask.data.ensure_special_tokens(tokenizer)"
        )
    train, evals = split_records(cfg)
    return _rows(cfg, tokenizer, train, eos_id), _rows(cfg, tokenizer, evals, eos_id)


def _rows(cfg: DataConfig, tokenizer, records: list[Record], eos_id: int) -> RowStore:
    examples = tokenize_records(records, tokenizer, eos_id, cfg.chat_template)
    return build_rows(examples, cfg.packing_length, eos_id, cfg.packing, cfg.supervise_padding)


def heldout_examples(cfg: DataConfig) -> list[Example]:
    """Held-out (prompt, answer) pairs for generation-based eval (exact match).

    Synthetic: the task set's eval prompts. Other data: the prompt/response pairs of the eval
    split (plain documents have no answer and are left out).
    """
    if cfg.dataset == "synthetic":
        return make_synthetic_heldout(cfg)
    _, evals = split_records(cfg)
    return [(r["prompt"], r["response"]) for r in evals if "prompt" in r]


class BatchLoader:
    """Endless batches of rows: a fresh seeded shuffle each epoch, a disjoint slice per rank.

    A global batch is `batch_size * world_size` rows of the epoch's permutation; rank r takes
    rows [r * batch_size, (r + 1) * batch_size) of it. The permutation of epoch e comes from a
    generator seeded with seed + e, so the order depends only on (seed, epoch, position), and
    `state_dict` / `load_state_dict` resume exactly. Each epoch drops its last partial global
    batch; a dataset smaller than one global batch repeats its permutation to fill one.
    Yields dicts of (batch_size, L) tensors.
    """

    def __init__(
        self, rows: RowStore, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ):
        if len(rows) == 0:
            raise InputError("data: no training rows; give a dataset with at least one document")
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"bad batch_size={batch_size}, rank={rank}, world_size={world_size}")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0
        self._order: torch.Tensor | None = None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

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

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._order is None:
            self._order = self.epoch_order(self.epoch)
        if self.position * self.global_batch_size >= len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self.epoch_order(self.epoch)
        start = self.position * self.global_batch_size + self.rank * self.batch_size
        self.position += 1
        return self.rows.gather(self._order[start : start + self.batch_size])

    def state_dict(self) -> dict[str, int]:
        """Where the next batch comes from: {"epoch", "position"} (global batches done)."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = None


def eval_batches(rows: RowStore, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """All rows in order, `batch_size` at a time (the last batch may be smaller)."""
    for start in range(0, len(rows), batch_size):
        yield rows.gather(torch.arange(start, min(start + batch_size, len(rows))))
