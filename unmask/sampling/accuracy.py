"""Exact-match accuracy of generated answers for held-out prompts (the quickstart's score)."""

from collections import defaultdict
from collections.abc import Callable

import torch

from unmask.sampling.config import EvalConfig, SamplingConfig
from unmask.sampling.generate import generate
from unmask.sampling.texts import before_eos


def decode_answer(tokenizer, ids: list[int]) -> str:
    """Text of the generated ids up to (not including) the first EOS."""
    return tokenizer.decode(before_eos(ids, tokenizer.eos_token_id), skip_special_tokens=True)


@torch.no_grad()
def heldout_accuracy(
    model,
    tokenizer,
    examples: list[tuple[str, str]],
    cfg: EvalConfig,
    row_length: int,
    device: torch.device,
    sampling: dict | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[float, list[tuple[str, str, str]]]:
    """Generate an answer for each prompt so that prompt + answer fills `row_length` tokens
    (the shape rows had in training) and score exact match.

    sampling: what the training objective fixes (`fixed_by_training`): Dream's
    `shift_logits`; BD3LM's `block_causal` with its `block_length`, where the answer is
    rounded up to whole blocks (later blocks cannot change earlier ones).

    Prompts are grouped by token length so each group is one rectangular batch;
    on_progress(done, total) is called after each batch.
    Returns (accuracy, [(prompt, expected, predicted), ...]).
    """
    examples = examples[: cfg.max_examples]
    fixed = dict(sampling or {})
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
        block = (
            cfg.block_length
            if cfg.block_length and gen_length % cfg.block_length == 0
            else gen_length
        )
        if fixed.get("block_causal"):
            block = fixed["block_length"]
            gen_length = -(-gen_length // block) * block
        blocks = gen_length // block
        steps = max(blocks, round(gen_length * cfg.steps_per_token / blocks) * blocks)
        config = SamplingConfig.model_validate(
            {**fixed, "steps": steps, "gen_length": gen_length, "block_length": block,
             "temperature": cfg.temperature, "remasking": cfg.remasking}
        )  # fmt: skip
        for start in range(0, len(indices), cfg.batch_size):
            chunk = indices[start : start + cfg.batch_size]
            prompt = torch.tensor([encoded[i] for i in chunk], device=device)
            out = generate(model, prompt, config, mask_id=tokenizer.mask_token_id)
            for row, index in zip(out[:, prompt_len:].tolist(), chunk):
                predictions[index] = decode_answer(tokenizer, row)
            if on_progress is not None:
                on_progress(len(predictions), len(examples))
    model.train(was_training)
    rows = [(p, a, predictions[i]) for i, (p, a) in enumerate(examples)]
    correct = sum(expected == got for _, expected, got in rows)
    return correct / max(1, len(rows)), rows
