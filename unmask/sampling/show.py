"""`unmask generate --show`: the canvas after every denoising step, masked positions drawn
as a shaded block and EOS as a middle dot, so the answer visibly fills in and where it
ends shows. On a terminal each frame redraws the last in place; elsewhere (a file, a pipe,
CI logs) frames are written one after another as plain lines, with no escape codes."""

import sys
import time
from typing import TextIO

import torch

MASK_GLYPH = "\u2591"  # light shade
EOS_GLYPH = "\u00b7"  # middle dot


def render_row(tokenizer, row: list[int], mask_id: int, skip_ids: set[int],
               eos_id: int | None = None) -> str:  # fmt: skip
    """Text of one canvas row: tokens decoded one by one, masks as MASK_GLYPH, EOS as
    EOS_GLYPH, skip_ids (left padding) left out."""
    pieces = []
    for token in row:
        if token == mask_id:
            pieces.append(MASK_GLYPH)
        elif token == eos_id:
            pieces.append(EOS_GLYPH)
        elif token not in skip_ids:
            pieces.append(tokenizer.decode([token]))
    return "".join(pieces)


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

    def __call__(self, canvas: torch.Tensor) -> None:
        self.step += 1
        text = [f"step {self.step}"] + [
            self._row(row) for row in canvas.tolist()
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

    def _row(self, row: list[int]) -> str:
        start = 0
        while start < len(row) and row[start] in self.padding:
            start += 1
        return render_row(self.tokenizer, row[start:], self.mask_id, set(), self.eos_id)
