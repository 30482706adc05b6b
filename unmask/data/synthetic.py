"""Built-in offline tasks for the quickstart and tests: reverse, sort, add and repeat digit strings.

Each example is a (prompt, answer) pair in a compact form the character tokenizer keeps short:

    "rev 3917="   -> "7193"      reverse the digits
    "sort 3917="  -> "1379"      sort the digits ascending
    "add 47+05="  -> "052"       sum of two zero-padded numbers, zero-padded to one more digit
    "rep 3x41="   -> "414141"    the digits repeated k times (k in 1..3): the answer's length
                                 depends on the prompt, not only on its length (stopping)

Answers are always computed from the prompt (`answer_for`). Held-out eval prompts are drawn
first and never appear in training. Examples are balanced over tasks and digit lengths.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from unmask.data.config import DataConfig

Example = tuple[str, str]
TASK_PREFIXES = {"reverse": "rev ", "sort": "sort ", "add": "add ", "repeat": "rep "}
REPEAT_TIMES = 3  # repeat: k is drawn from 1..REPEAT_TIMES
_MAX_DRAWS = 1000  # rejection-sampling tries per example before giving up on a cell


def answer_for(prompt: str) -> str:
    """The exact answer to a synthetic prompt, parsed from the prompt itself."""
    if not prompt.endswith("="):
        raise ValueError(f"not a synthetic prompt (must end with '='): {prompt!r}")
    body = prompt[:-1]
    if body.startswith(TASK_PREFIXES["reverse"]):
        return body[len(TASK_PREFIXES["reverse"]) :][::-1]
    if body.startswith(TASK_PREFIXES["sort"]):
        return "".join(sorted(body[len(TASK_PREFIXES["sort"]) :]))
    if body.startswith(TASK_PREFIXES["add"]):
        left, right = body[len(TASK_PREFIXES["add"]) :].split("+")
        return str(int(left) + int(right)).zfill(len(left) + 1)
    if body.startswith(TASK_PREFIXES["repeat"]):
        times, digits = body[len(TASK_PREFIXES["repeat"]) :].split("x")
        return digits * int(times)
    raise ValueError(f"unknown synthetic task in prompt {prompt!r}")


def _digits(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("0123456789") for _ in range(n))


def _task_lengths(cfg: DataConfig) -> dict[str, list[int]]:
    """Digit lengths of each task (for add: the fixed operand width)."""
    lengths = {}
    for task in cfg.synthetic_tasks:
        if task == "add":
            lengths[task] = [cfg.synthetic_add_digits]
        else:
            lengths[task] = list(range(cfg.synthetic_min_digits, cfg.synthetic_max_digits + 1))
    return lengths


def _balanced_cell(lengths: dict[str, list[int]], i: int) -> tuple[str, int]:
    """The (task, length) of example i: tasks round robin, then each task's lengths in turn."""
    tasks = list(lengths)
    task = tasks[i % len(tasks)]
    task_lengths = lengths[task]
    return task, task_lengths[(i // len(tasks)) % len(task_lengths)]


def _cell_size(task: str, n: int) -> int:
    """How many distinct prompts a cell has (add: two n-digit operands; repeat: k too)."""
    if task == "repeat":
        return REPEAT_TIMES * 10**n
    return 10 ** (2 * n) if task == "add" else 10**n


def _draw_prompt(rng: random.Random, task: str, n: int) -> str:
    if task == "add":
        # Fixed-width operands put digits of equal place value at fixed offsets, which
        # attention with relative positions can learn; the answer has n + 1 digits.
        return f"{TASK_PREFIXES['add']}{_digits(rng, n)}+{_digits(rng, n)}="
    if task == "repeat":
        return f"{TASK_PREFIXES['repeat']}{rng.randint(1, REPEAT_TIMES)}x{_digits(rng, n)}="
    return f"{TASK_PREFIXES[task]}{_digits(rng, n)}="


def _eval_quotas(lengths: dict[str, list[int]], total: int) -> dict[tuple[str, int], int]:
    """Balanced eval counts per cell; a cell gives at most half its prompts to eval and passes
    the excess to the task's longest length (the largest cell)."""
    quotas: dict[tuple[str, int], int] = {}
    for i in range(total):
        cell = _balanced_cell(lengths, i)
        quotas[cell] = quotas.get(cell, 0) + 1
    for (task, n), k in list(quotas.items()):
        cap = _cell_size(task, n) // 2
        if k > cap:
            quotas[(task, n)] = cap
            longest = (task, lengths[task][-1])
            quotas[longest] = quotas.get(longest, 0) + k - cap
    for (task, n), k in quotas.items():
        if k > _cell_size(task, n) // 2:
            raise ValueError(f"synthetic_eval_size={total} is too large for the digit lengths")
    return quotas


def _draw_distinct(rng: random.Random, task: str, n: int, k: int) -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < k:
        prompt = _draw_prompt(rng, task, n)
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
    return out


def make_synthetic(cfg: DataConfig) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples, deterministic in `cfg.seed`; eval prompts never in train.

    Eval is drawn first from its own stream, so it does not change with the train size.
    Training prompts may repeat (small cells hold only 100 prompts); eval prompts do not.
    """
    eval_prompts = _heldout_prompts(cfg)
    held_out = set(eval_prompts)
    lengths = _task_lengths(cfg)
    train_rng = random.Random(f"unmask-synthetic-train-{cfg.seed}")
    train_prompts = []
    for i in range(cfg.synthetic_train_size):
        task, n = _balanced_cell(lengths, i)
        train_prompts.append(_draw_train_prompt(train_rng, task, n, held_out))
    train_rng.shuffle(train_prompts)
    return _with_answers(train_prompts), _with_answers(eval_prompts)


def make_synthetic_heldout(cfg: DataConfig) -> list[Example]:
    """The eval half of `make_synthetic(cfg)` alone (cheap: the train set is not drawn)."""
    return _with_answers(_heldout_prompts(cfg))


def _heldout_prompts(cfg: DataConfig) -> list[str]:
    lengths = _task_lengths(cfg)
    rng = random.Random(f"unmask-synthetic-eval-{cfg.seed}")
    prompts: list[str] = []
    for (task, n), k in sorted(_eval_quotas(lengths, cfg.synthetic_eval_size).items()):
        prompts.extend(_draw_distinct(rng, task, n, k))
    rng.shuffle(prompts)
    return prompts


def _draw_train_prompt(rng: random.Random, task: str, n: int, held_out: set[str]) -> str:
    for _ in range(_MAX_DRAWS):
        prompt = _draw_prompt(rng, task, n)
        if prompt not in held_out:
            return prompt
    raise RuntimeError(f"no training prompt left for task {task!r} with {n} digits")


def _with_answers(prompts: Sequence[str]) -> list[Example]:
    return [(p, answer_for(p)) for p in prompts]


def exact_match(predictions: Sequence[str], answers: Sequence[str]) -> float:
    """Fraction of predictions equal to their answer (surrounding whitespace ignored)."""
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions for {len(answers)} answers")
    if not answers:
        return 0.0
    hits = sum(p.strip() == a.strip() for p, a in zip(predictions, answers))
    return hits / len(answers)
