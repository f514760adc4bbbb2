"""The sweep driver: expand a spec, skip finished cells, run the rest, write each result.

>>> from moelab.sweeps import load_spec, run_sweep
>>> summary = run_sweep(load_spec("evals/sweeps/deferral_vs_skipping.yaml"), backend="ray", workers=2)

The driver is the single writer of the store (it holds the store's lock for the run);
sweep backends hand results back to it. Interrupting it at any moment (``kill -9`` included)
and running it again gives the results of an uninterrupted run: finished cells are
skipped, unfinished ones run from scratch, and no cell is recorded twice.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelab.sweeps.spec import Cell, SpecBase
from moelab.sweeps.store import Store, open_store

log = logging.getLogger(__name__)


@dataclass
class SweepSummary:
    """What one :func:`run_sweep` call did."""

    store: str
    total: int
    """Cells in the spec."""
    skipped: int
    """Cells already finished before this run."""
    done: int
    """Cells finished by this run."""
    failed: dict[str, str] = field(default_factory=dict)
    """Hash → last error of each cell that failed all its attempts."""
    recomputed: dict[str, str] = field(default_factory=dict)
    """Hash → why its stored record was rejected (then recomputed)."""

    def line(self) -> str:
        extra = f", {len(self.recomputed)} bad record(s) recomputed" if self.recomputed else ""
        return (f"{self.done} cell(s) run, {self.skipped} already done, {len(self.failed)} failed "
                f"of {self.total}{extra}; store {self.store}")


def store_path(spec: SpecBase, store: str | os.PathLike | None = None) -> Path:
    return Path(store).expanduser() if store is not None else spec.store_path()


def plan(spec: Any, store: Store, fingerprints: dict[str, str] | None = None) -> list[Any]:
    """The spec's cells, expanded by its kind (:mod:`moelab.sweeps.kinds`); for ``eval`` specs
    model fingerprints come from ``fingerprints``, else the store's cache, else are computed."""
    from moelab.sweeps.kinds import get_kind

    kind = get_kind(spec.kind)
    if fingerprints is not None:
        return kind.expand(spec, store, fingerprints=fingerprints)
    return kind.expand(spec, store)


def run_sweep(spec: Any, *, backend: str | Any = "local", workers: int = 1, address: str | None = None,
              threads: int | None = None, store: str | os.PathLike | None = None,
              progress: bool = True, fingerprints: dict[str, str] | None = None,
              log_failures: bool = True) -> SweepSummary:
    """Run every unfinished cell of ``spec`` and record it (see the module docstring).

    ``backend``: ``local``, ``ray``, or a sweep backend object (:mod:`moelab.sweeps.backends`);
    ``fingerprints``: model fingerprints already known (a shortcut that loaded the model);
    ``log_failures=False``: failed cells are only returned (a shortcut raises the error itself).

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    from tqdm.auto import tqdm

    from moelab.sweeps.backends import make_backend

    # refuses before taking the store
    runner = make_backend(backend, workers, address, threads) if isinstance(backend, str) else backend
    path = store_path(spec, store)
    with open_store(path, writable=True) as st:
        cells = plan(spec, st, fingerprints)
        good, bad = st.records()
        for h, why in bad.items():
            log.warning("cell %s: stored record rejected (%s); it will be recomputed", h, why)
        todo = [c for c in cells if c.hash not in good]
        summary = SweepSummary(store=str(path), total=len(cells), skipped=len(cells) - len(todo), done=0,
                               recomputed={h: w for h, w in bad.items() if h in {c.hash for c in todo}})
        st.begin_run(runner.name)
        running: set[str] = set()
        bar = tqdm(total=len(cells), initial=summary.skipped, desc=f"sweep {spec.name}", unit="cell",
                   disable=not progress)

        def refresh() -> None:
            bar.set_postfix(running=len(running), failed=len(summary.failed), refresh=True)

        def on_start(cell: Cell) -> None:
            running.add(cell.hash)
            refresh()

        def on_done(cell: Cell, out: dict[str, Any]) -> None:
            running.discard(cell.hash)
            st.put(out["record"], out.get("files") or out.get("samples") or {})
            summary.done += 1
            summary.failed.pop(cell.hash, None)
            bar.update(1)
            refresh()

        def on_failed(cell: Cell, attempt: int, error: str, final: bool) -> None:
            running.discard(cell.hash)
            st.record_failure(cell.hash, attempt, error)
            last = error.strip().splitlines()[-1] if error.strip() else "unknown error"
            (log.warning if log_failures else log.info)("cell %s (%s) failed, attempt %d%s: %s", cell.hash, cell.label(), attempt,
                        "" if final else ", retrying", last)
            if final:
                summary.failed[cell.hash] = last
            refresh()

        try:
            runner.run(todo, spec.retries, on_start, on_done, on_failed)
        finally:
            bar.close()
            st.end_run(summary.done, len(summary.failed))
    return summary
