"""Training with LLaDA2.1's editing stream (`diffusion.edit_fraction`): the replacements come
from the run's noise generator, so 2 processes train as 1 (mdlm draws the global batch's
noise, edits included) and a run killed and resumed ends bit-equal to an uninterrupted one."""

from pathlib import Path

import pytest
import torch
from conftest import losses, sigkill_after_steps, train_in_process, write_run_config
from launch import train_in_ranks
from safetensors.torch import load_file

from unmask.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
BASE = {"train": {"split_batches": True, "eval_steps": 0, "save_steps": 0, "logging_steps": 1}}


def test_two_processes_train_as_one_with_edits(tmp_path):
    edit = {"diffusion": {"edit_fraction": 0.2}, "train": {"max_steps": 20}}
    cfg = write_run_config(tmp_path, "edit", BASE, edit)
    results = train_in_ranks(2, tmp_path / "results.json", cfg)
    assert results["edit"]["rc"] == 0, results["edit"]["stderr"][-2000:]
    single = losses(train_in_process(cfg, tmp_path / "edit-1"))
    double = losses(tmp_path / "edit")
    assert sorted(single) == sorted(double) == list(range(1, 21))
    for step in single:
        assert double[step] == pytest.approx(single[step], abs=1e-5), step
    # the option acts: the same run without it has another first loss
    plain = write_run_config(tmp_path, "plain", BASE, {"train": {"max_steps": 1}})
    assert losses(train_in_process(plain, tmp_path / "plain-1"))[1] != single[1]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def test_sigkill_and_resume_is_bit_equal_with_edits(tmp_path):
    # sft: each rank draws from its own generator, which the checkpoints carry
    extra = {"diffusion": {"objective": "sft", "edit_fraction": 0.3},
             "train": {"max_steps": 30, "save_steps": 1, "save_total_limit": 2}}  # fmt: skip
    reference = write_run_config(tmp_path, "ref", BASE, extra)
    assert main(["train", str(reference)]) == 0
    cfg = write_run_config(tmp_path, "run", BASE, extra)
    run = tmp_path / "run"
    sigkill_after_steps(cfg, run, 8, timeout=60)
    assert main(["train", str(cfg), "train.resume_from_checkpoint=true"]) == 0
    ref, resumed = _weights(tmp_path / "ref"), _weights(run)
    assert ref.keys() == resumed.keys() and all(torch.equal(ref[k], resumed[k]) for k in ref)
    assert losses(run) == losses(tmp_path / "ref")
