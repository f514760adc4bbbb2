"""Accuracy sweeps that resume after any crash and scale out on Ray.

>>> from moelab.sweeps import load_spec, run_sweep
>>> spec = load_spec("evals/sweeps/deferral_vs_skipping.yaml")
>>> run_sweep(spec)                                   # local; run it again to resume
>>> run_sweep(spec, backend="ray", workers=2)        # one model-holding actor per worker

A spec (:mod:`moelab.sweeps.spec`) expands into cells with stable hashes; the results store
(:mod:`moelab.sweeps.store`, SQLite) keeps one checked record per finished cell; the driver
(:mod:`moelab.sweeps.driver`) is its single writer; sweep backends (:mod:`moelab.sweeps.backends`)
run cells locally or on Ray; :mod:`moelab.sweeps.report` reads the results back. Cells come
in registered kinds (:mod:`moelab.sweeps.kinds`: ``eval`` accuracy cells, and the trace-based
``cache`` and ``predictor`` cells); :mod:`moelab.sweeps.shortcuts` turns ``compare-policies``,
``cache simulate`` and ``predict compare`` into specs.
"""

from moelab._lazy import lazy_attributes

_LAZY: dict[str, str] = {
    "Cell": "moelab.sweeps.spec",
    "SpecBase": "moelab.sweeps.spec",
    "SweepSpec": "moelab.sweeps.spec",
    "load_spec": "moelab.sweeps.spec",
    "parse_spec": "moelab.sweeps.spec",
    "expand": "moelab.sweeps.spec",
    "run_sweep": "moelab.sweeps.driver",
    "SweepSummary": "moelab.sweeps.driver",
    "open_store": "moelab.sweeps.store",
    "collect": "moelab.sweeps.report",
    "CELL_KINDS": "moelab.sweeps.kinds",
    "CellKind": "moelab.sweeps.kinds",
    "TraceSweepSpec": "moelab.sweeps.trace_kinds",
    "pareto_front": "moelab.sweeps.report",
    "write_html": "moelab.sweeps.report",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
