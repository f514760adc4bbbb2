"""What-if grids: a hybrid configuration grid simulated on any model shape and hardware profile.

>>> df = whatif("deepseek-v3", "h100-pcie5-ddr5", synthetic=True, steps=16, context=1024,
...             grid=["capacity=0,4e,8e", "deferral=0,2", "placement=host-misses"])

Every cell of the grid (the product of its axes) is planned by the offline planner
(:func:`moelab.hybrid.offline.plan_routing`, the same planner as a running model) and its
plans simulated (:func:`moelab.simulate.executor.simulate_plans`). Beside every cell runs its
**oracle bound**: the same capacity, deferral and placement with Belady's MIN cache (it reads
the future of the routing) and the oracle prefetch (the experts the next MoE layer actually
needs). The bound is the best of :data:`ORACLE_VARIANTS` — Belady inserting every miss or
Belady with bypass, each without and with the oracle prefetch — because on a slow link
inserting or prefetching every needed expert congests the copy engine (an oracle would not);
its ``oracle_variant`` column names the winner. Belady minimises misses, not time, so the
bound is empirical, not a theorem: tests/test_simulate_whatif.py checks that it bounds the
policy column at every cell of a grid, and a cell where it does not would be worth a look.

Routing comes from a recorded trace (``trace=``; its experts, top-k and MoE layers must match
the shape) or is synthetic (``synthetic=True``): :func:`moelab.simulate.synthetic.synthetic_routing`
with statistics fitted from ``fit_from`` (a trace), by default from a trace recorded on the
fly from the bundled ``moelab-tiny-mixtral`` (fitted once, cached in
``~/.cache/moelab/simulate``). The statistics assumed are in ``df.attrs["routing_stats"]``.

Grid axes (:data:`AXES`): ``capacity`` (each layer's experts on the device, with its unit: ``8e``
a count, ``25%`` or ``0.25`` a fraction, ``0`` none; a bare ``1`` is refused as ambiguous; from
Python an int is a count and a float a fraction), ``deferral`` (deferred experts per token),
``placement`` (``host-misses``, ``fetch-misses``, ``greedy-hss``, ``min-cost``), ``policy`` (the
cache policy of the policy column; default ``lru``; ``static`` pins each layer's most used experts
of the warm-up steps, :func:`static_counts`), ``prefetch`` (``none``, ``oracle``, ``repeat``,
``activation``: the policy column's prefetch source), ``skipping``, ``min_immediate`` (experts per token deferral keeps; 2),
``select`` (how the planner picks among a prefetch proposal, ``prefetch.select``: ``impact``,
HybriMoE's impact-driven choice within the lead time, the default; ``order``, ProMoE's, the
proposal in order within the budget), ``chunks`` (low-priority copies in that many chunks,
ProMoE's yielding copies: ``prefetch.chunks``; 1, whole copies, by default). The oracle bound
selects and copies as its cell does.

Memory: every cell is held to the profile's ``gpu_memory_gb`` and ``host_memory_gb``
(:func:`moelab.timing.memory.memory_needs`: dense weights, the KV cache at ``context + warmup +
steps`` tokens × ``batch``, the cell's expert slots, a workspace; all routed experts on the host).
A cell that does not fit is not simulated; its ``refused`` column carries the numbers and the fix.

The hardware may be a name, a file (``base:`` + overrides) or a
:class:`~moelab.timing.profile.HardwareProfile` object (``with_changes``, ``--set``); the same
object reaches the planner's cost model and the simulator.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import moelab
from moelab._output import write_file_atomic
from moelab.caches import available_policies, get_policy
from moelab.caches.activation import NAME as ACTIVATION
from moelab.caches.prefetch import PREFETCH_SELECTIONS, routing_kinds
from moelab.errors import MoelabError, did_you_mean
from moelab.prompts import DEMO_PROMPTS
from moelab.timing import get_profile
from moelab.timing.memory import MemoryDoesNotFit, memory_needs
from moelab.timing.shapes import ModelShape, get_shape

log = logging.getLogger(__name__)

DEFAULT_FIT_MODEL = "moelab-tiny-mixtral"
STALL_CAUSES = ("copy", "device", "host", "deferred")


_CAPACITY_UNITS = ("give a count of experts per MoE layer with an `e` (capacity=1e, 8e) or a fraction of them "
                   "with `%` or a decimal point (capacity=25%, 0.25, 1.0 = all)")


def _capacity(text: str, key: str) -> float | int:
    """``8e`` → 8 experts per layer (int); ``25%`` or ``0.25`` → a fraction (float); ``0`` → none.
    A bare integer such as ``1`` is refused: one expert per layer, or all of them?"""
    t = text.strip().lower()
    try:
        if t.endswith("e") and t[:-1].isdigit():
            v: float | int = int(t[:-1])
            if v < 1:
                raise ValueError
            return v
        if t.endswith("%"):
            v = float(t[:-1]) / 100
        elif t.lstrip("+").isdigit():
            if float(t) == 0:
                return 0
            raise MoelabError(f"grid {key}={text!r} is ambiguous (one expert per layer, or all?); "
                              f"{_CAPACITY_UNITS}.")
        else:
            v = float(t)
    except ValueError:
        raise MoelabError(f"grid {key}={text!r}: not a capacity; {_CAPACITY_UNITS}.") from None
    if not 0.0 <= v <= 1.0:
        raise MoelabError(f"grid {key}={text}: a fraction must be in [0, 1] (0 %..100 %); for a count of experts "
                          f"per layer write it with `e` (e.g. {key}={max(1, round(v))}e).")
    return v


def capacity_label(c: float | int) -> str:
    """A capacity as the grid spells it: ``8e`` (a count), ``0.25`` (a fraction), ``0``."""
    if isinstance(c, (bool, float)) or not c:
        return f"{c:g}"
    return f"{int(c)}e"


def _int(text: str, key: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise MoelabError(f"grid {key}={text!r}: expected a whole number (e.g. {key}=0,2,3).") from None
    if v < 0:
        raise MoelabError(f"grid {key}={v}: expected ≥ 0.")
    return v


def _chunks(text: str, key: str) -> int:
    v = _int(text, key)
    if v < 1:
        raise MoelabError(f"grid {key}={v}: expected ≥ 1 chunks per low-priority copy (1: whole experts; 3: ProMoE's "
                          "per-projection chunks).")
    return v


def _select(text: str, key: str) -> str:
    if text not in PREFETCH_SELECTIONS:
        raise MoelabError(f"grid {key}={text!r} is not a prefetch selection;{did_you_mean(text, PREFETCH_SELECTIONS)} "
                          f"expected one of {', '.join(PREFETCH_SELECTIONS)}.")
    return text


def _placement(text: str, key: str) -> str:
    from moelab.hybrid.placement import PLACEMENTS

    if text not in PLACEMENTS:
        raise MoelabError(f"grid {key}={text!r} is not a placement;{did_you_mean(text, list(PLACEMENTS))} "
                          f"expected one of {', '.join(PLACEMENTS)}.")
    return text


def _policy(text: str, key: str) -> str:
    names = available_policies()
    if text not in names:
        raise MoelabError(f"grid {key}={text!r} is not a cache policy;{did_you_mean(text, names)} "
                          f"expected one of {', '.join(names)}.")
    return text


def _prefetch(text: str, key: str) -> str:
    names = ["none", *sorted(routing_kinds()), ACTIVATION]
    if text not in names:
        raise MoelabError(f"grid {key}={text!r} is not a prefetch source;{did_you_mean(text, names)} "
                          f"expected one of {', '.join(names)} (none: no prefetch).")
    return text


#: Grid axes and how one value of each is parsed.
AXES = {"capacity": _capacity, "deferral": _int, "placement": _placement, "policy": _policy, "skipping": _int,
        "min_immediate": _int, "prefetch": _prefetch, "select": _select,
        "chunks": _chunks}
DEFAULTS = {"capacity": [0.25], "deferral": [0], "placement": ["host-misses"], "policy": ["lru"], "skipping": [0],
            "min_immediate": [2], "prefetch": ["none"], "select": ["impact"],
            "chunks": [1]}


def parse_grid(items: list[str] | dict[str, Any] | None) -> dict[str, list]:
    """``["capacity=0.1,0.25", "deferral=0,2"]`` (or a dict of lists) → the grid's axes, with
    the defaults (:data:`DEFAULTS`) for axes not given."""
    grid: dict[str, list] = {}
    if isinstance(items, dict):
        pairs = [(k, v if isinstance(v, (list, tuple)) else [v]) for k, v in items.items()]
    else:
        pairs = []
        for item in items or []:
            if "=" not in item:
                raise MoelabError(f"grid item {item!r}: expected AXIS=V1,V2,... (e.g. capacity=0.1,0.25); "
                                  f"axes: {', '.join(AXES)}.")
            k, v = item.split("=", 1)
            pairs.append((k.strip(), [x.strip() for x in v.split(",") if x.strip()]))
    for k, vals in pairs:
        if k not in AXES:
            raise MoelabError(f"grid axis {k!r} is not known;{did_you_mean(k, list(AXES))} axes: {', '.join(AXES)}.")
        if not vals:
            raise MoelabError(f"grid axis {k!r} has no values, so the grid has no cells; give at least one "
                              f"(e.g. {k}={DEFAULTS[k][0]}).")
        parsed = [AXES[k](str(v), k) if isinstance(v, str) else v for v in vals]
        if k == "capacity":
            for c in parsed:
                if isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0:
                    raise MoelabError(f"grid capacity={c!r}: {_CAPACITY_UNITS}; from Python an int is a count, "
                                      "a float a fraction.")
        grid[k] = list(dict.fromkeys(parsed))
    return {k: grid.get(k, list(DEFAULTS[k])) for k in AXES}


def check_grid(grid: dict[str, list], shape: Any) -> None:
    """Refuse grid values ``shape`` cannot have, before anything is simulated: a capacity above
    one layer's experts (or a fraction above 1), more experts deferred or skipped per token than
    its top-k."""
    E, K = int(shape.num_experts), int(shape.top_k)
    for c in grid.get("capacity", []):
        if isinstance(c, float) and c > 1:
            raise MoelabError(f"grid capacity={c!r}: a fraction must be in [0, 1]; for a number of experts per "
                              f"layer give a count 1e..{E}e (e.g. capacity={min(E, max(1, round(c)))}e).")
        if isinstance(c, int) and c > E:
            raise MoelabError(f"grid capacity={c}e: {shape.name} has {E} experts per MoE layer; use a count ≤ {E}e "
                              "or a fraction in [0, 1].")
    for axis in ("deferral", "skipping", "min_immediate"):
        bad = [v for v in grid.get(axis, []) if v > K]
        if bad:
            raise MoelabError(f"grid {axis}={bad[0]}: {shape.name} routes each token to {K} experts, so at most "
                              f"{K} can be {'deferred' if axis == 'deferral' else 'skipped' if axis == 'skipping' else 'immediate'}; "
                              f"use values 0..{K}.")


def cells(grid: dict[str, list]) -> list[dict[str, Any]]:
    keys = list(grid)
    out = [dict(zip(keys, vals)) for vals in itertools.product(*(grid[k] for k in keys))]
    if not out:
        raise MoelabError("the grid has no cells; give every axis at least one value.")
    return out


# ---------------------------------------------------------------------- routing
def _cache_dir() -> Path:
    import os

    return Path(os.environ.get("MOELAB_CACHE", Path.home() / ".cache" / "moelab")) / "simulate"


def default_routing_stats(model: str = DEFAULT_FIT_MODEL, *, max_new_tokens: int = 32, progress: bool = False):
    """:class:`~moelab.simulate.synthetic.RoutingStats` fitted from a trace recorded now from the
    bundled ``model`` on the demo prompts (greedy, ``max_new_tokens``); cached on disk by moelab
    version, model and settings (the recording takes ~half a minute on 2 cores)."""
    from moelab.simulate.synthetic import RoutingStats, fit_routing_stats

    path = _cache_dir() / f"stats-{model}-{moelab.__version__}-{max_new_tokens}.json"
    if path.is_file():
        try:
            return RoutingStats.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError) as e:  # a stale or damaged cache: record again
            log.warning("ignoring %s (%s)", path, e)
    import tempfile

    from moelab.trace.run import trace_prompts

    m, tok = moelab.load(model)
    with tempfile.TemporaryDirectory() as d:
        tr = trace_prompts(m, tok, list(DEMO_PROMPTS), Path(d) / "trace", max_new_tokens=max_new_tokens,
                           progress=progress, model_name=model)
        stats = fit_routing_stats(tr)

    write_file_atomic(path, json.dumps(stats.to_dict(), default=str))
    return stats


@dataclass
class Routing:
    """The routing a grid runs on, and where it came from."""

    forwards: list
    source: str
    stats: Any = None
    """The statistics assumed (synthetic routing), or None."""
    generated_stats: Any = None
    """The statistics measured on the generated routing (how well the generator met them)."""
    notes: list[str] = field(default_factory=list)


def load_routing(shape: Any, *, trace: Any = None, synthetic: bool = False, fit_from: Any = None, steps: int = 32,
                 batch: int = 1, seed: int = 0, calibrate_synthetic: bool = False, stats: Any = None,
                 scores: bool = False) -> Routing:
    """A trace's first ``steps`` decode forwards (and the prefills before them), or synthetic
    routing of ``batch`` sequences × ``steps`` decode steps (``scores``: with synthesised router
    scores, :func:`moelab.simulate.synthetic.router_scores`, for score-reading caches such as ``mrs``).

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    from moelab.simulate.synthetic import check_trace_shape, fit_routing_stats, synthetic_routing

    if (trace is None) == (not synthetic):
        raise MoelabError("give a routing source: a trace (--trace DIR) or --synthetic, not both or neither.")
    if trace is not None:
        from moelab.hybrid.offline import routing_from_trace
        from moelab.trace import open_trace

        tr = open_trace(trace) if isinstance(trace, (str, Path)) else trace
        check_trace_shape(tr, shape)
        out, dec = [], 0
        for r in routing_from_trace(tr, hidden=False):
            if r.phase == "decode":
                if dec >= steps:
                    break
                dec += 1
            out.append(r)
        return Routing(out, f"trace {tr.path} ({dec} decode forwards)")
    if stats is not None:
        src = f"given ({stats.source or 'RoutingStats'})"
    elif fit_from is not None:
        stats = fit_routing_stats(fit_from)
        src = f"fitted from {fit_from}"
    else:
        stats = default_routing_stats()
        src = f"fitted from a trace of the bundled {DEFAULT_FIT_MODEL} (demo prompts, 32 new tokens)"
    fw = synthetic_routing(shape, stats, steps=steps, batch=batch, prompt_len=0, seed=seed,
                           calibrate=calibrate_synthetic, scores=scores)
    notes = [] if calibrate_synthetic else [
        "the generator's reuse/adjacency bonuses are a first guess (not calibrated): pass "
        "--calibrate-synthetic to fit them to the statistics (minutes on DeepSeek-V3 shapes)"]
    if scores:
        notes.append("router scores are synthesised (the top-k in the ratio of their weights, the rest from the "
                     "layer's popularity plus noise; moelab.simulate.synthetic.router_scores)")
    gen = None
    if steps >= 2:
        try:
            gen = fit_routing_stats(fw, num_experts=shape.num_experts, seed=seed)
        except MoelabError as e:  # too little routing to measure
            notes.append(f"statistics of the generated routing not measured: {e}")
    return Routing(fw, f"synthetic ({batch} sequence(s) × {steps} decode steps, seed {seed}); statistics {src}",
                   stats, gen, notes)


