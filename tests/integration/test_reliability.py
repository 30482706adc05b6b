"""Week-long runs: SIGKILLs at random moments (during checkpoint writes too), SIGTERM and
SIGINT, non-finite steps, damaged checkpoints, a full disk. Each ends with the parameters
and logged losses of an uninterrupted run, or one line saying what to do."""

import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import by_step, losses, read_metrics
from faults import NonFiniteAt, skipping_reference
from launch import WORKERS, torchrun
from safetensors.torch import load_file

from unmask.checkpoint import list_checkpoints
from unmask.checkpoint.layout import verify
from unmask.cli import main
from unmask.config import load_config
from unmask.errors import RunStopped
from unmask.train import run_dir as run_dir_module
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _start(cfg: Path, *overrides: str, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "unmask", "train", str(cfg), *overrides],
        stdout=stdout, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _logged_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.mark.slow
def test_repeated_sigkills_end_bit_equal_to_an_uninterrupted_run(tiny_config, tmp_path):
    train = {"max_steps": 60, "save_steps": 1, "save_total_limit": 2, "eval_steps": 0,
             "logging_steps": 1}  # fmt: skip
    reference = tiny_config({"train": {**train, "output_dir": str(tmp_path / "ref")}}, "ref.yaml")
    assert main(["train", str(reference)]) == 0
    cfg = tiny_config({"train": {**train, "output_dir": str(tmp_path / "run")}}, "run.yaml")
    run, rng = tmp_path / "run", random.Random(0)
    kills, during_writes = 0, 0
    while kills < 8 or during_writes < 3:
        proc = _start(cfg, "train.resume_from_checkpoint=true")
        started = _logged_steps(run)
        target_write = during_writes < 3 and rng.random() < 0.6
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if _logged_steps(run) > started:  # past start-up: training
                writing = any(p.name.startswith(".tmp-checkpoint-") for p in run.iterdir())
                if (target_write and writing) or (not target_write and rng.random() < 0.02):
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    kills += 1
                    during_writes += writing
                    break
            time.sleep(0.002)
        assert proc.poll() is not None, "a run did not get killed or finish within 60 s"
        assert proc.returncode in (0, -signal.SIGKILL), proc.stderr.read()[-2000:]
        if proc.returncode == 0:
            pytest.fail(f"the run finished after {kills} kills; give it more steps")
    proc = _start(cfg, "train.resume_from_checkpoint=true")
    assert proc.wait(timeout=120) == 0, proc.stderr.read()[-2000:]
    assert _same_weights(tmp_path / "ref", run)
    assert losses(run) == losses(tmp_path / "ref")
    steps = [r["step"] for r in read_metrics(run) if "loss" in r]
    assert steps == sorted(set(steps)) == list(range(1, 61))  # each step logged once
    assert not [p.name for p in run.iterdir() if p.name.startswith(".")]  # no temporaries


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_signal_saves_a_checkpoint_and_the_resumed_run_is_the_same(tiny_config, tmp_path, sig,
                                                                   code):  # fmt: skip
    train = {"max_steps": 400, "save_steps": 1000, "eval_steps": 0, "logging_steps": 1}
    optim = {"lr_scheduler_type": "constant", "warmup_steps": 0}  # the same at any length
    cfg = tiny_config({"train": train, "optim": optim})
    run = tmp_path / "run"
    proc = _start(cfg, stdout=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while _logged_steps(run) < 5:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.01)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr[-2000:]
    (checkpoint,) = list_checkpoints(run)
    step = int(checkpoint.name.split("-")[1])
    assert 5 <= step < 400 and not (run / "final").exists()
    assert f"stopped by {signal.Signals(sig).name} at step {step}" in stdout
    assert "train.resume_from_checkpoint=true" in stdout
    # resume to step + 3 and compare with an uninterrupted run of the same length
    short = ["train.max_steps=" + str(step + 3)]
    assert main(["train", str(cfg), *short, "train.resume_from_checkpoint=true"]) == 0
    ref = tiny_config({"train": {**train, "output_dir": str(tmp_path / "ref")}, "optim": optim},
                      "ref.yaml")  # fmt: skip
    assert main(["train", str(ref), *short]) == 0
    assert _same_weights(run, tmp_path / "ref")


