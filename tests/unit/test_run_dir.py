"""The lines unmask/train/run_dir.py writes for a user: the resume command a stopped run
prints, and the notice for `resume_from_checkpoint: true` on a folder with no run."""

import shlex

import pytest

from unmask.config import load_config
from unmask.train.run_dir import nothing_to_resume, resume_advice, resume_command


@pytest.fixture
def one_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


def test_resume_command_repeats_the_config_and_overrides_less_the_start_keys(one_process):
    command = resume_command("runs/x", "my run.yaml", ["train.max_steps=400",
                             "train.resume_from_checkpoint=runs/x/checkpoint-2",
                             "train.overwrite_output_dir=true"])  # fmt: skip
    assert command == ("unmask train 'my run.yaml' train.max_steps=400 train.output_dir=runs/x "
                       "train.resume_from_checkpoint=true")  # fmt: skip


def test_resume_command_without_a_config_file_names_the_output_dir(one_process):
    """The built-in quickstart (no file): its overrides, once each."""
    overrides = ["train.output_dir=runs/quickstart", "train.overwrite_output_dir=true"]
    command = resume_command("runs/quickstart", None, overrides)
    assert command == ("unmask train train.output_dir=runs/quickstart "
                       "train.resume_from_checkpoint=true")  # fmt: skip
    args = shlex.split(command)[2:]  # what `unmask train` reads back
    cfg = load_config(None, args)
    assert cfg.train.output_dir == "runs/quickstart" and cfg.train.resume_from_checkpoint is True
    assert cfg.train.overwrite_output_dir is False


def test_resume_advice_under_a_launcher_says_to_launch_every_process_again(monkeypatch):
    command = resume_command("runs/x", "run.yaml")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert resume_advice(command) == (
        "resume by launching every process as before, with: unmask train run.yaml "
        "train.output_dir=runs/x train.resume_from_checkpoint=true"
    )
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resume_advice(command) == f"resume with: {command}"


def test_nothing_to_resume_names_the_folder_and_says_when_there_are_no_runs_nearby(tmp_path):
    empty = tmp_path / "runs" / "new"
    empty.mkdir(parents=True)
    assert nothing_to_resume(empty) == (
        f"warning: train.resume_from_checkpoint=true, but output_dir {str(empty)!r} is empty: "
        "starting a NEW run there. If you meant to continue a run, stop this one and fix "
        f"train.output_dir (no run with a checkpoint in {str(tmp_path / 'runs')!r})"
    )
    lost = tmp_path / "runz" / "x"
    assert nothing_to_resume(lost).endswith(
        f"does not exist: starting a NEW run there. If you meant to continue a run, stop this "
        f"one and fix train.output_dir ({str(tmp_path / 'runz')!r} does not exist either)"
    )


def test_a_heartbeat_is_a_file_runs_write_before_their_first_save(tmp_path):
    """A run killed before its first checkpoint leaves heartbeat.json (and maybe a hidden
    temporary of it): resuming starts it fresh, as for its other logs."""
    from unmask.runs.heartbeat import HEARTBEAT_FILE
    from unmask.train.run_dir import RUN_ARTIFACTS, check_fresh_start

    for name in ("config.yaml", "metrics.jsonl", HEARTBEAT_FILE, f".{HEARTBEAT_FILE}.7.tmp"):
        (tmp_path / name).write_text("{}")
    check_fresh_start(tmp_path)  # no refusal
    assert HEARTBEAT_FILE in RUN_ARTIFACTS  # an overwrite removes it with the run
