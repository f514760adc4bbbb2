"""Kernel confinement for the ``namespaces`` isolation level (see :mod:`moelab.evals.sandbox`).

Executed as ``python -I -S -B -c <this file's source> <settings as JSON>``; imports
nothing from moelab. Python 3.11 has no ``os.unshare``, so the system calls go through
``ctypes`` (libc's ``unshare``, ``mount``, ``umount2``, ``prctl`` and ``syscall``).

0. Join a fresh, empty session keyring (nothing of the evaluator's keys is reachable) and,
   where the evaluator made one, the run's cgroup v2 (memory and process limits for
   everything below; :mod:`moelab.evals.sandbox_cgroup`).
1. ``unshare`` new user, mount, PID, network, IPC, UTS and cgroup namespaces; the
   evaluator's uid/gid become one unprivileged id inside (no other id is mapped). When
   the evaluator is root, a helper process does the unshare with its effective uid set to
   ``nobody`` first, so ``nobody`` owns the namespace and the kernel charges per-user
   counts (inotify instances, queued signals, namespaces) of everything inside to
   ``nobody``, never to the host's root; the launcher maps root to root (for the set-up
   only) and the candidate's id to ``nobody`` outside: the kernel exempts uid 0 from
   ``RLIMIT_NPROC``, so a root candidate could fork without limit.
2. Fork: the child is PID 1 of the new PID namespace (a trusted init, not the candidate).
   The parent stays behind and waits; both die with their parent (``PR_SET_PDEATHSIG``).
3. PID 1 builds a new root on a tmpfs: read-only, nosuid, nodev bind mounts of the
   system directories and the Python installation, a minimal ``/dev``, a fresh
   ``/proc`` of the new PID namespace, a size- and inode-limited tmpfs ``/tmp`` (the only
   writable place), then ``pivot_root`` and a detach of the old root, and remounts the
   new root read-only. Bind mounts made here are locked for any nested namespace the
   candidate could create, so they stay read-only.
4. PID 1 sets ``PR_SET_NO_NEW_PRIVS``, loads the seccomp filter below (it and everything
   it starts keep it), reports success on the status fd (which the candidate never gets),
   and forks the runner (new session, the candidate's ids), which execs ``python``: with
   a non-zero uid inside the namespace, ``execve`` leaves it no capabilities.
5. PID 1 reaps orphans until the runner exits, then exits: the kernel kills every
   process left in the PID namespace.

**The seccomp filter** (classic BPF built here and loaded with ``prctl(PR_SET_SECCOMP)``;
inherited by every process of the candidate, it cannot be removed) refuses with ``EPERM``
what a test program never needs and what the limits above do not see: memory outside
``RLIMIT_AS`` (``memfd_create``, SysV shared memory, message queues and semaphores, POSIX
message queues), new namespaces and mounts (``unshare``, ``setns``, ``clone`` with a
namespace flag, the mount system calls; ``clone3``, whose flags a filter cannot read,
answers ``ENOSYS`` so the C library falls back on ``clone``), kernel keyrings,
``io_uring``, ``bpf``, ``userfaultfd``, ``ptrace`` and reading other processes' memory,
``perf_event_open``, inotify/fanotify instances, queued real-time signals and POSIX
timers (per-user counts), and the administrative calls (modules, kexec, reboot, swap,
clocks, quotas, accounting). Another system call ABI (i386 or x32 on x86_64) kills the
process. Raw BPF through ``ctypes``, not a binding such as libseccomp's: this file runs
as ``python -I -S`` with nothing but the standard library, and the filter is a few dozen
instructions that ``moelab.evals.sandbox`` tests call by call. x86_64 and aarch64 have
tables; elsewhere the namespaces level fails to start, with that reason.
"""

import contextlib
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
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1
SETUP_FAILED = 125
NOBODY = 65534

# --- seccomp --------------------------------------------------------------------------------
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
EPERM, ENOSYS = 1, 38
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
#: Namespace flags of clone(2) (CLONE_NEWTIME 0x80 included).
CLONE_NS_FLAGS = (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER
                  | CLONE_NEWPID | CLONE_NEWNET | 0x80)
