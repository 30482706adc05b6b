"""The operating-system guards of a reward worker (docs/rewards.md, What the sandbox is).

Loaded by path by unmask/rewards/worker.py (the training process imports it only to remove
a killed worker's cgroup): standard library only. Each guard is best-effort: one the kernel
or the user's rights do not allow is reported as off (the training process says so once),
never a reason to refuse a reward.

- namespaces (Linux): the worker is the first process of new PID, mount and network
  namespaces (as root, or inside a new user namespace where unprivileged ones are allowed),
  with its own /proc: its calls see no other process, cannot signal one, and have no
  network (not even 127.0.0.1). Each call is the first process of a further PID namespace,
  so what it starts (setsid included) dies when it ends;
- a process-count limit: a pids cgroup (root) or RLIMIT_NPROC (in a user namespace, where
  it counts this worker's processes only);
- Landlock (Linux >= 5.13): file-system changes only under the worker's folder; with ABI 4
  no TCP connect or bind, with ABI 6 no signal to a process outside the worker;
- private writable memory (RLIMIT_DATA), and no core dumps nor /proc/<pid>/fd, mem or
  environ access to the worker for processes without CAP_SYS_PTRACE (PR_SET_DUMPABLE 0);
- drop_privileges: no capabilities, for the process that runs a completion's code.
"""

import ctypes
import os
import signal
import sys
import time

try:
    import resource
except ImportError:  # not POSIX: no rlimits
    resource = None

LINUX = sys.platform.startswith("linux")
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 28, 38, 47, 4
_SECUREBITS = 0b11  # noroot, locked: uid 0 gains no capability by execve
_LIBC = []


def _libc():
    if not _LIBC:
        libc = ctypes.CDLL(None, use_errno=True)
        if hasattr(libc, "mount"):
            libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_void_p]
        _LIBC.append(libc)
    return _LIBC[0]


def _call(name: str, *args) -> str | None:
    """None when libc's `name` returned 0, else why not ("unshare: Operation not permitted")."""
    try:
        result = getattr(_libc(), name)(*args)
    except (OSError, AttributeError) as err:
        return f"{name}: {err}"
    return None if result == 0 else f"{name}: {os.strerror(ctypes.get_errno())}"


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies."""
    if LINUX:
        _call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# --- namespaces ---------------------------------------------------------------------------


def unshare_namespaces(network: bool) -> tuple[int, str | None]:
    """New PID and mount namespaces for this process's children, and a network namespace
    for this process unless `network`; inside a new user namespace (uid and gid mapped to
    themselves) when that is what the kernel allows. (flags made, None) or (0, why not)."""
    if not LINUX:
        return 0, f"not Linux ({sys.platform})"
    flags = CLONE_NEWNS | CLONE_NEWPID | (0 if network else CLONE_NEWNET)
    why = _call("unshare", flags)
    if why is None:
        return flags, None
    probe = os.fork()  # a user namespace whose ids cannot be mapped cannot be left: try first
    if probe == 0:
        os._exit(0 if _enter_user_namespace(flags) else 1)
    if os.waitpid(probe, 0)[1] != 0 or not _enter_user_namespace(flags):
        return 0, why
    return flags | CLONE_NEWUSER, None


def _enter_user_namespace(flags: int) -> bool:
    """unshare(flags) inside a new user namespace, this process's uid and gid mapped to
    themselves; False when the kernel refuses either."""
    uid, gid = os.getuid(), os.getgid()
    if _call("unshare", flags | CLONE_NEWUSER) is not None:
        return False
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError:
        return False
    return True


def become_namespace_init(private: tuple, cgroup: str | None) -> None:
    """Fork after unshare_namespaces: the child returns, the first process of the new PID
    namespace; this process closes its copies of the `private` descriptors, leaves the
    child's `cgroup`, waits for the child, removes the cgroup and ends as the child did (a
    signal as that signal)."""
    child = os.fork()
    if child == 0:
        die_with_parent()
        return
    for fd in private:
        os.close(fd)
    if cgroup is not None:
        leave_cgroup(cgroup)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
    _, status = os.waitpid(child, 0)
    remove_cgroup(cgroup)
    if os.WIFSIGNALED(status):
        try:
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL and SIGSTOP keep their default
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def outer_pid() -> int:
    """This process's id in the outermost PID namespace /proc shows (call before
    mount_own_proc: the training process's id for it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return os.getpid()


