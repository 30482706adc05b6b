"""Trackers: W&B offline and trackio (local) receive the run's metrics through the real
packages; a tracker that is not installed stops the run before anything is written."""

import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest

from unmask.cli import main
from unmask.train import metrics as metrics_module

pytestmark = pytest.mark.slow


def _train(cfg, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unmask", "train", str(cfg)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})  # fmt: skip


def test_wandb_offline_gets_the_metrics(tiny_config, tmp_path):
    pytest.importorskip("wandb")
    cfg = tiny_config({"train": {"report_to": ["wandb"], "run_name": "tiny-wandb"}})
    proc = _train(cfg, {"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    (records,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    history = _wandb_history(records.read_bytes())
    assert [row["_step"] for row in history if "loss" in row] == [1, 2, 3, 4, 5, 6]
    assert all(row["loss"] > 0 for row in history if "loss" in row)
    assert any("eval_loss" in row for row in history)


def _wandb_history(data: bytes) -> list[dict]:
    """The history rows of an offline W&B run, read with W&B's own protobuf schema from its
    record log (a 7-byte ':W&B' header, then LevelDB-style 32 KiB blocks of chunks, each
    with a 7-byte header: checksum, length, kind 1=full 2=first 3=middle 4=last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    assert data[:4] == b":W&B"
    rows, chunk, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, size, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


def test_trackio_gets_the_metrics(tiny_config, tmp_path):
    pytest.importorskip("trackio")
    cfg = tiny_config({"train": {"report_to": ["trackio"], "run_name": "tiny-trackio"}})
    env = {"TRACKIO_DIR": str(tmp_path / "trackio")}
    proc = _train(cfg, env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    read = ("import json; from trackio.sqlite_storage import SQLiteStorage; "
            "print(json.dumps(SQLiteStorage.get_logs('tiny-trackio', 'tiny-trackio'), default=str))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120)  # fmt: skip
    logs = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["step"] for r in logs if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_missing_tracker_stops_before_anything_is_written(tiny_config, tmp_path, capsys,
                                                           monkeypatch):  # fmt: skip
    real = importlib.util.find_spec
    monkeypatch.setattr(metrics_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))  # fmt: skip
    assert main(["train", str(tiny_config({"train": {"report_to": ["wandb"]}}))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'unmask[wandb]'" in err[0]
    assert not (tmp_path / "run").exists()
