"""One way to measure speed: warm-up, repeats, median and spread, the machine's load, a verdict.

Every speed figure moelab prints (benchmarks, the demo report, notebooks, the simulator's
validation) comes from :func:`measure`: the callable runs ``warmup`` times untimed, then
``repeat`` times timed; the result is the median with its spread (the relative half-width of
the inter-quartile range, or of min–max with fewer than 5 repeats) and the load before and
after: the load average, and the part of it that is other work (less this process's own busy
cores, which a multi-threaded benchmark adds itself). :attr:`Measurement.busy` says when other
work makes the median meaningless (other load above ``max_load_per_cpu`` per CPU): reports
flag such a figure, benchmarks refuse it (:class:`BusyMachineError`) unless told to go on.
:attr:`Measurement.unstable` says when the repeats spread more than ``max_spread``: flagged,
not refused (a quiet machine can be noisy; the spread is printed with every figure). Standard library only.

>>> m = measure(lambda: model(x), warmup=2, repeat=7)
>>> print(m)            # 12.3 ms (median of 7, spread ±3.1 %, load 0.4 on 2 CPUs)
>>> m.check()           # raises BusyMachineError on a busy machine (benchmarks)
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from moelab.errors import MoelabError

#: Above this load per CPU from other work (the load average less this process's own busy
#: cores) the machine is busy: other work competes for the cores.
MAX_LOAD_PER_CPU = 0.75
#: Above this relative spread of the repeats the median is not a stable figure.
MAX_SPREAD = 0.25


class BusyMachineError(MoelabError):
    """A benchmark refused to report a figure measured on a busy machine."""


def _cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of its waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _process_start() -> tuple[float, float]:
    """(monotonic s, CPU s) at this process's start (Linux: ``/proc/self/stat``; elsewhere: now),
    so work done before this module was imported counts as the process's own."""
    now = time.monotonic()
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 (starttime), counted after ")"
    except (OSError, ValueError, IndexError):
        return now, _cpu_seconds()
    return (now - age, 0.0) if 0 <= age < 1e7 else (now, _cpu_seconds())


#: (monotonic s, CPU s) samples of this process, to estimate its own share of the load average
_HISTORY: list[tuple[float, float]] = [_process_start()]
#: the span over which the 1-minute load average mostly averages
_LOAD_WINDOW_S = 60.0
#: how often the sampler thread records this process's CPU time (the kernel samples the load every 5 s)
_SAMPLE_S = 5.0
_LOCK = threading.Lock()
_SAMPLER: list[threading.Thread] = []


def _sample_forever() -> None:
    while True:
        time.sleep(_SAMPLE_S)
        with _LOCK:
            _HISTORY.append((time.monotonic(), _cpu_seconds()))
            _trim(_HISTORY[-1][0])


def _ensure_sampler() -> None:
    """A daemon thread samples the CPU time every 5 s, so the own share follows the last minute
    rather than the average since the previous call (before this module's import, only the
    average since the process started is known)."""
    if not _SAMPLER or not _SAMPLER[0].is_alive():
        t = threading.Thread(target=_sample_forever, name="moelab-load-sampler", daemon=True)
        t.start()
        _SAMPLER[:] = [t]


def _after_fork_in_child() -> None:  # the child's CPU time starts at 0 and no thread survives a fork
    _HISTORY[:] = [_process_start()]
    _SAMPLER.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _trim(now: float) -> None:
    while len(_HISTORY) > 2 and now - _HISTORY[1][0] > 5 * _LOAD_WINDOW_S:  # weight below e^-5: forget
        del _HISTORY[0]
    del _HISTORY[1:-512]  # bounded


