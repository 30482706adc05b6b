"""train.async_checkpoint: checkpoints written in the background (DCP's async_save) train
and resume exactly like synchronous ones, and no folder looks complete before its write
finished."""

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import by_step, losses, read_metrics, tiny_model, write_run_config
from launch import train_in_ranks
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from unmask.checkpoint import Checkpointer, is_distributed_checkpoint, list_checkpoints
from unmask.cli import main
from unmask.config import load_config
from unmask.errors import RunStopped
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
TRAIN = {"max_steps": 9, "save_steps": 3, "eval_steps": 3, "logging_steps": 1}


def _final(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def test_async_run_and_resume_match_the_synchronous_run(tiny_config, tmp_path):
    ref = tiny_config({"train": {**TRAIN, "output_dir": str(tmp_path / "ref")}}, "ref.yaml")
    assert main(["train", str(ref)]) == 0
    cfg = tiny_config({"train": {**TRAIN, "async_checkpoint": True}})
    run = tmp_path / "run"
    assert main(["train", str(cfg)]) == 0
    assert losses(run) == losses(tmp_path / "ref")
    saved = list_checkpoints(run)
    assert [p.name for p in saved] == ["checkpoint-3", "checkpoint-6", "checkpoint-9"]
    assert all(is_distributed_checkpoint(p) and (p / "manifest.json").is_file() for p in saved)
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # no temporaries
    out = tmp_path / "exported"  # the one-process DCP checkpoint exports to the final weights
    assert main(["export", str(saved[-1]), "--out", str(out)]) == 0
    final = _final(run)
    assert all(
        torch.equal(final[k], v) for k, v in load_file(str(out / "model.safetensors")).items()
    )
    stalls = by_step(run, "save_stall_seconds")
    assert sorted(stalls) == [3, 6, 9] and all(s >= 0 for s in stalls.values())
    # resume from the middle checkpoint: the same losses and weights as the uninterrupted run
    resume = f"train.resume_from_checkpoint={run / 'checkpoint-3'}"
    assert main(["train", str(cfg), resume]) == 0
    assert losses(run) == losses(tmp_path / "ref")
    reference = _final(tmp_path / "ref")
    assert all(torch.equal(reference[k], v) for k, v in _final(run).items())


def _tiny_model_and_optimizer():
    model = tiny_model(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.zeros(1, 4, dtype=torch.long)).float().sum().backward()
    optimizer.step()  # optimizer state to save
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


@pytest.fixture
def held_writes(monkeypatch):
    """DCP's file writes wait for the returned event (or raise when failing[0] is set)."""
    release, failing = threading.Event(), [False]
    write_data = FileSystemWriter.write_data

    def held(self, plan, planner):
        assert release.wait(30)
        if failing[0]:
            raise OSError("No space left on device")
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", held)
    return release, failing


def test_state_is_copied_before_save_returns_and_published_only_once_written(tmp_path, held_writes):
    release, _ = held_writes
    model, optimizer, scheduler = _tiny_model_and_optimizer()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointer = Checkpointer(tmp_path, async_save=True, save_total_limit=1)
    path = checkpointer.save(1, model, optimizer, scheduler, {"loader": {}}, {})
    with torch.no_grad():  # the next step changes the parameters in place
        for param in model.parameters():
            param.add_(1.0)
    assert list_checkpoints(tmp_path) == []  # still being written: nothing looks complete
    (writing,) = tmp_path.iterdir()
    assert writing.name.startswith(".tmp-checkpoint-1")
    release.set()
    assert checkpointer.wait() == path and list_checkpoints(tmp_path) == [path]
    checkpointer.save(2, model, optimizer, scheduler, {"loader": {}}, {})
    checkpointer.wait()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2"]  # rotation
    fresh, fresh_optimizer, fresh_scheduler = _tiny_model_and_optimizer()
    checkpointer.load(path.with_name("checkpoint-2"), fresh, fresh_optimizer, fresh_scheduler)
    assert all(torch.equal(fresh.state_dict()[k], v + 1.0) for k, v in expected.items())


def test_staged_copy_holds_the_values_at_the_save(tmp_path, held_writes):
    release, _ = held_writes
    model, optimizer, scheduler = _tiny_model_and_optimizer()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointer = Checkpointer(tmp_path, async_save=True)
    path = checkpointer.save(1, model, optimizer, scheduler, {"loader": {}}, {})
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(-3.0)
    release.set()
    checkpointer.wait()
    fresh, fresh_optimizer, fresh_scheduler = _tiny_model_and_optimizer()
    with torch.no_grad():
        for param in fresh.parameters():
            param.zero_()
    checkpointer.load(path, fresh, fresh_optimizer, fresh_scheduler)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())


def test_a_failed_write_raises_at_the_wait_and_leaves_no_checkpoint(tmp_path, held_writes):
    release, failing = held_writes
    failing[0] = True
    model, optimizer, scheduler = _tiny_model_and_optimizer()
    checkpointer = Checkpointer(tmp_path, async_save=True)
    checkpointer.save(1, model, optimizer, scheduler, {"loader": {}}, {})
    release.set()
    with pytest.raises(
        RunStopped,
        match=r"^checkpoint-1 could not be written \(OSError: No "
        r"space left on device\); the last complete checkpoint is none",
    ):
        checkpointer.wait()
    assert list_checkpoints(tmp_path) == []
    assert checkpointer.wait() is None  # reported once


