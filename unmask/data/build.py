"""From the `data:` config to row sources: the training rows (one source or a blend), the
held-out eval rows, and the held-out prompt/answer pairs for generation.

In-memory sources (synthetic tasks, text / jsonl / parquet / save_to_disk files) are read,
tokenized and cut into rows at start-up. Token stores (PREFIX.bin + PREFIX.idx) are opened
memory-mapped: start-up reads the index only, rows are cut when a batch asks for them.
A document is never in both train and eval.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from unmask.data.config import DataConfig, SourceConfig
from unmask.data.images import (
    FolderVision,
    has_tower,
    picture_record,
    picture_row,
    picture_rows,
)
from unmask.data.indexed import IndexedStore, check_store_tokenizer
from unmask.data.packing import build_rows, tokenize_records
from unmask.data.rows import RowSource, TokenStoreRows
from unmask.data.sources import Record, read_rows, records_of, to_record
from unmask.data.streaming import (
    StreamSpec,
    first_records,
    open_stream,
    record_key,
    refuse_pictures,
)
from unmask.data.synthetic import Example, make_synthetic, make_synthetic_heldout
from unmask.errors import InputError


@dataclass
class Blend:
    """Several training sources drawn with weights (`data.sources`); its length is the sum
    of theirs (what one epoch means for num_train_epochs)."""

    sources: list[RowSource]
    weights: list[float]

    def __len__(self) -> int:
        return sum(len(s) for s in self.sources)


@dataclass
class Datasets:
    """What a run trains and evaluates on, and notices to print at start-up."""

    train: RowSource | Blend | StreamSpec
    eval: RowSource
    notices: list[str] = field(default_factory=list)


def token_store_prefix(path: str, dataset_format: str = "auto") -> str | None:
    """The store prefix `path` names (PREFIX, PREFIX.bin or PREFIX.idx), or None when it is
    not a token store."""
    prefix = path.removesuffix(".bin").removesuffix(".idx")
    exists = Path(prefix + ".idx").is_file() or Path(prefix + ".bin").is_file()
    if dataset_format == "indexed" or (dataset_format == "auto" and exists):
        return prefix
    return None


def build_datasets(cfg: DataConfig, tokenizer, saved_tokenizer=None,
                   model_folder: str | None = None) -> Datasets:  # fmt: skip
    """Training rows (a RowSource, a Blend for data.sources, a StreamSpec for
    data.streaming), eval rows and notices. Rows with pictures (data/images.py) go through
    `model_folder`'s image processor (the model's folder; None: a model without a vision
    tower, which refuses them).

    The tokenizer needs an EOS token (call `ensure_special_tokens` first); token stores are
    checked against `saved_tokenizer`, the tokenizer as loaded before tokens were added to it
    (default: the tokenizer).
    """
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise InputError(
            "the tokenizer has no EOS token; call unmask.data.ensure_special_tokens(tokenizer)"
        )
    tower = has_tower(model_folder)  # an image column is read as pictures only with one
    if cfg.streaming:
        return _streaming(cfg, tokenizer, eos_id, tower)
    check = _StoreCheck(saved_tokenizer or tokenizer)
    if not cfg.sources:
        source = SourceConfig(path=cfg.dataset, dataset_format=cfg.dataset_format)
        return _one_source(cfg, source, tokenizer, eos_id, cfg.eval_dataset, check,
                           vision=model_folder, tower=tower)  # fmt: skip
    parts = [_one_source(cfg, s, tokenizer, eos_id, None, check, tower=tower)
             for s in cfg.sources]  # fmt: skip
    evals = _concatenated([p.eval for p in parts])
    if cfg.eval_dataset is not None:
        eval_source = SourceConfig(path=cfg.eval_dataset)
        evals = _one_source(cfg, eval_source, tokenizer, eos_id, None, check, True,
                            tower=tower).eval  # fmt: skip
    blend = Blend([p.train for p in parts], [s.weight for s in cfg.sources])
    return Datasets(blend, evals, [n for p in parts for n in p.notices])


class _StoreCheck:
    """Checks each token store against the saved tokenizer (once per store)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, store: IndexedStore) -> list[str]:
        notice = check_store_tokenizer(store, self.tokenizer)
        return [notice] if notice else []


def _one_source(
    cfg: DataConfig, source: SourceConfig, tokenizer, eos_id: int, eval_path: str | None,
    check: _StoreCheck, eval_only: bool = False, vision: str | None | bool = False,
    tower: bool = False,
) -> Datasets:  # fmt: skip
    """`vision`: the model folder for rows with pictures (None: no tower; False: a blend or
    a separate eval source, which take no pictures); `tower`: the model has a vision tower
    (images.py picture_row)."""
    prefix = token_store_prefix(source.path, source.dataset_format)
    if prefix is not None:
        return _token_store(cfg, prefix, tokenizer, eos_id, eval_path, check, eval_only)
    train, evals = _split_records(cfg, source, eval_path, tower)
    if eval_only:
        train, evals = [], train
    return Datasets(_rows(cfg, tokenizer, train, eos_id, vision),
                    _rows(cfg, tokenizer, evals, eos_id, vision))  # fmt: skip


