"""The reward worker: the process that runs user reward functions and the code reward's
tests, so that the training process never runs user code (docs/rewards.md).

It is started as a script (`python .../worker.py`), not as a module, so it imports neither
torch nor the unmask package: the standard library and the user's module only. The parent
sends length-prefixed pickles on the worker's stdin (an init message, then batches of
calls) and reads length-prefixed JSON from the stdout the worker had at start (results are
plain numbers and strings: the training process never unpickles anything user code made).

Guards, none of them a security boundary against malicious code (a guard against runaway
code): the worker's private writable memory is capped (RLIMIT_DATA, where the OS enforces
it); where Linux Landlock is available, the worker and its calls may create, write, rename
or delete files only under the worker's temporary folder; HOME and TMPDIR point there and
each call's working directory is a fresh folder inside it. Each call runs in a fork of the
worker (the user module is imported once), in its own process group, with a CPU-time limit,
a wall-clock limit enforced here (SIGKILL to the group), stdin from /dev/null and stdout sent
to stderr. A call that is stopped, crashes, raises or returns no finite number is reported
as an error string; the worker itself carries on.
"""

import ctypes
import importlib
import importlib.util
import json
import math
import os
import pickle
import select
import shutil
import signal
import struct
import sys
import time

try:
    import resource
except ImportError:  # not POSIX: no rlimits
    resource = None

HEADER = struct.Struct(">I")
ERROR_CHARS = 300


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


# --- guards -------------------------------------------------------------------------------

# Landlock (Linux >= 5.13): a process may restrict itself, without privileges; the
# restriction holds for it and every process it forks. We handle only the access rights that
# change the file system, so reading and running files stays allowed everywhere.
_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446
_WRITE_RIGHTS_V1 = sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))
_REFER, _TRUNCATE = 1 << 13, 1 << 14
_FILE_RIGHTS = (1 << 1) | _TRUNCATE  # rights a rule on a single file may grant


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def restrict_writes(folder: str) -> bool:
    """Allow file-system changes only under `folder` (and writes to /dev/null), for this
    process and its children; False where Landlock is unavailable (nothing changed)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        abi = libc.syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
        if abi < 1:
            return False
        handled = _WRITE_RIGHTS_V1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
        attr = ctypes.c_uint64(handled)
        ruleset = libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(8), 0)
        if ruleset < 0:
            return False
        try:
            for path, rights in ((folder, handled), (os.devnull, handled & _FILE_RIGHTS)):
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                try:
                    rule = _PathBeneath(rights, fd)
                    if libc.syscall(_SYS_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) != 0:
                        return False
                finally:
                    os.close(fd)
            if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
                return False
            return libc.syscall(_SYS_RESTRICT, ruleset, 0) == 0
        finally:
            os.close(ruleset)
    except (OSError, AttributeError):
        return False


def limit_memory(memory_mb: int) -> bool:
    """Cap private writable memory (RLIMIT_DATA: heap and anonymous mappings, not shared
    libraries or reserved address space), or the address space where that is missing."""
    if resource is None:
        return False
    limit = memory_mb * 2**20
    for name in ("RLIMIT_DATA", "RLIMIT_AS"):
        which = getattr(resource, name, None)
        if which is None:
            continue
        try:
            resource.setrlimit(which, (limit, limit))
            return True
        except (ValueError, OSError):
            continue
    return False


def die_with_parent() -> None:
    """Linux: SIGKILL this process when the worker dies (a killed worker leaves no calls)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


# --- loading ------------------------------------------------------------------------------


def load(target: str):
    """(function, None) or (None, {"kind": ..., "message": ...}) for `module:function`, or
    the code reward's runner for "builtin:code"."""
    if target == "builtin:code":
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_tests.py")
        spec = importlib.util.spec_from_file_location("_unmask_code_tests", here)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.run_tests, None
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


def as_score(value) -> dict:
    """{"score": float} for a finite number (bool = 0/1, numpy scalars and anything float()
    accepts except strings), else {"error": why}."""
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
    return {"score": number}


