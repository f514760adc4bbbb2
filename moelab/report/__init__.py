"""The self-contained HTML report of ``moelab demo``, built from registered sections.

A section is registered with :func:`register_section`: a name, a title, a sentence saying
what to read in it, and a function ``(ctx: ReportContext) -> Section | None`` that returns
labelled plotly figures (each with a title) and optional HTML. ``build_report`` runs the
chosen sections in order and writes one HTML file with plotly.js embedded once, so it opens
offline. A section that raises is drawn as an error box (the report is still written, and
:attr:`Report.failed` names it); a section that raises :class:`SectionUnavailable` is drawn
as "not available in this build" with its reason.
"""

from __future__ import annotations

import html
import logging
import re
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moelab import __version__
from moelab._output import reserve_output
from moelab.errors import MoelabError, unknown_name
from moelab.measure import MAX_LOAD_PER_CPU, machine_load
from moelab.registry import Registry

log = logging.getLogger(__name__)


@dataclass
class ReportContext:
    """What sections can use: the loaded model, its tokenizer, a recorded trace, settings."""

    model: Any
    tokenizer: Any
    model_name: str
    trace: Any
    workdir: Path
    """A scratch directory for sections that write files (traces, logs)."""
    quick: bool = False
    """Sections should keep their work to seconds (tests, smoke runs)."""
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class Section:
    title: str = ""
    """Overrides the registered title when not empty."""
    figures: list[Any] = field(default_factory=list)
    """plotly figures, drawn in order after the text; each must have a title."""
    html: str = ""
    """Extra HTML (tables, notes) placed before the figures."""


class SectionUnavailable(Exception):
    """Raised by a section whose capability is not in this build (the reason is shown)."""


SectionFn = Callable[[ReportContext], "Section | None"]


@dataclass(frozen=True)
class ReportSection:
    """A registered section: its builder, its place in the report, its title and reading guide."""

    name: str
    fn: SectionFn
    order: int = 100
    """Lower comes first (ties by name); data, so registering never re-sorts anything."""
    title: str = ""
    """Heading of the section (default: the name)."""
    read: str = ""
    """One sentence: what to read in the figures."""

    @property
    def heading(self) -> str:
        return self.title or self.name


@dataclass
class SectionOutcome:
    """How one section went: ``ok``, ``failed`` (an error box) or ``unavailable``."""

    name: str
    title: str
    status: str
    seconds: float
    figures: int = 0
    error: str = ""


@dataclass
class Report:
    """What :func:`build_report` wrote: the file and each section's outcome."""

    path: Path
    sections: list[SectionOutcome]

    @property
    def failed(self) -> list[SectionOutcome]:
        return [s for s in self.sections if s.status == "failed"]

    @property
    def figures(self) -> int:
        return sum(s.figures for s in self.sections)


def _load_builtin_sections() -> None:
    import importlib

    for module in BUILTIN_SECTION_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:  # a capability that is not installed: its section is skipped
            log.debug("report section module %s not available: %s", module, exc)


#: Report sections by name (:class:`ReportSection` instances); the built-ins register on first lookup.
SECTIONS: Registry[ReportSection] = Registry(
    "report section", base=ReportSection, instances=True, loader=_load_builtin_sections
)


def register_section(name: str, fn: SectionFn, order: int = 100, *, title: str = "", read: str = "",
                     overwrite: bool = False) -> ReportSection:
    """Add a report section; lower ``order`` comes first. ``title`` heads it and ``read`` is one
    sentence saying what to read in its figures.

    A different section under a registered name raises (naming both places) unless ``overwrite=True``.
    """
    section = ReportSection(name, fn, order, title, read)
    SECTIONS.register(name, section, overwrite=overwrite, stacklevel=2)
    return section


def ordered_sections() -> list[ReportSection]:
    """The registered sections in report order (``order``, then name)."""
    return sorted((SECTIONS.get(n) for n in SECTIONS.names()), key=lambda s: (s.order, s.name))


def section_names() -> list[str]:
    return [s.name for s in ordered_sections()]


