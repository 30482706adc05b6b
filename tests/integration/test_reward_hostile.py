"""Hostile rewards: what a reward function, or a completion the code reward runs, must not
be able to do from its worker (docs/rewards.md, What the sandbox is): return a score the
training process cannot hold, forge its result, read the training process's secrets, reach
127.0.0.1, signal the training process, leave processes behind, start processes without
limit.

Each runs with the worker's namespaces and without them (what a kernel that refuses them
gives); a guard the worker reports missing (RewardSet.guards) must be one that lets the
hostile reward through, so the report, and the notice built from it, say what holds."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from unmask.errors import InputError
from unmask.rewards import RewardSet, parse_rewards, sandbox

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux guards")

HOSTILE_MODULE = '''
import os, signal, socket, sys, time

def number(prompt, completion, record):
    return float(completion)

def sees(prompt, completion, record):
    """1.0 when the value `completion` is in this process's environment, 2.0 when only in
    the /proc/<pid>/environ of a process it can see, else 0.0."""
    if completion in os.environ.values():
        return 1.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if completion.encode() in open(f"/proc/{pid}/environ", "rb").read():
                return 2.0
        except OSError:
            pass
    return 0.0

def connects(prompt, completion, record):
    try:
        socket.create_connection(("127.0.0.1", record["port"]), timeout=2).close()
        return 1.0
    except OSError:
        return 0.0

def kill(prompt, completion, record):
    os.kill(record["pid"], signal.SIGKILL)
    return 1.0

def escape(prompt, completion, record):
    """Leaves a sleeping process behind with record["tag"] on its command line: a child
    (holding the result pipe open) or, for "setsid", a grandchild in a session of its own;
    1.0 once it runs."""
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, True)
    code = "import os, sys, time; os.write(int(sys.argv[1]), b'x'); time.sleep(60)"
    if os.fork() == 0:
        if completion == "setsid":
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
        os.execv(sys.executable, [sys.executable, "-c", code, str(write_end), record["tag"]])
    os.close(write_end)
    return float(os.read(read_end, 1) == b"x")

def fork_many(prompt, completion, record):
    """Forks sleeping children until refused, at most record["most"]; how many it made."""
    made = 0
    for _ in range(record["most"]):
        try:
            child = os.fork()
        except OSError:
            break
        if child == 0:
            time.sleep(30)
            os._exit(0)
        made += 1
    return made
'''

FAST = {"timeout_s": 1.5, "memory_mb": 100}
CODE_RECORD = {"tests": "assert add(1, 2) == 3\nassert add(2, 2) == 4"}


@pytest.fixture
def hostile(tmp_path, monkeypatch):
    """rw_hostile.py on this process's sys.path (the worker gets the same path); the
    folder, for a training process started by the test."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "rw_hostile.py").write_text(HOSTILE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "lib"


@pytest.fixture(params=["namespaces", "no namespaces"])
def namespaces(request, monkeypatch):
    monkeypatch.setattr(sandbox, "USE_NAMESPACES", request.param == "namespaces")
    return request.param == "namespaces"


def score_all(rewards, completions, record):
    n = len(completions)
    return rewards(["prompt"] * n, completions, [record] * n)


def test_a_score_beyond_the_reward_limit_is_a_failure(hostile):
    with RewardSet(parse_rewards([{"fn": "rw_hostile:number", **FAST}])) as rewards:
        scores = score_all(rewards, ["1e39", "-1e39", "2e6", "1e6", "-0.5"], {})
    assert scores.per_reward["number"].tolist() == [0.0, 0.0, 0.0, 1e6, -0.5]
    assert scores.total.tolist() == [0.0, 0.0, 0.0, 1e6, -0.5]
    assert scores.failures == {"number": 3}
    assert scores.failure_lines == [
        f"reward 'number' on completion {i}: returned {shown}, beyond the reward limit of "
        "±1e+06; scored 0"
        for i, shown in enumerate(["1e+39", "-1e+39", "2e+06"])
    ]
    with RewardSet(parse_rewards([{"fn": "rw_hostile:number", **FAST}])) as rewards:
        with pytest.raises(InputError) as err:
            rewards.check([{"answer": "1e39"}])
    assert str(err.value) == (
        "rewards[0].fn: 'rw_hostile:number' returned 1e+39, beyond the reward limit of ±1e+06 "
        "on record 0 (called with its 'answer' as the completion): keep rewards within ±1e+06 "
        "(rescale them)"
    )


