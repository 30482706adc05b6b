"""examples/muon_fsdp2.py (docs/muon.md) under torchrun with 2 gloo processes: MuonAdamW made
after fully_shard trains (the loss falls on both ranks); made before, the first step is
refused in one line per rank and the launch fails."""

import re
import subprocess
from pathlib import Path

import pytest
from launch import failure, rank_env, torchrun_command

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def launch(*args: str) -> subprocess.CompletedProcess:
    script = REPO / "examples" / "muon_fsdp2.py"
    return subprocess.run(torchrun_command(2, script, *args), capture_output=True, text=True,
                          timeout=300, env=rank_env())  # fmt: skip


def test_made_after_fully_shard_it_trains():
    proc = launch()
    assert proc.returncode == 0, failure(proc)
    assert sorted(re.findall(r"rank (\d) \(fsdp2\): loss", proc.stdout)) == ["0", "1"], proc.stdout


def test_made_before_fully_shard_the_first_step_is_refused_in_one_line():
    proc = launch("--optimizer-first")
    assert proc.returncode != 0
    # each rank's one line (the two processes' stderr reach torchrun's interleaved)
    refusal = "error: MuonAdamW.step: none of its parameters has a gradient"
    assert proc.stderr.count(refusal) == 2, proc.stderr[-2000:]
    assert "loss" not in proc.stdout  # no step went through
