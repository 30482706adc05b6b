"""Preference runs on 2 gloo processes (FSDP2) against the one-process run of the same
config: the same losses and reward margins within float tolerance, with a frozen reference
copy and with LoRA (the reference is the base with adapters off)."""

from pathlib import Path

import pytest
from conftest import read_metrics, train_in_process, write_run_config
from launch import train_in_ranks

pytestmark = pytest.mark.slow
BASE = {
    "diffusion": {"objective": "preference"},
    "preference": {"num_samples": 2, "beta": 0.5},
    "train": {"split_batches": True, "eval_steps": 0, "save_steps": 0, "logging_steps": 1,
              "max_steps": 4, "per_device_train_batch_size": 4,
              "gradient_accumulation_steps": 2},
    "eval": {"generate_accuracy": False},
}  # fmt: skip
# lora_dropout 0: dropout draws from each process's own RNG, for any objective
LORA = {"model": {"lora": True, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0}}


def write_config(root: Path, name: str, extra: dict) -> Path:
    return write_run_config(root, name, BASE, extra)


def records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("pref_dist")
    configs = [write_config(root, "full", {}), write_config(root, "lora", LORA)]
    return root, train_in_ranks(2, root / "results.json", *configs)


@pytest.mark.parametrize("name", ["full", "lora"])
def test_two_ranks_give_the_losses_of_one(runs, name):
    root, results = runs
    assert results[name]["rc"] == 0, results[name]["stderr"][-2000:]
    train_in_process(root / f"{name}.yaml", root / f"{name}-1")
    one, two = records(root / f"{name}-1"), records(root / name)
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for step in one:
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], abs=1e-5), step
        margin = one[step]["reward_margin"]
        assert two[step]["reward_margin"] == pytest.approx(margin, abs=1e-5), step