def test_non_finite_steps_are_skipped_counted_and_equal_skipping_those_batches(
    tiny_config, tmp_path
):
    train = {"max_steps": 8, "save_steps": 100, "eval_steps": 0, "logging_steps": 1}
    bad = {3, 5}
    trainer = Trainer(load_config(tiny_config({"train": train})))
    trainer.objective = NonFiniteAt(trainer, bad)
    trainer.train()
    ref = Trainer(load_config(tiny_config({"train": {**train, "output_dir": str(
        tmp_path / "ref")}}, "ref.yaml")))  # fmt: skip
    skipping_reference(ref, bad)
    ref.train()
    assert _same_weights(tmp_path / "run", tmp_path / "ref")
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "skipped_in_a_row" in r] == [3, 5]
    assert [r for r in records if "loss" in r][-1]["skipped_steps"] == 2
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 4, 6, 7, 8]


def test_persistent_non_finite_loss_stops_naming_the_last_checkpoint(tiny_config, tmp_path):
    train = {"max_steps": 20, "save_steps": 2, "eval_steps": 0, "max_bad_steps": 3}
    trainer = Trainer(load_config(tiny_config({"train": train})))
    trainer.objective = NonFiniteAt(trainer, set(range(5, 21)))
    with pytest.raises(RunStopped) as info:
        trainer.train()
    message = str(info.value)
    assert "steps 5-7 had a non-finite loss or gradient norm (3 in a row" in message
    assert "checkpoint-4" in message and "train.nan_rollback=true" in message


def test_nan_rollback_goes_back_with_a_lower_learning_rate(tiny_config, tmp_path):
    train = {"max_steps": 12, "save_steps": 4, "eval_steps": 0, "max_bad_steps": 2,
             "nan_rollback": True, "lr_backoff": 0.25, "logging_steps": 1}  # fmt: skip
    cfg = tiny_config({"train": train, "optim": {"lr_scheduler_type": "constant",
                                                 "warmup_steps": 0}})  # fmt: skip
    trainer = Trainer(load_config(cfg))
    trainer.objective = NonFiniteAt(trainer, {6, 7}, once=True)
    trainer.train()
    records = read_metrics(tmp_path / "run")
    lrs = [r["learning_rate"] for r in records if "loss" in r]
    assert lrs[:4] == [3e-3] * 4 and lrs[-1] == pytest.approx(3e-3 * 0.25)
    assert json.loads((tmp_path / "run" / "checkpoint-12" / "trainer_state.json").read_text())[
        "guard"]["lr_scale"] == 0.25  # fmt: skip
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 12  # rolled back: logged once


def test_checking_at_logging_steps_trains_as_checking_every_step(tiny_config, tmp_path):
    """train.nonfinite_check logging: with no bad step, the same losses and weights as the
    per-step check (the read moves, nothing else)."""
    train = {"max_steps": 6, "save_steps": 3, "eval_steps": 3, "logging_steps": 2}
    Trainer(load_config(tiny_config({"train": train}))).train()
    late = {**train, "nonfinite_check": "logging", "output_dir": str(tmp_path / "late")}
    Trainer(load_config(tiny_config({"train": late}, "late.yaml"))).train()
    assert losses(tmp_path / "run") == losses(tmp_path / "late")
    assert _same_weights(tmp_path / "run", tmp_path / "late")


