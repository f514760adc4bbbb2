"""Deferral versus skipping: accuracy against the number of affected experts (KTransformers Fig. 13).

>>> cmp = compare_policies(model, tok, tasks=["arith"], deferred=[0, 1, 2, 3], skipped=[0, 1, 2, 3], limit=20)
>>> print(cmp.table())
>>> cmp.heatmap().show()

The unmodified model (0 affected experts) is scored once and is the baseline of both
rows. The sweep lifts the guards (``min_immediate=0`` for deferral, ``min_kept=0`` for
skipping) so it can go as far as the paper's figure, which defers or skips up to all
routed experts; the last MoE layer never defers, while skipping acts on every MoE layer.

It lives in :mod:`moelab.evals` (it scores with lm-eval), above the policies it applies:
components never import evaluation.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from moelab.errors import MoelabError
from moelab.policies.base import PolicyPhase
from moelab.policies.registry import make_policy
from moelab.stats import degenerate, format_score, wilson_interval

log = logging.getLogger(__name__)

PolicyKind = Literal["deferral", "skipping"]


@dataclass
class PolicyPoint:
    """One cell of the comparison: a policy, a number of affected experts, a task."""

    policy: PolicyKind
    """``deferral`` or ``skipping``."""
    n: int
    """Experts deferred or skipped per token (0: the unmodified model)."""
    task: str
    """moelab task name."""
    score: float
    """The task's headline metric (exact match, pass@1) in [0, 1]."""
    relative_change: float | None
    """``100 · (score − baseline) / baseline`` in percent; None when the baseline is 0."""
    n_docs: int
    """Documents scored."""
    stderr: float | None = None
    """Standard error of ``score`` (lm-eval's; the sample one when lm-eval gives none)."""
    relative_stderr: float | None = None
    """Standard error of ``relative_change`` in percentage points (delta method, treating the
    cell and the baseline as independent: an upper bound for the same documents); None when the
    baseline is 0."""

    def score_text(self) -> str:
        """``0.650±0.109 (n=20)``; at a score of 0 or 1, where the standard error is 0, also the
        Wilson 95 % interval: ``0.000±0.000 [95% CI 0.000–0.561] (n=3)``."""
        return format_score(self.score, self.stderr, self.n_docs)

    @property
    def degenerate(self) -> bool:
        """True when ``stderr`` is 0 only because every document scored the same (0 or 1)."""
        return degenerate(self.score, self.stderr)

    def ci95(self) -> tuple[float, float]:
        """Wilson 95 % interval of ``score`` over ``n_docs`` (informative also at 0 and 1)."""
        return wilson_interval(self.score, self.n_docs)

    def _cell_score(self) -> str:
        text = f"{self.score:.3f}±{_se(self.stderr)}"
        if self.degenerate:
            lo, hi = self.ci95()
            text += f" [{lo:.3f}–{hi:.3f}]"
        return text


