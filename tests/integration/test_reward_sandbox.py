"""User reward functions and the code reward run in worker processes, never in the training
process: runaway code (an endless loop, unbounded allocation, deleting files, exiting,
crashing) is stopped, scored 0, counted and described in one line, and the worker goes on;
RewardSet.check refuses a reward that cannot be imported, raises or returns no number with
one line (docs/rewards.md)."""

import os
import signal
import sys
import textwrap

import pytest

from unmask.errors import InputError
from unmask.rewards import RewardSet, parse_rewards, sandbox

USER_MODULE = '''
import ctypes, math, os

THRESHOLD = 0.5

def score(prompt, completion, record):
    """Misbehaves on request, else exact match."""
    if completion == "loop":
        while True:
            pass
    if completion == "allocate":
        hoard = []
        while True:
            hoard.append(bytearray(10**6))
    if completion == "delete":
        os.remove(record["path"])
        return 1.0
    if completion == "exit":
        os._exit(3)
    if completion == "crash":
        ctypes.string_at(0)
    return float(completion.strip() == record["answer"])

def pid(prompt, completion, record):
    return os.getpid()

def where(prompt, completion, record):
    """1.0 when the call runs in a fresh folder inside the worker's, with HOME there."""
    cwd = os.getcwd()
    fresh = not os.listdir(cwd) and os.path.basename(cwd).startswith("call-")
    open("litter.txt", "w").close()  # the next call still gets an empty folder
    home = os.environ["HOME"] == os.environ["TMPDIR"] == cwd
    return float(fresh and home and "unmask-reward-" in cwd)

def text(prompt, completion, record):
    return "yes"

def missing(prompt, completion, record):
    return None

def nan(prompt, completion, record):
    return math.nan

def divide(prompt, completion, record):
    return 1 / 0

def boolean(prompt, completion, record):
    return completion == record["answer"]
'''

