"""moelab.timeline: summaries on hand-made event tables (figures computed by hand in the comments),
the figure's traces, exports parsed back, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from moelab.errors import MoelabError
from moelab.events import COLUMNS, summarize
from moelab.timeline import FATES, Timeline

# One step, MoE layers 0 and 1 (control work of layer 2 closes it). Times in µs.
#   control  dense0 [0,10]  wait0 [10,40]  dense1 [40,50]  wait1 [50,54]  (gap: deferred merge)  dense2 [60,70]
#   copy     demand L0 e3 [10,30]
#   device   L0 e1 [10,20] (hit)   L0 e3 [30,40] (fed by the copy)   L1 e2 [50,54]
#   host     L0 e5 miss [10,35]    L0 e6 deferred [40,60]
ROWS = [
    # step, layer, lane, kind, expert, tokens, bytes, t0, t1, cause
    (0, 0, "control", "dense", -1, 0, 0, 0, 10, "attention+router"),
    (0, 0, "copy", "transfer-demand", 3, 0, 100, 10, 30, "demand"),
    (0, 0, "device", "expert-device", 1, 2, 50, 10, 20, "hit+fetch"),
    (0, 0, "host", "expert-host", 5, 1, 50, 10, 35, "miss"),
    (0, 0, "control", "wait", -1, 0, 0, 10, 40, "lanes"),
    (0, 0, "device", "expert-device", 3, 1, 50, 30, 40, "hit+fetch"),
    (0, 1, "control", "dense", -1, 0, 0, 40, 50, "attention+router"),
    (0, 0, "host", "expert-deferred", 6, 1, 50, 40, 60, "deferred"),
    (0, 1, "device", "expert-device", 2, 3, 50, 50, 54, "hit"),
    (0, 1, "control", "wait", -1, 0, 0, 50, 54, "lanes"),
    (0, 2, "control", "dense", -1, 0, 0, 60, 70, "attention+router"),
]


def table(rows=ROWS, run="r") -> pd.DataFrame:
    cols = ["step", "layer", "lane", "kind", "expert", "tokens", "bytes", "t_start_us", "t_end_us", "cause"]
    df = pd.DataFrame(rows, columns=cols)
    df.insert(0, "run", run)
    return df[list(COLUMNS)]


@pytest.fixture
def tl() -> Timeline:
    return Timeline(table(), name="hand")


def test_busy_and_overlap_by_hand(tl):
    # wall 70; control work 30 (waits are idle), device 10+10+4, copy 20, host 25+20
    b = tl.busy_pct()
    assert b == pytest.approx({"control": 300 / 7, "device": 2400 / 70, "copy": 2000 / 70, "host": 4500 / 70})
    assert list(b) == ["control", "device", "copy", "host"]
    # host [10,35] ∪ [40,60]; device side [0,20] ∪ [30,54] ∪ [60,70] → 10 + 5 + 14 = 29 of 45
    assert tl.overlap_pct() == pytest.approx(100 * 29 / 45)
    # the hybrid run's summary is the same rule
    s = summarize(table())
    assert s["busy_pct"] == pytest.approx(b) and s["overlap_pct"] == pytest.approx(tl.overlap_pct())


def test_stalls_by_hand(tl):
    # control stalls: [10,40] (wait) and [50,60] (wait + merge gap) = 40 µs
    # copy runs 10..30 → 20; deferred 40..60 covers 50..60 → 10; host miss 30..35 → 5; device 35..40 → 5
    st = tl.stalls()
    assert st == pytest.approx({"copy": 20, "deferred": 10, "host": 5, "device": 5, "handoff": 0, "other": 0})
    assert sum(st.values()) == pytest.approx(40)


def test_explicit_wait_cause_wins():
    rows = [(0, 0, "control", "dense", -1, 0, 0, 0, 10, ""), (0, 0, "control", "wait", -1, 0, 0, 10, 30, "copy"),
            (0, 0, "host", "expert-host", 1, 1, 0, 10, 30, "miss-host"), (0, 1, "control", "dense", -1, 0, 0, 30, 35, ""),
            (0, 1, "control", "wait", -1, 0, 0, 35, 40, "lanes")]
    st = Timeline(table(rows)).stalls()
    # the wait on lanes at 35..40 while no lane runs is a hand-off to a lane thread, not "other"
    assert st == pytest.approx({"copy": 20, "deferred": 0, "host": 0, "device": 0, "handoff": 5, "other": 0})


def test_critical_path_by_hand(tl):
    # dense0 10 → host miss 25 → deferred 20 → dense2 10 = 65; the device chain
    # dense0 → copy → e3 → dense1 → e2 is 10+20+10+10+4 = 54 (then dense2: 64)
    cp = tl.critical_path(0)
    assert cp.length_us == pytest.approx(65) and cp.wall_us == pytest.approx(70)
    assert list(zip(cp.events["lane"], cp.events["kind"])) == [
        ("control", "dense"), ("host", "expert-host"), ("host", "expert-deferred"), ("control", "dense")]
    assert cp.by_lane() == pytest.approx({"control": 20, "host": 45})
    # a longer copy (10..50) moves the path onto the copy lane
    rows = [(0, 0, "control", "dense", -1, 0, 0, 0, 10, ""), (0, 0, "copy", "transfer-demand", 3, 0, 100, 10, 50, ""),
            (0, 0, "host", "expert-host", 5, 1, 50, 10, 35, "miss"), (0, 0, "control", "wait", -1, 0, 0, 10, 60, ""),
            (0, 0, "device", "expert-device", 3, 1, 50, 50, 60, "miss-fetch"),
            (0, 1, "control", "dense", -1, 0, 0, 60, 70, ""), (0, 0, "host", "expert-deferred", 6, 1, 50, 60, 80, ""),
            (0, 1, "device", "expert-device", 2, 3, 50, 70, 74, "hit"), (0, 1, "control", "wait", -1, 0, 0, 70, 74, ""),
            (0, 2, "control", "dense", -1, 0, 0, 80, 90, "")]
    cp2 = Timeline(table(rows)).critical_path(0)
    assert list(zip(cp2.events["lane"], cp2.events["expert"])) == [
        ("control", -1), ("copy", 3), ("device", 3), ("control", -1), ("device", 2), ("control", -1)]
    assert cp2.length_us == pytest.approx(84)


def test_fates_and_feeds(tl):
    f = tl.feeds()
    ev = tl.events
    assert len(f) == 1
    assert ev.iloc[f["tr"][0]]["kind"] == "transfer-demand" and ev.iloc[f["cp"][0]]["expert"] == 3
    fates = tl.fates()
    got = {(int(ev["expert"][i]), ev["kind"][i]): fates[i] for i in range(len(ev)) if fates[i]}
    assert got == {(1, "expert-device"): "hit", (3, "expert-device"): "miss-fetch", (5, "expert-host"): "miss-host",
                   (6, "expert-deferred"): "deferred", (2, "expert-device"): "hit"}


def test_fused_device_call_fed_by_its_layers_demand_copies():
    rows = [(0, 0, "control", "dense", -1, 0, 0, 0, 5, ""), (0, 0, "copy0", "transfer-demand", 4, 0, 10, 5, 9, "demand"),
            (0, 0, "copy1", "transfer-prefetch", 2, 0, 10, 5, 9, "prefetch"),
            (0, 0, "device", "expert-device", -1, 4, 20, 9, 12, "hit+fetch")]
    tl = Timeline(table(rows))
    assert tl.feeds()["tr"].tolist() == [1] and tl.fates().tolist()[3] == "miss-fetch"
    assert tl.lanes == ["control", "device", "copy0", "copy1"]
    assert tl.group_busy_pct()["copy"] == pytest.approx(100 * 4 / 12)


def test_compare_line_by_line(tl):
    slow = table()
    slow["t_start_us"] *= 2
    slow["t_end_us"] *= 2
    c = tl.compare(Timeline(slow, name="slow"))
    row = c.set_index("metric")
    assert row.loc["wall_us", "ratio"] == pytest.approx(2.0)
    assert row.loc["busy_pct.host", "diff"] == pytest.approx(0.0)
    assert row.loc["stall_us.copy", "slow"] == pytest.approx(40)
    assert {"hand", "slow", "diff", "ratio"} <= set(c.columns)


def test_select_and_rates(tl):
    assert len(tl.select(layers=[1])) == 3  # dense1, e2, wait1
    assert tl.select(lanes=["host"]).busy_pct() == pytest.approx({"host": 100 * 45 / 50})
    r = Timeline(table(), tokens=7).rates()
    assert r["tokens_per_s"] == pytest.approx(7 / 70e-6) and r["steps_per_s"] == pytest.approx(1 / 70e-6)
    assert r["expert_pairs_per_s"] == pytest.approx(8 / 70e-6)


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(MoelabError, match="no events.parquet"):
        Timeline.open(tmp_path)
    bad = tmp_path / "ev.parquet"
    table().drop(columns=["cause", "bytes"]).to_parquet(bad)
    with pytest.raises(MoelabError, match="bytes, cause"):
        Timeline.open(bad)
    rows = [(0, 0, "host", "expert-host", 1, 1, 0, 10, 5, "")]
    with pytest.raises(MoelabError, match="ends before it starts"):
        Timeline(table(rows))


# ---------------------------------------------------------------------------------------------- figure
def test_figure_traces(tl):
    fig = tl.figure()
    names = {d.name for d in fig.data}
    assert {"hit", "miss-fetch", "miss-host", "deferred", "dense", "transfer-demand", "wait", "copy → compute",
            "bytes in flight"} <= names
    bars = next(d for d in fig.data if d.name == "miss-host" and d.mode == "lines")
    assert np.isnan(np.asarray(bars.y, dtype=float)[2])  # NaN-separated segments, one trace per colour
    hover = [d for d in fig.data if d.name == "miss-fetch" and d.mode == "markers"]
    assert hover and "expert" in hover[0].hovertemplate and "cause: hit+fetch" in hover[0].hovertemplate
    assert list(fig.layout.yaxis.ticktext) == ["control", "device", "copy", "host"]
    flow = next(d for d in fig.data if d.name == "copy → compute")
    # from the copy's end (30 µs, copy row 2) to the fed compute's start (30 µs, device row 1)
    assert np.allclose(np.asarray(flow.x, dtype=float)[:2], [0.030, 0.030])
    assert list(np.asarray(flow.y, dtype=float)[:2]) == [2, 1]


def test_figure_overlay_and_levels():
    from moelab.timeline.synth import synthetic_events

    a = Timeline(synthetic_events(steps=6, layers=4, seed=1), name="real")
    b = Timeline(synthetic_events(steps=6, layers=4, seed=2), name="sim")
    fig = a.figure(b, detail_budget=150, aggregate_budget=40)
    ticks = list(fig.layout.yaxis.ticktext)
    assert ticks[:2] == ["real · control", "sim · control"] and len(ticks) == 2 * len(a.lanes)
    title = fig.layout.title.text
    assert "single events" in title and "per layer" in title and "per step" in title
    assert any(d.hovertemplate and "aggregate" in d.hovertemplate for d in fig.data)
    assert "cache occupancy Δ" in {d.name.split(" · ")[-1] for d in fig.data}


def test_counters():
    from moelab.timeline.figure import counter_series

    rows = [(0, 0, "copy0", "transfer-demand", 1, 0, 100, 0, 10, ""), (0, 0, "copy1", "transfer-prefetch", 2, 0, 50, 5, 20, ""),
            (0, 0, "copy0", "evict", 7, 0, 100, 12, 12, "")]
    c = counter_series(Timeline(table(rows)))
    t, v = c["bytes in flight"]
    assert list(zip(t, v)) == [(0, 100), (5, 150), (10, 50), (20, 0)]
    t, v = c["cache occupancy Δ"]
    assert list(zip(t, v)) == [(10, 100), (12, 0), (20, 50)]


# ---------------------------------------------------------------------------------------------- exports
def test_chrome_export_parses_and_validates(tl, tmp_path):
    import jsonschema

    from moelab.timeline.export import CHROME_SCHEMA, to_chrome

    path = to_chrome([tl, Timeline(table(), name="other")], tmp_path / "t.json")
    doc = json.loads(Path(path).read_text())
    jsonschema.validate(doc, CHROME_SCHEMA)
    ev = doc["traceEvents"]
    x = [e for e in ev if e["ph"] == "X" and e["pid"] == 1]
    assert len(x) == len(tl)
    e3 = next(e for e in x if e["name"] == "expert-device L0 e3")
    assert e3["ts"] == 30 and e3["dur"] == 10 and e3["args"]["fate"] == "miss-fetch" and e3["args"]["bytes"] == 50
    threads = {e["args"]["name"]: e["tid"] for e in ev if e["name"] == "thread_name" and e["pid"] == 1}
    assert set(threads) == {"control", "device", "copy", "host"}
    s = [e for e in ev if e["ph"] == "s" and e["pid"] == 1]
    f = [e for e in ev if e["ph"] == "f" and e["pid"] == 1]
    assert len(s) == len(f) == 1 and s[0]["id"] == f[0]["id"] and s[0]["tid"] == threads["copy"]
    assert f[0]["tid"] == threads["device"] and f[0]["ts"] == 30
    assert {e["pid"] for e in ev} == {1, 2} and any(e["ph"] == "C" for e in ev)
    with pytest.raises(jsonschema.ValidationError):  # the schema can fail
        jsonschema.validate({"traceEvents": [{"ph": "X", "pid": 1, "name": "x", "ts": 0}]}, CHROME_SCHEMA)


def test_perfetto_export_decodes(tl, tmp_path):
    pb = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2",
                             reason="the `perfetto` package is not installed")
    from moelab.timeline.export import to_perfetto

    trace = pb.Trace.FromString(Path(to_perfetto(tl, tmp_path / "t.pftrace")).read_bytes())
    tracks = {p.track_descriptor.uuid: p.track_descriptor for p in trace.packet if p.HasField("track_descriptor")}
    lanes = {d.thread.thread_name: u for u, d in tracks.items() if d.HasField("thread")}
    assert set(lanes) == {"control", "device", "copy", "host"}
    te = [p for p in trace.packet if p.HasField("track_event")]
    begins = [p for p in te if p.track_event.type == pb.TrackEvent.TYPE_SLICE_BEGIN]
    ends = [p for p in te if p.track_event.type == pb.TrackEvent.TYPE_SLICE_END]
    assert len(begins) == len(ends) == len(tl)
    e3 = next(p for p in begins if p.track_event.name == "expert-device L0 e3")
    assert e3.timestamp == 30_000 and e3.track_event.track_uuid == lanes["device"]
    ann = {a.name: a for a in e3.track_event.debug_annotations}
    assert ann["fate"].string_value == "miss-fetch" and ann["bytes"].int_value == 50
    copy = next(p for p in begins if p.track_event.name == "transfer-demand L0 e3")
    assert list(copy.track_event.flow_ids) == list(e3.track_event.terminating_flow_ids) != []
    counters = [p for p in te if p.track_event.type == pb.TrackEvent.TYPE_COUNTER]
    assert counters and all(tracks[p.track_event.track_uuid].HasField("counter") for p in counters)


# ---------------------------------------------------------------------------------------------- CLI
def _cli(*argv):
    from moelab.cli import main

    return main(list(argv))


def test_cli(tl, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    table().to_parquet(run / "events.parquet")
    assert _cli("timeline", "summary", str(run)) == 0
    out = capsys.readouterr().out
    assert "stalls" in out and "copy 0.02 ms" in out and "critical" in out
    assert _cli("timeline", "summary", str(run), str(run / "events.parquet"), "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(r["metric"] == "overlap_pct" and r["ratio"] == pytest.approx(1.0) for r in rows)
    assert _cli("timeline", "show", str(run), "--no-open") == 0
    html = (run / "timeline.html").read_text()
    assert "Plotly.newPlot" in html and ("copy → compute" in html or "copy \\u2192 compute" in html)
    assert _cli("timeline", "export", str(run), "--format", "chrome", "--out", str(tmp_path / "c.json")) == 0
    assert json.loads((tmp_path / "c.json").read_text())["traceEvents"]
    assert _cli("timeline", "export", str(run), "--format", "chrome", "--out", str(tmp_path / "c.json")) == 2
    assert "already exists" in capsys.readouterr().err


def test_cli_bad_input(tmp_path, capsys):
    assert _cli("timeline", "summary", str(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no events.parquet" in err and "moelab run" in err
    bad = tmp_path / "e.parquet"
    table().drop(columns=["lane"]).to_parquet(bad)
    assert _cli("timeline", "export", str(bad), "--out", str(tmp_path / "x.json")) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "lane" in err and not (tmp_path / "x.json").exists()


def test_panel_selects_and_overlays():
    pytest.importorskip("ipywidgets", reason="ipywidgets is not installed")
    from moelab.timeline.synth import synthetic_events
    from moelab.timeline.widgets import panel

    p = panel({"real": Timeline(synthetic_events(steps=4, layers=3, seed=1)),
               "sim": Timeline(synthetic_events(steps=4, layers=3, seed=2))})
    assert p.run_select.value == ("real", "sim")
    p.step_range.value = (1, 2)
    p.layer_range.value = (0, 1)
    sel = p.selected()
    assert set(sel["real"].steps) == {1, 2} and set(sel["sim"].layers) == {0, 1}
    assert list(p.figure().layout.yaxis.ticktext)[:2] == ["real · control", "sim · control"]
    assert "ratio" in p.summary_html.value
    p.run_select.value = ("sim",)
    assert p.summary()["metric"].tolist()[0] == "name" and "real" not in p.figure().layout.title.text


# ---------------------------------------------------------------------------------------------- a real run
def test_a_real_executor_run(tmp_path):
    torch = pytest.importorskip("torch")
    import moelab
    from moelab.models.tiny import build_tiny

    model = build_tiny("mixtral", seed=0).eval()
    ids = torch.randint(3, 250, (1, 5), generator=torch.Generator().manual_seed(0))
    cfg = {"cache": {"capacity": 0.25, "policy": "lru"}, "placement": "host-misses",
           "routing": {"deferred": 1, "min_immediate": 1}, "executor": "real"}
    with moelab.hybrid(model, cfg) as run:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                       pad_token_id=0)
    tl = Timeline(run.events_table())
    s = run.summary()  # the hybrid run's own summary is the timeline's busy/overlap rule
    assert tl.busy_pct() == pytest.approx(s["busy_pct"]) and tl.overlap_pct() == pytest.approx(s["overlap_pct"])
    fates = set(tl.fates()) - {""}
    assert "deferred" in fates and fates <= {"hit", "miss-host", "miss-fetch", "deferred"}
    # stalls partition the control thread's idle time inside each step
    ev = tl.events
    ctl = ev[ev["lane"] == "control"]
    idle = sum(g["t_end_us"].max() - g["t_start_us"].min() - (g["t_end_us"] - g["t_start_us"])[g["kind"] != "wait"].sum()
               for _, g in ctl.groupby("step", observed=True))
    assert sum(tl.stalls().values()) == pytest.approx(idle, rel=1e-6)
    for step in tl.steps:
        cp = tl.critical_path(step)
        e = cp.events
        assert (e["t_start_us"].to_numpy()[1:] >= e["t_end_us"].to_numpy()[:-1] - 1e-6).all()
        assert 0 < cp.length_us <= cp.wall_us + 1e-6 and e["lane"].iloc[0] == "control"


def test_synthetic_events_structure():
    from moelab.timeline.synth import synthetic_events

    df = synthetic_events(events=20_000, seed=3)
    assert len(df) >= 20_000 and list(df.columns) == list(COLUMNS)
    tl = Timeline(df)
    assert tl.lanes == ["control", "device", "copy0", "copy1", "host0", "host1"] and tl.layers == list(range(58))
    # serial lanes (evictions are instants), and every demand copy feeds a device compute
    for lane, g in tl.events[tl.events["kind"] != "evict"].groupby("lane", observed=True):
        if lane != "copy1":  # prefetches of consecutive layers may overlap
            assert (g["t_start_us"].to_numpy()[1:] >= g["t_end_us"].to_numpy()[:-1] - 1e-9).all(), lane
    demand = int((tl.events["kind"] == "transfer-demand").sum())
    fed = tl.feeds()
    assert demand and (tl.events["kind"].to_numpy()[fed["tr"]] == "transfer-demand").sum() == demand
    assert set(tl.fates()) - {""} == set(FATES)


def test_bench_cli_small(capsys):
    assert _cli("bench", "timeline", "--events", "3000", "--skip-perfetto", "--json", "--allow-busy") == 0
    r = json.loads(capsys.readouterr().out)
    assert r["events"] >= 3000 and r["html_mb"] > 0 and r["chrome_s"] > 0 and set(r["targets"]) == {
        "figure_s", "html_mb", "chrome_s"}


def test_timeline_help_is_light():
    import subprocess
    import sys

    code = ("import sys\nfrom moelab.cli import main\ntry:\n    main(['timeline', 'export', '--help'])\n"
            "except SystemExit:\n    pass\nprint([m for m in ('torch', 'pandas', 'plotly', 'perfetto') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_figure_draws_the_critical_path(tl):
    fig = tl.figure(critical_path=0)
    cp = next(d for d in fig.data if d.name == "critical path, step 0")
    # dense0 (control, row 0) → host miss (row 3) → deferred (row 3) → dense2 (row 0), in ms
    assert np.allclose(np.asarray(cp.x, dtype=float), [0, 0.01, 0.01, 0.035, 0.04, 0.06, 0.06, 0.07])
    assert list(np.asarray(cp.y, dtype=float)) == [0, 0, 3, 3, 3, 3, 0, 0]


def test_panel_level_of_detail_follows_the_zoom():
    pytest.importorskip("anywidget", reason="plotly's FigureWidget needs anywidget")
    from moelab.timeline.synth import synthetic_events
    from moelab.timeline.widgets import panel

    tl = Timeline(synthetic_events(steps=8, layers=6, seed=4), name="syn")
    p = panel(tl, steps=(0, 7), detail_budget=200)
    assert "per layer" in p.fig.layout.title.text  # 8 steps × ~70 events: mostly aggregated
    ticks = list(p.fig.layout.yaxis.ticktext)
    sel = tl.select(steps=[5])
    a = (sel.t0 - tl.t0) / 1e3
    p.fig.layout.xaxis.range = [a, a + 0.3]  # zoom into a fraction of step 5: single events
    title = p.fig.layout.title.text
    assert "single events" in title and "per layer" not in title
    assert list(p.fig.layout.yaxis.ticktext) == ticks and tuple(p.fig.layout.xaxis.range) == (a, a + 0.3)
    hover = [d for d in p.fig.data if d.mode == "markers" and d.hovertemplate and "expert %{customdata[2]}" in
             d.hovertemplate]
    xs = np.concatenate([np.asarray(d.x, dtype=float) for d in hover])
    assert xs.min() >= a - 1.0 and xs.max() <= a + 1.3  # drawn on the same time axis
    p.fig.layout.xaxis.range = None  # back out: the whole selection again
    assert "per layer" in p.fig.layout.title.text


@pytest.mark.parametrize("argv", [["timeline", "--help"], ["timeline", "summary", "--help"],
                                  ["timeline", "show", "--help"], ["timeline", "export", "--help"],
                                  ["bench", "timeline", "--help"]], ids=" ".join)
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _cli(*argv)
    assert e.value.code == 0 and "usage" in capsys.readouterr().out


def test_exports_keep_slices_nested(tmp_path):
    """Overlapping work on one lane moves to a second thread; nested and instant events stay;
    replaying the Perfetto begin/end packets per track gives back every event's duration."""
    pb = pytest.importorskip("perfetto.protos.perfetto.trace.perfetto_trace_pb2",
                             reason="the `perfetto` package is not installed")
    from moelab.timeline.export import to_chrome, to_perfetto

    rows = [(0, 0, "copy1", "transfer-prefetch", 1, 0, 8, 0, 10, ""),   # overlaps the next one partially
            (0, 0, "copy1", "transfer-prefetch", 2, 0, 8, 5, 15, ""),
            (0, 0, "copy1", "evict", 3, 0, 8, 15, 15, ""),             # an instant where the second ends
            (0, 0, "copy1", "transfer-prefetch", 4, 0, 8, 15, 20, ""),  # starts as the second ends
            (0, 0, "copy1", "transfer-insert", 5, 0, 8, 16, 18, "")]    # nested in the third
    tl = Timeline(table(rows))
    doc = json.loads(Path(to_chrome(tl, tmp_path / "c.json")).read_text())
    threads = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    by_expert = {e["args"]["expert"]: threads[e["tid"]] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert by_expert == {1: "copy1", 2: "copy1 #2", 3: "copy1", 4: "copy1", 5: "copy1"}
    trace = pb.Trace.FromString(Path(to_perfetto(tl, tmp_path / "p.pftrace")).read_bytes())
    stacks: dict[int, list] = {}
    got = {}
    for p in trace.packet:
        if not p.HasField("track_event") or p.track_event.type == pb.TrackEvent.TYPE_COUNTER:
            continue
        te = p.track_event
        if te.type == pb.TrackEvent.TYPE_INSTANT:
            got[te.name] = 0
        elif te.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            stacks.setdefault(te.track_uuid, []).append((te.name, p.timestamp))
        else:
            name, t = stacks[te.track_uuid].pop()
            got[name] = p.timestamp - t
    assert got == {"transfer-prefetch L0 e1": 10_000, "transfer-prefetch L0 e2": 10_000, "evict L0 e3": 0,
                   "transfer-prefetch L0 e4": 5_000, "transfer-insert L0 e5": 2_000}


def test_reading_a_timeline_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, moelab.timeline.core, moelab.timeline.export\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.strip().splitlines()[-1] == "False"
