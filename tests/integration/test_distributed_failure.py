"""A rank dies mid-run: the others stop within 60 s naming it, the last checkpoint resumes.
On another node (two torchrun agents), a lost or silent peer ends the surviving rank with one
line (the step, the newest complete checkpoint, the resume command) and no traceback."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import losses, write_run_config
from launch import children_of, free_port, rank_env, rank_of, torchrun_command

from unmask.checkpoint import is_distributed_checkpoint, list_checkpoints
from unmask.config import load_config
from unmask.train.trainer import Trainer

pytestmark = pytest.mark.slow


def test_killed_rank_stops_the_run_and_the_last_checkpoint_resumes(tmp_path):
    out = tmp_path / "run"
    cfg_path = write_run_config(tmp_path, "run", {}, {"train": {
        "max_steps": 500, "save_steps": 2, "eval_steps": 0, "split_batches": True,
        "ddp_timeout": 60}})  # fmt: skip
    launcher = subprocess.Popen(torchrun_command(2, "-m", "unmask", "train", cfg_path),
                                env=rank_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
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
    logged = losses(out)
    cfg = load_config(
        cfg_path, ["train.resume_from_checkpoint=true", f"train.max_steps={step + 1}"]
    )
    trainer = Trainer(cfg)
    assert trainer.step == step
    stats = trainer.train_step([next(trainer.loader)])
    if step + 1 in logged:  # rank 0 got to log the next step before it was stopped
        assert float(stats["loss"]) == pytest.approx(logged[step + 1], abs=1e-5)


@pytest.mark.parametrize("check", ["step", "logging"])
def test_slurm_usr1_through_torchrun_stops_every_rank_at_one_checkpoint(tmp_path, check):
    """SLURM's `--signal=USR1@120` reaches torchrun, which forwards it to the ranks when told
    to (`--signals-to-handle ...,SIGUSR1`, as configs/distributed/slurm.sbatch does): every
    rank finishes its step, one intact checkpoint of that step is written, and the run
    resumes from it. With train.nonfinite_check logging the ranks learn of the signal with
    the flags' read, at a logging step (every 3rd here)."""
    from unmask.checkpoint.layout import verify

    out = tmp_path / "run"
    every = 1 if check == "step" else 3
    cfg_path = write_run_config(tmp_path, "run", {}, {"train": {
        "max_steps": 2000, "save_steps": 0, "eval_steps": 0, "split_batches": True,
        "nonfinite_check": check, "logging_steps": every}})  # fmt: skip
    flags = ("--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout=60")
    cmd = torchrun_command(2, "-m", "unmask", "train", cfg_path, flags=flags)
    launcher = subprocess.Popen(cmd, env=rank_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
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
    assert step % every == 0
    assert verify(checkpoint) is None and is_distributed_checkpoint(checkpoint)
    assert f"stopped by SIGUSR1 at step {step}; checkpoint-{step} is saved" in stdout
    assert not (out / "final").exists()
    cfg = load_config(
        cfg_path, ["train.resume_from_checkpoint=true", f"train.max_steps={step + 1}"]
    )
    trainer = Trainer(cfg)
    assert trainer.step == step


# -- two nodes: one torchrun agent each --------------------------------------------------------
LOST_LINE = re.compile(
    r"^unmask: stopped: a peer process was lost after step (\d+): (.+); the newest complete "
    r"checkpoint is (.+); resume by launching every process as before, with: (.+)$"
)


class TwoNodes:
    """Two torchrun agents, one process each, meeting through c10d rendezvous on loopback, as
    two machines would (`--nnodes=2`): torchrun does not stop one node's process when the
    other's dies, the process group's own failure has to. Node 0's agent hosts the store.
    Each worker's stdout and stderr go to its node's log folder (`--redirects 3`). Not
    launch.torchrun_command: `--standalone` is one node's private rendezvous; two agents
    need one c10d endpoint on a port chosen here."""

    def __init__(self, tmp_path: Path, cfg_path: Path, overrides: list[str]):
        port = free_port()
        self.tmp_path = tmp_path
        self.agents: list[subprocess.Popen] = []
        self.workers: dict[int, int] = {}  # rank -> pid
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                   "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                   f"--rdzv-id=lost-peer-{port}", f"--rdzv-conf=is_host={node == 0}",
                   "--local-addr=127.0.0.1", "--max-restarts=0", f"--log-dir={tmp_path / f'logs{node}'}",
                   "--redirects=3", "-m", "unmask", "train", str(cfg_path), *overrides]  # fmt: skip
            with open(tmp_path / f"agent{node}.err", "w") as err:
                self.agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                                    stderr=err))  # fmt: skip

    def wait_for_checkpoints(self, out: Path, count: int, limit_s: float = 240) -> None:
        deadline = time.monotonic() + limit_s
        while len(list_checkpoints(out)) < count or len(self.workers) < 2:
            for agent in self.agents:
                assert agent.poll() is None, self.agent_log(self.agents.index(agent))[-3000:]
                for pid in children_of(agent.pid):
                    if (rank := rank_of(pid)) is not None:
                        self.workers[rank] = pid
            assert time.monotonic() < deadline, f"{count} checkpoints not there in {limit_s} s"
            time.sleep(0.2)

    def agent_of(self, rank: int) -> int:
        """The node whose agent runs the given rank (c10d rendezvous orders nodes itself)."""
        return next(
            n for n, a in enumerate(self.agents) if self.workers[rank] in children_of(a.pid)
        )

    def agent_log(self, node: int) -> str:
        return (self.tmp_path / f"agent{node}.err").read_text()

    def worker_log(self, node: int, stream: str) -> str:
        (path,) = (self.tmp_path / f"logs{node}").glob(f"*/attempt_0/0/{stream}.log")
        return path.read_text()

    def close(self) -> None:
        """Every process this run started ends, whatever the test did (a SIGSTOPped worker
        too: SIGKILL ends a stopped process)."""
        for pid in self.workers.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for agent in self.agents:
            if agent.poll() is None:
                agent.kill()
            agent.wait(timeout=30)


