"""Timelines of hybrid runs: summaries, interactive figures and trace exports over the events
every executor writes (:mod:`moelab.events`).

``Timeline.open("runs/h1")`` reads a run directory; ``tl.summary()``, ``tl.stalls()``,
``tl.critical_path(step)``, ``tl.compare(other)``; ``tl.figure()`` (plotly),
``panel(...)`` (ipywidgets), ``tl.to_chrome(path)`` / ``tl.to_perfetto(path)``; the signature
plot (KTransformers Fig. 10 redrawn): ``fig10_figure(simulated_fig10())`` or ``(real_fig10())``.
Everything is imported lazily (plotly and perfetto only when a figure or export is made).
"""

from __future__ import annotations

from moelab._lazy import lazy_attributes

_LAZY: dict[str, str] = {
    "Timeline": "moelab.timeline.core",
    "CriticalPath": "moelab.timeline.core",
    "FATES": "moelab.timeline.core",
    "STALL_CAUSES": "moelab.timeline.core",
    "check_events": "moelab.timeline.core",
    "timeline_figure": "moelab.timeline.figure",
    "panel": "moelab.timeline.widgets",
    "to_chrome": "moelab.timeline.export",
    "to_perfetto": "moelab.timeline.export",
    "synthetic_events": "moelab.timeline.synth",
    "fig10_figure": "moelab.timeline.signature",
    "simulated_fig10": "moelab.timeline.signature",
    "real_fig10": "moelab.timeline.signature",
}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
