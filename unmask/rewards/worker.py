"""The reward worker: the process that runs user reward functions and the code reward's
tests, so that the training process never runs user code (docs/rewards.md).

It is started as a script (`python .../worker.py`), not as a module, so it imports neither
torch nor the unmask package: the standard library, isolation.py and code_tests.py (loaded
by path) and the user's module only. The parent sends length-prefixed pickles on the
worker's stdin (an init message, then batches of calls) and reads length-prefixed JSON from
the stdout the worker had at start (results are plain numbers and strings: the training
process never unpickles anything user code made).

Before it imports the user's module the worker puts itself behind the guards of
isolation.py (namespaces, a process-count limit, Landlock, a memory limit), which its calls
inherit. HOME and TMPDIR point to its temporary folder, and each call's working directory is
a fresh folder inside it. Each call runs in a fork of the worker (the user module is
imported once), the first process of its own PID namespace where allowed, in its own process
group, with only its result pipe among its descriptors, a CPU-time limit, a wall-clock limit
enforced here (SIGKILL), stdin from /dev/null and stdout sent to stderr. The code reward runs
a completion's code one process further down, without capabilities and with no descriptor
but 0-2 and a pipe of its own (run_contained). A call that is stopped, crashes, raises or
returns no finite number within the reward limit is reported as an error string; the worker
itself carries on.
"""

import importlib
import importlib.util
import json
import math
import os
import pickle
import select
import shutil
import signal
import stat
import struct
import sys
import time

try:
    import resource
except ImportError:  # not POSIX: no rlimits
    resource = None

HEADER = struct.Struct(">I")
ERROR_CHARS = 300
HERE = os.path.dirname(os.path.abspath(__file__))


def load_file(name: str, filename: str):
    """A module of this folder, by path (this folder is not on sys.path: a user module may
    share a name with one of ours)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, filename))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


isolation = load_file("_unmask_isolation", "isolation.py")


# --- framing ------------------------------------------------------------------------------


def read_exactly(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def receive(fd: int):
    header = read_exactly(fd, HEADER.size)
    if header is None:
        return None
    payload = read_exactly(fd, HEADER.unpack(header)[0])
    return None if payload is None else pickle.loads(payload)


def send(fd: int, message: dict) -> None:
    payload = json.dumps(message).encode()
    write_all(fd, HEADER.pack(len(payload)) + payload)


def close_all_but(*keep: int) -> None:
    """Close every descriptor above 2 except `keep` (the pipes to the parent, other calls'
    pipes, the namespace handle: nothing a call's code may reach)."""
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, max(os.sysconf("SC_OPEN_MAX"), low + 1))


# --- loading ------------------------------------------------------------------------------


def load(target: str):
    """(function, None) or (None, {"kind": ..., "message": ...}) for `module:function`, or
    the code reward's runner for "builtin:code"."""
    if target == "builtin:code":
        return load_file("_unmask_code_tests", "code_tests.py").run_tests, None
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            return None, {"kind": "module_missing", "message": f"No module named {missing!r}"}
        return None, {"kind": "import_raised", "message": describe(err)}
    except BaseException as err:  # noqa: B036 - user code: SystemExit too
        return None, {"kind": "import_raised", "message": describe(err)}
    found = module
    for part in attribute.split("."):
        if not hasattr(found, part):
            names = sorted(n for n in dir(found) if callable(getattr(found, n, None)))
            return None, {"kind": "attribute_missing", "message": part, "names": names}
        found = getattr(found, part)
    if not callable(found):
        return None, {"kind": "not_callable", "message": type(found).__name__}
    return found, None


# --- calls --------------------------------------------------------------------------------


def describe(err: BaseException) -> str:
    text = " ".join(str(err).split())
    text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


def as_score(value, limit: float) -> dict:
    """{"score": float} for a finite number within ±limit (bool = 0/1, numpy scalars and
    anything float() accepts except strings), else {"error": why}."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        what = "None" if value is None else f"{type(value).__name__} {shown}"
        return {"error": f"returned {what}, not a number"}
    try:
        number = float(value)
    except Exception as err:  # noqa: BLE001 - a user type's __float__
        return {"error": f"returned {type(value).__name__}, whose float() raised {describe(err)}"}
    if not math.isfinite(number):
        return {"error": f"returned {number}, not a finite number"}
    if abs(number) > limit:
        return {"error": f"returned {number:g}, beyond the reward limit of ±{limit:g}"}
    return {"score": number}


def evaluate(fn, item, options: dict, limit: float) -> dict:
    """One call of fn: {"score": ...} or {"error": ...} (and "kind": "memory")."""
    prompt, completion, record = item
    try:
        return as_score(fn(prompt, completion, record, **options), limit)
    except MemoryError:
        return {"error": "ran out of memory", "kind": "memory"}
    except BaseException as err:  # noqa: B036 - user code: SystemExit too
        return {"error": f"raised {describe(err)}"}


def describe_status(status: int) -> str:
    """Why a process that gave no result ended, from its wait status."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
        why = " (CPU time limit)" if name == "SIGXCPU" else ""
        return f"was killed by {name}{why}"
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else "?"
    return f"exited (code {code}) without returning a score"


