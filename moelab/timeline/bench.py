"""``moelab bench timeline``: the timeline's figure and exports on a million synthetic events.

Each stage is timed once, in this process, after the synthetic events are built (the
first figure includes plotly's first use in the process; it is reported as such). Targets
(issue #14): figure ≤ 3 s and ≤ 20 MB of HTML, Chrome JSON ≤ 5 s for 1 M events.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

TARGETS = {"figure_s": 3.0, "html_mb": 20.0, "chrome_s": 5.0}


def run(events: int = 1_000_000, *, perfetto: bool = True, progress: Callable[[str], None] | None = None) -> dict:
    from moelab import __version__
    from moelab.timeline import Timeline
    from moelab.timeline.export import to_chrome, to_perfetto
    from moelab.timeline.figure import write_html
    from moelab.timeline.synth import synthetic_events

    say = progress or (lambda s: None)
    res: dict = {"events_requested": events, "machine": platform.node(), "cpus": os.cpu_count(),
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
        res["figure_s"] = time.perf_counter() - t
        say(f"figure built in {res['figure_s']:.2f} s")
        tl._cache.clear()  # the same work again, plotly warm, fates and feeds recomputed
        t = time.perf_counter()
        fig = tl.figure()
        res["figure_warm_s"] = time.perf_counter() - t
        t = time.perf_counter()
        html = write_html(fig, Path(d) / "timeline.html")
        res["html_s"] = time.perf_counter() - t
        res["html_mb"] = os.path.getsize(html) / 1e6
        res["figure_traces"] = len(fig.data)
        say(f"HTML {res['html_mb']:.1f} MB written in {res['html_s']:.2f} s")
        t = time.perf_counter()
        js = to_chrome(tl, Path(d) / "trace.json")
        res["chrome_s"] = time.perf_counter() - t
        res["chrome_mb"] = os.path.getsize(js) / 1e6
        say(f"Chrome JSON {res['chrome_mb']:.0f} MB in {res['chrome_s']:.2f} s")
        if perfetto:
            t = time.perf_counter()
            pf = to_perfetto(tl, Path(d) / "trace.pftrace")
            res["perfetto_s"] = time.perf_counter() - t
            res["perfetto_mb"] = os.path.getsize(pf) / 1e6
            say(f"Perfetto {res['perfetto_mb']:.0f} MB in {res['perfetto_s']:.2f} s")
    res["targets"] = {k: {"target": v, "measured": res[k], "met": res[k] <= v} for k, v in TARGETS.items()}
    return res


def format_result(r: dict) -> str:
    def mark(k: str) -> str:
        t = r["targets"][k]
        return f"(target ≤ {t['target']:g}: {'met' if t['met'] else 'NOT met'})"

    lines = [
        f"timeline benchmark: {r['events']} synthetic events, {r['steps']} decode steps of a DeepSeek-V3-like "
        f"hybrid run (58 MoE layers × 8 experts); {r['cpus']} CPUs, load average {r['load_avg']:.1f}",
        f"  synthesise events        {r['synth_s']:7.2f} s",
        f"  figure build             {r['figure_s']:7.2f} s  {mark('figure_s')}  "
        f"(again, plotly warm: {r['figure_warm_s']:.2f} s; {r['figure_traces']} traces)",
        f"  HTML                     {r['html_mb']:7.1f} MB {mark('html_mb')}  (written in {r['html_s']:.2f} s)",
        f"  Chrome JSON export       {r['chrome_s']:7.2f} s  {mark('chrome_s')}  ({r['chrome_mb']:.0f} MB)",
    ]
    if "perfetto_s" in r:
        lines.append(f"  Perfetto protobuf export {r['perfetto_s']:7.2f} s  (no target; {r['perfetto_mb']:.0f} MB)")
    return "\n".join(lines)
