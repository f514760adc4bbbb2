"""Build (JIT, cached) and load the native CPU kernels; detect the instruction set.

The extension is compiled with torch's C++ extension machinery the first time it is
needed (~1 minute on 2 cores), never at install time. The cache lives in
``$TORCH_EXTENSIONS_DIR/moelab_kernels`` if that variable is set, else in
``~/.cache/moelab/kernels/<python>-torch<version>``. torch's build lock makes
concurrent first builds (e.g. pytest-xdist workers) safe: one builds, the others wait.

Instruction set: ``amx`` (the AVX-512 path, with experts that have many tokens on AMX tiles: bf16/fp8 weights
on AMX-BF16, int8/int4 on AMX-INT8), ``avx512`` (AVX-512 F/BW/VL/DQ + VNNI + BF16 + VBMI: Sapphire Rapids, Zen 4),
``avx512vnni`` (AVX-512 F/BW/VL/DQ + VNNI without BF16 or VBMI: Cascade Lake, Cooper Lake, Ice Lake; bf16 and fp8
weights multiply in fp32), ``avx2`` (AVX2 + FMA + F16C) or ``portable`` (plain C++), chosen from CPU detection (``amx`` also needs the operating system to grant
the process tile state, Linux 5.16 or later). Force one with the environment
variable ``MOELAB_KERNELS_ISA`` or with :func:`force_isa` (tests use this to exercise
the fallback).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Literal

from moelab._resources import resource_dir
from moelab.errors import MoelabError, unknown_name

logger = logging.getLogger(__name__)

Isa = Literal["amx", "avx512", "avx512vnni", "avx2", "portable"]
#: Fastest first: the first one the CPU supports is the default.
ISAS: tuple[Isa, ...] = ("amx", "avx512", "avx512vnni", "avx2", "portable")
#: The extension's codes (kernels/moe_kernels.h); a new path takes the next free one.
ISA_CODES: dict[str, int] = {"portable": 0, "avx2": 1, "avx512": 2, "amx": 3, "avx512vnni": 4}
ISA_ENV = "MOELAB_KERNELS_ISA"
_AVX512VNNI = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "avx2", "fma", "f16c")
_AVX512 = (*_AVX512VNNI, "avx512bf16", "avx512vbmi")
_REQUIRED: dict[str, tuple[str, ...]] = {
    "amx": (*_AVX512, "amx_tile", "amx_bf16", "amx_int8"),
    "avx512": _AVX512,
    "avx512vnni": _AVX512VNNI,
    "avx2": ("avx2", "fma", "f16c"),
    "portable": (),
}
_EXT_NAME = "moelab_moe_kernels"
_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]  # the C++ standard is torch's own (-std=c++20 in torch 2.1x)

_lock = threading.Lock()
_module: ModuleType | None = None
_forced: list[str] = []


def cache_dir() -> Path:
    """Where the compiled extension is cached."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env) / "moelab_kernels"
    import torch

    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return Path.home() / ".cache" / "moelab" / "kernels" / tag


