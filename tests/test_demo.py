"""The demo report's section registry: every capability registered, choosing and skipping
sections, a failing section drawn as an error box (and a non-zero exit), an unavailable one
drawn as such, figures required to carry a title."""

from __future__ import annotations

import sys

import pytest

from moelab.cli import main
from moelab.errors import MoelabError
from moelab.report import (
    SECTIONS,
    ReportContext,
    ReportSection,
    Section,
    SectionUnavailable,
    build_report,
    check_sections,
    section_names,
)

CAPABILITIES = ["routing", "accuracy", "policies", "attribution", "predictors", "caches", "kernels", "hybrid",
                "simulate"]


def _figure(title: str | None = "a figure"):
    import plotly.graph_objects as go

    fig = go.Figure(go.Scatter(x=[0, 1, 2], y=[1, 3, 2]))
    if title:
        fig.update_layout(title=title, xaxis_title="x", yaxis_title="y")
    return fig


def _ctx(tmp_path) -> ReportContext:
    return ReportContext(model=None, tokenizer=None, model_name="m", trace=None, workdir=tmp_path)


def test_every_capability_is_a_registered_section_with_a_title_and_a_reading_guide():
    names = section_names()
    assert [n for n in names if n in CAPABILITIES] == CAPABILITIES  # all there, in story order
    for name in CAPABILITIES:
        s = SECTIONS.get(name)
        assert s.title and s.read.endswith("."), name


def test_sections_are_chosen_and_skipped_by_name():
    assert check_sections(None) == section_names()
    assert check_sections(["caches", "routing"]) == ["routing", "caches"]  # report order, not argument order
    assert "kernels" not in check_sections(None, ["kernels"])
    with pytest.raises(MoelabError, match="unknown report section 'kernel'.*Did you mean 'kernels'"):
        check_sections(None, ["kernel"])
    with pytest.raises(MoelabError, match="--skip leaves no report sections"):
        check_sections(None, section_names())
    with pytest.raises(MoelabError, match="routing are both chosen"):  # a contradiction, not an empty choice
        check_sections(["routing"], ["routing"])


def test_a_failing_section_is_an_error_box_and_the_rest_of_the_report_is_written(tmp_path):
    def boom(ctx):
        raise ValueError("kaboom in the section")

    def fine(ctx):
        return Section(html="<p>fine body</p>", figures=[_figure("fine figure")])

    with SECTIONS.temporarily("boom", ReportSection("boom", boom, 1, "Boom", "Nothing.")), \
            SECTIONS.temporarily("fine", ReportSection("fine", fine, 2, "Fine", "A line.")):
        report = build_report(_ctx(tmp_path), tmp_path / "r.html", sections=["boom", "fine"])
    assert [s.name for s in report.failed] == ["boom"]
    assert report.failed[0].error == "ValueError: kaboom in the section"
    assert [(s.name, s.status, s.figures) for s in report.sections] == [("boom", "failed", 0), ("fine", "ok", 1)]
    html = report.path.read_text()
    assert "data-section='boom' data-status='failed'" in html and "class='errbox'" in html
    assert "ValueError: kaboom in the section" in html and "Traceback" in html
    assert "fine body" in html and "fine figure" in html and "What to read:</b> A line." in html
    assert html.count("plotly.js v") <= 2


def test_an_unlabelled_figure_fails_its_section(tmp_path):
    def bare(ctx):
        return Section(figures=[_figure(None)])

    with SECTIONS.temporarily("bare", ReportSection("bare", bare, 1, "Bare")):
        report = build_report(_ctx(tmp_path), tmp_path / "r.html", sections=["bare"])
    assert "figure 0 of the section has no title" in report.failed[0].error


def test_the_cli_exits_1_naming_the_failed_section(tmp_path, capsys):
    def boom(ctx):
        raise RuntimeError("broken on purpose")

    out = tmp_path / "r.html"
    with SECTIONS.temporarily("boom", ReportSection("boom", boom, 1, "Boom")):
        code = main(["demo", "--model", "tiny-random-qwen2_moe", "--quick", "--max-new-tokens", "2",
                     "--sections", "routing,boom", "--out", str(out)])
    cap = capsys.readouterr()
    assert code == 1
    assert "1 report section(s) failed: boom" in cap.err and "Traceback" not in cap.err
    assert "routing" in cap.out and out.is_file()
    html = out.read_text()
    assert "data-section='routing' data-status='ok'" in html and "RuntimeError: broken on purpose" in html


def test_list_sections_prints_every_section(capsys):
    assert main(["demo", "--list-sections"]) == 0
    out = capsys.readouterr().out
    for name in CAPABILITIES:
        assert name in out


def test_the_simulator_section_waits_for_moelab_simulate(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "moelab.simulate", None)  # import fails as if absent
    report = build_report(_ctx(tmp_path), tmp_path / "a.html", sections=["simulate"])
    assert report.sections[0].status == "unavailable" and not report.failed
    assert "Not available in this build" in report.path.read_text()


def test_the_simulator_section_needs_the_demos_trace(tmp_path):
    # its synthetic routing's statistics are fitted from the demo's trace (the browser test
    # builds the whole section: tests/test_demo_browser.py)
    report = build_report(_ctx(tmp_path), tmp_path / "a.html", sections=["simulate"])
    assert report.sections[0].status == "unavailable" and "trace" in report.sections[0].error


def test_a_section_may_declare_itself_unavailable(tmp_path):
    def later(ctx):
        raise SectionUnavailable("needs a GPU")

    with SECTIONS.temporarily("later", ReportSection("later", later, 1, "Later")):
        report = build_report(_ctx(tmp_path), tmp_path / "r.html", sections=["later"])
    assert report.sections[0].status == "unavailable" and not report.failed
    assert "needs a GPU" in report.path.read_text()


def test_unknown_skip_names_are_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "r.html"
    assert main(["demo", "--skip", "kernel", "--out", str(out)]) == 2
    assert "unknown report section 'kernel'" in capsys.readouterr().err and not out.exists()


def test_the_kernel_bench_drops_to_one_thread_on_a_busy_machine(monkeypatch):
    import os

    from moelab.report.kernels import bench_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (9.5, 9.0, 8.0))
    threads, note = bench_threads(2)
    assert threads == 1 and "load average 9.5 on 2 CPUs" in note
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.2, 0.1))
    assert bench_threads(2)[0] == 2
