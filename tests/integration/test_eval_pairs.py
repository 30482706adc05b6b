"""`unmask eval --pairs`: answers scored given prompts (records equal to the Python
estimator, jsonl and separator text alike, EOS tail chosen from the run config, unknown
stderr with one draw), and the acceptance check: on a model trained here, the right answer
to held-out reverse prompts scores above a near miss for >= 95% of them."""

import json
import math
import random

import pytest
import yaml
from conftest import REVERSE_RUN, save_tiny_model

from unmask.checkpoint import load_for_sampling
from unmask.cli import main
from unmask.data import heldout_examples
from unmask.data.config import DataConfig
from unmask.sampling.likelihood import answer_log_likelihood, eos_tail, item_generator

pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = [("rev 123=", "321"), ("sort 31=", "13"), ("add 12+07=", "019"), ("rev 9=", "9")]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """checkpoint-3 (a random tiny model) of a run directory whose config.yaml says rows
    were padded to 20 tokens."""
    run = tmp_path_factory.mktemp("evalrun") / "run"
    save_tiny_model(run / "checkpoint-3", seed=2)
    data = {"packing": False, "packing_length": 20}
    (run / "config.yaml").write_text(yaml.safe_dump({"data": data}))
    return run / "checkpoint-3"


def write_jsonl(path, pairs, field="response"):
    path.write_text("".join(json.dumps({"prompt": p, field: a}) + "\n" for p, a in pairs))
    return path


def eval_lines(capsys, *args) -> list[dict]:
    assert main(["eval", *map(str, args)]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_pair_records_equal_the_python_estimator(run_dir, tmp_path, capsys):
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, ("answer" if i % 2 else "response"): a})
                           + "\n" for i, (p, a) in enumerate(PAIRS)))  # fmt: skip
    *records, total = eval_lines(capsys, "--model", run_dir, "--pairs", src, "--per-line",
                                 "--mc-num", 12, "--batch-size", 4, "--seed", 5)  # fmt: skip
    assert total["summary"] and total["mode"] == "pairs" and total["records"] == len(PAIRS)
    assert total["eos"] == "pad" and total["row_length"] == 20  # read from the run's config
    sm = load_for_sampling(run_dir)
    tok = sm.tokenizer
    for index, (record, (prompt, answer)) in enumerate(zip(records, PAIRS)):
        ctx = tok(prompt, add_special_tokens=False)["input_ids"]
        ans = tok(answer, add_special_tokens=False)["input_ids"]
        tail = eos_tail("pad", tok.eos_token_id, len(ctx) + len(ans), 20)
        est = answer_log_likelihood(sm, ctx, ans + tail, mc_num=12, batch_size=4,
                                    generator=item_generator(5, index))  # fmt: skip
        assert record["index"] == index and (record["prompt"], record["answer"]) == (prompt, answer)
        assert record["answer_tokens"] == len(ans) and record["eos_tokens"] == 20 - len(ctx + ans)
        assert record["scored_tokens"] == 20 - len(ctx)
        assert record["nelbo"] == pytest.approx(-est.value, abs=1e-6)
        assert record["nelbo_per_token"] == pytest.approx(-est.value / (20 - len(ctx)), abs=1e-6)
        assert record["stderr"] == pytest.approx(est.stderr, rel=1e-6) and est.draws == 3
    nelbo = sum(r["nelbo"] for r in records)
    tokens = sum(r["scored_tokens"] for r in records)
    assert total["nelbo"] == pytest.approx(nelbo) and total["scored_tokens"] == tokens
    assert total["ppl_upper_bound"] == pytest.approx(math.exp(nelbo / tokens))
    assert total["stderr"] == pytest.approx(math.sqrt(sum(r["stderr"] ** 2 for r in records)))


def test_separator_text_scores_like_jsonl_and_out_file(run_dir, tmp_path, capsys):
    text = tmp_path / "pairs.txt"
    text.write_text("".join(p + a + "\n" for p, a in PAIRS) + "\n")  # a blank line is skipped
    src = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    out = tmp_path / "scores.jsonl"
    common = ["--model", run_dir, "--mc-num", 8, "--batch-size", 4, "--eos", "eos"]
    (summary,) = eval_lines(capsys, *common, "--pairs", text, "--separator", "=", "--out", out)
    from_text = [json.loads(line) for line in out.read_text().splitlines()]
    assert from_text[-1] == summary and summary["eos"] == "eos"
    from_jsonl = eval_lines(capsys, *common, "--pairs", src, "--per-line")
    assert [r["prompt"] for r in from_text[:-1]] == [p for p, _ in PAIRS]  # keeps the "="
    assert [r["eos_tokens"] for r in from_text[:-1]] == [1] * len(PAIRS)
    strip = ("file",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in from_text] == [
        {k: v for k, v in r.items() if k not in strip} for r in from_jsonl
    ]


