"""`unmask generate --show`: the canvas after every denoising step, masked positions drawn
as a shaded block and EOS as a middle dot, so the answer visibly fills in and where it
ends shows. A decoder that edits tokens it committed (joint_threshold) shows it: the step
line counts the tokens the step replaced and those replaced so far, and on a terminal
the replaced tokens are underlined. On a terminal each frame redraws the last in place;
elsewhere (a file, a pipe, CI logs) frames are written one after another as plain lines,
with no escape codes."""

import sys
import time
from typing import TextIO

import torch

MASK_GLYPH = "\u2591"  # light shade
EOS_GLYPH = "\u00b7"  # middle dot
UNDERLINE, PLAIN = "\x1b[4m", "\x1b[24m"  # an edited token, on a terminal


def render_row(tokenizer, row: list[int], mask_id: int, skip_ids: set[int],
               eos_id: int | None = None, marked: set[int] = frozenset()) -> str:  # fmt: skip
    """Text of one canvas row: tokens decoded one by one, masks as MASK_GLYPH, EOS as
    EOS_GLYPH, skip_ids (left padding) left out; the tokens at positions `marked` (indices
    into row) underlined."""
    pieces = []
    for at, token in enumerate(row):
        if token == mask_id:
            piece = MASK_GLYPH
        elif token == eos_id:
            piece = EOS_GLYPH
        elif token not in skip_ids:
            piece = tokenizer.decode([token])
        else:
            continue
        pieces.append(f"{UNDERLINE}{piece}{PLAIN}" if at in marked else piece)
    return "".join(pieces)


def edited(before: torch.Tensor | None, after: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Bool, after's shape: positions that held a token (not a mask) in `before` and hold
    another in `after` (all False without a `before` of the same shape)."""
    if before is None or before.shape != after.shape:
        return torch.zeros(after.shape, dtype=torch.bool)
    return (before != mask_id) & (after != before)


class TerminalAnimation:
    """on_step callback for `sample`. The left padding of a batch's shorter prompts (pad_id
    or EOS ids before the prompt) is left out; everything after is drawn."""

    def __init__(self, tokenizer, mask_id: int, pad_id: int | None, eos_id: int | None,
                 stream: TextIO | None = None, delay: float = 0.05):  # fmt: skip
        self.tokenizer, self.mask_id, self.eos_id = tokenizer, mask_id, eos_id
        self.padding = {i for i in (pad_id, eos_id) if i is not None}
        self.stream = stream or sys.stderr
        self.in_place = self.stream.isatty()
        self.delay = delay if self.in_place else 0.0
        self.lines = 0
        self.step = 0
        self.previous: torch.Tensor | None = None
        self.edits = 0  # tokens replaced by others so far

    def __call__(self, canvas: torch.Tensor) -> None:
        self.step += 1
        changed = edited(self.previous, canvas.cpu(), self.mask_id)
        self.previous = canvas.cpu().clone()
        count = int(changed.sum())
        self.edits += count
        title = f"step {self.step}"
        if self.edits:  # a decoder that edits (joint_threshold)
            title += f" ({count} edited, {self.edits} so far)"
        text = [title] + [
            self._row(row, changed[b]) for b, row in enumerate(canvas.tolist())
        ]  # fmt: skip
        if not self.in_place:
            self.stream.write("".join(line + "\n" for line in text))
            self.stream.flush()
            return
        if self.lines:
            self.stream.write(f"\x1b[{self.lines}F")  # back to the first line drawn
        self.stream.write("".join(f"\x1b[2K{line}\n" for line in text))
        self.stream.flush()
        self.lines = len(text)
        if self.delay:
            time.sleep(self.delay)

    def _row(self, row: list[int], changed: torch.Tensor) -> str:
        start = 0
        while start < len(row) and row[start] in self.padding:
            start += 1
        marked = set()
        if self.in_place:  # underlined on a terminal; plain text elsewhere
            marked = {at - start for at in changed.nonzero().flatten().tolist() if at >= start}
        return render_row(self.tokenizer, row[start:], self.mask_id, set(), self.eos_id, marked)
