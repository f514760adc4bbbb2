"""Run untrusted, model-generated Python confined by the operating system.

Executing generated code is a security boundary: the code may be written to escape.
Nothing here relies on the interpreter policing itself — an audit hook inside the
candidate's process can always be undone from that process.

**Isolation levels** (weakest to strongest; :func:`available_isolation` detects the best):

``rlimits``
    a separate ``python -I -B`` process in its own session with resource limits, an
    empty working directory, a minimal environment, the ``nobody`` user when the
    evaluator is root and ``nobody`` can read Python, and an audit hook. Stops
    accidents, **not** deliberate escapes; used only when asked for explicitly.
``namespaces``
    the kernel confines each process (:mod:`moelab.evals.sandbox_launcher`, via
    ``ctypes``; no extra software): new user, PID, mount, network, IPC, UTS and cgroup
    namespaces; a root that holds only the system directories and the Python
    installation, read-only, nosuid, nodev; a fresh ``/proc`` that shows only the
    sandbox's processes; no network interface but a down loopback; a size-limited
    tmpfs ``/tmp`` as the only writable place (also ``HOME`` and the working
    directory); a non-root id inside with no capabilities; ``PR_SET_NO_NEW_PRIVS``;
    a trusted PID 1 that dies with the evaluator (``PR_SET_PDEATHSIG``) and whose
    exit makes the kernel kill every process left in the sandbox; hard rlimits on CPU
    seconds, address space, file size, open files and process count (``RLIMIT_NPROC``
    counts per user namespace, so it holds also when the evaluator is root); an inode
    limit on the tmpfs; a fresh session keyring; a seccomp filter that refuses what
    rlimits do not count (memfd, SysV/POSIX IPC, nested namespaces and mounts, keyrings,
    io_uring, bpf, userfaultfd, ptrace, inotify, queued real-time signals, ...; see
    :mod:`moelab.evals.sandbox_launcher`); with a root evaluator a user namespace owned by
    ``nobody``, so per-user kernel counts are never charged to root; and a cgroup v2 with
    memory and process limits where one is delegable (:mod:`moelab.evals.sandbox_cgroup`).
    The default requirement (``SandboxConfig.min_isolation``). What held for a run is in
    :attr:`ExecResult.mechanisms`.

Below the level asked for, :func:`run_program` / :func:`run_tests` raise
:class:`SandboxUnavailable` instead of running anything.

Why not bubblewrap: a non-setuid ``bwrap`` (Debian's) can map only the caller's own uid,
so run by root it leaves the candidate uid 0 outside its namespace — and the kernel never
applies ``RLIMIT_NPROC`` to uid 0, so a fork bomb would be bounded only by the machine.
The launcher here maps the candidate to ``nobody`` in that case, needs no package (CI
machines lack bwrap) and does the same mounts bwrap would.

**A verdict the candidate cannot forge** (:func:`run_tests`). The candidate (prompt +
completion) and the tests run in two separate sandboxes — separate PID, user and
mount namespaces, so neither can see, signal or trace the other — joined only by two
pipes. The candidate's sandbox executes its source and then only answers calls: a
request names one of its top-level functions and carries arguments as plain data
(tagged JSON of None, bool, numbers, str, bytes, lists, tuples, dicts, sets and
references to its own functions); the reply is such data or the name of an exception.
The check process runs the trusted test code with each name it takes from the
candidate's module bound to a proxy that makes such a call (never a built-in name or a
dunder; modules the candidate imported are imported again by the check process, from
the standard library only). Values the candidate returns are rebuilt as built-in types,
so no code of the candidate ever runs in the check process: a custom ``__eq__``, a
patched built-in, a monkeypatched ``check``, an early ``os._exit(0)``, a printed
nonce or a killed parent cannot change what the tests decide. The verdict is the check
process's exit status 0 and a marker (a nonce only that process knows) written after the
test code ran to its end; at the ``namespaces`` level the candidate cannot reach that
process. Semantics differ from running both in one process where values cross: results
must be plain data; arguments are copies (in-place changes of list, dict, set and
bytearray arguments are written back, top level only); the tests cannot pass their own
functions; exceptions arrive as the built-in type of that name with the same arguments
(docs/reference/lm-eval.md, "Same verdicts as one process").

:func:`run_program` runs one whole program (no separate tests): its ``passed`` only
means that the program reached its end, which a hostile program can claim falsely — the
scoring paths (:func:`moelab.evals.metrics.pass_at_k`,
:func:`moelab.training.quick_eval.run_check`) use :func:`run_tests`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import re
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from moelab.errors import MoelabError
from moelab.evals.sandbox_cgroup import SLACK_MB as CGROUP_SLACK_MB
from moelab.evals.sandbox_cgroup import RunCgroup, cgroup_parent

logger = logging.getLogger(__name__)

#: uid/gid the ``rlimits`` child switches to when the evaluator runs as root.
NOBODY = 65534
#: Isolation levels, weakest first.
LEVELS = ("rlimits", "namespaces")
#: The level asked for unless configured otherwise (env ``MOELAB_SANDBOX_MIN_ISOLATION``).
DEFAULT_MIN_ISOLATION = "namespaces"
MIN_ISOLATION_ENV = "MOELAB_SANDBOX_MIN_ISOLATION"
#: The uid/gid of the candidate inside its user namespace.
INNER_ID = 1000
#: System paths visible (read-only) inside the ``namespaces`` sandbox; symlinks are copied.
SYSTEM_PATHS = (
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
    "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
)  # fmt: skip
SETUP_FAILED = 125

Status = Literal["passed", "failed", "timeout"]

_HERE = Path(__file__).resolve().parent


class SandboxUnavailable(MoelabError):
    """The isolation asked for cannot be had on this machine, or the sandbox failed to start."""


def _default_min_isolation() -> str:
    return os.environ.get(MIN_ISOLATION_ENV) or DEFAULT_MIN_ISOLATION


def check_level(level: str, what: str = "isolation level") -> str:
    if level not in LEVELS:
        raise MoelabError(
            f"{what} {level!r} is unknown; expected one of {', '.join(LEVELS)} (weakest first)."
        )
    return level


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for one sandboxed program."""

    timeout_s: float = 10.0
    """Wall-clock seconds before everything the run started is killed."""
    memory_mb: int = 1024
    """Address-space limit of each process (``RLIMIT_AS``), in MiB."""
    file_size_mb: int = 16
    """Largest file a process may write (``RLIMIT_FSIZE``, includes its stdout/stderr), in MiB."""
    max_processes: int = 8
    """Processes and threads the code may start (``RLIMIT_NPROC``; ``namespaces`` level).
    ``memory_mb`` holds per process (there is no cgroup): a run may use up to
    ``(max_processes + 1) * memory_mb``, so keep the product well below the machine's memory."""
    work_mb: int = 64
    """Size of the writable tmpfs ``/tmp`` (``namespaces`` level), in MiB."""
    work_inodes: int = 4096
    """Files and directories the writable tmpfs can hold (``namespaces`` level): each costs
    kernel memory outside every other limit."""
    min_isolation: str = field(default_factory=_default_min_isolation)
    """Refuse to run below this level (``LEVELS``); default ``namespaces``, or the env
    ``MOELAB_SANDBOX_MIN_ISOLATION``."""
    isolation: str | None = None
    """Use exactly this level (None: the best available)."""
    drop_privileges: bool = True
    """``rlimits`` level, evaluator running as root: run the child as ``nobody`` (uid 65534)."""
    read_only_paths: tuple[str, ...] = ()
    """More host paths to show, read-only, inside the ``namespaces`` sandbox."""
    output_chars: int = 2000
    """How many trailing characters of stdout/stderr to keep in the result."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb must be ≥ 64 (Python needs some), got {self.memory_mb!r}")
        if self.file_size_mb < 1:
            raise ValueError(f"file_size_mb must be ≥ 1, got {self.file_size_mb!r}")
        if self.max_processes < 1 or self.work_mb < 1 or self.work_inodes < 16:
            raise ValueError("max_processes and work_mb must be ≥ 1, work_inodes ≥ 16")
        check_level(self.min_isolation, "min_isolation")
        if self.isolation is not None:
            check_level(self.isolation, "isolation")


@dataclass(frozen=True)
class ExecResult:
    """What happened to one program."""

    status: Status
    """``passed``, ``failed`` (raised, exited early, was killed by a limit) or ``timeout``."""
    returncode: int | None
    """Exit status of the deciding process (negative: killed by that signal)."""
    stdout: str
    """Tail of the candidate's stdout (the success marker removed)."""
    stderr: str
    """Tail of stderr (for :func:`run_tests`: the tests' traceback, then the candidate's)."""
    duration_s: float
    """Wall-clock seconds the run took."""
    isolation: str = "namespaces"
    """The isolation level it ran at."""
    mechanisms: tuple[str, ...] = ()
    """What bounded the run, beyond the level (:func:`mechanisms`): e.g. ``seccomp``,
    ``cgroup-v2``, ``userns-owner-nobody``."""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict:
        return asdict(self)


