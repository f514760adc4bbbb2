"""Calibration you can trust (#25 items 7 and 8), from the definitions: physical bounds on every
calibrated value and fit, a busy machine refused or flagged, repeated validation runs that must
agree, and moelab's executor's runtime overhead as a labelled term of the simulation. Loads are
faked and values synthetic: no test depends on wall-clock time."""

from __future__ import annotations

import numpy as np
import pytest

from moelab import measure as M
from moelab.errors import MoelabError
from moelab.simulate import bounds as B
from moelab.simulate.calibrate import _Routing, fit_fixed_per_byte

# the values issue #25 found written without a word
ISSUE_VALUES = {"link_bandwidth_gbs": 0.56, "gpu_dense_efficiency": 0.0118, "decode_layer_time_us": 841_218.0}


def _profile(**values) -> dict:
    base = {"name": "box", "description": "a box",
            "link_bandwidth_gbs": {"value": 12.0, "stated": "measured"},
            "gpu_dense_efficiency": {"value": 0.5, "stated": "measured"},
            "decode_layer_time_us": {"value": 900.0, "assumed": "estimated"},
            "cpu_memory_efficiency": {"value": 0.7, "stated": "measured"}}
    for k, v in values.items():
        base[k] = {"value": v, "stated": "measured"}
    return base


def _fake_load(monkeypatch, other: float, cpus: int = 2):
    load = {"load1": other, "cpus": cpus, "per_cpu": other / cpus, "own": 0.0, "other": other,
            "other_per_cpu": other / cpus}
    monkeypatch.setattr(M, "machine_load", lambda: dict(load))
    return load


# ---------------------------------------------------------------------- bounds
def test_the_issues_values_are_each_named_with_their_bound_and_nothing_is_written():
    violations = B.check_bounds(_profile(**ISSUE_VALUES))
    assert {v.what for v in violations} == set(ISSUE_VALUES)
    with pytest.raises(B.OutOfBoundsError) as e:
        B.enforce(_profile(**ISSUE_VALUES), violations)
    msg = str(e.value)
    assert "link_bandwidth_gbs = 0.56, expected in [1, 128] GB/s" in msg
    assert "gpu_dense_efficiency = 0.0118, expected in [0.05, 1]" in msg
    assert "decode_layer_time_us = 8.412e+05, expected in [1, 200000] µs" in msg
    assert "nothing was written" in msg and "--allow-out-of-bounds" in msg and "To fix:" in msg


def test_allowed_out_of_bounds_values_are_marked_in_their_provenance_and_the_description():
    prof = _profile(link_bandwidth_gbs=0.56)
    out = B.enforce(prof, B.check_bounds(prof), allow=True)
    assert out["link_bandwidth_gbs"]["value"] == 0.56
    assert out["link_bandwidth_gbs"]["stated"].startswith("OUT OF BOUNDS (written with --allow-out-of-bounds)")
    assert out["description"].startswith("WARNING: 1 value(s) outside physical bounds (link_bandwidth_gbs)")
    assert out["cpu_memory_efficiency"] == prof["cpu_memory_efficiency"]  # in bounds: untouched


@pytest.mark.parametrize("field,value,ok", [
    ("link_bandwidth_gbs", 1.0, True), ("link_bandwidth_gbs", 0.999, False), ("link_bandwidth_gbs", 128.0, True),
    ("link_bandwidth_gbs", 129.0, False), ("cpu_memory_efficiency", 1.0, True), ("cpu_memory_efficiency", 0.0, False),
    ("cpu_memory_efficiency", 1.01, False), ("gpu_memory_efficiency", 1e-9, True), ("decode_layer_time_us", 200_000, True),
    ("decode_layer_time_us", float("nan"), False), ("link_bandwidth_gbs", float("inf"), False),
])
def test_a_bound_holds_at_its_edges_and_efficiencies_are_in_the_open_closed_unit_interval(field, value, ok):
    assert B.BOUNDS[field].holds(value) is ok


def test_every_shipped_pcie_profile_is_within_the_bounds():
    """The bounds are physical: real machines' spec-sheet values pass (NVLink-C2C is not PCIe)."""
    from moelab.timing import available_profiles, get_profile

    for name in available_profiles():
        bad = [v.what for v in B.check_bounds(get_profile(name).to_dict())]
        assert bad == ([] if get_profile(name).link_bandwidth_gbs <= 128 else ["link_bandwidth_gbs"]), name


