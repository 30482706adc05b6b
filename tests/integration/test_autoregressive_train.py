"""`diffusion.objective: ar` end to end: a tiny run, its final folder sampled by
`unmask generate` (left to right, read from generation_config.json) and the same folder
exported and run by transformers' own greedy `generate`."""

import json

import pytest
import torch
import transformers
from conftest import read_metrics

from unmask.cli import main
from unmask.data.tokenizer import load_local_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["rev 123=", "sort 4=", "add 12+7="]


@pytest.fixture(scope="module")
def ar_run(tmp_path_factory):
    from conftest import write_run_config

    root = tmp_path_factory.mktemp("ar")
    config = write_run_config(root, "ar", {}, {"diffusion": {"objective": "ar"},
                                               "train": {"max_steps": 12}})  # fmt: skip
    assert main(["train", str(config)]) == 0
    return root / "ar"


def test_ar_run_trains_and_records_left_to_right_sampling(ar_run):
    saved = json.loads((ar_run / "final" / "generation_config.json").read_text())["unmask"]
    assert saved["autoregressive"] is True
    loss = [r["loss"] for r in read_metrics(ar_run) if "loss" in r]
    assert len(loss) == 12 and loss[-1] < loss[0]


@pytest.fixture(scope="module")
def random_ar_folder(tmp_path_factory):
    """A random tiny model tagged as an ar model (its answers are not all EOS, unlike a
    12-step run's)."""
    from conftest import save_tiny_model

    folder = save_tiny_model(tmp_path_factory.mktemp("random") / "model", seed=1)
    (folder / "generation_config.json").write_text(json.dumps({"unmask": {"autoregressive": True}}))
    return folder


@pytest.mark.parametrize("which", ["trained", "random"])
def test_generate_equals_transformers_greedy_on_the_exported_folder(
    ar_run, random_ar_folder, tmp_path, which
):
    final = ar_run / "final" if which == "trained" else random_ar_folder
    out = tmp_path / "gen.jsonl"
    assert main(["generate", "--model", str(final), "--prompt", PROMPTS[0], "--prompt",
                 PROMPTS[1], "--prompt", PROMPTS[2], "--gen-length", "10", "--out",
                 str(out)]) == 0  # fmt: skip
    records = [json.loads(line) for line in out.read_text().splitlines()]
    if which == "random":
        assert all(len(r["completion"]) >= 3 for r in records)  # something to compare
    exported = tmp_path / "hf"
    assert main(["export", str(final), "--out", str(exported)]) == 0

    tokenizer = load_local_tokenizer(exported)
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).float().eval()
    for record, prompt in zip(records, PROMPTS):
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                             do_sample=False, eos_token_id=None,
                             pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:]  # fmt: skip
        answer = greedy.tolist()
        eos = tokenizer.eos_token_id
        answer = answer[: answer.index(eos)] if eos in answer else answer
        assert record["completion"] == tokenizer.decode(answer, skip_special_tokens=True)
