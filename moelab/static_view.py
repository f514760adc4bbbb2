"""Widgets with a static view: what a panel shows now, for the places widgets cannot run.

A notebook's ipywidgets render only where a widget manager runs them: JupyterLab, or an HTML
export that embeds the widgets' state *and* can fetch the widget manager from the network.
A notebook saved from JupyterLab (widget state not saved, the default) and converted with
``jupyter nbconvert --to html`` shows an empty box where each panel was. Every moelab panel
is therefore displayed as one output with two representations: the live widget, which
JupyterLab and VS Code pick, and a ``text/html`` snapshot of the view at display time (its
figures and tables, rendered as the notebook renders them), which nbconvert picks when there
is no widget state (nbconvert's ``WidgetsDataTypeFilter`` skips the widget view then). For
``jupyter nbconvert --execute --to html`` offline, pass
``--ExecutePreprocessor.store_widget_state=False`` so the snapshot is used instead of a widget
view that would load from unpkg.

>>> view = moelab.viz.interactive(show, deferred=widgets.IntSlider(0, 0, 4))   # in a notebook cell
"""

from __future__ import annotations

import contextlib
import html
from collections.abc import Callable, Iterator
from typing import Any

PLOTLY_MIME = "application/vnd.plotly.v1+json"
SNAPSHOT_CLASS = "moelab-static-view"  # the class of the <div> every snapshot is wrapped in
# plotly renderers that publish a mime bundle (the others open a browser or write a file)
MIME_RENDERERS = {"plotly_mimetype", "notebook", "notebook_connected", "jupyterlab", "nteract", "vscode", "colab",
                  "kaggle", "azure", "cocalc", "databricks", "iframe", "iframe_connected", "png", "svg", "jpeg"}


def _rich_html(data: dict[str, Any]) -> str:
    """One displayed output as HTML: its HTML if it has one, else its text, escaped."""
    if "text/html" in data:
        v = data["text/html"]
        return v if isinstance(v, str) else "".join(v)
    if PLOTLY_MIME in data:  # a renderer without HTML (plain Python, "plotly_mimetype"): plotly.js is the page's
        import plotly.io as pio

        return pio.to_html(data[PLOTLY_MIME], full_html=False, include_plotlyjs=False)
    if "image/svg+xml" in data:
        return data["image/svg+xml"]
    for mime in ("image/png", "image/jpeg"):
        if mime in data:
            return f'<img src="data:{mime};base64,{data[mime]}"/>'
    text = data.get("text/plain", "")
    return f"<pre>{html.escape(text if isinstance(text, str) else ''.join(text))}</pre>"


@contextlib.contextmanager
def _figures_as_mime() -> Iterator[None]:
    """Plotly figures displayed while capturing keep their data: the notebook's own renderer when it
    publishes a mime bundle (its HTML is what the export shows for every other figure), else
    ``plotly_mimetype`` (plain Python, or a renderer that would open a browser)."""
    try:
        import plotly.io as pio
    except ImportError:
        yield
        return
    before = pio.renderers.default or ""
    if set(before.split("+")) & MIME_RENDERERS:
        yield
        return
    pio.renderers.default = "plotly_mimetype"
    try:
        yield
    finally:
        pio.renderers.default = before


def snapshot_html(render: Callable[[], Any], caption: str | None = None) -> str:
    """Run ``render`` (which prints and displays, as a panel's redraw does) with its output
    captured, and return what it showed as one HTML block."""
    from IPython.utils.capture import capture_output

    with _figures_as_mime(), capture_output(stdout=True, stderr=False, display=True) as cap:
        result = render()
        if result is not None:
            from IPython.display import display

            display(result)
    parts = [_rich_html(o.data) for o in cap.outputs]
    if cap.stdout:
        parts.insert(0, f"<pre>{html.escape(cap.stdout)}</pre>")
    head = (f"<p><em>{html.escape(caption, quote=False)}</em></p>" if caption else "")
    return f'<div class="{SNAPSHOT_CLASS}">{head}{"".join(parts)}</div>'


_OWN = ("widget", "_render", "_caption")


class StaticView:
    """A widget displayed with a static snapshot of its current view (see the module docstring).

    ``render`` draws the view (it runs again for each snapshot); ``caption``: a line above the
    snapshot, or a function giving it at snapshot time. Attributes read and set on the view are
    the widget's (``view.children``, ``view.layout = ...``); to put the panel inside another
    box, use ``view.widget``, the ipywidgets object itself."""

    def __init__(self, widget: Any, render: Callable[[], Any],
                 caption: str | Callable[[], str] | None = None) -> None:
        self.widget = widget
        self._render = render
        self._caption = caption

    def snapshot(self) -> str:
        """The ``text/html`` a static export shows: the view as it is now. A view that fails to
        render says so here instead of hiding the live widget."""
        try:
            caption = self._caption() if callable(self._caption) else self._caption
            return snapshot_html(self._render, caption)
        except Exception as exc:  # noqa: BLE001 - the live widget must still display
            return (f'<div class="{SNAPSHOT_CLASS}"><pre>no static view: {html.escape(type(exc).__name__)}: '
                    f"{html.escape(str(exc))}</pre></div>")

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None, **kwargs: Any) -> dict[str, Any]:
        bundle = dict(self.widget._repr_mimebundle_(include=include, exclude=exclude, **kwargs))
        bundle["text/html"] = self.snapshot()
        return bundle

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in _OWN:
            raise AttributeError(name)
        return getattr(self.widget, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        else:  # view.layout = ..., view.value = ...: the widget's
            setattr(self.widget, name, value)

    def __repr__(self) -> str:
        return f"StaticView({type(self.widget).__name__}; a static snapshot for exports without widgets)"


def controls_caption(values: dict[str, Any]) -> str:
    """``Static view (deferred = 2); open the notebook in Jupyter to change it.``"""
    settings = ", ".join(f"{k} = {v!r}" for k, v in values.items())
    return f"Static view ({settings}); open the notebook in Jupyter to change it."


def interactive(fn: Callable[..., Any], **controls: Any) -> StaticView:
    """``ipywidgets.interactive(fn, **controls)`` displayed with a static view of ``fn`` at the
    controls' current values (what an HTML export shows)."""
    import ipywidgets as w

    box = w.interactive(fn, **controls)
    return StaticView(box, lambda: fn(**box.kwargs), caption=lambda: controls_caption(box.kwargs))


__all__ = ["SNAPSHOT_CLASS", "StaticView", "controls_caption", "interactive", "snapshot_html"]
