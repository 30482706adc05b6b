"""Data: sources (files, token stores, streams, blends), tokenizers, rows with document ids,
and the resumable per-rank loaders."""

import importlib

from unmask.data.build import Blend, Datasets, build_datasets, heldout_examples, split_records
from unmask.data.config import DataConfig, SourceConfig
from unmask.data.indexed import IndexedStore, IndexedWriter, check_store_tokenizer
from unmask.data.loader import BatchLoader, MixedLoader, eval_batches, make_loader
from unmask.data.packing import build_rows, tokenize_records
from unmask.data.rows import ROW_KEYS, RowSource, RowStore, TokenStoreRows
from unmask.data.sources import load_records
from unmask.data.streaming import StreamLoader, StreamSpec
from unmask.data.synthetic import answer_for, exact_match, make_synthetic, make_synthetic_heldout

#: the tokenizer's names, imported on first use: it imports transformers, which a module
#: reading only data's light parts (the picture cap of the server's flags) need not load
_TOKENIZER = ("adopt_mask_token", "build_char_tokenizer", "build_tokenizer",
              "ensure_special_tokens", "mask_token_id")  # fmt: skip


def __getattr__(name: str):
    if name not in _TOKENIZER:
        raise AttributeError(f"module 'unmask.data' has no attribute {name!r}")
    return getattr(importlib.import_module("unmask.data.tokenizer"), name)


__all__ = [
    "ROW_KEYS",
    "BatchLoader",
    "Blend",
    "DataConfig",
    "Datasets",
    "IndexedStore",
    "IndexedWriter",
    "MixedLoader",
    "RowSource",
    "RowStore",
    "SourceConfig",
    "StreamLoader",
    "StreamSpec",
    "TokenStoreRows",
    "adopt_mask_token",
    "answer_for",
    "build_char_tokenizer",
    "build_datasets",
    "build_rows",
    "build_tokenizer",
    "check_store_tokenizer",
    "ensure_special_tokens",
    "eval_batches",
    "exact_match",
    "heldout_examples",
    "load_records",
    "make_loader",
    "make_synthetic",
    "make_synthetic_heldout",
    "mask_token_id",
    "split_records",
    "tokenize_records",
]
