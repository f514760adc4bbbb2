"""Run one cell of any kind: load (or reuse) its resource, run it, build its record.

:class:`CellRunner` is what every sweep backend runs: in the driver's process (local) or as a
Ray actor (one per worker), where it keeps the last resource (a model, a trace's access
stream) loaded across cells. It never touches the results store: it returns the cell's
record and files to the driver, the store's single writer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import Any

log = logging.getLogger(__name__)


class CellRunner:
    """Runs cells one at a time; keeps the most recent resource loaded.

    ``preload`` maps a cell's ``resource()`` to an object already loaded (a shortcut command
    that loaded the model or stream itself hands it over instead of loading it twice)."""

    def __init__(self, threads: int | None = None, name: str = "local",
                 preload: dict[tuple, Any] | None = None) -> None:
        self._threads = threads
        if threads:  # pinned now, before any work (trace-only cells never import torch otherwise)
            import torch

            torch.set_num_threads(threads)
            with contextlib.suppress(RuntimeError):  # inter-op too (only before the first parallel work)
                torch.set_num_interop_threads(threads)
        self.name = name
        self._preload = dict(preload or {})
        self._key: tuple | None = None
        self._resource: Any = None

    def warm(self) -> dict[str, Any]:
        """Import the evaluation stack (lm-eval: seconds) now, at the worker's start, not in its first cell."""
        import lm_eval.tasks  # noqa: F401

        return self.info()

    @property
    def threads(self) -> int | None:
        """Torch's intra-op threads in this worker (None where torch is not imported)."""
        import sys

        torch = sys.modules.get("torch")
        return torch.get_num_threads() if torch is not None else self._threads

    def info(self) -> dict[str, Any]:
        return {"worker": self.name, "pid": os.getpid(), "host": socket.gethostname(), "threads": self.threads}

    def _load(self, kind: Any, cell: Any) -> Any:
        key = cell.resource()
        if key != self._key:
            self._resource = None  # free the previous one first
            self._resource = self._preload[key] if key in self._preload else kind.load(cell)
            self._key = key
        return self._resource

    def run(self, cell: Any) -> dict[str, Any]:
        """``{"record": ..., "files": {relative path: bytes}}`` for ``cell``; raises if it fails."""
        from moelab.sweeps.kinds import cell_from_dict, get_kind
        from moelab.sweeps.store import now

        if isinstance(cell, dict):
            cell = cell_from_dict(cell)
        kind = get_kind(cell.kind)
        started, t0, c0 = now(), time.perf_counter(), time.process_time()
        resource = self._load(kind, cell)
        fields, files = kind.run(cell, resource, self)
        record = {
            "cell": cell.to_dict(),
            **fields,
            "worker": self.info(),
            "started_at": started,
            "finished_at": now(),
            "wall_s": time.perf_counter() - t0,
            # CPU seconds of this worker process (all its threads) in the cell: cpu_s / wall_s is the
            # cores it used; below 1 with one thread, it waited for a core (a loaded machine)
            "cpu_s": time.process_time() - c0,
        }
        return {"record": record, "files": files}
