"""moelab.timeline: summaries on hand-made event tables (figures computed by hand in the comments),
the figure's traces, exports parsed back, and the CLI."""

from __future__ import annotations

import pandas as pd
import pytest

from moelab.errors import MoelabError
from moelab.hybrid.events import COLUMNS, summarize
from moelab.timeline import Timeline

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
    assert st == pytest.approx({"copy": 20, "deferred": 10, "host": 5, "device": 5, "other": 0})
    assert sum(st.values()) == pytest.approx(40)


def test_explicit_wait_cause_wins():
    rows = [(0, 0, "control", "dense", -1, 0, 0, 0, 10, ""), (0, 0, "control", "wait", -1, 0, 0, 10, 30, "copy"),
            (0, 0, "host", "expert-host", 1, 1, 0, 10, 30, "miss-host"), (0, 1, "control", "dense", -1, 0, 0, 30, 35, ""),
            (0, 1, "control", "wait", -1, 0, 0, 35, 40, "lanes")]
    st = Timeline(table(rows)).stalls()
    assert st == pytest.approx({"copy": 20, "deferred": 0, "host": 0, "device": 0, "other": 5})


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
