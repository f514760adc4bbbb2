"""Read a sweep's results: status, tables with standard errors, and the HTML report.

The report has, per model and task, a table of accuracy ± standard error for every policy
setting, and the KTransformers-Fig.-13-style curves: accuracy against experts deferred or
skipped per token, with error bars (± 1 standard error; the Wilson 95 % interval where every
document scored the same and the standard error is 0). The unmodified model is the n = 0
point of both curves. Where records carry a speed (``latency[profile]`` with ``tokens_per_s``
or ``latency_s``; a spec with ``hardware:`` profiles fills it, :mod:`moelab.sweeps.latency`),
the report draws one panel per hardware profile: accuracy against simulated tokens/s, with
the Pareto front of each model and task, and a table of the points; otherwise it says why
there is none. Specs of other kinds (``cache``, ``predictor``) get the table of all cells.
"""

from __future__ import annotations

import html
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moelab._output import reserve_output, write_file_atomic
from moelab.stats import degenerate, format_score, paired_difference, wilson_interval
from moelab.sweeps.spec import Cell, SweepSpec


@dataclass
class CellStatus:
    cell: Cell
    state: str
    """``done``, ``failed`` (attempted, no good record), ``bad`` (record rejected) or ``todo``."""
    record: dict[str, Any] | None = None
    error: str | None = None


def collect(spec: SweepSpec, store: str | os.PathLike | None = None) -> list[CellStatus]:
    """Every cell of ``spec`` with its state in the store (read-only; no lock taken)."""
    from moelab.sweeps.driver import plan, store_path
    from moelab.sweeps.store import open_store

    with open_store(store_path(spec, store), writable=False) as st:
        cells = plan(spec, st)
        good, bad = st.records()
        failures = st.failures()
    out = []
    for c in cells:
        if c.hash in good:
            out.append(CellStatus(c, "done", good[c.hash]))
        elif c.hash in bad:
            out.append(CellStatus(c, "bad", error=bad[c.hash]))
        elif c.hash in failures:
            out.append(CellStatus(c, "failed", error=failures[c.hash].strip().splitlines()[-1]))
        else:
            out.append(CellStatus(c, "todo"))
    return out


def status_text(spec: SweepSpec, statuses: list[CellStatus], store: str) -> str:
    counts = {s: sum(1 for x in statuses if x.state == s) for s in ("done", "todo", "failed", "bad")}
    lines = [f"sweep {spec.name}: {counts['done']}/{len(statuses)} cells done, {counts['todo']} to do, "
             f"{counts['failed']} failed, {counts['bad']} bad record(s) (recomputed on the next run); "
             f"store {store}"]
    for x in statuses:
        if x.state in ("failed", "bad"):
            lines.append(f"  {x.state}: {x.cell.hash} {x.cell.label()}: {x.error}")
    return "\n".join(lines)


def score_text(score: float, se: float | None, n: int) -> str:
    return format_score(score, se, n)


def table_rows(statuses: list[CellStatus]) -> list[dict[str, Any]]:
    """One row per cell, the columns its kind shows (:meth:`CellKind.row`), its state and hash."""
    from moelab.sweeps.kinds import get_kind

    return [{**get_kind(x.cell.kind).row(x.cell, x.record), "state": x.state, "hash": x.cell.hash}
            for x in statuses]


# --------------------------------------------------------------------------- accuracy × speed
@dataclass
class SpeedPoint:
    """One cell's accuracy beside its simulated speed on one hardware profile."""

    status: CellStatus
    profile: str
    score: float
    stderr: float | None
    tokens_per_s: float


def tokens_per_s(figures: Any) -> float | None:
    """Tokens/s from a record's ``latency[profile]`` figures: ``tokens_per_s``, else
    ``1 / latency_s`` (seconds per token); None where neither is there."""
    if not isinstance(figures, dict):
        return None
    v = figures.get("tokens_per_s")
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        return float(v)
    v = figures.get("latency_s")
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        return 1.0 / float(v)
    return None


