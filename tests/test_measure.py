"""The one measurement function: warm-up, repeats, median and spread, the load, and a verdict
that benchmarks enforce and reports show (tests use fake clocks and loads, never wall time)."""

from __future__ import annotations

import pytest

from moelab import measure as M


def _fake_load(monkeypatch, load: float, cpus: int = 2):
    monkeypatch.setattr(M, "machine_load", lambda: {"load1": load, "cpus": cpus, "per_cpu": load / cpus})


def test_warm_up_is_untimed_and_the_median_and_spread_are_of_the_repeats(monkeypatch):
    _fake_load(monkeypatch, 0.1)
    calls = []
    m = M.measure(lambda: calls.append(1), warmup=3, repeat=7)
    assert len(calls) == 10 and len(m.samples) == 7
    m = M.from_samples([1.0, 1.0, 1.1, 1.0, 0.9, 1.0, 5.0])
    assert m.median == 1.0 and m.spread == pytest.approx(0.025) and not m.busy  # the IQR ignores one outlier
    assert "1000 ms (median of 7, spread ±2.5%, load 0.1 on 2 CPUs)" in str(m)


def test_the_own_share_of_the_load_average_is_its_exponential_average(monkeypatch):
    """A process busy on one core for 60 s adds 1 − e^-1 ≈ 0.632 to the 1-minute load average
    (the kernel's exponential average); what is left of the load average is other work, and
    only that makes a machine busy: a 2-thread benchmark alone on 2 CPUs is not."""
    import math

    clock = {"t": 1000.0, "cpu": 50.0}
    monkeypatch.setattr(M.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(M, "_cpu_seconds", lambda: clock["cpu"])
    monkeypatch.setattr(M, "_HISTORY", [(1000.0, 50.0)])
    clock.update(t=1060.0, cpu=110.0)  # one core for 60 s
    assert M._own_cpus() == pytest.approx(1 - math.exp(-1))
    clock.update(t=1120.0, cpu=110.0)  # then idle for 60 s: it decays
    assert M._own_cpus() == pytest.approx((1 - math.exp(-1)) * math.exp(-1))
    monkeypatch.setattr(M, "_HISTORY", [(1000.0, 0.0)])
    clock.update(t=1600.0, cpu=1200.0)  # two threads for 10 minutes: the average has caught up
    monkeypatch.setattr(M.os, "getloadavg", lambda: (2.05, 2.0, 2.0))
    monkeypatch.setattr(M.os, "sched_getaffinity", lambda _pid: {0, 1})
    load = M.machine_load()
    assert load["own"] == pytest.approx(2.0, abs=1e-3) and load["other"] == pytest.approx(0.05, abs=1e-3)
    assert not M.from_samples([1.0, 1.0, 1.0], load_before=load).busy


def test_a_loaded_machine_is_busy_and_refused_a_wide_spread_only_flagged(monkeypatch):
    _fake_load(monkeypatch, 4.0)
    m = M.from_samples([1.0, 1.0, 1.0])
    assert m.busy and "other work's load 4.0 on 2 CPUs" in m.reason and "BUSY" in str(m)
    with pytest.raises(M.BusyMachineError, match="busy machine.*--allow-busy"):
        m.check()
    assert m.check(allow_busy=True) is m
    _fake_load(monkeypatch, 0.1)
    wide = M.from_samples([1.0, 2.0, 3.0])  # a wide spread is flagged, not refused: it is not the load
    assert not wide.busy and "spread ±50%" in wide.unstable and "UNSTABLE" in str(wide)
    wide.check()
    with pytest.raises(M.MoelabError, match="repeat ≥ 1"):
        M.measure(lambda: None, repeat=0)


def test_the_kernel_report_hides_the_bandwidth_share_when_busy(monkeypatch, tmp_path):
    """The demo's kernel section showed 467 % of a read bandwidth measured under load; now it
    says the machine was busy and shows no share."""
    pytest.importorskip("moelab.kernels.op")
    from moelab.report import ReportContext
    from moelab.report.kernels import kernels_section

    _fake_load(monkeypatch, 9.0)
    ctx = ReportContext(model=None, tokenizer=None, model_name="m", trace=None, workdir=tmp_path, quick=True)
    sec = kernels_section(ctx)
    assert "Measured on a busy machine" in sec.html and "<td>busy</td>" in sec.html
    assert "BUSY MACHINE" in sec.figures[0].layout.title.text


@pytest.mark.parametrize("argv", [["bench", "timeline", "--events", "2000", "--skip-perfetto"],
                                  ["bench", "simulate", "--tokens", "4", "--reference-tokens", "2"]],
                         ids=["timeline", "simulate"])
def test_benches_print_medians_with_spread_and_load_and_refuse_a_busy_machine(argv, monkeypatch, capsys):
    """Every bench reports a median of repeats with its spread and load; on a busy machine it
    prints its figures flagged, then exits 2 unless --allow-busy."""
    from moelab.cli import main

    _fake_load(monkeypatch, 0.1)
    assert main([*argv, "--repeat", "3", "--allow-busy"]) == 0
    out = capsys.readouterr().out
    assert "median" in out and "±" in out and "load" in out
    _fake_load(monkeypatch, 9.0)
    assert main([*argv, "--repeat", "3"]) == 2
    captured = capsys.readouterr()
    assert "BUSY" in captured.out and "--allow-busy" in captured.err
