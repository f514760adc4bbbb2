"""The settings of an evaluation and what it measured (plain dataclasses, JSON-ready)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from moelab.errors import MoelabError
from moelab.stats import degenerate, wilson_interval


@dataclass
class EvalConfig:
    """How to score a model; drives :func:`moelab.evals.evaluate` and ``moelab eval`` alike."""

    tasks: list[str] = field(default_factory=lambda: ["arith"])
    """moelab task names (``moelab.evals.eval_task_names()``)."""
    limit: int | None = None
    """Score only the first ``limit`` documents of each task (None: all). Larger than the split: all."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt; None keeps each task's standard setting (gsm8k 8, others 0)."""
    allow_code_execution: bool = False
    """Opt-in to run model-generated code (pycode, humaneval) in moelab's sandbox."""
    batch_size: int = 1
    """Prompts per forward pass in lm-eval."""
    seed: int = 1234
    """Seed of lm-eval's python/numpy/torch RNGs and few-shot sampling (1234: lm-eval's default)."""
    max_gen_toks: int | None = None
    """Cap on generated tokens per answer (None: the task's; lowered to fit a short context)."""
    gsm8k_dir: str | None = None
    """Directory of the local GSM8K copy (None: ``$MOELAB_GSM8K_DIR``)."""
    humaneval_path: str | None = None
    """Local HumanEval directory or file (None: ``$MOELAB_HUMANEVAL_DIR``)."""
    code_timeout_s: float = 10.0
    """Wall-clock seconds each generated program may run in the sandbox."""
    sandbox_isolation: str | None = None
    """The least isolation level of the code sandbox to accept (``rlimits`` < ``namespaces``;
    ``moelab.evals.sandbox.LEVELS``); None: ``namespaces``, or ``$MOELAB_SANDBOX_MIN_ISOLATION``.
    Code tasks are refused when the machine offers less."""

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str):
            self.tasks = [t for t in self.tasks.split(",") if t.strip()]
        for name in ("limit", "batch_size", "max_gen_toks"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise MoelabError(f"{name}={value!r}: expected a positive integer or None.")
        if self.num_fewshot is not None and (
            not isinstance(self.num_fewshot, int) or self.num_fewshot < 0
        ):
            raise MoelabError(f"num_fewshot={self.num_fewshot!r}: expected an integer ≥ 0 or None.")
        if not self.code_timeout_s > 0:
            raise MoelabError(f"code_timeout_s={self.code_timeout_s!r}: expected seconds > 0.")
        if self.sandbox_isolation is not None:
            from moelab.evals.sandbox import check_level

            check_level(self.sandbox_isolation, "sandbox_isolation")


@dataclass
class TaskResult:
    """The scores of one task."""

    task: str
    """moelab task name."""
    lm_eval_task: str
    """The lm-eval task that ran."""
    metrics: dict[str, float]
    """lm-eval's ``metric,filter`` keys (e.g. ``exact_match,strict-match``) to values in [0, 1]."""
    stderr: dict[str, float]
    """Standard errors of ``metrics`` (same keys), where lm-eval computed them."""
    primary_metric: str
    """The key of the headline number in ``metrics``."""
    n_docs: int
    """Documents scored."""
    n_available: int
    """Documents in the evaluated split."""
    num_fewshot: int
    """Few-shot examples per prompt that were used."""
    notes: list[str] = field(default_factory=list)
    """Things worth knowing about this run (e.g. limit larger than the split)."""

    @property
    def score(self) -> float:
        """The headline number (``metrics[primary_metric]``)."""
        return self.metrics[self.primary_metric]


@dataclass
class EvalResult:
    """What :func:`moelab.evals.evaluate` measured, with everything needed to reproduce it."""

    model: str
    """The model's name or path (``config.name_or_path``)."""
    tasks: dict[str, TaskResult]
    """Per task name, its scores."""
    config: EvalConfig
    """The settings used."""
    versions: dict[str, str]
    """Versions of moelab, torch, transformers, lm_eval and python."""
    samples_dir: str | None = None
    """Where per-sample logs were written, if asked for."""
    policies: list[dict[str, Any]] = field(default_factory=list)
    """Routing policies active on the model while it was scored (class and settings), in
    the order applied; empty for the unmodified model."""
    hybrid: dict[str, Any] | None = None
    """The hybrid configuration (``moelab.hybrid``) the model was scored under, or None."""
    code_isolation: str | None = None
    """The isolation level of the sandbox that ran model-generated code (``namespaces``,
    ``rlimits``); None when no task ran generated code."""

    def score(self, task: str) -> float:
        """The headline number of ``task``."""
        return self.tasks[task].score

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``json.dumps(result.to_dict())``)."""
        return asdict(self)

    def setup_lines(self) -> list[str]:
        """What the model was scored under, one line each: the routing policies and the hybrid
        configuration (empty for the unmodified model)."""
        lines = []
        for p in self.policies:
            settings = ", ".join(f"{k}={v}" for k, v in p.items() if k != "policy")
            lines.append(f"scored under {p['policy']}({settings})")
        h = self.hybrid
        if h:
            cache, routing, prefetch = h.get("cache") or {}, h.get("routing") or {}, h.get("prefetch") or {}
            parts = [f"executor {h.get('executor')}", f"placement {h.get('placement')}",
                     f"cache {cache.get('policy')} capacity {cache.get('capacity')} ({cache.get('scope')})",
                     f"deferred {routing.get('deferred')}, skipped {routing.get('skipped')} "
                     f"(phase {routing.get('phase')}, min_immediate {routing.get('min_immediate')})",
                     f"prefetch {prefetch.get('predictor') or 'none'}"
                     + (f" at distance {prefetch.get('distance')}" if prefetch.get("predictor") else "")]
            if h.get("hardware"):
                parts.append(f"hardware {h['hardware']}")
            lines.append("scored under the hybrid configuration: " + "; ".join(parts))
        return lines

    def table(self) -> str:
        """A plain-text table: one row per task and metric, with lm-eval's standard error and n.

        Where a metric is 0 or 1 with a zero standard error (every document scored the same),
        the Wilson 95 % interval follows it in brackets (:func:`moelab.stats.wilson_interval`)."""

        rows = [("task", "metric", "value", "stderr", "n")]
        marked = False
        for t in self.tasks.values():
            for key, value in t.metrics.items():
                se = t.stderr.get(key)
                se_text = "" if se is None else f"{se:.4f}"
                if degenerate(value, se):  # every document scored the same: a 0 stderr claims certainty
                    lo, hi = wilson_interval(value, t.n_docs)
                    se_text += f" [{lo:.4f}–{hi:.4f}]"
                    marked = True
                rows.append((t.task, key, f"{value:.4f}", se_text, str(t.n_docs)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        if marked:
            lines.append("# [lo–hi]: Wilson 95% interval, shown where every document scored the same (0 or 1) "
                         "and the standard error is therefore 0")
        return "\n".join(lines)
