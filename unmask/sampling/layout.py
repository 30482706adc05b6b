"""Where a batch's prompts and masks sit on the canvas `sample` decodes, and where its
blocks start: `block_origin` (SamplingConfig).

- `answer` (unmask's default): prompts left-padded to the widest, then gen_length masks in
  blocks of block_length counted from the answer's first position; block-causal attention
  cuts the prompt into blocks from its end (`canvas_blocks`).
- `request` (LLaDA2's generate, SGLang): blocks counted from each request's first token.
  A row's first decoded block starts at its last whole prompt block, so the prompt's tail
  (P mod block_length tokens) shares it with masks: context there, never a mask, never
  edited. A row's canvas ends on the first block boundary at or after P + gen_length (the
  masks past gen_length are decoded, then dropped, as LLaDA2 drops them).

  Rows of different prompt lengths each follow their own grid: a row is shifted so that
  its first decoded block starts at the same column S (= the longest whole-block prompt
  prefix) for every row, padding on the left what is shorter, so every row's blocks fall
  on the common columns S + k * block_length and one block call decodes all rows. A row
  whose canvas ends a block before the others has padding there (not a mask: nothing is
  decoded; outside its attention, as left padding is). Block-causal attention uses the
  same grid, so it is cut from each request's first token.

`output` maps the canvas back to the (B, P + G) form `sample` returns: the left-padded
prompt, then each row's first gen_length answer tokens.
"""

from dataclasses import dataclass

import torch


@dataclass
class CanvasLayout:
    """A batch on the canvas: x (B, L) tokens (masks to decode), valid (B, L) bool (False:
    padding), in_prompt (B, L) bool (real prompt tokens), answer_from (B,) long (each row's
    first answer column), starts (the block start columns, in decoding order), blocks (L,)
    long (the block of each column, for block-causal attention) and row_blocks (B,) long
    (how many of the blocks each row has: later ones are its padding)."""

    x: torch.Tensor
    valid: torch.Tensor
    in_prompt: torch.Tensor
    answer_from: torch.Tensor
    starts: list[int]
    blocks: torch.Tensor
    row_blocks: torch.Tensor
    prompt_ids: torch.Tensor
    gen_length: int

    @property
    def shifted(self) -> bool:
        """Whether rows' answers start at different columns (request origin)."""
        return not bool((self.answer_from == self.prompt_ids.shape[1]).all())

    def answer_columns(self) -> torch.Tensor:
        """(B, L) bool: each row's answer positions (from its first answer column on)."""
        columns = torch.arange(self.x.shape[1], device=self.x.device)
        return (columns[None, :] >= self.answer_from[:, None]) & self.valid

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """(B, P + G): the left-padded prompts, then each row's first gen_length answer
        positions of canvas x (B, L)."""
        if not self.shifted:
            return x[:, : self.prompt_ids.shape[1] + self.gen_length]
        index = self.answer_from[:, None] + torch.arange(self.gen_length, device=x.device)
        return torch.cat([self.prompt_ids, x.gather(1, index)], dim=1)


def canvas_blocks(prompt_len: int, gen_length: int, block_length: int, device=None):
    """Block index of every canvas position (P + G,): answer blocks 0, 1, ... and the
    prompt cut from its end into blocks -1, -2, ... of block_length."""
    offset = torch.arange(prompt_len + gen_length, device=device) - prompt_len
    return torch.div(offset, block_length, rounding_mode="floor")


def filler_token(mask_id: int, eos_id: int | None) -> int:
    """A token for the padding after a shorter row's canvas: neither the mask nor EOS."""
    return next(t for t in range(3) if t not in (mask_id, eos_id))


def lay_out(prompt_ids: torch.Tensor, prompt_valid: torch.Tensor, gen_length: int,
            block_length: int, origin: str, mask_id: int, filler: int) -> CanvasLayout:  # fmt: skip
    """The canvas for prompt_ids (B, W) left-padded (prompt_valid (B, W) bool True on
    real tokens), gen_length masks each, blocks of block_length counted from `origin`
    (answer or request). filler: the token of padding after a row's canvas (neither the
    mask nor EOS; nothing attends to it)."""
    batch, width = prompt_ids.shape
    device = prompt_ids.device
    if origin == "answer":
        masks = torch.full((batch, gen_length), mask_id, dtype=prompt_ids.dtype, device=device)
        x = torch.cat([prompt_ids, masks], dim=1)
        valid = torch.cat([prompt_valid, torch.ones_like(masks, dtype=torch.bool)], dim=1)
        in_prompt = torch.cat([prompt_valid, torch.zeros_like(masks, dtype=torch.bool)], dim=1)
        count = gen_length // block_length
        starts = [width + k * block_length for k in range(count)]
        return CanvasLayout(x, valid, in_prompt,
                            torch.full((batch,), width, dtype=torch.long, device=device),
                            starts, canvas_blocks(width, gen_length, block_length, device),
                            torch.full((batch,), count, dtype=torch.long, device=device),
                            prompt_ids, gen_length)  # fmt: skip
    lengths = prompt_valid.sum(1).tolist()
    whole = [n // block_length * block_length for n in lengths]  # prompt blocks before
    first = max(whole)  # S: every row's first decoded block starts here
    row_blocks = [-(-(n - w + gen_length) // block_length) for n, w in zip(lengths, whole)]
    total = first + max(row_blocks) * block_length
    x = torch.full((batch, total), filler, dtype=prompt_ids.dtype, device=device)
    valid = torch.zeros((batch, total), dtype=torch.bool, device=device)
    in_prompt = torch.zeros_like(valid)
    answer_from = []
    for row, (n, w, count) in enumerate(zip(lengths, whole, row_blocks)):
        left, end = first - w, first + count * block_length
        x[row, left : left + n] = prompt_ids[row, width - n :]
        x[row, left + n : end] = mask_id
        valid[row, left:end] = True
        in_prompt[row, left : left + n] = True
        answer_from.append(left + n)
    starts = [first + k * block_length for k in range(max(row_blocks))]
    blocks = torch.div(torch.arange(total, device=device) - first, block_length,
                       rounding_mode="floor")  # fmt: skip
    return CanvasLayout(x, valid, in_prompt, torch.tensor(answer_from, device=device), starts,
                        blocks, torch.tensor(row_blocks, device=device), prompt_ids,
                        gen_length)  # fmt: skip


__all__ = ["CanvasLayout", "canvas_blocks", "filler_token", "lay_out"]
