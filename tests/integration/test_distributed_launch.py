"""The launch recipes start real multi-process runs: `accelerate launch` with the shipped
config, and srun-style processes that only have SLURM's variables (no torchrun)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import losses, write_run_config
from launch import descendants_of, free_port

from unmask.checkpoint import is_distributed_checkpoint, list_checkpoints

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
#: optimizer steps per run; the 2-process losses must equal the one-process run's
STEPS = 3


def write_config(tmp_path: Path) -> Path:
    return write_run_config(tmp_path, "run", {"train": {"split_batches": True}},
                            {"train": {"max_steps": STEPS}})  # fmt: skip


def assert_two_rank_run(run: Path, reference: dict[int, float]) -> None:
    last = list_checkpoints(run)[-1]
    assert is_distributed_checkpoint(last)
    assert json.loads((last / "trainer_state.json").read_text())["world_size"] == 2
    assert losses(run) == pytest.approx(reference, abs=1e-5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from unmask.config import load_config
    from unmask.train.trainer import Trainer

    path = write_config(tmp_path_factory.mktemp("one"))
    Trainer(load_config(path)).train()
    return losses(path.parent / "run")


def test_accelerate_launch_with_the_shipped_config(tmp_path, reference):
    pytest.importorskip("accelerate")
    cfg = write_config(tmp_path)
    accelerate_cfg = REPO / "configs" / "distributed" / "accelerate_fsdp2.yaml"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_cfg)]
    cmd += ["--num_processes", "2", "-m", "unmask", "train", str(cfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_two_rank_run(tmp_path / "run", reference)


def test_srun_style_processes_with_slurm_variables_only(tmp_path, reference):
    cfg = write_config(tmp_path)
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), SLURM_NTASKS="2")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "unmask", "train", str(cfg)],
            env={**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
    assert_two_rank_run(tmp_path / "run", reference)


def _fake_slurm(tmp_path: Path) -> dict:
    """srun and scontrol stand-ins on PATH (srun runs its command on this machine, scontrol
    names this host and records a requeue) and the variables SLURM sets in a batch job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nshift\nexec "$@"\n')  # drops --kill-on-bad-exit
    (bin_dir / "scontrol").write_text(
        '#!/bin/sh\nif [ "$1" = show ]; then echo localhost; '
        f'else echo "$@" >> {tmp_path / "requeued"}; fi\n'
    )
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    venv_bin = str(Path(sys.executable).parent)  # torchrun and python next to this one
    path = os.pathsep.join([str(bin_dir), venv_bin, os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1",
            "SLURM_JOB_NODELIST": "localhost", "SLURM_GPUS_ON_NODE": "2",
            "MASTER_PORT": str(free_port())}  # fmt: skip


def test_slurm_batch_script_finishes_or_requeues_after_usr1(tmp_path):
    """configs/distributed/slurm.sbatch with srun/scontrol stand-ins: a run that finishes
    is not requeued; one that gets SLURM's SIGUSR1 stops at a checkpoint and requeues."""
    script = REPO / "configs" / "distributed" / "slurm.sbatch"
    env = _fake_slurm(tmp_path)
    cfg = write_config(tmp_path)
    proc = subprocess.run(["bash", str(script), str(cfg)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"unmask: {tmp_path / 'run'} finished" in proc.stdout
    assert not (tmp_path / "requeued").exists()

    long = ["train.output_dir=" + str(tmp_path / "long"), "train.max_steps=5000",
            "train.save_steps=0", "train.eval_steps=0"]  # fmt: skip
    job = subprocess.Popen(["bash", str(script), str(cfg), *long], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)  # fmt: skip
    try:
        metrics = tmp_path / "long" / "metrics.jsonl"
        while not metrics.is_file() or len(metrics.read_text().splitlines()) < 3:
            assert job.poll() is None, job.stderr.read()[-3000:]
            time.sleep(0.2)
        for pid in descendants_of(job.pid):  # srun -> torchrun: SLURM signals the job step
            if b"torchrun" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGUSR1)
        stdout, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, stderr[-3000:]
    (checkpoint,) = list_checkpoints(tmp_path / "long")
    assert "requeueing job 4242" in stdout and "stopped by SIGUSR1" in stdout
    assert (tmp_path / "requeued").read_text().split() == ["requeue", "4242"]
    assert not (tmp_path / "long" / "final").exists() and checkpoint.name != "checkpoint-5000"


def test_slurm_batch_script_does_not_requeue_a_job_that_wrote_no_checkpoint(tmp_path):
    """A job refused at start-up (here: resume_from_checkpoint=true on a folder of other
    files) would be refused again: the script says so and exits 1 without requeueing."""
    script = REPO / "configs" / "distributed" / "slurm.sbatch"
    env = _fake_slurm(tmp_path)
    cfg = write_config(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a run\n")
    proc = subprocess.run(["bash", str(script), str(cfg), f"train.output_dir={tmp_path / 'mine'}"],
                          capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "files no unmask run writes (notes.txt)" in proc.stderr
    assert f"unmask: {tmp_path / 'mine'} not finished and this job wrote no checkpoint" in (
        proc.stdout
    )
    assert "not requeueing" in proc.stdout and not (tmp_path / "requeued").exists()
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
