"""Issue #30's crashes and silent acceptances: each case below crashed with a traceback or was
accepted without a word before; now each is one clear line (or works)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moelab.errors import MoelabError

ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "moelab", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_routing_statistics_fit_on_a_prompt_only_trace(tmp_path):
    import moelab
    from moelab.simulate.synthetic import fit_routing_stats

    model, tok = moelab.load("moelab-tiny-mixtral")
    with moelab.record(model, tmp_path / "t"):
        model(**tok(["hello world", "abc def ghi"], return_tensors="pt", padding=True))
    stats = fit_routing_stats(tmp_path / "t")  # was: IndexError in the adjacency fit
    assert stats.num_layers == len(moelab.moe_layers(model)) and len(stats.adjacent) == stats.num_layers


@pytest.mark.parametrize("grid, message", [
    (["capacity=1.5"], r"capacity=1.5: a fraction must be in \[0, 1\]"),
    (["capacity=300e"], r"capacity=300e: deepseek-v3 has 256 experts per MoE layer"),
    (["capacity=300"], r"capacity='300' is ambiguous"),
    (["deferral=9"], r"deferral=9: deepseek-v3 routes each token to 8 experts"),
    (["skipping=0,12"], r"skipping=12"),
])
def test_a_what_if_grid_is_checked_before_anything_is_simulated(grid, message, monkeypatch):
    from moelab.simulate import whatif as w

    monkeypatch.setattr(w, "load_routing", lambda *a, **k: pytest.fail("routing was built for a bad grid"))
    with pytest.raises(MoelabError, match=message):
        w.whatif("deepseek-v3", "ktransformers-a100", synthetic=True, grid=grid)


def test_a_timeline_takes_the_run_its_event_log_or_its_directory(tmp_path):
    import moelab
    from moelab.hybrid.run import run_prompts
    from moelab.timeline import Timeline

    model, tok = moelab.load("moelab-tiny-mixtral")
    cfg = {"cache": {"capacity": 0.25}, "executor": "real"}
    with moelab.hybrid(model, cfg) as run:
        model.generate(**tok(["1+1="], return_tensors="pt"), max_new_tokens=3, do_sample=False)
    by_log, by_run = Timeline(run.events), Timeline(run)  # was: AttributeError
    assert len(by_log) == len(by_run) > 0
    run_prompts(model, tok, ["1+1="], cfg, tmp_path / "r", max_new_tokens=3, progress=False)
    assert len(Timeline(tmp_path / "r")) > 0
    with pytest.raises(MoelabError, match="Timeline needs events"):
        Timeline(42)


def test_an_unknown_hardware_profile_is_refused_whatever_the_executor(tmp_path):
    from moelab.hybrid.config import HybridConfig

    with pytest.raises(MoelabError, match="unknown hardware profile 'pcie9-x16'.*'pcie5-x16'"):
        HybridConfig.from_dict({"hardware": "pcie9-x16"})  # was accepted unless the executor was simulated


def test_an_offline_only_predictor_in_a_live_run_says_so():
    import moelab

    model, _ = moelab.load("moelab-tiny-mixtral")
    with pytest.raises(MoelabError, match="'oracle' works only offline"), \
            moelab.hybrid(model, {"cache": {"capacity": 0.25}, "prefetch": {"predictor": "oracle"}}):
        pass


def test_contradictory_choices_are_refused(tmp_path):
    from moelab.report import check_sections

    with pytest.raises(MoelabError, match="caches are both chosen .--sections. and skipped"):
        check_sections(["routing", "caches"], ["caches"])
    ev = tmp_path / "run"
    ev.mkdir()
    r = _cli("timeline", "export", str(ev), "--format", "chrome", "--out", str(tmp_path / "t.pftrace"))
    assert r.returncode == 2 and "has the perfetto extension .pftrace but --format is chrome" in r.stderr


def test_a_mistyped_option_gets_the_subcommands_usage_and_the_closest_option(tmp_path):
    r = _cli("calibrate", "--quikc", "--out", str(tmp_path / "p.yaml"))
    assert r.returncode == 2
    assert "moelab calibrate: error: unrecognized arguments: --quikc. Did you mean '--quick'" in r.stderr
    assert "usage: moelab calibrate" in r.stderr


def test_hostile_files_get_one_line(tmp_path):
    from moelab.hybrid.config import HybridConfig
    from moelab.sweeps.spec import load_spec
    from moelab.timing import get_profile

    binary = tmp_path / "bin.yaml"
    binary.write_bytes(bytes(range(128, 256)) * 3)
    with pytest.raises(MoelabError, match="not UTF-8 text"):
        get_profile(binary)
    with pytest.raises(MoelabError, match="not UTF-8 text"):
        HybridConfig.from_yaml(binary)
    with pytest.raises(MoelabError, match="not UTF-8 text"):
        load_spec(binary)
    loop = tmp_path / "loop.yaml"
    loop.write_text("name: x\nmodels: &m [tiny-random-mixtral, *m]\npolicies: [none]\ntasks: [arith]\n")
    with pytest.raises(MoelabError, match=r"loop.yaml:2: this value refers to itself"):
        load_spec(loop)


def test_a_sweep_refuses_counts_above_the_models_top_k(tmp_path):
    from moelab.sweeps.spec import expand, load_spec

    spec = tmp_path / "s.yaml"
    spec.write_text("name: big\nmodels: [tiny-random-mixtral]\npolicies:\n"
                    "  - {policy: deferral, min_immediate: 0, grid: {deferred: [1, 1999]}}\ntasks: [arith]\n")
    with pytest.raises(MoelabError, match="deferred=1999 but model tiny-random-mixtral routes each token to 2"):
        expand(load_spec(spec), {"tiny-random-mixtral": "f" * 16})


def test_one_tokens_per_second_for_a_run_named_in_the_output(tmp_path):
    """`moelab run` and `moelab timeline summary` print the same tokens/s for one run directory —
    decode tokens over decode wall, set-up and prefill excluded — and say so."""
    import json

    cfg = tmp_path / "h.yaml"
    cfg.write_text("cache: {capacity: 0.25, policy: lru}\nplacement: host-misses\nexecutor: real\n")
    r = _cli("run", "--model", "moelab-tiny-mixtral", "--hybrid", str(cfg), "--task", "arith", "--limit", "2",
             "--max-new-tokens", "6", "--out", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr[-500:]
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    t = _cli("timeline", "summary", str(tmp_path / "r"), "--json")
    ts = json.loads(t.stdout)
    assert s["tokens_per_s"] == pytest.approx(ts["tokens_per_s"], rel=1e-9)
    assert s["tokens_per_s_basis"] == ts["tokens_per_s_basis"] == "decode tokens / decode wall (prefill and set-up excluded)"
    assert f"{s['tokens_per_s']:.2f} tokens/s (decode tokens / decode wall" in r.stdout
    assert s["decode_tokens"] == s["generated_tokens"] - 2  # each prompt's first token comes from its prefill
    cfg.write_text("cache: {capacity: 0.25, policy: lru}\nplacement: host-misses\n")
    f = _cli("run", "--model", "moelab-tiny-mixtral", "--hybrid", str(cfg), "--task", "arith", "--limit", "1",
             "--max-new-tokens", "4", "--out", str(tmp_path / "f"))
    assert "the functional executor runs no lanes" in f.stdout and "lanes busy: ;" not in f.stdout


def test_the_main_objects_say_what_they_hold():
    import moelab
    from moelab.hybrid.events import EventLog

    model, tok = moelab.load("moelab-tiny-mixtral")
    run = moelab.hybrid(model, {"cache": {"capacity": 0.25}, "executor": "real"})
    assert "HybridRun(MixtralForCausalLM: cache lru 0.25, placement host-misses, executor real; not applied" in repr(run)
    log = EventLog("abc")
    log.add(0, 0, "host", "expert-host", 0.0, 5.0)
    assert repr(log).startswith("EventLog(run 'abc': 1 events over 0.0 ms on lanes host")
    rec = moelab.record(model, None)
    assert repr(rec).startswith("TraceRecorder(") and "0 rows so far" in repr(rec)
    public = [n for n in dir(moelab) if not n.startswith("__")]
    assert not {"annotations", "logging", "lazy_attributes", "_lazy"} & set(public) and "load" in public


def test_an_empty_or_nan_section_fails_instead_of_passing_as_ok(tmp_path):
    import plotly.graph_objects as go

    from moelab.report import (
        SECTIONS,
        ReportContext,
        ReportSection,
        Section,
        build_report,
        html_table,
    )

    def empty(ctx):
        fig = go.Figure(go.Scatter(x=[], y=[], name="hits")).update_layout(title="t", xaxis_title="x", yaxis_title="y")
        return Section(figures=[fig])

    def nan_table(ctx):
        fig = go.Figure(go.Bar(x=[1], y=[2])).update_layout(title="t", xaxis_title="x", yaxis_title="y")
        return Section(html=html_table([{"a": float("nan"), "b": float("nan")}]), figures=[fig])

    def nan_figure(ctx):
        fig = go.Figure(go.Scatter(x=[1, 2], y=[float("nan")] * 2)).update_layout(title="t", xaxis_title="x",
                                                                                  yaxis_title="y")
        return Section(figures=[fig])

    ctx = ReportContext(model=None, tokenizer=None, model_name="m", trace=None, workdir=tmp_path)
    with SECTIONS.temporarily("e1", ReportSection("e1", empty, 1, "E1", "r.")), \
            SECTIONS.temporarily("e2", ReportSection("e2", nan_table, 2, "E2", "r.")), \
            SECTIONS.temporarily("e3", ReportSection("e3", nan_figure, 3, "E3", "r.")):
        report = build_report(ctx, tmp_path / "r.html", sections=["e1", "e2", "e3"])
    got = {s.name: (s.status, s.error) for s in report.sections}
    assert got["e1"][0] == "failed" and "has no data to plot" in got["e1"][1]
    assert got["e2"][0] == "failed" and "show NaN in 2 of 2 number cells" in got["e2"][1]
    assert got["e3"][0] == "failed" and "has no data to plot" in got["e3"][1]


def test_the_browser_check_refuses_a_legend_over_empty_axes(tmp_path):
    import shutil

    if not (shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")):
        pytest.skip("no Chromium on PATH (make test installs Debian's chromium when root)")
    import plotly.graph_objects as go

    from moelab.report.browser import check_in_browser

    fig = go.Figure([go.Scatter(x=[], y=[], name="a"), go.Scatter(x=[], y=[], name="b")])
    fig.update_layout(title="empty", xaxis_title="x", yaxis_title="y", showlegend=True)
    page = tmp_path / "p.html"
    page.write_text("<html><head><meta charset='utf-8'></head><body><section data-section='s' data-figures='1'><h2>s</h2><p class='read'>r</p>"
                    + fig.to_html(full_html=False, include_plotlyjs=True) + "</section></body></html>")
    problems = check_in_browser(page).problems
    assert any("plots no data" in p for p in problems), problems


def test_fates_per_expert_and_every_stall_with_a_cause(tmp_path):
    """The hybrid reference page's configuration (docs/reference/hybrid.md) (learned prefetch, MRS, greedy-hss, deferral, real executor): the
    timeline summary counts fates per expert from the run's plans — prefetch hits included, which
    the fused device call's events cannot show — and the control thread's stalls all have a cause."""
    import json

    import moelab
    from moelab.hybrid.run import run_prompts
    from moelab.timeline import Timeline

    model, tok = moelab.load("moelab-tiny-qwen2moe")
    pred = moelab.resource_dir("predictors") / "moelab-tiny-qwen2moe" / "learned-d1"
    cfg = {"cache": {"capacity": 0.25, "policy": "mrs"}, "placement": "greedy-hss", "hardware": "pcie4-x16",
           # select "order": every proposal within the budget, so prefetch hits happen on this tiny model
           "prefetch": {"predictor": str(pred), "distance": 1, "select": "order"}, "routing": {"deferred": 2},
           "executor": "real"}
    run_prompts(model, tok, ["Question: 3+4=?\nAnswer:", "Question: 12-5=?\nAnswer:"], cfg, tmp_path / "r",
                max_new_tokens=8, progress=False)
    plans = [json.loads(line) for line in (tmp_path / "r" / "plans.jsonl").read_text().splitlines()]
    s = Timeline.open(tmp_path / "r").summary()
    assert s["fates_basis"] == "per expert (plans)"
    assert s["fates"]["prefetch-hit"] == sum(len(p["prefetch_hits"]) for p in plans) > 0
    assert s["fates"]["deferred"] == sum(len(p["deferred"]) for p in plans) > 0
    # events alone (no plans): the fused device calls make the count per call, and it says so
    counts, basis = Timeline(Timeline.open(tmp_path / "r").events).fate_counts()
    assert basis.startswith("per call")
    stalls = s["stall_us"]
    assert stalls["other"] <= 0.02 * sum(stalls.values()), stalls  # was ~40 % before plan/dispatch events
    kinds = set(Timeline.open(tmp_path / "r").events["kind"].astype(str))
    assert {"dense", "plan", "dispatch", "wait"} <= kinds


def test_a_kernel_build_lock_left_by_a_killed_build_is_cleared(tmp_path):
    """A killed first build leaves torch's lock file; every later process waited on it forever."""
    import os
    import time

    from moelab.kernels.build import clear_stale_lock

    lock = tmp_path / "lock"
    lock.write_text("")
    assert not clear_stale_lock(tmp_path) and lock.exists()  # a build in progress keeps its lock
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path) and not lock.exists()