def _points(fn, xs=(1e3, 1e4, 1e5, 1e6, 1e7)):
    return [{"bytes": x, "us": fn(x)} for x in xs]


def test_a_fit_of_fixed_plus_bytes_over_rate_passes_and_has_r2_one():
    fit = fit_fixed_per_byte(_points(lambda x: 100 + x / 1e4))
    assert fit["fixed_us"] == pytest.approx(100) and fit["bytes_per_us"] == pytest.approx(1e4)
    assert fit["dropped"] == [] and B.fit_r2(fit) == pytest.approx(1.0)
    assert B.check_fit("host_call", fit) == []


def test_a_negative_intercept_or_a_flat_slope_or_a_poor_r2_is_flagged():
    neg = fit_fixed_per_byte(_points(lambda x: -500 + x / 1e3, xs=(1e6, 2e6, 4e6, 8e6)))
    assert neg["dropped"] == ["fixed"] and neg["raw_fixed"] < 0
    assert [v.what for v in B.check_fit("dense", neg)] == ["fit dense: fixed term"]
    flat = fit_fixed_per_byte(_points(lambda x: 1000.0 - x / 1e5))  # time falls with the bytes: no bandwidth
    assert "fit dense: per-byte slope" in [v.what for v in B.check_fit("dense", flat)]
    rng = np.random.default_rng(0)
    noisy = fit_fixed_per_byte(_points(lambda x: 100 + x / 1e4 * rng.uniform(0.1, 3.0)))
    assert B.fit_r2(noisy) < B.MIN_R2
    assert "fit host_call: R²" in [v.what for v in B.check_fit("host_call", noisy)]


def test_a_negative_term_within_the_noise_is_a_zero_not_a_refusal():
    # calls of 6 and 24 experts, one row each: 1000 µs + bytes, and per expert -0.05 µs (a zero, measured):
    # it takes at most 1.2 µs off a 1000+ µs call, under NEGLIGIBLE_PCT
    pts = [{"bytes": x, "distinct": d, "us": 1000 + x / 1e4 - 0.05 * d} for x in (1e5, 1e6, 4e6) for d in (6, 24)]
    fit = fit_fixed_per_byte(pts, extra="distinct")
    assert fit["dropped"] == ["per_extra"] and fit["raw_per_extra"] < 0
    assert 0 < fit["raw_per_extra_max_pct"] <= B.NEGLIGIBLE_PCT
    assert B.check_fit("host_call", fit) == []
    # -20 µs per expert on the same calls, measured exactly (standard error 0): refused, with its value
    big = fit_fixed_per_byte([{**p, "us": p["us"] - 20 * p["distinct"]} for p in pts], extra="distinct")
    assert big["raw_per_extra_max_pct"] > B.NEGLIGIBLE_PCT and big["raw_per_extra_se"] < 1e-6
    assert "fit host_call: per_extra term" in [v.what for v in B.check_fit("host_call", big)]


def test_a_negative_term_the_points_cannot_tell_from_zero_is_not_a_refusal():
    # no per-expert cost, ±15 % noise: the fit's per-expert term comes out -0.72 ± 0.83 µs (8.6 % of a
    # point): more than negligible, but within two standard errors of zero
    pts = [{"bytes": x, "distinct": d, "us": 200 + x / 1e4} for x in (1e5, 1e6, 4e6, 1e7) for d in (6, 24)]
    rng = np.random.default_rng(6)
    fit = fit_fixed_per_byte([{**p, "us": p["us"] * rng.uniform(0.85, 1.15)} for p in pts], extra="distinct")
    assert fit["dropped"] == ["per_extra"] and fit["raw_per_extra_max_pct"] > B.NEGLIGIBLE_PCT
    assert fit["raw_per_extra"] + B.ZERO_SE * fit["raw_per_extra_se"] >= 0
    assert B.check_fit("host_call", fit) == []
    # the device fit stop 57 refused (tiny reference calls of 1 and 4 tokens sharing 16 experts): fixed
    # -1610 µs, 4 standard errors below zero, stays refused
    seen = [(147456, 6, 2412.6), (331460.9, 13.5, 7623.2), (1622016, 6, 2696.3), (3649536, 13.5, 7811.0),
            (6488064, 6, 3399.3), (14909440, 13.8, 9097.5), (25952256, 6, 6200.9), (60014592, 13.9, 19150.2),
            (103809024, 6, 14914.9), (233570304, 13.5, 41017.7)]
    dev = fit_fixed_per_byte([{"bytes": x, "distinct": d, "us": u} for x, d, u in seen], extra="distinct")
    assert dev["dropped"] == ["fixed"] and dev["raw_fixed"] + B.ZERO_SE * dev["raw_fixed_se"] < 0
    assert [v.what for v in B.check_fit("device_call", dev)] == ["fit device_call: fixed term"]