# --- isolation levels ------------------------------------------------------------------


@functools.cache
def _source(name: str) -> str:
    return (_HERE / name).read_text(encoding="utf-8")


_WHY_WEAK = ["not probed yet"]


@functools.cache
def available_isolation() -> str:
    """The strongest isolation level that works here (probed once per process)."""
    try:
        r = _run_one(
            f"import os\nassert os.getuid() == {INNER_ID}\nopen(os.environ['HOME'] + '/x', 'w').write('x')\n",
            SandboxConfig(timeout_s=20.0, isolation="namespaces", min_isolation="rlimits"),
            role="program",
        )
        if r.passed:
            return "namespaces"
        if r.status == "timeout":
            _WHY_WEAK[0] = "the probe program timed out after 20 s (is the machine overloaded?)"
        else:
            _WHY_WEAK[0] = f"the probe program failed: {r.stderr.strip()[-300:]}"
    except (SandboxUnavailable, OSError) as exc:
        _WHY_WEAK[0] = str(exc)
    logger.warning("no namespaces sandbox: %s", _WHY_WEAK[0])
    return "rlimits"


def unavailable_reason() -> str | None:
    """Why the ``namespaces`` level is unavailable here (None where it is available)."""
    return None if available_isolation() == "namespaces" else _WHY_WEAK[0]


