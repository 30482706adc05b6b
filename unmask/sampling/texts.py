"""Text in, text out: tokenize prompts, decode them in left-padded batches with `sample`,
cut each answer at its first EOS. Used by `unmask generate` and the lm-eval adapter."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from unmask.errors import InputError
from unmask.sampling.config import SamplingConfig
from unmask.sampling.generate import end_of_turn_id, left_pad, sample


@dataclass
class SamplingModel:
    """A model ready to sample: eval mode on `device`, its tokenizer, special ids, and the
    sampling options its folder carries (`saved`, generation_config.json)."""

    model: nn.Module
    tokenizer: Any
    mask_id: int
    eos_id: int | None
    pad_id: int
    device: torch.device
    saved: dict[str, Any]


def before_eos(ids: list[int], eos_id: int | None) -> list[int]:
    """The answer ids up to (not including) the first EOS."""
    return ids[: ids.index(eos_id)] if eos_id is not None and eos_id in ids else ids


@torch.inference_mode()  # generation only: no graph built or kept, and faster
def generate_texts(
    sm: SamplingModel,
    prompts: list[str],
    config: SamplingConfig,
    batch_size: int = 16,
    generator: torch.Generator | None = None,
    on_step: Callable[[torch.Tensor], None] | None = None,
) -> list[dict[str, Any]]:
    """Generate for each prompt (batched, left-padded); returns one record per prompt, in
    order: prompt, completion (text before the first EOS), tokens, and nfe (model forward
    calls) and seconds of its batch, numbered by `batch`. With config.row_length the prompts are grouped by token length and each group
    gets the canvas that fills a training row (`SamplingConfig.fitted`)."""
    encoded = [sm.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    for text, ids in zip(prompts, encoded):
        if not ids:
            raise InputError(f"prompt {text!r} is empty after tokenization; give some text")
    groups: dict[int, list[int]] = {}
    for index, ids in enumerate(encoded):
        groups.setdefault(len(ids) if config.row_length else 0, []).append(index)
    records: list[dict[str, Any]] = [{} for _ in prompts]
    batch = 0
    for prompt_len, indices in sorted(groups.items()):
        fitted = config.fitted(prompt_len)
        try:
            fitted.check_lengths()
        except ValueError as err:
            raise InputError(str(err)) from None
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            ids, attention_mask = left_pad([encoded[i] for i in chunk], sm.pad_id)
            ids, attention_mask = ids.to(sm.device), attention_mask.to(sm.device)
            if bool(attention_mask.all()):
                attention_mask = None
            out = sample(sm.model, ids, fitted, mask_id=sm.mask_id, eos_id=sm.eos_id,
                         attention_mask=attention_mask, generator=generator, on_step=on_step,
                         pad_id=sm.pad_id, eot_id=end_of_turn_id(sm.tokenizer))  # fmt: skip
            for index, answer in zip(chunk, out.answers.tolist()):
                answer = before_eos(answer, sm.eos_id)
                records[index] = {
                    "prompt": prompts[index],
                    "completion": sm.tokenizer.decode(answer, skip_special_tokens=True),
                    "tokens": len(answer),
                    "nfe": out.nfe,
                    "seconds": round(out.seconds, 4),
                    "batch": batch,
                }
            batch += 1
    return records


def throughput(records: list[dict[str, Any]]) -> str:
    """One line for a finished generate call: prompts, answer tokens, forward calls, wall
    time, tokens/s and tokens per forward (the parallel-decoding gain; 1.0 = one token per
    step per row)."""
    batches = {r["batch"]: r for r in records}
    tokens = sum(r["tokens"] for r in records)
    nfe = sum(r["nfe"] for r in batches.values())
    seconds = sum(r["seconds"] for r in batches.values())
    rows_forward = sum(r["nfe"] * sum(x["batch"] == b for x in records) for b, r in batches.items())
    return (
        f"{len(records)} prompt(s), {tokens} answer tokens, {nfe} forward calls in "
        f"{seconds:.2f}s: {tokens / max(seconds, 1e-9):.1f} tokens/s, "
        f"{tokens / max(rows_forward, 1):.2f} tokens per forward per row"
    )


def unknown_characters(tokenizer, text: str, ids: list[int]) -> str:
    """The characters of `text` the tokenizer maps to its unknown token ('' when none or
    the tokenizer has no unknown token)."""
    unk = tokenizer.unk_token_id
    if unk is None or unk not in ids:
        return ""
    known = tokenizer.decode([i for i in ids if i != unk], skip_special_tokens=False)
    return "".join(sorted({c for c in text if c not in known and not c.isspace()}))
