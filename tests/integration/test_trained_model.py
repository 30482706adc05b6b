"""A small model trained here until it answers (conftest.reverse_run): what users do right
after the quickstart, checked against the trainer's own held-out evaluation."""

import json

import pytest
from conftest import REVERSE_RUN

from unmask.checkpoint import load_for_sampling
from unmask.cli import main
from unmask.config import EvalConfig
from unmask.data import heldout_examples
from unmask.data.config import DataConfig
from unmask.sampling.accuracy import heldout_accuracy
from unmask.sampling.config import resolve_sampling
from unmask.sampling.generation_file import saved_sampling
from unmask.sampling.texts import generate_texts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_generate_with_no_length_flag_answers_like_the_heldout_evaluation(reverse_run,
                                                                           tmp_path):  # fmt: skip
    data = DataConfig.model_validate(REVERSE_RUN["data"])
    final = reverse_run / "final"
    assert saved_sampling(final)["row_length"] == data.packing_length
    examples = heldout_examples(data)[:20]
    sm = load_for_sampling(final)
    accuracy, rows = heldout_accuracy(sm.model, sm.tokenizer, examples, EvalConfig(max_examples=20),
                                      data.packing_length, sm.device)  # fmt: skip
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p, _ in examples))
    out = tmp_path / "answers.jsonl"
    assert (
        main(["generate", "--model", str(final), "--prompts", str(prompts), "--out", str(out)]) == 0
    )
    answers = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    assert answers == [got for _, _, got in rows]
    right = sum(a == expected for a, (_, expected) in zip(answers, examples))
    print(f"generate with no length flag: {right}/20 right, held-out evaluation {accuracy:.0%}")
    assert right / 20 == accuracy and accuracy >= 0.9
    # from Python, as the README shows: the folder's saved defaults, no length given
    records = generate_texts(sm, [p for p, _ in examples], resolve_sampling(sm.saved))
    assert [r["completion"] for r in records] == answers
    # the README's batch form: threshold decoding with a prefix cache
    fast = tmp_path / "fast.jsonl"
    argv = ["generate", "--model", str(final), "--prompts", str(prompts), "--out", str(fast),
            "--threshold", "0.9", "--cache", "prefix"]  # fmt: skip
    assert main(argv) == 0
    quick = [json.loads(line)["completion"] for line in fast.read_text().splitlines()]
    quick_right = sum(a == expected for a, (_, expected) in zip(quick, examples))
    print(f"--threshold 0.9 --cache prefix: {quick_right}/20 right")
    assert quick_right >= 18