def check_sections(sections: Sequence[str] | None, skip: Sequence[str] | None = None) -> list[str]:
    """The section names to build, in report order: ``sections`` (None: all) less ``skip``.

    Unknown names, and a choice that leaves nothing, are refused before any work is done.
    """

    known = section_names()
    for names in (sections, skip):
        for name in names or ():
            if name not in known:
                raise unknown_name("report section", name, known)
    if sections is not None and not sections:
        raise MoelabError(f"no report sections selected; choose from: {', '.join(known)}.")
    both = [n for n in (sections or ()) if n in (skip or ())]
    if both:
        raise MoelabError(f"section(s) {', '.join(both)} are both chosen (--sections) and skipped (--skip); "
                          "name each section in one of them.")
    chosen = [n for n in known if (sections is None or n in sections) and n not in (skip or ())]
    if not chosen:
        raise MoelabError(f"--skip leaves no report sections; known: {', '.join(known)}.")
    return chosen


#: Modules that register sections when imported.
BUILTIN_SECTION_MODULES: list[str] = [
    "moelab.report.routing", "moelab.report.accuracy", "moelab.report.policies", "moelab.report.predictors",
    "moelab.report.caches", "moelab.report.kernels", "moelab.report.hybrid", "moelab.report.simulate",
    "moelab.report.attribution",
]


def _check_labelled(fig: Any, index: int) -> None:
    title = getattr(getattr(fig.layout, "title", None), "text", None)
    if not title:
        raise MoelabError(f"figure {index} of the section has no title; set fig.update_layout(title=...).")


def _finite_points(trace: Any) -> int:
    """Finite values a plotly trace plots: its first given of y, z, values (x only for traces
    that have none of them, e.g. a histogram); nested lists flattened."""
    import numpy as np

    for key in ("y", "z", "values", "x"):
        data = getattr(trace, key, None) if key in getattr(trace, "_valid_props", ()) else None
        if data is None:
            continue
        try:
            a = np.asarray(data, dtype=float).ravel()
        except (TypeError, ValueError):  # categories or text: each one is a plotted value
            return len(list(data))
        return int(np.isfinite(a).sum())
    return 0


def check_has_data(fig: Any, index: int) -> None:
    """Refuse a figure that would draw empty axes: no trace with a finite value."""
    if not any(_finite_points(t) for t in fig.data):
        title = getattr(getattr(fig.layout, "title", None), "text", None) or f"figure {index}"
        raise MoelabError(f"figure {title!r} has no data to plot (every trace is empty or NaN): the section's "
                          "inputs produced nothing; a report must not show empty axes as a result.")


_NAN_CELL = re.compile(r">\s*(?:nan|NaN)\s*<")
_NUM_CELL = re.compile(r">\s*[-+]?\d[\d.,]*(?:e[-+]?\d+)?\s*%?\s*<")


def check_no_nan(body: str) -> None:
    """Refuse section HTML whose tables are mostly NaN (numbers that were never measured)."""
    nan, nums = len(_NAN_CELL.findall(body or "")), len(_NUM_CELL.findall(body or ""))
    if nan and nan >= 0.5 * (nan + nums):
        raise MoelabError(f"the section's tables show NaN in {nan} of {nan + nums} number cells: its inputs "
                          "produced nothing to measure.")


def _run_section(entry: ReportSection, ctx: ReportContext) -> tuple[SectionOutcome, str, list[Any]]:
    """Run one section: (outcome, its heading and body HTML, its figures). An exception becomes
    an error box, never a crash; :class:`SectionUnavailable` a "not available" box."""
    t0 = time.perf_counter()
    title, figures = entry.heading, []
    try:
        section = entry.fn(ctx)
        if section is None:
            raise SectionUnavailable("the section has nothing to show for this model")
        title = section.title or title
        for i, fig in enumerate(section.figures):
            _check_labelled(fig, i)
            check_has_data(fig, i)
        check_no_nan(section.html)
        status, error, figures, body = "ok", "", list(section.figures), section.html
    except SectionUnavailable as exc:
        status, error = "unavailable", str(exc)
        body = f"<div class='unavailable'><b>Not available in this build:</b> {html.escape(error)}</div>"
    except Exception as exc:  # noqa: BLE001 - one broken section must not lose the report
        log.exception("report section %r failed", entry.name)
        status, error = "failed", f"{type(exc).__name__}: {exc}"
        tb = "".join(traceback.format_exception(exc))
        body = (f"<div class='errbox' role='alert'><b>This section failed</b> — {html.escape(error)}"
                f"<details><summary>traceback</summary><pre>{html.escape(tb)}</pre></details></div>")
    seconds = time.perf_counter() - t0
    log.info("section %s: %s in %.1f s", entry.name, status, seconds)
    name = html.escape(entry.name)
    read = f"<p class='read'><b>What to read:</b> {html.escape(entry.read)}</p>" if entry.read else ""
    head = (f"<section id='sec-{name}' class='report-section' data-section='{name}' data-status='{status}' "
            f"data-figures='{len(figures)}'><h2>{html.escape(title)}</h2>{read}{body}")
    return SectionOutcome(entry.name, title, status, seconds, len(figures), error), head, figures


