"""The lm-eval adapter: registered as `unmask`, built from a model_args string, and run by
lm-eval itself on local multiple-choice and generation tasks written by the test."""

import json

import pytest
import torch
from conftest import save_tiny_model

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from unmask.checkpoint import load_for_sampling  # noqa: E402
from unmask.cli import main  # noqa: E402
from unmask.eval.harness import UnmaskLM  # noqa: E402
from unmask.models import from_pretrained  # noqa: E402
from unmask.sampling.config import resolve_sampling  # noqa: E402
from unmask.sampling.likelihood import log_likelihood  # noqa: E402
from unmask.sampling.texts import generate_texts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


QUESTIONS = [
    {"question": "rev 12=", "choices": ["2", "1", "3"], "label": 0},
    {"question": "sort 31=", "choices": ["1", "3", "9"], "label": 0},
    {"question": "add 1+1=", "choices": ["5", "2", "7"], "label": 1},
    {"question": "rev 45=", "choices": ["4", "6", "5"], "label": 2},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("harness") / "model", seed=1)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A mixture-of-experts DLM (Qwen3-MoE layout: 4 experts, top 2) for the same checks."""
    return save_tiny_model(tmp_path_factory.mktemp("harness_moe") / "model", seed=1,
                           model_type="qwen3_moe_dllm", num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=16)  # fmt: skip


@pytest.fixture(params=["dense", "moe"])
def any_dir(request):
    return request.getfixturevalue("model_dir" if request.param == "dense" else "moe_dir")


def test_registered_and_built_from_an_arg_string(model_dir):
    assert get_model("unmask") is UnmaskLM
    assert issubclass(UnmaskLM, LM) and not UnmaskLM.__abstractmethods__
    lm = UnmaskLM.create_from_arg_string(f"pretrained={model_dir},mc_num=4,threshold=0.9")
    assert isinstance(lm, LM)
    assert lm.mc_num == 4 and lm.sampling == {"threshold": 0.9}
    with pytest.raises(ValueError, match="unknown model_args"):
        UnmaskLM.create_from_arg_string(f"pretrained={model_dir},mcnum=4")


def exact_choice_logprob(model, tok, question, choice):
    ids = tok(question, add_special_tokens=False)["input_ids"]
    (target,) = tok(choice, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids + [tok.mask_token_id]]))[0, -1]
    return torch.log_softmax(logits.double(), -1)[target].item()


def test_loglikelihood_requests_are_exact_for_one_token(any_dir):
    model_dir = any_dir
    lm = UnmaskLM(pretrained=str(model_dir), mc_num=8)
    sm = load_for_sampling(model_dir)
    requests = [Instance("loglikelihood", {}, (q["question"], c), i)
                for i, q in enumerate(QUESTIONS) for c in q["choices"]]  # fmt: skip
    got = lm.loglikelihood(requests)
    for request, (value, greedy) in zip(requests, got):
        expected = exact_choice_logprob(sm.model, sm.tokenizer, *request.args)
        assert value == pytest.approx(expected, abs=1e-5) and greedy is False
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("ab",), 0)])
    tok = sm.tokenizer
    ids = torch.tensor(tok("ab", add_special_tokens=False)["input_ids"])
    est = log_likelihood(from_pretrained(model_dir).eval(), ids[:0], ids, mask_id=tok.mask_token_id,
                         mc_num=8, batch_size=16, generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert rolling[0] == pytest.approx(est.value, abs=1e-6)


def test_logit_shift_models_score_from_the_output_before(model_dir):
    # a Dream-style model (shift_logits): an empty context reads the first answer token
    # from an EOS in front; rolling scores each token from the one before it
    lm = UnmaskLM(pretrained=str(model_dir), mc_num=8, shift_logits=True)
    sm = load_for_sampling(model_dir)
    tok, eos = sm.tokenizer, sm.tokenizer.eos_token_id
    (token,) = tok("7", add_special_tokens=False)["input_ids"]
    ((value, _),) = lm.loglikelihood([Instance("loglikelihood", {}, ("", "7"), 0)])
    with torch.no_grad():
        logits = sm.model(torch.tensor([[eos, tok.mask_token_id]]))[0, 0]
    assert value == pytest.approx(torch.log_softmax(logits.double(), -1)[token].item(), abs=1e-5)
    lm.max_length = 2  # chunks of one token after the one before: every term exact
    (rolling,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("123",), 0)])
    ids = tok("123", add_special_tokens=False)["input_ids"]
    expected = 0.0
    for before, after in zip(ids, ids[1:]):
        with torch.no_grad():
            logits = sm.model(torch.tensor([[before, tok.mask_token_id]]))[0, 0]
        expected += torch.log_softmax(logits.double(), -1)[after].item()
    assert rolling == pytest.approx(expected, abs=1e-5)


def test_loglikelihood_is_the_estimator_of_unmask_eval_pairs(model_dir, tmp_path, capsys):
    # multi-token continuations (the Monte Carlo path): request i and pair i of
    # `unmask eval --pairs --eos none` draw their masks from the same seed + i
    pairs = [("rev 123=", "321"), ("sort 31=", "13"), ("add 12+07=", "019")]
    lm = UnmaskLM(pretrained=str(model_dir), mc_num=8, mc_batch_size=4, seed=3)
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i)
                            for i, pair in enumerate(pairs)])  # fmt: skip
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in pairs))
    assert main(["eval", "--model", str(model_dir), "--pairs", str(src), "--per-line", "--eos",
                 "none", "--mc-num", "8", "--batch-size", "4", "--seed", "3"]) == 0  # fmt: skip
    *records, _ = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == len(pairs)
    for (value, _), record in zip(got, records):
        assert value == pytest.approx(-record["nelbo"], abs=1e-6)


def write_tasks(folder, data_file):
    mc = f"""task: unmask_toy_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_file}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
