"""Simulated latency of a sweep cell: its own routing trace, planned and simulated on hardware profiles.

An ``eval`` spec that lists ``hardware:`` profiles gives every accuracy point a speed beside
it. The cell records the routing trace of its evaluation (kept in the store when the spec asks
for ``artifacts: {trace: true}``, else in a temporary folder), then for each profile:

1. **plans**: :func:`moelab.hybrid.offline.plan_routing` of the trace
   (:func:`~moelab.hybrid.offline.routing_from_trace`) under a hybrid configuration — a
   ``hybrid`` cell's own; for a routing-policy cell (``none``, ``deferral``, ``skipping``, ...)
   the spec's ``simulate: {hybrid: ...}`` (default :data:`DEFAULT_HYBRID`: no device expert
   cache, every routed expert runs on the host — KTransformers with an empty GPU expert set,
   where deferral overlaps host experts with the next layer and skipping removes host work),
   with the cell's own policy object (its settings and guards) as the routing policy. Where
   the configuration names no ``hardware``, its placement's cost model uses the simulated
   profile.
2. **shape**: the loaded model's (:meth:`ModelShape.from_model`), or the spec's
   ``simulate: {model_shape: ...}`` override, so a tiny model's routing is costed at a real
   model's layer sizes (:func:`resolve_shape`). The trace's experts per layer, top-k and MoE
   layer count must equal the shape's; otherwise the cell fails with one line naming the fix.
3. **simulation**: :func:`moelab.simulate.simulate_plans`, one sequence at a time (a prefill
   forward and the decode forwards after it, from context 0: an evaluation's documents are
   independent prompts, so attention does not grow over the whole sweep), the sequences
   placed end to end; :func:`moelab.simulate.executor.summarize_sim` of all their events.

**Throughput** (``simulate: {schedule: moegen, prompt: 512, generate: 256}``): instead of the
per-sequence simulation, each profile's figure is MoE-Gen's offline-batch decode throughput
(:func:`moelab.simulate.moegen.plan_throughput`: tokens/s at the best batch the memory allows) for
the cell's shape, with the routed experts a token runs taken from the cell's own plans (fewer under
skipping; deferral changes when, not what) — :func:`throughput_figures`. The record's
``tokens_per_s_basis`` is then ``moegen``, and the report's axis says so.

``latency[profile]`` (:func:`figures`) holds ``tokens_per_s`` (decode tokens over decode time;
prefill tokens over prefill time for a task with no decode steps, ``tokens_per_s_basis`` says
which), ``decode_step_ms``, ``prefill_ms``, ``wall_ms``, lane busy %, overlap %, stalls by cause,
and the settings that produced them (profile fields and provenance, hybrid configuration,
shape, moelab version). All of them enter the cell hash (:func:`key`), so editing a profile
recomputes its cells.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import moelab
from moelab.errors import MoelabError, did_you_mean
from moelab.simulate.moegen import plan_throughput
from moelab.timing import get_profile
from moelab.timing.shapes import ModelShape, get_shape

log = logging.getLogger(__name__)

#: The hybrid configuration a routing-policy cell is costed under (``simulate: {hybrid: ...}``).
DEFAULT_HYBRID: dict[str, Any] = {"cache": {"capacity": 0}, "placement": "host-misses"}
#: Bumped when the meaning of the figures changes (their cells then recompute).
METHOD = "per-sequence simulate_plans v1"
_SHAPE_KEY = "shape"


# --------------------------------------------------------------------------- settings
def hybrid_settings(data: Any) -> dict[str, Any]:
    """The full HybridConfig dict of a ``simulate: {hybrid: ...}`` mapping (None: the default)."""
    from moelab.hybrid.config import HybridConfig

    cfg = HybridConfig.from_dict(DEFAULT_HYBRID if data is None else data, where="simulate.hybrid")
    return cfg.to_dict()


#: Schedules a cell's speed can be simulated with (``simulate: {schedule: ...}``).
SCHEDULES = ("per-sequence", "moegen")


def schedule_settings(name: Any, prompt: Any = None, generate: Any = None) -> dict[str, Any]:
    """``{name, prompt, generate}`` of a ``simulate: {schedule: ...}`` block ({} for the default
    per-sequence simulation); refuses unknown names and non-positive lengths."""
    if name in (None, "per-sequence"):
        if prompt is not None or generate is not None:
            raise MoelabError("prompt/generate are the throughput schedule's lengths; set schedule: moegen too, or "
                              "remove them.")
        return {}
    if name not in SCHEDULES:
        raise MoelabError(f"schedule {name!r}: expected one of {', '.join(SCHEDULES)}.{did_you_mean(str(name), SCHEDULES)}")
    out = {"name": str(name), "prompt": 512 if prompt is None else prompt, "generate": 256 if generate is None else generate}
    for k in ("prompt", "generate"):
        v = out[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MoelabError(f"{k}={v!r}: expected a positive number of tokens (MoE-Gen's setting: prompt 512, "
                              "generate 256).")
    return out


def resolve_shape(override: dict[str, Any]) -> Any:
    """A :class:`~moelab.simulate.ModelShape` from an override ``{shape: NAME, field: value, ...}``:
    the packaged shape (``moelab shapes``) with those fields replaced. ``num_layers`` alone keeps
    the shape's MoE layers below it (``{shape: mixtral-8x7b, num_layers: 4}``: four Mixtral-8x7B
    layers, for a 4-layer tiny model's routing)."""

    if not isinstance(override, dict) or not isinstance(override.get(_SHAPE_KEY), str):
        raise MoelabError(f"model_shape {override!r}: expected a shape name or {{shape: NAME, field: value, ...}}.")
    base = get_shape(override[_SHAPE_KEY])
    changes = {k: v for k, v in override.items() if k != _SHAPE_KEY}
    names = [f.name for f in dataclasses.fields(ModelShape) if f.name not in ("name", "source", "extra")]
    for k in changes:
        if k not in names:
            raise MoelabError(f"model_shape: unknown field {k!r}.{did_you_mean(k, names)} Known: {', '.join(names)}.")
    if "moe_layers" in changes:
        changes["moe_layers"] = tuple(changes["moe_layers"])
    elif "num_layers" in changes:
        changes["moe_layers"] = tuple(i for i in base.moe_layers if i < int(changes["num_layers"]))
    try:
        shape = dataclasses.replace(base, **changes)
    except TypeError as exc:
        raise MoelabError(f"model_shape {override!r}: {exc}") from None
    if changes:
        shape = dataclasses.replace(shape, name=f"{base.name} ({', '.join(f'{k}={v}' for k, v in changes.items())})")
    return shape