def isolation_level(config: SandboxConfig | None = None) -> str:
    """The level runs with ``config`` use; raise :class:`SandboxUnavailable` below its minimum."""
    config = config or SandboxConfig()
    level = config.isolation or available_isolation()
    if LEVELS.index(level) < LEVELS.index(config.min_isolation):
        why = "SandboxConfig.isolation chose it" if config.isolation else _WHY_WEAK[0]
        raise SandboxUnavailable(
            f"the code sandbox needs isolation level {config.min_isolation!r} but only {level!r} "
            f"is available here ({why}); run where unprivileged user namespaces work, or "
            f"accept the weaker level explicitly (CLI: --sandbox-isolation {level}; Python: "
            f"sandbox_isolation={level!r}; env {MIN_ISOLATION_ENV}={level})."
        )
    return level


# --- running ---------------------------------------------------------------------------


def _child_env(home: str) -> dict[str, str]:
    return {
        "HOME": home,
        "TMPDIR": home,
        "PATH": os.defpath,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _private(path: str):
    """A new file only the evaluator can read (0600), opened for binary writing."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


#: Control characters (C0 but tab and newline, DEL, C1): a terminal would act on them.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``), so output of the
    candidate cannot move a terminal's cursor, retitle its window or hide lines."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _tail(path: str, chars: int) -> str:
    """The last ``chars`` characters of a file the sandbox wrote, control characters escaped."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 4 * chars))
        return printable(f.read().decode("utf-8", "replace"))[-chars:]


def _work_dir_inside(bound: list[str]) -> str:
    """The sandbox's writable directory (its cwd, ``HOME`` and ``TMPDIR``): ``/tmp``, unless
    the Python installation is bound below it (a checkout or venv under ``/tmp``), whose
    directories would then show in the candidate's empty work directory; then ``/sandbox``."""
    for candidate in ("/tmp", "/sandbox", f"/sandbox-{secrets.token_hex(4)}"):
        if not any(p == candidate or p.startswith(candidate + "/") for p in bound):
            return candidate
    raise AssertionError("unreachable: a random work directory name collided")


def _python_paths() -> list[tuple[str, str]]:
    """(host path, path inside) of the Python installation, as the interpreter names them."""
    out: list[tuple[str, str]] = []
    for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        for inside in {os.path.abspath(p), os.path.realpath(p)}:
            out.append((os.path.realpath(p), inside))
    exe = os.path.realpath(sys.executable)
    out.append((os.path.dirname(exe), os.path.dirname(exe)))
    # shortest first, so a directory inside another one is not bound twice
    return sorted(set(out), key=lambda pair: len(pair[1]))


class _Child:
    """One sandboxed process (a launcher at the ``namespaces`` level)."""

    def __init__(self, work: str, name: str, job: dict, level: str, config: SandboxConfig,
                 pass_fds: tuple[int, ...] = ()) -> None:  # fmt: skip
        self.home: str | None = None
        self.cgroup: RunCgroup | None = None
        self.mechanisms = mechanisms(level, config)
        self.out_path = os.path.join(work, f"{name}.stdout")
        self.err_path = os.path.join(work, f"{name}.stderr")
        job_path = os.path.join(work, f"{name}.job")
        runner = [sys.executable, "-I", "-B", "-c", _source("sandbox_runner.py")]
        job = {
            **job,
            "cpu_s": int(math.ceil(config.timeout_s)) + 1,
            "memory_bytes": config.memory_mb * 1024 * 1024,
            "file_size_bytes": config.file_size_mb * 1024 * 1024,
        }
        status_r = None
        if level == "namespaces":
            python = _python_paths() + [
                (os.path.realpath(p), os.path.abspath(p)) for p in config.read_only_paths
            ]
            home = _work_dir_inside([inside for _, inside in python])
            # evaluator not root: the waiting launcher, init and the runner share the candidate's
            # id and count too; root: the candidate is nobody outside, only its runner counts
            extra = 1 if os.geteuid() == 0 else 3
            job.update(nproc=config.max_processes + extra, drop_to=None, audit_root=None)
            status_r, status_w = os.pipe()
            root = os.path.join(work, f"{name}.root")
            os.mkdir(root)
            parent, _ = cgroup_parent()
            if parent is not None:
                self.cgroup = RunCgroup(parent, (config.memory_mb + config.work_mb + CGROUP_SLACK_MB) << 20,
                                        config.max_processes + 4)
            settings = {
                "cgroup_procs": self.cgroup.procs if self.cgroup else None,
                "root": root,
                "system": [p for p in SYSTEM_PATHS if os.path.lexists(p)],
                "python": python,
                "work": home,
                "work_kib": config.work_mb * 1024,
                "work_inodes": config.work_inodes,
                "inner_id": INNER_ID,
                "outer_id": NOBODY,
                "status_fd": status_w,
                "ppid": os.getpid(),
                "argv": runner,
                "env": _child_env(home),
            }
            argv = [sys.executable, "-I", "-S", "-B", "-c", _source("sandbox_launcher.py")]
            argv.append(json.dumps(settings))
            pass_fds = (*pass_fds, status_w)
            env = {"PATH": os.defpath, "LANG": "C.UTF-8"}
            cwd = work
        else:
            # its own 0700 directory (the run's work directory is the evaluator's alone)
            home = tempfile.mkdtemp(prefix="moelab-sandbox-home-")
            self.home = home
            drop_to = NOBODY if (config.drop_privileges and _can_drop_privileges()) else None
            if drop_to is not None:
                os.chown(home, drop_to, drop_to)
            nproc = None if os.geteuid() == 0 and drop_to is None else config.max_processes
            job.update(nproc=nproc, drop_to=drop_to, audit_root=home, pdeathsig=True)
            argv, env, cwd = runner, _child_env(home), home
        with _private(job_path) as f:
            f.write(json.dumps(job).encode())
        with (
            open(job_path, "rb") as stdin,
            _private(self.out_path) as out,
            _private(self.err_path) as err,
        ):
            self.proc = subprocess.Popen(
                argv,
                stdin=stdin,
                stdout=out,
                stderr=err,
                cwd=cwd,
                env=env,
                start_new_session=True,
                close_fds=True,
                pass_fds=pass_fds,
            )
        os.unlink(job_path)  # the runner has it open; nothing else needs it
        self.status_r = status_r
        if status_r is not None:
            os.close(status_w)

    def wait_setup(self, deadline: float) -> None:
        """At the ``namespaces`` level: wait until the launcher said its sandbox stands."""
        if self.status_r is None:
            return
        data = b""
        try:
            while True:
                ready, _, _ = select.select(
                    [self.status_r], [], [], max(0.0, deadline - time.monotonic())
                )
                if not ready:
                    return  # the run's timeout handles it
                chunk = os.read(self.status_r, 64)
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(self.status_r)
            self.status_r = None
        if not data.startswith(b"ok"):
            self.kill()
            raise SandboxUnavailable(
                "the namespaces sandbox failed to start: "
                + (_tail(self.err_path, 500).strip() or f"exit status {self.proc.returncode}")
            )

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)
        if self.cgroup is not None:
            self.cgroup.remove()

    def returncode(self) -> int | None:
        code = self.proc.returncode
        if code is not None and code > 128 and code - 128 < 65:
            return -(code - 128)  # the launcher passes on "killed by signal N" as 128 + N
        return code