"""
    gen = f"""task: unmask_toy_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data_file}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[label]}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
"""
    (folder / "mc.yaml").write_text(mc)
    (folder / "gen.yaml").write_text(gen)


@pytest.mark.slow
def test_lm_eval_runs_local_tasks_offline(any_dir, tmp_path, monkeypatch):
    model_dir = any_dir
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    write_tasks(tmp_path, data)
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model="unmask", model_args=f"pretrained={model_dir},mc_num=4,block_length=2",
        tasks=["unmask_toy_mc", "unmask_toy_gen"], task_manager=manager, log_samples=True,
        bootstrap_iters=0,
    )  # fmt: skip
    sm = load_for_sampling(model_dir)
    picks = [max(range(3), key=lambda c: exact_choice_logprob(sm.model, sm.tokenizer,
                                                             q["question"], q["choices"][c]))
             for q in QUESTIONS]  # fmt: skip
    expected_acc = sum(p == q["label"] for p, q in zip(picks, QUESTIONS)) / len(QUESTIONS)
    assert results["results"]["unmask_toy_mc"]["acc,none"] == pytest.approx(expected_acc)
    # generation: the same completions as unmask's own batched generation
    options = resolve_sampling(sm.saved, dict(gen_length=6, steps=6, block_length=2))
    ours = generate_texts(sm, [q["question"] for q in QUESTIONS], options)
    responses = [s["resps"][0][0] for s in results["samples"]["unmask_toy_gen"]]
    expected = [r["completion"].split("\n")[0] for r in ours]
    assert sorted(responses) == sorted(expected)


@pytest.mark.slow
def test_unmask_lm_eval_command_line(model_dir, tmp_path, monkeypatch, capsys):
    """`unmask-lm-eval` = lm-eval's own CLI with the model registered (cuda default -> cpu)."""
    from unmask.eval.harness import cli

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    write_tasks(tmp_path, data)
    cli(["--model", "unmask", "--model_args", f"pretrained={model_dir},mc_num=2",
         "--tasks", "unmask_toy_mc", "--include_path", str(tmp_path)])  # fmt: skip
    sm = load_for_sampling(model_dir)
    picks = [max(range(3), key=lambda c: exact_choice_logprob(sm.model, sm.tokenizer,
                                                             q["question"], q["choices"][c]))
             for q in QUESTIONS]  # fmt: skip
    acc = sum(p == q["label"] for p, q in zip(picks, QUESTIONS)) / len(QUESTIONS)
    row = next(line for line in capsys.readouterr().out.splitlines() if "unmask_toy_mc" in line)
    assert f"|{acc:.2f}|" in row.replace(" ", "").replace("↑", "")