def run_contained(fn, item, options: dict, limit: float) -> dict:
    """evaluate() in a further child that holds no capability and no descriptor but 0-2 and
    a pipe of its own, so the completion's code it runs can reach neither this call's result
    pipe nor the worker's (not inherited, and /proc/<pid>/fd of these non-dumpable processes
    needs CAP_SYS_PTRACE). Its result counts only with this call's random token, so a line
    the code writes on its pipe is not taken for one (docs/rewards.md says what remains)."""
    token = os.urandom(16).hex()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            close_all_but(write_end)
            isolation.die_with_parent()
            why = isolation.drop_privileges()
            if why is not None:
                result = {"error": f"could not run without privileges ({why})"}
            else:
                result = evaluate(fn, item, options, limit)
            # on a line of its own, whatever the code wrote on the pipe before
            write_all(write_end, b"\n" + json.dumps({**result, "token": token}).encode() + b"\n")
        finally:
            os._exit(0)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    os.set_blocking(read_end, False)
    chunks = []
    while True:  # what it wrote before it ended (a process it left may still hold the pipe)
        try:
            chunk = os.read(read_end, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_end)
    for line in reversed(b"".join(chunks).split(b"\n")):
        try:
            result = json.loads(line)
        except ValueError:
            continue
        if isinstance(result, dict) and result.pop("token", None) == token:
            return result
    return {"error": describe_status(status)}


def call_in_child(fn, item, init: dict, call_dir: str, keep: int, contained: bool) -> None:
    """The forked child: run one call, write its JSON result on fd `keep`, exit."""
    try:
        os.setpgid(0, 0)
        isolation.die_with_parent()
        os.chdir(call_dir)
        os.environ["HOME"] = os.environ["TMPDIR"] = call_dir
        if resource is not None:
            cpu = math.ceil(init["timeout_s"]) + 1
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        run = run_contained if contained else evaluate
        result = run(fn, item, init["options"], init["max_abs_reward"])
        write_all(keep, json.dumps(result).encode() + b"\n")  # the newline ends the result
    finally:
        os._exit(0)


class Folders:
    """Empty working folders for the calls, reused while a call leaves its folder empty:
    making and removing a folder costs milliseconds on some file systems (7 ms on ext4
    mounted with discard), checking that one is empty microseconds."""

    def __init__(self, root: str):
        self.root, self.free, self.made = root, [], 0

    def take(self) -> str:
        if self.free:
            return self.free.pop()
        self.made += 1
        path = os.path.join(self.root, f"call-{self.made}")
        os.mkdir(path, 0o700)
        return path

    def give_back(self, path: str) -> None:
        try:
            reusable = (stat.S_ISDIR(os.lstat(path).st_mode) and not os.listdir(path)
                        and os.access(path, os.R_OK | os.W_OK | os.X_OK))  # fmt: skip
        except OSError:
            reusable = False
        if reusable:
            self.free.append(path)
        else:
            shutil.rmtree(path, ignore_errors=True)


class Call:
    def __init__(self, index: int, pid: int, fd: int, call_dir: str, deadline: float):
        self.index, self.pid, self.fd, self.call_dir, self.deadline = (
            index, pid, fd, call_dir, deadline)  # fmt: skip
        self.chunks: list[bytes] = []