def mount_own_proc() -> str | None:
    """Make every mount private to this mount namespace, then mount a /proc that shows only
    this PID namespace; None or why not."""
    why = _call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
    if why is None:  # never mount /proc where the mount could reach the host
        why = _call("mount", b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    return why


class CallForker:
    """fork() whose child is the first process of a fresh PID namespace, so that everything
    it starts dies when it ends (setsid or not); a plain fork where that is not allowed."""

    def __init__(self, enabled: bool):
        self.fd = None
        if enabled:
            try:
                self.fd = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self.fd = None
        self.enabled = self.fd is not None and self._works()
        if not self.enabled and self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def fork(self) -> int:
        fresh = (self.fd is not None and _call("setns", self.fd, CLONE_NEWPID) is None
                 and _call("unshare", CLONE_NEWPID) is None)  # fmt: skip
        pid = -1
        try:
            pid = os.fork()
        finally:
            if pid != 0 and fresh:  # this process's next children in its own namespace
                _call("setns", self.fd, CLONE_NEWPID)
        return pid

    def _works(self) -> bool:
        try:
            pid = self.fork()
        except OSError:
            return False
        if pid == 0:
            os._exit(0 if os.getpid() == 1 else 1)
        return os.waitpid(pid, 0)[1] == 0


# --- process count ------------------------------------------------------------------------


def _cgroup_mount() -> tuple[str, str] | None:
    """(the pids controller's mount point, this process's cgroup under it): cgroup v1's
    pids hierarchy, else the v2 one (where pids may be enabled for children)."""
    try:
        mounts = open("/proc/self/mountinfo").read().splitlines()
        groups = [line.split(":", 2) for line in open("/proc/self/cgroup").read().splitlines()]
    except OSError:
        return None
    points = {}
    for line in mounts:
        fields = line.split(" - ")
        if len(fields) == 2 and len(fields[1].split()) >= 3:
            fstype, _, options = fields[1].split()[:3]
            if fstype == "cgroup" and "pids" in options.split(","):
                points.setdefault("v1", fields[0].split()[4])
            elif fstype == "cgroup2":
                points.setdefault("v2", fields[0].split()[4])
    for version, wanted in (("v1", lambda c: "pids" in c.split(",")), ("v2", lambda c: not c)):
        path = next((g[2] for g in groups if len(g) == 3 and wanted(g[1])), None)
        if version in points and path is not None:
            return points[version], path
    return None


def cgroup_folder(pid: int) -> str | None:
    """Where join_pids_cgroup puts the worker whose first process is `pid` and that this
    process started: beside this process's own pids cgroup. None without one."""
    found = _cgroup_mount() if LINUX else None
    if found is None:
        return None
    point, parent = found
    return os.path.join(point, parent.lstrip("/"), f"unmask-reward-{pid}")


def join_pids_cgroup(limit: int) -> tuple[str | None, str | None]:
    """A new pids cgroup for this process and its descendants, at most `limit` tasks
    (processes and threads): (its folder, None) or (None, why not)."""
    folder = cgroup_folder(os.getpid())
    if folder is None:
        return None, "no pids cgroup is mounted"
    try:
        os.mkdir(folder)
    except OSError as err:
        return None, f"cannot make a pids cgroup ({err.strerror})"
    try:
        _write(os.path.join(folder, "pids.max"), str(limit))
        _write(os.path.join(folder, "cgroup.procs"), str(os.getpid()))
    except OSError as err:
        remove_cgroup(folder)
        return None, f"cannot use a pids cgroup ({err.strerror})"
    return folder, None


def leave_cgroup(folder: str) -> None:
    """Move this process back to the cgroup it came from (its children stay in `folder`)."""
    try:
        _write(os.path.join(os.path.dirname(folder), "cgroup.procs"), str(os.getpid()))
    except OSError:
        pass


def remove_cgroup(folder: str | None) -> None:
    """SIGKILL what is left in the cgroup folder (processes a call left in sessions of their
    own, where there was no PID namespace to end them), then remove it."""
    for _ in range(50):
        if folder is None or not os.path.isdir(folder):
            return
        try:
            with open(os.path.join(folder, "cgroup.procs")) as f:
                for pid in f.read().split():
                    os.kill(int(pid), signal.SIGKILL)
            os.rmdir(folder)
            return
        except OSError:
            time.sleep(0.01)  # its last tasks are still exiting


def limit_process_count(limit: int) -> bool:
    """RLIMIT_NPROC: it counts the processes of this user namespace's user, so only inside a
    new user namespace is it this worker's count (uid 0 of the first namespace ignores it)."""
    if resource is None:
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
        return True
    except (ValueError, OSError):
        return False


# --- memory, dumps, capabilities ----------------------------------------------------------


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


def forbid_inspection() -> bool:
    """PR_SET_DUMPABLE 0: /proc/<pid>/fd, mem and environ of this process (and of the
    processes it forks) open only to processes with CAP_SYS_PTRACE, and no core dumps."""
    return LINUX and _call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0) is None


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]