def test_one_draw_reports_unknown_stderr(run_dir, tmp_path, capsys):
    src = write_jsonl(tmp_path / "pairs.jsonl", PAIRS[:2], field="answer")
    *records, total = eval_lines(capsys, "--model", run_dir, "--pairs", src, "--per-line",
                                 "--mc-num", 16, "--batch-size", 16, "--eos", "none")  # fmt: skip
    assert [r["stderr"] for r in records] == [None, None] and total["eos"] == "none"
    assert total["stderr"] is None and total["stderr_per_token"] is None
    main(["eval", "--model", str(run_dir), "--pairs", str(src), "--mc-num", "16"])
    assert "standard error unknown" in capsys.readouterr().err
    text = tmp_path / "t.txt"
    text.write_text("rev 123=321\nsort 21=12\n")
    (whole,) = eval_lines(capsys, "--model", run_dir, "--ppl", text, "--mc-num", 16)
    assert whole["mode"] == "text" and whole["stderr_per_token"] is None
    *lines, per_line = eval_lines(capsys, "--model", run_dir, "--ppl", text, "--per-line",
                                  "--mc-num", 8, "--batch-size", 4)  # fmt: skip
    assert [r["text"] for r in lines] == ["rev 123=321", "sort 21=12"]
    assert per_line["mode"] == "text-lines" and per_line["stderr"] is not None
    assert per_line["scored_tokens"] == 21  # each line alone, no newline


def test_answer_end_without_a_run_config_is_none(tmp_path, capsys):
    model = save_tiny_model(tmp_path / "exported", seed=2)
    src = write_jsonl(tmp_path / "pairs.jsonl", PAIRS[:1])
    (total,) = eval_lines(capsys, "--model", model, "--pairs", src, "--mc-num", 4)
    assert total["eos"] == "none" and total["scored_tokens"] == 3
    (padded,) = eval_lines(capsys, "--model", model, "--pairs", src, "--row-length", 16)
    assert padded["eos"] == "pad" and padded["scored_tokens"] == 16 - len("rev 123=")
    assert main(["eval", "--model", str(model), "--pairs", str(src), "--eos", "pad"]) == 2
    assert "--row-length" in capsys.readouterr().err


# -- acceptance: a trained model ranks the right answer first --------------------------------


def near_miss(answer: str, rng: random.Random) -> str:
    """The answer with two different digits swapped (one digit changed if all are equal)."""
    digits = list(answer)
    pairs = [(i, j) for i in range(len(digits)) for j in range(i + 1, len(digits))
             if digits[i] != digits[j]]  # fmt: skip
    if not pairs:
        digits[-1] = str((int(digits[-1]) + 1) % 10)
    else:
        i, j = rng.choice(pairs)
        digits[i], digits[j] = digits[j], digits[i]
    return "".join(digits)


@pytest.mark.slow
def test_trained_model_ranks_the_right_answer_above_a_near_miss(reverse_run, tmp_path, capsys):
    examples = heldout_examples(DataConfig.model_validate(REVERSE_RUN["data"]))
    assert len(examples) >= 100
    rng = random.Random(0)
    right = write_jsonl(tmp_path / "right.jsonl", examples)
    wrong = write_jsonl(tmp_path / "wrong.jsonl", [(p, near_miss(a, rng)) for p, a in examples])
    # the same seed: pair i of both files draws the same masks (common random numbers)
    mc = ["--per-line", "--mc-num", 64, "--batch-size", 32, "--seed", 0]
    *good, good_total = eval_lines(capsys, "--model", reverse_run, "--pairs", right, *mc)
    *bad, bad_total = eval_lines(capsys, "--model", reverse_run, "--pairs", wrong, *mc)
    assert good_total["eos"] == "pad" and good_total["row_length"] == 16
    assert [r["answer"] for r in good] == [a for _, a in examples]
    ranked = sum(g["nelbo"] < b["nelbo"] for g, b in zip(good, bad)) / len(examples)
    print(f"right answer ranked first for {ranked:.1%} of {len(examples)} held-out prompts")
    assert ranked >= 0.95
    assert good_total["nelbo_per_token"] < bad_total["nelbo_per_token"]