def _token_store(
    cfg: DataConfig, prefix: str, tokenizer, eos_id: int, eval_path: str | None,
    check: _StoreCheck, eval_only: bool,
) -> Datasets:  # fmt: skip
    store = IndexedStore(prefix)
    notices = check(store)

    def rows(first: int, last: int) -> TokenStoreRows:
        return TokenStoreRows(store, cfg.packing_length, eos_id, cfg.packing,
                              cfg.supervise_padding, (first, last))  # fmt: skip

    n = store.num_documents
    if eval_only:
        return Datasets(rows(0, 0), rows(0, n), notices)
    if eval_path is not None:
        evals = _one_source(cfg, SourceConfig(path=eval_path), tokenizer, eos_id, None, check,
                            True)  # fmt: skip
        return Datasets(rows(0, n), evals.eval, notices + evals.notices)
    # the last k documents are held out: one contiguous token range, O(1) memory
    k = _held_out_count(n, cfg.eval_split, prefix)
    return Datasets(rows(0, n - k), rows(n - k, n), notices)


def _streaming(cfg: DataConfig, tokenizer, eos_id: int, tower: bool = False) -> Datasets:
    """A StreamSpec for the training rows; eval rows from eval_dataset, or the first
    documents of each stream (skipped by the training stream). A row with pictures
    (images.py picture_row) is refused in one line: in the first rows of a local file at
    start-up, in the hold-out, and wherever the training stream meets one."""
    pictures = (cfg.image_field, tower)
    sources = cfg.sources or [SourceConfig(path=cfg.dataset, dataset_format=cfg.dataset_format)]
    for source in sources:
        if source.path == "synthetic" or token_store_prefix(source.path, source.dataset_format):
            raise InputError(
                f"data.streaming reads jsonl / parquet / text files or a hub id, not "
                f"{source.path!r}; set data.streaming: false for it"
            )
        if Path(source.path).expanduser().exists():  # a hub id is not opened for this
            for index, row in enumerate(open_stream(source.path, source.dataset_format).take(8)):
                refuse_pictures(row, f"{source.path!r} row {index}", pictures)
    fields = {"prompt_field": cfg.prompt_field, "response_field": cfg.response_field}
    held = 0 if cfg.eval_dataset is not None else stream_eval_count(cfg.eval_split)
    held_records: list[Record] = []
    for source in sources:
        text_field = source.text_field or cfg.text_field
        if held:
            held_records += first_records(source.path, source.dataset_format, held,
                                          {**fields, "text_field": text_field},
                                          pictures)  # fmt: skip
    if cfg.eval_dataset is not None:
        evals = _one_source(cfg, SourceConfig(path=cfg.eval_dataset), tokenizer, eos_id, None,
                            _StoreCheck(tokenizer), True).eval  # fmt: skip
    else:
        evals = _rows(cfg, tokenizer, held_records, eos_id)
    spec = StreamSpec(
        sources=[(s.path, s.dataset_format, s.text_field or cfg.text_field) for s in sources],
        weights=[s.weight for s in sources],
        held_out=frozenset(record_key(r) for r in held_records), tokenizer=tokenizer,
        fields=fields, row_length=cfg.packing_length, eos_id=eos_id, packing=cfg.packing,
        supervise_padding=cfg.supervise_padding, chat_template=cfg.chat_template, seed=cfg.seed,
        pictures=pictures,
    )  # fmt: skip
    return Datasets(spec, evals)


def stream_eval_count(eval_split: float) -> int:
    """Documents held out at the start of a stream (its length is unknown): a count as it
    is, a fraction means 100, 0 none."""
    if eval_split <= 0:
        return 0
    return int(eval_split) if eval_split >= 1 else 100


def _concatenated(sources: list[RowSource]) -> RowSource:
    """One eval source over several (rows in order)."""
    return _Chain(sources) if len(sources) > 1 else sources[0]