# ---------------------------------------------------------------------- one cell
def static_counts(forwards: list, shape: Any, warmup: int) -> tuple[np.ndarray, str]:
    """Per-expert access counts (key ``layer × E + expert``) that pin the ``static`` policy's experts,
    and where they come from: the first ``warmup`` decode forwards (the steps not measured), or all
    forwards when there is no warm-up (then the pinned set has seen the measured routing)."""
    E, L = int(shape.num_experts), int(shape.num_moe_layers)
    dec = [r for r in forwards if r.phase == "decode"]
    src = dec[:warmup] if warmup else forwards
    counts = np.zeros(E * L, dtype=np.int64)
    for r in src:
        for ly, ids in enumerate(r.ids):
            ids = np.asarray(ids).reshape(-1)
            ids = ids[ids >= 0]
            counts += np.bincount(ly * E + ids, minlength=E * L)[: E * L]
    what = (f"static pins each layer's most used experts in the {len(src)} warm-up decode forwards" if warmup else
            "static pins each layer's most used experts over the whole routing (no warm-up: it has seen the "
            "measured steps)")
    return counts, what


def _config(cell: dict, hardware: Any, *, oracle: bool, prefetch: bool, cache: str | None = None,
            cache_options: dict | None = None) -> dict:
    """The cell as a hybrid configuration; ``hardware`` is the profile object itself, so the planner's
    cost model sees the same profile (``--set``, ``with_changes``) as the simulator."""
    source = cell.get("prefetch", "none")
    predictor = "oracle" if prefetch else None if oracle or source == "none" else source
    policy = cache or ("belady" if oracle else cell["policy"])
    return {
        "cache": {"capacity": cell["capacity"], "policy": policy,
                  "options": dict(cache_options or {}) if policy == "static" else {}},
        "placement": cell["placement"],
        "hardware": hardware,
        "routing": {"deferred": cell["deferral"], "skipped": cell["skipping"],
                    "min_immediate": cell.get("min_immediate", 2)},
        "prefetch": {"predictor": predictor, "select": cell.get("select", "impact"), "chunks": int(cell.get("chunks", 1))},
    }