def test_per_call_routing_gives_every_expert_one_token_as_a_decode_call():
    r = _Routing(4, 24, 6, seed=3, one_row=True)
    for _ in range(5):
        assert r.ids.shape == (4, 6) and r.ids.unique().numel() == 24
        r.redraw()
    with pytest.raises(MoelabError, match="need ≥ 24 experts, got 16"):
        _Routing(4, 16, 6, one_row=True)


# ---------------------------------------------------------------------- a busy machine
def test_calibrate_refuses_to_start_on_a_busy_machine_before_measuring_anything(monkeypatch):
    from moelab.simulate import calibrate as C

    _fake_load(monkeypatch, 4.0)
    monkeypatch.setattr(C, "_memory_read_gbps", lambda *a: pytest.fail("measured on a busy machine"))
    with pytest.raises(M.BusyMachineError, match=r"refusing to calibrate on a busy machine: other work's load "
                                                 r"4.0 on 2 CPUs.*--allow-busy"):
        C.calibrate(C.CalibrateConfig(), progress=False)


def _verdicts(monkeypatch, series, *, other_after=0.1, allow_busy=False):
    from moelab.simulate import calibrate as C

    quiet = _fake_load(monkeypatch, 0.1)
    after = dict(quiet, other=other_after, other_per_cpu=other_after / 2, load1=other_after)
    fits = {"host_call": fit_fixed_per_byte(_points(lambda x: 100 + x / 1e4))}
    return C._verdicts(_profile(), {"fits": fits}, series, quiet, after, "", allow_busy=allow_busy,
                       allow_out_of_bounds=False)


def test_repeated_measurements_that_disagree_or_load_after_mark_the_machine_busy(monkeypatch):
    with pytest.raises(M.BusyMachineError, match=r"spread ±40% \(median over 3 timed series; > ±25%\)"):
        _verdicts(monkeypatch, [0.4, 0.5, 0.1])
    with pytest.raises(M.BusyMachineError, match="after: other work's load 3.0 on 2 CPUs"):
        _verdicts(monkeypatch, [0.01], other_after=3.0)
    prof, raw = _verdicts(monkeypatch, [0.01, 0.02, 0.03])  # quiet and consistent: written as measured
    assert prof["link_bandwidth_gbs"]["stated"] == "measured" and raw["busy"] == ""


def test_allow_busy_flags_every_measured_figure(monkeypatch):
    prof, raw = _verdicts(monkeypatch, [0.4, 0.5, 0.1], allow_busy=True)
    assert "spread ±40%" in raw["busy"] and prof["description"].startswith("BUSY MACHINE when calibrated")
    stated = [e["stated"] for e in prof.values() if isinstance(e, dict) and "stated" in e]
    assert stated and all(s.startswith("BUSY MACHINE (--allow-busy: ") for s in stated)


def test_require_quiet_reads_only_other_work_and_says_how_to_go_on(monkeypatch):
    _fake_load(monkeypatch, 1.0)  # 0.5 per CPU: quiet
    assert M.require_quiet("calibrate")[1] == ""
    _fake_load(monkeypatch, 3.0)
    load, why = M.require_quiet("calibrate", allow_busy=True)
    assert load["other"] == 3.0 and "other work's load 3.0 on 2 CPUs" in why
    assert M.busy_reason({"load1": 3.0, "cpus": 2, "per_cpu": 1.5}) != ""  # no own/other split: the whole load
    assert M.spread_of([1.0, 2.0, 3.0]) == pytest.approx(0.5)


