"""A lost peer process: which errors are collective failures (and which keep their
traceback), the resume command the stop line ends with, and the CLI's one line.

The messages are torch 2.13's own, as gloo and the c10d store printed them when a peer was
SIGKILLed or SIGSTOPped mid-run (tests/integration/test_distributed_failure.py makes them
for real)."""

import pytest
import torch.distributed as dist
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from unmask.cli import main
from unmask.errors import RunStopped
from unmask.parallel.distributed import CollectiveFailure, collective_failure
from unmask.train.run_dir import resume_command

GLOO_CLOSED = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:62162. This is typically caused by a remote worker crashing. Check the "
    "logs of the remote worker before reporting an error. GLHF! \N{BEACH WITH UMBRELLA}"
)
GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
    "[127.0.0.1]:29360: Connection reset by peer"
)
GLOO_TIMEOUT = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
    "waiting 10000ms for recv operation to complete"
)
STORE_CLOSED = (
    "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server "
    "shutdown or crash?"
)


@pytest.mark.parametrize(
    "error, expected",
    [
        (RuntimeError(GLOO_CLOSED), CollectiveFailure(False, "Connection closed by peer [127.0.0.1]:62162")),
        (RuntimeError(GLOO_RESET), CollectiveFailure(False, "Read error [127.0.0.1]:29360: Connection reset by peer")),
        (RuntimeError(GLOO_TIMEOUT), CollectiveFailure(True, "Timed out waiting 10000ms for recv operation to complete")),
        (dist.DistNetworkError(STORE_CLOSED), CollectiveFailure(False, "Failed to recv, got 0 bytes")),
        (dist.DistStoreError("Socket Timeout"), CollectiveFailure(True, "Socket Timeout")),
    ],
)  # fmt: skip
def test_what_gloo_and_the_store_raise_for_a_lost_peer_is_a_collective_failure(error, expected):
    assert collective_failure(error) == expected


def test_a_collective_failure_inside_a_checkpoint_error_is_found():
    """DCP gathers each rank's error into a CheckpointException (a BaseException); an async
    write's error reaches the loop as the RunStopped that names it, with it as the cause."""
    dcp_error = CheckpointException("save failed", {1: (RuntimeError(GLOO_CLOSED), None)})
    assert collective_failure(dcp_error) == CollectiveFailure(
        False, "Connection closed by peer [127.0.0.1]:62162"
    )
    stopped = RunStopped("checkpoint-6 could not be written")
    stopped.__cause__ = dcp_error
    assert collective_failure(stopped) == collective_failure(dcp_error)
    try:  # an error raised while the collective's was on its way out: its context
        try:
            raise RuntimeError(GLOO_TIMEOUT)
        except RuntimeError:
            raise KeyError("hook state") from None
    except KeyError as err:
        assert collective_failure(err).timed_out


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x32 and 64x32)"),
        RuntimeError("DataLoader timed out after 5 seconds"),  # a timeout, not a collective's
        RuntimeError(
            "[enforce fail at ../third_party/gloo/gloo/allreduce.cc:41] "
            "opts.elements == elements. 16 vs 32"
        ),  # a usage bug
        dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage"),
        ValueError("connection closed by peer"),  # not an error torch.distributed raises
        OSError("[Errno 28] No space left on device"),
        RunStopped("steps 3-7 had a non-finite loss or gradient norm"),
    ],
)
def test_other_errors_are_not_collective_failures(error):
    """A genuine bug (or a full disk) is not reported as a lost peer: it keeps its traceback
    or its own line."""
    assert collective_failure(error) is None


def test_the_resume_command_is_the_users_own_with_resume_from_checkpoint():
    overrides = ["train.max_steps=900", "train.overwrite_output_dir=true",
                 "train.resume_from_checkpoint=false"]  # fmt: skip
    assert resume_command("runs/r", "my runs/run.yaml", overrides) == (
        "unmask train 'my runs/run.yaml' train.max_steps=900 train.output_dir=runs/r "
        "train.resume_from_checkpoint=true"
    )
    assert resume_command("runs/quickstart", None) == (
        "unmask train train.output_dir=runs/quickstart train.resume_from_checkpoint=true"
    )


@pytest.fixture
def lost_peer(monkeypatch, tiny_config):
    """`unmask train` whose run stops as the trainer stops it when a peer is lost."""

    class StoppedTrainer:
        exit_code = 0

        def __init__(self, cfg, **_):  # the CLI passes decide_checkpointing
            pass

        def train(self):
            raise RunStopped(
                "a peer process was lost after step 7: its connection closed (Connection "
                "closed by peer [127.0.0.1]:62162); the newest complete checkpoint is "
                "runs/run/checkpoint-6",
                resume=True,
            ) from RuntimeError(GLOO_CLOSED)

    monkeypatch.setattr("unmask.train.trainer.Trainer", StoppedTrainer)
    return tiny_config()


def test_the_cli_prints_one_line_with_the_resume_command(lost_peer, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    run_dir = yaml.safe_load(lost_peer.read_text())["train"]["output_dir"]
    assert main(["train", str(lost_peer), "train.max_steps=900"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "unmask: stopped: a peer process was lost after step 7: its connection closed "
        "(Connection closed by peer [127.0.0.1]:62162); the newest complete checkpoint is "
        f"runs/run/checkpoint-6; resume with: unmask train {lost_peer} train.max_steps=900 "
        f"train.output_dir={run_dir} train.resume_from_checkpoint=true"
    ]
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: every process, as launched
    monkeypatch.setenv("RANK", "0")
    assert main(["train", str(lost_peer)]) == 1
    assert capsys.readouterr().err.endswith(
        "; resume by launching every process as before, with: unmask train "
        f"{lost_peer} train.output_dir={run_dir} train.resume_from_checkpoint=true\n"
    )


def test_debug_shows_the_collectives_traceback(lost_peer, capsys):
    assert main(["train", str(lost_peer), "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo" in err
    assert err.splitlines()[-1].startswith("unmask: stopped: a peer process was lost")
