"""`unmask generate --show`: the canvas after every denoising step, masked positions drawn
as a shaded block and EOS as a middle dot, so the answer visibly fills in and where it
ends shows. A decoder that edits tokens it committed (joint_threshold) shows it: the step
line counts the tokens the step replaced and those replaced so far in the batch, on a
terminal the replaced tokens are underlined, and when a batch is done one line per edited
token says `'7' at 3: edited at step 5 from '1'`. Each batch of prompts is its own
animation (`begin_batch`): its steps count from 1 and its edits from 0. On a terminal each
frame redraws the last in place; elsewhere (a file, a pipe, CI logs) frames are written
one after another as plain lines, with no escape codes."""

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
        self.total_edits = 0  # tokens replaced by others, every batch
        self.history: dict = {}
        self.begin_batch()

    def begin_batch(self, prompts: list[int] | None = None) -> None:
        """A new batch (prompts: their indices, for the edit lines): the previous batch's
        edits are listed, and the animation starts again at step 1."""
        self.list_edits()
        self.prompts = prompts
        self.lines = 0  # the next frame is drawn below the last one
        self.step = 0
        self.previous: torch.Tensor | None = None
        self.edits = 0  # tokens replaced by others so far in this batch
        #: (row, position from its first token) -> [(step, token before, after), ...]
        self.history: dict[tuple[int, int], list[tuple[int, int, int]]] = {}

    def list_edits(self) -> None:
        """One line per edited token of the batch so far (none when nothing was edited)."""
        if not self.history:
            return
        lines = []
        for (row, at), changes in sorted(self.history.items()):
            prompt = self.prompts[row] if self.prompts is not None else row
            for step, old, new in changes:
                lines.append(f"  prompt {prompt + 1}: {self._text(new)!r} at token {at}: "
                             f"edited at step {step} from {self._text(old)!r}")  # fmt: skip
        self.stream.write("".join(line + "\n" for line in lines))
        self.stream.flush()
        self.lines = 0  # the next frame is drawn below them
        self.history = {}

    def _text(self, token: int) -> str:
        return EOS_GLYPH if token == self.eos_id else self.tokenizer.decode([token])

    def __call__(self, canvas: torch.Tensor) -> None:
        self.step += 1
        before = self.previous
        changed = edited(before, canvas.cpu(), self.mask_id)
        self.previous = canvas.cpu().clone()
        count = int(changed.sum())
        self.edits += count
        self.total_edits += count
        if count:  # positions counted from the row's first token (its left padding skipped)
            rows = self.previous.tolist()
            for row, at in changed.nonzero().tolist():
                where = (row, at - self._padding(rows[row]))
                self.history.setdefault(where, []).append(
                    (self.step, int(before[row, at]), rows[row][at]))  # fmt: skip
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

    def _padding(self, row: list[int]) -> int:
        start = 0
        while start < len(row) and row[start] in self.padding:
            start += 1
        return start

    def _row(self, row: list[int], changed: torch.Tensor) -> str:
        start = self._padding(row)
        marked = set()
        if self.in_place:  # underlined on a terminal; plain text elsewhere
            marked = {at - start for at in changed.nonzero().flatten().tolist() if at >= start}
        return render_row(self.tokenizer, row[start:], self.mask_id, set(), self.eos_id, marked)