def shape_overrides(data: Any, model_names: list[str]) -> dict[str, dict[str, Any]]:
    """``simulate: {model_shape: ...}`` as ``model → {shape: NAME, ...}``: one override for every
    model (a name, or a mapping with ``shape``), or a mapping of model names to overrides."""
    if data is None:
        return {}
    if isinstance(data, str) or (isinstance(data, dict) and _SHAPE_KEY in data):
        one = {_SHAPE_KEY: data} if isinstance(data, str) else dict(data)
        return {m: one for m in model_names}
    if not isinstance(data, dict):
        raise MoelabError(f"model_shape {data!r}: expected a shape name, {{shape: NAME, ...}}, or a mapping of "
                          "model names to those.")
    out = {}
    for m, v in data.items():
        if m not in model_names:
            raise MoelabError(f"model_shape names model {m!r}, which is not in the spec's models."
                              f"{did_you_mean(str(m), model_names)} Spec models: {', '.join(model_names)}.")
        out[m] = {_SHAPE_KEY: v} if isinstance(v, str) else dict(v) if isinstance(v, dict) else v
    return out


def profile_key(name: str) -> dict[str, Any]:
    """What of a hardware profile decides its figures: every field (not just the name)."""

    return get_profile(name).to_dict()


def key(hardware: list[str], simulate: dict[str, Any]) -> dict[str, Any]:
    """The cell-hash part of the latency inputs (profiles' fields, hybrid config, shape)."""
    out = {"method": METHOD, "profiles": {h: profile_key(h) for h in hardware},
           "hybrid": simulate.get("hybrid"), "model_shape": simulate.get("model_shape")}
    if simulate.get("schedule"):
        out["schedule"] = simulate["schedule"]
    return out