def _own_cpus() -> float:
    """This process's share of the 1-minute load average: its busy cores (CPU time over wall
    time between samples, taken every 5 s by a daemon thread) averaged the way the kernel
    averages the load, exponentially with a 60 s time constant, counting nothing before the
    process started. CPU time, not runnable threads: a process with more runnable threads than
    cores (a benchmark's lanes on 2 CPUs) adds more to the load average than this counts, and
    the excess reads as other work."""
    _ensure_sampler()
    now, cpu = time.monotonic(), _cpu_seconds()
    with _LOCK:
        _HISTORY.append((now, cpu))
        _trim(now)
        history = list(_HISTORY)
    own = 0.0
    for (t0, c0), (t1, c1) in zip(history, history[1:]):
        if t1 > t0:
            weight = math.exp(-(now - t1) / _LOAD_WINDOW_S) - math.exp(-(now - t0) / _LOAD_WINDOW_S)
            own += (c1 - c0) / (t1 - t0) * weight
    return max(0.0, own)


def machine_load() -> dict[str, Any]:
    """The machine's load, and how much of it is other work.

    ``load1``: the 1-minute load average (None where unknown); ``cpus``: usable CPUs;
    ``per_cpu``: load1 / cpus; ``own``: cores this process kept busy over about the last
    minute (CPU time / wall time, its threads and waited children included); ``other``:
    ``load1 − own`` (at least 0), the load of everything else — what makes a timing
    meaningless (a benchmark's own threads are in the load average too); ``other_per_cpu``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    own = _own_cpus()
    other = None if load is None else max(0.0, load - own)
    return {"load1": load, "cpus": cpus, "per_cpu": None if load is None else load / cpus, "own": own,
            "other": other, "other_per_cpu": None if other is None else other / cpus}


@dataclass
class Measurement:
    """Repeated timings of one callable (see the module docstring). Times in seconds."""

    samples: list[float]
    warmup: int
    load_before: dict[str, Any]
    load_after: dict[str, Any]
    max_load_per_cpu: float = MAX_LOAD_PER_CPU
    max_spread: float = MAX_SPREAD
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)

    @property
    def spread(self) -> float:
        """Relative half-width of the IQR (5 or more repeats) or of min–max, around the median."""
        s = sorted(self.samples)
        if len(s) < 2 or self.median <= 0:
            return 0.0
        if len(s) >= 5:
            q = statistics.quantiles(s, n=4, method="inclusive")
            lo, hi = q[0], q[2]
        else:
            lo, hi = s[0], s[-1]
        return (hi - lo) / 2 / self.median

    @property
    def load(self) -> float | None:
        """The larger of the other work's load per CPU before and after (None where unknown):
        the load average less this process's own busy cores (:func:`machine_load`)."""
        vals = [x.get("other_per_cpu", x.get("per_cpu")) for x in (self.load_before, self.load_after)]
        vals = [v for v in vals if v is not None]
        return max(vals) if vals else None

    @property
    def busy(self) -> bool:
        """Other work's load made the figure meaningless (benchmarks refuse it)."""
        return bool(self.reason)

    @property
    def reason(self) -> str:
        """Why the machine was busy ('' when it was not): other work's load per CPU above the limit."""
        return _busy_text(self.load, self.load_after["cpus"], self.max_load_per_cpu) if self.load is not None else ""

    @property
    def unstable(self) -> str:
        """Why the median is not a stable figure ('' when it is): the repeats spread more than
        ``max_spread``. Flagged beside the figure, not refused: a quiet machine can be noisy."""
        if self.spread > self.max_spread:
            return f"repeats spread ±{self.spread:.0%} (> ±{self.max_spread:.0%})"
        return ""

    def describe(self, scale: float = 1e3, unit: str = "ms") -> str:
        load, own = self.load_after.get("load1"), self.load_after.get("own")
        load_s = (f"load {load:.1f} on {self.load_after['cpus']} CPUs" if load is not None else "load unknown")
        if load is not None and own:
            load_s += f", {own:.1f} of it this process"
        flag = (f" — BUSY: {self.reason}" if self.busy else "") + (f" — UNSTABLE: {self.unstable}"
                                                                     if self.unstable else "")
        return (f"{self.median * scale:.4g} {unit} (median of {len(self.samples)}, spread ±{self.spread:.1%}, "
                f"{load_s}){flag}")

    def __str__(self) -> str:
        return self.describe()

    def check(self, allow_busy: bool = False) -> Measurement:
        """Raise :class:`BusyMachineError` when :attr:`busy` (benchmarks), unless ``allow_busy``."""
        if self.busy and not allow_busy:
            raise BusyMachineError(f"refusing a speed figure measured on a busy machine: {self.reason}. Run it on a "
                                   "quiet machine (stop other work), or pass --allow-busy to print it flagged.")
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(median_s=self.median, spread=self.spread, busy=self.busy, reason=self.reason, unstable=self.unstable)
        return d


