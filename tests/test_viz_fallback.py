"""Every moelab panel is one output with the live widget *and* a static view of what it shows
(text/html), which is what `jupyter nbconvert --to html` renders when no widget state is saved."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets", reason="ipywidgets is not installed")

WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(autouse=True, scope="module")
def shell():
    """An IPython shell, as in a kernel: display() publishes mime bundles (without one it prints)."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False  # no sqlite history under ~/.ipython (two xdist workers)
    yield InteractiveShell.instance(config=config)
    InteractiveShell.clear_instance()  # the rest of the worker's tests run outside IPython again


def _bundle(obj) -> dict:
    """What IPython's display machinery would publish for ``obj``."""
    from IPython.core.formatters import DisplayFormatter

    data, _ = DisplayFormatter().format(obj)
    return data


def test_interactive_publishes_the_widget_and_a_static_view_at_the_controls_values():
    import ipywidgets as w

    from moelab.static_view import SNAPSHOT_CLASS
    from moelab.viz import interactive

    calls = []

    def show(n, word):
        calls.append(n)
        print(f"n squared is {n * n}; <{word}>")

    view = interactive(show, n=w.IntSlider(value=3, min=0, max=9), word=w.Text(value="x&y"))
    data = _bundle(view)
    assert WIDGET in data and data[WIDGET]["model_id"] == view.widget.model_id
    html = data["text/html"]
    assert SNAPSHOT_CLASS in html and "n squared is 9" in html
    assert "&lt;x&amp;y&gt;" in html  # printed text is escaped
    assert "n = 3" in html and "open the notebook in Jupyter" in html
    view.widget.children[0].value = 4  # moving the slider changes what an export would show
    assert "n squared is 16" in _bundle(view)["text/html"]
    assert view.children == view.widget.children  # attributes reach the widget


def test_static_view_keeps_a_figure_html():
    import ipywidgets as w
    import plotly.graph_objects as go
    from IPython.display import display

    from moelab.viz import StaticView

    fig = go.Figure(go.Bar(x=[0, 1], y=[0.25, 0.75], name="the-bars"))
    data = _bundle(StaticView(w.VBox([]), lambda: display(fig), caption="a caption"))
    assert "a caption" in data["text/html"]
    assert "the-bars" in data["text/html"] and "Plotly.newPlot(" in data["text/html"]


def test_a_view_that_fails_to_render_still_shows_its_widget():
    import ipywidgets as w

    from moelab.viz import StaticView

    def broken():
        raise ValueError("no data")

    box = w.VBox([])
    view = StaticView(box, broken)
    data = _bundle(view)
    assert WIDGET in data and "no static view: ValueError: no data" in data["text/html"]
    view.layout = w.Layout(width="50%")  # attributes set on the view reach the widget
    assert box.layout.width == "50%"


def test_timeline_panel_static_view_shows_the_selection():
    from moelab.timeline import Timeline
    from moelab.timeline.synth import synthetic_events
    from moelab.timeline.widgets import panel

    p = panel({"real": Timeline(synthetic_events(steps=4, layers=3, seed=1))}, steps=(1, 2), zoom=False)
    data = _bundle(p)
    assert WIDGET in data
    html = data["text/html"]
    assert "steps = (1, 2)" in html and "runs = ['real']" in html and "Plotly.newPlot(" in html
    assert "<table" in html and "Timeline \\u2014 real" in html  # the summary and the figure (its title, JSON-escaped)


def test_cache_panel_static_view():
    import numpy as np

    from moelab.caches.stream import build_stream
    from moelab.caches.viz import cache_panel

    rng = np.random.default_rng(0)
    steps, layers, k = 20, 2, 2
    step = np.repeat(np.arange(1, steps + 1), layers)  # decode steps (step 0 would be the prompt)
    layer = np.tile(np.arange(layers), steps)
    experts = np.stack([rng.choice(8, size=k, replace=False) for _ in range(steps * layers)])
    stream = build_stream(seq=np.zeros(steps * layers, np.int64), step=step, moe_layer=layer, experts=experts,
                          weights=np.full((steps * layers, k), 0.5), num_experts=[8] * layers, top_k=[k] * layers,
                          replay="sequence")
    view = cache_panel(stream, policies=("lru", "lfu"), capacities=(0.25, 0.5))
    html = _bundle(view)["text/html"]
    assert "policy = 'lru'" in html and "capacity = 0.5" in html and "hit rate" in html
