"""Cell kinds: what a sweep's cells are, one registry entry per kind.

A spec's ``kind:`` (default ``eval``) names a :class:`CellKind`; the kind reads its part of
the spec, expands it into cells (each with a stable hash), says which resource a worker
keeps loaded between cells (a model, a trace's access stream), runs one cell and shows its
result in tables. The driver, store, executors and report know cells only through this
interface, so a new kind is one registered class:

* ``eval`` (:mod:`moelab.sweeps.spec`, :mod:`moelab.sweeps.eval_kind`): models × routing
  policies × tasks × seeds scored with lm-eval (accuracy);
* ``cache`` (:mod:`moelab.sweeps.trace_kinds`): traces × cache policies × capacities ×
  scopes × prefetch settings replayed by :func:`moelab.caches.simulate` (hit rates);
* ``predictor`` (:mod:`moelab.sweeps.trace_kinds`): traces × predictor kinds × distances
  fitted and scored by :func:`moelab.predictors.evaluate` (prediction accuracy);
* ``schedule`` (:mod:`moelab.sweeps.schedule_kind`): model shapes × hardware profiles × a
  simulated schedule's settings (MoE-Gen's throughput search; tokens/s).

Every kind's record has the store's common fields (``metrics``, ``score``,
``score_stderr``, ``n_docs``, ``finished_at``, ...; :mod:`moelab.sweeps.store`).
"""

from __future__ import annotations

from typing import Any

from moelab.registry import Registry


class CellKind:
    """One kind of sweep cell (see the module docstring). Subclasses set ``name``."""

    name: str = ""
    spec_keys: tuple[str, ...] = ()
    """Top-level spec keys of this kind, beside the common ones (name, kind, store, ...)."""

    def parse(self, reader: Any, data: dict[str, Any], common: dict[str, Any]) -> Any:
        """The kind's spec object from parsed YAML (``reader`` reports errors with lines)."""
        raise NotImplementedError

    def expand(self, spec: Any, store: Any) -> list[Any]:
        """The spec's cells in a stable order, each with its ``hash`` set."""
        raise NotImplementedError

    def cell_from_dict(self, d: dict[str, Any]) -> Any:
        raise NotImplementedError

    def load(self, cell: Any) -> Any:
        """The resource ``cell.resource()`` names (kept by a worker across cells)."""
        raise NotImplementedError

    def run(self, cell: Any, resource: Any, worker: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
        """``(record fields, files)``: the kind's part of the record (``metrics``, ``score``,
        ``score_stderr``, ``n_docs``, ``versions``, ...) and the files to store with the cell
        (relative path → bytes); record fields ending in ``_path`` that name a file or
        folder in ``files`` become paths in the store."""
        raise NotImplementedError

    def row(self, cell: Any, record: dict[str, Any] | None) -> dict[str, Any]:
        """One row of the report's table of all cells."""
        raise NotImplementedError


def _load_builtins() -> None:
    CELL_KINDS.register("eval", "moelab.sweeps.eval_kind:EVAL", stacklevel=2)
    CELL_KINDS.register("cache", "moelab.sweeps.trace_kinds:CACHE", stacklevel=2)
    CELL_KINDS.register("predictor", "moelab.sweeps.trace_kinds:PREDICTOR", stacklevel=2)
    CELL_KINDS.register("schedule", "moelab.sweeps.schedule_kind:SCHEDULE", stacklevel=2)


#: name → :class:`CellKind` instance.
CELL_KINDS: Registry[CellKind] = Registry("sweep cell kind", base=CellKind, instances=True, loader=_load_builtins)


def get_kind(name: str) -> CellKind:
    return CELL_KINDS.get(name)


def cell_from_dict(d: dict[str, Any]) -> Any:
    """A cell of any kind from its ``to_dict()`` (``kind`` absent: an ``eval`` cell)."""
    return get_kind(d.get("kind") or "eval").cell_from_dict(d)