def test_a_build_lock_that_goes_stale_while_waited_on_is_cleared(tmp_path):
    """A lock younger than the limit when a process starts (a build killed moments before) is
    waited on only until it is stale; a lock its build removes ends the wait at once."""
    import threading
    import time

    from moelab.kernels.build import wait_for_build_lock

    lock = tmp_path / "lock"
    lock.write_text("")
    t0 = time.monotonic()
    wait_for_build_lock(tmp_path, max_age_s=0.3, poll_s=0.02)  # fresh now, stale in 0.3 s
    assert not lock.exists() and 0.25 <= time.monotonic() - t0 < 30
    lock.write_text("")
    threading.Timer(0.1, lock.unlink).start()  # the other build finishes
    wait_for_build_lock(tmp_path, max_age_s=3600, poll_s=0.02)
    assert not lock.exists()
    wait_for_build_lock(tmp_path)  # no lock: returns at once


def _run_small_sweep(tmp_path, spec_yaml: str):
    """Write ``spec_yaml``, run it into ``tmp_path/store`` (1 thread) and return (spec, statuses)."""
    from moelab.sweeps.driver import run_sweep
    from moelab.sweeps.report import collect
    from moelab.sweeps.spec import load_spec

    (tmp_path / "s.yaml").write_text(spec_yaml)
    spec = load_spec(tmp_path / "s.yaml")
    run_sweep(spec, store=tmp_path / "store", threads=1, progress=False)
    return spec, collect(spec, tmp_path / "store")