def mechanisms(level: str, config: SandboxConfig | None = None) -> tuple[str, ...]:
    """What bounds a run at ``level`` on this machine (recorded in :attr:`ExecResult.mechanisms`):

    ``namespaces``: the kernel confinement, ``seccomp`` (the launcher's filter), ``rlimits``,
    ``tmpfs-size-inodes``, ``fresh-session-keyring``, ``userns-owner-nobody`` (root evaluator:
    per-user counts go to nobody) or ``userns-owner-evaluator``, and ``cgroup-v2`` where a
    delegated cgroup exists (:func:`moelab.evals.sandbox_cgroup.cgroup_parent` says why not);
    ``rlimits`` level: ``rlimits``, ``audit-hook`` and ``uid-nobody`` when it drops to nobody.
    """
    config = config or SandboxConfig()
    if level == "namespaces":
        out = ["namespaces", "seccomp", "rlimits", "tmpfs-size-inodes", "fresh-session-keyring",
               "userns-owner-nobody" if os.geteuid() == 0 else "userns-owner-evaluator"]
        if cgroup_parent()[0] is not None:
            out.append("cgroup-v2")
        return tuple(out)
    out = ["rlimits", "audit-hook"]
    if config.drop_privileges and _can_drop_privileges():
        out.append("uid-nobody")
    return tuple(out)


