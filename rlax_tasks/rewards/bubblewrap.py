"""One job run under bubblewrap (bwrap): the launcher, the per-run uids, limits and outcome.

No network, a read-only view of the system directories only, a private size-capped tmp,
CPU/wall/memory/process/output limits, and the whole process tree (a private PID namespace)
killed when the run ends. ``sandbox`` builds jobs from programs."""

from __future__ import annotations

import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rlax_tasks.rewards.sandbox_types import DEFAULT_CONFIG, ExecResult, SandboxConfig, SandboxError

logger = logging.getLogger(__name__)

# own uid so that RLIMIT_NPROC (counted per uid) of one run cannot starve another.
UID_BASE = 1_500_000
_UID_SLOTS = 64
_STARTUP_GRACE_S = 1.0
SANDBOX_DIR = "/sandbox"
_MEMORY_MARKERS = ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "out of memory")

# Runs inside the sandbox before the untrusted program: drops privileges, applies rlimits,
# reports on a private fd (closed on exec, so the program cannot forge it), then execs.
_LAUNCHER = r"""
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
fd = cfg["status_fd"]
try:
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    if prctl(38, 1, 0, 0, 0) != 0:
        raise OSError("prctl(PR_SET_NO_NEW_PRIVS) failed")
    for name, (soft, hard) in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    uid = cfg["uid"]
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE=0: the program cannot ptrace us or use our fds
    prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans (daemons) are re-parented to us
    check = cfg["syntax_check"]
    if check:
        with open(check, "rb") as f:
            src = f.read()
        try:
            compile(src, check, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            import traceback
            sys.stderr.write("".join(traceback.format_exception_only(exc)))
            sys.stderr.flush()
            os.write(fd, b"C")
            os._exit(1)
    err_r, err_w = os.pipe()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            os.closerange(3, err_w)
            os.closerange(err_w + 1, 1 << 20)
            os.set_inheritable(err_w, False)
            os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
        except BaseException as exc:
            os.write(err_w, repr(exc).encode())
        os._exit(127)
    os.close(err_w)
    failure = os.read(err_r, 4096)
    if failure:
        raise OSError("exec failed: " + failure.decode(errors="replace"))
    os.write(fd, b"X")
    for stream in (0, 1, 2):
        os.close(stream)
    code = 1
    while True:  # the run ends when the program AND every process it left behind are done
        try:
            child, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if child == pid:
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code
    os._exit(code)
except BaseException as exc:
    os.write(fd, ("E" + repr(exc)).encode())
    os._exit(126)
"""


def find_bwrap(config: SandboxConfig) -> str:
    path = shutil.which(config.bwrap)
    if path is None:
        raise SandboxError(
            "bubblewrap (bwrap) not found on PATH; install it (Debian: apt-get install -y "
            "bubblewrap) before running code verifiers"
        )
    return path


def sandbox_python(config: SandboxConfig) -> str:
    """Interpreter for sandboxed Python: config, $RLAX_SANDBOX_PYTHON, system python3, ours."""
    candidates = [
        config.python,
        os.environ.get("RLAX_SANDBOX_PYTHON"),
        shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin"),
        getattr(sys, "_base_executable", None),
        sys.executable,
    ]
    for cand in candidates:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return os.path.realpath(cand)
    raise SandboxError("no Python interpreter found for the sandbox")


def cxx_available(config: SandboxConfig = DEFAULT_CONFIG) -> bool:
    """True when a C++ compiler is installed, so language="cpp" can run."""
    return shutil.which(config.cxx) is not None


class _UidPool:
    """Per-process pool of distinct host uids for concurrent root-mode sandboxes."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._free: list[int] | None = None
        self._pid = -1

    def acquire(self) -> int:
        with self._cond:
            if self._pid != os.getpid():  # fresh pool after fork
                base = UID_BASE + (os.getpid() % 16384) * _UID_SLOTS
                self._free = list(range(base, base + _UID_SLOTS))
                self._pid = os.getpid()
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def release(self, uid: int) -> None:
        with self._cond:
            if self._pid == os.getpid() and self._free is not None:
                self._free.append(uid)
                self._cond.notify()


_UIDS = _UidPool()
_SLOTS_LOCK = threading.Lock()
_SLOTS = threading.BoundedSemaphore(_UID_SLOTS)


def set_max_concurrency(n: int) -> None:
    """Bound the number of sandboxes running at once in this process (default 64)."""
    global _SLOTS
    if not 1 <= n <= _UID_SLOTS:
        raise ValueError(f"max concurrency must be in 1..{_UID_SLOTS}, got {n}")
    with _SLOTS_LOCK:
        _SLOTS = threading.BoundedSemaphore(n)


def _system_binds(python: str, config: SandboxConfig) -> list[str]:
    """Read-only binds of system directories (never /home, /root, /work, /var, /run)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    for etc in (
        "/etc/ld.so.cache",
        "/etc/ld.so.conf",
        "/etc/ld.so.conf.d",
        "/etc/alternatives",
        "/etc/localtime",
        "/etc/os-release",
    ):
        args += ["--ro-bind-try", etc, etc]
    prefix = Path(python).parent.parent
    if not str(prefix).startswith("/usr"):
        args += ["--ro-bind", str(prefix), str(prefix)]
    for extra in config.extra_ro_binds:
        args += ["--ro-bind", extra, extra]
    return args


