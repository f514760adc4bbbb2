"""The signature plot: KTransformers Fig. 10 redrawn from events, simulated and real.

One MoE layer of a decode step at batch 1, without deferral and with 2, 3 and 4 deferred
experts: four panels stacked on one shared time axis (µs from the layer's start), one row per
lane, each lane's busy % and the layer's time annotated.

* :func:`simulated_fig10` — DeepSeek-V3 (BF16) on the ``ktransformers-a100`` profile, set up
  exactly as the simulator's validation cases of Fig. 10 (:mod:`moelab.simulate.validate_cases`,
  ``ktransformers-fig10-*``): the cases' hybrid configurations (every routed expert on the CPU,
  ``host-misses``), their context, batch and MoE layer, their profile (both sockets as one host
  lane, :func:`moelab.simulate.validate._profile_for`) and synthetic routing from
  :func:`moelab.simulate.whatif.load_routing`, planned by the offline planner and simulated.
* :func:`real_fig10` — the DeepSeek-V2-Lite-shaped model of
  :func:`moelab.hybrid.bench.realistic_model` on the real executor (``host-misses``, no device
  cache, as :func:`~moelab.hybrid.bench.real_executor_grid` runs it), one decode step after
  warm-up, its middle MoE layer.
* :func:`fig10_figure` — the figure of four :class:`Fig10Panel`.

**The layer's window** (the validation's rule): from the start of the layer's control-thread
work (attention and router, ``dense``) to the start of the next MoE layer's (or of the tail
after the last one). Every event overlapping the window is clipped to it and the panel's
:class:`~moelab.timeline.Timeline` is built over those clipped events, so each busy % and the
layer time annotated are that Timeline's :meth:`~moelab.timeline.Timeline.busy_pct` and
:attr:`~moelab.timeline.Timeline.wall_us` (in a real run the control thread's merge after its
last event is not an event, so the wall can end a few µs before the next layer starts).
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from moelab.errors import MoelabError
from moelab.simulate import whatif  # whatif.load_routing: looked up per call (tests replace it)
from moelab.simulate.validate import _profile_for
from moelab.simulate.validate_cases import get_case
from moelab.timeline.core import Timeline
from moelab.timing.shapes import ModelShape, get_shape

log = logging.getLogger(__name__)

DEFERRALS = (0, 2, 3, 4)
#: The simulator's validation cases of KTransformers Fig. 10, by deferred experts.
FIG10_CASES = {0: "ktransformers-fig10-cpu-busy", 2: "ktransformers-fig10-defer2", 3: "ktransformers-fig10-defer3",
               4: "ktransformers-fig10-defer4"}


@dataclass
class Fig10Panel:
    """One panel: the events of one MoE layer's window under ``deferred`` deferred experts."""

    deferred: int
    timeline: Timeline
    """The events overlapping the window, clipped to it."""
    step: int
    layer: int
    window_us: tuple[float, float]
    label: str = ""
    deferred_calls: int = 0
    """Deferred-expert calls (``expert-deferred`` events) of the panel's whole step, in or out of the
    window: whether deferred work reaches the window is timing (on a loaded machine a previous
    layer's can finish before it opens), whether the step deferred any is not."""

    @property
    def layer_us(self) -> float:
        return self.timeline.wall_us

    def busy_pct(self) -> dict[str, float]:
        return self.timeline.busy_pct()


# ---------------------------------------------------------------------- one layer's window
def layer_window(events: pd.DataFrame, layer: int, step: int | None = None) -> tuple[int, float, float]:
    """``(step, t0, t1)``: the window of MoE ``layer`` in ``step`` (default: the last step that has
    both the layer's and the next layer's control work); see the module docs."""
    ctl = events[(events["lane"].astype(str) == "control") & (events["kind"].astype(str) == "dense")]
    steps = sorted(int(s) for s in ctl["step"].unique()) if step is None else [int(step)]
    for s in reversed(steps):
        d = ctl[ctl["step"] == s]
        a = d[d["layer"] == layer]
        after = d[(d["layer"] > layer) | (d["layer"] == -1)]
        if len(a) and len(after):
            t0 = float(a["t_start_us"].min())
            later = after[after["t_start_us"] >= t0]
            if len(later):
                return s, t0, float(later["t_start_us"].min())
    have = sorted(int(x) for x in ctl["layer"].unique() if x >= 0)
    where = f"step {step}" if step is not None else "any step"
    raise MoelabError(f"no window for MoE layer {layer} in {where}: the events need the control thread's dense "
                      f"work of that layer and of a later one (layers with control work: "
                      f"{have[:3]}..{have[-3:] if have else []}); pick another layer or step.")