def speed_points(statuses: list[CellStatus]) -> dict[str, list[SpeedPoint]]:
    """Per hardware profile, every finished cell whose record carries a speed for it."""
    out: dict[str, list[SpeedPoint]] = {}
    for x in statuses:
        if x.state != "done" or not x.record:
            continue
        for profile, figures in (x.record.get("latency") or {}).items():
            tps = tokens_per_s(figures)
            if tps is not None:
                out.setdefault(profile, []).append(
                    SpeedPoint(x, profile, x.record["score"], x.record.get("score_stderr"), tps))
    return out


def pareto_front(points: list[SpeedPoint]) -> list[SpeedPoint]:
    """The points no other point beats on both accuracy and tokens/s (ties kept), by tokens/s."""
    front = [p for p in points if not any(
        (q.score >= p.score and q.tokens_per_s >= p.tokens_per_s)
        and (q.score > p.score or q.tokens_per_s > p.tokens_per_s) for q in points)]
    return sorted(front, key=lambda p: (p.tokens_per_s, -p.score))


def speed_groups(points: list[SpeedPoint]) -> dict[tuple[str, str], list[SpeedPoint]]:
    """Points by (model, task): a Pareto front compares settings of one model on one task."""
    out: dict[tuple[str, str], list[SpeedPoint]] = {}
    for p in points:
        out.setdefault((p.status.cell.model, p.status.cell.task), []).append(p)
    return out


def _label(p: SpeedPoint) -> str:
    from moelab.sweeps.kinds import get_kind

    row = get_kind(p.status.cell.kind).row(p.status.cell, p.status.record)
    return " · ".join(str(row[k]) for k in ("model", "task", "policy", "settings") if k in row)


def pareto_figure(points: list[SpeedPoint], profile: str):
    """Accuracy against simulated tokens/s on ``profile`` (one panel): per model and task, every
    cell with its error bar and that group's Pareto front as a step line."""
    import plotly.graph_objects as go

    fig = go.Figure()
    palette = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
    for i, ((model, task), pts) in enumerate(sorted(speed_groups(points).items())):
        color = palette[i % len(palette)]
        name = f"{model} · {task}"
        bars = [_bar(p.score, p.stderr, p.status.record["n_docs"]) for p in pts]
        fig.add_trace(go.Scatter(
            x=[p.tokens_per_s for p in pts], y=[p.score for p in pts], mode="markers", name=name,
            marker={"color": color}, legendgroup=name,
            error_y={"type": "data", "symmetric": False, "array": [b[1] for b in bars],
                     "arrayminus": [b[0] for b in bars], "visible": True},
            text=[_label(p) for p in pts],
            hovertemplate="%{text}<br>%{x:.1f} tokens/s, accuracy %{y:.3f}<extra></extra>",
        ))
        front = pareto_front(pts)
        fig.add_trace(go.Scatter(x=[p.tokens_per_s for p in front], y=[p.score for p in front], mode="lines",
                                 name=f"Pareto front · {name}", line={"shape": "hv", "color": color},
                                 legendgroup=name, text=[_label(p) for p in front],
                                 hovertemplate="%{text}<extra>Pareto front</extra>"))
    axis = speed_axis(points)
    fig.update_layout(title={"text": f"Accuracy vs {axis} on {profile}<br><sup>± 1 standard error; "
                                     "up and right is better</sup>"}, margin={"t": 80},
                      xaxis_title=axis, yaxis_title="accuracy", height=440)
    fig.update_xaxes(type="log")
    return fig


def speed_axis(points: list[SpeedPoint]) -> str:
    """What the points' tokens/s are: the per-sequence simulated decode, or MoE-Gen's offline-batch
    throughput at the best batch (``simulate: {schedule: moegen}``, :mod:`moelab.sweeps.latency`)."""
    bases = {(p.status.record["latency"][p.profile] or {}).get("tokens_per_s_basis") for p in points}
    if bases == {"moegen"}:
        return "simulated throughput tokens/s (MoE-Gen, best batch)"
    return "simulated decode tokens/s"


