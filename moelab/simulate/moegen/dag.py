"""A DAG of jobs on engines and its longest path (MoE-Gen Fig. 6, techniques.md §7.1).

Each job runs on one **engine** — ``gpu`` (compute stream), ``cpu`` (the host's attention
kernel), ``htod`` and ``dtoh`` (the two copy directions of the link) — for a cost in µs, after
its predecessors. Jobs on one engine also run in the order they were **issued** (added): the
engine's previous job is an implicit predecessor, the same-engine issue-order edge that
MoE-Gen leaves implicit, so serialisation on a busy engine shows up on the longest path.

Jobs are added in a topological order (every predecessor first), so the longest path is
computed as the DAG is built: ``dp[v] = max(dp[u] for u in pred(v) ∪ {engine's last job}) +
cost(v)`` is the job's finish time and ``T = max dp`` the makespan.

>>> g = Dag()
>>> a = g.add("copy", "htod", 5.0)
>>> b = g.add("pre", "gpu", 2.0)
>>> c = g.add("attn", "gpu", 3.0, [a])        # after its copy (5) and after "pre" on the GPU
>>> g.finish(c), g.T
(8.0, 8.0)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from moelab.errors import MoelabError

ENGINES: tuple[str, ...] = ("gpu", "cpu", "htod", "dtoh")


@dataclass(frozen=True)
class Job:
    """One node of the DAG: what it is, where it runs, its cost and its computed times (µs)."""

    name: str
    engine: str
    cost_us: float
    preds: tuple[int, ...]
    start_us: float
    finish_us: float
    fields: dict[str, Any] = field(default_factory=dict)


class Dag:
    """Jobs with explicit predecessors plus same-engine issue-order edges; see the module docstring.

    ``record=False`` keeps only the finish times (the search builds thousands of DAGs)."""

    def __init__(self, *, record: bool = True) -> None:
        self._finish: list[float] = []
        self._last: dict[str, int] = {}
        self._record = record
        self.jobs: list[Job] = []

    def add(self, name: str, engine: str, cost_us: float, preds: Iterable[int] = (), **fields: Any) -> int:
        """Add a job after ``preds`` (ids returned by earlier ``add`` calls) and after the previous
        job issued on ``engine``; its id."""
        if engine not in ENGINES:
            raise MoelabError(f"job {name!r}: engine {engine!r} is not one of {', '.join(ENGINES)}.")
        if not cost_us >= 0:
            raise MoelabError(f"job {name!r}: cost {cost_us!r} µs; expected a number ≥ 0.")
        fin = self._finish
        preds = tuple(preds)
        start = 0.0
        for p in preds:
            if not 0 <= p < len(fin):
                raise MoelabError(f"job {name!r}: predecessor {p} is not an earlier job (0..{len(fin) - 1}).")
            start = max(start, fin[p])
        prev = self._last.get(engine)
        if prev is not None:
            start = max(start, fin[prev])
        v = len(fin)
        fin.append(start + float(cost_us))
        self._last[engine] = v
        if self._record:
            self.jobs.append(Job(name, engine, float(cost_us), preds + (() if prev is None else (prev,)),
                                 start, start + float(cost_us), dict(fields)))
        return v

    def finish(self, v: int) -> float:
        """``dp[v]``: when job ``v`` finishes."""
        return self._finish[v]

    @property
    def T(self) -> float:
        """The makespan: the longest path's length (0 for an empty DAG)."""
        return max(self._finish, default=0.0)

    def busy_us(self) -> dict[str, float]:
        """Each engine's summed job costs (needs ``record=True``)."""
        out = dict.fromkeys(ENGINES, 0.0)
        for j in self.jobs:
            out[j.engine] += j.cost_us
        return out

    def critical_path(self) -> list[Job]:
        """The jobs on one longest path, first to last (needs ``record=True``): from the job that
        finishes last, back through the predecessor that finished when it started."""
        if not self.jobs:
            return []
        v = max(range(len(self.jobs)), key=lambda i: self.jobs[i].finish_us)
        path = [self.jobs[v]]
        while True:
            j = path[-1]
            on = [p for p in j.preds if abs(self.jobs[p].finish_us - j.start_us) <= 1e-9 * max(1.0, j.start_us)]
            if not on or j.start_us == 0.0:
                break
            path.append(self.jobs[on[0]])
        return path[::-1]


__all__ = ["ENGINES", "Dag", "Job"]
