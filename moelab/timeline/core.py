"""A :class:`Timeline` over the events of a hybrid run (:mod:`moelab.events`).

Every figure here is computed from the events table alone, so a real run and a simulated one
(or two configurations) compare line by line (:meth:`Timeline.compare`). Definitions:

* **wall**: first start to last end of all events. **busy %** of a lane: the union of its events
  other than ``wait`` over the wall; **overlap %**: the share of the host side's busy time during
  which the device side (device lanes or the control thread's own work) was busy too. Both are
  :func:`moelab.events.summarize` (one rule for the run's ``summary.json`` and here).
* **stall** (:meth:`Timeline.stalls`): inside each step's control window (first to last control
  event of the step), the time the control thread runs no work of its own (its ``wait`` events,
  and gaps such as the merge of a deferred result). A ``wait`` whose ``cause`` names a stall
  cause (``copy``, ``deferred``, ``host``, ``device``) counts as that cause; every other instant
  is attributed to the first of these that holds at that instant:

  1. ``copy`` — a demand copy (``transfer-demand``) runs, or a device lane waits for a copy (a
     native device lane's wait is the control thread's own, a ``wait`` of cause ``copy``);
  2. ``deferred`` — deferred host work (``expert-deferred``) runs: the control thread is waiting
     to merge a deferred result (or for the host lane it occupies);
  3. ``host`` — other host-lane work (misses computed on the host) runs;
  4. ``device`` — device-lane expert compute runs;
  5. ``handoff`` — the control thread waits on its lanes while none of them runs: a lane thread
     has not picked up (or handed back) its work yet;
  6. ``other`` — none of them, outside any wait: gaps between the control thread's own events
     (the executors record its attention/router, planning and dispatch as ``dense``, ``plan`` and
     ``dispatch`` events, so in their runs this is microseconds of clock reads).

* **critical path** of a step (:meth:`Timeline.critical_path`): the longest chain, by summed
  duration, through the step's events other than waits, along these dependencies (an edge is
  kept only when the predecessor ends no later than the successor starts):

  - *lane order*: an event follows the previous event on its lane (a lane runs one thing at a
    time; on the control thread this is the layer order);
  - *launch*: work on another lane follows the control event that issued it (the control event
    that ended last before it started);
  - *copy → compute*: a transfer feeds the device compute of the same (layer, expert) that next
    starts after it ends (:meth:`Timeline.feeds`; a fused device call, ``expert = -1``, is fed by
    its step and layer's demand copies);
  - *merge*: a layer's immediate expert compute precedes the control thread's next event of a
    later layer; deferred host work of layer ``l`` precedes the first control event past layer
    ``l + 1`` (its result is added at layer ``l + 1``'s output).

  Its length is at most the step's wall; the difference is time no event on the path ran.
* **fate** of an expert-compute event (:meth:`Timeline.fates`): ``hit``, ``prefetch-hit``,
  ``miss-host``, ``miss-fetch``, ``deferred``. Older runs' causes are mapped: ``miss`` on the
  host is ``miss-host``; a device call ``hit+fetch`` (or ``miss``/``fetch``) is ``miss-fetch`` when
  a demand copy fed it, else ``hit``. Events are per expert where the executor records one per
  expert (the simulator does); a fused device call (``expert`` -1, the real executor today)
  carries one fate for all its experts, so it cannot show a prefetch hit: the summary's fates are
  then counted **per expert from the run's plans** (``plans.jsonl``, read by :meth:`open`), and
  ``fates_basis`` says which count it is (``per expert (plans)``, ``per expert (events)`` or
  ``per call (fused device calls)``).
* **tokens/s**: tokens the run generated (``summary.json`` of a run directory, or ``tokens=``)
  over the events' wall; the events alone give steps/s and (token, expert) pairs/s.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from moelab.errors import MoelabError
from moelab.events import COLUMNS, RATE_BASIS, decode_rate, lane_group, length, summarize, union

log = logging.getLogger(__name__)

FATES = ("hit", "prefetch-hit", "miss-host", "miss-fetch", "deferred")
EXPERT_KINDS = ("expert-device", "expert-host", "expert-deferred")
STALL_CAUSES = ("copy", "deferred", "host", "device", "handoff", "other")
_DTYPES = {"run": str, "step": np.int64, "layer": np.int64, "lane": str, "kind": str, "expert": np.int64,
           "tokens": np.int64, "bytes": np.int64, "t_start_us": np.float64, "t_end_us": np.float64, "cause": str}
_GROUP_ORDER = {"control": 0, "device": 1, "copy": 2, "host": 3}


def lane_order(lanes) -> list[str]:
    """Lanes in display order: control, device*, copy*, host*, then any other, numbers naturally."""
    def key(name: str):
        parts = re.split(r"(\d+)", name)
        return (_GROUP_ORDER.get(lane_group(name), 9), [int(p) if p.isdigit() else p for p in parts])

    return sorted({str(x) for x in lanes}, key=key)


def check_events(df: pd.DataFrame, where: str = "events") -> None:
    """Raise a one-line :class:`MoelabError` when ``df`` lacks a column of the event schema."""
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise MoelabError(
            f"{where} lacks the event column(s) {', '.join(missing)}; an events table needs "
            f"{', '.join(COLUMNS)} (moelab.events.COLUMNS). Write it with a moelab executor "
            "(moelab run --hybrid CFG with executor: real) or add the columns."
        )


def _interval_op(a, b, keep) -> tuple[np.ndarray, np.ndarray]:
    """Intervals where ``keep(in_a, in_b)`` holds, for disjoint sorted interval sets ``a``, ``b``."""
    pts = np.unique(np.concatenate([a[0], a[1], b[0], b[1]]))
    if pts.size < 2:
        return np.empty(0), np.empty(0)
    lo, hi = pts[:-1], pts[1:]
    mid = (lo + hi) / 2

    def inside(iv):
        if iv[0].size == 0:
            return np.zeros(mid.size, dtype=bool)
        i = np.searchsorted(iv[0], mid, side="right") - 1
        return (i >= 0) & (mid < iv[1][np.clip(i, 0, None)])

    k = keep(inside(a), inside(b))
    return union(lo[k], hi[k])


def intersect(a, b):
    return _interval_op(a, b, lambda x, y: x & y)


def subtract(a, b):
    return _interval_op(a, b, lambda x, y: x & ~y)


def _spans(rows: pd.DataFrame):
    return union(rows["t_start_us"].to_numpy(), rows["t_end_us"].to_numpy())


@dataclass
class CriticalPath:
    """The critical path of one step: its events (in order), length and the step's wall."""

    step: int
    events: pd.DataFrame
    length_us: float
    wall_us: float

    def by_lane(self) -> dict[str, float]:
        """µs of the path on each lane."""
        d = self.events["t_end_us"] - self.events["t_start_us"]
        return {str(k): float(v) for k, v in d.groupby(self.events["lane"]).sum().items()}