# completions that fail their tests but first write a made-up result ({"score": 1.0} and a
# newline, what a call's process sends the worker) where they can, and end at once
FORGE_INHERITED = """
import os
def add(a, b):
    return a - b
for fd in range(3, 1024):
    try:
        os.write(fd, b'{"score": 1.0}\\n')
    except OSError:
        pass
os._exit(0)
"""
FORGE_PROC = """
import os, stat
def add(a, b):
    return a - b
def parent(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("PPid:"):
            return line.split()[1]
pid = parent("self")
for _ in range(2):  # its parent and grandparent: the newest pipe of the first one it can open
    pipes = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if stat.S_ISFIFO(os.stat(f"/proc/{pid}/fd/{fd}").st_mode):
                pipes.append(int(fd))
        except OSError:
            pass
    if pipes:
        os.write(os.open(f"/proc/{pid}/fd/{max(pipes)}", os.O_WRONLY), b'{"score": 1.0}\\n')
        break
    pid = parent(pid)
os._exit(0)
"""


def test_code_cannot_forge_its_result_through_descriptors(hostile, namespaces):
    good = "def add(a, b):\n    return a + b"
    with RewardSet(parse_rewards([{"fn": "code", **FAST}])) as rewards:
        inherited = score_all(rewards, [FORGE_INHERITED], CODE_RECORD)
        proc = score_all(rewards, [FORGE_PROC], CODE_RECORD)
        again = score_all(rewards, [good, FORGE_INHERITED, good], CODE_RECORD)
    assert inherited.per_reward["code"].tolist() == proc.per_reward["code"].tolist() == [0.0]
    assert (
        inherited.failure_lines
        == proc.failure_lines
        == ["reward 'code' on completion 0: exited (code 0) without returning a score; scored 0"]
    )
    assert again.per_reward["code"].tolist() == [1.0, 0.0, 1.0]  # the worker was not misled
    assert again.failures == {"code": 1}


TRAINER = """
import json, os, sys
from unmask.rewards import RewardSet, parse_rewards, sandbox

sandbox.USE_NAMESPACES = sys.argv[1] == "True"
specs, completions = json.loads(sys.argv[2]), json.loads(sys.argv[3])
completions = [c.replace("TRAINER_PID", str(os.getpid())) for c in completions]
record = {"pid": os.getpid(), "tests": "assert add(1, 2) == 3"}
with RewardSet(parse_rewards(specs)) as rewards:
    scores = rewards(["p"] * len(completions), completions, [record] * len(completions))
    guards = rewards.guards()
print(json.dumps({"scores": {k: v.tolist() for k, v in scores.per_reward.items()},
                  "lines": scores.failure_lines, "guards": guards}))
"""


def run_trainer(lib, namespaces: bool, specs: list, completions: list, **env) -> dict:
    """Score `completions` in a training process of its own (with `env` added to its
    environment); what it printed, after checking that it ended well."""
    path = os.pathsep.join([str(lib), os.environ.get("PYTHONPATH", "")])
    argv = [sys.executable, "-c", TRAINER, str(namespaces), json.dumps(specs),
            json.dumps(completions)]  # fmt: skip
    trainer = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                             env={**os.environ, **env, "PYTHONPATH": path})  # fmt: skip
    assert trainer.returncode == 0, (trainer.returncode, trainer.stderr[-2000:])
    return json.loads(trainer.stdout.splitlines()[-1])


def test_rewards_see_no_secret_of_the_training_process(hostile, namespaces, monkeypatch):
    """The training process's environment holds a secret from its start (so that its
    /proc/<pid>/environ shows it too)."""
    secret = f"token-{uuid.uuid4().hex}"
    specs = [{"fn": "rw_hostile:sees", **FAST}]
    path = os.environ["PATH"]
    out = run_trainer(hostile, namespaces, specs, [secret, path], UNMASK_TEST_SECRET=secret)
    assert out["scores"]["sees"][0] != 1.0  # not in the worker's environment, in any case
    assert out["scores"]["sees"][1] == 1.0  # PATH is on the allow-list
    own_proc = out["guards"]["sees"]["own_proc"]
    assert out["scores"]["sees"][0] == 0.0 or not own_proc  # /proc: without it, it may be
    monkeypatch.setenv("UNMASK_TEST_SECRET", secret)
    given = {"fn": "rw_hostile:sees", "env": ["UNMASK_TEST_SECRET"], **FAST}
    with RewardSet(parse_rewards([given])) as rewards:
        assert score_all(rewards, [secret], {}).per_reward["sees"].tolist() == [1.0]
    if not own_proc:
        seen = "was" if out["scores"]["sees"][0] else "was not"
        why = out["guards"]["sees"]["why"]
        pytest.skip(f"no /proc of its own here ({why}): the secret {seen} in /proc/<pid>/environ")