_LAST_CAP = []


def last_capability() -> int:
    """The kernel's highest capability number (read once: the worker reads it before its
    calls fork, so they need not)."""
    if not _LAST_CAP:
        try:
            _LAST_CAP.append(int(open("/proc/sys/kernel/cap_last_cap").read()))
        except (OSError, ValueError):
            _LAST_CAP.append(63)
    return _LAST_CAP[0]


def _status_caps() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {line[:6]: int(line.split()[1], 16) for line in f if line.startswith("Cap")}


def drop_privileges() -> str | None:
    """No capability, now or after an execve (no_new_privs; the bounding set and uid 0's
    securebits too where CAP_SETPCAP allows): a process that runs a completion's code cannot
    open the worker's /proc/<pid>/fd, undo the namespaces, or reach other users' processes.
    None, or why it could not."""
    if not LINUX:
        return None  # no capabilities, no /proc/<pid>/fd: the closed descriptors are all
    for cap in range(last_capability() + 1):  # needs CAP_SETPCAP: fails harmlessly for other users
        _call("prctl", PR_CAPBSET_DROP, cap, 0, 0, 0)
    _call("prctl", PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if os.geteuid() == 0:
        _call("prctl", PR_SET_SECUREBITS, _SECUREBITS, 0, 0, 0)
    why = _call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3
    why = why or _call("capset", ctypes.byref(header), data)
    if why is not None:
        return why
    try:
        caps = _status_caps()
    except (OSError, ValueError):
        return "cannot read /proc/self/status"
    if caps.get("CapEff") or caps.get("CapPrm") or caps.get("CapAmb"):
        return "capabilities remain"
    return None  # no_new_privs: an execve, even as uid 0, gains none back


# --- Landlock -----------------------------------------------------------------------------

# Landlock (Linux >= 5.13): a process may restrict itself, without privileges; the
# restriction holds for it and every process it forks. We handle only the file-system
# rights that change something, so reading and running files stays allowed everywhere.
_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446
_WRITE_RIGHTS_V1 = sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))
_REFER, _TRUNCATE = 1 << 13, 1 << 14
_FILE_RIGHTS = (1 << 1) | _TRUNCATE  # rights a rule on a single file may grant
_NET_TCP = 0b11  # bind and connect: no rule grants them, so no TCP at all
_SCOPES = 0b11  # abstract unix sockets and signals outside the restricted processes


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock(folder: str, network: bool) -> dict[str, bool]:
    """Restrict this process and its children: file-system changes only under `folder` (and
    writes to /dev/null); with ABI 4 no TCP (unless `network`); with ABI 6 no signal to, nor
    abstract unix socket of, a process outside. Which of these hold."""
    held = {"write_guard": False, "tcp_blocked": False, "signals_scoped": False}
    if not LINUX:
        return held
    try:
        libc = _libc()
        abi = libc.syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
        if abi < 1:
            return held
        handled = _WRITE_RIGHTS_V1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
        net = _NET_TCP if abi >= 4 and not network else 0
        scoped = _SCOPES if abi >= 6 else 0
        fields = [handled] + ([net] if abi >= 4 else []) + ([scoped] if abi >= 6 else [])
        attr = (ctypes.c_uint64 * len(fields))(*fields)
        size = ctypes.c_size_t(ctypes.sizeof(attr))
        ruleset = libc.syscall(_SYS_CREATE, ctypes.byref(attr), size, 0)
        if ruleset < 0:
            return held
        try:
            for path, rights in ((folder, handled), (os.devnull, handled & _FILE_RIGHTS)):
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                try:
                    rule = _PathBeneath(rights, fd)
                    if libc.syscall(_SYS_ADD_RULE, ruleset, 1, ctypes.byref(rule), 0) != 0:
                        return held
                finally:
                    os.close(fd)
            if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                return held
            if libc.syscall(_SYS_RESTRICT, ruleset, 0) != 0:
                return held
        finally:
            os.close(ruleset)
    except (OSError, AttributeError):
        return held
    return {"write_guard": True, "tcp_blocked": bool(net), "signals_scoped": bool(scoped)}
