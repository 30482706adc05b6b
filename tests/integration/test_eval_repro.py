"""`unmask eval --tasks`: presets, the results file, and reproducibility.

The tasks are YAML files and jsonl data the test writes (lm-eval's `--include-path` style),
run with the hub and datasets offline. The same command run twice, in two processes with
different hash seeds, must write byte-identical files but for the `wall_clock` entry."""

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model, write_toy_tasks
from torch import nn

pytest.importorskip("lm_eval")

from unmask.checkpoint import load_for_sampling  # noqa: E402
from unmask.cli import main  # noqa: E402
from unmask.sampling.config import SamplingConfig, resolve_sampling  # noqa: E402
from unmask.sampling.texts import generate_texts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
REPO = Path(__file__).resolve().parents[2]

QUESTIONS = [
    {"question": "rev 12=", "choices": ["21", "12", "3"], "label": 0},
    {"question": "sort 31=", "choices": ["13", "31", "9"], "label": 0},
    {"question": "add 1+1=", "choices": ["5", "2", "7"], "label": 1},
]
#: a chat template over the char tokenizer's alphabet
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("repro") / "model", seed=2)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "chat_template": TEMPLATE}))  # fmt: skip
    return folder


def without_wall_clock(text: str) -> str:
    """The results file's text less its `wall_clock` entry (the only one allowed to vary)."""
    return re.sub(r'\n  "wall_clock": \{[^}]*\}', "", text)


@pytest.mark.slow
def test_base_preset_results_reproduce_across_processes(model_dir, tmp_path, offline):
    tasks = write_toy_tasks(tmp_path / "tasks", QUESTIONS)
    out = tmp_path / "results.json"
    args = ["eval", "--model", str(model_dir), "--tasks", "toy_mc,toy_gen", "--include-path",
            str(tasks), "--preset", "base", "--mc-num", "4", "--batch-size", "2",
            "--temperature", "0.8", "--block-length", "2", "--seed", "5", "--log-samples",
            "--out", str(out)]  # fmt: skip
    command = [sys.executable, "-m", "unmask", *args]
    texts = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO)}  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        texts.append(out.read_text())
        out.unlink()
    first, second = texts
    assert first != second  # the wall clock moved...
    assert without_wall_clock(first) == without_wall_clock(second)  # ...and nothing else
    # in this process (other global RNG states, modules already imported): the same bytes;
    # another seed: other numbers (the seeds reach the draws)
    random.seed(99), torch.manual_seed(99)
    assert main(args) == 0
    assert without_wall_clock(out.read_text()) == without_wall_clock(first)
    at = args.index("--seed") + 1
    assert main([*args[:at], "6", *args[at + 1 :]]) == 0
    assert without_wall_clock(out.read_text()) != without_wall_clock(first)
    tree = json.loads(first)
    assert sorted(tree["wall_clock"]) == ["finished_at", "generated_tokens_per_second",
                                          "generation_seconds", "seconds", "started_at"]  # fmt: skip
    assert "wall_clock" not in without_wall_clock(first)
    head = tree["unmask"]
    assert head["preset"] == "base" and head["mode"] == "likelihood"
    assert head["chat_template"] is False
    assert head["seed"] == 5 and head["seeds"]["torch"] == 5
    assert head["likelihood"]["mc_num"] == 4 and head["likelihood"]["mc_batch_size"] == 2
    assert sorted(head["versions"]) == ["datasets", "lm_eval", "numpy", "python", "tokenizers",
                                        "torch", "transformers", "unmask"]  # fmt: skip
    assert head["versions"]["torch"] == torch.__version__.split("+")[0] or \
        head["versions"]["torch"] == torch.__version__  # fmt: skip
    # every sampler setting, the flags over the folder's
    assert sorted(head["sampling"]) == sorted(SamplingConfig.model_fields)
    assert head["sampling"]["temperature"] == 0.8 and head["sampling"]["block_length"] == 2
    (generation,) = head["generations"]
    assert sorted(generation["sampling"]) == sorted(SamplingConfig.model_fields)
    assert generation["sampling"]["gen_length"] == 6 and generation["requests"] == 3
    assert head["task_output_types"] == {"toy_gen": "generate_until",
                                         "toy_mc": "multiple_choice"}  # fmt: skip
    assert set(tree["results"]) == {"toy_mc", "toy_gen"}
    # throughput counts generated tokens: the responses' tokens, not the 3 x 6 canvas
    responses = [s["resps"][0][0] for s in tree["samples"]["toy_gen"]]
    assert tree["throughput"]["canvas_tokens"] == 18
    assert tree["throughput"]["generated_tokens"] <= 18
    assert tree["throughput"]["generation_requests"] == 3
    assert tree["throughput"]["likelihood_requests"] == 9
    assert tree["throughput"]["scored_tokens"] == sum(len(c) for q in QUESTIONS
                                                      for c in q["choices"])  # fmt: skip
    assert all(isinstance(r, str) for r in responses)


