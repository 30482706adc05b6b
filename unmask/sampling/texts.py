"""Text in, text out: tokenize prompts, decode them in left-padded batches with `sample`,
cut each answer at its first EOS. Used by `unmask generate` and the lm-eval adapter."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from unmask.errors import InputError
from unmask.sampling.config import SamplingConfig
from unmask.sampling.decoders import edits_tokens
from unmask.sampling.generate import end_of_turn_id, left_pad, sample
from unmask.sampling.images import PromptImages, with_prefix


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
    #: diffusion.edit_fraction of the run that made the folder (run_origin.py; None: unknown)
    trained_edit_fraction: float | None = None
    #: the model folder it was read from (its image processor: sampling/images.py)
    folder: Any = None


class RowEdits:
    """on_step wrapper counting each row's edits in one batch: positions that held a token
    (not a mask) at the previous step and hold another now. For joint_threshold these are
    its T2T edits, so the rows' counts add up to the batch's GenerationOutput.edits."""

    def __init__(self, rows: int, mask_id: int, on_step: Callable | None = None):
        self.counts = [0] * rows
        self.mask_id, self.on_step = mask_id, on_step
        self.previous: torch.Tensor | None = None

    def __call__(self, canvas: torch.Tensor) -> None:
        if self.previous is not None and self.previous.shape == canvas.shape:
            changed = (self.previous != self.mask_id) & (canvas != self.previous)
            for row, count in enumerate(changed.sum(1).tolist()):
                self.counts[row] += count
        self.previous = canvas
        if self.on_step is not None:
            self.on_step(canvas)


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
    on_batch: Callable[[list[int]], None] | None = None,
    pictures: PromptImages | None = None,
) -> list[dict[str, Any]]:
    """Generate for each prompt (batched, left-padded); returns one record per prompt, in
    order: prompt, completion (text before the first EOS), tokens, and nfe (model forward
    calls) and seconds of its batch, numbered by `batch`; with a decoder that edits tokens
    (joint_threshold), `edits`: the tokens of this prompt's answer the decoder replaced.
    With config.row_length the prompts are grouped by token length and each group gets the
    canvas that fills a training row (`SamplingConfig.fitted`). on_batch is called with
    the indices of each batch's prompts before it is decoded (on_step then gets its
    canvases: `--show` starts a new animation). pictures: every prompt's images
    (sampling/images.py: their tokens go before the prompt's)."""
    encoded = [sm.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    for text, ids in zip(prompts, encoded):
        if not ids:
            raise InputError(f"prompt {text!r} is empty after tokenization; give some text")
    encoded = [with_prefix(ids, pictures) for ids in encoded]
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
            if on_batch is not None:
                on_batch(chunk)
            counted = RowEdits(len(chunk), sm.mask_id, on_step) if edits_tokens(fitted) else None
            images = None if pictures is None else pictures.for_rows(len(chunk)).to(sm.device)
            out = sample(sm.model, ids, fitted, mask_id=sm.mask_id, eos_id=sm.eos_id,
                         attention_mask=attention_mask, generator=generator,
                         on_step=counted or on_step, pad_id=sm.pad_id,
                         eot_id=end_of_turn_id(sm.tokenizer), images=images)  # fmt: skip
            for row, (index, answer) in enumerate(zip(chunk, out.answers.tolist())):
                answer = before_eos(answer, sm.eos_id)
                records[index] = {
                    "prompt": prompts[index],
                    "completion": sm.tokenizer.decode(answer, skip_special_tokens=True),
                    "tokens": len(answer),
                    "nfe": out.nfe,
                    "seconds": round(out.seconds, 4),
                    "batch": batch,
                }
                if counted is not None:
                    records[index]["edits"] = counted.counts[row]
            batch += 1
    return records


def throughput(records: list[dict[str, Any]]) -> str:
    """One line for a finished generate call: prompts, answer tokens, forward calls, wall
    time, tokens/s and tokens per forward (the parallel-decoding gain; 1.0 = one token per
    step per row), and with a decoder that edits tokens the edits made."""
    batches = {r["batch"]: r for r in records}
    tokens = sum(r["tokens"] for r in records)
    nfe = sum(r["nfe"] for r in batches.values())
    seconds = sum(r["seconds"] for r in batches.values())
    rows_forward = sum(r["nfe"] * sum(x["batch"] == b for x in records) for b, r in batches.items())
    line = (
        f"{len(records)} prompt(s), {tokens} answer tokens, {nfe} forward calls in "
        f"{seconds:.2f}s: {tokens / max(seconds, 1e-9):.1f} tokens/s, "
        f"{tokens / max(rows_forward, 1):.2f} tokens per forward per row"
    )
    if any("edits" in r for r in records):
        line += f", {sum(r.get('edits', 0) for r in records)} token edits"
    return line


def unknown_characters(tokenizer, text: str, ids: list[int]) -> str:
    """The characters of `text` the tokenizer maps to its unknown token ('' when none or
    the tokenizer has no unknown token)."""
    unk = tokenizer.unk_token_id
    if unk is None or unk not in ids:
        return ""
    known = tokenizer.decode([i for i in ids if i != unk], skip_special_tokens=False)
    return "".join(sorted({c for c in text if c not in known and not c.isspace()}))
