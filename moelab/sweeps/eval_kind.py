"""The ``eval`` cell kind: a model × routing policy (or hybrid configuration) × task × seed,
scored with lm-eval (:func:`moelab.evals.evaluate`).

A cell's files are lm-eval's per-document logs (``samples_<task>.jsonl``) and, when the
spec asks for them (``artifacts: {trace: true, timeline: true}``), the routing trace of the
cell's evaluation (``trace/``, a :func:`moelab.record` directory) and, for a ``hybrid``
cell, its timeline (``events.parquet``, the schema of :mod:`moelab.hybrid.events`).
"""

from __future__ import annotations

import logging
import math
import tempfile
from pathlib import Path
from typing import Any

from moelab.sweeps.kinds import CellKind
from moelab.sweeps.spec import Cell, SweepSpec, cell_key, expand, parse_eval_spec

log = logging.getLogger(__name__)


def read_files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` as ``relative path → bytes``."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class EvalKind(CellKind):
    name = "eval"
    spec_keys = ("models", "policies", "tasks", "seeds", "hardware", "eval", "artifacts")

    def parse(self, reader: Any, data: dict[str, Any], common: dict[str, Any]) -> SweepSpec:
        return parse_eval_spec(reader, data, common)

    def expand(self, spec: SweepSpec, store: Any, fingerprints: dict[str, str] | None = None) -> list[Cell]:
        from moelab.sweeps import fingerprints as fps

        return expand(spec, fingerprints if fingerprints is not None else fps.resolve(spec.models, store))

    def cell_from_dict(self, d: dict[str, Any]) -> Cell:
        return Cell.from_dict(d)

    def load(self, cell: Cell) -> tuple[Any, Any]:
        from moelab import load

        log.info("loading %s", cell.model)
        return load(cell.model, dtype=cell.dtype)

    def run(self, cell: Cell, resource: Any, worker: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
        import contextlib

        import moelab
        from moelab.evals.api import evaluate
        from moelab.evals.results import EvalConfig
        from moelab.sweeps.policies import HYBRID, make_policy

        model, tokenizer = resource
        config = EvalConfig(tasks=[cell.task], limit=cell.limit, num_fewshot=cell.num_fewshot, seed=cell.seed,
                            **cell.eval)
        want_trace = bool(cell.artifacts.get("trace"))
        want_timeline = bool(cell.artifacts.get("timeline")) and cell.policy == HYBRID
        paths: dict[str, str | None] = {"samples_path": ".", "trace_path": None, "timeline_path": None}
        with tempfile.TemporaryDirectory(prefix="moelab-cell-") as tmp:
            out = Path(tmp) / "samples"
            files_dir = Path(tmp) / "files"
            files_dir.mkdir()
            with contextlib.ExitStack() as stack:
                policy = stack.enter_context(make_policy(cell.policy, model, cell.settings))
                if want_trace:
                    stack.enter_context(moelab.record(model, files_dir / "trace", model_name=cell.model,
                                                      metadata={"sweep_cell": cell.hash}))
                    paths["trace_path"] = "trace"
                result = evaluate(model, tokenizer, config=config, log_samples_dir=out, model_name=cell.model)
                if want_timeline:  # the run's events, complete once its last forward ended
                    import pyarrow.parquet as pq

                    pq.write_table(policy.events.table(), files_dir / "events.parquet")
                    paths["timeline_path"] = "events.parquet"
            for p in sorted(out.glob("samples_*.jsonl")):
                (files_dir / p.name).write_bytes(p.read_bytes())
            files = read_files(files_dir)
        task = result.tasks[cell.task]
        score = task.score
        se = task.stderr.get(task.primary_metric)
        if se is None and task.n_docs > 1:
            se = math.sqrt(score * (1 - score) / (task.n_docs - 1))
        fields = {
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
            "hybrid": result.hybrid,
            "code_isolation": result.code_isolation,
            "versions": result.versions,
            **paths,
            # {hardware profile: simulated figures}; None until a simulator is registered (#13)
            "latency": {h: None for h in cell.hardware},
        }
        return fields, files

    def row(self, cell: Cell, record: dict[str, Any] | None) -> dict[str, Any]:
        r = record or {}
        settings = {k: v for k, v in cell.settings.items() if k in ("deferred", "immediate", "skipped")}
        return {
            "model": cell.model, "task": cell.task, "policy": cell.policy,
            "settings": ", ".join(f"{k}={v}" for k, v in settings.items()) or "-",
            "affected": cell.affected, "seed": cell.seed,
            "score": r.get("score"), "stderr": r.get("score_stderr"), "n": r.get("n_docs"),
            "wall_s": r.get("wall_s"),
        }


EVAL = EvalKind()