def simulate_cell(routing: list, shape: Any, hardware: Any, profile: Any, cell: dict, *, context: int,
                  oracle: bool = False, prefetch: bool = False, warmup: int = 0, cache: str | None = None,
                  routing_memo: dict | None = None, cache_options: dict | None = None, warm: str = "frequency") -> dict:
    """Plan and simulate one configuration; tokens/s, decode step time, stalls (s), busy % over
    the decode forwards after the first ``warmup``. The caches start ``warm`` (``cache.warm``:
    ``frequency`` by default, counted over the warm-up forwards — over all of them when there is no
    warm-up — so a capacity of 1.0 holds every expert those steps need; ``empty``: cold).
    ``routing_memo``: see :func:`moelab.hybrid.offline.plan_routing` (one dict per routing source).

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    from moelab.hybrid.offline import plan_routing
    from moelab.simulate.executor import simulate_plans, summarize_sim

    L = shape.num_moe_layers
    cfg = _config(cell, hardware, oracle=oracle, prefetch=prefetch, cache=cache, cache_options=cache_options)
    if cfg["cache"]["policy"] == "static" and "profile" not in cfg["cache"]["options"]:
        cfg["cache"]["options"]["profile"] = static_counts(routing, shape, warmup)[0]
    cfg["cache"]["warm"] = warm
    plans = plan_routing(routing, cfg,
                         num_experts=[shape.num_experts] * L, top_k=[shape.top_k] * L,
                         expert_bytes=shape.expert_bytes(), shape=shape,
                         routing_memo=routing_memo, warm_routing=_warmup_forwards(routing, warmup))
    res = simulate_plans(plans, shape, profile, context=context, copy_chunks=int(cell.get("chunks", 1)))
    fw, ev = res.forwards, res.events
    dec = fw[fw["phase"] == "decode"]
    if warmup and len(dec) > warmup:
        keep = dec["forward"].to_numpy()[warmup:]
        fw = fw[fw["forward"].isin(keep)]
        ev = ev[ev["step"].isin(keep)]
    s = summarize_sim(ev, fw)
    out = {"tokens_per_s": s.get("decode_tokens_per_s", float("nan")),
           "step_ms": s.get("decode_step_us", float("nan")) / 1e3}
    for c in STALL_CAUSES:
        out[f"stall_{c}_s"] = s["stall_us"].get(c, 0.0) / 1e6
    for lane, pct in s["busy_pct"].items():
        out[f"busy_{lane}_pct"] = pct
    return out


def _warmup_forwards(routing: list, warmup: int) -> list | None:
    """The forwards up to the ``warmup``-th decode forward (the steps not measured), or None (all)."""
    if not warmup:
        return None
    n = 0
    for i, r in enumerate(routing):
        n += r.phase == "decode"
        if n == warmup:
            return routing[: i + 1]
    return None


#: The oracle's variants: Belady's MIN (inserting every miss, or bypassing the cache where the
#: expert's next use is farther than every resident's), each without and with the oracle prefetch.
ORACLE_VARIANTS = (("belady", False), ("belady-bypass", False), ("belady", True), ("belady-bypass", True))


def _oracle(routing, shape, hardware, profile, cell, context, warmup, memo=None) -> dict:
    """The best of :data:`ORACLE_VARIANTS` at this cell (prefetch needs a device cache)."""
    best = None
    for cache, prefetch in ORACLE_VARIANTS:
        if prefetch and not cell["capacity"]:
            continue
        r = simulate_cell(routing, shape, hardware, profile, cell, context=context, oracle=True, prefetch=prefetch,
                          warmup=warmup, cache=cache, routing_memo=memo)
        if best is None or r["tokens_per_s"] > best["tokens_per_s"]:
            best = {**r, "variant": cache + (" + oracle prefetch" if prefetch else "")}
    return best


# ---------------------------------------------------------------------- the grid
def refusal(cell: dict, shape: Any, profile: Any, *, context: int, batch: int, kv_on_host: bool = False,
            check_memory: bool = True) -> tuple[str, Any]:
    """(why this cell cannot run, or "", its :class:`~moelab.timing.memory.MemoryNeeds`): a prefetch
    with no device cache to prefetch into, or memory that does not fit (:mod:`moelab.timing.memory`)."""
    needs = memory_needs(shape, profile, capacity=cell["capacity"], context=context, batch=batch,
                         kv_on_host=kv_on_host)
    if cell.get("prefetch", "none") != "none" and not cell["capacity"]:
        return "prefetch needs a device cache to prefetch into; capacity is 0", needs
    if check_memory and needs.problems:
        return " ".join(needs.problems), needs
    return "", needs


def whatif(shape: Any, hardware: Any, *, trace: Any = None, synthetic: bool = False, fit_from: Any = None,
           steps: int = 16, warmup: int = 16, batch: int = 1, context: int = 1024, grid: Any = None,
           oracle: bool = True,
           seed: int = 0, calibrate_synthetic: bool = False, stats: Any = None, routing: Routing | None = None,
           progress: bool = False, check_memory: bool = True, kv_on_host: bool = False):
    """Simulate every cell of ``grid`` (see :func:`parse_grid`) on ``shape`` (a name, config
    path or :class:`~moelab.timing.shapes.ModelShape`) and ``hardware`` (a profile name, file or
    :class:`~moelab.timing.profile.HardwareProfile`); returns a pandas DataFrame, one row per cell:
    the axes, ``tokens_per_s``, ``step_ms``, ``stall_<cause>_s`` (control-thread waits over the
    run, by what held them up) and ``busy_<lane>_pct``, the oracle bound's ``oracle_*`` columns,
    and its memory: ``gpu_need_gb``, ``host_need_gb``, ``fits``, ``refused``. ``df.attrs`` holds the
    routing's source and statistics and the wall time.

    A cell that does not fit in the profile's GPU or host memory (:func:`moelab.timing.memory.check_memory`,
    at the KV cache of ``context + warmup + steps`` tokens; ``kv_on_host`` keeps it in host memory) is
    not simulated: its ``refused`` column says why, with the numbers, and its timings are NaN;
    ``check_memory=False`` simulates it anyway. If every cell is refused, the first refusal is raised.

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    import pandas as pd
    from tqdm.auto import tqdm


    t0 = time.perf_counter()
    shape = shape if isinstance(shape, ModelShape) else get_shape(shape)
    profile = get_profile(hardware)
    for name, v, low in (("steps", steps, 1), ("warmup", warmup, 0), ("batch", batch, 1), ("context", context, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise MoelabError(f"{name} is {v!r}; expected an integer ≥ {low}.")
    axes = parse_grid(grid)
    check_grid(axes, shape)
    todo = cells(axes)
    verdicts = [refusal(c, shape, profile, context=context + warmup + steps, batch=batch, kv_on_host=kv_on_host,
                        check_memory=check_memory) for c in todo]
    if all(why for why, _ in verdicts):  # nothing to simulate: say why now, before the routing is made
        why, needs = verdicts[0]
        msg = why if len(todo) == 1 else f"every cell of the grid is refused; the first: {why}"
        raise MemoryDoesNotFit(msg, needs) if needs.problems and check_memory else MoelabError(msg)
    if routing is None:
        needs_scores = any(get_policy(p).needs_scores for p in axes["policy"])
        routing = load_routing(shape, trace=trace, synthetic=synthetic, fit_from=fit_from, steps=warmup + steps,
                               batch=batch, seed=seed, calibrate_synthetic=calibrate_synthetic, stats=stats,
                               scores=needs_scores)
    t_routing = time.perf_counter() - t0
    rows = []
    memo: dict = {}  # the routing policies' slot states, computed once per setting for the whole grid
    for cell, (why, needs) in tqdm(list(zip(todo, verdicts)), desc="what-if", unit="cell", disable=not progress):
        row = dict(cell)
        row.update(gpu_need_gb=needs.gpu.need_bytes / 1e9, host_need_gb=needs.host.need_bytes / 1e9,
                   fits=needs.fits, refused=why)
        if why:
            row.update(tokens_per_s=float("nan"), step_ms=float("nan"))
            rows.append(row)
            continue
        row.update(simulate_cell(routing.forwards, shape, profile, profile, cell, context=context, warmup=warmup,
                                 routing_memo=memo))
        if oracle:
            row.update({f"oracle_{k}": v for k, v in _oracle(routing.forwards, shape, profile, profile, cell,
                                                             context, warmup, memo).items()})
        rows.append(row)
    df = pd.DataFrame(rows)
    df["capacity"] = pd.Series([r["capacity"] for r in rows], dtype=object)  # 8 (a count) stays apart from 8.0
    wall = time.perf_counter() - t0
    df.attrs.update({
        "shape": shape.name, "hardware": profile.name, "context": context, "steps": steps, "warmup": warmup,
        "batch": batch,
        "routing_source": routing.source, "routing_stats": routing.stats, "generated_stats": routing.generated_stats,
        "notes": list(routing.notes) + sorted({n for _, needs in verdicts for n in needs.notes}),
        "wall_s": wall, "routing_s": t_routing, "cells": len(todo),
        "refused": sum(bool(why) for why, _ in verdicts), "profile": profile, "kv_on_host": kv_on_host,
    })
    return df


def brief_stats(stats: Any) -> str:
    """One line: the layer means of a :class:`RoutingStats`' skew, reuse and adjacency lifts."""
    def mean(xs):
        a = np.asarray(xs, dtype=float)
        return float(np.nanmean(a)) if np.isfinite(a).any() else float("nan")

    return (f"E={stats.num_experts}, K={stats.top_k}, {stats.num_layers} MoE layers: mean Zipf s "
            f"{mean(stats.skew):.3f}, reuse {mean(stats.reuse):.3f} (lift {mean(stats.reuse_lift):+.3f}), "
            f"adjacent {mean(stats.adjacent):.3f} (lift {mean(stats.adjacent_lift):+.3f})")


def format_table(df) -> str:
    """The grid as text: per cell tokens/s and stalls (s), each with its oracle bound in brackets."""
    axes = [k for k in AXES if k in df.columns and (df[k].nunique() > 1 or k in ("capacity", "deferral",
                                                                                 "placement"))]
    oracle = "oracle_tokens_per_s" in df.columns
    axes += [k for k in ("prefetch",) if k in df.columns and k not in axes and (df[k] != "none").any()]
    head = [*axes, "tok/s", *(f"{c} s" for c in STALL_CAUSES)]
    lines = []
    refused: dict[str, list[str]] = {}
    for _, r in df.iterrows():
        vals = [capacity_label(r[k]) if k == "capacity" else f"{r[k]:g}" if isinstance(r[k], (float, np.floating))
                else str(r[k]) for k in axes]
        why = r.get("refused", "") if "refused" in df.columns else ""
        if isinstance(why, str) and why:
            refused.setdefault(why, []).append(" ".join(f"{k}={v}" for k, v in zip(axes, vals)))
            lines.append(vals + ["refused"] + ["-"] * len(STALL_CAUSES))
            continue

        def pair(col, fmt, r=r):
            v = fmt.format(r[col])
            return f"{v} ({fmt.format(r['oracle_' + col])})" if oracle else v

        vals.append(pair("tokens_per_s", "{:.2f}"))
        vals += [pair(f"stall_{c}_s", "{:.3f}") for c in STALL_CAUSES]
        lines.append(vals)
    widths = [max(len(h), *(len(v[i]) for v in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    out += ["  ".join(v.rjust(w) for v, w in zip(vals, widths)) for vals in lines]
    if oracle:
        out.append("(in brackets: the oracle bound — the best of Belady's MIN with or without bypass, with or "
                   "without the oracle prefetch, same capacity, deferral and placement; stalls: control-thread "
                   "waits summed over the measured steps, by what held them up)")
    for why, where in refused.items():
        out.append(f"refused ({len(where)} cell{'s' if len(where) > 1 else ''}: {'; '.join(where)}): {why}")
    return "\n".join(out)


__all__ = ["AXES", "Routing", "brief_stats", "capacity_label", "cells", "default_routing_stats", "format_table",
           "load_routing", "parse_grid", "refusal", "simulate_cell", "whatif"]


class _CallableModule(__import__("types").ModuleType):
    """``moelab.simulate.whatif(...)`` calls :func:`whatif` even after this module was imported
    (importing a submodule binds its name on the package, over the lazy function)."""

    def __call__(self, *args: Any, **kwargs: Any):
        return whatif(*args, **kwargs)


__import__("sys").modules[__name__].__class__ = _CallableModule
