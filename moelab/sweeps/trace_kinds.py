"""Trace-based cell kinds: expert-cache simulation (``cache``) and expert prediction (``predictor``).

Their cells replay recorded routing traces instead of scoring a model, so they need no
model and run in milliseconds to seconds; they share the store, the resume guarantees and
the executors of accuracy sweeps. A cache spec::

    name: caches_mixtral
    kind: cache
    traces: [runs/traces/mixtral]                 # relative to the spec file
    policies: [lru, lfu, belady, {policy: mrs, alpha: 0.5}]
    capacities: [0.125, 0.25, 4]                  # fractions of the experts, or counts
    scopes: [layer, global]
    prefetch: [none, {predictor: oracle, distance: 1, budget: 2}]
    settings: {insertion: always, replay: forward, include_prefill: false, warm: false}

expands into traces × prefetch × scopes × policies × capacities (prefetch only for policies
that accept it: the Belady bounds and ``static`` stay demand-only), one
:func:`moelab.caches.simulate` per cell. A predictor spec::

    name: predictors_mixtral
    kind: predictor
    traces: [{train: runs/traces/train, test: runs/traces/test}]   # or just DIR: its held-out sequences
    predictors: [frequency, token, {predictor: learned, width: 256}]
    distances: [1, 2]
    seeds: [0]
    settings: {m: [1, 2, 4, 8], hardware: pcie4-x16}

expands into traces × distances × predictors × seeds (distances beyond the model's MoE
layers are left out, as :func:`moelab.predictors.compare` does), each fitted on ``train``
and scored by :func:`moelab.predictors.evaluate`. A trace is identified in cell hashes by
:func:`moelab.sweeps.fingerprints.path_signature`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import moelab
from moelab.caches.base import SCOPES, available_policies, get_policy
from moelab.caches.results import CacheResult
from moelab.errors import MoelabError, did_you_mean
from moelab.sweeps.kinds import CellKind
from moelab.sweeps.spec import SpecBase, StoredCell
from moelab.timing import DEFAULT_PROFILE, reference_expert_bytes

log = logging.getLogger(__name__)

KEY_VERSION = 1


@dataclass
class TraceSweepSpec(SpecBase):
    """A ``cache`` or ``predictor`` spec (see the module docstring; the common fields:
    :class:`~moelab.sweeps.spec.SpecBase`)."""

    kind: str
    traces: list[dict[str, str | None]]
    """``{"train": dir, "test": dir or None}`` (cache specs use ``train`` only)."""
    methods: list[tuple[str, dict[str, Any]]]
    """Cache policies or predictor kinds, each with its parameters."""
    points: list[dict[str, Any]]
    """The grid of each method: capacity × scope × prefetch, or distance."""
    settings: dict[str, Any] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [0])


@dataclass
class TraceCell(StoredCell):
    """One replay: a trace × method (cache policy or predictor kind) × grid point × seed."""

    kind: str
    trace: str
    method: str
    params: dict[str, Any]
    point: dict[str, Any]
    settings: dict[str, Any]
    seed: int = 0
    test_trace: str | None = None
    signatures: dict[str, str] = field(default_factory=dict)
    """:func:`~moelab.sweeps.fingerprints.path_signature` of every path the cell reads."""
    model: str = ""
    """The trace's model (for tables)."""
    load: dict[str, Any] = field(default_factory=dict)
    """How the worker loads the trace (not in the hash: it does not change the result)."""
    hash: str = ""

    def resource(self) -> tuple:
        return ("trace", self.kind, self.trace, self.test_trace, json.dumps(self.load, sort_keys=True))

    def columns(self) -> dict[str, Any]:
        return {"model": self.model, "policy": self.method, "affected": None, "task": Path(self.trace).name,
                "seed": self.seed}

    def label(self) -> str:
        point = ",".join(f"{k}={_short(v)}" for k, v in self.point.items())
        return f"{Path(self.trace).name} · {self.kind} {self.method}({point})"


def _short(v: Any) -> str:
    if isinstance(v, dict):
        return v.get("predictor", "?") if "predictor" in v else json.dumps(v, sort_keys=True)
    return "none" if v is None else str(v)


