"""Rows: the fixed-length unit every source turns its data into, and the map-style sources
that hold them.

A row is four tensors of length L (`packing_length`):

- `input_ids`    long: token ids.
- `doc_ids`      long: 0, 1, 2, ... per document in the row (attention is block-diagonal on it).
- `position_ids` long: restart at 0 at each document start (and at the row start).
- `maskable`     bool: positions the diffusion loss may mask.

A `RowSource` is map-style: `len(source)` rows, `source.gather(indices)` returns a batch of
them as (n, L) tensors. Two kinds: `RowStore` (rows built in memory from records, see
packing.py) and `TokenStoreRows` (rows cut on demand from a memory-mapped token store, see
indexed.py), whose start-up cost and memory do not grow with the store's size.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

ROW_KEYS = ("input_ids", "doc_ids", "position_ids", "maskable")


class RowSource(Protocol):
    """Map-style rows of one length."""

    row_length: int

    def __len__(self) -> int: ...

    def gather(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows at `indices` as (len(indices), L) tensors."""
        ...


class RowStore:
    """Rows stacked in four (N, L) tensors; `rows[i]` is a dict of (L,) tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        shapes = {t.shape for t in tensors.values()}
        if set(tensors) != set(ROW_KEYS) or len(shapes) != 1:
            raise ValueError(f"a RowStore needs {ROW_KEYS} of one shape, got {shapes}")
        self.tensors = tensors

    def __len__(self) -> int:
        return self.tensors["input_ids"].shape[0]

    @property
    def row_length(self) -> int:
        return self.tensors["input_ids"].shape[1]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.tensors.items()}

    def gather(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows at `indices` as (len(indices), L) tensors."""
        return {k: v[indices] for k, v in self.tensors.items()}


def segment_layout(owner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row doc ids and positions from any per-token segment labels.

    owner: (N, L) labels, equal on consecutive tokens of one segment. Returns (doc_ids,
    position_ids), both (N, L): segments numbered from 0 in each row, positions restarting
    at each segment start and at column 0.
    """
    n, length = owner.shape
    starts = torch.ones_like(owner, dtype=torch.bool)
    starts[:, 1:] = owner[:, 1:] != owner[:, :-1]
    doc_ids = starts.long().cumsum(dim=1) - 1
    cols = torch.arange(length).expand(n, length)
    start_col = torch.where(starts, cols, torch.zeros_like(cols)).cummax(dim=1).values
    return doc_ids, cols - start_col


class TokenStore(Protocol):
    """What `TokenStoreRows` reads of a token store (`unmask.data.indexed.IndexedStore`)."""

    doc_offsets: np.ndarray  # (D + 1,) int64 token offset of each document start, then the end

    def tokens(self, start: int, stop: int) -> np.ndarray: ...


class TokenStoreRows:
    """Rows of a token store's documents [first_doc, last_doc), cut on demand.

    Packed (`packing=True`): the documents' tokens are one stream cut into rows of L; a
    document cut by a row end continues in the next row under a new doc id with positions
    restarting at 0; the last partial row is filled with EOS under its own doc id, not
    maskable. Every stored token is maskable (a store holds plain documents; the EOS a
    preprocess run appends is a stored token). Padded (`packing=False`): one document per
    row, truncated to L, filled with EOS (maskable when supervise_padding).

    Only the store's index is read up front; `gather` reads the rows it returns.
    """

    def __init__(
        self,
        store: TokenStore,
        row_length: int,
        eos_id: int,
        packing: bool = True,
        supervise_padding: bool = True,
        documents: tuple[int, int] | None = None,
    ):
        self.store, self.row_length, self.eos_id = store, row_length, eos_id
        self.packing, self.supervise_padding = packing, supervise_padding
        first, last = documents or (0, len(store.doc_offsets) - 1)
        self.first_doc, self.last_doc = first, last
        self.start = int(store.doc_offsets[first])  # token range of these documents
        self.stop = int(store.doc_offsets[last])

    def __len__(self) -> int:
        if not self.packing:
            return self.last_doc - self.first_doc
        return -(-(self.stop - self.start) // self.row_length)

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    def gather(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows at `indices` as (len(indices), L) tensors."""
        rows = [self._packed(i) if self.packing else self._padded(i) for i in indices.tolist()]
        ids = torch.from_numpy(np.stack([r[0] for r in rows]))
        owner = torch.from_numpy(np.stack([r[1] for r in rows]))
        maskable = torch.from_numpy(np.stack([r[2] for r in rows]))
        doc_ids, position_ids = segment_layout(owner)
        if not self.packing:  # supervised EOS fill belongs to the document; else hidden
            doc_ids = torch.zeros_like(doc_ids) if self.supervise_padding else (owner != 0).long()
            position_ids = torch.arange(self.row_length).expand_as(ids).clone()
        return {"input_ids": ids, "doc_ids": doc_ids, "position_ids": position_ids,
                "maskable": maskable}  # fmt: skip

    def _packed(self, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, document label per token, maskable), each (L,); -1 labels the fill."""
        length = self.row_length
        lo = self.start + row * length
        hi = min(lo + length, self.stop)
        ids = np.full(length, self.eos_id, dtype=np.int64)
        ids[: hi - lo] = self.store.tokens(lo, hi)
        owner = np.full(length, -1, dtype=np.int64)
        positions = np.arange(lo, hi)
        owner[: hi - lo] = np.searchsorted(self.store.doc_offsets, positions, side="right")
        maskable = np.zeros(length, dtype=bool)
        maskable[: hi - lo] = True
        return ids, owner, maskable

    def _padded(self, row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        doc = self.first_doc + row
        lo, hi = int(self.store.doc_offsets[doc]), int(self.store.doc_offsets[doc + 1])
        hi = min(hi, lo + self.row_length)
        ids = np.full(self.row_length, self.eos_id, dtype=np.int64)
        ids[: hi - lo] = self.store.tokens(lo, hi)
        maskable = np.full(self.row_length, self.supervise_padding, dtype=bool)
        maskable[: hi - lo] = True
        owner = np.ones(self.row_length, dtype=np.int64)  # 1 = the fill (see gather)
        owner[: hi - lo] = 0
        return ids, owner, maskable
