"""Interactive plotly figures and ipywidgets panels over traces (plotly imported lazily)."""

from moelab.viz.fallback import StaticView, interactive

__all__ = ["StaticView", "interactive"]
