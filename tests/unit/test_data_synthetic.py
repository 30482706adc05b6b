"""Synthetic tasks: answers recomputed independently, held-out prompts disjoint, balance."""

from collections import Counter

import pytest

from unmask.data import DataConfig, answer_for, exact_match, make_synthetic
from unmask.data.synthetic import TASK_PREFIXES

CFG = DataConfig(synthetic_train_size=3000, synthetic_eval_size=300)


def _recompute(prompt: str) -> str:
    """An independent oracle: parse with split/partition, not the module's parser."""
    task, _, rest = prompt.partition(" ")
    operand = rest.rstrip("=")
    if task == "rev":
        return "".join(reversed(operand))
    if task == "sort":
        return "".join(sorted(operand, key=int))
    a, b = operand.split("+")
    return f"{int(a) + int(b):0{len(a) + 1}d}"


def test_answers_are_correct():
    train, held = make_synthetic(CFG)
    for prompt, answer in train + held:
        assert answer == _recompute(prompt), prompt
    assert answer_for("rev 3917=") == "7193"
    assert answer_for("sort 3917=") == "1379"
    assert answer_for("add 47+85=") == "132"
    assert answer_for("add 07+05=") == "012"  # zero-padded to one more digit than the operands
    assert answer_for("add 047+385=") == "0432"


def test_heldout_prompts_never_in_training():
    train, held = make_synthetic(DataConfig(synthetic_train_size=20000, synthetic_eval_size=300))
    held_prompts = {p for p, _ in held}
    assert len(held_prompts) == 300  # distinct
    assert held_prompts.isdisjoint(p for p, _ in train)


def test_deterministic_and_seeded():
    assert make_synthetic(CFG) == make_synthetic(CFG)
    assert make_synthetic(CFG)[0] != make_synthetic(CFG.model_copy(update={"seed": 1}))[0]
    # Eval does not move with the train size.
    bigger = CFG.model_copy(update={"synthetic_train_size": 4000})
    assert make_synthetic(bigger)[1] == make_synthetic(CFG)[1]


def test_balanced_over_tasks_and_lengths():
    train, held = make_synthetic(CFG)
    by_task = Counter(p.split(" ")[0] for p, _ in train)
    assert by_task == {"rev": 1000, "sort": 1000, "add": 1000}
    rev_lengths = Counter(len(p) - len("rev =") for p, _ in train if p.startswith("rev"))
    assert rev_lengths == {n: 200 for n in range(2, 7)}
    assert Counter(p.split(" ")[0] for p, _ in held) == {"rev": 100, "sort": 100, "add": 100}
    add_widths = {
        tuple(len(x) for x in p[4:-1].split("+")) for p, _ in train if p.startswith("add")
    }
    assert add_widths == {(2, 2)}
    wide = make_synthetic(CFG.model_copy(update={"synthetic_add_digits": 3}))[0]
    assert {len(a) for p, a in wide if p.startswith("add")} == {4}


def test_prefixes_distinct_and_sequences_short():
    prefixes = list(TASK_PREFIXES.values())
    assert all(not a.startswith(b) for a in prefixes for b in prefixes if a != b)
    train, _ = make_synthetic(CFG)
    assert max(len(p) + len(a) for p, a in train) <= 18  # "sort 123456=" + 6 digits


def test_single_task_config():
    train, held = make_synthetic(
        DataConfig(synthetic_tasks=["add"], synthetic_train_size=50, synthetic_eval_size=10)
    )
    assert all(p.startswith("add ") for p, _ in train + held)
    assert len(train) == 50 and len(held) == 10


def test_exact_match():
    assert exact_match(["12", " 3 ", "x"], ["12", "3", "4"]) == pytest.approx(2 / 3)
    assert exact_match([], []) == 0.0
    with pytest.raises(ValueError, match="2 predictions for 1 answers"):
        exact_match(["a", "b"], ["a"])