def _as_frame(events: Any) -> pd.DataFrame:
    """A DataFrame of events from what a user holds: a DataFrame, an Arrow table, an event log
    (anything with ``table()``) or a run (anything with ``events``)."""
    if isinstance(events, pd.DataFrame):
        return events
    if not hasattr(events, "table") and hasattr(events, "events"):  # a HybridRun
        events = events.events
    if hasattr(events, "table") and callable(events.table):  # an EventLog
        events = events.table()
    if hasattr(events, "to_pandas"):  # an Arrow table
        return events.to_pandas()
    raise MoelabError(f"Timeline needs events: a DataFrame, an Arrow table, a run's event log (run.events), the "
                      f"run, or a run directory / events Parquet path; got {type(events).__name__}.")


def plan_fates(path: str | Path) -> dict[str, int]:
    """Per-expert fates of a run's layer plans (``plans.jsonl``): device experts that were cache
    hits (``hit``; ``prefetch-hit`` when a prefetch brought them) or fetched misses
    (``miss-fetch``), misses computed on the host (``miss-host``; a cached expert the host took is
    a hit) and ``deferred`` experts."""
    out = dict.fromkeys(FATES, 0)
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            p = json.loads(line)
            pre, hits, misses = set(p.get("prefetch_hits", ())), set(p.get("hits", ())), set(p.get("misses", ()))
            for e, _ in p.get("device", ()):
                out["prefetch-hit" if e in pre else "hit" if e in hits else "miss-fetch" if e in misses else "hit"] += 1
            for e, _ in p.get("host", ()):  # a cached expert the host took (HybriMoE's steal) is still a hit
                out["prefetch-hit" if e in pre else "hit" if e in hits else "miss-host"] += 1
            out["deferred"] += len(p.get("deferred", ()))
    return out