def test_checking_at_logging_steps_stops_or_rolls_back_at_the_read(tiny_config, tmp_path):
    """A bad step under nonfinite_check logging has updated the weights: at the next read
    (a log line) the run stops naming the last checkpoint, no checkpoint of it is written;
    with nan_rollback it goes back to that checkpoint with the lower learning rate."""
    train = {"max_steps": 12, "save_steps": 4, "eval_steps": 0, "logging_steps": 4,
             "nonfinite_check": "logging"}  # fmt: skip
    trainer = Trainer(load_config(tiny_config({"train": train})))
    trainer.objective = NonFiniteAt(trainer, {6})
    with pytest.raises(RunStopped) as info:
        trainer.train()
    message = str(info.value)
    # step 6's update made the weights NaN, so steps 7 and 8 were too
    assert message.startswith("3 of steps 6-8 had a non-finite loss or gradient norm "
                              "(train.nonfinite_check logging reads the flag after the updates")  # fmt: skip
    assert "checkpoint-4" in message
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-4"]
    back = {**train, "nan_rollback": True, "lr_backoff": 0.5,
            "output_dir": str(tmp_path / "back")}  # fmt: skip
    cfg = tiny_config({"train": back, "optim": {"lr_scheduler_type": "constant",
                                                "warmup_steps": 0}}, "back.yaml")  # fmt: skip
    trainer = Trainer(load_config(cfg))
    trainer.objective = NonFiniteAt(trainer, {6}, once=True)
    trainer.train()
    state = json.loads((tmp_path / "back" / "checkpoint-12" / "trainer_state.json").read_text())
    assert state["guard"]["lr_scale"] == 0.5
    records = read_metrics(tmp_path / "back")
    assert [r["step"] for r in records if "loss" in r] == [4, 8, 12]
    assert [r["learning_rate"] for r in records if "loss" in r][-1] == pytest.approx(1.5e-3)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny run (4 steps): checkpoint-2, checkpoint-4 and final/; cases copy it."""
    import yaml
    from conftest import TINY, deep_update

    root = tmp_path_factory.mktemp("finished")
    tree = deep_update(TINY, {"train": {**FINISHED, "output_dir": str(root / "run")}})
    (root / "run.yaml").write_text(yaml.safe_dump(tree))
    assert main(["train", str(root / "run.yaml")]) == 0
    return root / "run"


FINISHED = {"max_steps": 4, "save_steps": 2}


def _copy_run(finished: Path, to: Path, older: bool = True) -> Path:
    """A copy of the finished run (modification times kept); older=False: without
    checkpoint-2, so checkpoint-4 is its only checkpoint."""
    shutil.copytree(finished, to)
    if not older:
        shutil.rmtree(to / "checkpoint-2")
    return to


def _files(run: Path) -> dict[str, tuple]:
    """Every file and folder under run: its sha256 and size, and its modification time."""
    out = {}
    for path in sorted([run, *run.rglob("*")]):
        stat = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        out[str(path.relative_to(run))] = (digest, stat.st_size if digest else None,
                                          stat.st_mtime_ns)  # fmt: skip
    return out


def _damage(checkpoint: Path, how: str) -> None:
    if how == "truncated model.safetensors":
        path = checkpoint / "model.safetensors"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "truncated optimizer.pt":
        path = checkpoint / "optimizer.pt"
        path.write_bytes(path.read_bytes()[:-100])
    elif how == "missing rng_state.pt":
        (checkpoint / "rng_state.pt").unlink()
    else:  # the same length, other bytes: only the checksum tells
        path = checkpoint / "trainer_state.json"
        path.write_bytes(b"{" + b" " * (path.stat().st_size - 2) + b"}")


DAMAGES = {
    "truncated model.safetensors": "model.safetensors holds",
    "truncated optimizer.pt": "optimizer.pt holds",
    "missing rng_state.pt": "rng_state.pt is missing",
    "corrupt trainer_state.json": "trainer_state.json does not match its checksum",
}


@pytest.mark.parametrize("older", [False, True], ids=["only-checkpoint", "older-intact"])
@pytest.mark.parametrize("how", list(DAMAGES))
def test_damaged_checkpoint_of_a_finished_run_is_refused_and_nothing_changes(
    finished, tiny_config, tmp_path, capsys, how, older
):
    """resume_from_checkpoint=true on a finished run whose newest checkpoint was damaged
    after it was published: exit 2, one line naming the damage, the older intact checkpoint
    (if any) and the overrides that resume from it or start over; every file and folder of
    the run keeps its bytes and its modification time."""
    run = _copy_run(finished, tmp_path / "run", older)
    _damage(run / "checkpoint-4", how)
    before = _files(run)
    cfg = tiny_config({"train": FINISHED})
    capsys.readouterr()
    assert main(["train", str(cfg), "train.resume_from_checkpoint=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"cannot resume {str(run)!r}: checkpoint-4 is damaged ({DAMAGES[how]}" in err[0]
    assert "nothing was changed" in err[0]
    assert "train.resume_from_checkpoint=false train.overwrite_output_dir=true" in err[0]
    if older:
        override = f"train.resume_from_checkpoint={run / 'checkpoint-2'}"
        assert f"To resume from checkpoint-2, the newest intact one, set {override};" in err[0]
    else:
        assert "No intact checkpoint is left" in err[0]
    assert _files(run) == before


def test_the_named_override_resumes_from_the_older_intact_checkpoint(finished, tiny_config,
                                                                     tmp_path, capsys):  # fmt: skip
    """After the refusal, the override it names resumes from checkpoint-2 and ends with the
    weights of the uninterrupted run (its damaged checkpoint-4 is replaced by a whole one)."""
    run = _copy_run(finished, tmp_path / "run")
    _damage(run / "checkpoint-4", "truncated model.safetensors")
    cfg = tiny_config({"train": FINISHED})
    override = f"train.resume_from_checkpoint={run / 'checkpoint-2'}"
    assert main(["train", str(cfg), override]) == 0
    assert f"resuming from {run / 'checkpoint-2'} at step 2" in capsys.readouterr().out
    assert _same_weights(run, finished)
    assert verify(run / "checkpoint-4") is None


def test_finished_run_resumed_without_more_steps_changes_nothing(finished, tiny_config,
                                                                 tmp_path, capsys):  # fmt: skip
    """Nothing to train: exit 0 (the run is where the command asks it to be, so a requeue
    loop ends), one line saying so and how to train further; no file touched. Raised
    max_steps: it trains on."""
    run = _copy_run(finished, tmp_path / "run")
    before = _files(run)
    cfg = tiny_config({"train": FINISHED})
    for resume in ("true", str(run / "checkpoint-4")):
        capsys.readouterr()
        assert main(["train", str(cfg), f"train.resume_from_checkpoint={resume}"]) == 0
        out, err = capsys.readouterr()
        assert err.strip().splitlines() == [
            f"unmask: {str(run)!r} holds a finished run (checkpoint-4 and final/): this config "
            "plans 4 steps and the run has done 4, so there is nothing to train and nothing "
            "was changed; raise train.max_steps above 4 to train it further"
        ]
        assert out == ""
        assert _files(run) == before
    assert main(["train", str(cfg), "train.resume_from_checkpoint=true",
                 "train.max_steps=5"]) == 0  # fmt: skip
    assert f"resuming from {run / 'checkpoint-4'} at step 4" in capsys.readouterr().out
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-2", "checkpoint-4",
                                                        "checkpoint-5"]  # fmt: skip


def test_run_killed_while_writing_final_is_resumed_to_write_it_again(finished, tiny_config,
                                                                    tmp_path, capsys):  # fmt: skip
    """final/ cut short (a kill after the last checkpoint, while final/ was written): not a
    finished run; resuming writes final/ again, equal to the uninterrupted run's."""
    run = _copy_run(finished, tmp_path / "run")
    weights = run / "final" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    cfg = tiny_config({"train": FINISHED})
    assert main(["train", str(cfg), "train.resume_from_checkpoint=true"]) == 0
    assert f"resuming from {run / 'checkpoint-4'} at step 4" in capsys.readouterr().out
    assert _same_weights(run, finished)