def picture_requests(rows: list[tuple[str, list]]) -> list:
    """generate_until Instances of task 'pics', one per (prompt, pictures) row (lm-eval's
    `visual`), all in one generation setting."""
    return [Instance("generate_until", {}, (prompt, {"until": ["\n"], "max_gen_toks": 4},
                                            {"visual": visual}),
                     idx=0, metadata=("pics", doc_id, 1))
            for doc_id, (prompt, visual) in enumerate(rows)]  # fmt: skip


@pytest.mark.parametrize("bad", ["missing", "huge", "wrong_type"])
def test_pictures_are_checked_first_and_patched_one_prompt_at_a_time(model_dir, tmp_path,
                                                                     monkeypatch, bad):  # fmt: skip
    """generate_until reads and checks every request's pictures before it decodes any
    prompt (a bad picture in the last request: one line, nothing decoded, no patches
    built); with good pictures each prompt's patches are built just before it is decoded
    and dropped after (the previous prompt's are gone when the next are built)."""
    import weakref

    from conftest import huge_png
    from PIL import Image

    import unmask.eval.harness as harness
    from unmask.errors import InputError

    for name, color in (("a.png", "red"), ("b.png", "blue")):
        Image.new("RGB", (8, 8), color).save(tmp_path / name)
    (tmp_path / "huge.png").write_bytes(huge_png(20_000, 10_000))
    lm = UnmaskLM.create_from_arg_string(f"pretrained={model_dir}")
    lm.picture_roots = {"pics": tmp_path}
    events: list[tuple] = []
    built: list = []

    class Patches:  # stands in for PromptImages (the text model has no vision tower)
        def __init__(self, opened):
            self.sizes = [picture.size for picture in opened]

    def prompt_images(model, folder, opened):
        assert all(ref() is None for ref in built), "a previous prompt's patches are held"
        patches = Patches(opened)
        built.append(weakref.ref(patches))
        events.append(("patches", len(opened)))
        return patches

    def generate_texts(sm, contexts, options, batch_size, generator, pictures=None):
        events.append(("decode", contexts[0], None if pictures is None else pictures.sizes))
        return [{"completion": "ok", "tokens": 1, "nfe": 1, "seconds": 0.0, "batch": 0}]

    monkeypatch.setattr(harness, "require_vision", lambda model: None)
    monkeypatch.setattr(harness, "image_processor", lambda folder: None)
    monkeypatch.setattr(harness, "prompt_images", prompt_images)
    monkeypatch.setattr(harness, "generate_texts", generate_texts)
    last = {"missing": ["nope.png"], "huge": ["huge.png"], "wrong_type": [3]}[bad]
    rows = [("q0", ["a.png"]), ("q1", ["b.png", "a.png"]), ("q2", []), ("q3", last)]
    with pytest.raises(InputError, match="task 'pics' document 3: "):
        lm.generate_until(picture_requests(rows))
    assert events == []  # nothing decoded, no patches built
    rows[-1] = ("q3", ["b.png"])
    assert lm.generate_until(picture_requests(rows)) == ["ok"] * 4
    assert events == [("patches", 1), ("decode", "q0", [(8, 8)]),
                      ("patches", 2), ("decode", "q1", [(8, 8), (8, 8)]),
                      ("decode", "q2", None),
                      ("patches", 1), ("decode", "q3", [(8, 8)])]  # fmt: skip