def test_rewards_cannot_reach_the_loopback_network(hostile, namespaces):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        record = {"port": listener.getsockname()[1]}
        with RewardSet(parse_rewards([{"fn": "rw_hostile:connects", **FAST}])) as rewards:
            scores = score_all(rewards, ["a"], record)
            guards = rewards.guards()["connects"]
        held = guards["network_namespace"] or guards["tcp_blocked"]
        assert scores.per_reward["connects"].tolist() == [0.0 if held else 1.0]
        allowed = {"fn": "rw_hostile:connects", "network": True, **FAST}
        with RewardSet(parse_rewards([allowed])) as rewards:
            scores = score_all(rewards, ["a"], record)
        assert scores.per_reward["connects"].tolist() == [1.0]  # `network: true`
        listener.settimeout(0.5)
        accepted = []
        while len(accepted) < 3:
            try:
                accepted.append(listener.accept()[0].close())
            except OSError:
                break
    assert len(accepted) == (1 if held else 2)
    if not held:
        pytest.skip(f"no network namespace nor Landlock TCP rules here ({guards['why']})")


def guards_here() -> dict:
    """The guards a worker has here (with the namespaces the test asked for)."""
    with RewardSet(parse_rewards([{"fn": "rw_hostile:number", **FAST}])) as rewards:
        rewards.check([{"answer": "1"}])
        return rewards.guards()["number"]


def test_rewards_cannot_signal_the_training_process(hostile, namespaces):
    """A user function and a completion the code reward runs each SIGKILL the training
    process (one of its own, so that the test survives when they succeed)."""
    kills = (
        "import os, signal\nos.kill(TRAINER_PID, signal.SIGKILL)\ndef add(a, b):\n    return a + b"
    )
    specs = [{"fn": "rw_hostile:kill", "timeout_s": 5}, {"fn": "code", "timeout_s": 5}]
    guards = guards_here()
    if not (guards["pid_namespace"] or guards["signals_scoped"]):
        with pytest.raises(AssertionError, match=r"^\(-9, "):
            run_trainer(hostile, namespaces, specs, [kills])
        pytest.skip(f"no PID namespace nor Landlock signal scope here ({guards['why']})")
    out = run_trainer(hostile, namespaces, specs, [kills])  # it ended well: it was not killed
    assert out["scores"] == {"kill": [0.0], "code": [0.0]}
    denied = ("raised ProcessLookupError: [Errno 3] No such process; scored 0",
              "raised PermissionError: [Errno 1] Operation not permitted; scored 0")  # fmt: skip
    assert [line.split(": ", 1)[1] in denied for line in out["lines"]] == [True, True]


def tagged_processes(tag: str, wait_s: float = 0.0) -> list[int]:
    """Processes (not zombies) with `tag` among their command-line arguments, after waiting
    up to wait_s for them to go (a SIGKILLed process takes a moment to end)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if tag.encode() in open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0"):
                    found.append(int(pid))
            except OSError:
                pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["child", "setsid"])
def test_what_a_call_leaves_running_is_killed_with_it(hostile, namespaces, how):
    tag = f"unmask-test-{uuid.uuid4().hex}"
    try:
        spec = {"fn": "rw_hostile:escape", "timeout_s": 10}  # it starts an interpreter
        with RewardSet(parse_rewards([spec])) as rewards:
            scores = score_all(rewards, [how], {"tag": tag})
            guards = rewards.guards()["escape"]
            left = tagged_processes(tag, wait_s=2.0)  # the worker still runs: the call's end
    finally:
        for pid in tagged_processes(tag):
            os.kill(pid, signal.SIGKILL)
    assert scores.per_reward["escape"].tolist() == [1.0]  # scored when it returned
    assert scores.failures == {"escape": 0}
    if how == "child" or guards["call_namespaces"]:
        assert left == []
    else:  # its own session: out of the call's process group
        assert len(left) == 1
        pytest.skip(f"no PID namespace per call here ({guards['why']}): docs/rewards.md")


def test_rewards_have_a_process_count_limit(hostile):
    most = sandbox.process_limit(1) + 100
    spec = {"fn": "rw_hostile:fork_many", "parallel_calls": 1, "timeout_s": 10}
    with RewardSet(parse_rewards([spec])) as rewards:
        scores = score_all(rewards, ["a"], {"most": most})
        guards = rewards.guards()["fork_many"]
        again = score_all(rewards, ["a"], {"most": 3})  # the children of the first are gone
    made = scores.per_reward["fork_many"].item()
    assert again.per_reward["fork_many"].tolist() == [3.0]
    if not guards["process_limit"]:
        assert made == most
        pytest.skip(f"no pids cgroup nor user namespace here ({guards['why']})")
    assert 10 < made < sandbox.process_limit(1)


def has_cap_sys_admin() -> bool:
    with open("/proc/self/status") as f:
        caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return bool(caps & (1 << 21))


@pytest.mark.skipif(not has_cap_sys_admin(), reason="needs CAP_SYS_ADMIN (root) for every guard")
def test_with_cap_sys_admin_every_guard_holds_and_nothing_is_said(hostile, capsys):
    guards = guards_here()
    assert {name for name, held in guards.items() if held is False} == {"user_namespace"}
    assert guards["why"] == [] and "/unmask-reward-" in guards["cgroup"]
    assert "fewer guards" not in capsys.readouterr().err