SIGRTMIN = 32
#: The denied system calls, one table per architecture: name -> number.
DENIED = {
    "x86_64": {
        "memfd_create": 319, "memfd_secret": 447,
        "shmget": 29, "shmat": 30, "shmctl": 31, "shmdt": 67,
        "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220,
        "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71,
        "mq_open": 240, "mq_unlink": 241, "mq_timedsend": 242, "mq_timedreceive": 243,
        "mq_notify": 244, "mq_getsetattr": 245,
        "keyctl": 250, "add_key": 248, "request_key": 249,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "mount_setattr": 442,
        "bpf": 321, "userfaultfd": 323, "ptrace": 101, "perf_event_open": 298,
        "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438, "kcmp": 312,
        "process_madvise": 440,
        "inotify_init": 253, "inotify_init1": 294, "fanotify_init": 300,
        "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "timer_create": 222,
        "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163,
        "quotactl": 179, "quotactl_fd": 443, "syslog": 103, "settimeofday": 164, "clock_settime": 227,
        "clock_adjtime": 305, "adjtimex": 159, "sethostname": 170, "setdomainname": 171,
        "vhangup": 153, "iopl": 172, "ioperm": 173, "name_to_handle_at": 303, "open_by_handle_at": 304,
    },
    "aarch64": {
        "memfd_create": 279, "memfd_secret": 447,
        "shmget": 194, "shmctl": 195, "shmat": 196, "shmdt": 197,
        "semget": 190, "semctl": 191, "semtimedop": 192, "semop": 193,
        "msgget": 186, "msgctl": 187, "msgrcv": 188, "msgsnd": 189,
        "mq_open": 180, "mq_unlink": 181, "mq_timedsend": 182, "mq_timedreceive": 183,
        "mq_notify": 184, "mq_getsetattr": 185,
        "keyctl": 219, "add_key": 217, "request_key": 218,
        "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
        "fspick": 433, "mount_setattr": 442,
        "bpf": 280, "userfaultfd": 282, "ptrace": 117, "perf_event_open": 241,
        "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438, "kcmp": 272,
        "process_madvise": 440,
        "inotify_init1": 26, "fanotify_init": 262,
        "rt_sigqueueinfo": 138, "rt_tgsigqueueinfo": 240, "timer_create": 107,
        "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89,
        "quotactl": 60, "quotactl_fd": 443, "syslog": 116, "settimeofday": 170, "clock_settime": 112,
        "clock_adjtime": 266, "adjtimex": 171, "sethostname": 161, "setdomainname": 162,
        "vhangup": 58, "name_to_handle_at": 264, "open_by_handle_at": 265,
    },
}
#: Per architecture: its audit arch, clone, clone3, and the signal-sending calls with the
#: index of their signal argument (a real-time signal is queued and counted per user).
ARCH = {
    "x86_64": {"audit": 0xC000003E, "clone": 56, "clone3": 435, "x32": 0x40000000,
               "signals": {62: 1, 200: 1, 234: 2, 424: 1}},  # kill, tkill, tgkill, pidfd_send_signal
    "aarch64": {"audit": 0xC00000B7, "clone": 220, "clone3": 435, "x32": None,
                "signals": {129: 1, 130: 1, 131: 2, 424: 1}},
}


