"""A pipeline schedule added from outside the package, as docs/architecture.md says (Where
to add, a pipeline schedule): a `ScheduleSpec` registered by an installed package's
`unmask.plugins` module is a parallel.pipeline_schedule value of `unmask train` under torchrun
(pp=2, two stages per rank, against the one-process run) and of `unmask plan`, with no edit
of unmask/. The toy is torch's ScheduleLoopedBFS: every forward of a stage's micro-batches
first, so the head's loss is the chunked one and every micro-batch's activations are live
at once."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import installed_plugin, losses, train_in_process, write_run_config
from launch import rank_env, torchrun_command

from unmask.config import load_config
from unmask.parallel.schedules import PIPELINE_SCHEDULES

pytestmark = pytest.mark.slow
STEPS = 6
PLUGIN = textwrap.dedent("""
    from unmask.parallel.schedules import ScheduleSpec, register_schedule

    register_schedule(ScheduleSpec("looped_bfs", "ScheduleLoopedBFS", multi_stage=True,
                                   head_loss="chunked", forwards_first=True))
""")
BASE = {
    "model": {"num_hidden_layers": 4},
    "train": {"split_batches": True, "eval_steps": 0, "save_steps": 0, "logging_steps": 1,
              "max_steps": STEPS, "pipeline_parallel": 2, "pipeline_schedule": "looped_bfs",
              "pipeline_stages_per_rank": 2, "pipeline_microbatches": 4},
}  # fmt: skip


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The plug-in as an installed package (its module and a dist-info folder naming it in
    the `unmask.plugins` entry-point group), registered in this process too."""
    root = installed_plugin(tmp_path_factory.mktemp("schedule_plugin"), "toy_schedule", None,
                            PLUGIN)  # fmt: skip
    sys.path.insert(0, str(root))
    import toy_schedule  # noqa: F401  (registers it here: the one-process reference)

    yield root
    PIPELINE_SCHEDULES.pop("looped_bfs")
    sys.path.remove(str(root))
    sys.modules.pop("toy_schedule")


def test_an_unregistered_schedule_is_refused_naming_the_registered_ones(tmp_path):
    path = write_run_config(tmp_path, "bad", BASE, {"train": {"pipeline_schedule": "bfs"}})
    with pytest.raises(
        Exception, match="parallel.pipeline_schedule.*Input should be 'gpipe', '1f1b'"
    ):
        load_config(path)


def test_the_registered_schedule_trains_under_torchrun_as_one_process(plugin, tmp_path):
    config = write_run_config(tmp_path, "pp2-bfs", BASE, {})
    env = rank_env({"PYTHONPATH": os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")])})
    run = subprocess.run(torchrun_command(2, "-m", "unmask.cli", "train", config), env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "looped_bfs" in run.stdout + run.stderr  # the start-up line names the schedule
    single = train_in_process(config, tmp_path / "one", pipeline_parallel=1,
                              pipeline_schedule="1f1b", pipeline_stages_per_rank=1,
                              pipeline_microbatches=None)  # fmt: skip
    split, one = losses(tmp_path / "pp2-bfs"), losses(single)
    assert sorted(split) == sorted(one) == list(range(1, STEPS + 1))
    for step in one:
        assert split[step] == pytest.approx(one[step], rel=1e-5), step

    def plan(*overrides: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "unmask", "plan", str(config), *overrides,
                               "--world", "2", "--device", "cpu", "--json"], env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    bfs, interleaved = plan(), plan("parallel.pipeline_schedule=interleaved_1f1b")
    assert bfs["bubble"] == pytest.approx(1 / (2 * 4 + 1))  # (p - 1) / (v m + p - 1)
    # every forward first: rank 0 holds all 4 micro-batches' activations, interleaved 1F1B's
    # warm-up 5 stage-micro-batches of half its layers (the spec's in_flight)
    assert PIPELINE_SCHEDULES["looped_bfs"].in_flight(4, 2, 2, 0) == 4.0
    ratio = (
        bfs["ranks"][0]["memory"]["activations"] / interleaved["ranks"][0]["memory"]["activations"]
    )
    assert ratio == pytest.approx(4 / 2.5, rel=0.01)
