"""The Train tab's queue file (serve/training.py JOBS_FILE): a new queue of the folder lists
the jobs of the server before, a job that was running whose process is gone is marked by
its log (stopped after a SIGTERM checkpoint, else failed), a record that is not a job is
left out, and a later job number follows the highest."""

import json
import subprocess
import sys

from unmask.serve.training import JOB_LOG, JOBS_FILE, TrainQueue


def test_a_new_queue_lists_the_jobs_of_the_one_before(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that has exited
    for name, log in (("stopped-run", "step 3/100\nstopped by SIGTERM at step 3; ...\n"),
                      ("dead-run", "step 3/100\nTraceback ...\n")):  # fmt: skip
        (tmp_path / name).mkdir()
        (tmp_path / name / JOB_LOG).write_text(log)
    records = [
        {"id": "1", "name": "done-run", "source": "tiny.yaml", "state": "finished",
         "exit_code": 0, "pid": None, "created": 1.0, "started": 2.0, "ended": 3.0},
        {"id": "4", "name": "stopped-run", "source": "quickstart", "state": "running",
         "exit_code": None, "pid": gone.pid, "created": 1.0, "started": 2.0, "ended": None},
        {"id": "7", "name": "dead-run", "source": "x.yaml (edited)", "state": "running",
         "exit_code": None, "pid": gone.pid, "created": 1.0, "started": 2.0, "ended": None},
        {"id": "9", "name": "../escape", "state": "queued"},  # not a run name: left out
        "not a record",
    ]  # fmt: skip
    (tmp_path / JOBS_FILE).write_text(json.dumps({"jobs": records}))
    queue = TrainQueue(tmp_path)
    try:
        jobs = {job["name"]: job for job in queue.jobs()}
        assert {name: (job["id"], job["state"], job["source"]) for name, job in jobs.items()} == {
            "done-run": ("1", "finished", "tiny.yaml"),
            "stopped-run": ("4", "stopped", "quickstart"),
            "dead-run": ("7", "failed", "x.yaml (edited)"),
        }  # fmt: skip
        assert queue._count == 7  # the next job is number 8
        assert "ended with the server that ran it" in (tmp_path / "dead-run" / JOB_LOG).read_text()
        kept = json.loads((tmp_path / JOBS_FILE).read_text())["jobs"]
        assert [(r["name"], r["state"]) for r in kept] == [
            ("done-run", "finished"), ("stopped-run", "stopped"), ("dead-run", "failed")]  # fmt: skip
    finally:
        queue.close(5)


def test_a_file_that_is_not_a_job_list_starts_an_empty_queue(tmp_path, capsys):
    (tmp_path / JOBS_FILE).write_text("{not json")
    queue = TrainQueue(tmp_path)
    try:
        assert queue.jobs() == []
        assert f"{JOBS_FILE} is not a job list" in capsys.readouterr().err
    finally:
        queue.close(5)
