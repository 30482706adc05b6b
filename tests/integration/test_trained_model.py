"""A small model trained here until it answers (reverse, 2-4 digits): what users do right
after the quickstart, checked against the trainer's own held-out evaluation."""

import json

import pytest
import yaml
from conftest import deep_update

from unmask.checkpoint import load_for_sampling
from unmask.cli import main
from unmask.config import load_config
from unmask.data import heldout_examples
from unmask.sampling.accuracy import heldout_accuracy
from unmask.sampling.config import EvalConfig, saved_sampling

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SMALL = {
    "model": {"model_type": "qwen3_dllm", "hidden_size": 96, "intermediate_size": 288,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 128, "tie_word_embeddings": True},
    "data": {"dataset": "synthetic", "tokenizer": "char", "packing": False,
             "packing_length": 16, "synthetic_tasks": ["reverse"], "synthetic_min_digits": 2,
             "synthetic_max_digits": 4, "synthetic_train_size": 20000,
             "synthetic_eval_size": 200},
    "diffusion": {"objective": "mdlm", "t_sampling": "antithetic"},
    "optim": {"name": "adamw", "learning_rate": 3e-3, "weight_decay": 0.01,
              "lr_scheduler_type": "cosine", "warmup_steps": 30, "min_lr_ratio": 0.05,
              "max_grad_norm": 1.0},
    "train": {"max_steps": 1500, "per_device_train_batch_size": 64, "logging_steps": 500,
              "eval_steps": 0, "save_steps": 0, "disable_tqdm": True},
    "eval": {"generate_accuracy": False},
}  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run config path, final/ folder) of the small model, trained once per module."""
    root = tmp_path_factory.mktemp("trained")
    tree = deep_update(SMALL, {"train": {"output_dir": str(root / "run")}})
    path = root / "small.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert main(["train", str(path)]) == 0
    return path, root / "run" / "final"


def test_generate_with_no_length_flag_answers_like_the_heldout_evaluation(trained, tmp_path):
    cfg_path, final = trained
    cfg = load_config(cfg_path)
    assert saved_sampling(final)["row_length"] == cfg.data.packing_length
    examples = heldout_examples(cfg.data)[:20]
    sm = load_for_sampling(final)
    accuracy, rows = heldout_accuracy(sm.model, sm.tokenizer, examples, EvalConfig(max_examples=20),
                                      cfg.data.packing_length, sm.device)  # fmt: skip
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p, _ in examples))
    out = tmp_path / "answers.jsonl"
    assert (
        main(["generate", "--model", str(final), "--prompts", str(prompts), "--out", str(out)]) == 0
    )
    answers = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    assert answers == [got for _, _, got in rows]
    right = sum(a == expected for a, (_, expected) in zip(answers, examples))
    assert right / 20 == accuracy and accuracy >= 0.3
