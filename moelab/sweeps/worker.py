"""Run one cell: load (or reuse) the model, apply the policy, score the task.

:class:`CellRunner` is what every executor runs: in the driver's process (local) or as a
Ray actor (one per worker), where it keeps the last model loaded across cells. It never
touches the results store: it returns the cell's record and samples to the driver, the
store's single writer.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from moelab.sweeps.spec import Cell, cell_key

log = logging.getLogger(__name__)


class CellRunner:
    """Runs cells one at a time; keeps the most recent model loaded."""

    def __init__(self, threads: int | None = None, name: str = "local") -> None:
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        self.name = name
        self._key: tuple | None = None
        self._model: Any = None
        self._tokenizer: Any = None

    def warm(self) -> dict[str, Any]:
        """Import the evaluation stack (lm-eval: seconds) now, at the worker's start, not in its first cell."""
        import lm_eval.tasks  # noqa: F401

        import moelab.evals.api  # noqa: F401

        return self.info()

    def info(self) -> dict[str, Any]:
        return {"worker": self.name, "pid": os.getpid(), "host": socket.gethostname(), "threads": self.threads}

    def _load(self, cell: Cell) -> tuple[Any, Any]:
        key = (cell.model, cell.dtype)
        if key != self._key:
            from moelab import load

            self._model = self._tokenizer = None  # free the previous model first
            log.info("%s: loading %s", self.name, cell.model)
            self._model, self._tokenizer = load(cell.model, dtype=cell.dtype)
            self._key = key
        return self._model, self._tokenizer

    def run(self, cell: Cell | dict[str, Any]) -> dict[str, Any]:
        """``{"record": ..., "samples": {file name: text}}`` for ``cell``; raises if it fails."""
        import moelab
        from moelab.evals.api import evaluate
        from moelab.evals.results import EvalConfig
        from moelab.sweeps.policies import make_policy
        from moelab.sweeps.store import now

        if isinstance(cell, dict):
            cell = Cell.from_dict(cell)
        started, t0 = now(), time.perf_counter()
        model, tokenizer = self._load(cell)
        config = EvalConfig(tasks=[cell.task], limit=cell.limit, num_fewshot=cell.num_fewshot, seed=cell.seed,
                            **cell.eval)
        with tempfile.TemporaryDirectory(prefix="moelab-cell-") as tmp:
            out = Path(tmp) / "samples"
            with make_policy(cell.policy, model, cell.settings):
                result = evaluate(model, tokenizer, config=config, log_samples_dir=out, model_name=cell.model)
            samples = {p.name: p.read_text(encoding="utf-8") for p in sorted(out.glob("samples_*.jsonl"))}
        task = result.tasks[cell.task]
        score = task.score
        se = task.stderr.get(task.primary_metric)
        if se is None and task.n_docs > 1:
            se = math.sqrt(score * (1 - score) / (task.n_docs - 1))
        record = {
            "cell": cell.to_dict(),
            "key": cell_key(cell, moelab.__version__),
            "affected": cell.affected,
            "metrics": task.metrics,
            "stderr": task.stderr,
            "primary_metric": task.primary_metric,
            "score": score,
            "score_stderr": se,
            "n_docs": task.n_docs,
            "n_available": task.n_available,
            "num_fewshot": task.num_fewshot,
            "notes": task.notes,
            "policies": result.policies,
            "code_isolation": result.code_isolation,
            "versions": result.versions,
            "worker": self.info(),
            "started_at": started,
            "finished_at": now(),
            "wall_s": time.perf_counter() - t0,
            "samples_path": None,
            "trace_path": None,
            "timeline_path": None,
            # {hardware profile: simulated figures}; None until a simulator is registered (#13)
            "latency": {h: None for h in cell.hardware},
        }
        return {"record": record, "samples": samples}
