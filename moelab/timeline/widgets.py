"""An ipywidgets panel over one or several timelines: pick the runs (two or more are overlaid on
one time axis: real beside simulated, configuration A beside B), the steps and MoE layers, the
colouring, and read the summary (or the line-by-line comparison) of what is selected.

Level of detail follows the zoom: the figure is a plotly ``FigureWidget`` (with ``anywidget``
installed); zooming in redraws the visible time range, event by event once it holds no more
than the detail budget (single experts), as per-layer or per-step aggregates before that;
zooming back out (double click) restores the whole selection. Without ``anywidget`` the figure
is static and the step and layer sliders do the zooming.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from moelab.errors import MoelabError
from moelab.static_view import StaticView, controls_caption
from moelab.timeline.core import Timeline


class TimelinePanel:
    """Controls, a summary and the figure; display it (``panel`` in a cell) or use ``.widget``."""

    def __init__(self, runs: Timeline | Sequence[Timeline] | Mapping[str, Timeline], *,
                 steps: tuple[int, int] | None = None, detail_budget: int = 40_000, zoom: bool | None = None) -> None:
        import ipywidgets as w

        if zoom is None:
            try:
                import anywidget  # noqa: F401 - plotly's FigureWidget needs it

                zoom = True
            except ImportError:
                zoom = False
        self.zoom = zoom
        self.fig: Any = None  # the FigureWidget (zoom) or the static figure on display
        self._redrawing = False

        if isinstance(runs, Timeline):
            runs = {runs.name: runs}
        elif not isinstance(runs, Mapping):
            runs = {t.name if t.name not in {u.name for u in list(runs)[:i]} else f"{t.name} ({i})": t
                    for i, t in enumerate(runs)}
        if not runs:
            raise MoelabError("panel needs at least one Timeline.")
        self.runs: dict[str, Timeline] = dict(runs)
        self.detail_budget = detail_budget
        all_steps = sorted({s for t in self.runs.values() for s in t.steps}) or [0]
        all_layers = sorted({x for t in self.runs.values() for x in t.layers}) or [0]
        first = list(self.runs)[: min(2, len(self.runs))]
        if steps is None:  # a few steps to start with: the first ones, as many as the detail budget holds
            t0 = self.runs[first[0]]
            counts = t0.events.groupby("step", observed=True).size().cumsum()
            n = max(1, int((counts <= detail_budget).sum()))
            steps = (all_steps[0], all_steps[min(n, len(all_steps)) - 1])
        self.run_select = w.SelectMultiple(options=list(self.runs), value=tuple(first), description="runs",
                                           rows=min(4, len(self.runs)))
        self.step_range = w.IntRangeSlider(value=steps, min=all_steps[0], max=all_steps[-1], description="steps",
                                           continuous_update=False)
        self.layer_range = w.IntRangeSlider(value=(all_layers[0], all_layers[-1]), min=all_layers[0],
                                            max=all_layers[-1], description="layers", continuous_update=False)
        self.color_by = w.ToggleButtons(options=["fate", "kind"], value="fate", description="colour")
        self.summary_html = w.HTML()
        self.out = w.Output()
        for c in (self.run_select, self.step_range, self.layer_range, self.color_by):
            c.observe(lambda _change: self.update(), names="value")
        self.widget = w.VBox([w.HBox([self.run_select, w.VBox([self.step_range, self.layer_range, self.color_by])]),
                              self.summary_html, self.out])
        self.update()

    def selected(self) -> dict[str, Timeline]:
        """The chosen runs restricted to the chosen steps and layers."""
        return {name: self.runs[name].select(steps=tuple(self.step_range.value), layers=tuple(self.layer_range.value))
                for name in self.run_select.value}

    def figure(self, t_range: tuple[float, float] | None = None) -> Any:
        """The figure of the selection, or of the part of it in ``t_range`` (ms on the figure's axis)."""
        from moelab.timeline.figure import timeline_figure

        sel = self.selected()
        if not sel:
            return None
        tls = list(sel.values())
        origins = [t.t0 for t in tls]
        rows = [(i, lane) for lane in _lanes(tls) for i, t in enumerate(tls) if lane in t.lanes]
        counters = "always" if any(t.events["kind"].str.startswith("transfer").any() for t in tls) else False
        if t_range is not None:
            tls = [t.select(t_range=(o + t_range[0] * 1e3, o + t_range[1] * 1e3)) for t, o in zip(tls, origins,
                                                                                                 strict=True)]
        return timeline_figure(tls, labels=list(sel), color_by=self.color_by.value, detail_budget=self.detail_budget,
                               origins=origins, rows=rows, counters=counters)

    def _on_zoom(self, layout, x_range) -> None:
        if self._redrawing or self.fig is None:
            return
        fig = self.figure(None if x_range is None else (float(x_range[0]), float(x_range[1])))
        self._redrawing = True
        try:
            with self.fig.batch_update():
                self.fig.data = []
                self.fig.add_traces(list(fig.data))
                self.fig.layout.title = fig.layout.title
                if x_range is not None:
                    self.fig.layout.xaxis.range = x_range
        finally:
            self._redrawing = False

    def summary(self):
        """The summary of the selection (one run), or the comparison of the first two selected runs."""
        sel = self.selected()
        tls = list(sel.values())
        if len(tls) >= 2:
            return tls[0].compare(tls[1], names=(list(sel)[0], list(sel)[1]))
        if tls:
            return tls[0].summary_table()
        return None

    def update(self) -> None:
        from IPython.display import display

        table = self.summary()
        self.summary_html.value = "" if table is None else table.to_html(index=False, float_format=lambda x: f"{x:.4g}",
                                                                        max_rows=60)
        fig = self.figure()
        if fig is not None and self.zoom:
            import plotly.graph_objects as go

            fig = go.FigureWidget(fig)
            fig.layout.on_change(self._on_zoom, "xaxis.range")
        self.fig = fig
        with self.out:
            self.out.clear_output(wait=True)
            if fig is None:
                print("select at least one run")
            else:
                display(fig)

    def _draw_static(self) -> None:
        from IPython.display import HTML, display

        if self.summary_html.value:
            display(HTML(self.summary_html.value))
        fig = self.figure()
        if fig is None:
            print("select at least one run")
        else:
            display(fig)

    def static_view(self) -> Any:
        """The panel with the static view an HTML export shows (:mod:`moelab.static_view`): the
        summary and the figure of the current selection."""

        return StaticView(self.widget, self._draw_static, caption=lambda: controls_caption({
            "runs": list(self.run_select.value), "steps": tuple(self.step_range.value),
            "layers": tuple(self.layer_range.value), "colour": self.color_by.value}))

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, **kwargs: Any) -> dict[str, Any]:
        return self.static_view()._repr_mimebundle_(include=include, exclude=exclude, **kwargs)


def _lanes(tls: list[Timeline]) -> list[str]:
    from moelab.timeline.core import lane_order

    return lane_order({lane for t in tls for lane in t.lanes})


def panel(runs: Timeline | Sequence[Timeline] | Mapping[str, Timeline], **kwargs) -> TimelinePanel:
    """A :class:`TimelinePanel` over ``runs`` (a Timeline, a list, or ``{label: Timeline}``)."""
    return TimelinePanel(runs, **kwargs)