class Calls:
    """What every call of this worker shares: the function, the init message, the folders
    and the forker (a fresh PID namespace per call where allowed)."""

    def __init__(self, fn, init: dict, folders: Folders, forker, contained: bool):
        self.fn, self.init, self.folders, self.forker = fn, init, folders, forker
        self.contained = contained

    def start(self, item, index: int) -> Call:
        call_dir = self.folders.take()
        read_end, write_end = os.pipe()
        pid = self.forker.fork()
        if pid == 0:
            close_all_but(write_end)
            call_in_child(self.fn, item, self.init, call_dir, write_end, self.contained)
        os.close(write_end)
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass  # the child did it first, or has already exited
        return Call(index, pid, read_end, call_dir, time.monotonic() + self.init["timeout_s"])

    def end(self, call: Call, timed_out: bool) -> list:
        """[score, None] or [None, error] for a call whose pipe closed or whose time is up."""
        for kill in (os.killpg, os.kill):  # the group: what the call started dies with it
            try:
                kill(call.pid, signal.SIGKILL)
                break
            except OSError:
                continue
        _, status = os.waitpid(call.pid, 0)
        os.close(call.fd)
        self.folders.give_back(call.call_dir)
        if timed_out:
            return [None, f"timed out after {self.init['timeout_s']:g} s (timeout_s)"]
        try:
            result = json.loads(b"".join(call.chunks))
        except ValueError:
            result = None
        if isinstance(result, dict) and "score" in result:
            return [result["score"], None]
        if isinstance(result, dict) and result.get("kind") == "memory":
            return [None, f"ran out of memory (memory_mb={self.init['memory_mb']})"]
        if isinstance(result, dict) and "error" in result:
            return [None, str(result["error"])]
        return [None, describe_status(status)]

    def run_batch(self, items: list) -> list:
        """Each item's [score, error], at most init["parallel"] calls at once."""
        results: list = [None] * len(items)
        pending = list(range(len(items)))[::-1]
        running: dict[int, Call] = {}
        while pending or running:
            while pending and len(running) < self.init["parallel"]:
                i = pending.pop()
                try:
                    call = self.start(items[i], i)
                except OSError as err:  # no process or folder to be had: this call fails
                    results[i] = [None, f"could not start its process ({describe(err)})"]
                    continue
                running[call.fd] = call
            if not running:
                continue
            wait = max(0.0, min(c.deadline for c in running.values()) - time.monotonic())
            ready, _, _ = select.select(list(running), [], [], wait)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                running[fd].chunks.append(chunk)
                # done at the newline (a process the call started may still hold the pipe
                # open) or at end of file (the call ended without a result)
                if not chunk or chunk.endswith(b"\n"):
                    call = running.pop(fd)
                    results[call.index] = self.end(call, False)
            now = time.monotonic()
            for fd in [fd for fd, c in running.items() if c.deadline <= now]:
                call = running.pop(fd)
                results[call.index] = self.end(call, True)
        return results


# --- start --------------------------------------------------------------------------------


def isolate(init: dict, private: tuple):
    """Put this worker behind isolation.py's guards before any user code runs: (what holds,
    by name, with "pid" (its id for the training process), "cgroup" and "why" (what could
    not be had); the CallForker). With a new PID namespace this process forks: the child
    goes on as the namespace's first process, this one waits for it and never returns."""
    why: list[str] = []
    cgroup = None
    if os.geteuid() == 0:
        cgroup, reason = isolation.join_pids_cgroup(init["process_limit"])
        why += [f"process limit: {reason}"] if reason else []
    flags, reason = (isolation.unshare_namespaces(init["network"]) if init["namespaces"]
                     else (0, "turned off"))  # fmt: skip
    why += [f"namespaces: {reason}"] if reason else []
    pid, own_proc = os.getpid(), False
    if flags & isolation.CLONE_NEWPID:
        isolation.become_namespace_init(private, cgroup)
        pid = isolation.outer_pid()
        reason = isolation.mount_own_proc()
        own_proc = reason is None
        why += [f"/proc: {reason}"] if reason else []
    in_user_namespace = bool(flags & isolation.CLONE_NEWUSER)
    if in_user_namespace and isolation.limit_process_count(init["process_limit"]):
        why = [w for w in why if not w.startswith("process limit:")]
        limited = True
    else:
        limited = cgroup is not None
    guards = {
        "network_namespace": bool(flags & isolation.CLONE_NEWNET),
        "pid_namespace": bool(flags & isolation.CLONE_NEWPID),
        "own_proc": own_proc,
        "user_namespace": in_user_namespace,
        "process_limit": limited,
        "memory_limit": isolation.limit_memory(init["memory_mb"]),
        "no_inspection": isolation.forbid_inspection(),
    }
    guards.update(isolation.landlock(init["root"], init["network"]))
    isolation.last_capability()  # read once here, not in each code call
    forker = isolation.CallForker(guards["pid_namespace"])
    guards["call_namespaces"] = forker.enabled
    return {**guards, "pid": pid, "cgroup": cgroup, "why": why}, forker


def main() -> None:
    # keep the pipes to the parent on private descriptors: user code gets /dev/null as stdin
    # and stderr as stdout, so nothing it reads or prints touches the protocol
    private = (os.dup(0), os.dup(1))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this ends
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    init = receive(private[0])
    if init is None:
        return
    guards, forker = isolate(init, private)
    sys.path[:0] = [p for p in init["path"] if p not in sys.path]
    fn, error = load(init["target"])
    if error is not None:
        send(private[1], {"error": error})
        return
    send(private[1], {"pid": guards.pop("pid"), "guards": guards})
    calls = Calls(fn, init, Folders(init["root"]), forker, init["target"] == "builtin:code")
    while (request := receive(private[0])) is not None:
        send(private[1], {"results": calls.run_batch(request["items"])})


if __name__ == "__main__":
    main()