def trace_cell_key(cell: TraceCell, moelab_version: str) -> dict[str, Any]:
    return {"key_version": KEY_VERSION, "kind": cell.kind, "signatures": cell.signatures, "method": cell.method,
            "params": cell.params, "point": cell.point, "settings": cell.settings, "seed": cell.seed,
            "moelab": moelab_version}


def _add_unseen(cell: TraceCell, seen: set[str], cells: list[TraceCell]) -> None:
    """Hash ``cell`` and keep it unless a cell with the same hash was kept already."""
    cell.hash = _hash(cell)
    if cell.hash not in seen:
        seen.add(cell.hash)
        cells.append(cell)


def _hash(cell: TraceCell) -> str:
    blob = json.dumps(trace_cell_key(cell, moelab.__version__), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _trace_model(path: str) -> str:
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
        return str(meta.get("model", {}).get("name") or "")
    except (OSError, ValueError, AttributeError):
        return ""


# --------------------------------------------------------------------------- common parsing
def _methods(r: Any, items: Any, path: tuple, what: str, one: str, known: list[str],
             key: str) -> list[tuple[str, dict]]:
    out = []
    for i, m in enumerate(r.listed(items, path, what)):
        if isinstance(m, str):
            m = {key: m}
        if not isinstance(m, dict) or key not in m:
            raise r.fail((*path, i), f"{what} entry {m!r}: expected a name or {{{key}: NAME, ...parameters}}.")
        name = m[key]
        if name not in known:
            raise r.fail((*path, i), f"unknown {one} {name!r}."
                                     f"{did_you_mean(str(name), known)} Known: {', '.join(known)}.")
        out.append((name, {k: v for k, v in m.items() if k != key}))
    if not out:
        raise r.fail(path, f"{what} is empty; list at least one.")
    return out


def _traces(r: Any, items: Any, with_test: bool) -> list[dict[str, str | None]]:
    out = []
    for i, t in enumerate(r.listed(items, ("traces",), "traces")):
        if isinstance(t, dict) and with_test:
            r.keys(t, ("traces", i), ("train", "test"), "a trace entry")
            if "train" not in t:
                raise r.fail(("traces", i), "a trace entry {train: DIR, test: DIR} needs train.")
            train, test = t["train"], t.get("test")
        else:
            train, test = t, None
        entry = {"train": r.path(train, ("traces", i), "trace"),
                 "test": r.path(test, ("traces", i), "trace") if test is not None else None}
        for p in filter(None, entry.values()):
            if not (Path(p) / "meta.json").is_file():
                raise r.fail(("traces", i), f"{p!r} is not a routing trace (no meta.json); record one with "
                                            "`moelab trace --out DIR`.")
        out.append(entry)
    if not out:
        raise r.fail(("traces",), "traces is empty; list at least one trace directory.")
    return out


# --------------------------------------------------------------------------- cache
CACHE_SETTINGS = {"include_prefill": False, "insertion": "always", "replay": "forward", "warm": False,
                  "expert_bytes": None, "access_order": "weight"}
PREFETCH_KEYS = ("predictor", "distance", "budget", "budget_bytes", "link_gbps", "step_ms", "link_latency_us", "budget_scope")


def prefetcher(spec: str, distance: int | None, trace_dir: str) -> tuple[Any, int]:
    """(predictor, distance) for a prefetch setting: a registered name, or a saved predictor directory."""
    if not Path(spec).exists():
        return spec, distance or 1
    from moelab.predictors.io import load_predictor
    from moelab.predictors.prefetch import as_prefetcher

    predictor = load_predictor(spec)
    if distance is not None and distance != predictor.distance:
        raise MoelabError(
            f"--distance {distance} does not match the saved predictor {spec!r}, which predicts at distance "
            f"{predictor.distance}; drop --distance or use a predictor fitted for that distance."
        )
    return as_prefetcher(predictor, trace_dir), int(predictor.distance)


def prefetch_config(pf: dict[str, Any] | None, trace_dir: str) -> Any:
    """A :class:`moelab.caches.PrefetchConfig` from a cell's prefetch setting (None: demand caching)."""
    if not pf:
        return None
    from moelab.caches.simulation import PrefetchConfig

    predictor, distance = prefetcher(pf["predictor"], pf.get("distance"), trace_dir)
    if pf.get("link_gbps") is not None:
        return PrefetchConfig.from_link(predictor, distance, gb_per_s=pf["link_gbps"], step_ms=pf["step_ms"],
                                        latency_us=pf.get("link_latency_us") or 0.0)
    return PrefetchConfig(predictor, distance, pf.get("budget"), pf.get("budget_bytes"),
                          budget_scope=pf.get("budget_scope") or "layer")


def check_prefetch(pf: dict[str, Any]) -> None:
    """The budget rules of ``moelab cache simulate``'s prefetch flags, for a prefetch setting."""
    if pf.get("link_latency_us") is not None and pf.get("link_gbps") is None:
        raise MoelabError("--link-latency-us is the latency of the --link-gbps link: add --link-gbps and --step-ms.")
    if (pf.get("link_gbps") is None) != (pf.get("step_ms") is None):
        raise MoelabError("--link-gbps and --step-ms go together: the budget is bandwidth × step time.")
    given = [n for n in ("budget", "budget_bytes", "link_gbps") if pf.get(n) is not None]
    if len(given) > 1:
        raise MoelabError(f"give one prefetch budget, not {' and '.join('--' + g.replace('_', '-') for g in given)}.")
    if given and not pf.get("predictor"):
        raise MoelabError(f"--{given[0].replace('_', '-')} is a prefetch budget: add --prefetch PREDICTOR "
                          "(oracle, repeat or a directory).")


class CacheKind(CellKind):
    name = "cache"
    spec_keys = ("traces", "policies", "capacities", "scopes", "prefetch", "settings")

    def parse(self, r: Any, data: dict[str, Any], common: dict[str, Any]) -> TraceSweepSpec:
        r.required(data, ("traces", "policies"))
        traces = _traces(r, data["traces"], with_test=False)
        methods = _methods(r, data["policies"], ("policies",), "cache policies", "cache policy",
                           available_policies(), "policy")
        caps = r.listed(data.get("capacities", [0.125, 0.25, 0.5, 0.75]), ("capacities",), "capacities")
        for i, c in enumerate(caps):
            if isinstance(c, bool) or not isinstance(c, (int, float)) or c <= 0 or (isinstance(c, float) and c > 1):
                raise r.fail(("capacities", i), f"capacity {c!r}: expected a fraction in (0, 1] or a count ≥ 1.")
        scopes = r.listed(data.get("scopes", ["layer"]), ("scopes",), "scopes")
        for i, s in enumerate(scopes):
            if s not in SCOPES:
                raise r.fail(("scopes", i), f"unknown cache scope {s!r}.{did_you_mean(str(s), list(SCOPES))} "
                                            f"Known: {', '.join(SCOPES)}.")
        prefetch: list[dict | None] = []
        for i, pf in enumerate(r.listed(data.get("prefetch", ["none"]), ("prefetch",), "prefetch")):
            if pf in (None, "none"):
                prefetch.append(None)
                continue
            if isinstance(pf, str):
                pf = {"predictor": pf}
            r.keys(pf, ("prefetch", i), PREFETCH_KEYS, "a prefetch entry")
            pf = dict(pf)
            if isinstance(pf.get("predictor"), str) and any(c in pf["predictor"] for c in "/\\"):
                pf["predictor"] = r.path(pf["predictor"], ("prefetch", i, "predictor"), "saved predictor")
            try:
                check_prefetch(pf)
            except MoelabError as exc:
                raise r.fail(("prefetch", i), str(exc)) from None
            prefetch.append(pf)
        settings = dict(CACHE_SETTINGS)
        settings.update(r.keys(data.get("settings") or {}, ("settings",), tuple(CACHE_SETTINGS), "settings"))
        points = [{"capacity": c, "scope": s, "prefetch": pf} for pf in prefetch for s in scopes for c in caps]
        return TraceSweepSpec(kind="cache", traces=traces, methods=methods, points=points, settings=settings,
                              seeds=[0], **common)

    def expand(self, spec: TraceSweepSpec, store: Any) -> list[TraceCell]:
        from moelab.sweeps.fingerprints import path_signature

        scores = any(get_policy(m).needs_scores for m, _ in spec.methods)
        load = {"include_prefill": spec.settings["include_prefill"], "replay": spec.settings["replay"],
                "scores": scores}
        groups: dict[str, list[dict[str, Any]]] = {}  # per (prefetch, scope): its capacities, in order
        for pt in spec.points:
            groups.setdefault(json.dumps([pt["prefetch"], pt["scope"]], sort_keys=True), []).append(pt)
        cells, seen = [], set()
        for t in spec.traces:
            sig = {"trace": path_signature(t["train"])}
            model = _trace_model(t["train"])
            for group in groups.values():
                for (method, params), pt in itertools.product(spec.methods, group):
                    point = dict(pt)
                    if point["prefetch"] is not None and not get_policy(method).accepts_prefetch:
                        point["prefetch"] = None
                    sigs = dict(sig)
                    if point["prefetch"] and Path(point["prefetch"]["predictor"]).exists():
                        sigs["prefetch"] = path_signature(point["prefetch"]["predictor"])
                    cell = TraceCell(kind="cache", trace=t["train"], method=method, params=params, point=point,
                                     settings=dict(spec.settings), signatures=sigs, model=model, load=load)
                    _add_unseen(cell, seen, cells)
        return cells

    def cell_from_dict(self, d: dict[str, Any]) -> TraceCell:
        return TraceCell.from_dict(d)

    def load(self, cell: TraceCell) -> Any:
        from moelab.caches.simulation import load_stream

        return load_stream(cell.trace, cell.load["include_prefill"], scores=cell.load["scores"],
                           replay=cell.load["replay"])

    def run(self, cell: TraceCell, resource: Any, worker: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
        from moelab.caches.simulation import simulate

        s = cell.settings
        result = simulate(resource, cell.method, cell.point["capacity"], cell.point["scope"],
                          prefetch=prefetch_config(cell.point["prefetch"], cell.trace), warm=s["warm"],
                          expert_bytes=s["expert_bytes"], insertion=s["insertion"],
                          access_order=s.get("access_order", "weight"), **cell.params)
        return {"key": trace_cell_key(cell, moelab.__version__), "metrics": result.to_dict(),
                "score": result.hit_rate, "score_stderr": None, "n_docs": result.accesses,
                "versions": _versions(), "samples_path": None, "trace_path": None, "timeline_path": None}, {}

    def row(self, cell: TraceCell, record: dict[str, Any] | None) -> dict[str, Any]:
        m = (record or {}).get("metrics") or {}
        return {"trace": Path(cell.trace).name, "model": cell.model, "policy": cell.method,
                "capacity": cell.point["capacity"], "scope": cell.point["scope"],
                "prefetch": m.get("prefetch") or _short(cell.point["prefetch"]), "hit rate": m.get("hit_rate"),
                "misses": m.get("misses"), "moved (experts)": m.get("transfers"), "accesses": m.get("accesses")}


def cache_result(record: dict[str, Any]) -> Any:
    """The :class:`moelab.caches.CacheResult` a ``cache`` cell's record holds."""

    m = record["metrics"]
    return CacheResult(**{f.name: m[f.name] for f in fields(CacheResult) if f.name in m and f.name != "hit"})


# --------------------------------------------------------------------------- predictor
PREDICTOR_SETTINGS = {"m": [1, 2, 4, 8], "hardware": None, "expert_bytes": None, "layer_time_us": None,
                      "link_gbs": None, "fetch_basis": "predicted"}


class PredictorKind(CellKind):
    name = "predictor"
    spec_keys = ("traces", "predictors", "distances", "seeds", "settings")

    def parse(self, r: Any, data: dict[str, Any], common: dict[str, Any]) -> TraceSweepSpec:
        from moelab.predictors.registry import available_predictors

        r.required(data, ("traces", "predictors"))
        traces = _traces(r, data["traces"], with_test=True)
        methods = _methods(r, data["predictors"], ("predictors",), "predictors", "predictor kind",
                           available_predictors(), "predictor")
        distances = r.listed(data.get("distances", [1]), ("distances",), "distances")
        for i, d in enumerate(distances):
            r.int_or_none(d, ("distances", i), "distance", 1)
        seeds = r.listed(data.get("seeds", [0]), ("seeds",), "seeds")
        for i, s in enumerate(seeds):
            r.int_or_none(s, ("seeds", i), "seed", 0)
        settings = dict(PREDICTOR_SETTINGS)
        settings.update(r.keys(data.get("settings") or {}, ("settings",), tuple(PREDICTOR_SETTINGS), "settings"))
        if settings["hardware"] is None:
            settings["hardware"] = DEFAULT_PROFILE
        from moelab.predictors.metrics import FETCH_BASES

        if settings["fetch_basis"] not in FETCH_BASES:
            raise r.fail(("settings", "fetch_basis"), f"fetch_basis={settings['fetch_basis']!r}: expected one of "
                         f"{', '.join(FETCH_BASES)} (the fetch rate's denominator; 'predicted' is ProMoE's).")
        return TraceSweepSpec(kind="predictor", traces=traces, methods=methods,
                              points=[{"distance": d} for d in distances], settings=settings, seeds=seeds, **common)

    def expand(self, spec: TraceSweepSpec, store: Any) -> list[TraceCell]:
        from moelab.sweeps.fingerprints import path_signature
        from moelab.trace import open_trace

        cells, seen = [], set()
        for t in spec.traces:
            sigs = {"train": path_signature(t["train"])}
            if t["test"]:
                sigs["test"] = path_signature(t["test"])
            layers = open_trace(t["train"]).num_moe_layers
            model = _trace_model(t["train"])
            for pt in spec.points:
                if pt["distance"] > layers - 1:
                    log.warning("leaving out distance %d: the model has %d MoE layers", pt["distance"], layers)
                    continue
                for method, params in spec.methods:
                    for seed in spec.seeds:
                        cell = TraceCell(kind="predictor", trace=t["train"], test_trace=t["test"], method=method,
                                         params=params, point=dict(pt), settings=dict(spec.settings), seed=seed,
                                         signatures=sigs, model=model)
                        _add_unseen(cell, seen, cells)
        return cells

    def cell_from_dict(self, d: dict[str, Any]) -> TraceCell:
        return TraceCell.from_dict(d)

    def load(self, cell: TraceCell) -> Any:
        from moelab.predictors.base import as_trace_data

        train = as_trace_data(cell.trace)
        return train, (as_trace_data(cell.test_trace) if cell.test_trace else train)

    def run(self, cell: TraceCell, resource: Any, worker: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
        import numpy as np
        import torch

        from moelab.predictors.metrics import evaluate
        from moelab.predictors.registry import make_predictor

        train, test = resource
        torch.manual_seed(cell.seed)
        np.random.seed(cell.seed)
        s = cell.settings
        predictor = make_predictor(cell.method, distance=cell.point["distance"], **cell.params).fit(train)
        eb = reference_expert_bytes(s["expert_bytes"]) if s["expert_bytes"] else None
        report = evaluate(predictor, test, m_values=list(s["m"]), hardware=s["hardware"], expert_bytes=eb,
                          layer_time_us=s["layer_time_us"], link_bandwidth_gbs=s["link_gbs"],
                          fetch_basis=s.get("fetch_basis", "predicted"))
        overall = report.overall["all"]
        return {"key": trace_cell_key(cell, moelab.__version__), "metrics": report.to_dict(),
                "score": overall.get("accuracy"), "score_stderr": overall.get("accuracy_stderr"),
                "n_docs": overall.get("pairs"), "versions": _versions(), "samples_path": None, "trace_path": None,
                "timeline_path": None}, {}

    def row(self, cell: TraceCell, record: dict[str, Any] | None) -> dict[str, Any]:
        r = record or {}
        o = ((r.get("metrics") or {}).get("overall") or {}).get("all") or {}
        return {"trace": Path(cell.trace).name, "model": cell.model, "predictor": cell.method,
                "distance": cell.point["distance"], "seed": cell.seed, "accuracy": r.get("score"),
                "stderr": r.get("score_stderr"), "fetch rate": o.get("fetch_rate"), "goodpred": o.get("goodpred"),
                "pairs": r.get("n_docs"), "latency_us": (r.get("metrics") or {}).get("latency_us")}


def _versions() -> dict[str, str]:
    import platform

    import numpy as np

    return {"moelab": moelab.__version__, "numpy": np.__version__, "python": platform.python_version()}


CACHE = CacheKind()
PREDICTOR = PredictorKind()