def test_validate_refuses_a_busy_machine_before_any_run(monkeypatch):
    from moelab.simulate import validate as V

    _fake_load(monkeypatch, 4.0)
    monkeypatch.setattr(V, "calibrated_profile", lambda **k: pytest.fail("calibrated on a busy machine"))
    with pytest.raises(M.BusyMachineError, match="refusing to validate the simulator against this machine"):
        V.machine_rows(quick=True)


# ---------------------------------------------------------------------- the benches' profile
class _Calibrating(Exception):
    """Raised by the fake calibration: the bench asked for one (and stops there)."""


def test_both_benches_calibrate_through_one_helper_and_only_the_throughput_bench_says_so(monkeypatch):
    from moelab.simulate import validate as V
    from moelab.simulate.moegen.bench import run_bench
    from moelab.simulate.side_by_side import side_by_side

    calls: list[dict] = []

    def fake(**kw):
        calls.append(kw)
        raise _Calibrating

    monkeypatch.setattr(V, "calibrated_profile", fake)
    said: list[str] = []
    with pytest.raises(_Calibrating):
        run_bench(["tiny-random-mixtral"], profile=None, progress=said.append)
    with pytest.raises(_Calibrating):
        side_by_side(profile=None, allow_busy=True, device_backend="reference")  # (auto would probe first)
    # moelab calibrate --quick's settings, each bench's allow_busy (and the side-by-side's device backend) passed on
    assert calls == [{"quick": True, "allow_busy": False, "device_backend": "reference"},
                     {"quick": True, "allow_busy": True, "device_backend": "reference"}]
    assert said == ["calibrating this machine (moelab calibrate --quick settings) for the simulation ..."]


def test_a_given_profile_is_used_as_given_and_nothing_is_calibrated(monkeypatch):
    from moelab.simulate import validate as V
    from moelab.timing import get_profile

    monkeypatch.setattr(V, "calibrated_profile", lambda **k: pytest.fail("calibrated with a profile given"))
    said: list[str] = []
    prof, path = V.profile_or_calibrated("pcie4-x16", progress=said.append)
    assert path == "pcie4-x16" and prof.to_dict() == get_profile("pcie4-x16").to_dict() and said == []


# ---------------------------------------------------------------------- repeated validation runs
def test_runs_agree_when_their_medians_are_within_ten_percent_of_the_larger():
    from moelab.simulate.validate import runs_agree

    assert runs_agree([20.0, 21.0]) == (True, pytest.approx(1 / 21))
    assert runs_agree([20.0, 22.0]) == (True, pytest.approx(2 / 22))
    assert runs_agree([20.0, 23.0])[0] is False
    assert runs_agree([430.0, 27.0])[0] is False  # the issue's two runs
    assert runs_agree([12.0]) == (None, 0.0)


def test_the_targets_are_met_only_when_every_run_meets_them():
    from moelab.simulate.validate import machine_targets

    t = machine_targets([{"median": 8.0, "worst": 20.0}, {"median": 8.5, "worst": 26.0}])
    assert [x["met"] for x in t] == [True, False, True]
    assert t[0]["target"] == "median |error| ≤ 10 %" and t[1]["target"] == "worst |error| ≤ 25 %"
    assert "run 1 8.0 %, run 2 8.5 %" in t[0]["value"] and "6 % apart" in t[2]["value"]
    one = machine_targets([{"median": 8.0, "worst": 9.0}])
    assert one[2]["met"] is None and "--repeat 2" in one[2]["value"]


