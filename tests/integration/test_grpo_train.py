"""`diffusion.objective: grpo` through the trainer: rollout metrics, exact resume, LoRA with
the KL to the adapter-free base, and 2 gloo ranks against 1."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY, deep_update, losses, read_metrics

from unmask.config import load_config
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

# a random tiny model never answers right: the format reward (a letter a-m anywhere) varies
# within groups, so advantages and losses are not all 0
GRPO = {
    "diffusion": {"objective": "grpo"},
    "grpo": {"group_size": 2, "log_samples": 1},
    "rewards": [
        {"fn": "format", "options": {"pattern": "[a-m]", "match": "search"}},
        {"fn": "exact_match"},
    ],  # fmt: skip
    "train": {
        "per_device_train_batch_size": 2,
        "eval_steps": 2,
        "save_steps": 2,
        "max_steps": 4,
    },  # fmt: skip
}


def write(root: Path, name: str, extra: dict) -> Path:
    tree = deep_update(deep_update(TINY, GRPO), {"train": {"output_dir": str(root / name)}})
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(deep_update(tree, extra)))
    return path


def test_grpo_logs_rollouts_and_resumes_exactly(tmp_path):
    Trainer(load_config(write(tmp_path, "run", {}))).train()
    records = read_metrics(tmp_path / "run")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        keys = {"reward_mean", "reward_std", "reward/format_mean", "reward/exact_match_std",
                "completion_length", "zero_advantage_groups", "clip_fraction",
                "generations_per_second", "samples"}  # fmt: skip
        assert keys <= set(r), set(r)
        assert 0 <= r["zero_advantage_groups"] <= 1 and r["completion_length"] > 0
        assert set(r["samples"][0]) == {"prompt", "completion", "answer", "reward"}
    # diffu-GRPO at ratio 1 on equal-length completions has loss 0, not gradient 0
    assert any(r["grad_norm"] > 0 for r in steps)
    grad_norms = {r["step"]: r["grad_norm"] for r in steps}
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    full = losses(tmp_path / "run")
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    shutil.copytree(tmp_path / "run" / "checkpoint-2", stopped / "checkpoint-2")
    cfg = write(tmp_path, "stopped", {"train": {"resume_from_checkpoint": True}})
    trainer = Trainer(load_config(cfg))
    assert trainer.step == 2
    trainer.train()
    resumed = losses(stopped)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == full[step]  # exactly, on CPU
    again = {r["step"]: r["grad_norm"] for r in read_metrics(stopped) if "grad_norm" in r}
    assert again == {3: grad_norms[3], 4: grad_norms[4]}
    final = "final/model.safetensors"
    assert (tmp_path / "run" / final).read_bytes() == (stopped / final).read_bytes()


def test_grpo_with_lora_and_kl_to_the_base(tmp_path):
    """Under LoRA the reference is the model with its adapters disabled: at step 1 the
    adapters are still 0 (peft's init), so the KL is exactly 0; then it grows."""
    extra = {"model": {"lora": True, "lora_r": 4}, "grpo": {"kl_beta": 0.1},
             "optim": {"learning_rate": 0.05}, "train": {"max_steps": 3, "eval_steps": 0,
                                                         "save_steps": 0}}  # fmt: skip
    Trainer(load_config(write(tmp_path, "lora", extra))).train()
    kl = {r["step"]: r["kl"] for r in read_metrics(tmp_path / "lora") if "kl" in r}
    assert sorted(kl) == [1, 2, 3]
    assert kl[1] == 0.0
    assert kl[3] > 0.0
    assert (tmp_path / "lora" / "final").is_dir()


@pytest.mark.slow
def test_grpo_two_ranks_match_one(tmp_path):
    """Prompt groups draw rollouts and estimator masks from their own seeds (drawn for the
    global batch): the 2-rank FSDP2 run's losses equal the 1-rank run's."""
    extra = {"train": {"split_batches": True, "per_device_train_batch_size": 4, "max_steps": 3,
                       "eval_steps": 0, "save_steps": 0},
             "grpo": {"estimator": "coupled", "loss": "spg"}}  # fmt: skip
    cfg = write(tmp_path, "two", extra)
    worker = Path(__file__).parent / "dist_workers" / "train_worker.py"
    results = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(worker), str(results), str(cfg)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(results.read_text())["two"]["rc"] == 0
    one = load_config(cfg)
    one.train = one.train.model_copy(update={"output_dir": str(tmp_path / "one")})
    Trainer(one).train()
    single, double = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(single) == sorted(double) == [1, 2, 3]
    assert any(v != 0 for v in single.values())
    for step in single:
        assert double[step] == pytest.approx(single[step], abs=1e-5), step