def latency_rows(points: list[SpeedPoint]) -> list[dict[str, Any]]:
    """One row per point of one profile: accuracy, tokens/s, decode step, host busy, on the front."""
    rows = []
    for (_model, _task), pts in sorted(speed_groups(points).items()):
        front = {id(p) for p in pareto_front(pts)}
        for p in sorted(pts, key=lambda q: -q.tokens_per_s):
            f = p.status.record["latency"][p.profile]
            rows.append({"cell": _label(p),
                         "accuracy": score_text(p.score, p.stderr, p.status.record["n_docs"]),
                         "tokens/s": f"{p.tokens_per_s:.1f}",
                         "decode step ms": _num(f.get("decode_step_ms")),
                         "host busy %": _num(f.get("host_side_busy_pct"), 0),
                         "Pareto": "yes" if id(p) in front else ""})
    return rows


def _num(v: Any, digits: int = 2) -> str:
    return "" if not isinstance(v, (int, float)) else f"{v:.{digits}f}"


def markdown_latency(statuses: list[CellStatus]) -> str:
    """Markdown: per hardware profile, every cell's accuracy beside its simulated speed."""
    out = []
    for profile, points in sorted(speed_points(statuses).items()):
        rows = latency_rows(points)
        out.append(f"**simulated on {profile}** ({speed_axis(points)} of each cell's own routing; "
                   "Pareto = on its model and task's accuracy-vs-tokens/s front)\n")
        out.append("| " + " | ".join(rows[0]) + " |")
        out.append("|---" * len(rows[0]) + "|")
        out += ["| " + " | ".join(r.values()) + " |" for r in rows]
        out.append("")
    return "\n".join(out)


def _series(statuses: list[CellStatus], model: str, task: str) -> dict[str, dict[int, Any]]:
    """Per curve (``deferral``, ``skipping``; ``… · seed S`` when the sweep has several seeds),
    ``experts affected → cell``, the unmodified model's cell being n = 0."""
    done = [x for x in statuses if x.state == "done" and x.cell.model == model and x.cell.task == task]
    seeds = sorted({x.cell.seed for x in done})
    out: dict[str, dict[int, CellStatus]] = {}
    for policy in ("deferral", "skipping"):
        for seed in seeds:
            mine = [x for x in done if x.cell.seed == seed]
            pts = {x.cell.affected: x for x in mine if x.cell.policy == policy and x.cell.affected is not None}
            if not pts:
                continue
            base = next((x for x in mine if x.cell.policy == "none"), None)
            if base is not None and 0 not in pts:
                pts[0] = base
            out[policy if len(seeds) == 1 else f"{policy} · seed {seed}"] = pts
    return out


def grid_table(statuses: list[CellStatus], model: str, task: str) -> tuple[list[int], dict[str, dict[int, str]]]:
    """Per curve, ``affected n → "score±se (n=…)"`` for one model and task (n=0: unmodified)."""
    series = _series(statuses, model, task)
    rows = {name: {n: score_text(x.record["score"], x.record["score_stderr"], x.record["n_docs"])
                   for n, x in pts.items()} for name, pts in series.items()}
    return sorted({n for pts in series.values() for n in pts}), rows


def markdown_tables(spec: SweepSpec, statuses: list[CellStatus]) -> str:
    """Markdown: per model and task, a row per policy and a column per experts affected."""
    out = []
    if spec.kind != "eval":
        return ""
    for m in spec.models:
        for t in spec.tasks:
            ns, rows = grid_table(statuses, m.name, t.name)
            if not rows:
                continue
            out.append(f"**{m.name} · {t.name}** (accuracy ± standard error; n = experts deferred/skipped "
                       "per token, 0 = unmodified)\n")
            out.append("| policy | " + " | ".join(f"n={n}" for n in ns) + " |")
            out.append("|---|" + "---|" * len(ns))
            for policy, cells in rows.items():
                out.append(f"| {policy} | " + " | ".join(cells.get(n, "") for n in ns) + " |")
            out.append("")
    return "\n".join(out)


