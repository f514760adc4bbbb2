"""``moelab bench timeline``: the timeline's figure and exports on a million synthetic events.

Each stage runs ``repeat`` times (default 3) in this process after the synthetic events are
built and is reported as the median with its spread and the machine's load
(:mod:`moelab.measure`); the first figure, which includes plotly's first use in the process,
is timed once and reported apart. Targets
(issue #14): figure ≤ 3 s and ≤ 20 MB of HTML, Chrome JSON ≤ 5 s for 1 M events.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from moelab import __version__
from moelab.measure import Measurement, measure

TARGETS = {"figure_s": 3.0, "html_mb": 20.0, "chrome_s": 5.0}


def _timed(res: dict, name: str, m: Measurement, say: Callable[[str], None]) -> None:
    res[f"{name}_s"], res[f"{name}_spread"], res[f"{name}_busy"] = m.median, m.spread, m.reason
    res["load_avg"] = m.load_after.get("load1")
    say(f"{name}: {m.describe(1, 's')}")


def run(events: int = 1_000_000, *, perfetto: bool = True, progress: Callable[[str], None] | None = None,
        repeat: int = 3) -> dict:
    from moelab.timeline import Timeline
    from moelab.timeline.export import to_chrome, to_perfetto
    from moelab.timeline.figure import write_html
    from moelab.timeline.synth import synthetic_events

    say = progress or (lambda s: None)
    res: dict = {"events_requested": events, "machine": platform.node(), "cpus": os.cpu_count(), "repeat": repeat,
                 "moelab": __version__, "load_avg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    t = time.perf_counter()
    tl = Timeline(synthetic_events(events=events))
    res["synth_s"] = time.perf_counter() - t
    res["events"] = len(tl)
    res["steps"] = len(tl.steps)
    say(f"synthesised {len(tl)} events ({res['steps']} steps × 58 layers) in {res['synth_s']:.2f} s")
    with tempfile.TemporaryDirectory(prefix="moelab-bench-timeline-") as d:
        t = time.perf_counter()
        fig = tl.figure()
        res["figure_cold_s"] = time.perf_counter() - t  # plotly's first use in the process included
        say(f"first figure built in {res['figure_cold_s']:.2f} s")

        def figure():
            nonlocal fig
            tl._cache.clear()  # the same work again, plotly warm, fates and feeds recomputed
            fig = tl.figure()

        _timed(res, "figure", measure(figure, warmup=0, repeat=repeat), say)
        html = Path(d) / "timeline.html"
        _timed(res, "html", measure(lambda: write_html(fig, html), warmup=0, repeat=repeat), say)
        res["html_mb"] = os.path.getsize(html) / 1e6
        res["figure_traces"] = len(fig.data)
        js = Path(d) / "trace.json"
        _timed(res, "chrome", measure(lambda: to_chrome(tl, js), warmup=0, repeat=repeat), say)
        res["chrome_mb"] = os.path.getsize(js) / 1e6
        if perfetto:
            pf = Path(d) / "trace.pftrace"
            _timed(res, "perfetto", measure(lambda: to_perfetto(tl, pf), warmup=0, repeat=repeat), say)
            res["perfetto_mb"] = os.path.getsize(pf) / 1e6
    res["busy"] = [k for k in ("figure", "html", "chrome", "perfetto") if res.get(f"{k}_busy")]
    res["targets"] = {k: {"target": v, "measured": res[k], "met": res[k] <= v} for k, v in TARGETS.items()}
    return res


def format_result(r: dict) -> str:
    def mark(k: str) -> str:
        t = r["targets"][k]
        return f"(target ≤ {t['target']:g}: {'met' if t['met'] else 'NOT met'})"

    def spread(k: str) -> str:
        return f"±{r[f'{k}_spread']:.0%}" + (" BUSY" if r.get(f"{k}_busy") else "")

    load = f"load average {r['load_avg']:.1f}" if r.get("load_avg") is not None else "load unknown"
    lines = [
        f"timeline benchmark: {r['events']} synthetic events, {r['steps']} decode steps of a DeepSeek-V3-like "
        f"hybrid run (58 MoE layers × 8 experts); {r['cpus']} CPUs, {load}; medians of {r['repeat']} "
        "with their spread",
        f"  synthesise events        {r['synth_s']:7.2f} s",
        f"  figure build             {r['figure_s']:7.2f} s  {spread('figure'):>5} {mark('figure_s')}  "
        f"(first in the process, plotly cold: {r['figure_cold_s']:.2f} s; {r['figure_traces']} traces)",
        f"  HTML                     {r['html_mb']:7.1f} MB {mark('html_mb')}  (written in {r['html_s']:.2f} s "
        f"{spread('html')})",
        f"  Chrome JSON export       {r['chrome_s']:7.2f} s  {spread('chrome'):>5} {mark('chrome_s')}  "
        f"({r['chrome_mb']:.0f} MB)",
    ]
    if "perfetto_s" in r:
        lines.append(f"  Perfetto protobuf export {r['perfetto_s']:7.2f} s  {spread('perfetto'):>5} (no target; "
                     f"{r['perfetto_mb']:.0f} MB)")
    if r.get("busy"):
        lines.append(f"  BUSY machine: {r[r['busy'][0] + '_busy']} — the medians above are not meaningful")
    return "\n".join(lines)