def _memory_failure(stderr: str) -> bool:
    tail = stderr[-4096:]
    return any(marker in tail for marker in _MEMORY_MARKERS)


@dataclass
class Job:
    argv: list[str]  # program argv inside the sandbox
    stdin_path: str | None
    ro_files: dict[str, str]  # sandbox path -> host path
    rw_dirs: dict[str, str]  # sandbox path -> host path
    timeout_s: float
    memory_mb: int
    syntax_check: str | None = None
    max_processes: int | None = None


def execute(job: Job, config: SandboxConfig) -> ExecResult:
    """Run one job in a fresh bubblewrap sandbox and classify the outcome."""
    bwrap = find_bwrap(config)
    if job.timeout_s <= 0 or not math.isfinite(job.timeout_s):
        raise ValueError(f"timeout_s must be a positive number, got {job.timeout_s!r}")
    if job.memory_mb <= 0:
        raise ValueError(f"memory_mb must be positive, got {job.memory_mb!r}")
    python = sandbox_python(config)
    slots = _SLOTS
    with slots:
        uid = _UIDS.acquire() if os.geteuid() == 0 else None
        try:
            return _execute_as(job, config, bwrap, python, uid)
        finally:
            if uid is not None:
                _UIDS.release(uid)


def _execute_as(
    job: Job, config: SandboxConfig, bwrap: str, python: str, uid: int | None
) -> ExecResult:
    output_cap = config.output_limit_bytes
    cpu_s = max(1, math.ceil(job.timeout_s))
    nproc = job.max_processes or config.max_processes
    fsize = max(output_cap, config.tmp_size_mb * 1024 * 1024)
    rlimits = {  # name -> (soft, hard); CPU: SIGXCPU at soft, SIGKILL one second later
        "RLIMIT_AS": (job.memory_mb * 1024 * 1024,) * 2,
        "RLIMIT_CPU": (cpu_s, cpu_s + 1),
        "RLIMIT_NPROC": (nproc, nproc),
        "RLIMIT_FSIZE": (fsize, fsize),
        "RLIMIT_CORE": (0, 0),
        "RLIMIT_NOFILE": (config.max_open_files,) * 2,
    }
    for path in job.rw_dirs.values():
        if uid is not None:
            os.chown(path, uid, uid)
    status_r, status_w = os.pipe()
    info_r, info_w = os.pipe()
    os.set_inheritable(status_w, True)
    os.set_inheritable(info_w, True)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
    }
    launcher_cfg = {
        "status_fd": status_w,
        "rlimits": rlimits,
        "uid": uid,
        "syntax_check": job.syntax_check,
        "argv": job.argv,
        "env": env,
    }
    argv = [
        bwrap,
        "--die-with-parent",
        "--new-session",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--info-fd",
        str(info_w),
    ]
    if uid is None:  # unprivileged: a user namespace is the only way to get the others
        argv += ["--unshare-user", "--disable-userns"]
    argv += _system_binds(python, config)
    argv += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(config.tmp_size_mb * 1024 * 1024),
        "--tmpfs",
        "/tmp",
        "--dir",
        SANDBOX_DIR,
    ]
    for target, source in job.ro_files.items():
        argv += ["--ro-bind", source, target]
    for target, source in job.rw_dirs.items():
        argv += ["--bind", source, target]
    argv += [
        "--chdir",
        "/tmp",
        "--clearenv",
        "--setenv",
        "PATH",
        env["PATH"],
        "--",
        python,
        "-I",
        "-S",
        "-c",
        _LAUNCHER,
        json.dumps(launcher_cfg),
    ]

    start = time.monotonic()
    stdin_file = open(job.stdin_path, "rb") if job.stdin_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(
            argv,
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w, info_w),
            env={"PATH": env["PATH"]},
            start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        for fd in (status_r, status_w, info_r, info_w):
            os.close(fd)
        raise SandboxError(f"cannot start bwrap: {exc}") from exc
    finally:
        if stdin_file is not subprocess.DEVNULL:
            stdin_file.close()
    os.close(status_w)
    os.close(info_w)
    buffers = {
        "stdout": bytearray(),
        "stderr": bytearray(),
        "status": bytearray(),
        "info": bytearray(),
    }
    killed: str | None = None
    deadline = start + job.timeout_s + _STARTUP_GRACE_S
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    sel.register(status_r, selectors.EVENT_READ, "status")
    sel.register(info_r, selectors.EVENT_READ, "info")
    try:
        while any(key.data in ("stdout", "stderr") for key in sel.get_map().values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed = "timeout"
                break
            for key, _ in sel.select(timeout=min(remaining, 0.5)):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                buffers[key.data] += data
                if key.data in ("stdout", "stderr") and len(buffers[key.data]) > output_cap:
                    killed = "output_limit"
            if killed:
                break
        if killed is None:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                killed = "timeout"
        if killed is not None:
            _kill_tree(proc, bytes(buffers["info"]) + _drain(info_r))
        else:
            proc.wait()
        buffers["status"] += _drain(status_r)
    finally:
        sel.close()
        for fd in (status_r, info_r):
            try:
                os.close(fd)
            except OSError:
                pass
        for stream in (proc.stdout, proc.stderr):
            stream.close()
        if proc.poll() is None:
            _kill_tree(proc, b"")
    wall_s = time.monotonic() - start
    return _classify(job, proc.returncode, killed, buffers, wall_s, config)


def _drain(fd: int) -> bytes:
    """Read what is buffered in a pipe without blocking."""
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            data = os.read(fd, 1 << 16)
        except (BlockingIOError, OSError):
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def _kill_tree(proc: subprocess.Popen, info: bytes) -> None:
    """SIGKILL the sandbox's PID 1 (the kernel then kills its whole namespace) and bwrap."""
    child_pid = None
    try:
        child_pid = int(json.loads(info.decode().split("}")[0] + "}")["child-pid"])
        with open(f"/proc/{child_pid}/stat") as f:  # only ever kill bwrap's own child
            if int(f.read().rsplit(")", 1)[1].split()[1]) != proc.pid:
                child_pid = None
    except (OSError, ValueError, KeyError, IndexError):
        child_pid = None
    if child_pid is not None:
        try:
            os.kill(child_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            logger.warning("bwrap did not exit after its sandbox was killed; killing it")
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _classify(
    job: Job,
    returncode: int,
    killed: str | None,
    buffers: dict,
    wall_s: float,
    config: SandboxConfig,
) -> ExecResult:
    stdout = bytes(buffers["stdout"][: config.output_limit_bytes]).decode("utf-8", "replace")
    stderr_b = bytes(buffers["stderr"])
    if len(stderr_b) > config.stderr_keep_bytes:
        stderr_b = (
            stderr_b[: config.stderr_keep_bytes // 2]
            + b"\n...[truncated]...\n"
            + stderr_b[-config.stderr_keep_bytes // 2 :]
        )
    stderr = stderr_b.decode("utf-8", "replace")
    status_msg = bytes(buffers["status"]).decode("utf-8", "replace")
    if killed is not None:
        return ExecResult(killed, stdout, stderr, None, wall_s)
    if status_msg.startswith("E") or not status_msg:
        raise SandboxError(
            f"sandbox failed before running the program (bwrap exit {returncode}): "
            f"{status_msg[1:] or stderr.strip()[-2000:]}"
        )
    if status_msg.startswith("C"):
        return ExecResult("compile_error", stdout, stderr, returncode, wall_s)
    if returncode == 0:
        status = "ok"
    elif returncode == 128 + signal.SIGXCPU or (
        returncode == 128 + signal.SIGKILL and wall_s >= 0.9 * job.timeout_s
    ):
        status = "timeout"  # CPU limit: SIGXCPU at the soft limit, SIGKILL at the hard one
    elif _memory_failure(stderr):
        status = "memory"
    else:
        status = "runtime_error"
    return ExecResult(status, stdout, stderr, returncode, wall_s)
