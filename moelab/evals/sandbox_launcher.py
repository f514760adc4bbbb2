"""Kernel confinement for the ``namespaces`` isolation level (see :mod:`moelab.evals.sandbox`).

Executed as ``python -I -S -B -c <this file's source> <settings as JSON>``; imports
nothing from moelab. Python 3.11 has no ``os.unshare``, so the system calls go through
``ctypes`` (libc's ``unshare``, ``mount``, ``umount2``, ``prctl`` and ``syscall``).

1. ``unshare`` new user, mount, PID, network, IPC, UTS and cgroup namespaces; the
   evaluator's uid/gid become one unprivileged id inside (no other id is mapped). When
   the evaluator is root, a helper process does the unshare and the launcher maps root to
   root (for the set-up only) and the candidate's id to ``nobody`` outside: the kernel
   exempts uid 0 from ``RLIMIT_NPROC``, so a root candidate could fork without limit.
2. Fork: the child is PID 1 of the new PID namespace (a trusted init, not the candidate).
   The parent stays behind and waits; both die with their parent (``PR_SET_PDEATHSIG``).
3. PID 1 builds a new root on a tmpfs: read-only, nosuid, nodev bind mounts of the
   system directories and the Python installation, a minimal ``/dev``, a fresh
   ``/proc`` of the new PID namespace, a size-limited tmpfs ``/tmp`` (the only
   writable place), then ``pivot_root`` and a detach of the old root, and remounts the
   new root read-only. Bind mounts made here are locked for any nested namespace the
   candidate could create, so they stay read-only.
4. PID 1 reports success on the status fd (which the candidate never gets), forks the
   runner (new session, ``PR_SET_NO_NEW_PRIVS``), which execs ``python``: with a
   non-zero uid inside the namespace, ``execve`` leaves it no capabilities.
5. PID 1 reaps orphans until the runner exits, then exits: the kernel kills every
   process left in the PID namespace.
"""

import ctypes
import json
import os
import platform
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SIGKILL = 9
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SETUP_FAILED = 125

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.unshare.argtypes = [ctypes.c_int]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(path):
    return None if path is None else os.fsencode(path)


def mount(src, dst, fstype, flags, data=None):
    _check(libc.mount(_b(src), _b(dst), _b(fstype), flags, _b(data)), f"mount {src} on {dst}")


def prctl(option, arg):
    _check(libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _unescape(field):
    out, i = "", 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out += chr(int(field[i + 1 : i + 4], 8))
            i += 4
        else:
            out += field[i]
            i += 1
    return out


def remount_readonly(top):
    """Make the mount at ``top`` and every mount below it read-only, nosuid, nodev."""
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    for row in rows:
        point, options = _unescape(row[4]), row[5].split(",")
        if point == top or point.startswith(top.rstrip("/") + "/"):
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
            if "noexec" in options:
                flags |= MS_NOEXEC
            mount(None, point, None, flags)


def bind_readonly(src, dst):
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, None, MS_BIND | MS_REC)
    remount_readonly(dst)


def build_root(cfg):
    root = cfg["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in cfg["system"]:
        if os.path.islink(path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
        elif os.path.exists(path):
            bind_readonly(path, root + path)
    work = root + cfg["work"]
    os.makedirs(work, exist_ok=True)
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['work_kib']}k,mode=1777")
    for src, dst in cfg["python"]:
        if not os.path.lexists(root + dst):
            bind_readonly(src, root + dst)
    dev = root + "/dev"
    os.makedirs(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(dev + "/" + name, "a").close()
        mount("/dev/" + name, dev + "/" + name, None, MS_BIND)
        mount(None, dev + "/" + name, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.symlink(target, dev + "/" + name)
    os.makedirs(dev + "/shm")
    mount("tmpfs", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,mode=1777")
    mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in ("sys", "sysrq-trigger", "irq", "bus"):
        path = root + "/proc/" + name
        if os.path.exists(path):
            mount(path, path, None, MS_BIND | MS_REC)
            remount_readonly(path)
    os.chdir(root)
    nr = SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise OSError(f"pivot_root: unknown system call number on {platform.machine()}")
    _check(libc.syscall(nr, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _check(libc.sethostname(b"sandbox", 7), "sethostname")


def main():
    cfg = json.loads(sys.argv[1])
    status = cfg["status_fd"]
    prctl(PR_SET_PDEATHSIG, SIGKILL)
    if os.getppid() != cfg["ppid"]:
        os._exit(SETUP_FAILED)  # the evaluator is already gone
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
    flags |= CLONE_NEWUTS | CLONE_NEWCGROUP
    if uid == 0:
        # The kernel never applies RLIMIT_NPROC to (outer) uid 0, so the candidate must not be
        # root outside: this root launcher maps inner 0 -> 0 (for the set-up) and the inner
        # id -> ``outer_id`` (nobody), which the runner switches to before it execs.
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        child = os.fork()
        if child:
            os.close(ready_w)
            os.close(go_r)
            os.close(status)
            if os.read(ready_r, 1) == b"x":
                maps = f"0 0 1\n{cfg['inner_id']} {cfg['outer_id']} 1\n"
                _write(f"/proc/{child}/uid_map", maps)
                _write(f"/proc/{child}/gid_map", maps)
                os.write(go_w, b"x")
            os.close(go_w)
            _, st = os.waitpid(child, 0)
            code = os.waitstatus_to_exitcode(st)
            os._exit(code if code >= 0 else 128 - code)
        prctl(PR_SET_PDEATHSIG, SIGKILL)
        os.close(ready_r)
        os.close(go_w)
        _check(libc.unshare(flags), "unshare")
        os.write(ready_w, b"x")
        if os.read(go_r, 1) != b"x":
            raise OSError("the id maps were not written")
    else:
        _check(libc.unshare(flags), "unshare")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{cfg['inner_id']} {uid} 1")
        _write("/proc/self/gid_map", f"{cfg['inner_id']} {gid} 1")
    init = os.fork()
    if init:  # outside the new PID namespace: wait for its init and pass on its status
        os.close(status)
        _, st = os.waitpid(init, 0)
        code = os.waitstatus_to_exitcode(st)
        os._exit(code if code >= 0 else 128 - code)
    prctl(PR_SET_PDEATHSIG, SIGKILL)
    build_root(cfg)
    prctl(PR_SET_DUMPABLE, 0)  # the candidate (same uid) cannot ptrace or read this init
    os.write(status, b"ok\n")
    os.close(status)
    runner = os.fork()
    if runner == 0:
        os.setsid()
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        prctl(PR_SET_PDEATHSIG, SIGKILL)
        if os.getuid() != cfg["inner_id"]:
            os.setgroups([])
            os.setgid(cfg["inner_id"])
            os.setuid(cfg["inner_id"])
        os.chdir(cfg["work"])
        os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
    while True:  # PID 1: reap orphans until the runner exits, then take everything down
        pid, st = os.wait()
        if pid == runner:
            code = os.waitstatus_to_exitcode(st)
            os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    try:
        main()
    except BaseException as exc:  # noqa: BLE001 - report any setup failure in one line
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-1]
        sys.stderr.write(
            f"moelab sandbox setup failed ({where.name}, line {where.lineno}): "
            f"{type(exc).__name__}: {exc}\n"
        )
        sys.stderr.flush()
        os._exit(SETUP_FAILED)
