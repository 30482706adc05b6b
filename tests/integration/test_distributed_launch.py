"""The launch recipes start real multi-process runs: `accelerate launch` with the shipped
config, and srun-style processes that only have SLURM's variables (no torchrun)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY, deep_update

from unmask.checkpoint import is_distributed_checkpoint, list_checkpoints

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
#: optimizer steps per run; the 2-process losses must equal the one-process run's
STEPS = 3


def write_config(tmp_path: Path) -> Path:
    extra = {"train": {"output_dir": str(tmp_path / "run"), "max_steps": STEPS}}
    tree = deep_update(TINY, deep_update({"train": {"split_batches": True}}, extra))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def losses(run: Path) -> list[float]:
    rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in rows if "loss" in r]


def assert_two_rank_run(run: Path, reference: list[float]) -> None:
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