def _run_one(program: str, config: SandboxConfig, role: str) -> ExecResult:
    level = isolation_level(config)
    nonce = secrets.token_hex(16)
    work = tempfile.mkdtemp(prefix="moelab-sandbox-")
    try:
        start = time.monotonic()
        deadline = start + config.timeout_s
        child = _Child(work, "candidate", {"role": role, "program": program, "nonce": nonce},
                       level, config)  # fmt: skip
        timed_out = False
        try:
            child.wait_setup(deadline)
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            child.kill()
        duration = time.monotonic() - start
        stdout = _tail(child.out_path, config.output_chars + 64)
        stderr = _tail(child.err_path, config.output_chars)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    code = child.returncode()
    marker = "\n" + nonce + "\n"
    passed = not timed_out and code == 0 and stdout.endswith(marker)
    if passed:
        stdout = stdout[: -len(marker)]
    status: Status = "timeout" if timed_out else ("passed" if passed else "failed")
    return ExecResult(status, code, stdout[-config.output_chars :], stderr, duration, level, child.mechanisms)


def run_program(program: str, config: SandboxConfig | None = None) -> ExecResult:
    """Run ``program`` (Python source) in the sandbox; see the module docstring.

    It passes if it runs to its end without raising. A hostile program can fake that
    (it sees the run's marker): score untrusted code with :func:`run_tests`.
    """
    return _run_one(program, config or SandboxConfig(), role="program")