def test_a_failed_async_write_stops_the_run_with_the_previous_checkpoint_intact(
    tiny_config, tmp_path, monkeypatch, capsys
):
    write_data, calls = FileSystemWriter.write_data, [0]

    def second_fails(self, plan, planner):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError("No space left on device")
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", second_fails)
    cfg = tiny_config({"train": {**TRAIN, "async_checkpoint": True}})
    assert main(["train", str(cfg)]) == 1
    assert (
        "unmask: stopped: checkpoint-6 could not be written (OSError: No space left on "
        f"device); the last complete checkpoint is {tmp_path / 'run' / 'checkpoint-3'}"
        in capsys.readouterr().err
    )
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-3"]


@pytest.mark.slow
def test_two_processes_async_match_one_process_and_resume(tmp_path):
    """torchrun, 2 gloo processes, FSDP2: async checkpoints, the same losses as a one-process
    synchronous run; resumed (2 processes) from the middle one, the same losses again."""
    train = {**TRAIN, "split_batches": True, "eval_steps": 0}

    def config(name: str, extra: dict) -> Path:
        return write_run_config(tmp_path, name, {"train": train}, extra)

    assert main(["train", str(config("ref", {}))]) == 0
    run = config("run", {"train": {"async_checkpoint": True}})
    middle = tmp_path / "run" / "checkpoint-3"
    resumed = config("resumed", {"train": {"async_checkpoint": True,
                                           "resume_from_checkpoint": str(middle)}})  # fmt: skip
    for name, result in train_in_ranks(2, tmp_path / "results.json", run, resumed).items():
        assert result["rc"] == 0, (name, result["stderr"][-2000:])
    reference = losses(tmp_path / "ref")
    for name, first in (("run", 1), ("resumed", 4)):
        got = losses(tmp_path / name)
        assert sorted(got) == list(range(first, 10)), name
        assert all(got[s] == pytest.approx(reference[s], rel=1e-5) for s in got), name
    saved = list_checkpoints(tmp_path / "run")
    assert [p.name for p in saved] == ["checkpoint-3", "checkpoint-6", "checkpoint-9"]
    assert all((p / "manifest.json").is_file() for p in saved)


@pytest.mark.slow
def test_kills_mid_async_write_resume_bit_equal_to_an_uninterrupted_run(tiny_config, tmp_path):
    """SIGKILL while an async write is in flight (a .tmp-checkpoint folder exists): the next
    start passes over it and the run ends as an uninterrupted one."""
    train = {"max_steps": 40, "save_steps": 1, "save_total_limit": 2, "eval_steps": 0}
    ref = tiny_config({"train": {**train, "output_dir": str(tmp_path / "ref")}}, "ref.yaml")
    assert main(["train", str(ref)]) == 0
    cfg = tiny_config({"train": {**train, "async_checkpoint": True}})
    run, kills = tmp_path / "run", 0
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-m", "unmask", "train", str(cfg), "train.resume_from_checkpoint=true"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if run.is_dir() and list_checkpoints(run):  # past the first save
                if any(p.name.startswith(".tmp-checkpoint-") for p in run.iterdir()):
                    proc.send_signal(signal.SIGKILL)
                    kills += 1
                    break
            time.sleep(0.002)
        proc.wait(timeout=60)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read()[-2000:]
    else:
        assert main(["train", str(cfg), "train.resume_from_checkpoint=true"]) == 0
    assert kills >= 1
    assert losses(run) == losses(tmp_path / "ref")
    reference = _final(tmp_path / "ref")
    assert all(torch.equal(reference[k], v) for k, v in _final(run).items())
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]


def test_eval_loss_does_not_depend_on_the_eval_batch_size(tiny_config):
    values = []
    for size in (1, 5, 32):
        extra = {"train": {"per_device_eval_batch_size": size, "eval_max_batches": None,
                           "overwrite_output_dir": True}}  # fmt: skip
        trainer = Trainer(load_config(tiny_config(extra)))
        values.append(trainer.evaluate())
    assert values[1] == pytest.approx(values[0], rel=1e-6)
    assert values[2] == pytest.approx(values[0], rel=1e-6)


def test_nan_rollback_waits_for_the_async_write_and_goes_back_to_it(tiny_config, tmp_path):
    """The checkpoint of step 4 may still be in flight when steps 5-6 turn out non-finite:
    the rollback waits for it and restores it."""
    from faults import NonFiniteAt

    train = {"max_steps": 8, "save_steps": 4, "eval_steps": 0, "max_bad_steps": 2,
             "nan_rollback": True, "lr_backoff": 0.5, "async_checkpoint": True}  # fmt: skip
    trainer = Trainer(load_config(tiny_config({"train": train})))
    trainer.objective = NonFiniteAt(trainer, {5, 6}, once=True)
    trainer.train()
    records = read_metrics(tmp_path / "run")
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]  # 5-6 again after the rollback to step 4
    state = json.loads((tmp_path / "run" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["guard"]["lr_scale"] == 0.5
