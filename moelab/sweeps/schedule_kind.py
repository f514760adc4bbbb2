"""The ``schedule`` cell kind: simulated schedules (MoE-Gen's throughput, OSDI '26's stream-loading
prefill) swept over model shapes × hardware profiles × the schedule's settings.

Its cells need no model and no trace: each runs one schedule of :data:`SCHEDULES` on a packaged
model shape (or a ``config.json``) and a hardware profile, so a grid of batch sizes, micro-batches
or prompt lengths is a resumable sweep like any other (the store, the executors, the report)::

    name: moegen_grid
    kind: schedule
    schedule: moegen                       # MoE-Gen's throughput search (moelab.simulate.moegen)
    shapes: [mixtral-8x7b, deepseek-v2-lite]
    hardware: [moegen-a5000, moegen-a6000]
    grid: {cpu_attention: [0, 0.5, 1], expert_slots: [2, 8]}   # each a list to sweep
    settings: {prompt: 512, generate: 256}                     # fixed for every cell

Every axis a cell does not pin is searched by the schedule itself (MoE-Gen: ``batch``,
``micro_batch``, ``expert_batch``, ``cpu_attention``, ``expert_slots``). ``schedule: prefill``
(:func:`moelab.simulate.prefill.prefill`) takes ``prompt_tokens`` (required), ``path`` (``slp``,
``hybrid``, ``auto``: by the searched crossover), ``ring_slots``, ``dense_budget_gb``,
``chunk_tokens``; both take ``dtype`` (re-cost the shape's weights, e.g. ``fp8``). A cell's
``score`` is its tokens/s; ``metrics`` is the schedule's whole answer (the configuration, its memory, the
baseline, the assumptions). A configuration that does not fit the profile's memory fails its
cell with the refusal, which names every term.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import moelab
from moelab.errors import MoelabError, did_you_mean
from moelab.simulate.moegen import plan_throughput
from moelab.simulate.prefill import PrefillConfig, prefill
from moelab.sweeps.kinds import CellKind
from moelab.sweeps.spec import SpecBase, StoredCell
from moelab.timing import get_profile
from moelab.timing.shapes import get_shape

KEY_VERSION = 1


def _shape(name: str, values: dict[str, Any]) -> Any:
    """The cell's model shape (its weights re-costed in ``dtype`` where the settings give one)."""
    return get_shape(name, dtype=values.pop("dtype", None))