def seccomp_program(machine):
    """The filter as (code, jt, jf, k) tuples for ``machine`` (``platform.machine()``)."""
    if machine not in ARCH:
        raise OSError(f"no seccomp table for {machine}: the sandbox supports x86_64 and aarch64")
    arch, denied = ARCH[machine], sorted(set(DENIED[machine].values()))
    prog, fixups = [], []  # fixups: (index, field, label)

    def emit(code, k=0, jt=0, jf=0):
        prog.append([code, jt, jf, k])
        return len(prog) - 1

    def jump(code, k, jt=None, jf=None):
        i = emit(code, k)
        for field, label in (("jt", jt), ("jf", jf)):
            if label is not None:
                fixups.append((i, field, label))

    def arg_low(index):  # low 32 bits of seccomp_data.args[index] (little-endian)
        return 16 + 8 * index

    emit(BPF_LD_W_ABS, 4)                                   # arch
    jump(BPF_JEQ_K, arch["audit"], jf="kill")
    emit(BPF_LD_W_ABS, 0)                                   # nr
    if arch["x32"] is not None:
        jump(BPF_JGE_K, arch["x32"], jt="kill")
    for nr in denied:
        jump(BPF_JEQ_K, nr, jt="deny")
    jump(BPF_JEQ_K, arch["clone3"], jt="enosys")
    jump(BPF_JEQ_K, arch["clone"], jt="clone")
    for nr, index in sorted(arch["signals"].items()):
        jump(BPF_JEQ_K, nr, jt=f"signal{index}")
    labels = {}
    emit(BPF_RET_K, SECCOMP_RET_ALLOW)  # every other system call
    labels["clone"] = emit(BPF_LD_W_ABS, arg_low(0))
    jump(BPF_JSET_K, CLONE_NS_FLAGS, jt="deny", jf="allow")
    for index in sorted(set(arch["signals"].values())):
        labels[f"signal{index}"] = emit(BPF_LD_W_ABS, arg_low(index))
        jump(BPF_JGE_K, SIGRTMIN, jt="deny", jf="allow")
    labels["deny"] = emit(BPF_RET_K, SECCOMP_RET_ERRNO | EPERM)
    labels["enosys"] = emit(BPF_RET_K, SECCOMP_RET_ERRNO | ENOSYS)
    labels["kill"] = emit(BPF_RET_K, SECCOMP_RET_KILL_PROCESS)
    labels["allow"] = emit(BPF_RET_K, SECCOMP_RET_ALLOW)
    for i, field, label in fixups:
        offset = labels[label] - i - 1
        if not 0 <= offset <= 255:
            raise AssertionError(f"seccomp jump of {offset} does not fit")
        prog[i][1 if field == "jt" else 2] = offset
    return [tuple(x) for x in prog]


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def install_seccomp(machine):
    """Load the filter into this process (``PR_SET_NO_NEW_PRIVS`` must be set)."""
    prog = seccomp_program(machine)
    arr = (_SockFilter * len(prog))(*[_SockFilter(c, jt, jf, k) for c, jt, jf, k in prog])
    fprog = _SockFprog(len(prog), arr)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "seccomp filter: " + os.strerror(err)
                      + (" (the kernel lacks seccomp filters, CONFIG_SECCOMP_FILTER)" if err == 22 else ""))


def join_fresh_session_keyring():
    """A new, empty session keyring for this process and everything it starts."""
    nr = SYS_KEYCTL.get(platform.machine())
    if nr is None or libc.syscall(nr, KEYCTL_JOIN_SESSION_KEYRING, None) >= 0:
        return
    err = ctypes.get_errno()
    if err != ENOSYS:  # a kernel without keys has no keyring to inherit either
        raise OSError(err, f"join a new session keyring: {os.strerror(err)}")


def join_cgroup(procs):
    """Move this process (and so everything it starts) into the run's cgroup."""
    with open(procs, "w") as f:
        f.write(str(os.getpid()))

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
libc.syscall.restype = ctypes.c_long


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
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for path in cfg["system"]:
        if os.path.islink(path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            os.symlink(os.readlink(path), root + path)
        elif os.path.exists(path):
            bind_readonly(path, root + path)
    work = root + cfg["work"]
    os.makedirs(work, exist_ok=True)
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={cfg['work_kib']}k,nr_inodes={cfg['work_inodes']},mode=1777")
    for src, dst in cfg["python"]:
        if not os.path.lexists(root + dst):
            bind_readonly(src, root + dst)
    dev = root + "/dev"
    os.makedirs(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(dev + "/" + name, "a").close()
        mount("/dev/" + name, dev + "/" + name, None, MS_BIND)
        mount(None, dev + "/" + name, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.symlink(target, dev + "/" + name)
    os.makedirs(dev + "/shm")
    mount("tmpfs", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,nr_inodes=64,mode=1777")
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
    if cfg.get("cgroup_procs"):
        join_cgroup(cfg["cgroup_procs"])
    join_fresh_session_keyring()
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
        # The namespace's owner is the effective uid at unshare: nobody, so that per-user
        # counts of everything inside are charged to nobody at the host's level, not to root.
        # (Where nobody is not mapped, e.g. root inside a user namespace, the id maps below fail.)
        launcher = os.getppid()
        with contextlib.suppress(OSError):
            os.setresuid(0, cfg["outer_id"], 0)
        _check(libc.unshare(flags), "unshare")
        os.write(ready_w, b"x")
        if os.read(go_r, 1) != b"x":
            raise OSError("the id maps were not written")
        os.setresuid(0, 0, 0)  # inner root (outer root, mapped 0 -> 0), for the set-up only
        prctl(PR_SET_PDEATHSIG, SIGKILL)  # a change of uid cleared it
        if os.getppid() != launcher:
            os._exit(SETUP_FAILED)
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
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    install_seccomp(platform.machine())  # PID 1 and everything it starts from now on
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