def test_the_sweep_report_is_small_says_what_was_cut_and_ticks_whole_experts(tmp_path):
    from moelab.sweeps.report import curves_figure, write_html

    spec, statuses = _run_small_sweep(
        tmp_path, "name: small\nmodels: [tiny-random-mixtral]\npolicies:\n  - none\n"
        "  - {policy: deferral, min_immediate: 0, grid: {deferred: [1]}}\n"
        "  - {policy: skipping, min_kept: 0, grid: {skipped: [1]}}\n"
        "tasks:\n  - {task: arith, limit: 1}\neval: {max_gen_toks: 3}\n")
    page_path = write_html(spec, statuses, tmp_path / "out" / "r.html")
    page = page_path.read_text()
    assert page_path.stat().st_size < 300_000  # was 4.8 MB for 3 cells: plotly.js is beside it, once
    assert (tmp_path / "out" / "plotly.min.js").stat().st_size > 1_000_000 and "src='plotly.min.js'" in page
    assert "immediate=None" not in page
    assert "Notes from the evaluations" in page and "max_gen_toks" in page  # answers cut at the cap are said
    fig = curves_figure(statuses, "tiny-random-mixtral", "arith")
    assert fig.layout.xaxis.dtick == 1 and "<br>" in fig.layout.title.text  # whole experts; a title that fits
    embedded = write_html(spec, statuses, tmp_path / "one.html", self_contained=True)
    assert embedded.stat().st_size > 1_000_000 and "src='plotly.min.js'" not in embedded.read_text()