class _Chain:
    def __init__(self, sources: list[RowSource]):
        self.sources = sources
        self.row_length = sources[0].row_length
        self.starts = torch.tensor([0] + [len(s) for s in sources]).cumsum(0)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def gather(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        owner = torch.searchsorted(self.starts, indices, right=True) - 1
        parts = [self.sources[int(s)].gather(indices[owner == s] - self.starts[s])
                 for s in owner.unique()]  # fmt: skip
        order = torch.cat([(owner == s).nonzero().squeeze(1) for s in owner.unique()]).argsort()
        return {k: torch.cat([p[k] for p in parts])[order] for k in parts[0]}


def _split_records(
    cfg: DataConfig, source: SourceConfig, eval_path: str | None, tower: bool = False
) -> tuple[list[Record], list[Record]]:
    if source.path == "synthetic":
        train, held_out = make_synthetic(cfg)
        return _pair_records(train), _pair_records(held_out)
    text_field = source.text_field or cfg.text_field
    train = _load(cfg, source.path, source.dataset_format, text_field, tower)
    if eval_path is not None:
        return train, _load(cfg, eval_path, "auto", text_field, tower)
    return _hold_out(train, cfg.eval_split, cfg.seed)


def split_records(cfg: DataConfig) -> tuple[list[Record], list[Record]]:
    """(train, eval) records of `data.dataset`; documents are never in both.

    Synthetic: the task set's own held-out split. Otherwise `eval_dataset` when given, else a
    seeded hold-out of `eval_split` documents (a fraction < 1, or a count >= 1).
    """
    source = SourceConfig(path=cfg.dataset, dataset_format=cfg.dataset_format)
    return _split_records(cfg, source, cfg.eval_dataset)


def _load(cfg: DataConfig, path: str, dataset_format: str, text_field: str,
          tower: bool = False) -> list[Record]:  # fmt: skip
    rows = read_rows(path, dataset_format)
    if not any(picture_row(row, cfg.image_field, tower) for row in rows):
        return records_of(rows, path, text_field, cfg.prompt_field, cfg.response_field)
    source = Path(path).expanduser()
    folder = Path(cfg.image_folder).expanduser() if cfg.image_folder else (
        source if source.is_dir() else source.parent)  # fmt: skip
    out = []
    for index, row in enumerate(rows):
        where = f"{path!r} row {index}"
        if picture_row(row, cfg.image_field, tower):
            out.append(picture_record(row, where, cfg.image_field, folder, cfg.prompt_field,
                                      cfg.response_field))  # fmt: skip
        else:
            record = to_record(row, where, text_field, cfg.prompt_field, cfg.response_field)
            out += [] if record is None else [record]
    return out


def _pair_records(examples: list[Example]) -> list[Record]:
    return [{"prompt": p, "response": a} for p, a in examples]


def eval_count(n_docs: int, eval_split: float) -> int:
    """Documents to hold out: a fraction < 1 (at least one when > 0), or a count >= 1."""
    if eval_split <= 0:
        return 0
    if eval_split >= 1:
        return int(eval_split)
    return max(1, round(eval_split * n_docs))


def _held_out_count(n_docs: int, eval_split: float, where: str) -> int:
    k = eval_count(n_docs, eval_split)
    if k >= n_docs:
        raise InputError(
            f"data.eval_split={eval_split} holds out {k} of {n_docs} documents of {where!r}, "
            "leaving none to train on; lower data.eval_split or set data.eval_dataset"
        )
    return k


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


def _rows(cfg: DataConfig, tokenizer, records: list[Record], eos_id: int,
          vision: str | None | bool = False) -> RowSource:  # fmt: skip
    """Rows of records; PictureRows (data/images.py) when some hold pictures."""
    if any("images" in r for r in records):
        where = f"data.dataset {cfg.dataset!r}"
        if vision is False:
            raise InputError(f"data: pictures are read from one data.dataset (with its held-out "
                             f"rows), not from data.sources or data.eval_dataset; {where}")  # fmt: skip
        if cfg.packing:
            raise InputError("data: rows with pictures are one example per row: set "
                             "data.packing: false (data.pad_policy eos or single_eos)")  # fmt: skip
        folder = FolderVision(vision, where)
        return picture_rows(records, tokenizer, eos_id, cfg.chat_template, folder,
                            cfg.packing_length, cfg.supervise_padding)  # fmt: skip
    examples = tokenize_records(records, tokenizer, eos_id, cfg.chat_template)
    return build_rows(examples, cfg.packing_length, eos_id, cfg.packing, cfg.supervise_padding)


def heldout_examples(cfg: DataConfig) -> list[Example]:
    """Held-out (prompt, answer) pairs for generation-based eval (exact match).

    Synthetic: the task set's eval prompts. Other data: the prompt/response pairs of the eval
    split (plain documents have no answer and are left out; so are token stores).
    """
    if cfg.dataset == "synthetic" and not cfg.sources:
        return make_synthetic_heldout(cfg)
    if cfg.sources or cfg.streaming:
        return []
    if token_store_prefix(cfg.dataset, cfg.dataset_format) is not None:
        return []
    _, evals = split_records(cfg)
    return [(r["prompt"], r["response"]) for r in evals if "prompt" in r and "images" not in r]
