"""`unmask generate --show`: redraw the canvas after every denoising step, masked
positions drawn as a shaded block, so the answer visibly fills in."""

import sys
import time
from typing import TextIO

import torch

MASK_GLYPH = "\u2591"  # light shade


def render_row(tokenizer, row: list[int], mask_id: int, skip_ids: set[int]) -> str:
    """Text of one canvas row: tokens decoded one by one, masks as MASK_GLYPH."""
    pieces = []
    for token in row:
        if token == mask_id:
            pieces.append(MASK_GLYPH)
        elif token not in skip_ids:
            pieces.append(tokenizer.decode([token]))
    return "".join(pieces)


class TerminalAnimation:
    """on_step callback for `sample`: redraws every row in place (ANSI cursor moves)."""

    def __init__(self, tokenizer, mask_id: int, skip_ids: set[int], stream: TextIO | None = None,
                 delay: float = 0.05):  # fmt: skip
        self.tokenizer, self.mask_id, self.skip_ids = tokenizer, mask_id, skip_ids
        self.stream = stream or sys.stderr
        self.delay = delay
        self.lines = 0
        self.step = 0

    def __call__(self, canvas: torch.Tensor) -> None:
        self.step += 1
        rows = [render_row(self.tokenizer, r, self.mask_id, self.skip_ids) for r in canvas.tolist()]
        if self.lines:
            self.stream.write(f"\x1b[{self.lines}F")  # back to the first line drawn
        text = [f"step {self.step}"] + rows
        self.stream.write("".join(f"\x1b[2K{line}\n" for line in text))
        self.stream.flush()
        self.lines = len(text)
        if self.delay:
            time.sleep(self.delay)