#: A build lock older than this was left by a build that was killed (a build takes about a minute).
STALE_LOCK_S = 600


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove torch's build lock in ``build_dir`` when it is older than ``max_age_s``: a killed
    build leaves it behind, and every later process would otherwise wait on it forever."""
    import time

    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= max_age_s:
        return False
    logger.warning("removing a stale kernel build lock %s (%.0f s old: its build was interrupted)", lock, age)
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
    return True


def wait_for_build_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S, poll_s: float = 1.0) -> None:
    """Return once ``build_dir`` has no build lock: another process's build finished (its lock is
    gone) or its lock grew older than ``max_age_s`` (that build was killed: the lock is removed).
    torch's own wait polls for the lock forever, so a lock left by a build killed moments before
    this process started would hang it; this wait re-checks the age on every poll."""
    import time

    lock = Path(build_dir) / "lock"
    said = False
    while lock.exists():
        if clear_stale_lock(build_dir, max_age_s):
            return
        if not said:
            logger.warning("waiting for another process's kernel build to finish (lock %s; removed if it "
                           "grows older than %.0f s)", lock, max_age_s)
            said = True
        time.sleep(poll_s)


def _check_toolchain() -> None:
    from torch.utils.cpp_extension import is_ninja_available

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise MoelabError(
            f"moelab's native kernels need a C++ compiler, but {cxx!r} was not found on PATH. "
            "Install one (Debian/Ubuntu: `sudo apt-get install g++`; or set CXX to a compiler)."
        )
    if not is_ninja_available():
        raise MoelabError(
            "moelab's native kernels are built with ninja, which was not found. Install it with "
            "`pip install ninja` (or `sudo apt-get install ninja-build`)."
        )


def load_extension() -> ModuleType:
    """The compiled extension, building it on first use (logged at WARNING level)."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module

        src_dir = resource_dir("kernels")
        sources = sorted(str(p) for p in src_dir.glob("*.cpp"))
        if not sources:
            raise MoelabError(
                f"no C++ sources in {src_dir}; reinstall moelab from a full checkout (`pip install .`)."
            )
        _check_toolchain()
        build_dir = cache_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        wait_for_build_lock(build_dir)
        if not any(build_dir.glob(f"{_EXT_NAME}*.so")):
            logger.warning(
                "Compiling moelab's native CPU kernels (first use only, about a minute); cache: %s",
                build_dir,
            )
        from torch.utils import cpp_extension

        try:
            _module = cpp_extension.load(
                name=_EXT_NAME,
                sources=sources,
                extra_cflags=_CFLAGS,
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(src_dir)],
                build_directory=str(build_dir),
                verbose=False,
            )
        except (RuntimeError, OSError, ImportError) as exc:
            raise MoelabError(
                f"building moelab's native kernels in {build_dir} failed: {exc}. "
                "Check that g++ (C++17 with OpenMP) and ninja work, then delete that directory to "
                "force a clean rebuild."
            ) from exc
        logger.info("moelab native kernels loaded from %s", build_dir)
        return _module


def cpu_features() -> frozenset[str]:
    """x86 features the running CPU supports (as detected by the compiled extension; asked once
    per process: every kernel call reads them to pick its path)."""
    global _features
    if _features is None:
        _features = frozenset(load_extension().cpu_features())
    return _features


_features: frozenset[str] | None = None


def supported_isas() -> tuple[Isa, ...]:
    """Instruction-set paths this CPU can run, fastest first (worked out once per process, from
    :func:`cpu_features`: every call without a forced path reads it)."""
    global _supported
    if _supported is None or _supported[0] is not _features:
        feats = cpu_features()
        _supported = (feats, tuple(i for i in ISAS if all(f in feats for f in _REQUIRED[i])))
    return _supported[1]


_supported: tuple[frozenset[str], tuple[Isa, ...]] | None = None


def _validate(isa: str, source: str) -> Isa:
    if isa not in ISAS:
        raise unknown_name(f"instruction set (from {source})", isa, ISAS)
    if isa not in supported_isas():
        missing = sorted(set(_REQUIRED[isa]) - cpu_features())
        raise MoelabError(
            f"instruction set {isa!r} (from {source}) is not supported by this CPU (missing "
            f"{', '.join(missing)}); use one of {supported_isas()} or unset {ISA_ENV}."
        )
    return isa  # type: ignore[return-value]


_ENV_KEYS: dict[str, object] = {}


def env_value(name: str) -> str | None:
    """``os.environ.get(name)``, in one lookup of the mapping behind ``os.environ``: every kernel
    call reads two settings (:func:`active_isa`, :func:`moelab.kernels.op.default_threads`),
    usually unset, and ``os.environ.get`` of an unset name raises and catches a ``KeyError``
    inside (1.7 µs in a loop on the development VM, against 0.2). Reads what ``os.environ``
    holds, so a change made through it is seen by the next call."""
    data = getattr(os.environ, "_data", None)
    if data is None:  # another Python's os.environ
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    value = data.get(key)
    return None if value is None else os.environ.decodevalue(value)


def active_isa() -> Isa:
    """The path calls will use: forced by :func:`force_isa`, else ``$MOELAB_KERNELS_ISA``, else the best."""
    if _forced:
        return _validate(_forced[-1], "force_isa()")
    env = (env_value(ISA_ENV) or "").strip().lower()
    if env and env != "auto":
        return _validate(env, ISA_ENV)
    return supported_isas()[0]


@contextlib.contextmanager
def force_isa(isa: Isa) -> Iterator[Isa]:
    """Run the kernels on one instruction-set path inside the ``with`` block."""
    _forced.append(_validate(isa, "force_isa()"))
    try:
        yield isa
    finally:
        _forced.pop()