def layer_timeline(events: pd.DataFrame, layer: int, step: int | None = None, *, name: str = "layer"
                   ) -> tuple[Timeline, int, tuple[float, float]]:
    """The Timeline of the events overlapping ``layer``'s window, clipped to it."""
    s, t0, t1 = layer_window(events, layer, step)
    ev = events[(events["t_end_us"] > t0) & (events["t_start_us"] < t1)].copy()
    ev["t_start_us"] = ev["t_start_us"].clip(lower=t0)
    ev["t_end_us"] = ev["t_end_us"].clip(upper=t1)
    return Timeline(ev, name=name), s, (t0, t1)


def _panel(events: pd.DataFrame, deferred: int, layer: int, step: int | None, label: str) -> Fig10Panel:
    tl, s, window = layer_timeline(events, layer, step, name=label)
    kinds = events.loc[events["step"] == s, "kind"].astype(str)
    return Fig10Panel(deferred, tl, s, layer, window, label, int((kinds == "expert-deferred").sum()))


# ---------------------------------------------------------------------- simulated
def simulated_timeline(shape: Any, profile: Any, hybrid: dict, *, routing: Any = None, steps: int = 4,
                       batch: int = 1, context: int = 1024, name: str | None = None) -> Timeline:
    """The Timeline of ``hybrid`` (a hybrid configuration dict) on ``shape`` (a model shape or its
    name) and ``profile`` (a hardware profile or its name): the routing (a
    :class:`~moelab.simulate.whatif.Routing`, a list of forwards, or None: synthetic routing of
    ``batch`` sequences × ``steps`` decode steps with the what-if grids' default statistics)
    planned by the offline planner and simulated from ``context`` cached tokens."""
    from moelab.hybrid.offline import plan_routing
    from moelab.simulate.executor import simulate_plans

    shape = shape if isinstance(shape, ModelShape) else get_shape(shape)
    if routing is None:
        routing = whatif.load_routing(shape, synthetic=True, steps=steps, batch=batch)
    forwards = getattr(routing, "forwards", routing)
    L = shape.num_moe_layers
    plans = plan_routing(forwards, hybrid, num_experts=[shape.num_experts] * L, top_k=[shape.top_k] * L,
                         expert_bytes=shape.expert_bytes(), shape=shape)
    res = simulate_plans(plans, shape, profile, context=context,
                         copy_chunks=int((hybrid.get("prefetch") or {}).get("chunks", 1)))
    pname = getattr(profile, "name", profile)
    return Timeline(res.events, name=name or f"simulated {shape.name} on {pname}",
                    tokens=sum(int(f.tokens) for f in forwards if f.phase == "decode"))