def test_unfinished_save_is_passed_over_for_the_newest_published_checkpoint(finished,
                                                                            tiny_config,
                                                                            tmp_path, capsys):  # fmt: skip
    """A save killed mid-write leaves a temporary folder, never a published checkpoint: the
    run resumes from the newest published one and the temporary folder is removed."""
    run = _copy_run(finished, tmp_path / "run")
    shutil.rmtree(run / "checkpoint-4")
    shutil.rmtree(run / "final")
    partial = run / ".tmp-checkpoint-4-999"
    shutil.copytree(run / "checkpoint-2", partial)
    (partial / "manifest.json").unlink()
    _damage(partial, "truncated model.safetensors")
    cfg = tiny_config({"train": FINISHED})
    assert main(["train", str(cfg), "train.resume_from_checkpoint=true"]) == 0
    out = capsys.readouterr().out
    assert f"resuming from {run / 'checkpoint-2'} at step 2" in out
    assert "removed 1 unfinished save(s) of a stopped run: ['.tmp-checkpoint-4-999']" in out
    assert _same_weights(run, finished) and not partial.exists()


def test_resume_true_on_a_folder_that_does_not_exist_says_so_and_names_runs_nearby(
    finished, tiny_config, tmp_path, capsys
):
    """A mistyped output_dir with resume_from_checkpoint=true: the run starts (a requeued
    job's first launch must), the start line says there was nothing to resume and a
    warning names the folder and the run folders beside it that hold checkpoints, the
    closest names first."""
    runs = tmp_path / "runs"
    _copy_run(finished, runs / "exp-large")
    _copy_run(finished, runs / "other")
    (runs / "no-checkpoint").mkdir()
    (runs / "no-checkpoint" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    cfg = tiny_config({"train": {"max_steps": 1}})
    typo = runs / "exp-lareg"
    assert main(["train", str(cfg), f"train.output_dir={typo}",
                 "train.resume_from_checkpoint=true"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "| fresh: nothing to resume |" in out
    assert (
        f"warning: train.resume_from_checkpoint=true, but output_dir {str(typo)!r} does not "
        f"exist: starting a NEW run there. If you meant to continue a run, stop this one and "
        f"fix train.output_dir (runs with a checkpoint in {str(runs)!r}: "
        f"{str(runs / 'exp-large')!r} (checkpoint-4, finished), "
        f"{str(runs / 'other')!r} (checkpoint-4, finished))"
    ) in out
    assert (typo / "final").is_dir()


def test_ctrl_c_prints_the_command_that_resumes_and_it_does(tiny_config, tmp_path, capsys,
                                                           monkeypatch):  # fmt: skip
    """The stop line names the config file and overrides the run was started with (not a
    placeholder), and running that command resumes the run."""
    cfg = tiny_config({"train": {"save_steps": 100}})
    real_step = Trainer.train_step

    def step_then_ctrl_c(self, batches):
        stats = real_step(self, batches)
        if self.step == 1:  # the second step: the loop stops after it
            os.kill(os.getpid(), signal.SIGINT)
        return stats

    monkeypatch.setattr(Trainer, "train_step", step_then_ctrl_c)
    assert main(["train", str(cfg), "train.max_steps=5", "train.overwrite_output_dir=true"]) == 130
    out = capsys.readouterr().out
    command = (f"unmask train {cfg} train.max_steps=5 train.output_dir={tmp_path / 'run'} "
               "train.resume_from_checkpoint=true")  # fmt: skip
    assert f"stopped by SIGINT at step 2; checkpoint-2 is saved. Resume with: {command}\n" in out
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert main(shlex.split(command)[1:]) == 0
    assert f"resuming from {tmp_path / 'run' / 'checkpoint-2'} at step 2" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2, 3, 4, 5]


def test_resume_true_without_a_checkpoint_starts_fresh(tiny_config, tmp_path, capsys):
    cfg = tiny_config({"train": {"max_steps": 3, "save_steps": 100}})
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    (run / "config.yaml").write_text("a run killed before its first checkpoint\n")
    (run / ".tmp-checkpoint-1-999").mkdir()
    assert main(["train", str(cfg), "train.resume_from_checkpoint=true"]) == 0
    out = capsys.readouterr().out
    assert "no intact checkpoint" in out and "starting fresh" in out
    assert [r["step"] for r in read_metrics(run) if "loss" in r][0] == 1
    assert read_metrics(run)[0]["loss"] != 9.0
    assert not (run / ".tmp-checkpoint-1-999").exists()


def test_full_disk_stops_or_trains_on(tiny_config, tmp_path, monkeypatch, capsys):
    full = type("Usage", (), {"free": 1000, "total": 10**9, "used": 10**9 - 1000})
    monkeypatch.setattr(run_dir_module.shutil, "disk_usage", lambda path: full)
    cfg = tiny_config({"train": {"max_steps": 4, "save_steps": 2}})
    assert main(["train", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "not enough free space" in err and "checkpoint-2" in err
    assert "train.on_disk_full=continue" in err
    assert not list_checkpoints(tmp_path / "run")
    cfg = tiny_config({"train": {"max_steps": 4, "save_steps": 2, "on_disk_full": "continue",
                                 "output_dir": str(tmp_path / "on")}}, "on.yaml")  # fmt: skip
    assert main(["train", str(cfg)]) == 0
    assert not list_checkpoints(tmp_path / "on") and (tmp_path / "on" / "final").is_dir()
    out = capsys.readouterr().out
    assert out.count("not enough free space") == 2 and "training on to the next save" in out


def test_keep_best_keeps_the_lowest_eval_loss_checkpoint(tiny_config, tmp_path):
    train = {"max_steps": 8, "save_steps": 2, "eval_steps": 2, "save_total_limit": 1,
             "keep_best": True}  # fmt: skip
    Trainer(load_config(tiny_config({"train": train}))).train()
    run = tmp_path / "run"
    states = {p.name: json.loads((p / "trainer_state.json").read_text())
              for p in list_checkpoints(run)}  # fmt: skip
    assert "checkpoint-8" in states  # the newest is never deleted
    evals = by_step(run, "eval_loss")
    best = min(evals, key=evals.get)
    assert f"checkpoint-{best}" in states and len(states) <= 2
    assert os.listdir(run)  # sanity


@pytest.mark.slow
def test_non_finite_on_one_rank_every_rank_skips_rolls_back_or_stops(tiny_config, tmp_path):
    """2 gloo ranks, rank 1's loss NaN: both ranks skip the same steps (bit-equal to a
    2-rank run whose optimizer stands still there), roll back together, or stop together
    with the same message, without a hang."""
    train = {"max_steps": 8, "save_steps": 2, "eval_steps": 0, "logging_steps": 1,
             "split_batches": True, "fsdp2": True}  # fmt: skip
    specs = []
    for name, mode, steps, extra in [
        ("skipped", "nan", "3,5", {}),
        ("oracle", "skip", "3,5", {}),
        ("stopped", "nan", "5,6,7,8", {"max_bad_steps": 3}),
        ("rolled", "nan-once", "5,6", {"max_bad_steps": 2, "nan_rollback": True}),
    ]:
        cfg = tiny_config({"train": {**train, **extra, "output_dir": str(tmp_path / name)}},
                          f"{name}.yaml")  # fmt: skip
        specs.append(f"{cfg}:{mode}:1:{steps}")
    results_path = tmp_path / "results.json"
    torchrun(2, WORKERS / "guard_worker.py", results_path, *specs)
    results = json.loads(results_path.read_text())
    assert results["skipped"]["rc"] == 0 and results["oracle"]["rc"] == 0
    assert _same_weights(tmp_path / "skipped", tmp_path / "oracle")
    records = read_metrics(tmp_path / "skipped")
    assert [r["step"] for r in records if "skipped_in_a_row" in r] == [3, 5]
    stopped = results["stopped"]
    assert stopped["rc"] == 1 and stopped["step"] == 7
    assert "steps 5-7 had a non-finite loss" in stopped["message"]
    assert "checkpoint-4" in stopped["message"]
    rolled = results["rolled"]
    assert rolled["rc"] == 0 and rolled["step"] == 8 and (tmp_path / "rolled" / "final").is_dir()
    steps = [r["step"] for r in read_metrics(tmp_path / "rolled") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8]
