"""One cgroup v2 per sandboxed process tree, where this machine lets the evaluator make one.

A cgroup bounds what the per-process limits cannot: the memory of all the candidate's
processes together (anonymous memory, its tmpfs files and kernel memory included, since
cgroup v2 charges them to the writer) and their number. It is used when a cgroup v2
directory is delegable to the evaluator, found in this order:

1. ``MOELAB_SANDBOX_CGROUP``: a cgroup v2 directory prepared for moelab (its
   ``cgroup.subtree_control`` enables ``memory`` and ``pids``, writable by the evaluator;
   e.g. a systemd user slice: ``systemd-run --user --scope -p Delegate=yes``);
2. the evaluator's own cgroup, when it already enables ``memory`` and ``pids`` for its
   children and is writable (a delegated systemd unit);
3. the root of a cgroup v2 hierarchy the evaluator is in (root only), after enabling
   ``memory`` and ``pids`` there.

Elsewhere — cgroup v1 machines, containers without delegation, hybrid hierarchies whose
v2 part has no controllers — :func:`cgroup_parent` says why, runs go on without one, and
``RLIMIT_AS`` plus the seccomp filter (which closes the paths ``RLIMIT_AS`` misses: memfd,
SysV shared memory, mounts) carry the memory bound; :attr:`ExecResult.mechanisms
<moelab.evals.sandbox.ExecResult.mechanisms>` records which held.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import time
from pathlib import Path

ENV = "MOELAB_SANDBOX_CGROUP"
CONTROLLERS = ("memory", "pids")
#: What a run's processes may use beyond ``memory_mb + work_mb`` (the launcher, the trusted
#: init and the interpreter start-up of the sandbox's own processes), in MiB.
SLACK_MB = 96


def _words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


def _v2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (``/sys/fs/cgroup`` or a hybrid's ``unified``)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        if right.split()[:1] == ["cgroup2"]:
            return Path(left.split()[4])
    return None


def _own_v2_path() -> str | None:
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:]
    except OSError:
        pass
    return None


def _usable(d: Path) -> bool:
    return set(CONTROLLERS) <= _words(d / "cgroup.subtree_control") and os.access(d, os.W_OK)


@functools.cache
def cgroup_parent() -> tuple[str | None, str]:
    """``(directory, why)``: where runs make their cgroups (None: nowhere, ``why`` says why)."""
    env = os.environ.get(ENV)
    if env:
        d = Path(env)
        if _usable(d):
            return str(d), f"{ENV}={env}"
        return None, (f"{ENV}={env} is not a writable cgroup v2 directory whose cgroup.subtree_control "
                      f"enables {' and '.join(CONTROLLERS)}")
    mount = _v2_mount()
    if mount is None:
        return None, "no cgroup v2 hierarchy is mounted (cgroup v1 only)"
    own = _own_v2_path()
    if own is None:
        return None, "this process is in no cgroup v2"
    here = mount / own.lstrip("/")
    if _usable(here):
        return str(here), f"the evaluator's own cgroup {here} is delegated"
    available = _words(here / "cgroup.controllers")
    if own == "/" and os.geteuid() == 0 and set(CONTROLLERS) <= available:
        with contextlib.suppress(OSError):
            (here / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in CONTROLLERS))
        if _usable(here):
            return str(here), f"the root of the cgroup v2 hierarchy at {mount}"
    missing = [c for c in CONTROLLERS if c not in available]
    if missing:
        return None, (f"the cgroup v2 hierarchy at {mount} offers no {' or '.join(missing)} controller here "
                      f"(cgroup {own}); they are bound to cgroup v1 or not delegated")
    return None, (f"the evaluator's cgroup {here} does not delegate {' and '.join(CONTROLLERS)} to children "
                  f"(set {ENV} to a delegated cgroup, e.g. from systemd-run --user --scope -p Delegate=yes)")


class RunCgroup:
    """A child cgroup of :func:`cgroup_parent` for one process tree; :meth:`remove` kills and removes it."""

    def __init__(self, parent: str, memory_bytes: int, pids: int) -> None:
        self.path = Path(parent) / f"moelab-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        self.path.mkdir(mode=0o755)
        try:
            (self.path / "memory.max").write_text(str(memory_bytes))
            for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                if (self.path / name).exists():
                    (self.path / name).write_text(value)
            (self.path / "pids.max").write_text(str(pids))
        except OSError:
            self.remove()
            raise

    @property
    def procs(self) -> str:
        """The file a process writes its pid to, to join."""
        return str(self.path / "cgroup.procs")

    def peak_bytes(self) -> int | None:
        """The largest memory use of the tree so far (``memory.peak``), where the kernel reports it."""
        try:
            return int((self.path / "memory.peak").read_text())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        kill = self.path / "cgroup.kill"
        with contextlib.suppress(OSError):
            if kill.exists():
                kill.write_text("1")
        for _ in range(50):  # processes take a moment to leave after SIGKILL
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)