def test_instruct_preset_generates_from_the_chat_template(model_dir, tmp_path, offline, capsys):
    tasks = write_toy_tasks(tmp_path / "tasks", QUESTIONS)
    out = tmp_path / "results.json"
    assert main(["eval", "--model", str(model_dir), "--tasks", str(tasks / "gen.yaml"),
                 "--preset", "instruct", "--log-samples", "--out", str(out)]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "toy_gen: exact_match" in err and "generated tokens/s" in err
    tree = json.loads(out.read_text())
    head = tree["unmask"]
    assert head["preset"] == "instruct" and head["mode"] == "generation"
    assert head["chat_template"] is True and len(head["chat_template_sha256"]) == 64
    assert head["sampling_preset"] == {"temperature": 0.0, "remasking": "low_confidence",
                                       "block_length": 32}  # fmt: skip
    # oracle: unmask's own batched generation on the chat-templated prompts, with the
    # preset's settings (a 6-token answer: one block of 6, one token per step)
    sm = load_for_sampling(model_dir)
    prompts = [sm.tokenizer.apply_chat_template([{"role": "user", "content": q["question"]}],
                                                tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS]  # fmt: skip
    assert prompts[0] == "user: rev 12=\nassistant: "
    options = resolve_sampling(sm.saved, dict(gen_length=6, block_length=6, steps=6))
    ours = generate_texts(sm, prompts, options, generator=torch.Generator().manual_seed(0))
    samples = sorted(tree["samples"]["toy_gen"], key=lambda s: s["doc_id"])
    assert [s["arguments"][0][0] for s in samples] == prompts
    assert [s["resps"][0][0] for s in samples] == [r["completion"].split("\n")[0] for r in ours]
    assert tree["throughput"]["generated_tokens"] == sum(r["tokens"] for r in ours)
    assert tree["throughput"]["canvas_tokens"] == 3 * 6
    expected = sum(r["completion"].split("\n")[0] == q["choices"][q["label"]]
                   for r, q in zip(ours, QUESTIONS)) / len(QUESTIONS)  # fmt: skip
    assert tree["results"]["toy_gen"]["exact_match,none"] == pytest.approx(expected)


def test_base_preset_scores_choices_with_the_mc_elbo(model_dir, tmp_path, offline, capsys):
    """Multiple choice by likelihood: every choice's score in the results file is the
    adapter's Monte Carlo ELBO of request i drawn from seed + i (`answer_log_likelihood`,
    the estimator of `unmask eval --pairs`), and acc picks the best-scored choice."""
    from unmask.sampling.likelihood import (
        answer_log_likelihood,
        continuation_ids,
        item_generator,
    )

    tasks = write_toy_tasks(tmp_path / "tasks", QUESTIONS)
    assert main(["eval", "--model", str(model_dir), "--tasks", "toy_mc", "--include-path",
                 str(tasks), "--mc-num", "4", "--batch-size", "2", "--seed", "7",
                 "--log-samples"]) == 0  # fmt: skip
    tree = json.loads(capsys.readouterr().out)  # no --out: the results on stdout
    assert tree["unmask"]["likelihood"]["mc_num"] == 4
    sm = load_for_sampling(model_dir)
    picks = []
    for sample in sorted(tree["samples"]["toy_mc"], key=lambda s: s["doc_id"]):
        q = QUESTIONS[sample["doc_id"]]
        scores = [r[0][0] for r in sample["resps"]]
        for number, choice in enumerate(q["choices"]):
            ctx, cont = continuation_ids(sm.tokenizer, q["question"], choice)
            index = 3 * sample["doc_id"] + number  # lm-eval's request order
            est = answer_log_likelihood(sm, ctx, cont, mc_num=4, batch_size=2,
                                        generator=item_generator(7, index))  # fmt: skip
            assert scores[number] == pytest.approx(est.value, abs=1e-6)
        picks.append(max(range(3), key=lambda c: scores[c]) == q["label"])
    assert tree["results"]["toy_mc"]["acc,none"] == pytest.approx(sum(picks) / len(picks))


class AnswersThenStops(nn.Module):
    """A stand-in model: on a canvas whose last `gen` positions are the answer, the first
    `answer` of them read '7' (confident), the rest EOS: every row says "77" and stops."""

    def __init__(self, vocab: int, digit: int, eos: int, gen: int, answer: int) -> None:
        super().__init__()
        self.vocab, self.digit, self.eos, self.gen, self.answer = vocab, digit, eos, gen, answer

    def forward(self, x, **kwargs):
        batch, length = x.shape
        logits = torch.zeros(batch, length, self.vocab)
        start = length - self.gen
        logits[:, :, self.eos] = 5.0
        logits[:, start : start + self.answer, self.digit] = 10.0
        return logits


def test_throughput_counts_generated_tokens_only(model_dir, tmp_path, offline, monkeypatch,
                                                 capsys):  # fmt: skip
    """A model that answers 2 tokens then EOS on a 6-token canvas: 2 generated tokens per
    prompt, never the canvas, the padding or the prompt."""
    import unmask.eval.harness as harness

    def stopping(*args, **kwargs):
        sm = load_for_sampling(*args, **kwargs)
        tok = sm.tokenizer
        (digit,) = tok("7", add_special_tokens=False)["input_ids"]
        sm.model = AnswersThenStops(len(tok), digit, sm.eos_id, gen=6, answer=2)
        return sm

    monkeypatch.setattr(harness, "load_for_sampling", stopping)
    tasks = write_toy_tasks(tmp_path / "tasks", QUESTIONS)
    assert main(["eval", "--model", str(model_dir), "--tasks", str(tasks / "gen.yaml"),
                 "--preset", "instruct", "--log-samples"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    tree = json.loads(captured.out)
    assert [s["resps"][0][0] for s in tree["samples"]["toy_gen"]] == ["77"] * 3
    assert tree["throughput"]["generated_tokens"] == 3 * 2
    assert tree["throughput"]["canvas_tokens"] == 3 * 6
    assert tree["throughput"]["generation_requests"] == 3
    seconds, rate = (tree["wall_clock"][k] for k in ("generation_seconds",
                                                     "generated_tokens_per_second"))  # fmt: skip
    assert rate is None if seconds == 0 else rate == pytest.approx(6 / seconds, rel=1e-3)
    assert "unmask: 6 generated tokens for 3 prompt(s)" in captured.err
    # tokens per forward: generated tokens over forward calls times the rows in them
    stats = tree["throughput"]
    assert stats["row_forwards"] >= stats["forward_passes"] >= 1
    assert stats["tokens_per_forward"] == round(6 / stats["row_forwards"], 4)
    assert f"{stats['tokens_per_forward']} tokens per forward" in captured.err


def test_instruct_prompts_without_a_chat_template_are_the_sft_rows_prompts(tmp_path):
    """A tokenizer with no chat template: the instruct preset's prompt is the prompt unmask's
    SFT rows were built with (`split_chat`), so the model sees what it was trained on."""
    from unmask.data.sft import split_chat
    from unmask.eval.harness import UnmaskLM

    lm = UnmaskLM(pretrained=str(save_tiny_model(tmp_path / "model")))
    assert not getattr(lm.sm.tokenizer, "chat_template", None) and lm.chat_template() == ""
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "rev 12="}]
    prompt, answer = split_chat(lm.sm.tokenizer, [*turns, {"role": "assistant", "content": "21"}])
    assert lm.apply_chat_template(turns) == prompt == "system: be brief\nuser: rev 12=\nassistant: "
    prefilled = [*turns, {"role": "assistant", "content": "21"}]
    assert lm.apply_chat_template(prefilled, add_generation_prompt=False) == prompt + answer


def test_a_decoder_that_edits_reports_its_edits(model_dir, tmp_path, offline, capsys):
    """joint_threshold's edits (issue 55: totals in every summary line): summed over the
    generations in the results' throughput and on the summary line; a decoder that never
    edits reports none."""
    tasks = write_toy_tasks(tmp_path / "tasks", QUESTIONS)
    args = ["eval", "--model", str(model_dir), "--tasks", str(tasks / "gen.yaml"),
            "--preset", "instruct", "--log-samples"]  # fmt: skip
    assert main([*args, "--decoder", "joint_threshold", "--joint-preset", "speedy",
                 "--threshold", "0.2", "--edit-threshold", "0.0"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    stats = json.loads(captured.out)["throughput"]
    assert isinstance(stats["edits"], int) and stats["edits"] >= 0
    assert f"tokens per forward, {stats['edits']} edits" in captured.err
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "edits" not in json.loads(captured.out)["throughput"]
    assert " edits" not in captured.err.splitlines()[-1]