class Timeline:
    """The events of one run (real or simulated) with summaries computed from them alone.

    ``Timeline(events)`` over the events of a run: a DataFrame or Arrow table with the columns
    of :data:`moelab.events.COLUMNS`, a hybrid run's event log (``run.events``), the run itself
    (a :class:`~moelab.hybrid.HybridRun`), or a path (as :meth:`open`: a run directory or an
    events Parquet file).
    """

    def __init__(self, events: Any, *, name: str | None = None, tokens: int | None = None,
                 meta: dict[str, Any] | None = None) -> None:
        if isinstance(events, (str, Path)):
            opened = Timeline.open(events, name=name)
            events, meta = opened.events, {**opened.meta, **(meta or {})}
            name = name or opened.name
        events = _as_frame(events)
        check_events(events)
        df = events.loc[:, list(COLUMNS)].copy()
        for c, t in _DTYPES.items():
            # strings as categories: a few distinct values, and fast to group, compare and map
            df[c] = _categorical(df[c]) if t is str else df[c].astype(t)
        bad = df["t_end_us"] < df["t_start_us"]
        if bool(bad.any()):
            i = int(np.flatnonzero(bad.to_numpy())[0])
            raise MoelabError(f"event {i} ends before it starts (t_start_us={df['t_start_us'].iat[i]}, "
                              f"t_end_us={df['t_end_us'].iat[i]}); fix the events table's timestamps.")
        self.events = df.sort_values(["t_start_us", "t_end_us"], kind="stable").reset_index(drop=True)
        self.meta = dict(meta or {})
        self.name = name or self.meta.get("name") or (str(df["run"].iat[0]) if len(df) else "events")
        self._tokens = tokens if tokens is not None else self.meta.get("generated_tokens")
        self._cache: dict[str, Any] = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def open(cls, path: str | Path, *, name: str | None = None) -> Timeline:
        """A run directory (``events.parquet``, with ``summary.json``) or an events Parquet file."""
        p = Path(path)
        meta: dict[str, Any] = {}
        if p.is_dir():
            f = p / "events.parquet"
            if not f.exists():
                raise MoelabError(
                    f"{str(p)!r} has no events.parquet; pass a run directory written by "
                    "`moelab run --hybrid CFG --out DIR` (executor: real) or an events Parquet file."
                )
            s = p / "summary.json"
            if s.exists():
                meta.update(json.loads(s.read_text()))
            plans = p / "plans.jsonl"
            if plans.exists():
                meta["plan_fates"] = plan_fates(plans)
        elif p.exists():
            f = p
        else:
            raise MoelabError(f"{str(p)!r} does not exist; pass a run directory or an events Parquet file.")
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(f)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the user's to fix
            raise MoelabError(f"{str(f)!r} is not a readable Parquet file ({e}); pass an events.parquet.") from None
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            check_events(pd.DataFrame(columns=table.column_names), where=str(f))
        return cls(table.to_pandas(), name=name or (p.name if p.is_dir() else p.stem), meta=meta)

    def select(self, *, steps=None, layers=None, lanes=None, t_range: tuple[float, float] | None = None) -> Timeline:
        """A Timeline of the events in ``steps``/``layers`` (iterables or ``(lo, hi)`` inclusive ranges),
        on ``lanes``, or overlapping ``t_range`` (µs). Layer ``-1`` (work outside MoE layers) stays."""
        df = self.events
        m = np.ones(len(df), dtype=bool)
        if steps is not None:
            m &= _member(df["step"], steps)
        if layers is not None:
            m &= _member(df["layer"], layers) | (df["layer"] == -1).to_numpy()
        if lanes is not None:
            m &= df["lane"].isin(list(lanes)).to_numpy()
        if t_range is not None:
            m &= ((df["t_end_us"] >= t_range[0]) & (df["t_start_us"] <= t_range[1])).to_numpy()
        return Timeline(df[m], name=self.name, tokens=None, meta={k: v for k, v in self.meta.items()
                                                                  if k != "generated_tokens"})

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        return f"Timeline({self.name!r}: {len(self)} events, {len(self.steps)} steps, lanes {self.lanes})"

    # ------------------------------------------------------------------ basics
    @property
    def lanes(self) -> list[str]:
        return lane_order(self.events["lane"].unique())

    @property
    def steps(self) -> list[int]:
        return sorted(int(s) for s in self.events["step"].unique())

    @property
    def layers(self) -> list[int]:
        return sorted(int(x) for x in self.events["layer"].unique() if x >= 0)

    @property
    def t0(self) -> float:
        return float(self.events["t_start_us"].min()) if len(self) else 0.0

    @property
    def wall_us(self) -> float:
        return float(self._summary()["wall_us"])

    def _summary(self) -> dict:
        if "summary" not in self._cache:
            self._cache["summary"] = summarize(self.events)
        return self._cache["summary"]

    def busy_pct(self) -> dict[str, float]:
        """Per lane: the share of the wall during which it ran work (waits excluded)."""
        b = self._summary()["busy_pct"]
        return {lane: float(b[lane]) for lane in self.lanes if lane in b}

    def group_busy_pct(self) -> dict[str, float]:
        """Per lane group (``device``, ``copy``, ``host``, ``control``): % of the wall at least one
        of its lanes ran work."""
        df = self.events[self.events["kind"] != "wait"]
        wall = max(self.wall_us, 1e-9)
        groups = df["lane"].map(lane_group)
        return {g: 100.0 * length(_spans(df[groups == g])) / wall for g in _GROUP_ORDER if bool((groups == g).any())}

    def overlap_pct(self) -> float:
        """The share of the host side's busy time during which the device side was busy too."""
        return float(self._summary()["overlap_pct"])

    # ------------------------------------------------------------------ fates and flows
    def feeds(self) -> pd.DataFrame:
        """``(transfer, compute)`` row pairs: each transfer and the device compute it feeds (see the
        module's definition), as positions in :attr:`events`."""
        if "feeds" in self._cache:
            return self._cache["feeds"]
        df = self.events
        idx = np.arange(len(df))
        is_tr = df["kind"].str.startswith("transfer").to_numpy()
        is_dev = ((df["kind"] == "expert-device") & (df["lane"].map(lane_group) == "device")).to_numpy()
        out = []
        tr = pd.DataFrame({"tr": idx[is_tr], "layer": df["layer"].to_numpy()[is_tr],
                           "expert": df["expert"].to_numpy()[is_tr], "step": df["step"].to_numpy()[is_tr],
                           "t": df["t_end_us"].to_numpy()[is_tr], "kind": df["kind"].to_numpy()[is_tr]})
        dv = pd.DataFrame({"cp": idx[is_dev], "layer": df["layer"].to_numpy()[is_dev],
                           "expert": df["expert"].to_numpy()[is_dev], "step": df["step"].to_numpy()[is_dev],
                           "t": df["t_start_us"].to_numpy()[is_dev]})
        single = dv[dv["expert"] >= 0].sort_values("t")
        if len(tr) and len(single):
            m = pd.merge_asof(tr.sort_values("t"), single[["cp", "layer", "expert", "t"]], on="t",
                              by=["layer", "expert"], direction="forward")
            out.append(m.dropna(subset=["cp"])[["tr", "cp"]])
        fused = dv[dv["expert"] < 0].sort_values("t")
        demand = tr[tr["kind"] == "transfer-demand"]
        if len(demand) and len(fused):
            m = pd.merge_asof(demand.sort_values("t"), fused[["cp", "layer", "step", "t"]], on="t",
                              by=["step", "layer"], direction="forward")
            out.append(m.dropna(subset=["cp"])[["tr", "cp"]])
        res = (pd.concat(out) if out else pd.DataFrame({"tr": [], "cp": []})).astype(np.int64)
        res = res.drop_duplicates("tr").sort_values("tr").reset_index(drop=True)
        self._cache["feeds"] = res
        return res

    def fate_counts(self) -> tuple[dict[str, int], str]:
        """``(counts by fate, basis)``: per expert from the run's plans where :meth:`open` read them,
        else from the events — per expert, or per call where the executor fused device calls."""
        if self.meta.get("plan_fates"):
            return {f: int(self.meta["plan_fates"].get(f, 0)) for f in FATES}, "per expert (plans)"
        fates = self.fates()
        counts = {f: int((fates == f).sum()) for f in FATES}
        df = self.events
        fused = bool(((df["expert"] < 0) & df["kind"].isin(EXPERT_KINDS)).any())
        basis = ("per call (fused device calls: one fate per call, so prefetch hits cannot show; a run "
                 "directory's plans.jsonl has them per expert)") if fused else "per expert (events)"
        return counts, basis

    def fates(self) -> pd.Series:
        """The fate of each expert-compute event (``''`` for other events); see the module docs."""
        if "fates" in self._cache:
            return self._cache["fates"]
        df = self.events
        kind, cause = df["kind"].to_numpy(), df["cause"].to_numpy()
        fate = np.full(len(df), "", dtype=object)
        expert = np.isin(kind, EXPERT_KINDS)
        known = expert & np.isin(cause, FATES)
        fate[known] = cause[known]
        rest = expert & ~known
        fate[rest & (kind == "expert-deferred")] = "deferred"
        fate[rest & (kind == "expert-host")] = "miss-host"
        dev = np.flatnonzero(rest & (kind == "expert-device"))
        if dev.size:
            f = self.feeds()
            fed_by_demand = set(f["cp"][df["kind"].to_numpy()[f["tr"].to_numpy()] == "transfer-demand"].tolist())
            fate[dev] = ["miss-fetch" if i in fed_by_demand else "hit" for i in dev.tolist()]
        s = pd.Series(fate, index=df.index, name="fate", dtype=object)
        self._cache["fates"] = s
        return s

    # ------------------------------------------------------------------ stalls
    def stalls(self) -> dict[str, float]:
        """µs the control thread stalled, by cause (``copy``, ``deferred``, ``host``, ``device``,
        ``other``); see the module docs for the rule."""
        if "stalls" in self._cache:
            return self._cache["stalls"]
        df = self.events
        groups = df["lane"].map(lane_group)
        ctl = df[groups == "control"]
        res = dict.fromkeys(STALL_CAUSES, 0.0)
        if len(ctl):
            w = ctl.groupby("step").agg(a=("t_start_us", "min"), b=("t_end_us", "max"))
            windows = union(w["a"].to_numpy(), w["b"].to_numpy())
            stall = subtract(windows, _spans(ctl[ctl["kind"] != "wait"]))
            waits = ctl[ctl["kind"] == "wait"]
            for c in STALL_CAUSES[:4]:
                explicit = intersect(stall, _spans(waits[waits["cause"] == c]))
                res[c] += length(explicit)
                stall = subtract(stall, explicit)
            kind = df["kind"]
            sets = {
                "copy": df[(kind == "transfer-demand") | ((groups == "device") & (kind == "wait")
                                                          & (df["cause"] == "copy"))],
                "deferred": df[kind == "expert-deferred"],
                "host": df[(groups == "host") & (kind != "wait") & (kind != "expert-deferred")],
                "device": df[(groups == "device") & (kind != "wait")],
            }
            for c, rows in sets.items():
                part = intersect(stall, _spans(rows))
                res[c] += length(part)
                stall = subtract(stall, part)
            # waiting on lanes while none runs: a lane thread has not yet picked up (or handed back)
            # the work it was given — thread hand-off latency (the GIL on a CPU-only machine)
            part = intersect(stall, _spans(waits))
            res["handoff"] += length(part)
            res["other"] += length(subtract(stall, part))
        self._cache["stalls"] = res
        return res

    # ------------------------------------------------------------------ critical path
    def critical_path(self, step: int | None = None) -> CriticalPath:
        """The longest dependency chain through ``step``'s events (default: the last step)."""
        if step is None:
            if not len(self):
                raise MoelabError("the timeline has no events; a critical path needs at least one step.")
            step = self.steps[-1]
        df = self.events
        if "step_rows" not in self._cache:
            work = df.index[df["kind"] != "wait"].to_numpy()
            self._cache["step_rows"] = {int(k): work[np.asarray(v)] for k, v in
                                        pd.Series(work).groupby(df["step"].to_numpy()[work]).groups.items()}
            f = self.feeds()
            steps = df["step"].to_numpy()
            same = steps[f["tr"].to_numpy()] == steps[f["cp"].to_numpy()]
            self._cache["step_feeds"] = dict(list(f[same].groupby(steps[f["cp"].to_numpy()[same]])))
        rows = self._cache["step_rows"].get(int(step))
        if rows is None:
            raise MoelabError(f"the timeline has no step {step}; steps are {_ranges(self.steps)}.")
        rows = np.sort(rows)
        fed = self._cache["step_feeds"].get(int(step), pd.DataFrame({"tr": [], "cp": []}, dtype=np.int64))
        order, length_us, wall = _longest_chain(df, rows, fed)
        ev = df.iloc[order]
        sub = df.iloc[rows]
        return CriticalPath(int(step), ev, length_us, float(sub["t_end_us"].max() - sub["t_start_us"].min()))

    def critical_paths(self, steps=None) -> pd.DataFrame:
        """Per step (all, or ``steps``): the critical path's length, the step's wall and the path's
        µs per lane group."""
        rows = []
        for s in self.steps if steps is None else steps:
            try:
                cp = self.critical_path(s)
            except MoelabError:
                continue
            g: dict[str, float] = {}
            for lane, us in cp.by_lane().items():
                g[lane_group(lane)] = g.get(lane_group(lane), 0.0) + us
            rows.append({"step": s, "path_us": cp.length_us, "wall_us": cp.wall_us,
                         **{f"path_{k}_us": v for k, v in g.items()}})
        return pd.DataFrame(rows)

    # ------------------------------------------------------------------ rates and summary
    def rates(self) -> dict[str, Any]:
        """Steps and (token, expert) pairs per second of event wall, and the run's tokens/s:
        :func:`moelab.events.decode_rate` where the run recorded its forwards' phases (every run
        written by moelab now), else generated tokens over the events' wall, labelled as such."""

        wall_s = self.wall_us / 1e6 if len(self) else 0.0
        pairs = int(self.events.loc[self.events["kind"].isin(EXPERT_KINDS), "tokens"].sum())
        out: dict[str, Any] = {
            "steps_per_s": len(self.steps) / wall_s if wall_s > 0 else None,
            "expert_pairs_per_s": pairs / wall_s if wall_s > 0 else None,
        }
        forwards = self.meta.get("forwards")
        if forwards:
            r = decode_rate(self.events, forwards)
            out.update(tokens_per_s=r["tokens_per_s"], tokens_per_s_basis=r["tokens_per_s_basis"])
        else:
            out.update(tokens_per_s=self._tokens / wall_s if (self._tokens and wall_s > 0) else None,
                       tokens_per_s_basis=(f"generated tokens / event wall (this run recorded no forward phases, "
                                           f"so not {RATE_BASIS})"))
        return out

    def summary(self, *, critical_path: bool = True, max_path_steps: int = 256) -> dict[str, Any]:
        """Everything above as one flat-ish dict (JSON-serialisable). The critical path is averaged
        over every step, or over ``max_path_steps`` evenly spaced ones in longer runs
        (``critical_path_steps`` says how many)."""
        out: dict[str, Any] = {"name": self.name, "events": len(self), "steps": len(self.steps),
                               "wall_us": self.wall_us, "busy_pct": self.busy_pct(),
                               "group_busy_pct": self.group_busy_pct(), "overlap_pct": self.overlap_pct(),
                               "stall_us": self.stalls(), **self.rates()}
        kinds = self.events.assign(d=self.events["t_end_us"] - self.events["t_start_us"]).groupby("kind")["d"].sum()
        out["time_by_kind_us"] = {str(k): float(v) for k, v in kinds.items()}
        out["fates"], out["fates_basis"] = self.fate_counts()
        if critical_path and len(self):
            steps = self.steps
            if len(steps) > max_path_steps:
                steps = [steps[i] for i in np.linspace(0, len(steps) - 1, max_path_steps).round().astype(int)]
            cps = self.critical_paths(sorted(set(steps)))
            out["critical_path_steps"] = len(cps)
            out["critical_path_us"] = float(cps["path_us"].mean()) if len(cps) else None
            out["critical_path_share"] = float((cps["path_us"] / cps["wall_us"].clip(lower=1e-9)).mean()) \
                if len(cps) else None
        return out

    def summary_table(self) -> pd.DataFrame:
        """:meth:`summary` as ``metric``/``value`` rows (nested figures flattened)."""
        return pd.DataFrame(_flatten(self.summary()), columns=["metric", "value"])

    def compare(self, other: Timeline, *, names: tuple[str, str] | None = None) -> pd.DataFrame:
        """Line by line: every metric of :meth:`summary` for both timelines, with difference and ratio."""
        a_name, b_name = names or (self.name, other.name if other.name != self.name else f"{other.name} (2)")
        a = dict(_flatten(self.summary()))
        b = dict(_flatten(other.summary()))
        keys = list(a) + [k for k in b if k not in a]
        rows = []
        for k in keys:
            if k == "name":
                continue
            x, y = a.get(k), b.get(k)
            num = isinstance(x, int | float) and isinstance(y, int | float)
            rows.append({"metric": k, a_name: x, b_name: y,
                         "diff": (y - x) if num else None,
                         "ratio": (y / x) if num and x else None})
        return pd.DataFrame(rows)

    # ------------------------------------------------------------------ views and exports
    def figure(self, *others: Timeline, **kwargs):
        """The interactive plotly figure (:func:`moelab.timeline.figure.timeline_figure`)."""
        from moelab.timeline.figure import timeline_figure

        return timeline_figure([self, *others], **kwargs)

    def to_chrome(self, path: str | Path | None = None):
        """Chrome trace JSON (:func:`moelab.timeline.export.to_chrome`)."""
        from moelab.timeline.export import to_chrome

        return to_chrome(self, path)

    def to_perfetto(self, path: str | Path | None = None):
        """Perfetto protobuf (:func:`moelab.timeline.export.to_perfetto`)."""
        from moelab.timeline.export import to_perfetto

        return to_perfetto(self, path)