def build_report(ctx: ReportContext, out: str | Path, *, sections: Sequence[str] | None = None,
                 skip: Sequence[str] | None = None) -> Report:
    """Run the chosen sections (default all, less ``skip``) and write the HTML report atomically.

    Returns a :class:`Report`; a section that failed is an error box in the file and is listed
    in ``report.failed`` (the CLI then exits non-zero).
    """
    chosen = check_sections(sections, skip)
    outcomes: list[SectionOutcome] = []
    parts: list[str] = []
    toc: list[str] = []
    include_js = True
    for entry in ordered_sections():
        if entry.name not in chosen:
            continue
        outcome, head, figures = _run_section(entry, ctx)
        parts.append(head)
        for i, fig in enumerate(figures):
            div = fig.to_html(full_html=False, include_plotlyjs=include_js, div_id=f"fig-{entry.name}-{i}",
                              config={"displaylogo": False})
            include_js = False
            parts.append(f"<figure class='fig' data-section='{html.escape(entry.name)}'>{div}</figure>")
        parts.append(f"<p class='timing'>section {html.escape(entry.name)}: {outcome.status}, "
                     f"{outcome.seconds:.1f} s</p></section>")
        mark = {"ok": "", "failed": " — failed", "unavailable": " — not available"}[outcome.status]
        toc.append(f"<li><a href='#sec-{html.escape(entry.name)}'>{html.escape(outcome.title)}</a>{mark}</li>")
        outcomes.append(outcome)

    doc = _TEMPLATE.format(
        title=html.escape(f"moelab report — {ctx.model_name}"),
        model=html.escape(ctx.model_name),
        version=__version__,
        created=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        seconds=f"{sum(o.seconds for o in outcomes):.0f}",
        load=load_text(),
        toc="".join(toc),
        body="\n".join(parts),
    )

    with reserve_output(out, overwrite=True, what="report", kind="file") as res:
        res.staging.write_text(doc, encoding="utf-8")
        path = res.commit()
    return Report(path, outcomes)


_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }}
h1 {{ margin-bottom: 0.2em; }} .meta, .timing {{ color: #666; }} .timing {{ font-size: 0.8em; }}
table {{ border-collapse: collapse; margin: 1em 0; }} td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th {{ background: #f4f4f4; }} .err {{ color: #b00; }} section {{ margin-top: 2.5em; }}
.read {{ background: #f3f7fb; border-left: 4px solid #4a7ab5; padding: 0.5em 0.8em; }}
.errbox {{ background: #fdecea; border: 2px solid #b00; color: #600; padding: 0.8em; border-radius: 4px; }}
.unavailable {{ background: #f6f6f6; border: 2px dashed #999; color: #444; padding: 0.8em; border-radius: 4px; }}
figure.fig {{ margin: 1em 0; }}
</style></head><body>
<h1>{title}</h1>
<p class="meta">model <b>{model}</b> · moelab {version} · {created} · sections took {seconds} s ({load})</p>
<ul>{toc}</ul>
{body}
</body></html>
"""


def load_text() -> str:
    """The machine's load when the report was written: section seconds mean little without it."""

    m = machine_load()
    if m["load1"] is None:
        return "load average unknown"
    busy = " — a busy machine: the times are inflated" if m.get("other_per_cpu", m["per_cpu"]) > MAX_LOAD_PER_CPU else ""
    own = f", {m['own']:.1f} of it the report's own" if m.get("own") is not None else ""
    return f"load average {m['load1']:.1f} on {m['cpus']} CPUs when written{own}{busy}"


def html_table(rows: list[dict[str, Any]], floatfmt: str = "{:.3f}") -> str:
    """A small HTML table from a list of dicts (same keys)."""
    if not rows:
        return "<p>(no rows)</p>"
    keys = list(rows[0])

    def cell(v):
        return floatfmt.format(v) if isinstance(v, float) else html.escape(str(v))

    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(k, ''))}</td>" for k in keys) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"
