"""Torch threads (unmask/parallel/threads.py): `auto` gives a tiny CPU model one thread per idle
core unless OMP_NUM_THREADS is set; train.num_threads sets a count; `unmask generate` applies
`auto`. The machine's load is set by the tests (`busy`), never read from the shared machine."""

import os
import time

import pytest
import torch
from conftest import TINY, deep_update, save_tiny_model

from unmask.cli import main
from unmask.config import validate_tree
from unmask.errors import InputError
from unmask.parallel import threads
from unmask.parallel.threads import TINY_MODEL_PARAMS, auto_threads, set_threads
from unmask.train.trainer import Trainer


@pytest.fixture
def two_threads(monkeypatch):
    """Torch at 2 threads with OMP_NUM_THREADS unset (a user's plain shell) on a 2-core
    machine with one core busy with other work; restored."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "busy_cores", lambda: (1.0, 2))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_auto_is_one_thread_per_idle_core_for_a_tiny_cpu_model_only(two_threads, monkeypatch):
    assert TINY_MODEL_PARAMS == 5_000_000
    chosen, why = auto_threads(800_000, "cpu")  # the quickstart's size, one core busy
    assert chosen == 1
    assert why.startswith("auto: a 0.80M-parameter model, 1.0 of 2 cores busy with other work")
    assert auto_threads(TINY_MODEL_PARAMS - 1, "cpu")[0] == 1
    assert auto_threads(TINY_MODEL_PARAMS, "cpu") is None  # large enough: torch's count
    assert auto_threads(800_000, "cuda") is None
    for busy, cores, expected in [(0.0, 2, None), (0.4, 2, None), (0.6, 2, 1), (7.5, 2, 1),
                                  (5.0, 8, None)]:  # fmt: skip
        monkeypatch.setattr(threads, "busy_cores", lambda b=busy, c=cores: (b, c))
        got = auto_threads(800_000, "cpu")  # idle cores: torch's 2 threads are kept
        assert (got and got[0]) == expected, (busy, cores, got)
    monkeypatch.setattr(threads, "busy_cores", lambda: None)  # no load average: kept
    assert auto_threads(800_000, "cpu") is None
    monkeypatch.setattr(threads, "busy_cores", lambda: (1.0, 2))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user chose: kept
    assert auto_threads(800_000, "cpu") is None


def test_busy_cores_reads_this_machine():
    busy, cores = threads.busy_cores(window_s=0.01)
    assert 0 <= busy and 1 <= cores <= os.cpu_count()


def test_idle_cores_are_the_cores_not_busy_with_other_work(monkeypatch):
    """The busy share of all cores less this process's own CPU time, over windows of
    window_s, the least of the last `keep` windows; between measurements the value stays.
    Clocks and /proc/stat are the test's: (seconds, this process's CPU seconds, all jiffies,
    idle jiffies) on 2 cores, 100 jiffies per core-second."""
    samples = iter([(0.0, 0.0, 0, 0),  # made
                    (1.0, 1.0, 200, 0),  # both cores busy, one of them this process: 1 idle
                    (2.0, 1.5, 400, 100),  # one core busy, half of it this process: 1.5
                    (3.0, 3.5, 600, 100),  # both busy, both this process: 2
                    (4.0, 5.5, 800, 100),  # 2 again
                    (5.0, 5.5, 1000, 300)])  # nothing busy: 2  # fmt: skip
    measure = threads.IdleCores._sample
    monkeypatch.setattr(threads.IdleCores, "_sample", staticmethod(lambda: next(samples)))
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    clock = [0.0]
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock[0])
    idle = threads.IdleCores(window_s=1.0, keep=2)
    idle.cores = 2
    assert idle.idle() is None  # no window yet
    got = []
    for now in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0):
        clock[0] = now
        got.append(idle.idle())
    assert got == [None, 1.0, 1.0, 1.0, 1.5, 2.0, 2.0]  # windows 1, 1.5, 2, 2, 2
    monkeypatch.setattr(threads.IdleCores, "_sample", staticmethod(measure))
    monkeypatch.setattr(threads, "_cpu_jiffies", lambda: None)  # no /proc/stat
    clock[0] = 10.0
    assert threads.IdleCores().idle() is None


def test_idle_cores_reads_this_machine():
    idle = threads.IdleCores(window_s=0.01)
    time.sleep(0.05)
    assert 0 <= idle.idle() <= idle.cores <= os.cpu_count()


def test_set_threads_applies_auto_or_a_count_and_says_so(two_threads):
    line = set_threads("auto", 800_000, "cpu")
    assert torch.get_num_threads() == 1
    assert line.startswith("torch threads: 1 instead of 2 (auto: a 0.80M-parameter model")
    assert set_threads("auto", 800_000, "cpu") is None  # nothing changed: nothing to say
    assert set_threads(3, 800_000, "cpu") == "torch threads: 3 instead of 1 (train.num_threads)"
    assert torch.get_num_threads() == 3
    torch.set_num_threads(2)
    assert set_threads("auto", 50_000_000, "cpu") is None and torch.get_num_threads() == 2


def trainer(tmp_path, train: dict) -> Trainer:
    tree = deep_update(TINY, {"train": {"output_dir": str(tmp_path / "run"), **train}})
    return Trainer(validate_tree(tree))


def test_the_trainer_gives_a_tiny_model_one_thread_unless_told(tmp_path, two_threads, monkeypatch):
    run = trainer(tmp_path / "auto", {"num_threads": "auto"})
    assert torch.get_num_threads() == 1
    assert any(n.startswith("torch threads: 1 instead of 2 (auto: ") for n in run.notices)
    torch.set_num_threads(2)
    run = trainer(tmp_path / "two", {"num_threads": 2})  # asked for: kept
    assert torch.get_num_threads() == 2 and not any("torch threads" in n for n in run.notices)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the environment chose: kept
    trainer(tmp_path / "omp", {"num_threads": "auto"})
    assert torch.get_num_threads() == 2
    with pytest.raises(InputError, match="train.num_threads"):
        trainer(tmp_path / "bad", {"num_threads": 0})


def test_generate_runs_a_tiny_model_on_one_thread(tmp_path, two_threads, capsys):
    folder = save_tiny_model(tmp_path / "model")
    assert main(["generate", "--model", str(folder), "--prompt", "ab", "--gen-length", "4"]) == 0
    assert torch.get_num_threads() == 1
    assert capsys.readouterr().out.startswith("ab")


def test_auto_keeps_the_thread_count_of_the_run_it_resumes(two_threads, monkeypatch):
    """Another count sums in another order on a CPU: the resume would not be exact."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert set_threads("auto", 800_000, "cpu", resumed=1) == (
        "torch threads: 1 instead of 2 (auto: the count the resumed run was trained with, so "
        "it continues exactly)"
    )
    assert torch.get_num_threads() == 1
    assert set_threads("auto", 800_000, "cpu", resumed=1) is None  # already so
    assert set_threads(2, 800_000, "cpu", resumed=1) is not None  # a count asked for wins
    assert torch.get_num_threads() == 2