def _categorical(col: pd.Series) -> pd.Categorical:
    """A string column as a categorical with plain-object categories (``''`` for missing)."""
    codes, uniques = pd.factorize(col, use_na_sentinel=True)
    cats = [("" if pd.isna(u) else str(u)) for u in uniques]
    if (codes < 0).any():
        cats.append("")
        codes = np.where(codes < 0, len(cats) - 1, codes)
    if len(set(cats)) < len(cats):  # '' both present and missing: merge
        names, inv = np.unique(np.asarray(cats, dtype=object), return_inverse=True)
        codes, cats = inv[codes], list(names)
    return pd.Categorical.from_codes(codes, categories=pd.Index(cats, dtype=object))


def _member(col: pd.Series, sel) -> np.ndarray:
    if isinstance(sel, tuple) and len(sel) == 2:
        return ((col >= sel[0]) & (col <= sel[1])).to_numpy()
    if isinstance(sel, int | np.integer):
        sel = [sel]
    return col.isin(list(sel)).to_numpy()


def _ranges(xs: list[int]) -> str:
    return f"{xs[0]}..{xs[-1]}" if xs else "none"


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += _flatten(v, key + ".")
        else:
            out.append((key, v))
    return out


def _longest_chain(df: pd.DataFrame, rows: np.ndarray, fed: pd.DataFrame) -> tuple[list[int], float, float]:
    """Longest duration-weighted path through ``rows`` (positions in ``df``) along the dependencies
    of the module docs. Returns (positions on the path in order, its length, the rows' wall)."""
    eps = 1e-6
    sub = df.iloc[rows]
    start = sub["t_start_us"].to_numpy()
    end = sub["t_end_us"].to_numpy()
    lane = sub["lane"].to_numpy()
    kind = sub["kind"].to_numpy()
    layer = sub["layer"].to_numpy()
    group = np.array([lane_group(x) for x in lane])
    n = rows.size
    order = np.lexsort((end, start))  # rows are time-sorted already; keep it explicit
    pos = {int(r): i for i, r in enumerate(rows)}
    preds: list[list[int]] = [[] for _ in range(n)]
    last_on_lane: dict[str, int] = {}
    ctl = [i for i in order if group[i] == "control"]
    ctl_start = np.array([start[i] for i in ctl])
    by_end = sorted(ctl, key=lambda i: end[i])
    ctl_end = np.array([end[i] for i in by_end])
    for i in order:
        p = last_on_lane.get(lane[i])
        if p is not None:
            preds[i].append(p)
        last_on_lane[lane[i]] = i
        if group[i] != "control" and ctl:
            j = np.searchsorted(ctl_end, start[i] + eps, side="right") - 1
            if j >= 0:
                preds[i].append(by_end[j])
        if kind[i] in ("expert-device", "expert-host", "expert-deferred") and ctl:
            past = layer[i] + (2 if kind[i] == "expert-deferred" else 1)
            k = np.searchsorted(ctl_start, end[i] - eps, side="left")
            while k < len(ctl) and layer[ctl[k]] < past:
                k += 1
            if k < len(ctl):
                preds[ctl[k]].append(i)
    for t, c in zip(fed["tr"].to_numpy(), fed["cp"].to_numpy(), strict=True):
        preds[pos[int(c)]].append(pos[int(t)])
    best = np.zeros(n)
    back = np.full(n, -1)
    # every edge is known before the pass below
    dur = end - start
    # a valid predecessor ends before its successor starts, so start order is a topological order
    for i in order:
        b, arg = 0.0, -1
        for p in preds[i]:
            if end[p] <= start[i] + eps and best[p] > b:
                b, arg = best[p], p
        best[i] = b + dur[i]
        back[i] = arg
    i = int(np.argmax(best))
    path = []
    while i >= 0:
        path.append(int(rows[i]))
        i = int(back[i])
    return path[::-1], float(best.max()), float(end.max() - start.min())
