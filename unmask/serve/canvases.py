"""Continuous batching of canvas rows for `unmask serve` (DiffusionGemma's decoder
entropy_bound, and any decoder that declares `serves_by_canvas` with its `serve_canvas`):
requests join and leave the batch between canvases, as masked rows do between blocks
(engine.py).

What a row carries from one canvas to the next is the encoder's K/V of its prompt and of
its finished canvases (models/diffusion_gemma.py PromptCache) and its own generator. So:

1. when a row joins, its prompt is encoded alone (`model.encode`, the prompt's pictures
   through the vision tower and the projector there): once per prompt, never again for
   its later steps or canvases (`CanvasState.cache`);
2. each turn denoises one canvas for every row of the group with the running decoder's
   `serve_canvas` (entropy_bound: `denoise_canvas`, the code `unmask generate` runs): the
   rows' caches are joined, each left-padded to the longest (zeros no query attends to:
   the cache's padding mask), and each row's canvas sits at its own positions (its tokens
   so far onward);
3. the finished canvas is appended to the rows' joined cache (`model.encode`, the canvas
   after them), which is split back into each row's own cache, its padding dropped.

A row draws from its own generator, seeded as `sample` seeds a prompt alone
(`row_seeds`: a request's seed S, so it draws what `unmask generate --seed S` draws), and
reads only its own K/V: its tokens are those it gets alone (tests/integration/
test_diffusion_gemma_images.py serves rows with and without pictures at once). A seeded
request joins the batch too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from unmask.sampling.decoders import decoder_class
from unmask.sampling.entropy_bound import row_seeds


@dataclass
class CanvasState:
    """A row's state between canvases: the encoder's K/V of its tokens so far (batch 1, no
    padding), how many tokens that is, its generator, and the probability of each shown
    token (the playground's hover)."""

    cache: object  # models/diffusion_gemma.py PromptCache
    length: int
    generator: torch.Generator
    probability: list = field(default_factory=list)


def join_caches(caches: list) -> object:
    """One PromptCache of single-row caches of different lengths: each layer's K/V
    left-padded with zeros to the longest row's, the padding marked in the cache's mask (no
    query attends to it); every row right-aligned, so a sliding layer's window is counted
    over real tokens."""
    first = caches[0]
    if len(caches) == 1:
        return first
    cls, device = type(first), first.keys[0].device
    longest = max(c.length for c in caches)
    keys, values = [], []
    for layer in range(len(first.keys)):
        kept = max(c.keys[layer].shape[2] for c in caches)
        keys.append(torch.cat([_left_pad(c.keys[layer], kept) for c in caches]))
        values.append(torch.cat([_left_pad(c.values[layer], kept) for c in caches]))
    mask = None
    if any(c.length != longest for c in caches):
        lengths = torch.tensor([c.length for c in caches], device=device)
        mask = torch.arange(longest, device=device)[None] >= (longest - lengths)[:, None]
    return cls(keys, values, longest, mask)


def _left_pad(t: torch.Tensor, kept: int) -> torch.Tensor:
    """(1, H, n, D) -> (1, H, kept, D), zeros before."""
    return torch.nn.functional.pad(t, (0, 0, kept - t.shape[2], 0))


def row_cache(cache, row: int, length: int) -> object:
    """Row `row` of a joined cache as its own (batch 1, no padding): each layer's last
    `length` K/V at most (a sliding layer keeps fewer)."""
    keys = [k[row : row + 1, :, -min(length, k.shape[2]) :] for k in cache.keys]
    values = [v[row : row + 1, :, -min(length, v.shape[2]) :] for v in cache.values]
    return type(cache)(keys, values, length, None)


def start_row(model, prompt_ids: list[int], images, generator: torch.Generator | None,
              device: torch.device) -> CanvasState:  # fmt: skip
    """A row joining: its prompt (and pictures) encoded alone, its generator seeded as
    `sample` seeds one prompt."""
    ids = torch.tensor([prompt_ids], device=device)
    cache = model.encode(ids, images=None if images is None else images.to(device))
    seed = row_seeds(generator, 1)[0]
    return CanvasState(cache, len(prompt_ids), torch.Generator(device=device).manual_seed(seed))


def run_canvas(model, states: list[CanvasState], config, show=None) -> tuple[torch.Tensor, object]:
    """One canvas for rows `states` (one group: the same options), by the decoder of
    `config` (its `serve_canvas`) -> (the canvas (R, C), (joined cache, positions, counts:
    nfe, steps, row_forwards)). show(argmax, probability) after every step."""
    length = model.config.diffusion_gemma.canvas_length
    device = states[0].cache.keys[0].device
    cache = join_caches([s.cache for s in states])
    positions = torch.stack([s.length + torch.arange(length, device=device) for s in states])
    counts = SimpleNamespace(nfe=0, steps=0, row_forwards=0)
    probability = torch.full((len(states), length), float("nan"), device=device)
    step_show = None if show is None else (lambda argmax: show(argmax, probability))
    canvas = decoder_class(config).serve_canvas(model, cache, positions,
                                                [s.generator for s in states], config, counts,
                                                step_show,
                                                probability if show is not None else None)  # fmt: skip
    for state, shown in zip(states, probability.tolist()):
        state.probability += shown
    return canvas, (cache, positions, counts)


def append_canvas(model, states: list[CanvasState], canvas: torch.Tensor, joined: tuple,
                  keep: list[int]) -> None:  # fmt: skip
    """The rows `keep` (indices into states) go on: their canvas appended to their cache
    (one encoder pass over the joined cache of those rows), split back per row."""
    if not keep:
        return
    cache, positions, _ = joined
    idx = torch.tensor(keep, device=canvas.device)
    if len(keep) < len(states):
        cache = cache.select_rows(idx)
    grown = model.encode(canvas[idx], cache, position_ids=positions[idx])
    length = canvas.shape[1]
    for i, row in enumerate(keep):
        state = states[row]
        state.length += length
        state.cache = row_cache(grown, i, state.length)


__all__ = ["CanvasState", "append_canvas", "join_caches", "row_cache", "run_canvas",
           "start_row"]  # fmt: skip
