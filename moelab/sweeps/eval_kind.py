"""The ``eval`` cell kind: a model × routing policy (or hybrid configuration) × task × seed,
scored with lm-eval (:func:`moelab.evals.evaluate`).

A cell's files are lm-eval's per-document logs (``samples_<task>.jsonl``) and, when the
spec asks for them (``artifacts: {trace: true, timeline: true}``), the routing trace of the
cell's evaluation (``trace/``, a :func:`moelab.record` directory) and, for a ``hybrid``
cell, its timeline (``events.parquet``, the schema of :mod:`moelab.hybrid.events`). A spec
with ``hardware:`` profiles also records each cell's simulated latency (``latency[profile]``,
:mod:`moelab.sweeps.latency`) from its own routing trace.
"""

from __future__ import annotations

import logging
import math
import tempfile
from pathlib import Path
from typing import Any

import moelab
from moelab.evals.api import evaluate
from moelab.evals.results import EvalConfig
from moelab.sweeps.kinds import CellKind
from moelab.sweeps.spec import Cell, SweepSpec, cell_key, expand, parse_eval_spec
from moelab.tasks import TASKS, generate, prompt_and_target
from moelab.timing.shapes import ModelShape

log = logging.getLogger(__name__)


def read_files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` as ``relative path → bytes``."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class EvalKind(CellKind):
    name = "eval"
    spec_keys = ("models", "policies", "tasks", "seeds", "hardware", "simulate", "eval", "artifacts", "attribution")

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

        from moelab.sweeps.policies import HYBRID, make_policy

        model, tokenizer = resource
        config = EvalConfig(tasks=[cell.task], limit=cell.limit, num_fewshot=cell.num_fewshot, seed=cell.seed,
                            **cell.eval)
        want_trace = bool(cell.artifacts.get("trace"))
        shape = None
        if cell.hardware:  # the shape first: a mismatch fails the cell before its evaluation runs
            from moelab.sweeps.latency import cell_shape, check_shape

            shape = cell_shape(cell, model)
            live = ModelShape.from_model(model, name=cell.model)
            check_shape(shape, [live.num_experts] * live.num_moe_layers, [live.top_k] * live.num_moe_layers,
                        f"model {cell.model}")
        want_timeline = bool(cell.artifacts.get("timeline")) and cell.policy == HYBRID
        paths: dict[str, str | None] = {"samples_path": ".", "trace_path": None, "timeline_path": None}
        with tempfile.TemporaryDirectory(prefix="moelab-cell-") as tmp:
            out = Path(tmp) / "samples"
            files_dir = Path(tmp) / "files"
            files_dir.mkdir()
            with contextlib.ExitStack() as stack:
                policy = stack.enter_context(make_policy(cell.policy, model, cell.settings))
                # the latency needs the trace too: kept in the store if asked for, else a temporary one
                trace_dir = files_dir / "trace" if want_trace else Path(tmp) / "trace"
                if want_trace or cell.hardware:
                    stack.enter_context(moelab.record(model, trace_dir, model_name=cell.model,
                                                      metadata={"sweep_cell": cell.hash}))
                if want_trace:
                    paths["trace_path"] = "trace"
                result = evaluate(model, tokenizer, config=config, log_samples_dir=out, model_name=cell.model)
                if want_timeline:  # the run's events, complete once its last forward ended
                    import pyarrow.parquet as pq

                    pq.write_table(policy.events.table(), files_dir / "events.parquet")
                    paths["timeline_path"] = "events.parquet"
            attribution = cell_attribution(cell, model, tokenizer) if cell.attribution else {}
            latency = {}
            if cell.hardware:  # the recorder has closed: the trace is complete
                from moelab.sweeps.latency import cell_latency

                latency = cell_latency(cell, trace_dir, shape)
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
            # {hardware profile: simulated figures of the cell's own routing} (moelab.sweeps.latency)
            "latency": latency,
            # the policy against the unmodified model on the task's prompts (moelab.attribution)
            "attribution": attribution,
        }
        return fields, files

    def row(self, cell: Cell, record: dict[str, Any] | None) -> dict[str, Any]:
        r = record or {}
        settings = {k: v for k, v in cell.settings.items() if k in ("deferred", "immediate", "skipped") and v is not None}
        return {
            "model": cell.model, "task": cell.task, "policy": cell.policy,
            "settings": ", ".join(f"{k}={v}" for k, v in settings.items()) or "-",
            "affected": cell.affected, "seed": cell.seed,
            "score": r.get("score"), "stderr": r.get("score_stderr"), "n": r.get("n_docs"),
            "wall_s": r.get("wall_s"),
            **{f"tokens/s {h}": _tps(r, h) for h in cell.hardware},
            **({"mean KL": (r.get("attribution") or {}).get("mean_kl"),
                "top-1 agree": (r.get("attribution") or {}).get("top1_agreement")} if cell.attribution else {}),
        }


def cell_attribution(cell: Cell, model: Any, tokenizer: Any) -> dict[str, Any]:
    """The cell's policy compared with the unmodified model (:func:`moelab.attribution.compare`)
    on the task's first ``limit`` test prompts, teacher-forced on the baseline's greedy generation."""
    from moelab.attribution import compare

    if cell.task not in TASKS:
        return {"error": f"attribution needs a local task's prompts ({', '.join(TASKS)}); {cell.task!r} is not one"}
    a = cell.attribution
    docs = generate(cell.task, "test")
    if a.get("limit"):
        docs = docs[: a["limit"]]
    prompts = [prompt_and_target(cell.task, d)[0] for d in docs]
    policy = None if cell.policy == "none" else (
        {"policy": "hybrid", "config": cell.settings["config"]} if cell.policy == "hybrid"
        else {"policy": cell.policy, **cell.settings})
    att = compare(model, policy, prompts, tokenizer=tokenizer, max_new_tokens=a.get("max_new_tokens") or 32,
                  batch_size=a.get("batch_size") or 8, layers=False)
    out = att.summary()
    out["method"] = "teacher-forced on the baseline's greedy generation"
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def _tps(record: dict[str, Any], profile: str) -> float | None:
    figures = (record.get("latency") or {}).get(profile)
    return figures.get("tokens_per_s") if isinstance(figures, dict) else None


EVAL = EvalKind()