# --------------------------------------------------------------------------- computing
def check_shape(shape: Any, num_experts: list[int], top_k: list[int], what: str) -> None:
    """Refuse (one line) a shape whose experts, top-k or MoE layer count differ from the routing's."""
    if (len(num_experts) != shape.num_moe_layers or set(num_experts) != {shape.num_experts}
            or set(top_k) != {shape.top_k}):
        raise MoelabError(
            f"{what} has {len(num_experts)} MoE layers of {sorted(set(num_experts))} experts, top-k "
            f"{sorted(set(top_k))}, but model shape {shape.name!r} has {shape.num_moe_layers} of {shape.num_experts}, "
            f"top-k {shape.top_k}; choose a simulate.model_shape that matches (e.g. {{shape: NAME, num_layers: "
            f"{len(num_experts)}}}) or drop it to cost the model's own shape."
        )


def cell_shape(cell: Any, model: Any) -> Any:
    """The shape a cell's routing is costed at (its override, or the live model's)."""

    override = (cell.simulate or {}).get("model_shape")
    return resolve_shape(override) if override else ModelShape.from_model(model, name=cell.model)


def hybrid_config(cell: Any, profile: str) -> Any:
    """The hybrid configuration a cell's trace is planned under on ``profile`` (module docstring)."""
    from moelab.hybrid.config import HybridConfig
    from moelab.sweeps.policies import HYBRID

    data = cell.settings["config"] if cell.policy == HYBRID else (cell.simulate or {}).get("hybrid")
    cfg = HybridConfig.from_dict(data if data is not None else DEFAULT_HYBRID)
    cfg = dataclasses.replace(cfg, executor="functional", device="cpu")
    if cfg.hardware is None:
        cfg.hardware = profile
    return cfg


def plan_cell(cell: Any, trace: Any, shape: Any, profile: str) -> list:
    """The plans of the cell's trace on ``profile`` (see the module docstring, step 1)."""
    from moelab.hybrid.offline import plan_routing, routing_from_trace, trace_shape
    from moelab.sweeps.policies import offline_policies

    ts = trace_shape(trace)
    check_shape(shape, ts["num_experts"], ts["top_k"], f"the routing trace of {cell.model}")
    return plan_routing(routing_from_trace(trace, hidden=False), hybrid_config(cell, profile),
                        num_experts=ts["num_experts"], top_k=ts["top_k"], expert_bytes=shape.expert_bytes(),
                        shape=shape,
                        routing_policies=offline_policies(cell.policy, cell.settings))


def sequences(plans: list) -> list[list]:
    """Plans cut into sequences: each prefill forward starts one; decode forwards follow it."""
    out: list[list] = []
    prev = None
    for p in plans:
        if not out or (p.phase == "prefill" and p.forward != prev):
            out.append([])
        out[-1].append(p)
        prev = p.forward
    return out


def simulate_sequences(plans: list, shape: Any, profile: str, *, copy_chunks: int = 1) -> dict[str, Any]:
    """:func:`~moelab.simulate.simulate_plans` of each sequence from context 0, end to end (low-priority
    copies in ``copy_chunks``: the configuration's ``prefetch.chunks``); the summary of all their
    events (``summarize_sim``) and counts."""
    import pandas as pd

    from moelab.simulate.executor import simulate_plans, summarize_sim

    events, forwards, clock = [], [], 0.0
    for seq in sequences(plans):
        res = simulate_plans(seq, shape, profile, copy_chunks=copy_chunks)
        ev, fw = res.events.copy(), res.forwards.copy()
        if not len(ev):
            continue
        for c in ("t_start_us", "t_end_us"):
            ev[c] = ev[c].astype("float64") + clock
        for c in ("start_us", "end_us"):
            fw[c] = fw[c].astype("float64") + clock
        clock = float(ev["t_end_us"].max())
        events.append(ev.astype({c: "object" for c in ev.columns if str(ev[c].dtype) == "category"}))
        forwards.append(fw)
    if not events:
        return {"wall_us": 0.0, "sequences": 0}
    summary = summarize_sim(pd.concat(events, ignore_index=True), pd.concat(forwards, ignore_index=True))
    fw = pd.concat(forwards, ignore_index=True)
    summary["sequences"] = len(forwards)
    summary["decode_tokens"] = int(fw.loc[fw["phase"] == "decode", "tokens"].sum())
    summary["prefill_tokens"] = int(fw.loc[fw["phase"] == "prefill", "tokens"].sum())
    summary["forwards"] = len(fw)
    return summary


def figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The record's figures of one profile from :func:`simulate_sequences`'s summary."""
    ms = 1e-3
    tps, basis = summary.get("decode_tokens_per_s"), "decode"
    if tps is None and summary.get("prefill_us"):
        tps, basis = summary["prefill_tokens"] / (summary["prefill_us"] / 1e6), "prefill"
    return {
        "tokens_per_s": tps,
        "tokens_per_s_basis": basis if tps is not None else None,
        "decode_step_ms": summary["decode_step_us"] * ms if "decode_step_us" in summary else None,
        "prefill_ms": summary["prefill_us"] * ms if "prefill_us" in summary else None,
        "wall_ms": summary.get("wall_us", 0.0) * ms,
        "busy_pct": summary.get("busy_pct", {}),
        "device_side_busy_pct": summary.get("device_side_busy_pct"),
        "host_side_busy_pct": summary.get("host_side_busy_pct"),
        "overlap_pct": summary.get("overlap_pct"),
        "stall_ms": {k: v * ms for k, v in summary.get("stall_us", {}).items()},
        "sequences": summary.get("sequences", 0),
        "forwards": summary.get("forwards", 0),
        "decode_tokens": summary.get("decode_tokens", 0),
        "prefill_tokens": summary.get("prefill_tokens", 0),
    }


def slots_per_token(plans: list) -> float | None:
    """Routed experts a decode token runs, on average over the decode plans (immediate and
    deferred slots; dropped ones not): what a routing policy leaves of the top-k. None without decode."""
    slots = tokens = 0
    for p in plans:
        if p.phase == "decode":
            slots += sum(n for _, n in p.device) + sum(n for _, n in p.host)
            tokens += p.tokens
    return slots / tokens if tokens else None


def throughput_figures(plans: list, shape: Any, profile: str, schedule: dict[str, Any]) -> dict[str, Any]:
    """MoE-Gen's decode throughput (:func:`moelab.simulate.moegen.plan_throughput`) for ``shape`` on
    ``profile`` with the routed experts per token of ``plans``: tokens/s at the best batch, the
    configuration and the on-demand baseline."""
    k = slots_per_token(plans)
    plan = plan_throughput(shape, profile, prompt=int(schedule["prompt"]), generate=int(schedule["generate"]),
                           slots_per_token=None if k is None else min(max(k, 1e-6), shape.top_k))
    best = plan.best.to_dict()
    return {"tokens_per_s": plan.tokens_per_s, "tokens_per_s_basis": "moegen", "slots_per_token": k,
            "decode_step_ms": best["step_ms"], "configuration": best,
            "baseline_tokens_per_s": None if plan.baseline is None else plan.baseline.tokens_per_s,
            "assumptions": list(plan.assumptions)}


def cell_latency(cell: Any, trace_dir: str | Path, shape: Any) -> dict[str, dict[str, Any]]:
    """``{profile: figures}`` of a cell's recorded trace (module docstring); raises on bad input."""
    from moelab.trace import open_trace

    trace = open_trace(trace_dir)
    schedule = (cell.simulate or {}).get("schedule") or {}
    out = {}
    for name in cell.hardware:
        profile = get_profile(name)
        cfg = hybrid_config(cell, name)
        plans = plan_cell(cell, trace, shape, name)
        if schedule.get("name") == "moegen":
            fig = throughput_figures(plans, shape, name, schedule)
        else:
            fig = figures(simulate_sequences(plans, shape, name, copy_chunks=cfg.prefetch.chunks))
        fig["settings"] = {
            "moelab": moelab.__version__, "method": METHOD,
            "profile": profile.to_dict(), "profile_provenance": dict(profile.provenance),
            "hybrid": cfg.to_dict(), "routing_policy": {"name": cell.policy, "settings": cell.settings},
            "schedule": schedule or {"name": "per-sequence"},
            "model_shape": {"name": shape.name, "source": getattr(shape, "source", ""),
                            "override": (cell.simulate or {}).get("model_shape"),
                            "expert_bytes": int(shape.expert_bytes())},
        }
        log.info("%s on %s: %.1f tokens/s", cell.label(), name, fig["tokens_per_s"] or 0.0)
        out[name] = fig
    return out