def lost_peer_run(tmp_path: Path, stop_with: signal.Signals, train: dict) -> dict:
    """Two nodes train (FSDP2 over 2); once two checkpoints are written rank 1's worker gets
    `stop_with`; returns what rank 0's node printed, how long it took to stop, and the run."""
    out = tmp_path / "run"
    cfg_path = write_run_config(tmp_path, "run", {}, {"train": {
        "max_steps": 2000, "save_steps": 2, "eval_steps": 0, "split_batches": True,
        **train}})  # fmt: skip
    overrides = ["train.logging_steps=1"]  # on the command line: the resume command keeps it
    nodes = TwoNodes(tmp_path, cfg_path, overrides)
    try:
        nodes.wait_for_checkpoints(out, 2)
        survivor = nodes.agent_of(0)
        os.kill(nodes.workers[1], stop_with)
        stopped_at = time.monotonic()
        returncode = nodes.agents[survivor].wait(timeout=120)
        left_after = time.monotonic() - stopped_at
    finally:
        nodes.close()
    return {"returncode": returncode, "left_after": left_after, "out": out,
            "stderr": nodes.worker_log(survivor, "stderr"),
            "stdout": nodes.worker_log(survivor, "stdout"), "agent": nodes.agent_log(survivor),
            "command": ["unmask", "train", str(cfg_path), *overrides]}  # fmt: skip


def check_one_line(run: dict) -> re.Match:
    """Rank 0's worker printed exactly one `unmask:` line on stderr, the lost-peer line, and no
    traceback; its step is the last one it logged; its checkpoint is the newest complete one;
    its command is the one the run was started with, resuming."""
    stderr = run["stderr"]
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("unmask:")]
    assert len(lines) == 1, stderr[-3000:]
    match = LOST_LINE.match(lines[0])
    assert match, lines[0]
    assert int(match[1]) == max(losses(run["out"]))
    newest = list_checkpoints(run["out"])[-1]
    assert match[3] == str(newest) and is_distributed_checkpoint(newest)
    assert match[4] == shlex.join([*run["command"], f"train.output_dir={run['out']}",
                                   "train.resume_from_checkpoint=true"])  # fmt: skip
    assert "unmask: stopped" not in run["stdout"]
    # the worker exited with code 1 (torchrun's summary says so), torchrun exits non-zero
    assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s+exitcode\s*:\s*1 ", run["agent"])
    assert run["returncode"] != 0
    return match


def test_a_peer_killed_on_another_node_stops_rank_0_with_one_line(tmp_path):
    run = lost_peer_run(tmp_path, signal.SIGKILL, {"ddp_timeout": 120})
    match = check_one_line(run)
    assert match[2].startswith("its connection closed (")
    assert run["left_after"] < 60  # the closed connection, not the 120 s timeout
    # the printed command resumes the run (here in one process: the checkpoint is sharded)
    step = int(list_checkpoints(run["out"])[-1].name.split("-")[1])
    command = [sys.executable, "-m", "unmask", *shlex.split(match[4])[1:]]
    resumed = subprocess.run(command + [f"train.max_steps={step + 1}"], capture_output=True,
                             text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {run['out'] / f'checkpoint-{step}'} at step {step}" in resumed.stdout


def test_a_peer_that_stops_answering_times_out_with_one_line(tmp_path):
    """SIGSTOP: the peer is alive but silent; the surviving rank's collective gives up after
    train.ddp_timeout (gloo's own words carry the 15 s) and it leaves with the same line.
    (No MFU probe: rank 0 measuring the CPU at start-up must not look like a silent peer.)"""
    run = lost_peer_run(tmp_path, signal.SIGSTOP, {"ddp_timeout": 15, "log_mfu": False})
    match = check_one_line(run)
    assert match[2].startswith("it did not answer within train.ddp_timeout (15 s: ")
    assert "Timed out waiting 15000ms" in match[2]
    assert run["left_after"] < 15 + 50