@dataclass
class PolicyComparison:
    """The result of :func:`compare_policies`."""

    model: str
    """The model's name."""
    tasks: list[str]
    """Tasks scored."""
    phase: PolicyPhase
    """Where the policies acted (``decode`` or ``all``)."""
    renormalize: bool
    """Whether skipping renormalised the kept weights."""
    limit: int | None
    """Documents per task (None: all)."""
    points: list[PolicyPoint] = field(default_factory=list)
    """Every (policy, n, task) cell; n = 0 is the shared baseline."""

    def to_dict(self) -> dict[str, Any]:
        """Every field, and per point its Wilson 95 % interval (``ci95_wilson``)."""
        d = asdict(self)
        for point, p in zip(d["points"], self.points):
            point["ci95_wilson"] = list(p.ci95())
        return d

    def cell(self, policy: str, n: int, task: str) -> PolicyPoint | None:
        return next((p for p in self.points if p.policy == policy and p.n == n and p.task == task), None)

    def counts(self, policy: str) -> list[int]:
        return sorted({p.n for p in self.points if p.policy == policy})

    def table(self) -> str:
        """Plain text: per task and policy, ``score (relative change %)`` for each n."""
        ns = sorted({p.n for p in self.points})
        header = ["task", "policy", *[f"n={n}" for n in ns]]
        rows = [header]
        for task in self.tasks:
            for policy in ("deferral", "skipping"):
                if not self.counts(policy):
                    continue
                row = [task, policy]
                for n in ns:
                    c = self.cell(policy, n, task)
                    row.append("" if c is None else f"{c._cell_score()} "
                               f"({_pct(c.relative_change, c.relative_stderr)})")
                rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        docs = sorted({p.n_docs for p in self.points})
        lines.append(f"# n = experts deferred/skipped per token; accuracy ± standard error over "
                     f"{'/'.join(map(str, docs))} documents per cell; (relative change vs n=0 ± standard error); "
                     f"phase={self.phase}, limit={self.limit}, skipping renormalize={self.renormalize}")
        if any(p.degenerate for p in self.points):
            lines.append("# [lo–hi]: Wilson 95% interval, shown where every document scored the same (0 or 1) "
                         "and the standard error is therefore 0")
        return "\n".join(lines)

    def heatmap(self):
        """A plotly heatmap: rows policy × task, columns n, colour the relative change (%)."""
        import plotly.graph_objects as go

        ns = sorted({p.n for p in self.points})
        ys, z, text = [], [], []
        for task in self.tasks:
            for policy in ("deferral", "skipping"):
                if not self.counts(policy):
                    continue
                ys.append(f"{policy} · {task}")
                cells = [self.cell(policy, n, task) for n in ns]
                z.append([None if c is None else c.relative_change for c in cells])
                text.append(["" if c is None else f"{c._cell_score()}<br>"
                             f"{_pct(c.relative_change, c.relative_stderr)}<br>n={c.n_docs}" for c in cells])
        fig = go.Figure(go.Heatmap(
            x=[str(n) for n in ns], y=ys, z=z, text=text, texttemplate="%{text}",
            colorscale="RdBu", zmid=0, colorbar={"title": "Δ accuracy (%)"},
            hovertemplate="%{y}, n=%{x}: %{text}<extra></extra>",
        ))
        fig.update_layout(
            title=f"{self.model}: relative accuracy change vs experts deferred or skipped "
                  f"(± standard error; phase={self.phase}, {self._docs_label()})",
            xaxis_title="experts affected per token", yaxis_title="", yaxis_autorange="reversed",
        )
        return fig

    def line_figure(self):
        """Accuracy versus n, one line per policy and task (the shape of the paper's Figure 13)."""
        import plotly.graph_objects as go

        fig = go.Figure()
        for task in self.tasks:
            for policy, dash in (("deferral", "solid"), ("skipping", "dash")):
                pts = sorted((p for p in self.points if p.policy == policy and p.task == task), key=lambda p: p.n)
                if pts:
                    fig.add_trace(go.Scatter(
                        x=[p.n for p in pts], y=[p.score for p in pts], mode="lines+markers",
                        name=f"{policy} · {task}", line={"dash": dash},
                        error_y={"type": "data", "symmetric": False, "visible": True,
                                 "array": [_bar(p)[1] for p in pts], "arrayminus": [_bar(p)[0] for p in pts]},
                        text=[p.score_text() for p in pts], hovertemplate="n=%{x}: %{text}<extra></extra>",
                    ))
        wilson = "; Wilson 95% interval where accuracy is 0 or 1" if any(p.degenerate for p in self.points) else ""
        fig.update_layout(title=f"{self.model}: accuracy vs experts deferred or skipped "
                                f"(error bars: ± 1 standard error{wilson}; {self._docs_label()})",
                          xaxis_title="experts affected per token", yaxis_title="accuracy")
        return fig

    def _docs_label(self) -> str:
        docs = sorted({p.n_docs for p in self.points})
        return f"n={'/'.join(map(str, docs))} documents per point"

    def write_html(self, path) -> None:
        """The heatmap as a self-contained HTML file (plotly embedded, opens offline)."""
        self.heatmap().write_html(str(path), include_plotlyjs=True)


def _pct(x: float | None, se: float | None = None) -> str:
    if x is None:
        return "n/a"
    return f"{x:+.1f}%" if se is None else f"{x:+.1f}±{se:.1f}%"


def _bar(p: PolicyPoint) -> tuple[float, float]:
    """Error bar (below, above): ± stderr, or the Wilson 95 % interval where stderr is 0 because
    the score is 0 or 1 (a zero-height bar would claim certainty from a handful of documents)."""
    if p.degenerate:
        lo, hi = p.ci95()
        return p.score - lo, hi - p.score
    se = p.stderr or 0.0
    return se, se