def test_format_rows_prints_the_targets_and_labels_every_simulated_number():
    from moelab.simulate.validate import format_rows, machine_targets

    runs = [{"run": 1, "median": 30.0, "worst": 40.0, "median_hardware": 60.0, "prediction": "moelab executor"},
            {"run": 2, "median": 31.0, "worst": 41.0, "median_hardware": 61.0, "prediction": "moelab executor"}]
    row = {"group": "machine", "case": "tiny", "metric": "decode step ms", "reference": 10.0,
           "reference_kind": "measured", "simulated": 13.0, "simulated_hardware": 4.0, "error": 30.0,
           "error_unit": "%", "target": "≤ 10 % median", "prediction": "moelab executor", "busy": ""}
    text = format_rows([dict(row, run=1), dict(row, run=2, busy="other work's load 3.0")],
                       {"runs": runs, "targets": machine_targets(runs), "profile": "p"})
    assert "[run 1] tiny" in text and "[run 2] tiny" in text and "10 (measured) BUSY" in text
    assert "moelab executor (hardware 4)" in text
    assert "median |error| ≤ 10 %: run 1 30.0 %, run 2 31.0 % — MISSED" in text
    assert "2 runs' medians agree within 10 %: run 1 30.0 %, run 2 31.0 %: 3 % apart — met" in text


# ---------------------------------------------------------------------- runtime overhead as a term
def test_the_executor_prediction_adds_runtime_overhead_per_layer_and_per_lane_call():
    from moelab.simulate.executor import simulate_plans
    from moelab.simulate.runtime import EXECUTOR, HARDWARE, hardware_only, prediction_label
    from tests.test_simulate_engine import HandShape, hand_profile, plan

    # two MoE layers, each one device expert (a call) and one host expert (a call)
    plans = [plan(0, device=[(1, 1)], host=[(2, 1)], hits=[1]),
             plan(1, device=[(1, 1)], host=[(2, 1)], hits=[1])]
    hw = hand_profile()
    ex = hw.with_changes(runtime_layer_us=1000.0, runtime_call_us=10_000.0)
    assert prediction_label(hw) == HARDWARE and prediction_label(ex) == EXECUTOR
    assert prediction_label(hardware_only(ex)) == HARDWARE
    base = simulate_plans(plans, HandShape(), hw).summary()["decode_step_us"]
    both = simulate_plans(plans, HandShape(), ex).summary()["decode_step_us"]
    # per layer: the control thread's 1000 µs, then the device and host calls in parallel, each 10_000 µs
    # longer (the hand-offs overlap as the calls do): 2 × (1000 + 10_000) on the critical path
    assert both - base == pytest.approx(2 * (1000 + 10_000), rel=1e-6)
    assert simulate_plans(plans, HandShape(), hardware_only(ex)).summary()["decode_step_us"] == pytest.approx(base)


def test_every_shipped_profile_predicts_the_hardware():
    from moelab.simulate.runtime import HARDWARE, prediction_label
    from moelab.timing import available_profiles, get_profile

    for name in available_profiles():
        hw = get_profile(name)
        assert prediction_label(hw) == HARDWARE, name
        assert hw.provenance["runtime_layer_us"].startswith("assumed: not measured"), name


def test_the_what_if_command_says_which_prediction_its_numbers_are():
    from moelab.cli.simulate import _predicts
    from moelab.timing import get_profile

    hw = get_profile("pcie4-x16")
    assert _predicts("pcie4-x16") == "the hardware pcie4-x16 alone (no runtime overhead of moelab's executor in the profile)"
    ex = hw.with_changes(runtime_layer_us=250.0, runtime_call_us=40.0)
    assert _predicts(ex) == ("moelab's executor on pcie4-x16 (its runtime overhead: 250 µs per MoE layer, 40 µs per "
                             "lane call)")


def test_a_refused_calibration_writes_no_profile_but_keeps_its_raw_measurements_aside(tmp_path, monkeypatch, capsys):
    import json

    from moelab.cli import main
    from moelab.simulate import calibrate as C

    def refused(cfg, **kw):
        err = B.OutOfBoundsError("calibration produced 1 value(s) outside physical bounds; nothing was written")
        err.raw = {"fits": {}, "out_of_bounds": ["link_bandwidth_gbs = 0.56"]}
        raise err

    monkeypatch.setattr(C, "calibrate", refused)
    out = tmp_path / "box.yaml"
    assert main(["calibrate", "--quick", "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "outside physical bounds; nothing was written" in err and "box.rejected.raw.json" in err
    assert not out.exists() and not (tmp_path / "box.raw.json").exists()
    assert json.loads((tmp_path / "box.rejected.raw.json").read_text())["out_of_bounds"] == ["link_bandwidth_gbs = 0.56"]