def _bar(score: float, se: float | None, n: int) -> tuple[float, float]:
    if degenerate(score, se):
        lo, hi = wilson_interval(score, n)
        return score - lo, hi - score
    return (se or 0.0), (se or 0.0)


def curves_figure(statuses: list[CellStatus], model: str, task: str):
    """Accuracy vs experts deferred or skipped, with error bars (the shape of KTransformers Fig. 13)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, pts in _series(statuses, model, task).items():
        dash = "dash" if name.startswith("skipping") else "solid"
        xs = sorted(pts)
        recs = [pts[n].record for n in xs]
        bars = [_bar(r["score"], r["score_stderr"], r["n_docs"]) for r in recs]
        fig.add_trace(go.Scatter(
            x=xs, y=[r["score"] for r in recs], mode="lines+markers", name=name, line={"dash": dash},
            error_y={"type": "data", "symmetric": False, "array": [b[1] for b in bars],
                     "arrayminus": [b[0] for b in bars], "visible": True},
            text=[score_text(r["score"], r["score_stderr"], r["n_docs"]) for r in recs],
            hovertemplate="n=%{x}: %{text}<extra>" + name + "</extra>",
        ))
    fig.update_layout(title={"text": f"{model} · {task}: accuracy vs experts deferred or skipped per token<br><sup>"
                                     "± 1 standard error; Wilson 95% where every document scored the same</sup>"},
                      xaxis_title="experts affected per token", yaxis_title="accuracy", height=420, margin={"t": 80})
    fig.update_xaxes(tick0=0, dtick=1)  # whole experts: no 0.2, 0.4 … ticks
    return fig


def notes_html(statuses: list[CellStatus]) -> str:
    """What each finished cell's evaluation noted (answers cut at ``max_gen_toks``, truncated
    prompts, a limit above the task's size), one line per distinct note with the cells it holds for."""
    notes: dict[str, list[str]] = {}
    for x in statuses:
        for n in (x.record or {}).get("notes") or []:
            notes.setdefault(str(n), []).append(x.cell.label())
    if not notes:
        return ""
    items = "".join(f"<li>{html.escape(n)} <i>({len(cells)} cell(s): {html.escape('; '.join(cells[:3]))}"
                    f"{' …' if len(cells) > 3 else ''})</i></li>" for n, cells in notes.items())
    return f"<h2>Notes from the evaluations</h2><ul>{items}</ul>"