def call_in_child(fn, item, options: dict, call_dir: str, timeout_s: float, keep: int) -> None:
    """The forked child: run one call, write its JSON result on fd `keep`, exit."""
    try:
        os.setpgid(0, 0)
        die_with_parent()
        os.chdir(call_dir)
        os.environ["HOME"] = os.environ["TMPDIR"] = call_dir
        if resource is not None:
            cpu = math.ceil(timeout_s) + 1
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        prompt, completion, record = item
        try:
            result = as_score(fn(prompt, completion, record, **options))
        except MemoryError:
            result = {"error": "ran out of memory", "kind": "memory"}
        except BaseException as err:  # noqa: B036 - user code: SystemExit too
            result = {"error": f"raised {describe(err)}"}
        write_all(keep, json.dumps(result).encode())
    finally:
        os._exit(0)


class Call:
    def __init__(self, index: int, pid: int, fd: int, call_dir: str, deadline: float):
        self.index, self.pid, self.fd, self.call_dir, self.deadline = (
            index, pid, fd, call_dir, deadline)  # fmt: skip
        self.chunks: list[bytes] = []


def start_call(fn, item, index: int, options: dict, root: str, timeout_s: float, private) -> Call:
    call_dir = os.path.join(root, f"call-{index}-{time.monotonic_ns()}")
    os.mkdir(call_dir)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        for fd in private:
            os.close(fd)
        call_in_child(fn, item, options, call_dir, timeout_s, write_end)
    os.close(write_end)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass  # the child did it first, or has already exited
    return Call(index, pid, read_end, call_dir, time.monotonic() + timeout_s)


def end_call(call: Call, timed_out: bool, timeout_s: float, memory_mb: int) -> list:
    """[score, None] or [None, error] for a call whose pipe closed or whose time is up."""
    for kill in (os.killpg, os.kill):  # the group: what the call started dies with it
        try:
            kill(call.pid, signal.SIGKILL)
            break
        except OSError:
            continue
    _, status = os.waitpid(call.pid, 0)
    os.close(call.fd)
    shutil.rmtree(call.call_dir, ignore_errors=True)
    if timed_out:
        return [None, f"timed out after {timeout_s:g} s (timeout_s)"]
    try:
        result = json.loads(b"".join(call.chunks))
    except ValueError:
        result = None
    if isinstance(result, dict) and "score" in result:
        return [result["score"], None]
    if isinstance(result, dict) and result.get("kind") == "memory":
        return [None, f"ran out of memory (memory_mb={memory_mb})"]
    if isinstance(result, dict) and "error" in result:
        return [None, str(result["error"])]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else sig
        why = " (CPU time limit)" if name == "SIGXCPU" else ""
        return [None, f"was killed by {name}{why}"]
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else "?"
    return [None, f"exited (code {code}) without returning a score"]


def run_batch(fn, items: list, init: dict, private) -> list:
    """Each item's [score, error], at most init["parallel"] calls at once."""
    results: list = [None] * len(items)
    pending = list(range(len(items)))[::-1]
    running: dict[int, Call] = {}
    timeout_s, memory_mb = init["timeout_s"], init["memory_mb"]
    while pending or running:
        while pending and len(running) < init["parallel"]:
            i = pending.pop()
            call = start_call(fn, items[i], i, init["options"], init["root"], timeout_s, private)
            running[call.fd] = call
        wait = max(0.0, min(c.deadline for c in running.values()) - time.monotonic())
        ready, _, _ = select.select(list(running), [], [], wait)
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if chunk:
                running[fd].chunks.append(chunk)
            else:
                call = running.pop(fd)
                results[call.index] = end_call(call, False, timeout_s, memory_mb)
        now = time.monotonic()
        for fd in [fd for fd, c in running.items() if c.deadline <= now]:
            call = running.pop(fd)
            results[call.index] = end_call(call, True, timeout_s, memory_mb)
    return results


def main() -> None:
    # keep the pipes to the parent on private descriptors: user code gets /dev/null as stdin
    # and stderr as stdout, so nothing it reads or prints touches the protocol
    private = (os.dup(0), os.dup(1))
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this ends
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    init = receive(private[0])
    if init is None:
        return
    sys.path[:0] = [p for p in init["path"] if p not in sys.path]
    guarded = restrict_writes(init["root"])
    limited = limit_memory(init["memory_mb"])
    fn, error = load(init["target"])
    if error is not None:
        send(private[1], {"error": error})
        return
    send(private[1], {"pid": os.getpid(), "write_guard": guarded, "memory_limit": limited})
    while (request := receive(private[0])) is not None:
        send(private[1], {"results": run_batch(fn, request["items"], init, private)})


if __name__ == "__main__":
    main()
