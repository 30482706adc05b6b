"""Fixed-length rows (rows.py) from tokenized examples, built in memory.

An example is a document (all tokens maskable) or a prompt/answer pair (prompt kept clean:
not maskable; answer and its EOS maskable); every example ends with EOS.

Packed mode concatenates examples and cuts the stream into rows; a document cut by a row end
continues in the next row under a new doc id with positions restarting at 0. The final partial
row is filled with EOS under its own doc id, not maskable.

Padded mode puts one example per row, truncated to L, then fills the row with EOS. With
`supervise_padding` (pad_policy eos) the fill keeps the example's doc id, so the answer
attends to its EOS tail, and is maskable (LLaDA SFT). Without it (pad_policy single_eos)
the fill is neither maskable nor visible: it gets doc id 1, so the example never attends
to it, as after an answer's EOS in packed rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from unmask.data.rows import RowStore, segment_layout
from unmask.data.sft import format_pair
from unmask.data.sources import Record


@dataclass
class TokenizedExample:
    """Token ids of one example, EOS included, and which of them the loss may mask."""

    ids: list[int]
    maskable: list[bool]


def tokenize_records(
    records: Sequence[Record], tokenizer, eos_id: int, chat_template: bool = True
) -> list[TokenizedExample]:
    """Records to token ids with EOS appended; prompts (if any) are not maskable.

    Prompt and answer are tokenized separately so the clean/maskable border is exact. Chat
    `messages` records, and pairs when the tokenizer has a chat template and `chat_template`
    is true, are formatted by data/sft.py first.
    """
    is_pair = [("prompt" in r or "messages" in r) for r in records]
    pairs = [format_pair(tokenizer, r, chat_template) for r, p in zip(records, is_pair) if p]
    docs = [r for r, p in zip(records, is_pair) if not p]
    enc = _encode_many(tokenizer, [p for p, _ in pairs] + [a for _, a in pairs])
    prompts, answers = enc[: len(pairs)], enc[len(pairs) :]
    doc_ids = iter(_encode_many(tokenizer, [r["text"] for r in docs]))
    pair_ids = iter(zip(prompts, answers))
    out = []
    for pair in is_pair:
        if pair:
            prompt, answer = next(pair_ids)
            ids = prompt + answer + [eos_id]
            out.append(
                TokenizedExample(ids, [False] * len(prompt) + [True] * (len(ids) - len(prompt)))
            )
        else:
            ids = next(doc_ids) + [eos_id]
            out.append(TokenizedExample(ids, [True] * len(ids)))
    return out


def _encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids without BOS/EOS; the Rust tokenizer directly (the Python wrapper is ~3x slower)."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=False)]


def _flatten(
    examples: Sequence[TokenizedExample],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenated (ids, maskable, example index), each (T,)."""
    ids = torch.tensor([t for e in examples for t in e.ids], dtype=torch.long)
    maskable = torch.tensor([m for e in examples for m in e.maskable], dtype=torch.bool)
    lengths = torch.tensor([len(e.ids) for e in examples], dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(examples)), lengths)
    return ids, maskable, owner


def pack_examples(examples: Sequence[TokenizedExample], length: int, eos_id: int) -> RowStore:
    """Packed mode: one token stream cut into rows of `length` (see the module docstring)."""
    ids, maskable, owner = _flatten(examples)
    fill = (-ids.numel()) % length
    ids = torch.cat([ids, torch.full((fill,), eos_id, dtype=torch.long)])
    maskable = torch.cat([maskable, torch.zeros(fill, dtype=torch.bool)])
    owner = torch.cat([owner, torch.full((fill,), -1, dtype=torch.long)])
    owner = owner.view(-1, length)
    doc_ids, position_ids = segment_layout(owner)
    return RowStore(
        {
            "input_ids": ids.view(-1, length),
            "doc_ids": doc_ids,
            "position_ids": position_ids,
            "maskable": maskable.view(-1, length),
        }
    )


def pad_examples(
    examples: Sequence[TokenizedExample], length: int, eos_id: int, supervise_padding: bool
) -> RowStore:
    """Padded mode: one example per row, truncated to `length`, filled with EOS."""
    n = len(examples)
    input_ids = torch.full((n, length), eos_id, dtype=torch.long)
    maskable = torch.full((n, length), supervise_padding, dtype=torch.bool)
    kept = [min(len(e.ids), length) for e in examples]
    kept_t = torch.tensor(kept, dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(n), kept_t)
    starts = kept_t.cumsum(0) - kept_t  # offset of each example in the flat stream
    cols = torch.arange(rows.numel()) - torch.repeat_interleave(starts, kept_t)
    flat_ids = [t for e, k in zip(examples, kept) for t in e.ids[:k]]
    input_ids[rows, cols] = torch.tensor(flat_ids, dtype=torch.long)
    flat_mask = [m for e, k in zip(examples, kept) for m in e.maskable[:k]]
    maskable[rows, cols] = torch.tensor(flat_mask, dtype=torch.bool)
    doc_ids = torch.zeros((n, length), dtype=torch.long)
    if not supervise_padding:  # unsupervised padding: hidden from the example (pad_policy)
        doc_ids[torch.arange(length)[None, :] >= kept_t[:, None]] = 1
    return RowStore(
        {
            "input_ids": input_ids,
            "doc_ids": doc_ids,
            "position_ids": torch.arange(length).expand(n, length).clone(),
            "maskable": maskable,
        }
    )


def build_rows(
    examples: Sequence[TokenizedExample],
    length: int,
    eos_id: int,
    packing: bool,
    supervise_padding: bool,
) -> RowStore:
    """Packed or padded rows, as the config asks."""
    if packing:
        return pack_examples(examples, length, eos_id)
    return pad_examples(examples, length, eos_id, supervise_padding)
