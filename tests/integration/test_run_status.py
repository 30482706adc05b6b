"""`unmask runs` and the server's runs list on real training processes: `running` while a
run trains between two metric writes, `crashed` once it is SIGKILLed, `stopped at step N`
after a stop signal (runs/heartbeat.py's rule, the same for both)."""

import json
import signal
import subprocess
import sys
import time

import pytest

from unmask.cli import main
from unmask.runs.heartbeat import HEARTBEAT_FILE, read_heartbeat
from unmask.serve.runs_view import list_runs

pytestmark = pytest.mark.usefixtures("one_thread")


def _start(cfg):
    return subprocess.Popen([sys.executable, "-m", "unmask", "train", str(cfg)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _wait_for_steps(proc, run, steps: int) -> dict:
    deadline = time.monotonic() + 120
    while True:
        beat = read_heartbeat(run)
        if beat is not None and (beat.get("step") or 0) >= steps:
            return beat
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.05)


def _row_status(capsys, folder, run) -> str:
    assert main(["runs", str(folder)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(str(run))]
    (row,) = rows
    return " ".join(row[len(str(run)) :].split()[:4])


def test_running_between_writes_then_crashed_after_sigkill_then_stopped(tiny_config, tmp_path,
                                                                      capsys):  # fmt: skip
    # one metrics line at step 1 at most, then none for 100000 steps: only the heartbeat
    # says the run is alive
    train = {"max_steps": 100000, "logging_steps": 100000, "save_steps": 100000,
             "eval_steps": 0}  # fmt: skip
    cfg = tiny_config({"train": train})
    run = tmp_path / "run"
    proc = _start(cfg)
    try:
        beat = _wait_for_steps(proc, run, 3)
        assert beat["status"] == "running" and beat["pid"] == proc.pid
        assert not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text()
        assert _row_status(capsys, tmp_path, run).startswith("running")
        (row,) = list_runs(tmp_path)
        assert row["status"] == "running"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert read_heartbeat(run)["status"] == "running"  # the killed process said nothing more
    assert _row_status(capsys, tmp_path, run).startswith("crashed")
    assert list_runs(tmp_path)[0]["status"] == "crashed"

    cfg2 = tiny_config({"train": {**train, "output_dir": str(tmp_path / "two")}}, "two.yaml")
    proc = _start(cfg2)
    try:
        _wait_for_steps(proc, tmp_path / "two", 2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    beat = json.loads((tmp_path / "two" / HEARTBEAT_FILE).read_text())
    assert beat["status"] == "stopped"
    status = _row_status(capsys, tmp_path, tmp_path / "two")
    assert status == f"stopped at step {beat['step']}"
    rows = {r["name"]: r for r in list_runs(tmp_path)}
    assert rows["two"]["status"] == status and rows["run"]["status"] == "crashed"


def test_a_run_building_its_model_is_running(tiny_config, tmp_path):
    """The heartbeat is written with the run folder's config.yaml, before train() starts
    its thread: a run built but not yet stepping reads `running` (this process is alive),
    not `crashed`."""
    import os

    from unmask.config import load_config
    from unmask.runs.report import run_info
    from unmask.train.trainer import Trainer

    trainer = Trainer(load_config(tiny_config({"train": {"max_steps": 2}})))
    beat = read_heartbeat(trainer.output_dir)
    assert beat["status"] == "running" and beat["pid"] == os.getpid() and beat["step"] is None
    assert run_info(trainer.output_dir).status == "running"
    trainer.train()
    assert read_heartbeat(trainer.output_dir)["status"] == "finished"
    assert run_info(trainer.output_dir).status == "finished"
