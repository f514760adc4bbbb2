"""Run untrusted, model-generated Python in a separate, limited process.

Executing generated code is a security boundary. Each program runs in a fresh
``python -I -B`` child process, never in the calling (notebook/kernel) process:

* an empty temporary working directory that is also its ``HOME`` and ``TMPDIR``,
  with a minimal environment (no proxies, tokens or ``PYTHON*`` variables);
* its own session / process group, killed as a whole on the wall-clock timeout;
* ``resource.setrlimit`` in the child: CPU seconds, address space (memory),
  size of files written, no core dumps and (for a non-root user) no new processes;
* when the evaluator runs as root (and ``nobody`` can read the Python installation):
  the child drops to the ``nobody`` user, so the kernel refuses writes to files it
  does not own;
* an audit hook (``sys.addaudithook``) installed before the program runs that
  refuses file writes, deletions, renames, ``chmod``/``chown``, links outside the
  sandbox directory, and refuses processes (``subprocess``, ``os.system``,
  ``fork``, ``exec``), signals (``os.kill``), sockets, ``ctypes`` and raising limits;
* success is a random nonce printed by the runner only after the program returned
  normally, so ``sys.exit(0)`` or ``os._exit(0)`` in a candidate is a failure.

This is defence in depth, not an operating-system jail: the program can still
read files the user can read, use CPU and memory up to the limits, and
deliberately hostile code could find ways around an in-process audit hook (for
example through introspection). Run evaluations of untrusted models inside a
container or VM without network access if that matters to you.

Shape of the API: :func:`run_program` for one program, :func:`run_programs` for
several (a small thread pool of child processes).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Literal

logger = logging.getLogger(__name__)

#: uid/gid the child switches to when the evaluator runs as root.
NOBODY = 65534

Status = Literal["passed", "failed", "timeout"]


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for one sandboxed program."""

    timeout_s: float = 10.0
    """Wall-clock seconds before the whole process group is killed."""
    memory_mb: int = 1024
    """Address-space limit of the child (``RLIMIT_AS``), in MiB."""
    file_size_mb: int = 16
    """Largest file the child may write (``RLIMIT_FSIZE``, includes its stdout/stderr), in MiB."""
    drop_privileges: bool = True
    """When the evaluator runs as root, run the child as ``nobody`` (uid/gid 65534)."""
    output_chars: int = 2000
    """How many trailing characters of the child's stdout/stderr to keep in the result."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb must be ≥ 64 (Python needs some), got {self.memory_mb!r}")
        if self.file_size_mb < 1:
            raise ValueError(f"file_size_mb must be ≥ 1, got {self.file_size_mb!r}")


@dataclass(frozen=True)
class ExecResult:
    """What happened to one program."""

    status: Status
    """``passed`` (ran to the end), ``failed`` (raised, exited early, was killed by a limit) or ``timeout``."""
    returncode: int | None
    """Exit status of the child (negative: killed by that signal); None if it never started."""
    stdout: str
    """Tail of the child's stdout (the success marker removed)."""
    stderr: str
    """Tail of the child's stderr (the traceback of a failure is here)."""
    duration_s: float
    """Wall-clock seconds the child ran."""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict:
        return asdict(self)


# The child's program, run as ``python -I -B -c _RUNNER``. It reads its job (JSON) from
# stdin, limits itself, installs the audit hook, runs the program and prints the nonce
# only when the program returned normally. Kept free of f-strings with braces from
# the parent so it can be read as it runs.
_RUNNER = r"""
import json, os, resource, sys, traceback
job = json.loads(sys.stdin.read())
sys.stdin.close()
def _limit(which, value):
    try:
        resource.setrlimit(which, (value, value))
    except (ValueError, OSError) as exc:
        sys.stderr.write("moelab sandbox: could not set limit %r: %s\n" % (which, exc))
_limit(resource.RLIMIT_CORE, 0)
_limit(resource.RLIMIT_CPU, job["cpu_s"])
_limit(resource.RLIMIT_AS, job["memory_bytes"])
_limit(resource.RLIMIT_FSIZE, job["file_size_bytes"])
if os.getuid() != 0:
    _limit(resource.RLIMIT_NPROC, 0)
if job["drop_to"] is not None and os.getuid() == 0:
    os.setgroups([])
    os.setgid(job["drop_to"])
    os.setuid(job["drop_to"])
ROOT = os.path.realpath(job["root"])
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.mkdir": (0,),
    "os.chmod": (0,), "os.chown": (0,), "os.link": (0, 1), "os.symlink": (0, 1),
    "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "shutil.copyfile": (1,),
    "shutil.copymode": (1,), "shutil.copystat": (1,), "shutil.move": (0, 1),
    "os.chflags": (0,), "os.lchflags": (0,), "os.mkfifo": (0,), "os.mknod": (0,),
    "os.removexattr": (0,), "os.setxattr": (0,),
}
_BLOCKED = (
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "resource.setrlimit", "resource.prlimit",
    "sys.addaudithook", "os.setuid", "os.setgid", "os.chroot", "os.startfile", "webbrowser.open",
)
def _inside(path):
    if isinstance(path, int):
        return True
    try:
        real = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return real == ROOT or real.startswith(ROOT + os.sep)
def _hook(event, args):
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, 0))[:3]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _WRITE)
        if writes and not _inside(path):
            raise PermissionError("moelab sandbox: writing outside the sandbox is not allowed: %r" % (path,))
    elif event in _PATH_EVENTS:
        for i in _PATH_EVENTS[event]:
            if i < len(args) and args[i] is not None and not _inside(args[i]):
                raise PermissionError("moelab sandbox: %s outside the sandbox is not allowed: %r" % (event, args[i]))
    elif event.startswith(_BLOCKED):
        raise PermissionError("moelab sandbox: %s is not allowed" % event)
sys.addaudithook(_hook)
nonce = job.pop("nonce").encode()
program = job.pop("program")
try:
    exec(compile(program, "<candidate>", "exec"), {"__name__": "__candidate__", "__builtins__": __builtins__})
except BaseException:
    traceback.print_exc()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(1)
sys.stdout.flush(); sys.stderr.flush()
os.write(1, b"\n" + nonce + b"\n")
os._exit(0)
"""


