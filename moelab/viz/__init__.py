"""Interactive plotly figures and ipywidgets panels over traces (plotly imported lazily)."""
