"""The self-contained HTML report of ``moelab demo``, built from registered sections.

A section is a function ``(ctx: ReportContext) -> Section | None``. Capabilities add
theirs with :func:`register_section` (with an ``order``); ``build_report`` runs them in
order and writes one HTML file with plotly embedded once, so it opens offline.
"""

from __future__ import annotations

import html
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    title: str
    figures: list[Any] = field(default_factory=list)
    """plotly figures, drawn in order after the text."""
    html: str = ""
    """Extra HTML (tables, notes) placed before the figures."""


SectionFn = Callable[[ReportContext], "Section | None"]


@dataclass(frozen=True)
class ReportSection:
    """A registered section: its builder and its place in the report."""

    name: str
    fn: SectionFn
    order: int = 100
    """Lower comes first (ties by name); data, so registering never re-sorts anything."""


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


def register_section(name: str, fn: SectionFn, order: int = 100, *, overwrite: bool = False) -> ReportSection:
    """Add a report section; lower ``order`` comes first.

    A different section under a registered name raises (naming both places) unless ``overwrite=True``.
    """
    section = ReportSection(name, fn, order)
    SECTIONS.register(name, section, overwrite=overwrite, stacklevel=2)
    return section


def ordered_sections() -> list[ReportSection]:
    """The registered sections in report order (``order``, then name)."""
    return sorted((SECTIONS.get(n) for n in SECTIONS.names()), key=lambda s: (s.order, s.name))


def section_names() -> list[str]:
    return [s.name for s in ordered_sections()]


def check_sections(sections: list[str] | None) -> None:
    """Refuse section names that no registered section has (before any work is done)."""
    if sections is None:
        return
    from moelab.errors import MoelabError, unknown_name

    known = section_names()
    if not sections:
        raise MoelabError(f"no report sections selected; choose from: {', '.join(known)}.")
    for name in sections:
        if name not in known:
            raise unknown_name("report section", name, known)


#: Modules that register sections when imported.
BUILTIN_SECTION_MODULES: list[str] = ["moelab.report.routing", "moelab.evals.report"]


def build_report(ctx: ReportContext, out: str | Path, *, sections: list[str] | None = None) -> Path:
    """Run the sections and write the HTML report atomically to ``out``."""
    check_sections(sections)
    parts: list[str] = []
    include_js = True
    toc: list[str] = []
    for entry in ordered_sections():
        name, fn = entry.name, entry.fn
        if sections is not None and name not in sections:
            continue
        t0 = time.perf_counter()
        try:
            section = fn(ctx)
        except Exception as exc:  # noqa: BLE001 - one broken section must not lose the report
            log.exception("report section %r failed", name)
            section = Section(title=name, html=f"<p class='err'>This section failed: {html.escape(repr(exc))}</p>")
        if section is None:
            continue
        log.info("section %s took %.1f s", name, time.perf_counter() - t0)
        anchor = f"sec-{name}"
        toc.append(f"<li><a href='#{anchor}'>{html.escape(section.title)}</a></li>")
        parts.append(f"<section id='{anchor}'><h2>{html.escape(section.title)}</h2>{section.html}")
        for fig in section.figures:
            parts.append(fig.to_html(full_html=False, include_plotlyjs=include_js))
            include_js = False
        parts.append("</section>")
    from moelab import __version__

    doc = _TEMPLATE.format(
        title=html.escape(f"moelab report — {ctx.model_name}"),
        model=html.escape(ctx.model_name),
        version=__version__,
        created=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        toc="".join(toc),
        body="\n".join(parts),
    )
    from moelab._output import reserve_output

    with reserve_output(out, overwrite=True, what="report", kind="file") as res:
        res.staging.write_text(doc, encoding="utf-8")
        return res.commit()


_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }}
h1 {{ margin-bottom: 0.2em; }} .meta {{ color: #666; }}
table {{ border-collapse: collapse; margin: 1em 0; }} td, th {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th {{ background: #f4f4f4; }} .err {{ color: #b00; }} section {{ margin-top: 2.5em; }}
</style></head><body>
<h1>{title}</h1>
<p class="meta">model <b>{model}</b> · moelab {version} · {created}</p>
<ul>{toc}</ul>
{body}
</body></html>
"""


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
