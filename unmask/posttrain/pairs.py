"""Preference pairs: `prompt` / `chosen` / `rejected` records read, tokenized and padded
into two aligned row stores (the chosen and the rejected completion of each pair).

Accepted rows (jsonl / json / parquet / a save_to_disk folder, data.dataset):

- `{"prompt": str, "chosen": str, "rejected": str}`: formatted like SFT prompt/response
  pairs (the tokenizer's chat template when it has one and data.chat_template is true);
- `chosen` / `rejected` as chat message lists: the conversation ending in the assistant's
  answer (a `prompt` message list, or string as a user turn, is put in front when given).

`data.dataset: synthetic` makes pairs from the built-in tasks: the right answer is chosen,
a wrong one (one character of it changed) rejected.

Rows are one completion per row (padded, never packed), prompt not maskable, the answer,
its EOS and (data.supervise_padding) the EOS fill maskable, as SFT rows are. A pair source
is a map-style row source like the others, so the loaders shard and resume it unchanged;
a batch holds the chosen rows under the usual keys and the rejected rows under the same
keys prefixed `rejected_`.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from unmask.data import DataConfig, RowStore, make_synthetic, make_synthetic_heldout
from unmask.data.build import Datasets, _hold_out
from unmask.data.packing import pad_examples, tokenize_records
from unmask.data.sft import check_messages, format_pair
from unmask.data.sources import read_rows
from unmask.errors import InputError

PAIR_KEYS = ("chosen", "rejected")
PairRecord = dict[str, dict]  # {"chosen": SFT record, "rejected": SFT record}


class PairRows:
    """Pairs as two row stores of one length: `gather` returns the chosen rows' four
    tensors and the rejected rows' under `rejected_` names, (n, L) each."""

    def __init__(self, chosen: RowStore, rejected: RowStore):
        if len(chosen) != len(rejected):
            raise ValueError("chosen and rejected rows differ in number")
        self.chosen, self.rejected = chosen, rejected
        self.row_length = chosen.row_length

    def __len__(self) -> int:
        return len(self.chosen)

    def gather(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        rejected = {f"rejected_{k}": v for k, v in self.rejected.gather(indices).items()}
        return {**self.chosen.gather(indices), **rejected}


def pair_record(row: dict[str, Any], where: str, number: int) -> PairRecord:
    """One data row as a pair of SFT records (module docstring); a row without `chosen` or
    `rejected` is refused naming the file, the row and the key."""
    for key in PAIR_KEYS:
        if row.get(key) is None:
            raise InputError(
                f"data: {where}: row {number} has no {key!r} (keys: "
                f"{', '.join(map(str, row)) or 'none'}); preference pairs need 'prompt', "
                "'chosen' and 'rejected'"
            )
    prompt = row.get("prompt")
    return {key: _completion(prompt, row[key], where, number, key) for key in PAIR_KEYS}


def _completion(prompt: Any, answer: Any, where: str, number: int, key: str) -> dict:
    """An SFT record (prompt/response or messages) for one completion of a pair."""
    place = f"{where}: row {number} {key!r}"
    if isinstance(answer, list):  # a chat conversation (or the assistant turn alone)
        before = _prompt_turns(prompt, place)
        return {"messages": check_messages(before + answer, place)}
    if isinstance(prompt, list):
        turns = check_messages([*prompt, {"role": "assistant", "content": str(answer)}], place)
        return {"messages": turns}
    if prompt is None:
        raise InputError(
            f"data: {where}: row {number} has no 'prompt' (keys: chosen, rejected, ...); "
            "give 'prompt', or 'chosen' and 'rejected' as chat message lists"
        )
    return {"prompt": str(prompt), "response": str(answer)}


def _prompt_turns(prompt: Any, place: str) -> list[dict]:
    if prompt is None:
        return []
    if isinstance(prompt, list):
        return list(prompt)
    return [{"role": "user", "content": str(prompt)}]


def load_pairs(path: str, dataset_format: str = "auto") -> list[PairRecord]:
    """Every pair of a local dataset, in file order (at least one)."""
    rows = read_rows(path, dataset_format)
    pairs = [pair_record(row, repr(str(path)), i) for i, row in enumerate(rows, 1)]
    if not pairs:
        raise InputError(f"data: {str(path)!r} holds no preference pairs; give at least one")
    return pairs


def wrong_answer(answer: str, rng: random.Random) -> str:
    """The answer with one character changed (a digit to another digit): a rejected
    completion for a synthetic task."""
    pos = rng.randrange(len(answer)) if answer else 0
    if not answer:
        return "0"
    old = answer[pos]
    pool = "0123456789" if old.isdigit() else "abcdefghij"
    new = rng.choice([c for c in pool if c != old])
    return answer[:pos] + new + answer[pos + 1 :]


def synthetic_pairs(examples: list[tuple[str, str]], seed: int) -> list[PairRecord]:
    rng = random.Random(seed)
    return [{"chosen": {"prompt": p, "response": a},
             "rejected": {"prompt": p, "response": wrong_answer(a, rng)}}
            for p, a in examples]  # fmt: skip


def split_pairs(cfg: DataConfig) -> tuple[list[PairRecord], list[PairRecord]]:
    """(train, eval) pairs of data.dataset: the synthetic tasks' own split, else
    data.eval_dataset or a seeded hold-out of data.eval_split pairs."""
    if cfg.sources or cfg.streaming:
        raise InputError(
            "diffusion.objective: preference reads its pairs from data.dataset (jsonl, json, "
            "parquet or a save_to_disk folder), not data.sources or data.streaming"
        )
    if cfg.dataset == "synthetic":
        train, held_out = make_synthetic(cfg)
        return synthetic_pairs(train, cfg.seed), synthetic_pairs(held_out, cfg.seed + 1)
    train = load_pairs(cfg.dataset, cfg.dataset_format)
    if cfg.eval_dataset is not None:
        return train, load_pairs(cfg.eval_dataset)
    return _hold_out(train, cfg.eval_split, cfg.seed)


def pair_rows(cfg: DataConfig, tokenizer, pairs: list[PairRecord]) -> PairRows:
    """Padded rows of the chosen and of the rejected completions (the SFT tokenization)."""
    eos_id = tokenizer.eos_token_id
    stores = []
    for key in PAIR_KEYS:
        examples = tokenize_records([p[key] for p in pairs], tokenizer, eos_id,
                                    cfg.chat_template)  # fmt: skip
        stores.append(pad_examples(examples, cfg.packing_length, eos_id, cfg.supervise_padding))
    return PairRows(*stores)


def build_pair_datasets(cfg: DataConfig, tokenizer) -> Datasets:
    """Training and eval pairs as row sources (what `build_datasets` is for other data)."""
    if tokenizer.eos_token_id is None:
        raise InputError("the tokenizer has no EOS token; preference rows end with one")
    train, evals = split_pairs(cfg)
    return Datasets(pair_rows(cfg, tokenizer, train), pair_rows(cfg, tokenizer, evals))


def heldout_pair_examples(cfg: DataConfig, tokenizer) -> list[tuple[str, str]]:
    """Held-out (prompt, chosen answer) texts for generation-based exact match."""
    if cfg.dataset == "synthetic":
        return make_synthetic_heldout(cfg)
    _, evals = split_pairs(cfg)
    return [format_pair(tokenizer, p["chosen"], cfg.chat_template) for p in evals]
