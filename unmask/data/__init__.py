"""Data: sources, tokenizers, token stores, packed rows with document ids, and the resumable
loader."""

from unmask.data.config import DataConfig
from unmask.data.indexed import IndexedStore, IndexedWriter, check_store_tokenizer
from unmask.data.loader import (
    BatchLoader,
    build_datasets,
    eval_batches,
    heldout_examples,
    split_records,
)
from unmask.data.packing import ROW_KEYS, RowStore, build_rows, tokenize_records
from unmask.data.sources import load_records
from unmask.data.synthetic import answer_for, exact_match, make_synthetic, make_synthetic_heldout
from unmask.data.tokenizer import (
    adopt_mask_token,
    build_char_tokenizer,
    build_tokenizer,
    ensure_special_tokens,
    mask_token_id,
)

__all__ = [
    "ROW_KEYS",
    "BatchLoader",
    "DataConfig",
    "IndexedStore",
    "IndexedWriter",
    "RowStore",
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
    "make_synthetic",
    "make_synthetic_heldout",
    "mask_token_id",
    "split_records",
    "tokenize_records",
]
