"""Interactive plotly figures and ipywidgets panels over traces (plotly imported lazily)."""

from moelab.static_view import StaticView, interactive

__all__ = ["StaticView", "interactive"]