def test_paired_differences_by_hand():
    from moelab.stats import mcnemar_exact, paired_difference

    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact(3, 3) == 1.0
    base = {str(i): 1.0 for i in range(10)}
    other = {**base, "0": 0.0, "1": 0.0}  # two documents lost, none gained
    r = paired_difference(base, other)
    assert (r["n"], r["n01"], r["n10"]) == (10, 0, 2) and r["diff"] == pytest.approx(-0.2)
    # paired: sd of (0,..,0,-1,-1) / sqrt(10); far below the unpaired SE of two accuracies
    assert r["paired_se"] == pytest.approx((((8 * 0.04 + 2 * 0.64) / 9) ** 0.5) / 10 ** 0.5)
    assert r["mcnemar_p"] == pytest.approx(0.5)


def test_the_sweep_report_pairs_every_cell_with_the_unmodified_model_per_document(tmp_path):
    from moelab.sweeps.report import paired_rows, write_html

    spec, statuses = _run_small_sweep(
        tmp_path, "name: paired\nmodels: [moelab-tiny-mixtral]\npolicies:\n  - none\n"
        "  - {policy: skipping, min_kept: 0, grid: {skipped: [2]}}\n"
        "tasks:\n  - {task: arith, limit: 3}\neval: {max_gen_toks: 24}\n")
    (row,) = paired_rows(statuses, tmp_path / "store")
    assert row["n"] == 3 and row["cell"].startswith("skipping")
    scores = {x.cell.policy: x.record["score"] for x in statuses}
    assert row["diff"] == pytest.approx(scores["skipping"] - scores["none"])
    page = write_html(spec, statuses, tmp_path / "r.html", store=tmp_path / "store").read_text()
    assert "Paired differences against the unmodified model" in page and "McNemar" in page


def test_the_readmes_first_eval_scores_a_trained_model():
    """The README's first `moelab eval` ran 2.5 minutes to print 0.0000 on an untrained model (the
    section is now the reference page docs/reference/lm-eval.md)."""
    text = (ROOT / "docs" / "reference" / "lm-eval.md").read_text()
    first = next(line for line in text.splitlines() if line.startswith("moelab eval --model"))
    assert "tiny-random" not in first and "--limit 10" in first