def run_tests(candidate: str, tests: str, config: SandboxConfig | None = None) -> ExecResult:
    """Run ``tests`` (trusted Python) against ``candidate`` (untrusted Python, e.g. prompt +
    completion), each in its own sandbox; see the module docstring for why the verdict
    cannot be forged. ``tests`` usually ends in ``check(entry_point)``.
    """
    config = config or SandboxConfig()
    level = isolation_level(config)
    work = tempfile.mkdtemp(prefix="moelab-sandbox-")
    to_cand_r, to_cand_w = os.pipe()
    to_check_r, to_check_w = os.pipe()
    children: list[_Child] = []
    try:
        start = time.monotonic()
        deadline = start + config.timeout_s
        cand_job = {"role": "candidate", "program": candidate, "fd_in": to_cand_r,
                    "fd_out": to_check_w}  # fmt: skip
        nonce = secrets.token_hex(16)  # only the check process knows it
        check_job = {"role": "check", "program": tests, "fd_in": to_check_r,
                     "fd_out": to_cand_w, "nonce": nonce}  # fmt: skip
        cand = _Child(work, "candidate", cand_job, level, config, (to_cand_r, to_check_w))
        children.append(cand)
        check = _Child(work, "check", check_job, level, config, (to_check_r, to_cand_w))
        children.append(check)
        for fd in (to_cand_r, to_cand_w, to_check_r, to_check_w):
            os.close(fd)
        to_cand_r = to_cand_w = to_check_r = to_check_w = -1
        timed_out = False
        try:
            cand.wait_setup(deadline)
            check.wait_setup(deadline)
            check.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            for child in children:
                child.kill()
        duration = time.monotonic() - start
        stdout = _tail(cand.out_path, config.output_chars)
        check_out = _tail(check.out_path, 64)
        check_err = _tail(check.err_path, config.output_chars).strip()
        cand_err = _tail(cand.err_path, config.output_chars).strip()
    finally:
        for child in children:
            child.kill()
        for fd in (to_cand_r, to_cand_w, to_check_r, to_check_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(work, ignore_errors=True)
    code = check.returncode()
    stderr = check_err + (f"\n--- candidate's stderr ---\n{cand_err}" if cand_err else "")
    passed = code == 0 and check_out.endswith(f"\n{nonce}\n")  # the tests ran to their end
    status: Status = "timeout" if timed_out else ("passed" if passed else "failed")
    return ExecResult(status, code, stdout, stderr[-config.output_chars :], duration, level, check.mechanisms)


@functools.cache
def _can_drop_privileges() -> bool:
    """True when running as root and ``nobody`` could still import the standard library."""
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


def _pool_map(fn, items: list, workers: int | None):
    if not items:
        return []
    workers = workers or max(1, min(4, os.cpu_count() or 1, len(items)))
    if workers == 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def run_programs(
    programs: list[str], config: SandboxConfig | None = None, workers: int | None = None
) -> list[ExecResult]:
    """Several whole programs, each in its own sandbox, a few at a time; results in order."""
    return _pool_map(lambda p: run_program(p, config), programs, workers)


def run_tests_many(
    pairs: list[tuple[str, str]], config: SandboxConfig | None = None, workers: int | None = None
) -> list[ExecResult]:
    """:func:`run_tests` for several ``(candidate, tests)`` pairs, a few at a time; in order."""
    return _pool_map(lambda p: run_tests(p[0], p[1], config), pairs, workers)