def simulated_fig10(deferrals: Sequence[int] = DEFERRALS, *, steps: int = 8, routing: Any = None,
                    layer: int | None = None) -> list[Fig10Panel]:
    """Fig. 10 simulated as the validation cases set it up (module docs): one panel per number of
    deferred experts, the cases' MoE layer in the last of ``steps`` decode steps. ``routing``: a
    :class:`moelab.simulate.whatif.Routing` (or a list of forwards) to use instead of
    the cases' synthetic routing (e.g. statistics fitted from another trace)."""

    base = get_case(FIG10_CASES[0])
    st = base.settings
    shape = get_shape(base.shape, dtype=base.dtype)
    hw = _profile_for(base)
    if routing is None:
        routing = whatif.load_routing(shape, synthetic=True, steps=steps, batch=int(st.get("batch", 1)))
    moe_layer = int(st.get("moe_layer", shape.num_moe_layers // 2)) if layer is None else int(layer)
    panels = []
    for d in deferrals:
        hybrid = get_case(FIG10_CASES[d]).hybrid if d in FIG10_CASES else \
            {**base.hybrid, "routing": {"deferred": int(d)}}
        tl = simulated_timeline(shape, hw, hybrid, routing=routing, context=int(st.get("context", 1024)))
        panels.append(_panel(tl.events, int(d), moe_layer, None, _label(d)))
    return panels


def simulated_setup() -> str:
    """One line: what :func:`simulated_fig10` simulates."""

    c = get_case(FIG10_CASES[0])
    st = c.settings
    return (f"{c.shape} ({c.dtype}) on the {c.profile} profile (both sockets as one host lane), decode batch "
            f"{st.get('batch', 1)}, context {st.get('context')}, MoE layer {st.get('moe_layer')}, "
            f"{c.hybrid['placement']} with {c.hybrid['cache']['capacity']} routed experts on the GPU, synthetic "
            "routing — the validation cases ktransformers-fig10-*. Lanes: control = attention and router (GPU), "
            "device = shared experts (GPU), host = routed experts (CPU)")


def _label(d: int) -> str:
    return "no deferral" if d == 0 else f"{d} deferred"


# ---------------------------------------------------------------------- real
def real_fig10(deferrals: Sequence[int] = DEFERRALS, *, layers: int = 3, warmup: int = 2, steps: int = 3,
               layer: int | None = None, host_backend: str | None = None, model: Any = None,
               progress: bool = False) -> list[Fig10Panel]:
    """Fig. 10 on this machine: the DeepSeek-V2-Lite-shaped model (``layers`` MoE layers, random
    BF16 weights) on the real executor, ``host-misses`` with no device cache (every routed expert
    on the host lane); the middle MoE layer (or ``layer``) of one decode step: of ``steps`` decode
    steps after ``warmup``, the one whose layer window is the median (timings on a shared machine
    are noisy; the median step is the typical one, not the best).
    ``host_backend``: default ``moelab_bf16`` when the native kernels build, else ``reference``."""
    import torch
    from tqdm.auto import tqdm

    from moelab.forward.bench import decode_loop
    from moelab.hybrid.bench import realistic_model
    from moelab.hybrid.runtime import HybridRun

    if host_backend is None:
        host_backend = "moelab_bf16"
        try:
            from moelab.kernels.build import load_extension

            load_extension()
        except Exception as e:  # noqa: BLE001 - no compiler here: the host lane runs the reference experts
            log.warning("native kernels unavailable (%s); the host lane runs the reference backend", e)
            host_backend = "reference"
    model = realistic_model(layers) if model is None else model
    ids = torch.randint(3, 250, (1, 8), generator=torch.Generator().manual_seed(0))
    panels = []
    for d in tqdm(list(deferrals), desc="real runs", unit="run", disable=not progress):
        cfg = {"cache": {"capacity": 0.0, "policy": "lru"}, "placement": "host-misses", "executor": "real",
               "device_backend": "reference", "host_backend": host_backend, "device": "cpu",
               "routing": {"deferred": int(d), "min_immediate": 0}}
        run = HybridRun(model, cfg)
        with run, torch.no_grad():
            decode_loop(model, ids, warmup + steps)
        ev = run.events_table()
        moe = sorted(int(x) for x in ev["layer"].unique() if x >= 0)
        if not moe:
            raise MoelabError("the real run recorded no MoE layer events; the model has no MoE layers.")
        mid = moe[(len(moe) - 1) // 2] if layer is None else int(layer)
        last = sorted(int(x) for x in ev["step"].unique())[-steps:]
        spans = []
        for st in last:
            try:
                _, t0, t1 = layer_window(ev, mid, st)
            except MoelabError:
                continue
            spans.append((t1 - t0, st))
        if not spans:
            raise MoelabError(f"no decode step of the real run has a window for MoE layer {mid}.")
        step = sorted(spans)[(len(spans) - 1) // 2][1]
        panels.append(_panel(ev, int(d), mid, step, _label(d)))
    return panels


def real_setup(layers: int = 3, steps: int = 3) -> str:
    """One line: what :func:`real_fig10` runs."""
    import torch

    return (f"DeepSeek-V2-Lite MoE shapes (hidden 2048, 64 experts of 1408, top-6, 2 shared) × {layers} MoE "
            f"layers, BF16 random weights, real executor on this machine ({torch.get_num_threads()} torch threads; "
            f"the device lane is a CPU worker), host-misses, no device cache, the median of {steps} decode steps after "
            "warm-up. Lanes: control = the model's own thread: attention, router and the layer's other dense work "
            "(the GPU's part in Fig. 10, here on the CPU), host = routed experts")


# ---------------------------------------------------------------------- the figure
def _lane_label(lane: str, pct: float) -> str:
    return f"{lane} · {pct:.0f} %"


def fig10_figure(panels: Sequence[Fig10Panel], *, title: str | None = None, subtitle: str = "") -> Any:
    """The stacked figure: one panel per :class:`Fig10Panel` (rows: lanes, labelled with their busy
    %), one shared time axis in µs from each layer's start. ``fig.layout.meta["panels"]`` holds
    what is annotated (deferred, lanes, busy %, layer µs) per panel."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from moelab.timeline.figure import COLORS, ORDER, categories

    panels = list(panels)
    if not panels:
        raise MoelabError("fig10_figure needs at least one panel (simulated_fig10() or real_fig10()).")
    base_us = panels[0].layer_us if panels[0].deferred == 0 else None
    heads = []
    for p in panels:
        change = ""
        if base_us and p.deferred:
            change = f", {100 * (p.layer_us / base_us - 1):+.1f} % vs no deferral"
        heads.append(f"{p.label or _label(p.deferred)} — layer {p.layer_us:,.0f} µs{change}")
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.06, subplot_titles=heads)
    seen: set[str] = set()
    meta = []
    for r, p in enumerate(panels, start=1):
        tl = p.timeline
        ev = tl.events
        busy = tl.busy_pct()
        lanes = [lane for lane in tl.lanes if lane in busy or bool((ev["lane"] == lane).any())]
        names = {lane: _lane_label(lane, busy.get(lane, 0.0)) for lane in lanes}
        cat = categories(tl, "fate")
        t0 = p.window_us[0]
        for c in sorted(pd.unique(cat), key=lambda c: ORDER.index(c) if c in ORDER else len(ORDER)):
            m = cat == c
            g = ev[m]
            fig.add_trace(go.Bar(
                y=[names[str(x)] for x in g["lane"]], x=(g["t_end_us"] - g["t_start_us"]).to_numpy(),
                base=(g["t_start_us"] - t0).to_numpy(), orientation="h", name=str(c), legendgroup=str(c),
                showlegend=str(c) not in seen, marker={"color": COLORS.get(str(c), COLORS["other"]),
                                                       "opacity": 0.45 if c == "wait" else 1.0,
                                                       "line": {"color": "white", "width": 0.5}},
                customdata=np.column_stack([g["step"], g["layer"], g["expert"], g["tokens"], g["bytes"],
                                            g["cause"].astype(str)]),
                hovertemplate=(f"{_label(p.deferred)} · {c}<br>step %{{customdata[0]}}, layer %{{customdata[1]}}, "
                               "expert %{customdata[2]}<br>tokens %{customdata[3]}, bytes %{customdata[4]}<br>"
                               "cause %{customdata[5]}<br>%{base:.0f} → %{x:.0f} µs long<extra></extra>"),
            ), row=r, col=1)
            seen.add(str(c))
        fig.update_yaxes(categoryorder="array", categoryarray=[names[lane] for lane in reversed(lanes)], row=r, col=1,
                         title_text="lane · busy %", title_font_size=10)
        if r < len(panels):  # the shared time axis, its ticks drawn under the last panel
            fig.update_xaxes(title_text="µs", title_font_size=10, title_standoff=0, row=r, col=1)
        meta.append({"label": p.label or _label(p.deferred), "deferred": p.deferred, "step": p.step,
                     "layer": p.layer, "layer_us": p.layer_us, "lanes": lanes,
                     "busy_pct": {lane: busy.get(lane, 0.0) for lane in lanes},
                     "group_busy_pct": tl.group_busy_pct()})
    fig.update_xaxes(title_text="µs from the layer's start (its attention)", row=len(panels), col=1)
    head = title or "One MoE layer without and with deferred experts (KTransformers Fig. 10, redrawn)"
    fig.update_layout(
        title={"text": head + "".join(f"<br><sup>{line}</sup>" for line in textwrap.wrap(subtitle, 150))},
        barmode="overlay", height=int(170 + 150 * len(panels) + 22 * len(textwrap.wrap(subtitle, 150))), meta={"panels": meta},
        legend={"title": {"text": "fate / kind"}},
        margin={"l": 130, "r": 20, "t": 90 + 22 * len(textwrap.wrap(subtitle, 150)), "b": 50},
    )
    return fig


def fig10_table(panels: Sequence[Fig10Panel]) -> pd.DataFrame:
    """Per panel: layer µs, change vs the first panel, busy % per lane and per lane group."""
    rows = []
    base = panels[0].layer_us if panels else None
    for p in panels:
        row: dict[str, Any] = {"deferred": p.deferred, "layer_us": p.layer_us,
                               "change_pct": 100 * (p.layer_us / base - 1) if base else None}
        row.update({f"busy_{k}_pct": v for k, v in p.busy_pct().items()})
        rows.append(row)
    return pd.DataFrame(rows)


__all__ = ["DEFERRALS", "FIG10_CASES", "Fig10Panel", "fig10_figure", "fig10_table", "layer_timeline",
           "layer_window", "real_fig10", "real_setup", "simulated_fig10", "simulated_setup",
           "simulated_timeline"]
