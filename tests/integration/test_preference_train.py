"""Preference runs end to end (diffusion.objective: preference): log 2 at the first step
(policy = reference), reward metrics, exact resume with and without LoRA, pair files."""

import json
import math
import shutil

import pytest
from conftest import losses, read_metrics

from unmask.cli import main
from unmask.config import load_config
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
PREF = {
    "diffusion": {"objective": "preference"},
    "preference": {"num_samples": 2, "beta": 0.5},
    "train": {"max_steps": 6, "save_steps": 3, "per_device_train_batch_size": 4},
}


def with_lora(lora: bool) -> dict:
    return {**PREF, "model": {"lora": True, "lora_r": 4, "lora_alpha": 8}} if lora else PREF


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_preference_resumes_exactly_and_starts_at_log_2(tiny_config, tmp_path, lora):
    if lora:
        pytest.importorskip("peft")
    Trainer(load_config(tiny_config(with_lora(lora)))).train()
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    full = losses(tmp_path / "run")
    # the policy starts as the reference (LoRA's B = 0; the copy): every score is 0
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert records[0]["reward_margin"] == 0.0 and records[0]["reward_accuracy"] == 0.0
    assert any(r["reward_margin"] != 0.0 for r in records[1:])
    assert all(0.0 <= r["reward_accuracy"] <= 1.0 for r in records)
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copytree(tmp_path / "run" / "checkpoint-3", stopped / "checkpoint-3")
    resume = {"train": {"output_dir": str(stopped), "resume_from_checkpoint": True}}
    cfg = load_config(tiny_config(_merge(with_lora(lora), resume), name="resume.yaml"))
    trainer = Trainer(cfg)
    assert trainer.step == 3
    trainer.train()
    again = [r for r in read_metrics(stopped) if "loss" in r]
    assert [r["step"] for r in again] == [4, 5, 6]
    for r in again:
        assert r["loss"] == full[r["step"]]  # exactly, on CPU
        assert r["reward_margin"] == records[r["step"] - 1]["reward_margin"]


def _merge(a: dict, b: dict) -> dict:
    out = {k: dict(v) for k, v in a.items()}
    for k, v in b.items():
        out[k] = {**out.get(k, {}), **v}
    return out


def test_preference_trains_on_a_pair_file_with_chat_rows(tiny_config, tmp_path):
    rows = [{"prompt": f"rev {i}{i + 1}=", "chosen": f"{i + 1}{i}", "rejected": f"{i}{i + 1}"}
            for i in range(1, 9)]  # fmt: skip
    rows.append({"chosen": [{"role": "user", "content": "rev 45="},
                            {"role": "assistant", "content": "54"}],
                 "rejected": [{"role": "user", "content": "rev 45="},
                              {"role": "assistant", "content": "45"}]})  # fmt: skip
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = _merge(PREF, {"data": {"dataset": str(data), "eval_split": 2},
                          "train": {"max_steps": 2, "save_steps": 0}})  # fmt: skip
    assert main(["train", str(tiny_config(extra))]) == 0
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert any("eval_loss" in r for r in records)
