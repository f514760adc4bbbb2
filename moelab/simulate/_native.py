"""Build (once, cached) and call the simulator's C engine (``_engine.c``) through ctypes.

The engine is one C file without dependencies beyond libc and libm, so it builds with
the system C compiler in well under a second — no torch headers, no ninja (the experts
kernels in :mod:`moelab.kernels` use ``torch.utils.cpp_extension`` because they need
torch's tensor API; this does not). The shared object is cached in
``$MOELAB_CACHE/simulate`` (default ``~/.cache/moelab/simulate``) under a name that
hashes the source, the compiler and the flags, written atomically (compile to a
temporary name, then rename), so concurrent first uses are safe and a changed source
rebuilds. Without a compiler :func:`available` is False and
:func:`moelab.simulate.engine.simulate` falls back to the reference engine (logged once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from moelab.errors import MoelabError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "_engine.c"
CFLAGS = ["-O2", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None


def cache_dir() -> Path:
    base = os.environ.get("MOELAB_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "moelab") / "simulate"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def _build() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise MoelabError("no C compiler (cc, gcc or clang) on PATH; install one (Debian: apt-get install gcc) "
                          "or set CC, or use the reference engine.")
    src = SOURCE.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    tag = hashlib.sha256(src + version.encode() + " ".join(CFLAGS).encode() + sys.platform.encode()).hexdigest()[:16]
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    so = d / f"engine-{tag}.so"
    if not so.exists():
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".engine-", suffix=".so")
        os.close(fd)
        try:
            proc = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                                  timeout=120)
            if proc.returncode != 0:
                msg = " ".join(proc.stderr.split())[:300]
                raise MoelabError(f"building the simulator's C engine with {cc} failed: {msg}")
            os.replace(tmp, so)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(so))
    f = lib.moelab_simulate
    p = ctypes.c_void_p
    f.argtypes = [ctypes.c_int64, ctypes.c_int32, ctypes.c_int32] + [p] * 15
    f.restype = ctypes.c_int
    return lib


def load() -> ctypes.CDLL:
    """The compiled engine, building it on first use; raises :class:`MoelabError` if it cannot."""
    global _lib, _error
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            if _error is not None:
                raise MoelabError(_error)
            try:
                _lib = _build()
            except (MoelabError, OSError, subprocess.SubprocessError) as e:
                _error = str(e)
                raise MoelabError(_error) from None
    return _lib


def available() -> bool:
    """Whether the fast engine builds and loads here (the first call warns once if not)."""
    try:
        load()
        return True
    except MoelabError as e:
        if not getattr(available, "_warned", False):
            log.warning("simulator: the fast C engine is not available (%s); using the reference engine", e)
            available._warned = True  # type: ignore[attr-defined]
        return False


def simulate_fast(g):
    """:func:`moelab.simulate.engine.simulate_reference`'s result, from the C engine."""
    from moelab.simulate.engine import Schedule

    g.validate()
    lib = load()
    n = g.n
    start = np.empty(n, dtype=np.float64)
    end = np.empty(n, dtype=np.float64)
    server = np.empty(n, dtype=np.int32)
    crit = np.empty(n, dtype=np.int64)
    events = ctypes.c_int64(0)

    def ptr(a: np.ndarray):
        return a.ctypes.data_as(ctypes.c_void_p)

    rc = lib.moelab_simulate(
        n, len(g.servers), len(g.pool_bw), ptr(g.resource), ptr(g.priority), ptr(g.fixed_us), ptr(g.nbytes),
        ptr(g.cap), ptr(g.pool), ptr(g.dep_ptr), ptr(g.dep_idx), ptr(g.servers), ptr(g.pool_bw), ptr(start),
        ptr(end), ptr(server), ptr(crit), ctypes.byref(events),
    )
    if rc == 1:
        raise MoelabError("graph: some tasks never ran (a dependency cycle); this is a bug in the graph's builder.")
    if rc != 0:
        raise MoelabError(f"the simulator's C engine failed (code {rc}: out of memory?).")
    return Schedule(start, end, server, crit, int(events.value))