def _moegen(shape: str, profile: str, values: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    values = dict(values)
    plan = plan_throughput(_shape(shape, values), profile, **values)
    return plan.tokens_per_s, plan.to_dict()


def _prefill(shape: str, profile: str, values: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    values = dict(values)
    s = _shape(shape, values)
    result = prefill(s, profile, PrefillConfig(**values))
    return result.tokens_per_s, result.to_dict()


@dataclass(frozen=True)
class Schedule:
    """One sweepable schedule: its runner and the settings a spec may give it."""

    run: Callable[[str, str, dict[str, Any]], tuple[float, dict[str, Any]]]
    keys: tuple[str, ...]
    defaults: dict[str, Any] = field(default_factory=dict)


#: Schedules by name (``schedule:`` of a spec).
SCHEDULES: dict[str, Schedule] = {
    "moegen": Schedule(_moegen, ("dtype", "phase", "prompt", "generate", "batch", "micro_batch", "expert_batch",
                                 "cpu_attention", "expert_slots"), {"phase": "decode", "prompt": 512, "generate": 256}),
    "prefill": Schedule(_prefill, ("dtype", "prompt_tokens", "path", "ring_slots", "dense_budget_gb", "chunk_tokens",
                                   "crossover"), {"path": "auto"}),
}


@dataclass
class ScheduleSweepSpec(SpecBase):
    """A ``schedule`` spec (see the module docstring; the common fields:
    :class:`~moelab.sweeps.spec.SpecBase`)."""

    schedule: str
    shapes: list[str]
    hardware: list[str]
    points: list[dict[str, Any]]
    settings: dict[str, Any]
    kind: str = "schedule"


@dataclass
class ScheduleCell(StoredCell):
    """One schedule run: a shape × a profile × one grid point."""

    schedule: str
    shape: str
    profile: str
    point: dict[str, Any]
    settings: dict[str, Any]
    profile_fields: dict[str, Any] = field(default_factory=dict)
    """The profile's fields (in the hash: editing a profile re-runs its cells)."""
    kind: str = "schedule"
    hash: str = ""

    def resource(self) -> tuple:
        return ("schedule",)

    def columns(self) -> dict[str, Any]:
        return {"model": self.shape, "policy": self.schedule, "affected": None, "task": self.profile, "seed": 0}

    def label(self) -> str:
        point = ",".join(f"{k}={v}" for k, v in self.point.items())
        return f"{self.shape} on {self.profile} · {self.schedule}({point})"

    def values(self) -> dict[str, Any]:
        return {**self.settings, **self.point}


def schedule_cell_key(cell: ScheduleCell, moelab_version: str) -> dict[str, Any]:
    return {"key_version": KEY_VERSION, "kind": "schedule", "schedule": cell.schedule, "shape": cell.shape,
            "profile": cell.profile_fields, "values": cell.values(), "moelab": moelab_version}


class ScheduleKind(CellKind):
    name = "schedule"
    spec_keys = ("schedule", "shapes", "hardware", "grid", "settings")

    def parse(self, r: Any, data: dict[str, Any], common: dict[str, Any]) -> ScheduleSweepSpec:
        r.required(data, ("schedule", "shapes", "hardware"))
        name = data["schedule"]
        if name not in SCHEDULES:
            raise r.fail(("schedule",), f"unknown schedule {name!r}.{did_you_mean(str(name), list(SCHEDULES))} "
                                        f"Known: {', '.join(SCHEDULES)}.")
        sched = SCHEDULES[name]
        shapes = r.listed(data["shapes"], ("shapes",), "shapes")
        for i, s in enumerate(shapes):
            try:
                get_shape(r.path(s, ("shapes", i), "shape") if str(s).endswith(".json") else s)
            except MoelabError as exc:
                raise r.fail(("shapes", i), str(exc)) from None
        shapes = [r.path(s, ("shapes", i), "shape") if str(s).endswith(".json") else str(s)
                  for i, s in enumerate(shapes)]
        hardware = r.listed(data["hardware"], ("hardware",), "hardware")
        for i, h in enumerate(hardware):
            try:
                get_profile(h)
            except MoelabError as exc:
                raise r.fail(("hardware", i), str(exc)) from None
        for what, items in (("shapes", shapes), ("hardware", hardware)):
            if not items:
                raise r.fail((what,), f"{what} is empty; list at least one.")
        grid = r.keys(data.get("grid") or {}, ("grid",), sched.keys, f"the {name} grid")
        settings = dict(sched.defaults)
        settings.update(r.keys(data.get("settings") or {}, ("settings",), sched.keys, f"the {name} settings"))
        both = sorted(set(grid) & set(settings) - set(sched.defaults))
        if both:
            raise r.fail(("grid",), f"{', '.join(both)} both in grid and settings; give each in one place.")
        axes = []
        for k, v in grid.items():
            vals = r.listed(v, ("grid", k), f"grid {k}")
            if not vals:
                raise r.fail(("grid", k), f"grid {k} is empty; list at least one value.")
            axes.append([(k, x) for x in vals])
        points = [dict(p) for p in itertools.product(*axes)] if axes else [{}]
        return ScheduleSweepSpec(schedule=name, shapes=shapes, hardware=list(hardware), points=points,
                                 settings=settings, **common)

    def expand(self, spec: ScheduleSweepSpec, store: Any) -> list[ScheduleCell]:
        cells, seen = [], set()
        for shape, profile, point in itertools.product(spec.shapes, spec.hardware, spec.points):
            cell = ScheduleCell(schedule=spec.schedule, shape=shape, profile=profile, point=dict(point),
                                settings=dict(spec.settings), profile_fields=get_profile(profile).to_dict())
            blob = json.dumps(schedule_cell_key(cell, moelab.__version__), sort_keys=True, separators=(",", ":"),
                              default=str)
            cell.hash = hashlib.sha256(blob.encode()).hexdigest()[:24]
            if cell.hash not in seen:
                seen.add(cell.hash)
                cells.append(cell)
        return cells

    def cell_from_dict(self, d: dict[str, Any]) -> ScheduleCell:
        return ScheduleCell.from_dict(d)

    def load(self, cell: ScheduleCell) -> Any:
        return None

    def run(self, cell: ScheduleCell, resource: Any, worker: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
        import platform

        tps, metrics = SCHEDULES[cell.schedule].run(cell.shape, cell.profile, cell.values())
        return {"key": schedule_cell_key(cell, moelab.__version__), "metrics": metrics, "score": tps,
                "score_stderr": None, "n_docs": None,
                "versions": {"moelab": moelab.__version__, "python": platform.python_version()},
                "samples_path": None, "trace_path": None, "timeline_path": None}, {}

    def row(self, cell: ScheduleCell, record: dict[str, Any] | None) -> dict[str, Any]:
        m = (record or {}).get("metrics") or {}
        if cell.schedule == "prefill":
            return {"shape": cell.shape, "profile": cell.profile, "schedule": cell.schedule,
                    "point": ", ".join(f"{k}={v}" for k, v in cell.point.items()) or "-",
                    "tokens/s": (record or {}).get("score"), "path": m.get("path"), "time ms": m.get("time_ms"),
                    "ring slots": m.get("ring_slots"), "crossover tokens": m.get("crossover_tokens")}
        best = m.get("best") or {}
        return {"shape": cell.shape, "profile": cell.profile, "schedule": cell.schedule,
                "point": ", ".join(f"{k}={v}" for k, v in cell.point.items()) or "(searched)",
                "tokens/s": (record or {}).get("score"), "batch": best.get("batch"),
                "micro batch": best.get("micro_batch"), "expert batch": best.get("expert_batch"),
                "cpu attention": best.get("cpu_attention"), "baseline tokens/s": (m.get("baseline") or {}).get(
                    "tokens_per_s")}


def register_schedule(name: str, schedule: Schedule, *, overwrite: bool = False) -> None:
    """Make a schedule sweepable as ``schedule: name`` (a repeated name raises unless ``overwrite``)."""
    if name in SCHEDULES and not overwrite:
        raise MoelabError(f"schedule {name!r} is already registered; pass overwrite=True to replace it.")
    SCHEDULES[name] = schedule


SCHEDULE = ScheduleKind()