def doc_scores(store: Path, record: dict[str, Any], task: str) -> dict[str, float]:
    """``doc id → score`` of a finished eval cell, from the per-document log lm-eval wrote
    (``samples_<task>.jsonl`` in the cell's folder), on the record's primary metric and filter."""
    rel = record.get("samples_path")
    if not rel:
        return {}
    metric, _, filt = str(record.get("primary_metric") or "").partition(",")
    out: dict[str, float] = {}
    for f in sorted((Path(store) / rel).glob(f"samples_{task}*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if filt and row.get("filter") not in (None, filt):
                continue
            v = row.get(metric)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[str(row["doc_id"])] = float(v)
    return out


def paired_rows(statuses: list[CellStatus], store: str | os.PathLike) -> list[dict[str, Any]]:
    """Every finished eval cell against the unmodified model's cell of the same model, task, limit
    and seed, document by document (:func:`moelab.stats.paired_difference`): the accuracy
    difference with its paired and unpaired standard errors, the discordant documents and McNemar's p."""

    done = [x for x in statuses if x.state == "done" and x.cell.kind == "eval"]
    base = {(x.cell.model, x.cell.task, x.cell.limit, x.cell.seed): x for x in done if x.cell.policy == "none"}
    rows, cache = [], {}

    def scores(x):
        if x.cell.hash not in cache:
            cache[x.cell.hash] = doc_scores(Path(store), x.record, x.cell.task)
        return cache[x.cell.hash]

    for x in done:
        b = base.get((x.cell.model, x.cell.task, x.cell.limit, x.cell.seed))
        if b is None or b is x:
            continue
        r = paired_difference(scores(b), scores(x))
        if not r["n"]:
            continue
        label = x.cell.label().split(" · ")
        rows.append({"model": x.cell.model, "task": x.cell.task, "cell": " · ".join(label[1:2] + label[3:]),
                     **r})
    return rows


def markdown_paired(rows: list[dict[str, Any]]) -> str:
    """:func:`paired_rows` as a Markdown table (empty when there is nothing to pair)."""
    if not rows:
        return ""
    lines = ["| model | task | cell | docs | Δ accuracy | paired SE | unpaired SE | discordant +/− | McNemar p |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = "" if r["mcnemar_p"] is None else f"{r['mcnemar_p']:.3g}"
        lines.append(f"| {r['model']} | {r['task']} | {r['cell']} | {r['n']} | {r['diff']:+.3f} | {r['paired_se']:.3f} "
                     f"| {r['unpaired_se']:.3f} | {r['n01']} / {r['n10']} | {p} |")
    return "\n".join(lines)


def paired_html(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""

    def f(v, fmt):
        return "" if v is None else fmt.format(v)

    body = "".join(
        f"<tr><td>{html.escape(r['model'])}</td><td>{html.escape(r['task'])}</td><td>{html.escape(r['cell'])}</td>"
        f"<td>{r['n']}</td><td>{f(r['diff'], '{:+.3f}')}</td><td>{f(r['paired_se'], '{:.3f}')}</td>"
        f"<td>{f(r['unpaired_se'], '{:.3f}')}</td><td>{r['n01']} / {r['n10']}</td>"
        f"<td>{f(r['mcnemar_p'], '{:.3g}')}</td></tr>" for r in rows)
    return ("<h2>Paired differences against the unmodified model</h2><p>Per document: the same documents "
            "scored with and without the policy, so the standard error of the difference is the paired one "
            "(the unpaired one beside it, for comparison); discordant = documents only the policy got right / "
            "only the unmodified model got right; McNemar's exact test on them.</p><table><tr><th>model</th>"
            "<th>task</th><th>cell</th><th>docs</th><th>Δ accuracy</th><th>paired SE</th><th>unpaired SE</th>"
            f"<th>discordant +/−</th><th>McNemar p</th></tr>{body}</table>")


PLOTLY_FILE = "plotly.min.js"


def write_html(spec: SweepSpec, statuses: list[CellStatus], out: str | os.PathLike, *,
               overwrite: bool = False, self_contained: bool = False, store: str | os.PathLike | None = None) -> Path:
    """The sweep's report as HTML, written atomically. plotly.js is written once beside it
    (``plotly.min.js``, shared by the reports in that folder: a report stays small and opens
    offline); ``self_contained=True`` embeds it instead (one ~5 MB file to send around)."""

    parts = [f"<h1>Sweep {html.escape(spec.name)}</h1>"]
    if spec.description:
        parts.append(f"<p>{html.escape(spec.description)}</p>")
    n_done = sum(x.state == "done" for x in statuses)
    parts.append(f"<p>{n_done} of {len(statuses)} cells done.</p>")
    parts.append(notes_html(statuses))
    if spec.kind == "eval":
        from moelab.sweeps.driver import store_path

        parts.append(paired_html(paired_rows(statuses, store_path(spec, store))))
    first = self_contained  # embed plotly.js with the first figure, or load plotly.min.js beside the report
    if not self_contained:
        parts.insert(0, f"<script src='{PLOTLY_FILE}'></script>")
    for m in (spec.models if spec.kind == "eval" else []):
        for t in spec.tasks:
            ns, rows = grid_table(statuses, m.name, t.name)
            if not rows:
                continue
            parts.append(f"<h2>{html.escape(m.name)} · {html.escape(t.name)}</h2>")
            head = "".join(f"<th>n={n}</th>" for n in ns)
            body = "".join(f"<tr><th>{html.escape(p)}</th>" + "".join(
                f"<td>{html.escape(cells.get(n, ''))}</td>" for n in ns) + "</tr>" for p, cells in rows.items())
            parts.append(f"<table><tr><th>policy</th>{head}</tr>{body}</table>")
            fig = curves_figure(statuses, m.name, t.name)
            parts.append(fig.to_html(full_html=False, include_plotlyjs=first))
            first = False
    speed = speed_points(statuses)
    for profile, points in sorted(speed.items()):
        axis = speed_axis(points)
        heading = "simulated tokens/s" if axis == "simulated decode tokens/s" else axis
        parts.append(f"<h2>Accuracy vs {html.escape(heading)} · {html.escape(profile)}</h2>")
        n_front = sum(len(pareto_front(g)) for g in speed_groups(points).values())
        parts.append(f"<p>{len(points)} cell(s); {n_front} on a Pareto front (per model and task: no other "
                     "setting is both more accurate and faster). Speeds are each cell's own routing trace "
                     "planned and simulated on this profile (moelab.sweeps.latency).</p>")
        parts.append(pareto_figure(points, profile).to_html(full_html=False, include_plotlyjs=first))
        first = False
        rows = latency_rows(points)
        parts.append("<table><tr>" + "".join(f"<th>{html.escape(k)}</th>" for k in rows[0]) + "</tr>" + "".join(
            "<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r.values()) + "</tr>" for r in rows)
            + "</table>")
    if not speed and spec.kind == "eval":
        parts.append("<h2>Simulated latency</h2><p>No simulated latency: "
                     + ("no finished cell carries one yet." if spec.hardware else
                        "the spec lists no hardware profiles; add hardware: [PROFILE, ...] to simulate each "
                        "cell's routing and draw accuracy against tokens/s with its Pareto front.") + "</p>")
    parts.append("<h2>All cells</h2>")
    rows = table_rows(statuses)
    keys = list(rows[0]) if rows else []

    def fmt(v: Any) -> str:
        if v is None:
            return ""
        return f"{v:.4f}" if isinstance(v, float) else html.escape(str(v))

    parts.append("<table><tr>" + "".join(f"<th>{k}</th>" for k in keys) + "</tr>" + "".join(
        "<tr>" + "".join(f"<td>{fmt(r[k])}</td>" for k in keys) + "</tr>" for r in rows) + "</table>")
    page = _TEMPLATE.format(title=html.escape(f"moelab sweep — {spec.name}"), body="\n".join(parts))
    target = Path(out).expanduser()
    with reserve_output(target, overwrite=overwrite, what="report", kind="file",
                        hint="pass --overwrite or choose another path") as res:
        res.staging.write_text(page, encoding="utf-8")
        if not self_contained:
            _write_plotly(target.parent)
        res.commit()
    return target


def _write_plotly(folder: Path) -> None:
    """plotly.js beside the report (atomically; kept when an identical copy is there)."""
    from plotly.offline import get_plotlyjs

    js = get_plotlyjs()
    dest = folder / PLOTLY_FILE
    if dest.exists() and dest.stat().st_size == len(js.encode("utf-8")):
        return
    folder.mkdir(parents=True, exist_ok=True)
    write_file_atomic(dest, js)


_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}}
table{{border-collapse:collapse;margin:1em 0;font-size:90%}}td,th{{border:1px solid #ccc;padding:3px 8px}}
th{{background:#f4f4f4}}</style></head><body>
{body}
</body></html>
"""