def _se(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _stderr(score: float, stderr: float | None, n: int) -> float | None:
    """lm-eval's stderr, else the sample standard error of a mean of 0/1 scores."""
    if stderr is not None:
        return stderr
    return math.sqrt(score * (1 - score) / (n - 1)) if n > 1 and 0 <= score <= 1 else None


def _relative_stderr(s: float, se: float | None, b: float, se_b: float | None) -> float | None:
    """Standard error of ``100 · (s − b) / b`` by the delta method (independent s and b)."""
    if not b or se is None or se_b is None:
        return None
    return 100.0 * math.sqrt((se / b) ** 2 + (s * se_b / b**2) ** 2)


def compare_policies(
    model: Any,
    tokenizer: Any,
    tasks: str | list[str] = ("arith",),
    *,
    deferred: list[int] = (0, 1, 2),
    skipped: list[int] = (0, 1, 2),
    limit: int | None = None,
    phase: PolicyPhase = "decode",
    renormalize: bool = False,
    model_name: str | None = None,
    **eval_settings: Any,
) -> PolicyComparison:
    """Score ``model`` unmodified and under each deferral and skipping count on ``tasks``.

    ``eval_settings`` go to :func:`moelab.evals.evaluate` (``batch_size``, ``max_gen_toks``,
    ``allow_code_execution``, ``gsm8k_dir``, ...). All settings are checked against the
    model before anything is scored.

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    from moelab.evals import evaluate

    task_list = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    runs: list[tuple[str, int, Any]] = []
    for n in sorted(set(deferred)):
        if n:
            runs.append(("deferral", n, make_policy("deferral", model, deferred=n, phase=phase, min_immediate=0)))
    for n in sorted(set(skipped)):
        if n:
            runs.append(("skipping", n, make_policy("skipping", model, skipped=n, phase=phase,
                                                    renormalize=renormalize, min_kept=0)))
    if not runs and not (0 in deferred or 0 in skipped):
        raise MoelabError("nothing to compare: pass deferred and/or skipped counts, e.g. [0, 1, 2].")
    for _, _, policy in runs:  # refuse a setting that does not fit the model before scoring anything
        with policy:
            pass

    name = model_name or str(getattr(model, "name_or_path", "") or type(model).__name__)
    cmp = PolicyComparison(model=name, tasks=task_list, phase=phase, renormalize=renormalize, limit=limit)

    def score(policy) -> dict[str, tuple[float, int, float | None]]:
        if policy is None:
            result = evaluate(model, tokenizer, task_list, limit=limit, model_name=name, **eval_settings)
        else:
            with policy:
                result = evaluate(model, tokenizer, task_list, limit=limit, model_name=name, **eval_settings)
        return {
            t: (r.score, r.n_docs, _stderr(r.score, r.stderr.get(r.primary_metric), r.n_docs))
            for t, r in result.tasks.items()
        }

    log.info("scoring the unmodified model on %s", ", ".join(task_list))
    base = score(None)
    from tqdm.auto import tqdm

    scored = []
    for kind, n, policy in tqdm(runs, desc="policies", disable=not runs):
        log.info("scoring %s n=%d", kind, n)
        scored.append((kind, n, score(policy)))
    return comparison_from_scores(cmp, base, scored, deferred, skipped)


Scores = dict[str, tuple[float, int, float | None]]
"""Per task: (score, documents, standard error)."""


def comparison_from_scores(cmp: PolicyComparison, base: Scores, runs: list[tuple[str, int, Scores]],
                           deferred: list[int], skipped: list[int]) -> PolicyComparison:
    """Fill ``cmp.points`` from the unmodified model's scores (``base``) and each
    ``(policy, n, scores)`` run: the one place the comparison's points, relative changes and
    their standard errors are made (:func:`compare_policies`, and ``moelab compare-policies``,
    which scores the same cells with the sweep engine)."""
    for kind, counts in (("deferral", deferred), ("skipping", skipped)):
        if 0 in counts or any(counts):
            for task, (s, n_docs, se) in base.items():
                cmp.points.append(PolicyPoint(kind, 0, task, s, 0.0 if s else None, n_docs, se))
    for kind, n, scores in runs:
        for task, (s, n_docs, se) in scores.items():
            b, _, se_b = base[task]
            rel = 100.0 * (s - b) / b if b else None
            cmp.points.append(PolicyPoint(kind, n, task, s, rel, n_docs, se,  # type: ignore[arg-type]
                                          _relative_stderr(s, se, b, se_b)))
    return cmp
