"""Exact-match accuracy of generated answers for held-out prompts (the quickstart's score)."""

from collections import defaultdict
from collections.abc import Callable
from typing import Protocol

import torch

from unmask.sampling import generate
from unmask.sampling.config import SamplingConfig
from unmask.sampling.decoders import uniform_canvas_model
from unmask.sampling.texts import before_eos


def decode_answer(tokenizer, ids: list[int]) -> str:
    """Text of the generated ids up to (not including) the first EOS."""
    return tokenizer.decode(before_eos(ids, tokenizer.eos_token_id), skip_special_tokens=True)


class HeldoutSettings(Protocol):
    """What heldout_accuracy reads of the run config's `eval:` section (EvalConfig,
    unmask/config/eval.py, which this layer cannot import)."""

    max_examples: int
    batch_size: int
    steps_per_token: float
    sampling: SamplingConfig


@torch.no_grad()
def heldout_accuracy(
    model,
    tokenizer,
    examples: list[tuple[str, str]],
    cfg: HeldoutSettings,
    row_length: int,
    device: torch.device,
    sampling: dict | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[float, list[tuple[str, str, str]]]:
    """Generate an answer for each prompt so that prompt + answer fills `row_length` tokens
    (the shape rows had in training) and score exact match.

    cfg.sampling: the sampler (SamplingConfig.fitted sets each answer's gen_length and
    blocks; steps = steps_per_token per answer token, whole steps per block).
    sampling: what the training objective fixes (`fixed_by_training`), winning over
    cfg.sampling: Dream's `shift_logits`; BD3LM's `block_causal` with its `block_length`,
    where the answer is rounded up to whole blocks (later blocks cannot change earlier ones).

    A uniform-canvas model (DiffusionGemma) is decoded by entropy_bound: gen_length fitted
    to the row, its own steps (steps_per_token does not apply), EOS ending a row, seed 0.

    Prompts are grouped by token length so each group is one rectangular batch;
    on_progress(done, total) is called after each batch.
    Returns (accuracy, [(prompt, expected, predicted), ...]).
    """
    examples = examples[: cfg.max_examples]
    rows_config = cfg.sampling.updated(**(sampling or {}), row_length=row_length)
    # a uniform-canvas model (DiffusionGemma): decoder entropy_bound with its own steps, its
    # draws from a generator of its own (seed 0), never from torch's global one
    uniform = rows_config.uniform_canvas or uniform_canvas_model(model)
    if uniform:
        rows_config = rows_config.updated(uniform_canvas=True)
    generator = torch.Generator(device=device).manual_seed(0) if uniform else None
    groups: dict[int, list[int]] = defaultdict(list)
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in examples]
    for index, ids in enumerate(encoded):
        groups[len(ids)].append(index)
    predictions: dict[int, str] = {}
    was_training = model.training
    model.eval()
    for prompt_len, indices in sorted(groups.items()):
        gen_length = row_length - prompt_len
        if gen_length <= 0:
            raise ValueError(f"prompt of {prompt_len} tokens leaves no room in {row_length}")
        config = fitted = rows_config.fitted(prompt_len)
        if not uniform:
            blocks = fitted.gen_length // fitted.block_length
            steps = max(blocks, round(fitted.gen_length * cfg.steps_per_token / blocks) * blocks)
            config = fitted.updated(steps=steps)
        for start in range(0, len(indices), cfg.batch_size):
            chunk = indices[start : start + cfg.batch_size]
            prompt = torch.tensor([encoded[i] for i in chunk], device=device)
            out = generate(model, prompt, config, mask_id=tokenizer.mask_token_id,
                           eos_id=tokenizer.eos_token_id if uniform else None,
                           generator=generator)  # fmt: skip
            for row, index in zip(out[:, prompt_len:].tolist(), chunk):
                predictions[index] = decode_answer(tokenizer, row)
            if on_progress is not None:
                on_progress(len(predictions), len(examples))
    model.train(was_training)
    rows = [(p, a, predictions[i]) for i, (p, a) in enumerate(examples)]
    correct = sum(expected == got for _, expected, got in rows)
    return correct / max(1, len(rows)), rows
