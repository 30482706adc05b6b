"""A rank dies mid-run: the others stop within 60 s naming it, the last checkpoint resumes."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import TINY, deep_update

from unmask.checkpoint import is_distributed_checkpoint, list_checkpoints
from unmask.config import load_config
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.slow


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def test_killed_rank_stops_the_run_and_the_last_checkpoint_resumes(tmp_path):
    out = tmp_path / "run"
    tree = deep_update(
        TINY,
        {
            "train": {
                "output_dir": str(out),
                "max_steps": 500,
                "save_steps": 2,
                "eval_steps": 0,
                "split_batches": True,
                "ddp_timeout": 60,
            }
        },
    )
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(tree))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    launcher = subprocess.Popen(
        cmd + ["-m", "unmask", "train", str(cfg_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while len(list_checkpoints(out)) < 2:
            assert launcher.poll() is None, launcher.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.2)
        victim = next(p for p in children_of(launcher.pid) if rank_of(p) == 1)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = launcher.communicate(timeout=90)
        stopped_after = time.monotonic() - killed_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode != 0
    assert stopped_after < 60
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", stderr), stderr[-2000:]
    assert "exitcode  : -9" in stderr
    # the newest complete checkpoint is intact and continues the same run
    last = list_checkpoints(out)[-1]
    assert is_distributed_checkpoint(last)
    step = json.loads((last / "trainer_state.json").read_text())["step"]
    logged = {
        r["step"]: r["loss"]
        for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }
    cfg = load_config(
        cfg_path, ["train.resume_from_checkpoint=true", f"train.max_steps={step + 1}"]
    )
    trainer = Trainer(cfg)
    assert trainer.step == step
    stats = trainer.train_step([next(trainer.loader)])
    if step + 1 in logged:  # rank 0 got to log the next step before it was stopped
        assert float(stats["loss"]) == pytest.approx(logged[step + 1], abs=1e-5)


def test_slurm_usr1_through_torchrun_stops_every_rank_at_one_checkpoint(tmp_path):
    """SLURM's `--signal=USR1@120` reaches torchrun, which forwards it to the ranks when told
    to (`--signals-to-handle ...,SIGUSR1`, as configs/distributed/slurm.sbatch does): every
    rank finishes its step, one intact checkpoint of that step is written, and the run
    resumes from it."""
    from unmask.checkpoint.layout import verify

    out = tmp_path / "run"
    tree = deep_update(TINY, {"train": {"output_dir": str(out), "max_steps": 2000,
                                        "save_steps": 0, "eval_steps": 0,
                                        "split_batches": True}})  # fmt: skip
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(tree))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout=60",
           "-m", "unmask", "train", str(cfg_path)]  # fmt: skip
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while (
            not (out / "metrics.jsonl").is_file()
            or len((out / "metrics.jsonl").read_text().splitlines()) < 5
        ):
            assert launcher.poll() is None, launcher.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "no logged steps within 180 s"
            time.sleep(0.2)
        launcher.send_signal(signal.SIGUSR1)
        stdout, stderr = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    (checkpoint,) = list_checkpoints(out)
    step = int(checkpoint.name.split("-")[1])
    assert verify(checkpoint) is None and is_distributed_checkpoint(checkpoint)
    assert f"stopped by SIGUSR1 at step {step}; checkpoint-{step} is saved" in stdout
    assert not (out / "final").exists()
    cfg = load_config(
        cfg_path, ["train.resume_from_checkpoint=true", f"train.max_steps={step + 1}"]
    )
    trainer = Trainer(cfg)
    assert trainer.step == step
