"""The demo report end to end: every section builds (``--quick``), and in a real browser
(headless Chromium) every figure draws with no JavaScript error. The browser tests run where
Chromium is on PATH (Debian: ``apt-get install chromium``; ``make install`` does it as root)
and are skipped with that reason elsewhere. The screenshot goes to ``out/demo-screenshot.png``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.report import section_names
from moelab.report.browser import check_in_browser, find_chromium

pytestmark = pytest.mark.xdist_group("demo-report")  # one report build per worker group

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "out" / "demo-screenshot.png"
needs_chromium = pytest.mark.skipif(
    find_chromium() is None,
    reason="Chromium is not on PATH: install it with `apt-get install chromium` (or set MOELAB_CHROMIUM) "
           "to check the report in a browser",
)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "report.html"
    code = main(["demo", "--quick", "--max-new-tokens", "4", "--out", str(out)])
    assert code == 0, "a section failed; see the error box in the report"
    return out


def _statuses(html: str) -> dict[str, str]:
    return dict(re.findall(r"data-section='([^']+)' data-status='([^']+)'", html))


def test_every_section_builds_and_the_report_is_self_contained(report):
    html = report.read_text()
    statuses = _statuses(html)
    assert list(statuses) == section_names()
    for name, status in statuses.items():
        assert status == "ok", (name, status)
    assert re.search(r"<script[^>]*\ssrc=", html) is None  # nothing loaded from outside: opens offline
    assert html.count("plotly.js v") <= 2  # the library is embedded once
    # the simulated what-if shows its grid and the signature plot (KTransformers Fig. 10 redrawn)
    assert "What-if: deepseek-v3" in html and "KTransformers Fig. 10, redrawn" in html


@needs_chromium
def test_every_figure_draws_in_headless_chromium(report):
    result = check_in_browser(report, screenshot=SCREENSHOT)
    print(f"\nbrowser: {result.browser}; plotly.js {result.plotly}; {len(result.figures)} figures; "
          f"screenshot: {result.screenshot}")
    assert result.problems == []
    assert [s["name"] for s in result.sections] == section_names()
    assert all(s["read"] and s["title"] for s in result.sections)
    drawn = {s: sum(1 for f in result.figures if f["section"] == s) for s in section_names()}
    for s in result.sections:
        if s["status"] == "ok" and s["name"] != "accuracy":  # the accuracy section is a table
            assert drawn[s["name"]] >= 1, s["name"]
    assert all(f["marks"] > 0 and f["width"] > 0 and f["height"] > 0 for f in result.figures)
    assert SCREENSHOT.is_file() and SCREENSHOT.stat().st_size > 10_000


@needs_chromium
def test_the_browser_check_catches_a_figure_that_did_not_draw(tmp_path):
    import plotly.graph_objects as go

    from moelab.report import SECTIONS, ReportContext, ReportSection, Section, build_report

    def one(ctx):
        return Section(figures=[go.Figure(go.Bar(x=[1, 2], y=[3, 4])).update_layout(
            title="ok figure", xaxis_title="x", yaxis_title="y")])

    ctx = ReportContext(model=None, tokenizer=None, model_name="m", trace=None, workdir=tmp_path)
    with SECTIONS.temporarily("one", ReportSection("one", one, 1, "One")):
        path = build_report(ctx, tmp_path / "r.html", sections=["one"]).path
    assert check_in_browser(path).problems == []
    broken = ("<section data-section='bad' data-status='ok' data-figures='1'><h2>bad</h2>"
              "<div id='bad-fig' class='plotly-graph-div' style='height:300px'></div>"
              "<script>Plotly.newPlot('bad-fig', [], {});"
              "throw new Error('figure script broke');</script></section></body>")
    path.write_text(path.read_text().replace("</body>", broken, 1))
    problems = check_in_browser(path).problems
    assert any("figure script broke" in p for p in problems), problems
    assert any("bad-fig" in p and "has no traces" in p for p in problems), problems
    assert any("bad-fig" in p and "has no title" in p for p in problems), problems