def _child_env(box: str) -> dict[str, str]:
    return {
        "HOME": box,
        "TMPDIR": box,
        "PATH": os.defpath,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _tail(path: str, chars: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 4 * chars))
        return f.read().decode("utf-8", "replace")[-chars:]


def run_program(program: str, config: SandboxConfig | None = None) -> ExecResult:
    """Run ``program`` (Python source) in a sandboxed child process; see the module docstring.

    The program passes if it runs to the end without raising; the usual form is the
    candidate function, then the unit tests, then ``check(entry_point)``.
    """
    config = config or SandboxConfig()
    nonce = secrets.token_hex(16)
    drop_to = NOBODY if (config.drop_privileges and _can_drop_privileges()) else None
    work = tempfile.mkdtemp(prefix="moelab-sandbox-")
    try:
        os.chmod(work, 0o711)  # traversable by the child, not listable
        box = os.path.join(work, "box")
        os.mkdir(box, 0o700)
        if drop_to is not None:
            os.chown(box, drop_to, drop_to)
        job = {
            "program": program,
            "nonce": nonce,
            "root": box,
            "cpu_s": int(math.ceil(config.timeout_s)) + 1,
            "memory_bytes": config.memory_mb * 1024 * 1024,
            "file_size_bytes": config.file_size_mb * 1024 * 1024,
            "drop_to": drop_to,
        }
        out_path, err_path = os.path.join(work, "stdout"), os.path.join(work, "stderr")
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", _RUNNER],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=box,
                env=_child_env(box),
                start_new_session=True,
                close_fds=True,
            )
            timed_out = False
            try:
                try:
                    proc.stdin.write(json.dumps(job).encode())
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
                proc.wait(timeout=config.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)
                proc.wait()
        duration = time.monotonic() - start
        stdout = _tail(out_path, config.output_chars + 64)
        stderr = _tail(err_path, config.output_chars)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    marker = "\n" + nonce + "\n"
    passed = not timed_out and proc.returncode == 0 and stdout.endswith(marker)
    if passed:
        stdout = stdout[: -len(marker)]
    status: Status = "timeout" if timed_out else ("passed" if passed else "failed")
    return ExecResult(
        status=status,
        returncode=proc.returncode,
        stdout=stdout[-config.output_chars :],
        stderr=stderr,
        duration_s=duration,
    )


@functools.cache
def _can_drop_privileges() -> bool:
    """True when running as root and ``nobody`` could still import the standard library.

    (A Python installed under ``/root`` is unreadable for ``nobody``; then the child keeps
    the evaluator's user and the audit hook alone guards writes.)
    """
    if os.geteuid() != 0:
        return False
    path = os.path.realpath(os.path.dirname(os.__file__))
    if not os.stat(path).st_mode & stat.S_IROTH:
        return False
    while True:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            logger.debug(
                "not dropping privileges in the sandbox: %s is not world-traversable", path
            )
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def _kill_group(pgid: int) -> None:
    """SIGKILL the child's whole process group (it leads its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_programs(
    programs: list[str], config: SandboxConfig | None = None, workers: int | None = None
) -> list[ExecResult]:
    """Run several programs, each in its own sandboxed process, a few at a time; results in order."""
    if not programs:
        return []
    workers = workers or max(1, min(4, os.cpu_count() or 1, len(programs)))
    if workers == 1:
        return [run_program(p, config) for p in programs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda p: run_program(p, config), programs))
