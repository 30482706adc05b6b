"""A sampler algorithm added from outside the package, as docs/architecture.md says (Where
to add, a sampler algorithm): a confidence score registered with `register_confidence`
becomes a `remasking` value of SamplingConfig, of `sample`, of `unmask generate
--remasking` and of generation_config.json, with no edit of unmask/."""

import json

import pytest
import torch
from conftest import save_tiny_model

from unmask.checkpoint import load_for_sampling
from unmask.cli import main
from unmask.errors import InputError
from unmask.sampling import SamplingConfig, register_confidence, resolve_sampling, sample
from unmask.sampling.generation_file import GENERATION_FILE, generation_config_text, saved_sampling
from unmask.sampling.transfer import CONFIDENCE_FNS

pytestmark = pytest.mark.usefixtures("one_thread")
GEN = 6
calls = []  # one entry per call of the toy score
canvases = []  # the canvas after every step of a CLI run (tokens hook)


def right_first(logits, probs, x0, generator=None) -> torch.Tensor:
    """The toy score: a position's index, so the rightmost masked position is committed
    first and an answer is written right to left whatever the model says."""
    calls.append(x0.shape)
    batch, length = x0.shape
    return torch.arange(length, dtype=torch.float64, device=x0.device).expand(batch, length)


def record_canvas(step, x, logits):
    """A tokens hook (--tokens-hook MODULE:record_canvas): keeps the canvas of each step."""
    canvases.append(x.clone())
    return x


@pytest.fixture
def toy():
    register_confidence("toy", right_first)
    calls.clear()
    canvases.clear()
    yield "toy"
    CONFIDENCE_FNS.pop("toy")  # the registry is process-wide: leave it as it was


def commit_order(steps: list[torch.Tensor], start: int) -> list[int]:
    """Answer positions (from `start`) committed at each step: where the canvas changed."""
    order = []
    for before, after in zip(steps, steps[1:]):
        changed = (before[0] != after[0]).nonzero().squeeze(1).tolist()
        order += [p - start for p in changed]
    return order


def test_a_toy_confidence_registered_from_outside_decodes(toy, tmp_path):
    folder = save_tiny_model(tmp_path / "model")
    with pytest.raises(ValueError, match="already registered"):
        register_confidence("toy", right_first)
    sm = load_for_sampling(folder, device="cpu")
    prompt = "rev 12="
    ids = torch.tensor([sm.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    start = ids.shape[1]

    # the Python API: one position per step, right to left
    config = SamplingConfig(gen_length=GEN, steps=GEN, remasking=toy, history=True)
    out = sample(sm.model, ids, config, mask_id=sm.mask_id, eos_id=sm.eos_id, pad_id=sm.pad_id)
    first = torch.full((1, start + GEN), sm.mask_id)
    first[:, :start] = ids
    assert commit_order([first, *out.history], start) == list(range(GEN - 1, -1, -1))
    assert len(calls) == GEN and not (out.answers == sm.mask_id).any()
    greedy = sample(sm.model, ids, config.updated(remasking="low_confidence"), mask_id=sm.mask_id)
    assert commit_order([first, *greedy.history], start) != list(range(GEN - 1, -1, -1))

    # the command line: --remasking toy is a choice, and the same order and tokens come out
    answers = tmp_path / "answers.jsonl"
    args = ["generate", "--model", str(folder), "--prompt", prompt, "--gen-length", str(GEN),
            "--steps", str(GEN), "--device", "cpu", "--out", str(answers),
            "--tokens-hook", f"{__name__}:record_canvas"]  # fmt: skip
    assert main([*args, "--remasking", toy]) == 0
    assert commit_order(canvases, start) == list(range(GEN - 1, -1, -1))
    assert torch.equal(torch.stack(canvases[1:]), torch.stack(out.history))
    answer = out.answers[0].tolist()
    answer = answer[: answer.index(sm.eos_id)] if sm.eos_id in answer else answer
    completion = json.loads(answers.read_text())["completion"]
    assert completion == sm.tokenizer.decode(answer, skip_special_tokens=True)

    # a model folder's generation_config.json may name it, and is then sampled with it
    (folder / GENERATION_FILE).write_text(generation_config_text(sm.tokenizer, {"remasking": toy},
                                                                 complete=False))  # fmt: skip
    assert resolve_sampling(saved_sampling(folder)).remasking == toy
    canvases.clear()
    assert main(args) == 0
    assert commit_order(canvases, start) == list(range(GEN - 1, -1, -1))


def test_an_unregistered_score_is_refused_with_the_choices():
    with pytest.raises(
        InputError,
        match=r"unknown remasking 'toy2'( \(did you mean '\w+'\?\))?; expected one "
        r"of \[.*'entropy'",
    ):
        resolve_sampling({"remasking": "toy2"})
    assert main(["generate", "--model", "m", "--remasking", "toy2"]) == 2
    with pytest.raises(ValueError, match="a confidence name is a Python identifier"):
        register_confidence("my toy", lambda *a: None)
    with pytest.raises(ValueError, match="already registered"):
        register_confidence("origin", lambda *a: None)