def _busy_text(other_per_cpu: float, cpus: int, max_load_per_cpu: float) -> str:
    if other_per_cpu > max_load_per_cpu:
        return (f"other work's load {other_per_cpu * cpus:.1f} on {cpus} CPUs "
                f"(> {max_load_per_cpu:g} per CPU; load average less this process's own)")
    return ""


def busy_reason(load: dict[str, Any], max_load_per_cpu: float = MAX_LOAD_PER_CPU) -> str:
    """Why the machine is busy now ('' when it is not), from one :func:`machine_load` reading: the
    same rule as :attr:`Measurement.busy` (other work's load per CPU above the limit)."""
    per = load.get("other_per_cpu", load.get("per_cpu"))
    return "" if per is None else _busy_text(per, load["cpus"], max_load_per_cpu)


def spread_of(samples: list[float]) -> float:
    """The relative spread of repeated timings, as :attr:`Measurement.spread` defines it."""
    return Measurement(list(samples), 0, {}, {}).spread


def require_quiet(what: str, *, allow_busy: bool = False,
                  max_load_per_cpu: float = MAX_LOAD_PER_CPU) -> tuple[dict[str, Any], str]:
    """Before a long measurement (calibration, validation): the load now and why the machine is busy
    ('' when quiet). Raises :class:`BusyMachineError` when busy, unless ``allow_busy`` (then the
    caller flags every figure with the reason)."""
    load = machine_load()
    reason = busy_reason(load, max_load_per_cpu)
    if reason and not allow_busy:
        raise BusyMachineError(f"refusing to {what} on a busy machine: {reason}. Its figures would measure the "
                               "other work, not this machine: run it on a quiet machine (stop other work), or pass "
                               "--allow-busy to run it with every figure flagged.")
    return load, reason


def measure(fn: Callable[[], Any], *, warmup: int = 2, repeat: int = 7, setup: Callable[[], Any] | None = None,
            max_load_per_cpu: float = MAX_LOAD_PER_CPU, max_spread: float = MAX_SPREAD) -> Measurement:
    """Time ``fn`` (``setup`` runs untimed before each call): ``warmup`` untimed calls, then
    ``repeat`` timed ones; the load average is read before and after."""
    if repeat < 1 or warmup < 0:
        raise MoelabError(f"measure needs repeat ≥ 1 and warmup ≥ 0 (got repeat={repeat}, warmup={warmup}).")
    before = machine_load()
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    samples = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return Measurement(samples, warmup, before, machine_load(), max_load_per_cpu, max_spread)


def from_samples(samples: list[float], *, warmup: int = 0, load_before: dict | None = None,
                 max_load_per_cpu: float = MAX_LOAD_PER_CPU, max_spread: float = MAX_SPREAD) -> Measurement:
    """A :class:`Measurement` of timings taken elsewhere (e.g. interleaved A/B loops)."""
    if not samples:
        raise MoelabError("no timings to summarise (0 repeats).")
    now = machine_load()
    return Measurement(list(samples), warmup, load_before or now, now, max_load_per_cpu, max_spread)


__all__ = ["MAX_LOAD_PER_CPU", "MAX_SPREAD", "BusyMachineError", "Measurement", "busy_reason", "from_samples",
           "machine_load", "measure", "require_quiet", "spread_of"]