FAST = {"timeout_s": 1.5, "memory_mb": 100}


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """rw_user.py on this process's sys.path (the worker gets the same path), never
    imported here; the test runs in a folder that holds keep.txt, outside any sandbox."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "rw_user.py").write_text(USER_MODULE)
    (tmp_path / "lib" / "rw_broken.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    monkeypatch.chdir(outside)
    return outside / "keep.txt"


def score_all(rewards, completions, record):
    n = len(completions)
    return rewards(["prompt"] * n, completions, [record] * n)


def test_user_functions_run_in_another_process_in_a_fresh_folder(user_module):
    specs = parse_rewards([{"fn": "rw_user:pid"}, {"fn": "rw_user:where", "parallel_calls": 1}])
    with RewardSet(specs) as rewards:
        scores = score_all(rewards, ["a", "b", "c"], {"answer": "a"})
        workers = rewards.worker_pids()
        own_namespaces = rewards.guards()["pid"]["call_namespaces"]
    pids = scores.per_reward["pid"].tolist()
    assert os.getpid() not in workers.values()
    if own_namespaces:  # each call is the first process of a PID namespace of its own
        assert pids == [1.0, 1.0, 1.0]
    else:
        assert len(set(pids)) == 3 and os.getpid() not in pids  # each in its own process
    assert scores.per_reward["where"].tolist() == [1.0, 1.0, 1.0]
    assert "rw_user" not in sys.modules


def test_runaway_user_code_is_stopped_scored_zero_and_logged(user_module):
    completions = ["loop", "allocate", "delete", "exit", "crash", "72", "71"]
    record = {"answer": "72", "path": "keep.txt"}  # relative: resolves in the call's folder
    with RewardSet(parse_rewards([{"fn": "rw_user:score", **FAST}])) as rewards:
        scores = score_all(rewards, completions, record)
        worker = rewards.worker_pids()["score"]
        again = score_all(rewards, ["72", "7"], record)  # the same worker carries on
        assert rewards.worker_pids()["score"] == worker
    assert scores.per_reward["score"].tolist() == [0, 0, 0, 0, 0, 1, 0]
    assert scores.total.tolist() == [0, 0, 0, 0, 0, 1, 0]
    assert scores.failures == {"score": 5}
    assert scores.failure_lines == [
        "reward 'score' on completion 0: timed out after 1.5 s (timeout_s); scored 0",
        "reward 'score' on completion 1: ran out of memory (memory_mb=100); scored 0",
        "reward 'score' on completion 2: raised FileNotFoundError: [Errno 2] No such file or "
        "directory: 'keep.txt'; scored 0",
        "reward 'score' on completion 3: exited (code 3) without returning a score; scored 0",
        "reward 'score' on completion 4: was killed by SIGSEGV; scored 0",
    ]
    assert user_module.read_text() == "precious"
    assert again.per_reward["score"].tolist() == [1.0, 0.0] and again.failures == {"score": 0}


def test_deleting_a_file_outside_the_sandbox_is_refused(user_module):
    with RewardSet(parse_rewards([{"fn": "rw_user:score", **FAST}])) as rewards:
        scores = score_all(rewards, ["delete", "72"], {"answer": "72", "path": str(user_module)})
        guarded = rewards.write_guarded()["score"]
    if not guarded:  # the file is gone: only Landlock (Linux >= 5.13) stops an absolute path
        pytest.skip("Landlock is not available here (docs/rewards.md, What the sandbox is not)")
    assert user_module.read_text() == "precious"
    assert scores.per_reward["score"].tolist() == [0.0, 1.0]
    assert scores.failure_lines == [
        f"reward 'score' on completion 0: raised PermissionError: [Errno 13] Permission "
        f"denied: '{user_module}'; scored 0"
    ]


CODE_RECORD = {"tests": "assert add(1, 2) == 3\nassert add(2, 2) == 4"}


def test_runaway_code_completions_are_stopped_scored_zero_and_logged(user_module):
    completions = [
        "while True:\n    pass",
        "hoard = []\nwhile True:\n    hoard.append(bytearray(10**6))",
        f"import os\nos.remove({str(user_module)!r})",
        "import os\nos.remove('keep.txt')",
        "```python\ndef add(a, b):\n    return a + b\n```",
        "def add(a, b):\n    return a * b",  # wrong: a failed test, not a failure
        "def add(a, b) return a + b",
    ]
    with RewardSet(parse_rewards([{"fn": "code", **FAST}])) as rewards:
        scores = score_all(rewards, completions, CODE_RECORD)
        guarded = rewards.write_guarded()["code"]
        assert os.getpid() not in rewards.worker_pids().values()
    assert user_module.read_text() == "precious" or not guarded
    assert scores.per_reward["code"].tolist() == [0, 0, 0, 0, 1, 0, 0]
    assert scores.failures == {"code": 5 if guarded else 4}
    lines = [line.removeprefix("reward 'code' on completion ") for line in scores.failure_lines]
    assert lines[:2] == ["0: timed out after 1.5 s (timeout_s); scored 0",
                         "1: ran out of memory (memory_mb=100); scored 0"]  # fmt: skip
    if guarded:
        assert lines[2] == (
            f"2: raised PermissionError: [Errno 13] Permission denied: '{user_module}'; scored 0"
        )
    assert lines[-2:] == [
        "3: raised FileNotFoundError: [Errno 2] No such file or directory: 'keep.txt'; scored 0",
        "6: raised SyntaxError: expected ':' (<completion>, line 1); scored 0",
    ]


def test_code_reward_partial_scores_and_per_test_timeout(user_module):
    record = {"tests": ["assert f(1) == 1", "assert f(-1) == 1", "assert f(2) == 2"]}
    loops_on_negatives = "def f(x):\n    while x < 0:\n        pass\n    return x"
    spec = {"fn": "code", **FAST, "options": {"partial": True, "test_timeout_s": 0.2}}
    with RewardSet(parse_rewards([spec])) as rewards:
        scores = score_all(rewards, [loops_on_negatives, "def f(x):\n    return abs(x)"], record)
    assert scores.per_reward["code"].tolist() == pytest.approx([2 / 3, 1.0])
    assert scores.failures == {"code": 0}


def test_a_record_that_cannot_be_sent_fails_its_calls(user_module):
    with RewardSet(parse_rewards([{"fn": "rw_user:score", **FAST}])) as rewards:
        scores = score_all(rewards, ["72"], {"answer": "72", "hook": lambda: 0})
        again = score_all(rewards, ["72"], {"answer": "72"})
    assert len(scores.failure_lines) == 1 and scores.failures == {"score": 1}
    assert scores.failure_lines[0].startswith(
        "reward 'score' on completion 0: its record cannot be sent to the reward worker ("
    )
    assert "pickle" in scores.failure_lines[0]  # the pickling error's words vary by version
    assert again.per_reward["score"].tolist() == [1.0]


def test_a_dead_worker_is_restarted_by_the_next_call(user_module):
    with RewardSet(parse_rewards([{"fn": "rw_user:score", **FAST}])) as rewards:
        first = rewards.worker_pids()
        assert first == {}  # started on first use
        rewards.check([{"answer": "72"}])
        old = rewards.worker_pids()["score"]
        os.kill(old, signal.SIGKILL)
        rewards._workers[0].proc.wait()
        scores = score_all(rewards, ["72"], {"answer": "72"})
        assert rewards.worker_pids()["score"] != old
    assert scores.per_reward["score"].tolist() == [1.0] and scores.failure_lines == []


def check_error(fn: str, records=({"prompt": "p", "answer": "72"},)) -> str:
    with RewardSet(parse_rewards([{"fn": fn, **FAST}])) as rewards:
        with pytest.raises(InputError) as err:
            rewards.check(list(records))
    assert "\n" not in str(err.value) and "Traceback" not in str(err.value)
    return str(err.value)


def test_check_refuses_what_cannot_be_imported(user_module):
    assert check_error("rw_missing_xyz:score") == (
        "rewards[0].fn: cannot import module 'rw_missing_xyz' (No module named "
        "'rw_missing_xyz'): check that module 'rw_missing_xyz' is importable from the "
        f"directory you run unmask in ({os.getcwd()}) or from PYTHONPATH"
    )
    assert check_error("rw_user:scroe") == (
        "rewards[0].fn: module 'rw_user' has no 'scroe' (did you mean 'rw_user:score'?): "
        "name a function the module defines"
    )
    assert check_error("rw_user:THRESHOLD") == (
        "rewards[0].fn: 'rw_user:THRESHOLD' is a float, not a function: name a function "
        "fn(prompt, completion, record) -> float"
    )
    assert check_error("rw_broken:score") == (
        "rewards[0].fn: importing module 'rw_broken' raised RuntimeError: boom at import: fix it"
    )
    assert "rw_user" not in sys.modules and "rw_broken" not in sys.modules


def test_check_stops_an_import_that_hangs_or_hoards(user_module, tmp_path, monkeypatch):
    (tmp_path / "lib" / "rw_hang.py").write_text("while True:\n    pass\n")
    (tmp_path / "lib" / "rw_hog.py").write_text("hoard = bytearray(10**9)\n")
    monkeypatch.setattr(sandbox, "START_TIMEOUT_S", 1.0)
    assert check_error("rw_hang:score") == (
        "rewards[0].fn: could not load 'rw_hang:score': the reward worker did not answer "
        "within 1 s and was stopped"
    )
    assert check_error("rw_hog:score") == (
        "rewards[0].fn: importing module 'rw_hog' raised MemoryError: raise rewards[0].memory_mb"
    )


def test_check_refuses_what_raises_or_returns_no_number(user_module):
    called = "on record 0 (called with its 'answer' as the completion)"
    assert check_error("rw_user:text") == (
        f"rewards[0].fn: 'rw_user:text' returned str 'yes', not a number {called}: return a "
        "float (an int or a bool also works)"
    )
    assert check_error("rw_user:missing").startswith(
        f"rewards[0].fn: 'rw_user:missing' returned None, not a number {called}"
    )
    assert check_error("rw_user:nan").startswith(
        f"rewards[0].fn: 'rw_user:nan' returned nan, not a finite number {called}"
    )
    assert check_error("rw_user:divide") == (
        "rewards[0].fn: 'rw_user:divide' raised ZeroDivisionError: division by zero "
        f"{called}: a reward must return a number for any completion (catch what can fail)"
    )
    assert check_error("rw_user:score", [{"answer": "72"}, {"answer": "loop"}]) == (
        "rewards[0].fn: 'rw_user:score' timed out after 1.5 s (timeout_s) on record 1 (called "
        "with its 'answer' as the completion): make it faster or raise rewards[0].timeout_s"
    )


def test_check_passes_good_rewards_and_bools_count(user_module):
    specs = parse_rewards([{"fn": "rw_user:boolean", **FAST}, {"fn": "code", **FAST}])
    record = {"prompt": "p", "answer": "72", **CODE_RECORD}
    with RewardSet(specs) as rewards:
        rewards.check([record, record])
        scores = score_all(rewards, ["72", "71"], record)
    assert scores.per_reward["boolean"].tolist() == [1.0, 0.0]
    with RewardSet(parse_rewards([{"fn": "rw_user:where", **FAST}])) as rewards:
        rewards.check([{"prompt": "no reference answer"}])  # called with ""


def test_check_refuses_code_records_without_good_tests(user_module):
    assert check_error("code", [{"prompt": "p"}]) == (
        "rewards[0] (code): record 0 has no 'tests' (its keys: ['prompt']): give records "
        "their tests, or set rewards[0].options.tests_key"
    )
    assert check_error("code", [{"tests": "assert f(1) = 1"}]).startswith(
        "rewards[0] (code): record 0's 'tests': SyntaxError: "
    )


def test_a_reward_whose_worker_cannot_start_scores_zero_with_one_line(user_module):
    with RewardSet(parse_rewards([{"fn": "rw_missing_xyz:score"}, "exact_match"])) as rewards:
        scores = score_all(rewards, ["72", "71"], {"answer": "72"})
    assert scores.total.tolist() == [1.0, 0.0]
    assert scores.failures == {"score": 2, "exact_match": 0}
    assert scores.failure_lines == [
        "reward 'score': its worker could not start (No module named 'rw_missing_xyz'); all 2 "
        "completions scored 0"
    ]


def test_prints_and_input_do_not_disturb_the_worker(user_module, tmp_path, monkeypatch):
    (tmp_path / "lib" / "rw_noisy.py").write_text(textwrap.dedent('''
        import sys
        def score(prompt, completion, record):
            print("x" * 10000)
            sys.stdout.flush()
            return float(len(sys.stdin.read()) == 0)
    '''))  # fmt: skip
    with RewardSet(parse_rewards([{"fn": "rw_noisy:score", **FAST}])) as rewards:
        scores = score_all(rewards, ["a", "b"], {"answer": "a"})
    assert scores.per_reward["score"].tolist() == [1.0, 1.0]
